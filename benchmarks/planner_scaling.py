"""How planning time grows with the graph, and how far the greedy is from the MILP.

    python -m benchmarks.planner_scaling --json docs/benchmarks/planner_scaling.json

``--smoke`` runs one tiny case of each part instead (part 3 left out), in seconds: it checks
that the script runs end to end, and its figures mean nothing.

1. Real graphs: the GPT-style decoder with 6 to 48 layers is planned offline (``fxckpt.inspect``,
   meta tensors, ``memory_budget=0.3``). The partitioner's own step timings (its
   stages' events, ``fxckpt.passes.pipeline.listening``) give the time of each step; the solver's input, a
   :class:`fxckpt.planning.memory.Problem`, is captured on its way into the solver.
2. Greedy against MILP: every captured problem, and small synthetic ones, solved with
   ``fxckpt.planning.solve.solve(problem, budget, method="greedy" | "milp")`` at budgets that
   go from the lowest reachable peak to the all-keep peak. The gap is the greedy's simulated added ms
   over the MILP's, where the MILP finished (``method_used == "milp"``).
3. Compile time: a 24-layer decoder compiled on real CPU tensors with plain
   ``torch.compile(backend="aot_eager")`` and with ``backend="fxckpt"`` (``compiler="eager"``)
   under a budget, a segment stride, and both; the share of aot_eager's compile time that
   fxckpt adds.
4. The greedy on a synthetic 10k-candidate, 20k-position problem.

The solver's input is captured by wrapping ``fxckpt.planning.plan_round.choose`` for the length
of a run; nothing in fxckpt is changed.
"""

from __future__ import annotations

import argparse
import builtins
import contextlib
import json
import math
import random
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from benchmarks.methods import Decoder, DecoderConfig, fresh_backend, make_batch, median

SCALING_MODEL = DecoderConfig("gpt-scaling", vocab=2048, d=256, heads=4, layers=6, ffn=1024)
COMPILE_MODEL = DecoderConfig("gpt-compile", vocab=512, d=128, heads=4, layers=24, ffn=512)


@dataclass
class Capture:
    """What one compile's partitioner did: its step timings and the problems it solved."""

    steps: list[tuple[str, float]] = field(default_factory=list)  # (step name, ms)
    problems: list[tuple[Any, int | None, str, float]] = field(default_factory=list)

    def step_ms(self, prefix: str) -> float:
        return sum(ms for name, ms in self.steps if name.startswith(prefix))

    @property
    def total_ms(self) -> float:
        return sum(ms for _, ms in self.steps)


@contextlib.contextmanager
def capturing() -> Iterator[Capture]:
    """Record the partitioner's step timings and the solver's problems while inside."""
    import fxckpt.planning.plan_round as plan_round
    from fxckpt.passes.pipeline import StageDone, listening

    cap = Capture()
    old_choose = plan_round.choose

    def heard(done: StageDone) -> None:
        cap.steps.append((done.name, done.seconds * 1e3))

    def choose(problem: Any, blocks: Any, budget: int | None, prefetch: str, low: Any = None) -> Any:
        start = time.perf_counter()
        pick = old_choose(problem, blocks, budget, prefetch, low)
        cap.problems.append((problem, budget, prefetch, time.perf_counter() - start))
        return pick

    plan_round.choose = choose
    try:
        with listening(heard):
            yield cap
    finally:
        plan_round.choose = old_choose


# --------------------------------------------------------------------------------------------
# 1. Planning time on real graphs
# --------------------------------------------------------------------------------------------


