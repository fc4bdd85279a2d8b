"""One budget for the whole step, measured: does ``memory_budget=N`` hold the step's peak?

    python -m benchmarks.step_budget --json docs/benchmarks/step_budget.json --docs

``--smoke`` runs the one-graph decoder at one budget under ``compiler="eager"`` instead, in
seconds: it checks that the script runs end to end.

For each model of :mod:`benchmarks.step_models` and each compiler (``eager``, ``inductor``),
plain ``torch.compile`` (fxckpt without a budget, which plans nothing) is measured first: the
absolute peak of a warm training step, ``P0``. Then fxckpt runs at ``memory_budget = N`` for
N = 0.7, 0.5 and 0.35 of ``P0``. Each figure is the meter's, never a plan's: a warm step (the
fifth: the steps before it may re-plan, and a step whose graphs cannot fit raises by then;
gradients set to None before it) under :func:`fxckpt.measure`, whose peak is the CPU
allocator's own events and whose start level is the storages of everything the step is given
(parameters, buffers, gradients, optimizer state, inputs). A budget no plan meets raises
``BudgetError``; the figure it names is written back and measured too. The loss and every
gradient of the first step are compared with eager's (with ``aot_eager``'s where dropout draws
masks).

Also measured:

- ``adamw``: the decoder with AdamW stepping between steps (its state appears after the first
  step), step 3 against N;
- ``sweep``: the decoder at 8 budgets from 0.3 to 1.0 of ``P0``: the measured peak must not rise
  as the budget falls;
- ``choice``: a decoder with d=256, 8 blocks and 4x512 tokens, at N = per-block
  checkpointing's measured step peak: fxckpt's step time against ``offload="all"``, per-block
  checkpointing and each ``segment_stride`` whose measured peak fits N, in one run, under an
  emulated host link sized to an H200 over PCIe Gen5 (``h200-pcie5``); every method is
  compiled and measured first, then timed one step at a time in 9 rounds, the order rotated
  each round, and each method's median step is compared; also fxckpt's step over the fastest
  one's in each round (paired: median, quartiles, range), each plan's predicted added time,
  and which methods run the same plan as fxckpt's (every saved tensor decided alike);
- ``compile``: planning's share of the compile time on a 24-block decoder under a budget that
  binds (:func:`benchmarks.planner_scaling.compile_share`).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import gc
import json
import sys
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from benchmarks.methods import Decoder, DecoderConfig, make_batch, median
from benchmarks.step_models import CASES, Case

FRACTIONS = (0.7, 0.5, 0.35)
SWEEP = (1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3)
CHOICE = DecoderConfig("choice", vocab=2048, d=256, heads=4, layers=8, ffn=1024)
DOCS = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"
START, END = "<!-- step-budget:start -->", "<!-- step-budget:end -->"


def _budget_error(err: BaseException) -> Any:
    import fxckpt

    cause: BaseException | None = err
    while cause is not None and not isinstance(cause, fxckpt.BudgetError):
        cause = getattr(cause, "inner_exception", None) or cause.__cause__ or cause.__context__
    return cause


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def run_case(name: str, compiler: str, options: dict[str, Any] | None, *, steps: int = 5,
             adamw: bool = False, reference: bool = False) -> dict[str, Any]:
    """One model under one backend: the meter's figures of the last of ``steps`` steps, and
    (``reference``) whether the first step's loss and gradients equal eager's."""
    import fxckpt

    torch._dynamo.reset()
    fxckpt.reset_stats()
    gc.collect()
    case: Case = CASES[name]()
    model = case.model
    eager = (case.reference or copy.deepcopy(model)) if reference else None
    backend = fxckpt.backend(compiler=compiler, **(options or {}))
    compiled = torch.compile(model, backend=backend)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3) if adamw else None
    if opt is not None:
        fxckpt.watch(opt)
    row: dict[str, Any] = {"case": name, "compiler": compiler, "options": options or {}}
    equal = None
    try:
        for k in range(steps - 1):
            model.zero_grad(set_to_none=True)
            torch.manual_seed(k)
            loss = case.step(compiled)
            loss.backward()
            if k == 0 and eager is not None:
                equal = _equal(case, eager, model, loss, compiler)
            if opt is not None:
                opt.step()
        model.zero_grad(set_to_none=True)
        gc.collect()
        holding = (model, case.given, opt.state if opt is not None else None)
        start = time.perf_counter()
        m = fxckpt.measure(lambda: case.step(compiled).backward(), holding=holding)
        row["step_s"] = time.perf_counter() - start
    except Exception as err:
        budget_error = _budget_error(err)
        if budget_error is None:
            raise
        row["budget_error"] = budget_error.smallest_bytes
        row["error"] = str(budget_error)[:400]
        return row
    plans = fxckpt.last_plans()
    row.update(start_bytes=m.start_bytes, absolute_peak_bytes=m.absolute_peak_bytes,
               predicted_bytes=max((p.step or {}).get("total_bytes", 0) for p in plans) or None,
               graphs=len({p.name.split("~")[0] for p in plans}), grads_equal=equal)  # fmt: skip
    return row


def _equal(case: Case, eager: torch.nn.Module, compiled_model: torch.nn.Module,
           loss: torch.Tensor, compiler: str = "eager") -> bool:
    """The compiled step's loss and gradients against eager's; under dropout, against plain
    ``aot_eager``'s, or plain Inductor's under Inductor (whose RNG draws other masks)."""
    torch.manual_seed(0)
    backend = "inductor" if compiler == "inductor" else "aot_eager"
    ref = torch.compile(eager, backend=backend) if _has_dropout(eager) else eager
    want = case.step(ref)
    want.backward()
    try:
        torch.testing.assert_close(loss.detach(), want.detach(), atol=1e-5, rtol=1e-4)
        got = {_plain(n): g for n, g in _grads(compiled_model).items()}
        exp = {_plain(n): g for n, g in _grads(eager).items()}
        assert got.keys() == exp.keys()
        for n in exp:
            torch.testing.assert_close(got[n], exp[n], atol=1e-5, rtol=1e-4)
    except AssertionError:
        return False
    return True


def _plain(name: str) -> str:
    """A parameter's name as the model had it before stream_weights parametrized it."""
    return name.replace("parametrizations.", "").replace(".original", "")


