"""Memory and step time of every method on a small GPT-style decoder, on the CPU.

    python -m benchmarks.cpu_bench --quick --json docs/benchmarks/cpu_quick.json

``--smoke`` runs one tiny case instead (a 2-block decoder, one sequence length, 2 rounds), in
seconds: it checks that the script runs end to end, and its figures mean nothing.

Each method is a row (``benchmarks/methods.py``): eager, full_checkpoint, save_on_cpu, compiled
(plain torch.compile), torch_offload, torch_budget and several fxckpt settings, one of them
with ``memory_budget`` set to full_checkpoint's measured absolute step peak. Per sequence
length every method runs a first (compiling) step, warm-up steps (at least
``BUDGET_WARMUP`` for an fxckpt row with a ``memory_budget``: its step account measures a
step and may compile again), then ``--repeats`` rounds in which the methods take turns in a
rotating order. Times are medians, with the min and max beside them. A row whose byte budget
no plan meets (fxckpt's ``BudgetError``, raised once the step is known) is unavailable, with
the error's first line.

What the columns measure:

- ``measured_resident_bytes``: what one forward leaves allocated on the compute device for
  its backward (the loss excluded), measured by fxckpt's meter (:class:`Meters`) in an
  untimed step: the allocator's figures, not a plan's. fxckpt's host pool and offload handles
  are host memory and not in it. ``hook_resident_saved_bytes`` is what a saved-tensors hook
  counts (:class:`benchmarks.methods.SavedCounter`), kept as a cross-check; fxckpt rows also
  carry their planned figures, ``planned_kept_bytes`` and ``planned_peak_bytes``.
- ``host_saved_bytes``: what the row keeps on the host instead (save_on_cpu's copies, torch's
  offloaded tensors, fxckpt's offloaded bytes from ``fxckpt.stats()``). On a CPU device that is
  the same memory: the split is the one a GPU would see.
- ``peak_bytes``: the meter's peak over one more untimed step (forward and backward), above
  what was allocated before it: gradients, temporaries and copies included.
  ``absolute_peak_bytes`` is the same step's absolute peak, what ``memory_budget`` bounds:
  ``start_bytes`` (what the device held when the step began: the parameters and buffers, the
  batch; every gradient dropped first) plus ``peak_bytes``. The rows whose figure becomes a
  budget (full_checkpoint, save_on_cpu) also carry ``budget_source_bytes``, the absolute step
  peak measured in the untimed step after their first, which the fxckpt rows at that
  baseline's memory were given as ``memory_budget``.
- ``step_time_ratio``: median step time (forward + backward) over eager's, in the same run.
- ``compile_time_ratio``: (first step - median step) over the same figure of ``compiled``.
- ``grads_match``: every parameter gradient of the first step passes
  ``torch.testing.assert_close`` (default tolerances) against eager's.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import json
import os
import platform
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from benchmarks.methods import (
    BASELINE_SPECS,
    BUDGET_SOURCES,
    GPT_QUICK,
    GPT_SMALL,
    GPT_SMOKE,
    Decoder,
    DecoderConfig,
    MethodSpec,
    Runner,
    SavedCounter,
    build_runner,
    default_fxckpt_specs,
    grads_match,
    grads_of,
    make_batch,
    median,
    start_of,
)

MiB = 2**20
# Untimed steps, after the first, of an fxckpt row with a memory_budget: its step account
# measures one whole step (a profiled one on the CPU), may compile graphs again at the step
# after it, and raises BudgetError there when no plan meets a budget in bytes. None of that
# belongs in a timed round.
BUDGET_WARMUP = 3


# --------------------------------------------------------------------------------------------
# Memory: fxckpt's meter, the same for every row.
# --------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _quiet_fd2() -> Iterator[None]:
    """Silence C-level stderr (kineto prints a line at every profiler start and stop)."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