def plan_real(layers: int, seq: int, batch: int, budget: float) -> tuple[dict[str, Any], Capture]:
    import fxckpt

    cfg = replace(SCALING_MODEL, layers=layers)
    with torch.device("meta"):
        model = Decoder(cfg)
    idx = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    with capturing() as cap:
        start = time.perf_counter()
        plans = fxckpt.inspect(model, (idx, idx), memory_budget=budget, min_offload_bytes=0)
        wall = time.perf_counter() - start
    first = cap.problems[0][0] if cap.problems else None
    row = {
        "layers": layers,
        "inspect_s": wall,
        "partition_ms": cap.total_ms,
        "min_cut_ms": cap.step_ms("baseline min-cut") + cap.step_ms("min-cut"),
        "plan_ms": cap.step_ms("plan round"),
        "solver_ms": 1e3 * sum(p[3] for p in cap.problems),
        "solver_calls": len(cap.problems),
        "candidates": len(first) if first is not None else 0,
        "positions": first.timeline.num_positions if first is not None else 0,
        "steps": _sum_steps(cap),
        "plan_resident_peak_bytes": sum(p.resident_peak_bytes for p in plans),
        "plan_budget_bytes": sum(p.budget_bytes or 0 for p in plans),
    }
    return row, cap


def _sum_steps(cap: Capture) -> dict[str, float]:
    out: dict[str, float] = {}
    for name, ms in cap.steps:
        out[name] = out.get(name, 0.0) + ms
    return out


# --------------------------------------------------------------------------------------------
# 2. Greedy against MILP
# --------------------------------------------------------------------------------------------


def keep_peak(problem: Any) -> int:
    from fxckpt.planning.memory import simulate

    return simulate(problem, ["keep"] * len(problem)).peak


def budget_at(problem: Any, fraction: float) -> int:
    """``fraction`` of the way from the lowest reachable peak to the all-keep peak.

    The lowest reachable peak: every candidate at its smallest-residency choice (recompute,
    else offload, else keep), as the solver's infeasible answer starts from.
    """
    from fxckpt.planning.memory import simulate

    c = problem.candidates
    low = simulate(problem, [c.lowest(i) for i in range(len(problem))]).peak
    return int(low + fraction * (keep_peak(problem) - low))


def compare(problem: Any, fractions: Sequence[float], label: str) -> list[dict[str, Any]]:
    from fxckpt.planning.solve import solve

    rows = []
    for f in fractions:
        budget = budget_at(problem, f)
        t0 = time.perf_counter()
        g = solve(problem, budget, method="greedy")
        t1 = time.perf_counter()
        m = solve(problem, budget, method="milp")
        t2 = time.perf_counter()
        finished = m.method_used == "milp"
        gap = gap_ms = None
        if finished and g.feasible and m.feasible:
            gap_ms = g.cost_ms - m.cost_ms
            # Below a microsecond both are the offload price alone (1e-12 ms per byte).
            gap = gap_ms / m.cost_ms if m.cost_ms > 1e-3 else None
        rows.append({
            "problem": label, "candidates": len(problem),
            "positions": problem.timeline.num_positions, "budget_fraction": f,
            "budget_bytes": budget, "greedy_peak": g.peak, "milp_peak": m.peak,
            "greedy_ms": 1e3 * (t1 - t0), "greedy_cost_ms": g.cost_ms,
            "greedy_feasible": g.feasible, "milp_ms": 1e3 * (t2 - t1),
            "milp_finished": finished, "milp_cost_ms": m.cost_ms if finished else None,
            "milp_feasible": m.feasible if finished else None, "gap": gap, "gap_ms": gap_ms,
        })  # fmt: skip
    return rows


def synthetic(n: int, T: int, seed: int = 0, bandwidth: float = 2.5e6) -> Any:
    """A transformer-shaped step: activations saved in order and used back in reverse."""
    from fxckpt.planning.memory import Candidates, Problem, Timeline

    rng, F = random.Random(seed), T // 2
    cols: list[list[Any]] = [[] for _ in range(7)]
    for i in range(n):
        p = i * F // n
        fb = max(F, T - 1 - p - rng.randint(0, 3))
        row = (rng.choice([1, 2, 4, 8, 16]) * 2**20, p, min(F - 1, p + rng.randint(0, 3)), fb,
               min(T - 1, fb + rng.randint(0, 3)),
               math.inf if rng.random() < 0.1 else rng.uniform(0.01, 1.0), rng.random() < 0.8)
        for col, v in zip(cols, row, strict=True):
            col.append(v)
    step = [rng.uniform(0.01, 0.5) for _ in range(T)]
    return Problem(Timeline(step, F, bandwidth, [2**30] * T), Candidates(*cols))


