"""Re-planning from measured copies (``adapt``) on the emulated host link, per step.

    python -m benchmarks.adapt --json docs/benchmarks/adapt.json [--docs] [--steps 15]

One decoder on the CPU, behind an emulated host link (``fxckpt.emulate_link``) sized so that
its copy-to-compute ratio per block is the ``--target`` GPU's (an H200 over PCIe5 by
default), with the planner's compute scaled to this machine's measured forward where fxckpt
supports it. Two cases, each compiled with a ``bandwidth`` option that is wrong about the
link:

- **too high**: ``bandwidth`` 4x the link's. The plan offloads more than the link can move
  while compute runs, so the first steps stall;
- **too low**: ``bandwidth`` a quarter of the link's. The plan recomputes what it could have
  offloaded. This case runs behind a link ``--low-speedup`` times the target's (2.5 by
  default: between PCIe5 and NVLink-C2C): at the target's own PCIe ratio this model's plan
  recomputes everything even at the link's real bandwidth, so that a quarter of it costs
  nothing and a re-plan could change nothing. Such a plan copies nothing for the copy meter
  to measure; under ``adapt="auto"`` one link probe between two steps measures the link.

Each case runs twice, ``adapt="auto"`` and ``adapt="never"``, from the same weights and
batches, at the same ``memory_budget``. The two rows take turns step by step (the order
alternates), so that both see the same load. Per step: the wall time of forward + backward,
the exposed copy stall (``fxckpt.stats()["graphs"][...]["exposed_copy_seconds"]``, the
copy meter's figure), the re-plans so far, and with ``--memory`` the forward's held bytes
measured by ``fxckpt.measure`` (the allocator's accounting, never the plan's; its profiler
lengthens the forward, so copies hide better with it). Every step's loss and gradients are
compared with an eager copy of the model.
"""

from __future__ import annotations

import argparse
import copy
import inspect
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from benchmarks.cpu_bench import machine_info
from benchmarks.methods import Decoder, DecoderConfig, grads_match, grads_of, make_batch

# d=256: recompute must cost enough, next to a CPU memcpy's own time (which a GPU's copy
# engines would not take from compute), for offload to save time in the too-low case.
MODEL = DecoderConfig("gpt-adapt", vocab=512, d=256, heads=4, layers=4, ffn=1024)
DOC = Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md"
BEGIN, END = "<!-- adapt:begin -->", "<!-- adapt:end -->"


@dataclass
class Row:
    case: str
    adapt: str
    bandwidth: float
    link: dict[str, Any]
    model: Decoder
    compiled: Any
    ref: Decoder
    graphs: set[str] = field(default_factory=set)
    steps: list[dict[str, Any]] = field(default_factory=list)
    grads_equal: bool = True
    first_mismatch: str = ""


def _stall(graphs: dict[str, Any], mine: set[str]) -> float:
    return sum(g["exposed_copy_seconds"] for n, g in graphs.items() if n.split("~")[0] in mine)


def _replans(graphs: dict[str, Any], mine: set[str]) -> int:
    return sum(1 for n in graphs if "~" in n and n.split("~")[0] in mine)


def _install(link: dict[str, Any]) -> None:
    """Emulate ``link`` from now on (between two steps: no copy is in flight)."""
    import fxckpt

    kwargs: dict[str, Any] = {"overhead_ms": link["overhead_ms"]}
    if link["compute_scale"] is not None:
        kwargs["compute_scale"] = link["compute_scale"]
    fxckpt.emulate_link(link["bandwidth"], **kwargs)


def step(row: Row, idx: torch.Tensor, tgt: torch.Tensor, memory: bool) -> None:
    import fxckpt

    _install(row.link)
    before = fxckpt.stats()["graphs"]
    known = set(before)
    row.model.zero_grad(set_to_none=True)
    start = time.perf_counter()
    if memory:
        m = fxckpt.measure(lambda: row.compiled(idx, tgt))
        loss, held = m.output, m.held_bytes
    else:
        loss, held = row.compiled(idx, tgt), None
    loss.backward()
    seconds = time.perf_counter() - start
    after = fxckpt.stats()["graphs"]
    if not row.graphs:  # the first call compiled: the new graphs are this row's
        row.graphs = {n.split("~")[0] for n in after if n not in known}
    row.ref.zero_grad(set_to_none=True)
    want = row.ref(idx, tgt)
    want.backward()
    ok, why = grads_match(grads_of(row.ref), grads_of(row.model))
    try:
        torch.testing.assert_close(loss.detach(), want.detach())
    except AssertionError as e:
        ok, why = False, f"loss: {str(e).splitlines()[0]}"
    if not ok and row.grads_equal:
        row.grads_equal, row.first_mismatch = False, why or "loss differs"
    row.steps.append({
        "step_s": seconds,
        "stall_s": _stall(after, row.graphs) - _stall(before, row.graphs),
        "replans": _replans(after, row.graphs),
        "held_bytes": held,
        "plans": sorted(n for n in after if n.split("~")[0] in row.graphs),
        "link_probes": sum(g.get("link_probes", 0) for n, g in after.items()
                           if n.split("~")[0] in row.graphs),
    })