def _has_dropout(model: torch.nn.Module) -> bool:
    return any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules())


def matrix(names: Sequence[str], compilers: Sequence[str], fractions: Sequence[float],
           log: Any = print) -> list[dict[str, Any]]:
    """Each case at each budget, each compiler: the rows of the table."""
    rows = []
    for name in names:
        for compiler in compilers:
            if compiler == "eager" and CASES[name]().inductor_only:
                continue
            plain = run_case(name, compiler, None)
            p0 = plain["absolute_peak_bytes"]
            log(f"{name} {compiler}: plain {p0} bytes")
            for f in fractions:
                budget = int(f * p0)
                row = run_case(name, compiler, {"memory_budget": budget}, reference=True)
                row.update(fraction=f, budget_bytes=budget, plain_bytes=p0)
                if "budget_error" in row:
                    again = run_case(name, compiler, {"memory_budget": row["budget_error"]})
                    row["written_back"] = again
                    row["holds"] = again.get("absolute_peak_bytes", 1 << 62) <= row["budget_error"]
                else:
                    row["holds"] = row["absolute_peak_bytes"] <= budget
                log(f"  N={f} ({budget}): {_describe(row)}")
                rows.append(row)
    return rows


def _describe(row: dict[str, Any]) -> str:
    if "budget_error" in row:
        back = row.get("written_back", {})
        return (f"BudgetError names {row['budget_error']}; written back measures "
                f"{back.get('absolute_peak_bytes')} (holds: {row['holds']})")
    return (f"measured {row['absolute_peak_bytes']} = {row['absolute_peak_bytes'] / row['budget_bytes']:.3f} "
            f"of N (holds: {row['holds']}), grads equal: {row['grads_equal']}")


def adamw(compiler: str = "eager", fractions: Sequence[float] = FRACTIONS) -> list[dict[str, Any]]:
    plain = run_case("decoder", compiler, None, adamw=True)
    rows = []
    for f in fractions:
        budget = int(f * plain["absolute_peak_bytes"])
        row = run_case("decoder", compiler, {"memory_budget": budget, "on_infeasible": "warn"},
                       adamw=True, steps=3)
        row.update(fraction=f, budget_bytes=budget, plain_bytes=plain["absolute_peak_bytes"],
                   holds=row.get("absolute_peak_bytes", 0) <= budget)
        rows.append(row)
    return rows


def sweep(compiler: str = "eager") -> dict[str, Any]:
    plain = run_case("decoder", compiler, None)["absolute_peak_bytes"]
    points = []
    for f in SWEEP:
        row = run_case("decoder", compiler, {"memory_budget": int(f * plain), "on_infeasible": "warn"})
        points.append((f, row["absolute_peak_bytes"]))
    peaks = [p for _, p in points]
    return {"plain_bytes": plain, "points": points,
            "monotone": all(b <= a for a, b in zip(peaks, peaks[1:], strict=False))}


