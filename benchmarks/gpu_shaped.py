"""The five GPU goals, measured on the CPU through an emulated host link.

    python -m benchmarks.gpu_shaped --quick --json docs/benchmarks/gpu_shaped.json --docs

``--smoke`` runs one tiny case instead (a 2-block decoder, batch 1 x seq 32, the quick rows,
2 rounds and 1 back-to-back pair), in seconds: it checks that the script runs end to end, and
its figures mean nothing.

On the CPU an offload is a RAM-to-RAM memcpy, ~700x cheaper relative to compute than on a GPU,
so CPU timings say nothing about offload. Here the CPU engine emulates a host link
(``fxckpt.emulate_link``) whose bandwidth gives this run's decoder, per block, the
copy-to-compute ratio fxckpt's cost model predicts for the target (``--target``, default
``h200-pcie5``: Qwen3-8B-shaped layers at 32k tokens on an H200 over PCIe Gen5); the ratio is
taken against this model's forward per block as measured at the start of the run. Every peer
copies through the same link: ``save_on_cpu`` and torch's partitioner offload copy on the
compute stream (each copy blocks the step), fxckpt's copies run on the engine's queues.

Rows, in rotated rounds (``cpu_bench.run_suite``): eager, per-block checkpointing,
``save_on_cpu``, plain ``torch.compile``, torch's offload, ``activation_memory_budget`` at a
sweep, fxckpt ``offload="all"``, ``segment_stride`` values, and the planner at budgets from
"what min-cut already meets" (``memory_budget=1.0``) through full checkpointing's and
``save_on_cpu``'s measured absolute step peak (each as a ``memory_budget`` in bytes) to halfway
between what the step starts with and full checkpointing's peak. Memory is the meter's
(``fxckpt.measure``): bytes held after the forward and the whole step's absolute peak (what
the device held when the step began, the model and the batch, plus the most the step
allocated), the figure ``memory_budget`` bounds. The ``goals`` object has the keys and records of ``benchmarks/goals.py``, labelled
"emulated". Also written: a Pareto plot (measured peak against step time) and, with
``--docs``, the gpu-shaped block of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from benchmarks import pareto
from benchmarks.cpu_bench import machine_info, run_suite, warm_compilers
from benchmarks.gpu_shaped_goals import (
    PLAN_AT_FULL,
    PLAN_AT_SAVE_ON_CPU,
    PLAN_FITS,
    extras,
    goal_pairs,
    goal_records,
)
from benchmarks.methods import (
    AT_FULL_CHECKPOINT,
    AT_SAVE_ON_CPU,
    Decoder,
    DecoderConfig,
    MethodSpec,
    Runner,
    fxckpt_spec,
    make_batch,
    median,
    scaled,
)

MiB = 2**20
ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "benchmarks.md"
QUICK = DecoderConfig("qwen3-shaped-quick", vocab=512, d=160, heads=4, kv_heads=2, head_dim=40,
                      layers=6, ffn=448, style="qwen3")
FULL = replace(QUICK, name="qwen3-shaped", vocab=1024, d=256, head_dim=64, layers=8, ffn=704)
SMOKE = replace(QUICK, name="qwen3-shaped-smoke", vocab=64, d=32, heads=2, kv_heads=1,
                head_dim=16, layers=2, ffn=64)  # --smoke
FREE_LINK = "1TB/s"  # the ablation rows plan as if copies cost nothing


def method_specs(quick: bool) -> list[MethodSpec]:
    fx = fxckpt_spec
    specs = [
        MethodSpec("eager", "eager", description="no checkpointing"),
        MethodSpec("full_checkpoint", "full_checkpoint",
                   description="torch.utils.checkpoint per block"),
        MethodSpec("save_on_cpu", "save_on_cpu_link",
                   description="transformers offload=True: save_on_cpu per checkpointed block, "
                               "blocking copies through the link"),
        MethodSpec("compiled", "compiled", description="torch.compile, plain min-cut"),
        MethodSpec("torch_offload", "torch_offload_link",
                   description="torch's partitioner offload, every node tagged, sync copies "
                               "through the link"),
    ]
    for b in (0.1, 0.5) if quick else (0.1, 0.3, 0.5, 0.8):
        specs.append(MethodSpec(f"torch_budget{b:g}", "torch_budget",
                                {"activation_memory_budget": b},
                                description=f"activation_memory_budget={b:g}"))
    specs += [
        fx("fxckpt_offload_all", 'offload="all"', offload="all"),
        *(fx(f"fxckpt_stride{s}", f"segment_stride={s}", segment_stride=s)
          for s in ((1,) if quick else (1, 2, 4, 8))),
        *(() if quick else (fx("fxckpt_none", "no memory_budget"),)),
        fx(PLAN_FITS, "memory_budget=1.0: what plain min-cut already meets", memory_budget=1.0),
        *(fx(f"fxckpt_budget{b:g}",
             f"memory_budget={b:g}: {b:g} of the way from the lowest plan to plain compile",
             memory_budget=b) for b in ((0.5, 0.3, 0.25, 0.2, 0.15) if quick
                                        else (0.5, 0.4, 0.3, 0.25, 0.2, 0.15))),
        fx(PLAN_AT_FULL, "memory_budget = full_checkpoint's measured absolute step peak",
           memory_budget=AT_FULL_CHECKPOINT),
        fx(PLAN_AT_SAVE_ON_CPU, "memory_budget = save_on_cpu's measured absolute step peak",
           memory_budget=AT_SAVE_ON_CPU),
        fx("fxckpt_half_full_ckpt", "memory_budget = the step's start level plus half of what "
           "full_checkpoint's step added to it", memory_budget=scaled(AT_FULL_CHECKPOINT, 0.5)),
        # What pricing the link moves: the same budgets, planned as if copies were free.
        fx("fxckpt_budget0.25_free_link", f"memory_budget=0.25, planned at bandwidth={FREE_LINK}",
           memory_budget=0.25, bandwidth=FREE_LINK),
    ]
    if not quick:
        specs.append(fx("fxckpt_at_full_ckpt_free_link",
                        "memory_budget = full_checkpoint's absolute step peak, planned at "
                        f"bandwidth={FREE_LINK}",
                        memory_budget=AT_FULL_CHECKPOINT, bandwidth=FREE_LINK))
    return specs


class LinkClock:
    """This model's forward per block, measured here and now: one block of an eager copy of
    the model (training mode, autograd on), median of five calls.

    Called before every timed step, it rescales the emulated link by how much slower (or
    faster) compute runs than when the link was sized: other processes' load slows compute
    but not wall-clock copies, and would otherwise make copies look cheaper (or dearer) than
    the target's ratio.
    """

    def __init__(self, cfg: DecoderConfig, batch: int, seq: int) -> None:
        torch.manual_seed(0)
        model = Decoder(cfg)
        idx, tgt = make_batch(cfg, batch, seq, "cpu")
        seen: list[tuple[Any, ...]] = []
        hook = model.layers[0].register_forward_pre_hook(lambda _m, args: seen.append(args))
        model(idx, tgt)
        hook.remove()
        self.block, self.args = model.layers[0], tuple(a.detach() for a in seen[0])
        self.planned_ms: float | None = None
        self.scales: list[float] = []

    def measure(self) -> float:
        times = []
        for _ in range(5):
            start = time.perf_counter()
            self.block(*self.args)
            times.append(time.perf_counter() - start)
        return 1e3 * statistics.median(times)

    def size(self) -> float:
        self.measure()  # warm-up
        self.planned_ms = self.measure()
        return self.planned_ms

    def __call__(self, runner: Runner, row: dict[str, Any]) -> None:
        import fxckpt.emulation

        assert self.planned_ms is not None
        scale = self.measure() / self.planned_ms
        fxckpt.emulation.rescale_link(scale)
        row.setdefault("link_scales", []).append(scale)
        self.scales.append(scale)


def plan_probe(runner: Runner, idx: torch.Tensor, tgt: torch.Tensor, row: dict[str, Any]) -> None:
    """One more untimed step of an fxckpt row: what its plans predicted.

    ``predicted_absolute_peak_bytes``: the step's absolute peak the plans predicted (their
    ``step["total_bytes"]``: the start level, gradients and activations where the step peaks),
    where a budget is set; the largest of the plans' (each is the step's, with its own graph's
    plan). ``predicted_step_peak_bytes``: the graph's own step peak, the start level left out
    (one graph only), as ``peak_bytes`` measures it."""
    import fxckpt

    if runner.spec.kind != "fxckpt":
        return
    fxckpt.reset_stats()
    runner.step(idx, tgt)
    plans = fxckpt.last_plans()
    steps = [p.step["total_bytes"] for p in plans if p.step]
    offloads = [a for p in plans for a in p.activations if a.decision.kind == "offload"]
    timed = all(p.timeline is not None for p in plans)
    row["plan"] = {
        "graphs": len(plans),
        "budget_bytes": [p.budget_bytes for p in plans],
        "resident_peak_bytes": sum(p.resident_peak_bytes for p in plans),
        "predicted_step_peak_bytes": (sum(p.predicted_step_peak_bytes or 0 for p in plans)
                                      if len(plans) == 1 else None),
        "predicted_absolute_peak_bytes": max(steps) if steps else None,
        "predicted_start_bytes": (max(p.step["start_bytes"] for p in plans if p.step)
                                  if steps else None),
        "baseline_saved_bytes": sum(p.baseline_saved_bytes for p in plans),
        "offloaded_bytes": sum(p.offloaded_bytes for p in plans),
        "offloads": len(offloads),
        "offloads_hidden": sum("fully hidden" in a.decision.reason for a in offloads),
        "est_overhead_ms": sum(p.est_overhead_ms for p in plans),
        "compute_ms": (sum(p.timeline["compute_ms"] for p in plans if p.timeline)
                       if timed else None),
        # The graphs' compute (recompute included) plus what the copies add, per plan.
        "predicted_step_ms": (sum(p.timeline["predicted_step_ms"] for p in plans if p.timeline)
                              if timed else None),
        "assumptions": plans[0].assumptions if plans else {},
    }


class BackToBack:
    """After the rotated rounds: each goal's pair of rows again, ``n`` times back to back
    (alternating which goes first), the link calibrated before every step. Neighbouring steps
    see nearly the same load from other processes, rotated rounds up to a round apart."""

    def __init__(self, clock: LinkClock, n: int) -> None:
        self.clock, self.n = clock, n

    def __call__(self, runners: dict[str, Runner], rows: dict[str, dict[str, Any]],
                 idx: torch.Tensor, tgt: torch.Tensor) -> None:
        import fxckpt

        for a, b in goal_pairs(rows):
            ratios = []
            for k in range(self.n):
                took = {}
                for name in (a, b) if k % 2 == 0 else (b, a):
                    runner = runners[name]
                    self.clock(runner, rows[name])
                    fxckpt.reset_stats()
                    start = time.perf_counter()
                    runner.step(idx, tgt)
                    took[name] = time.perf_counter() - start
                    for p in runner.model.parameters():
                        p.grad = None
                ratios.append(took[a] / took[b])
            rows[a].setdefault("pairs", {})[b] = ratios


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / MiB:.2f}"


def markdown(doc: dict[str, Any]) -> str:
    m, link = doc["machine"], doc["link"]
    lines = [
        f"Command: `{doc['command']}`  ",
        f"Date: {m['date']}; {m['cpu']}, {m['cores']} cores; torch {m['torch']}, torch threads "
        f"{m['torch_threads']}; load average {m['loadavg_start'][0]:.2f} at the start and "
        f"{m['loadavg_end'][0]:.2f} at the end; wall {m['wall_s']} s; {doc['repeats']} rotated "
        f"rounds, then {doc['pairs']} back-to-back pairs per step-time goal.  ",
        f"Model: {doc['model_description']}, batch {doc['batch']}, seq {doc['seq']}, fp32.  ",
        f"Link: {link['bandwidth'] / 1e6:.1f} MB/s each way, {link['overhead_ms']:.4f} ms per "
        f"copy, standing for `{link['target']}` ({link['target_model']}): copy-to-compute "
        f"ratio per block {link['target_ratio']:.3f}, taken against this model's measured "
        f"forward of {link['forward_ms']:.2f} ms per block (the cost model said "
        f"{link['cost_model_forward_ms']:.2f} ms; the planner's compute is scaled by "
        f"{link['compute_scale']:.3g}); before every timed step the link was rescaled to "
        f"compute measured then (x{link['scales']['min']:.2f} to x{link['scales']['max']:.2f}, "
        f"median x{link['scales']['median']:.2f}), so the ratio held under other processes' "
        "load.",
        "",
        "Step peak: the absolute one (what the device held when the step began, the model and "
        "the batch, plus the most the step allocated; `memory_budget` bounds it), with the "
        "plans' prediction of it where a budget is set.",
        "",
        "| method | held after fwd MiB | step peak MiB (predicted) | host MiB | step ms (min-max) "
        "| vs eager | exposed copy / step | simulated step ms | grads |",
        "|" + "---|" * 9,
    ]
    ext = doc["extras"]
    for r in doc["rows"]:
        if r.get("unavailable"):
            lines.append(f"| {r['method']} | unavailable: {r['unavailable']} |" + " |" * 7)
            continue
        e = ext.get(r["method"], {})
        sim = e.get("scaled_predicted_step_ms")
        shares = r.get("stall_shares")
        pred = (r.get("plan") or {}).get("predicted_absolute_peak_bytes")
        lines.append(
            f"| {r['method']} | {_mib(r['measured_resident_bytes'])} "
            f"| {_mib(r['absolute_peak_bytes'])}"
            f"{'' if pred is None else f' ({_mib(pred)})'} "
            f"| {_mib(r.get('host_saved_bytes'))} "
            f"| {r['step_ms']:.0f} ({r['step_ms_min']:.0f}-{r['step_ms_max']:.0f}) "
            f"| {r['step_time_ratio']:.2f}x "
            f"| {'-' if not shares else f'{100 * median(shares):.2f} %'} "
            f"| {'-' if sim is None else f'{sim:.0f}'} | {'ok' if r['grads_match'] else 'DIFF'} |")
    lines += ["", "| goal | figure | threshold | verdict | from |", "|---|---|---|---|---|"]
    for key, rec in doc["goals"].items():
        fig = "-" if rec["figure"] is None else f"{rec['figure']:.4g}"
        src = rec["inputs"].get("row") or rec["inputs"].get("worst") or ""
        why = rec["inputs"].get("why", "")
        lines.append(f"| `{key}` | {fig} | {'<=' if rec['better'] == 'lower' else '>='} "
                     f"{rec['threshold']:g} | {rec['verdict']}{': ' + why if why else ''} "
                     f"| `{src}` |")
    return "\n".join(lines)


def write_doc(text: str, doc_path: Path = DOC) -> None:
    start, end = "<!-- gpu-shaped:start -->", "<!-- gpu-shaped:end -->"
    page = doc_path.read_text()
    if start not in page or end not in page:
        raise SystemExit(f"{doc_path} has no {start} ... {end} block to replace")
    head, rest = page.split(start, 1)
    _, tail = rest.split(end, 1)
    doc_path.write_text(f"{head}{start}\n{text}\n{end}{tail}")


def plot(doc: dict[str, Any], path: Path) -> None:
    rows = [{"method": r["method"], "x": r["step_time_ratio"],
             "y": r["absolute_peak_bytes"] / MiB}
            for r in doc["rows"] if not r.get("unavailable")]
    link = doc["link"]
    pareto.write(path, rows, f"Measured step peak against step time, through an emulated "
                 f"{link['target']} link ({link['bandwidth'] / 1e6:.0f} MB/s)",
                 "step time / eager's (median of rotated rounds)",
                 "absolute step peak, MiB (meter)")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_shaped",
                                description=__doc__.splitlines()[0])
    p.add_argument("--json", metavar="PATH", help="write the rows, goals and facts here")
    p.add_argument("--quick", action="store_true",
                   help="a smaller decoder and fewer rows: under 10 minutes on 2 cores")
    p.add_argument("--smoke", action="store_true",
                   help="one tiny case to check that the script runs: a 2-block d=32 decoder, "
                   "batch 1 x seq 32, the quick rows, 2 rounds, 1 pair (seconds; the figures "
                   "mean nothing)")
    p.add_argument("--docs", action="store_true",
                   help="also rewrite the gpu-shaped block of docs/benchmarks.md and its plot")
    p.add_argument("--target", default="h200-pcie5", help="the link target (fxckpt.targets)")
    p.add_argument("--batch", type=int, help="default 2")
    p.add_argument("--seq", type=int, help="sequence length (default 256 quick, 512 full)")
    p.add_argument("--repeats", type=int, help="timed rounds (default 15)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--pairs", type=int,
                   help="back-to-back pairs per step-time goal, after the rotated rounds "
                   "(default 11)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch.set_num_threads (the other core is left to the copy threads)")
    p.add_argument("--only", nargs="+", metavar="METHOD",
                   help="only these rows (eager, full_checkpoint, save_on_cpu and compiled always "
                        "run: the baseline, the budgets' sources and the goals' references)")
    args = p.parse_args(argv)
    if args.smoke and args.docs:
        p.error("--smoke's figures mean nothing: not for --docs")
    args.batch = args.batch or (1 if args.smoke else 2)
    args.pairs = args.pairs if args.pairs is not None else 1 if args.smoke else 11
    return args


def main(argv: Sequence[str] | None = None) -> int:
    import fxckpt
    from fxckpt.targets import derive

    args = parse_args(argv)
    cfg = SMOKE if args.smoke else QUICK if args.quick else FULL
    seq = args.seq or (32 if args.smoke else 256 if args.quick else 512)
    repeats = args.repeats or (2 if args.smoke else 15)
    specs = method_specs(args.quick or args.smoke)
    if args.only:
        names = {s.name for s in specs}
        unknown = sorted(set(args.only) - names)
        if unknown:
            raise SystemExit(f"--only {' '.join(unknown)}: not a row here; choose from "
                             f"{', '.join(sorted(names))}")
        keep = {"eager", "full_checkpoint", "save_on_cpu", "compiled", *args.only}
        specs = [s for s in specs if s.name in keep]
    torch.set_num_threads(args.threads)
    torch._dynamo.config.recompile_limit = 1024
    torch._dynamo.config.accumulated_recompile_limit = 1 << 16
    command = "python -m benchmarks.gpu_shaped " + " ".join(sys.argv[1:] if argv is None else argv)
    facts = machine_info(args.threads)
    print(f"{command}\n{facts['date']}, {facts['cpu']}, load {facts['loadavg_start'][0]:.2f}\n"
          f"{cfg.describe()}, batch {args.batch}, seq {seq}")
    started = time.perf_counter()
    facts["compiler_warmup_s"] = round(warm_compilers(torch.device("cpu")), 1)
    clock = LinkClock(cfg, args.batch, seq)
    forward_ms = clock.size()
    torch.manual_seed(0)
    d = derive(args.target, Decoder(cfg), make_batch(cfg, args.batch, seq, "cpu"),
               forward_ms=forward_ms)
    print(d.describe())
    link_facts = {"target": args.target, "target_model": d.target.model,
                  "target_gpu": d.target.gpu.name, "target_ratio": d.target_ratio,
                  "target_saved_bytes_per_block": d.target_figures.saved_bytes,
                  "target_forward_ms_per_block": d.target_figures.forward_ms,
                  "bandwidth": d.bandwidth, "overhead_ms": d.overhead_ms,
                  "forward_ms": forward_ms, "cost_model_forward_ms": d.model_figures.forward_ms,
                  "saved_bytes_per_block": d.model_figures.saved_bytes,
                  "compute_scale": d.compute_scale}
    with fxckpt.emulate_link(d.bandwidth, overhead_ms=d.overhead_ms,
                             compute_scale=d.compute_scale):
        rows = run_suite(cfg, batch=args.batch, seq=seq, specs=specs, device=torch.device("cpu"),
                         warmup=args.warmup, repeats=repeats, probe=plan_probe,
                         before_step=clock, after=BackToBack(clock, args.pairs))
    link_facts["scales"] = {"min": min(clock.scales), "median": median(clock.scales),
                            "max": max(clock.scales)}
    facts["wall_s"] = round(time.perf_counter() - started, 1)
    facts["loadavg_end"] = list(os.getloadavg())
    by = {r["method"]: r for r in rows}
    doc: dict[str, Any] = {
        "command": command, "machine": facts, "model": cfg.__dict__,
        "model_description": cfg.describe(), "batch": args.batch, "seq": seq,
        "repeats": repeats, "pairs": args.pairs, "warmup": args.warmup, "link": link_facts,
        "goals": goal_records(by), "extras": extras(by, d.bandwidth), "rows": rows,
    }
    text = markdown(doc)
    print()
    print(text)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(doc, indent=1, default=str) + "\n")
        print(f"wrote {args.json}")
    if args.docs:
        svg = ROOT / "docs" / "benchmarks" / "gpu_shaped.svg"
        plot(doc, svg)
        write_doc(text + "\n\n![Measured step peak against step time, every method]"
                  "(benchmarks/gpu_shaped.svg)")
        print(f"rewrote the gpu-shaped block of {DOC} and {svg}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