def emulated_link(cfg: DecoderConfig, batch: int, seq: int, target: str, link: float | None
          ) -> tuple[Any, dict[str, Any]]:
    """The emulated link, and how it was sized."""
    import fxckpt

    params = inspect.signature(fxckpt.emulate_link).parameters
    if link is None and "forward_ms" in params:
        from benchmarks.gpu_shaped import LinkClock  # the same sizing as the GPU-shaped suite
        from fxckpt.targets import derive

        forward_ms = LinkClock(cfg, batch, seq).size()
        torch.manual_seed(0)
        d = derive(target, Decoder(cfg), make_batch(cfg, batch, seq, "cpu"), forward_ms=forward_ms)
        handle = fxckpt.emulate_link(d.bandwidth, overhead_ms=d.overhead_ms,
                                     compute_scale=d.compute_scale)
        return handle, {"target": target, "bandwidth": d.bandwidth, "overhead_ms": d.overhead_ms,
                        "compute_scale": d.compute_scale, "forward_ms_per_block": forward_ms,
                        "sized": d.describe()}
    rate = link or 50e6
    handle = fxckpt.emulate_link(rate)
    return handle, {"target": None, "bandwidth": rate, "overhead_ms": 0.0, "compute_scale": None,
                    "sized": "given (--link); the planner's compute is not scaled to this machine"}


def summarize(row: Row, first: int = 3, last: int = 3) -> dict[str, Any]:
    s = row.steps
    head = [x["stall_s"] for x in s[:first]]
    tail = [x["stall_s"] for x in s[-last:]]
    tail_steps = [x["step_s"] for x in s[-last:]]
    return {
        "case": row.case, "adapt": row.adapt, "bandwidth_option": row.bandwidth,
        "link_bandwidth": row.link["bandwidth"],
        "replans": s[-1]["replans"] if s else 0,
        "link_probes": s[-1].get("link_probes", 0) if s else 0,
        "replans_by_step_10": s[min(9, len(s) - 1)]["replans"] if s else 0,
        "first_steps_stall_s": sum(head) / max(1, len(head)),
        "last_steps_stall_s": sum(tail) / max(1, len(tail)),
        "last_steps_step_s": statistics.median(tail_steps) if tail_steps else None,
        "last_steps_stall_share": (sum(tail) / sum(tail_steps)) if tail_steps else None,
        "max_held_bytes": max((x["held_bytes"] for x in s if x["held_bytes"] is not None),
                              default=None),
        "grads_equal_eager": row.grads_equal, "first_mismatch": row.first_mismatch,
        "final_plans": s[-1]["plans"] if s else [],
    }


def _plan_figures(row: Row) -> dict[str, Any]:
    """What each of the row's plans decided (the first, then its re-plans), and the link
    probe's figure: read from the plans and stats, after the run."""
    import fxckpt

    plans = {p.name: p for p in fxckpt.last_plans()}
    graphs = fxckpt.stats()["graphs"]
    out = []
    for name in (row.steps[-1]["plans"] if row.steps else []):
        p = plans.get(name)
        if p is None:
            continue
        kinds = [a.decision.kind for a in p.activations]
        out.append({"name": name, "offloads": kinds.count("offload"),
                    "recomputes": kinds.count("recompute"), "offloaded_bytes": p.offloaded_bytes,
                    "recomputed_bytes": p.recomputed_bytes, "kept_bytes": p.kept_bytes,
                    "budget_bytes": p.budget_bytes,
                    "bandwidth": p.assumptions.get("bandwidth_bytes_per_s", {}).get("value")})
    probed = [g.get("probed_bandwidth_bytes_per_s") for n, g in graphs.items()
              if n.split("~")[0] in row.graphs and g.get("link_probes")]
    return {"plans": out, "probed_bandwidth": probed[0] if probed else None}