class Meters:
    """fxckpt's meter (``fxckpt.Meter``) around one untimed forward, then one untimed step:
    the allocator's figures, never a plan's. CPU: torch's CPU allocator reports (profiler
    memory events, ops not recorded); CUDA: ``memory_allocated`` / ``max_memory_allocated``
    with the peak reset. fxckpt's host pool and offload handles are host memory, not counted.

    A step's ``start_bytes`` is what the device held when it began, its gradients dropped
    first: on the CPU the storages of the model (parameters, buffers) and the batch (the
    meter's ``holding``); on CUDA the allocator's figure, everything the process keeps there.
    ``absolute_peak_bytes`` (start plus peak) is the figure ``memory_budget`` bounds."""

    name = "fxckpt.Meter: the allocator's net and peak bytes over the call"

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def forward(self, runner: Runner, idx: torch.Tensor, tgt: torch.Tensor) -> Any:
        import fxckpt

        meter = fxckpt.Meter(self.device)
        with _quiet_fd2():
            runner.step(idx, tgt, meter=meter)
        return meter.result

    def step(self, runner: Runner, idx: torch.Tensor, tgt: torch.Tensor) -> Any:
        import fxckpt

        for p in runner.model.parameters():
            p.grad = None
        meter = fxckpt.Meter(self.device, holding=(runner.model, idx, tgt))
        with _quiet_fd2(), meter:
            runner.step(idx, tgt)
        return meter.result


# --------------------------------------------------------------------------------------------
# The harness, shared with gpu_check.py
# --------------------------------------------------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _frames_compiled() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _fxckpt_stats() -> dict[str, Any]:
    import fxckpt

    return fxckpt.stats()