# --------------------------------------------------------------------------------------------
# 3. Compile-time share on real tensors
# --------------------------------------------------------------------------------------------


COMPILE_CONFIGS: dict[str, dict[str, Any]] = {
    "budget 0.5": {"memory_budget": 0.5},
    "budget 0.9": {"memory_budget": 0.9},
    "stride 2": {"segment_stride": 2},
    "stride 2, budget 0.3": {"segment_stride": 2, "memory_budget": 0.3},
}


def compile_share(seq: int, batch: int, steps: int = 3, repeats: int = 5) -> dict[str, Any]:
    """Compile time of plain aot_eager and of fxckpt under each of :data:`COMPILE_CONFIGS`.

    Each compile is timed ``repeats`` times, the backends interleaved so that load on the
    machine falls on all of them alike; medians are reported. Two figures per compile:

    - ``compile_s``: its first step less the median of the ``steps`` steps after it; this
      includes dynamo's bytecode tracing, the same work for every backend, which varied by
      ±0.3 s from run to run on this machine;
    - ``backend_s``: dynamo's own timer of the backend call
      (``compilation_time_metrics["OutputGraph.call_user_compiler"]``): AOTAutograd's trace,
      the partitioner and the compiler, which is where backends differ.
    """
    import copy

    import fxckpt

    cfg = COMPILE_MODEL
    torch.manual_seed(0)
    base = Decoder(cfg)
    idx, tgt = make_batch(cfg, batch, seq, "cpu")
    runs: dict[str, list[dict[str, Any]]] = {}
    backends: list[tuple[str, dict[str, Any] | None]] = [
        ("aot_eager", None),
        *((name, {"compiler": "eager", "min_offload_bytes": 0, **opts})
          for name, opts in COMPILE_CONFIGS.items()),
    ]
    for _ in range(repeats):
        for name, options in backends:
            torch._dynamo.reset()
            fxckpt.reset_stats()
            metrics = torch._dynamo.utils.compilation_time_metrics
            metrics.clear()
            model = copy.deepcopy(base)
            backend = "fxckpt" if options is not None else fresh_backend("aot_eager")
            fn = torch.compile(model, backend=backend, options=options, dynamic=False)
            with capturing() as cap:
                start = time.perf_counter()
                fn(idx, tgt).backward()
                first = time.perf_counter() - start
            times = []
            for _ in range(steps):
                start = time.perf_counter()
                fn(idx, tgt).backward()
                times.append(time.perf_counter() - start)
            run = {"first_step_s": first, "step_s": median(times),
                   "compile_s": first - median(times),
                   "backend_s": sum(metrics.get("OutputGraph.call_user_compiler", [0.0]))}  # fmt: skip
            if options is not None:
                run.update(partition_ms=cap.total_ms, steps=_sum_steps(cap),
                           plan_ms=cap.step_ms("plan round"))  # fmt: skip
            runs.setdefault(name, []).append(run)
    plain = median([r["compile_s"] for r in runs["aot_eager"]])
    plain_backend = median([r["backend_s"] for r in runs["aot_eager"]])
    out: dict[str, Any] = {"model": cfg.describe(), "seq": seq, "batch": batch,
                           "repeats": repeats, "aot_eager_compile_s": plain,
                           "aot_eager_backend_s": plain_backend, "configs": {},
                           "runs": runs}  # fmt: skip
    for name, opts in COMPILE_CONFIGS.items():
        rs = runs[name]
        compile_s = median([r["compile_s"] for r in rs])
        backend_s = median([r["backend_s"] for r in rs])
        out["configs"][name] = {
            "options": opts,
            "compile_s": compile_s,
            "added_fraction": (compile_s - plain) / plain,
            "backend_s": backend_s,
            "backend_added_fraction": (backend_s - plain_backend) / plain_backend,
            "partition_s": median([r["partition_ms"] for r in rs]) / 1e3,
            "plan_s": median([r["plan_ms"] for r in rs]) / 1e3,
        }
    torch._dynamo.reset()
    return out