def _plan_line(r: dict[str, Any]) -> str:
    parts = [f"`{p['name']}` offloads {p['offloaded_bytes'] / 2**20:.2f} MiB and recomputes "
             f"{p['recomputed_bytes'] / 2**20:.2f} MiB{_budget(p.get('budget_bytes'))}"
             for p in r.get("plans", [])]
    probe = ("" if r.get("probed_bandwidth") is None
             else f" (link probe: {r['probed_bandwidth'] / 1e6:.4g} MB/s)")
    return f"- {r['case']}, {r['adapt']}: " + "; then ".join(parts) + probe


def paired(rows: list[Row]) -> list[dict[str, Any]]:
    """Per case: the median over the steps after ``auto``'s first re-plan of ``auto``'s step
    time over ``never``'s at the same step (the two took turns: the same load)."""
    out = []
    for case in dict.fromkeys(r.case for r in rows):
        auto = next(r for r in rows if r.case == case and r.adapt == "auto")
        never = next(r for r in rows if r.case == case and r.adapt == "never")
        first = next((i for i, x in enumerate(auto.steps) if x["replans"]), None)
        if first is None:
            out.append({"case": case, "from_step": None, "ratio": None, "pairs": 0})
            continue
        ratios = [a["step_s"] / b["step_s"] for a, b in
                  zip(auto.steps[first + 1:], never.steps[first + 1:], strict=True)]
        out.append({"case": case, "from_step": first + 1, "pairs": len(ratios),
                    "ratio": statistics.median(ratios) if ratios else None,
                    "min": min(ratios, default=None), "max": max(ratios, default=None)})
    return out


def _mib(n: int | None) -> str:
    return "not measured" if n is None else f"{n / 2**20:.2f} MiB"


def _budget(n: int | None) -> str:
    return "" if n is None else f" under a budget of {n / 2**20:.2f} MiB"