def run_suite(
    cfg: DecoderConfig,
    *,
    batch: int,
    seq: int,
    specs: Sequence[MethodSpec],
    device: torch.device,
    dtype: torch.dtype = torch.float32,
    compiler: str = "eager",
    warmup: int = 1,
    repeats: int = 5,
    tolerances: dict[str, float] | None = None,
    log: Callable[[str], None] = print,
    probe: Callable[[Runner, torch.Tensor, torch.Tensor, dict[str, Any]], None] | None = None,
    before_step: Callable[[Runner, dict[str, Any]], None] | None = None,
    after: Callable[[dict[str, Runner], dict[str, dict[str, Any]], torch.Tensor, torch.Tensor],
                    None] | None = None,
) -> list[dict[str, Any]]:
    """Rows for every spec at one sequence length; ``specs[0]`` must be eager.

    ``probe(runner, idx, targets, row)``, if given, runs once per method after the timed
    rounds and may add fields to the row (gpu_check's memory probes). ``before_step(runner,
    row)`` runs before each timed step, untimed (gpu_shaped's link calibration);
    ``after(runners, rows, idx, targets)`` once everything else is measured (gpu_shaped's
    back-to-back pairs).
    """
    import fxckpt

    if specs[0].kind != "eager":
        raise ValueError("the first spec must be eager: it is the baseline of every ratio")
    torch._dynamo.reset()
    fxckpt.reset_stats()
    torch.manual_seed(0)
    base = Decoder(cfg).to(device=device, dtype=dtype)
    idx, tgt = make_batch(cfg, batch, seq, device)
    meters = Meters(device)
    runners: list[Runner] = []
    rows: dict[str, dict[str, Any]] = {}
    ref_grads: dict[str, torch.Tensor] = {}
    # memory_budget placeholder -> a baseline's measured absolute step peak (and, under
    # methods.start_of, what its step started with).
    budgets: dict[str, int] = {}
    # Every method's copy of the model exists from the start, and for the whole run: on CUDA a
    # step's start level (and so an absolute peak, and a byte budget) is everything allocated,
    # so a baseline's figure and the rows given it as a budget count the same copies.
    models = [copy.deepcopy(base) for _ in specs]

    # 1. First step of each method: compile, saved bytes, gradients against eager.
    for spec, model in zip(specs, models, strict=True):
        try:
            runner = build_runner(spec, model, device, compiler, budgets=budgets)
        except ValueError as e:  # its baseline did not run
            log(f"  {spec.name}: unavailable: {e}")
            rows[spec.name] = {**_row(spec, Runner(spec, model, model, "-"), seq, batch),
                               "unavailable": f"ValueError: {e}"}
            continue
        counter = SavedCounter(model.parameters(), device)
        fxckpt.reset_stats()
        _sync(device)
        start = time.perf_counter()
        try:
            with _quiet_fd2():
                loss, resident, host = runner.step(idx, tgt, counter)
        except Exception as e:  # a method that cannot run here is a row that says why
            log(f"  {spec.name}: unavailable: {type(e).__name__}: {str(e).splitlines()[0]}")
            rows[spec.name] = _row(spec, runner, seq, batch, unavailable=f"{type(e).__name__}: "
                                   f"{str(e).splitlines()[0][:300]}")  # fmt: skip
            continue
        _sync(device)
        first_s = time.perf_counter() - start
        grads = grads_of(model)
        if spec.kind == "eager":
            ref_grads, ok, why = grads, True, ""
        else:
            ok, why = grads_match(ref_grads, grads, **(tolerances or {}))
        del grads  # only eager's stay, for the whole run (a constant part of the start level)
        for p in model.parameters():
            p.grad = None
        row = _row(spec, runner, seq, batch)
        row.update(first_step_s=first_s, loss=loss, hook_resident_saved_bytes=resident,
                   host_saved_bytes=host, grads_match=ok, grads_note=why)  # fmt: skip
        if spec.kind == "fxckpt":
            st, plans = _fxckpt_stats(), fxckpt.last_plans()
            row["planned_kept_bytes"] = int(st["planned_kept_bytes"])
            row["host_saved_bytes"] = (host or 0) + int(st["offloaded_bytes"])
            row["planned_peak_bytes"] = sum(p.resident_peak_bytes or 0 for p in plans)
            row["plan_decisions"] = _decisions(plans)
            row["plan_budget_bytes"] = [p.budget_bytes for p in plans]
            row["plan_est_overhead_ms"] = sum(p.est_overhead_ms for p in plans)
        if spec.kind in BUDGET_SOURCES:
            # Its absolute step peak (an untimed step after the first): the memory_budget of
            # the fxckpt rows at this method's memory.
            measured = meters.step(runner, idx, tgt)
            placeholder = BUDGET_SOURCES[spec.kind]
            budgets[placeholder] = row["budget_source_bytes"] = measured.absolute_peak_bytes
            budgets[start_of(placeholder)] = measured.start_bytes
            for p in model.parameters():
                p.grad = None
        rows[spec.name] = row
        runners.append(runner)
        log(f"  {spec.name:<22} first step {first_s:6.1f} s, saved (hook) "
            f"{(resident or 0) / MiB:8.2f} MiB, grads_match={ok} {why[:100]}")  # fmt: skip

    def infeasible(runner: Runner, e: Exception) -> None:
        """A byte budget no plan meets: fxckpt says so once the step is known (its third
        step, usually). The row says why, with the smallest budget the step runs under, and
        leaves the rounds."""
        why = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
        log(f"  {runner.name}: unavailable: {why}")
        rows[runner.name]["unavailable"] = why
        runners.remove(runner)
        for p in runner.model.parameters():
            p.grad = None

    # 2. Warm-up, then interleaved rounds in a rotating order.
    for runner in list(runners):
        steps = warmup
        if runner.spec.kind == "fxckpt" and runner.options.get("memory_budget") is not None:
            steps = max(warmup, BUDGET_WARMUP)
        try:
            for _ in range(steps):
                runner.step(idx, tgt)
        except fxckpt.BudgetError as e:
            infeasible(runner, e)
    for runner in runners:
        rows[runner.name].update(step_s=[], cpu_s=[], stall_s=[], offloaded=[], copy_s=[])
    frames = _frames_compiled()
    for r in range(repeats):
        order = runners[r % len(runners):] + runners[: r % len(runners)]
        for runner in order:
            row = rows[runner.name]
            if before_step is not None:
                before_step(runner, row)
            fxckpt.reset_stats()
            _sync(device)
            start, cpu_start = time.perf_counter(), time.process_time()
            try:
                runner.step(idx, tgt)
            except fxckpt.BudgetError as e:
                infeasible(runner, e)
                continue
            _sync(device)
            row["step_s"].append(time.perf_counter() - start)
            row["cpu_s"].append(time.process_time() - cpu_start)
            for p in runner.model.parameters():
                p.grad = None
            if runner.spec.kind == "fxckpt":
                st = _fxckpt_stats()
                row["stall_s"].append(float(st["stall_seconds"]))
                row["offloaded"].append(int(st["offloaded_bytes"]))
                row["copy_s"].append(float(st["copy_seconds"]))
    recompiled = _frames_compiled() - frames
    for runner in runners:  # memory: two more steps each, not timed (the meter slows them)
        fwd = meters.forward(runner, idx, tgt)
        rows[runner.name]["measured_resident_bytes"] = fwd.held_bytes
        rows[runner.name]["forward_peak_bytes"] = fwd.peak_bytes
        step = meters.step(runner, idx, tgt)
        rows[runner.name].update(peak_bytes=step.peak_bytes, start_bytes=step.start_bytes,
                                 absolute_peak_bytes=step.absolute_peak_bytes)
        for p in runner.model.parameters():
            p.grad = None
        if probe is not None:
            probe(runner, idx, tgt, rows[runner.name])
            for p in runner.model.parameters():
                p.grad = None
    if after is not None:
        after({r.name: r for r in runners}, rows, idx, tgt)

    # 3. Ratios against eager and compiled of the same run.
    eager = rows[specs[0].name]
    compiled = rows.get("compiled")
    for row in rows.values():
        if row.get("unavailable"):
            continue
        ts = row["step_s"]
        row["step_ms"] = 1e3 * median(ts)
        row["step_ms_min"], row["step_ms_max"] = 1e3 * min(ts), 1e3 * max(ts)
        row["step_time_ratio"] = median(ts) / median(eager["step_s"])
        # CPU seconds of all the process's threads: less sensitive than wall time to other
        # processes on the machine, and it shows work that copy threads overlap.
        row["cpu_ms"] = 1e3 * median(row["cpu_s"])
        row["cpu_time_ratio"] = median(row["cpu_s"]) / median(eager["cpu_s"])
        paired = [a / b for a, b in zip(ts, eager["step_s"], strict=True)]
        row["step_ratios"] = paired
        row["step_ratio_min"], row["step_ratio_max"] = min(paired), max(paired)
        row["compile_s"] = max(0.0, row["first_step_s"] - median(ts)) if row["compiled"] else 0.0
        if row["stall_s"]:
            row["stall_s_per_step"] = median(row["stall_s"])
            row["offloaded_bytes_per_step"] = int(median([float(x) for x in row["offloaded"]]))
            row["copy_s_per_step"] = median(row["copy_s"])
            # Per round, step and stall together: exposed copy time over that round's step.
            row["stall_shares"] = [a / b for a, b in zip(row["stall_s"], ts, strict=True)]
        row["recompiles_while_timed"] = recompiled
    ref = compiled["compile_s"] if compiled and not compiled.get("unavailable") else None
    for row in rows.values():
        if row.get("unavailable") or not row["compiled"] or not ref:
            row["compile_time_ratio"] = None
        else:
            row["compile_time_ratio"] = row["compile_s"] / ref
    for row in rows.values():
        for key in ("stall_s", "offloaded", "copy_s"):
            row.pop(key, None)
    row_list = [rows[s.name] for s in specs if s.name in rows]
    for row in row_list:
        row["meter"] = meters.name
    return row_list