def choice(steps: int = 9, batch: int = 4, seq: int = 512) -> dict[str, Any]:
    """At per-block checkpointing's measured step peak: fxckpt's step time against each method
    that fits, all measured in this one process, under an emulated link at an H200's ratio."""
    from benchmarks.adapt import emulated_link

    # Copies at an H200's copy-to-compute ratio (the emulated link, sized to this machine's
    # forward): a RAM memcpy would hide every copy offload makes.
    handle, link = emulated_link(CHOICE, batch, seq, "h200-pcie5", None)
    try:
        return {**_choice(steps, batch, seq), "link": link}
    finally:
        handle.__exit__(None, None, None)


def _choice(steps: int, batch: int, seq: int) -> dict[str, Any]:
    """Each method warmed and measured, then timed one step at a time in ``steps`` rounds, the
    order rotated each round, so that the machine's load falls on all of them alike."""
    from torch.utils.checkpoint import checkpoint

    import fxckpt

    torch.manual_seed(0)
    base = Decoder(CHOICE)
    idx, tgt = make_batch(CHOICE, batch, seq, "cpu")

    def step(model: torch.nn.Module, fn: Any) -> float:
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        fn(idx, tgt).backward()
        return time.perf_counter() - start

    def measured(model: torch.nn.Module, fn: Any) -> dict[str, Any]:
        for _ in range(2):
            step(model, fn)
        model.zero_grad(set_to_none=True)
        gc.collect()
        m = fxckpt.measure(lambda: fn(idx, tgt).backward(), holding=(model, idx, tgt))
        return {"absolute_peak_bytes": m.absolute_peak_bytes}

    methods: dict[str, tuple[torch.nn.Module, Any]] = {}
    rows: dict[str, dict[str, Any]] = {}
    eager = copy.deepcopy(base)
    methods["eager"] = (eager, eager)
    ckpt = copy.deepcopy(base)
    for block in ckpt.layers:
        block.forward = _checkpointed(block.forward, checkpoint)
    methods["per_block_checkpointing"] = (ckpt, ckpt)
    for name in methods:
        rows[name] = measured(*methods[name])
    budget = rows["per_block_checkpointing"]["absolute_peak_bytes"]
    variants: dict[str, dict[str, Any]] = {
        "fxckpt": {"memory_budget": budget, "on_infeasible": "warn"},
        "offload_all": {"offload": "all"},
        **{f"stride_{s}": {"segment_stride": s} for s in (1, 2, 4)},
    }
    decisions: dict[str, list[tuple[str, str]]] = {}
    for name, opts in variants.items():
        model = copy.deepcopy(base)
        fxckpt.reset_stats()
        fn = torch.compile(model, backend=fxckpt.backend(compiler="eager", **opts))
        methods[name] = (model, fn)
        rows[name] = {**measured(model, fn), "options": dict(opts)}
        # The planner's own prediction of what the plan adds to the step (recompute, exposed
        # copies): where two methods predict the same, they run the same plan.
        plans = fxckpt.last_plans()
        rows[name]["predicted_added_ms"] = sum(p.est_overhead_ms for p in plans)
        decisions[name] = sorted((r.name, r.decision.kind) for p in plans for r in p.activations)
    times: dict[str, list[float]] = {name: [] for name in methods}
    names = list(methods)
    for r in range(steps):
        for name in names[r % len(names):] + names[:r % len(names)]:
            times[name].append(step(*methods[name]))
    for name, r in rows.items():
        r["step_s"] = median(times[name])
        r["fits"] = r["absolute_peak_bytes"] <= budget
    for r in rows.values():
        r["vs_eager"] = r["step_s"] / rows["eager"]["step_s"]
    fitting = {n: r for n, r in rows.items() if r["fits"] and n not in ("eager", "fxckpt")}
    fastest = min(fitting, key=lambda n: fitting[n]["step_s"]) if fitting else None
    # Paired: fxckpt's step against the fastest's in the same round (one after the other, on
    # the same load), so that the spread says how far apart two runs of one plan can read.
    paired = sorted(a / b for a, b in zip(times["fxckpt"], times[fastest], strict=True)) if fastest else []
    return {"model": CHOICE.describe(), "batch": batch, "seq": seq, "budget_bytes": budget,
            "rounds": steps, "rows": rows, "fastest_other": fastest,
            # Methods whose plan decides every saved tensor as fxckpt's does: the same plan,
            # so that their step times differ by the machine's noise alone.
            "same_plan_as_fxckpt": [n for n in decisions if n != "fxckpt" and decisions[n] == decisions["fxckpt"]],
            "fxckpt_vs_fastest": (rows["fxckpt"]["step_s"] / fitting[fastest]["step_s"]
                                  if fastest else None),
            "paired_vs_fastest": {"median": median(paired), "quartiles": _quartiles(paired),
                                  "min": min(paired), "max": max(paired)} if paired else None}  # fmt: skip