def markdown(doc: dict[str, Any]) -> str:
    link = doc["link"]
    lines = [
        f"`{doc['command']}` ({doc['machine']['date']}, {doc['machine']['cpu']}, "
        f"{doc['machine']['cores']} cores, load {doc['machine']['loadavg_start'][0]:.2f} at the "
        f"start and {doc['machine']['loadavg_end'][0]:.2f} at the end; {doc['model']}, batch "
        f"{doc['batch']}, seq {doc['seq']}, memory_budget {doc['budget']}).",
        "",
        f"Link: {link['bandwidth'] / 1e6:.4g} MB/s each way, {link['overhead_ms']:.3g} ms per "
        f"copy ({link['sized']}).",
        "",
        f"The *too low* case runs behind a link {doc['low_speedup']:g}x that: "
        f"{link['bandwidth'] * doc['low_speedup'] / 1e6:.4g} MB/s each way.",
        "",
        "| case | adapt | link | bandwidth option | re-plans | link probes | stall, first 3 "
        "steps | stall, last 3 steps | last 3: step | last 3: stall share | max held (measured) "
        "| grads = eager |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in doc["summary"]:
        lines.append(
            f"| {r['case']} | {r['adapt']} | {r['link_bandwidth'] / 1e6:.4g} MB/s | "
            f"{r['bandwidth_option'] / 1e6:.4g} MB/s | "
            f"{r['replans']} | {r['link_probes']} | {r['first_steps_stall_s'] * 1e3:.1f} ms | "
            f"{r['last_steps_stall_s'] * 1e3:.1f} ms | {r['last_steps_step_s'] * 1e3:.0f} ms | "
            f"{100 * r['last_steps_stall_share']:.1f} % | {_mib(r['max_held_bytes'])} | "
            f"{'yes' if r['grads_equal_eager'] else 'NO: ' + r['first_mismatch']} |")
    lines += ["", "After `auto`'s first re-plan, `auto`'s step time over `never`'s at the same "
              "step (paired; median, and the range):", ""]
    for p in doc.get("paired", []):
        if p["ratio"] is None:
            lines.append(f"- {p['case']}: no re-plan, or no step after it")
        else:
            lines.append(f"- {p['case']}: {p['ratio']:.3f} over steps {p['from_step']} to "
                         f"{doc['steps'] - 1} ({p['pairs']} pairs, {p['min']:.2f} to "
                         f"{p['max']:.2f})")
    lines += ["", "Plans (the first, then each re-plan):", ""]
    lines += [_plan_line(r) for r in doc["summary"]]
    lines += ["", "Per step (exposed stall ms / step ms, re-plans so far):", ""]
    header = "| step | " + " | ".join(f"{r['case']}, {r['adapt']}" for r in doc["summary"]) + " |"
    lines += [header, "|---" * (1 + len(doc["summary"])) + "|"]
    for i in range(doc["steps"]):
        cells = []
        for r in doc["rows"]:
            x = r["steps"][i]
            cells.append(f"{x['stall_s'] * 1e3:.1f} / {x['step_s'] * 1e3:.0f} ({x['replans']})")
        lines.append(f"| {i} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_doc(text: str, path: Path = DOC) -> None:
    doc = path.read_text()
    if BEGIN not in doc:
        raise SystemExit(f"{path} has no {BEGIN} ... {END} section")
    head, rest = doc.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    path.write_text(f"{head}{BEGIN}\n{text}\n{END}{tail}")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.adapt", description=__doc__.split("\n")[0])
    p.add_argument("--json", type=Path, help="write every figure here")
    p.add_argument("--docs", action="store_true", help="rewrite the section in docs/benchmarks.md")
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--budget", type=float, default=0.4, help="memory_budget (a fraction)")
    p.add_argument("--target", default="h200-pcie5")
    p.add_argument("--link", type=float, default=None,
                   help="bytes/s of the emulated link instead of a target's (no compute scaling)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--factor", type=float, default=4.0)
    p.add_argument("--low-speedup", type=float, default=2.5,
                   help="the too-low case's link, as a multiple of the target's (1: the same)")
    p.add_argument("--memory", action="store_true",
                   help="measure each forward with fxckpt.measure (its profiler slows the "
                        "forward, which then hides more of the copies)")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    import fxckpt

    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch._dynamo.config.recompile_limit = 64
    command = "python -m benchmarks.adapt " + " ".join(sys.argv[1:] if argv is None else argv)
    facts = machine_info(args.threads)
    print(f"{command}\n{facts['date']}, {facts['cpu']}, load {facts['loadavg_start'][0]:.2f}")
    cfg = MODEL
    handle, link = emulated_link(cfg, args.batch, args.seq, args.target, args.link)
    print("link:", link["sized"])
    torch.manual_seed(0)
    base = Decoder(cfg)
    batches = [make_batch(cfg, args.batch, args.seq, "cpu", seed=i) for i in range(args.steps)]
    fxckpt.reset_stats()
    rows: list[Row] = []
    low = {**link, "bandwidth": link["bandwidth"] * args.low_speedup}
    for case, factor, behind in (("too high", args.factor, link),
                                 ("too low", 1 / args.factor, low)):
        for mode in ("auto", "never"):
            model = copy.deepcopy(base)
            options = {"memory_budget": args.budget, "bandwidth": behind["bandwidth"] * factor,
                       "adapt": mode, "compiler": "eager"}
            compiled = torch.compile(model, backend=fxckpt.backend(**options))
            rows.append(Row(case, mode, options["bandwidth"], behind, model, compiled,
                            copy.deepcopy(base)))
    try:
        for i, (idx, tgt) in enumerate(batches):
            order = rows if i % 2 == 0 else rows[::-1]
            for row in order:
                step(row, idx, tgt, args.memory)
            print(f"step {i:2d} " + "  ".join(
                f"{r.case}/{r.adapt}: {r.steps[-1]['stall_s'] * 1e3:6.1f}/"
                f"{r.steps[-1]['step_s'] * 1e3:5.0f} ms ({r.steps[-1]['replans']})" for r in rows))
    finally:
        handle.__exit__(None, None, None)
    facts["loadavg_end"] = list(os.getloadavg())
    doc = {"command": command, "machine": facts, "model": cfg.describe(), "batch": args.batch,
           "seq": args.seq, "budget": args.budget, "steps": args.steps, "link": link,
           "low_speedup": args.low_speedup,
           "summary": [{**summarize(r), **_plan_figures(r)} for r in rows],
           "paired": paired(rows),
           "rows": [{"case": r.case, "adapt": r.adapt, "steps": r.steps} for r in rows]}
    text = markdown(doc)
    print()
    print(text)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=1) + "\n")
    if args.docs:
        write_doc(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