def warm_compilers(device: torch.device, compiler: str = "eager") -> float:
    """Compile a tiny decoder once with each backend, so that one-time costs (imports, the
    first dynamo trace, fxckpt's bandwidth probe) do not land on whichever row compiles
    first. Returns the seconds it took."""
    from benchmarks.methods import fresh_backend

    start = time.perf_counter()
    tiny = DecoderConfig("warm-up", vocab=64, d=32, heads=2, layers=2, ffn=64)
    idx, tgt = make_batch(tiny, 1, 16, device)
    for backend, options in ((fresh_backend("aot_eager" if compiler == "eager" else "inductor"),
                              None),
                             ("fxckpt", {"compiler": compiler, "memory_budget": 0.5})):
        model = Decoder(tiny).to(device)
        torch.compile(model, backend=backend, options=options, dynamic=False)(idx, tgt).backward()
    torch._dynamo.reset()
    return time.perf_counter() - start


def _row(spec: MethodSpec, runner: Runner, seq: int, batch: int,
         unavailable: str | None = None) -> dict[str, Any]:
    return {
        "method": spec.name,
        "description": spec.description,
        "seq": seq,
        "batch": batch,
        "compiler": runner.compiler,
        "compiled": runner.compiled,
        "options": {k: v for k, v in runner.options.items() if k != "compiler"},
        "unavailable": unavailable,
    }