def _quartiles(xs: list[float]) -> tuple[float, float]:
    """The first and third quartiles of sorted ``xs`` (the medians of each half)."""
    half = len(xs) // 2
    return median(xs[:half] or xs), median(xs[len(xs) - half:] or xs)


def _checkpointed(forward: Any, checkpoint: Any) -> Any:
    def run(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return run


def table(doc: dict[str, Any]) -> str:
    lines = ["| model | compiler | N (of plain) | N bytes | measured peak | of N | holds | gradients |",
             "|---|---|---|---|---|---|---|---|"]
    for r in doc["matrix"]:
        if "budget_error" in r:
            back = r.get("written_back", {}).get("absolute_peak_bytes")
            measured = f"BudgetError: {r['budget_error']}; written back: {back}"
            ratio = "-"
        else:
            measured = str(r["absolute_peak_bytes"])
            ratio = f"{r['absolute_peak_bytes'] / r['budget_bytes']:.3f}"
        grads = {True: "equal", False: "differ", None: "-"}[r.get("grads_equal")]
        lines.append(f"| {r['case']} | {r['compiler']} | {r['fraction']} | {r['budget_bytes']} | "
                     f"{measured} | {ratio} | {'yes' if r['holds'] else 'NO'} | {grads} |")
    return "\n".join(lines)


def write_docs(doc: dict[str, Any], path: Path = DOCS) -> None:
    text = path.read_text()
    body = f"{START}\n{table(doc)}\n{END}"
    if START in text:
        head, rest = text.split(START, 1)
        text = head + body + rest.split(END, 1)[1]
    else:
        text += f"\n{body}\n"
    path.write_text(text)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.step_budget",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", metavar="PATH", help="write the figures here")
    parser.add_argument("--docs", action="store_true", help="update docs/benchmarks.md's table")
    parser.add_argument("--smoke", action="store_true", help="one tiny case, to check the script")
    parser.add_argument("--cases", default=",".join(CASES),
                        help='comma-separated case names ("": none, the other parts only)')
    parser.add_argument("--compilers", default="eager,inductor")
    parser.add_argument("--skip", default="", help="comma-separated parts to skip: "
                        "adamw,sweep,choice,compile")  # fmt: skip
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    started = time.perf_counter()
    doc: dict[str, Any] = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                           "torch": torch.__version__,
                           "command": "python -m benchmarks.step_budget " + " ".join(argv or sys.argv[1:])}
    if args.smoke:
        doc["matrix"] = matrix(["decoder"], ["eager"], (0.5,))
    else:
        skip = set(filter(None, args.skip.split(",")))
        cases = [c for c in args.cases.split(",") if c]  # --cases "": no matrix
        doc["matrix"] = matrix(cases, args.compilers.split(","), FRACTIONS)
        if "adamw" not in skip:
            doc["adamw"] = adamw()
            print("adamw:", [(r["fraction"], r.get("absolute_peak_bytes"), r["holds"]) for r in doc["adamw"]])
        if "sweep" not in skip:
            doc["sweep"] = sweep()
            print("sweep:", doc["sweep"])
        if "choice" not in skip:
            doc["choice"] = choice()
            print("choice:", {n: (round(r["vs_eager"], 3), r["fits"]) for n, r in doc["choice"]["rows"].items()},
                  "paired against the fastest that fits:", doc["choice"]["paired_vs_fastest"],
                  "the same plan as fxckpt's:", doc["choice"]["same_plan_as_fxckpt"])
        if "compile" not in skip:
            from benchmarks.planner_scaling import compile_share

            doc["compile"] = compile_share(seq=64, batch=2, repeats=3)
            print("compile:", {n: round(c["added_fraction"], 3) for n, c in doc["compile"]["configs"].items()})
    doc["wall_s"] = time.perf_counter() - started
    print(table(doc))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(doc, indent=1, default=str))
    if args.docs:
        write_docs(doc)
    failed = [r for r in doc["matrix"] if not r["holds"] or r.get("grads_equal") is False]
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