# --------------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.planner_scaling",
                                description="Planning time against graph size; greedy vs MILP.")
    p.add_argument("--smoke", action="store_true",
                   help="one tiny case to check that the script runs: a 2-layer graph at batch 1 "
                   "x seq 32, one budget fraction (0.5), one synthetic size (50), a 200-candidate "
                   "greedy, no compile-time share (seconds; the figures mean nothing)")
    p.add_argument("--layers", type=int, nargs="+", help="default 6 12 24 48")
    p.add_argument("--seq", type=int, help="default 512")
    p.add_argument("--batch", type=int, help="default 4")
    p.add_argument("--budget", type=float, default=0.3,
                   help="memory_budget fraction for the real-graph plans")
    p.add_argument("--fractions", type=float, nargs="+",
                   help="budgets for greedy vs MILP, as fractions of the all-keep peak "
                   "(default 0.7 0.5 0.3)")
    p.add_argument("--big", type=int, help="candidates of the synthetic problem (default 10000)")
    p.add_argument("--skip-compile", action="store_true", help="skip the compile-time share")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--docs", action="store_true",
                   help="also put this report into docs/benchmarks.md (planner-table block)")
    args = p.parse_args(argv)
    if args.smoke and args.docs:
        p.error("--smoke's figures mean nothing: not for --docs")
    smoke = args.smoke
    args.layers = args.layers or ([2] if smoke else [6, 12, 24, 48])
    args.seq = args.seq or (32 if smoke else 512)
    args.batch = args.batch or (1 if smoke else 4)
    args.fractions = args.fractions or ([0.5] if smoke else [0.7, 0.5, 0.3])
    args.big = args.big or (200 if smoke else 10_000)
    args.skip_compile = args.skip_compile or smoke
    sizes = (50,) if smoke else (50, 200)
    torch.set_num_threads(args.threads)
    torch._dynamo.config.recompile_limit = 1024
    from benchmarks.cpu_bench import machine_info

    command = "python -m benchmarks.planner_scaling " + " ".join(
        sys.argv[1:] if argv is None else argv)
    doc: dict[str, Any] = {"command": command, "machine": machine_info(args.threads)}
    out: list[str] = []

    def say(*parts: Any) -> None:  # printed, and kept for the docs
        text = " ".join(str(p) for p in parts)
        out.append(text)
        builtins.print(text, flush=True)

    say(command)

    model = SCALING_MODEL.describe().replace(f"{SCALING_MODEL.layers} layers, ", "")
    say(f"\n1. Planning time, {model}, {args.layers} layers, batch {args.batch} x seq "
        f"{args.seq}, memory_budget={args.budget}, offline (meta); the min-cuts are torch's "
        "min_cut_rematerialization_partition calls fxckpt makes (baseline, tagged, re-plans):\n")
    say("| layers | candidates | positions | inspect s | partition ms | min-cuts ms "
          "| planning ms | solver ms |\n|---|---|---|---|---|---|---|---|")
    real, problems = [], []
    plan_real(2, 64, 1, args.budget)  # one-time costs (imports, first trace) land here
    for layers in args.layers:
        row, cap = plan_real(layers, args.seq, args.batch, args.budget)
        real.append(row)
        if cap.problems:
            pb = cap.problems[0][0]
            problems.append((f"{layers}-layer decoder", pb))
            # At the measured host bandwidth every copy hides and both solvers' answers cost
            # ~0 ms; a 50x slower link makes copies queue, where the choice matters.
            slow = replace(pb.timeline,
                           bandwidth_bytes_per_ms=pb.timeline.bandwidth_bytes_per_ms / 50)
            problems.append((f"{layers}-layer decoder, link 50x slower", replace(pb, timeline=slow)))
        say(f"| {layers} | {row['candidates']} | {row['positions']} | {row['inspect_s']:.1f} "
              f"| {row['partition_ms']:.0f} | {row['min_cut_ms']:.0f} | {row['plan_ms']:.0f} "
              f"| {row['solver_ms']:.0f} |")
    doc["real_graphs"] = real

    say(f"\n2. Greedy vs MILP; budget at {args.fractions} of the way from the lowest reachable "
        "peak to the all-keep peak (MILP: HiGHS, 10 s limit; 'no answer': it returned none and "
        "solve fell back to the greedy). Gap: greedy's simulated added ms over the MILP's:\n")
    say("| problem | candidates | budget | greedy ms | MILP ms | greedy cost ms "
          "| MILP cost ms | gap |\n|---|---|---|---|---|---|---|---|")
    # Copies at 2.5 GB/s queue behind each other, where the MILP's linear copy model is only a
    # bound; at infinite bandwidth they never queue and the MILP is exact (solve.py).
    problems += [(f"synthetic n={n}", synthetic(n, 2 * n, seed=n)) for n in sizes]
    problems += [(f"synthetic n={n}, copies never queue",
                  synthetic(n, 2 * n, seed=n, bandwidth=math.inf)) for n in sizes]
    gaps = []
    for label, problem in problems:
        for r in compare(problem, args.fractions, label):
            gaps.append(r)
            milp = f"{r['milp_cost_ms']:.4g}" if r["milp_finished"] else "no answer"
            if not r["greedy_feasible"]:
                milp += " (greedy over budget)"
            if r["gap"] is not None:
                gap = f"{100 * r['gap']:+.2f}%"
            elif r["gap_ms"] is not None:
                gap = f"{r['gap_ms']:+.2g} ms"
            else:
                gap = "-"
            say(f"| {label} | {r['candidates']} | {r['budget_fraction']} | "
                  f"{r['greedy_ms']:.0f} | {r['milp_ms']:.0f} | {r['greedy_cost_ms']:.4g} | "
                  f"{milp} | {gap} |")
    doc["greedy_vs_milp"] = gaps

    if not args.skip_compile:
        say("\n3. Compile time that fxckpt adds to aot_eager, real CPU tensors, "
            "compiler='eager' (median of 5 compiles each, interleaved). 'compile': first step "
            "less a later step; 'backend': dynamo's timer of the backend call (AOTAutograd "
            "trace, partitioner, compiler):")
        share = compile_share(seq=128, batch=1)
        doc["compile_share"] = share
        say(f"{share['model']}, batch 1 x seq 128; aot_eager: compile "
            f"{share['aot_eager_compile_s']:.2f} s, backend {share['aot_eager_backend_s']:.2f} s\n")
        say("| fxckpt options | compile s | vs aot_eager | backend s | vs aot_eager "
            "| partitioner s | planning s |\n|---|---|---|---|---|---|---|")
        for name, c in share["configs"].items():
            say(f"| {name} | {c['compile_s']:.2f} | {100 * c['added_fraction']:+.0f}% "
                f"| {c['backend_s']:.2f} | {100 * c['backend_added_fraction']:+.0f}% "
                f"| {c['partition_s']:.2f} | {c['plan_s']:.2f} |")

    from fxckpt.planning.solve import solve

    big = synthetic(args.big, 2 * args.big)
    top = keep_peak(big)
    start = time.perf_counter()
    sol = solve(big, top // 2, method="greedy")  # as tests/planning/test_solve.py does
    big_s = time.perf_counter() - start
    doc["greedy_big"] = {"candidates": args.big, "positions": 2 * args.big, "budget": "half the "
                         "all-keep peak", "seconds": big_s, "feasible": sol.feasible}
    say(f"\n4. Greedy, synthetic {args.big} candidates x {2 * args.big} positions, budget half "
          f"the all-keep peak: {big_s:.2f} s (feasible={sol.feasible})")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(doc, indent=1, default=str) + "\n")
        builtins.print(f"wrote {args.json}")
    if args.docs:
        from benchmarks.plot import update_doc

        m = doc["machine"]
        head = (f"Command: `{command}`  \nDate: {m['date']}; machine: {m['cpu']}, {m['cores']} "
                f"cores; torch {m['torch']}, torch threads {m['torch_threads']}; load average "
                f"{m['loadavg_start'][0]:.1f} at the start.\n")
        update_doc(head + "\n".join(out[1:]), "planner-table")
    return 0


if __name__ == "__main__":
    sys.exit(main())