def _decisions(plans: list[Any]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for plan in plans:
        for row in plan.activations:
            counts[row.decision.kind] = counts.get(row.decision.kind, 0) + 1
    return counts


# --------------------------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------------------------


def _mib(n: int | None) -> str:
    return "-" if n is None or n < 0 else f"{n / MiB:.1f}"


def markdown_table(rows: Sequence[dict[str, Any]]) -> str:
    head = ("| seq | method | compiler | resident after fwd MiB | host MiB | peak MiB | "
            "step ms (min-max) | step vs eager (min-max) | CPU time vs eager | "
            "compile vs compiled | grads |")
    lines = [head, "|" + "---|" * 11]
    for r in rows:
        if r.get("unavailable"):
            lines.append(f"| {r['seq']} | {r['method']} | {r['compiler']} | unavailable: "
                         f"{r['unavailable']} | | | | | | | |")  # fmt: skip
            continue
        ctr = r.get("compile_time_ratio")
        lines.append(
            f"| {r['seq']} | {r['method']} | {r['compiler']} | {_mib(r['measured_resident_bytes'])} "
            f"| {_mib(r['host_saved_bytes'])} | {_mib(r['peak_bytes'])} "
            f"| {r['step_ms']:.0f} ({r['step_ms_min']:.0f}-{r['step_ms_max']:.0f}) "
            f"| {r['step_time_ratio']:.2f}x ({r['step_ratio_min']:.2f}-{r['step_ratio_max']:.2f}) "
            f"| {r['cpu_time_ratio']:.2f}x | {'-' if ctr is None else f'{ctr:.2f}x'} "
            f"| {'ok' if r['grads_match'] else 'DIFF'} |"
        )
    return "\n".join(lines)


def machine_info(threads: int) -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "loadavg_start": list(os.getloadavg()),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch_threads": threads,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    try:
        import fxckpt

        info["fxckpt"] = fxckpt.__version__
    except ImportError:  # pragma: no cover
        pass
    return info


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.cpu_bench",
        description="Saved-activation memory and step time per method on the CPU "
        "(see docs/benchmarks.md).",
    )
    p.add_argument("--quick", action="store_true",
                   help="the small configuration: under 5 minutes on 2 cores")
    p.add_argument("--smoke", action="store_true",
                   help="one tiny case to check that the script runs: a 2-block d=32 decoder, "
                   "seq 32, batch 1, 2 rounds (seconds; its figures mean nothing)")
    p.add_argument("--json", metavar="PATH", help="write the rows and the run's facts here")
    p.add_argument("--seqs", type=int, nargs="+", help="sequence lengths (default by mode)")
    p.add_argument("--batch", type=int, help="batch size (default by mode)")
    p.add_argument("--repeats", type=int, help="timed rounds (default by mode)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per method")
    p.add_argument("--threads", type=int, default=1,
                   help="torch.set_num_threads; the default 1 leaves the second core to "
                   "fxckpt's copy threads (the same setting for every row)")
    p.add_argument("--compiler", choices=("eager", "inductor"), default="eager",
                   help="code generation for the compiled rows (torch_offload is always "
                   "aot_eager); inductor compiles take tens of seconds each here")
    p.add_argument("--min-offload-bytes", default="64KiB",
                   help="fxckpt's min_offload_bytes in every fxckpt row")
    p.add_argument("--methods", nargs="+", help="only these rows (eager is always run)")
    p.add_argument("--docs", action="store_true",
                   help="also regenerate docs/benchmarks.md's CPU table and plot from this run")
    args = p.parse_args(argv)
    if args.smoke and args.docs:
        p.error("--smoke's figures mean nothing: not for --docs")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    cfg = GPT_SMOKE if args.smoke else GPT_QUICK if args.quick else GPT_SMALL
    seqs = args.seqs or ([32] if args.smoke else [256, 512] if args.quick else [256, 512, 1024])
    batch = args.batch or (1 if args.smoke else 2 if args.quick else 4)
    repeats = args.repeats or (2 if args.smoke else 5)
    torch.set_num_threads(args.threads)
    # Every method and sequence length compiles the same forward again; keep dynamo from
    # falling back to eager after its default 8 recompiles.
    torch._dynamo.config.recompile_limit = 1024
    torch._dynamo.config.accumulated_recompile_limit = 1 << 16
    specs = list(BASELINE_SPECS) + list(default_fxckpt_specs(args.min_offload_bytes))
    if args.methods:
        unknown = sorted(set(args.methods) - {s.name for s in specs})
        if unknown:
            raise SystemExit(f"--methods {' '.join(unknown)}: not a method here; choose from "
                             f"{', '.join(sorted(s.name for s in specs))}")
        keep = set(args.methods) | {"eager"}
        if any(s.name == "fxckpt_at_full_ckpt" for s in specs if s.name in keep):
            keep.add("full_checkpoint")
        specs = [s for s in specs if s.name in keep]
    if args.docs and not args.json:
        args.json = f"docs/benchmarks/cpu_{'quick' if args.quick else 'full'}.json"
    command = "python -m benchmarks.cpu_bench " + " ".join(sys.argv[1:] if argv is None else argv)
    facts = machine_info(args.threads)
    print(f"{command}\n{facts['date']}, {facts['cpu']}, {facts['cores']} cores, torch "
          f"{facts['torch']}, torch threads {args.threads}\n{cfg.describe()}, batch {batch}")
    rows: list[dict[str, Any]] = []
    started = time.perf_counter()
    facts["compiler_warmup_s"] = round(warm_compilers(torch.device("cpu"), args.compiler), 1)
    for seq in seqs:
        print(f"seq {seq}:")
        rows += run_suite(cfg, batch=batch, seq=seq, specs=specs, device=torch.device("cpu"),
                          compiler=args.compiler, warmup=args.warmup, repeats=repeats)
    facts["wall_s"] = round(time.perf_counter() - started, 1)
    facts["loadavg_end"] = list(os.getloadavg())
    print()
    print(markdown_table(rows))
    print(f"\nmemory: {rows[0]['meter']}; wall {facts['wall_s']} s; load average "
          f"{facts['loadavg_start'][0]:.1f} at the start, {facts['loadavg_end'][0]:.1f} at the end")
    doc = {"command": command, "machine": facts, "model": cfg.__dict__, "batch": batch,
           "seqs": seqs, "repeats": repeats, "warmup": args.warmup, "compiler": args.compiler,
           "rows": rows}  # fmt: skip
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(doc, indent=1, default=str) + "\n")
        print(f"wrote {args.json}")
    if args.docs:
        from benchmarks import plot

        return plot.main([args.json])
    return 0


if __name__ == "__main__":
    sys.exit(main())
