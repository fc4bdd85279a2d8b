"""The five GPU goals, measured on the CPU through an emulated host link.

    python -m benchmarks.gpu_shaped --quick --json docs/benchmarks/gpu_shaped.json --docs

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
"what min-cut already meets" through full checkpointing's measured bytes to half of them.
Memory is the meter's (``fxckpt.measure``): bytes held after the forward and the whole step's
peak. The ``goals`` object has the keys and records of ``benchmarks/goals.py``, labelled
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

from benchmarks import goals as g
from benchmarks import pareto
from benchmarks.cpu_bench import machine_info, run_suite, warm_compilers
from benchmarks.methods import (
    AT_FULL_CHECKPOINT,
    Decoder,
    DecoderConfig,
    MethodSpec,
    Runner,
    at_measured,
    fxckpt_spec,
    make_batch,
    median,
)

MiB = 2**20
ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "benchmarks.md"
QUICK = DecoderConfig("qwen3-shaped-quick", vocab=512, d=160, heads=4, kv_heads=2, head_dim=40,
                      layers=6, ffn=448, style="qwen3")
FULL = replace(QUICK, name="qwen3-shaped", vocab=1024, d=256, head_dim=64, layers=8, ffn=704)
# The row each goal reads (see goal_records).
PLAN_AT_FULL = "fxckpt_at_full_ckpt"
PLAN_FITS = "fxckpt_fits"
PLAN_AT_SOC = "fxckpt_at_save_on_cpu"


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
          for s in ((1, 2) if quick else (1, 2, 4))),
        fx(PLAN_FITS, "memory_budget=1.0: what plain min-cut already meets", memory_budget=1.0),
        fx("fxckpt_budget0.5", "memory_budget=0.5 (of min-cut's saved bytes)", memory_budget=0.5),
        fx(PLAN_AT_FULL, "memory_budget = full_checkpoint's measured bytes",
           memory_budget=AT_FULL_CHECKPOINT),
        fx(PLAN_AT_SOC, "memory_budget = save_on_cpu's measured bytes",
           memory_budget=at_measured("save_on_cpu")),
        fx("fxckpt_half_full_ckpt", "memory_budget = half of full_checkpoint's bytes",
           memory_budget=at_measured("full_checkpoint", 0.5)),
    ]
    return specs


def block_forward_ms(cfg: DecoderConfig, batch: int, seq: int, repeats: int = 3) -> float:
    """This model's forward per block, measured in eager (training mode, autograd on)."""
    torch.manual_seed(0)
    model = Decoder(cfg)
    idx, tgt = make_batch(cfg, batch, seq, "cpu")
    times: list[float] = []
    start: list[float] = []
    hooks = []
    for layer in model.layers:
        hooks.append(layer.register_forward_pre_hook(lambda *_: start.append(time.perf_counter())))
        hooks.append(layer.register_forward_hook(
            lambda *_: times.append(time.perf_counter() - start.pop())))
    model(idx, tgt)  # warm-up
    times.clear()
    for _ in range(repeats):
        model(idx, tgt)
    for h in hooks:
        h.remove()
    return 1e3 * statistics.median(times)


def plan_probe(runner: Runner, idx: torch.Tensor, tgt: torch.Tensor, row: dict[str, Any]) -> None:
    """One more untimed step of an fxckpt row: what its plans predicted."""
    import fxckpt

    if runner.spec.kind != "fxckpt":
        return
    fxckpt.reset_stats()
    runner.step(idx, tgt)
    plans = fxckpt.last_plans()
    offloads = [a for p in plans for a in p.activations if a.decision.kind == "offload"]
    timed = all(p.timeline is not None for p in plans)
    row["plan"] = {
        "graphs": len(plans),
        "budget_bytes": [p.budget_bytes for p in plans],
        "resident_peak_bytes": sum(p.resident_peak_bytes for p in plans),
        "baseline_saved_bytes": sum(p.baseline_saved_bytes for p in plans),
        "offloaded_bytes": sum(p.offloaded_bytes for p in plans),
        "offloads": len(offloads),
        "offloads_hidden": sum("fully hidden" in a.decision.reason for a in offloads),
        "est_overhead_ms": sum(p.est_overhead_ms for p in plans),
        "compute_ms": (sum(p.timeline["compute_ms"] for p in plans if p.timeline)
                       if timed else None),
        "assumptions": plans[0].assumptions if plans else {},
    }


def paired(by: dict[str, dict[str, Any]], a: str, b: str) -> list[float]:
    return [x / y for x, y in zip(by[a]["step_s"], by[b]["step_s"], strict=True)]


def _ok(by: dict[str, dict[str, Any]], *names: str) -> str | None:
    for n in names:
        if n not in by or by[n].get("unavailable"):
            return f"row {n} did not run" + (f": {by[n]['unavailable']}" if n in by else "")
        if not by[n].get("grads_match", True):
            return f"row {n}'s gradients differ from eager's"
    return None


def goal_records(by: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The five goals from the rows; every figure measured, none read from a plan but the
    simulator's own prediction in the first."""
    out: dict[str, dict[str, Any]] = {}
    th = g.THRESHOLDS

    def record(key: str, figure: float | None, inputs: dict[str, Any], skipped: str | None = None,
               failed: str | None = None) -> None:
        rec = g.goal(figure, th[key][0], better=th[key][1], inputs=inputs, label="emulated",
                     skipped=skipped)
        if failed is not None and skipped is None:
            rec["verdict"], rec["inputs"]["why_not_met"] = g.NOT_MET, failed
        out[key] = rec

    # 1. The whole step's measured peak against the simulator's, at the full-checkpoint budget.
    why = _ok(by, PLAN_AT_FULL)
    r = by.get(PLAN_AT_FULL, {})
    plan = r.get("plan") or {}
    if why is None and plan.get("resident_peak_bytes"):
        predicted, measured = plan["resident_peak_bytes"], r["peak_bytes"]
        budget = (plan["budget_bytes"] or [None])[0]
        record("peak_vs_simulator", abs(measured - predicted) / predicted,
               {"row": PLAN_AT_FULL, "measured_step_peak_bytes": measured,
                "simulated_peak_bytes": predicted, "budget_bytes": budget,
                "what_the_simulator_counts": "saved activations resident at each position of "
                "the step; not the backward's gradients and temporaries"},
               failed=None if budget is None or measured <= budget else
               "the measured step peak is over the budget")
    else:
        record("peak_vs_simulator", None, {}, skipped=why or "the plan has no simulated peak")
    # 2. At full-checkpointing memory, against full checkpointing.
    why = _ok(by, PLAN_AT_FULL, "full_checkpoint")
    if why is None:
        ratios = paired(by, PLAN_AT_FULL, "full_checkpoint")
        budget = by["full_checkpoint"]["measured_resident_bytes"]
        held = by[PLAN_AT_FULL]["measured_resident_bytes"]
        record("at_full_ckpt_memory", median(ratios),
               {"row": PLAN_AT_FULL, "per_round": ratios, "budget_bytes": budget,
                "held_after_forward_bytes": held},
               failed=None if held <= budget else "the plan held more than the budget")
    else:
        record("at_full_ckpt_memory", None, {}, skipped=why)
    # 3. A budget plain min-cut meets: no overhead over plain torch.compile.
    why = _ok(by, PLAN_FITS, "compiled")
    if why is None:
        ratios = paired(by, PLAN_FITS, "compiled")
        record("no_offload_overhead", median(ratios),
               {"row": PLAN_FITS, "per_round": ratios,
                "offloaded_bytes": (by[PLAN_FITS].get("plan") or {}).get("offloaded_bytes")})
    else:
        record("no_offload_overhead", None, {}, skipped=why)
    # 4. Against save_on_cpu at equal measured peak (the whole step's).
    why = _ok(by, PLAN_AT_SOC, "save_on_cpu")
    if why is None:
        ratios = paired(by, "save_on_cpu", PLAN_AT_SOC)
        mine, theirs = by[PLAN_AT_SOC]["peak_bytes"], by["save_on_cpu"]["peak_bytes"]
        record("vs_save_on_cpu", median(ratios),
               {"row": PLAN_AT_SOC, "per_round": ratios, "step_peak_bytes": mine,
                "save_on_cpu_step_peak_bytes": theirs},
               failed=None if mine <= theirs else "fxckpt's step peak is above save_on_cpu's")
    else:
        record("vs_save_on_cpu", None, {}, skipped=why)
    # 5. Exposed copy time where the plan says every copy is hidden.
    hidden = [n for n, r in by.items() if not r.get("unavailable") and r.get("plan")
              and r["plan"]["offloads"] and r["plan"]["offloads"] == r["plan"]["offloads_hidden"]]
    if hidden:
        shares = {n: median(by[n]["stall_shares"]) for n in hidden}
        worst = max(shares, key=shares.__getitem__)
        record("exposed_copy", shares[worst],
               {"rows": shares, "worst": worst, "stall_s_per_step": by[worst]["stall_s_per_step"],
                "step_s": median(by[worst]["step_s"])})
    else:
        record("exposed_copy", None, {}, skipped="no row's plan offloads with every copy hidden")
    return out


def extras(by: dict[str, dict[str, Any]], bandwidth: float) -> dict[str, Any]:
    """Per fxckpt row: the simulator's step time against the measured one, and the link check
    (a step lasts at least its offloaded bytes over the bandwidth; the engine's copy seconds
    at least twice that)."""
    out: dict[str, Any] = {}
    for n, r in by.items():
        plan = r.get("plan")
        if r.get("unavailable") or plan is None:
            continue
        step_ms = 1e3 * median(r["step_s"])
        moved = r.get("offloaded_bytes_per_step", 0)
        floor_s = moved / bandwidth
        out[n] = {
            "step_ms": step_ms,
            "predicted_step_ms": (None if plan["compute_ms"] is None
                                  else plan["compute_ms"] + plan["est_overhead_ms"]),
            "offloaded_bytes_per_step": moved,
            "step_at_least_copies": min(r["step_s"]) >= floor_s,
            "copy_seconds_at_least_twice": r.get("copy_s_per_step", 0.0) >= 2 * floor_s - 1e-9,
        }
        if out[n]["predicted_step_ms"] is not None:
            out[n]["step_vs_simulator"] = (step_ms - out[n]["predicted_step_ms"]) / step_ms
    return out


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / MiB:.2f}"


def markdown(doc: dict[str, Any]) -> str:
    m, link = doc["machine"], doc["link"]
    lines = [
        f"Command: `{doc['command']}`  ",
        f"Date: {m['date']}; {m['cpu']}, {m['cores']} cores; torch {m['torch']}, torch threads "
        f"{m['torch_threads']}; load average {m['loadavg_start'][0]:.2f} at the start and "
        f"{m['loadavg_end'][0]:.2f} at the end; wall {m['wall_s']} s; {doc['repeats']} rotated "
        f"rounds.  ",
        f"Model: {doc['model_description']}, batch {doc['batch']}, seq {doc['seq']}, fp32.  ",
        f"Link: {link['bandwidth'] / 1e6:.1f} MB/s each way, {link['overhead_ms']:.4f} ms per "
        f"copy, standing for `{link['target']}` ({link['target_model']}): copy-to-compute "
        f"ratio per block {link['target_ratio']:.3f}, taken against this model's measured "
        f"forward of {link['forward_ms']:.2f} ms per block (the cost model said "
        f"{link['cost_model_forward_ms']:.2f} ms; the planner's compute is scaled by "
        f"{link['compute_scale']:.3g}).",
        "",
        "| method | held after fwd MiB | step peak MiB | host MiB | step ms (min-max) | vs eager "
        "| exposed copy / step | simulated step ms | grads |",
        "|" + "---|" * 9,
    ]
    ext = doc["extras"]
    for r in doc["rows"]:
        if r.get("unavailable"):
            lines.append(f"| {r['method']} | unavailable: {r['unavailable']} |" + " |" * 7)
            continue
        e = ext.get(r["method"], {})
        sim = e.get("predicted_step_ms")
        shares = r.get("stall_shares")
        lines.append(
            f"| {r['method']} | {_mib(r['measured_resident_bytes'])} | {_mib(r['peak_bytes'])} "
            f"| {_mib(r.get('host_saved_bytes'))} "
            f"| {r['step_ms']:.0f} ({r['step_ms_min']:.0f}-{r['step_ms_max']:.0f}) "
            f"| {r['step_time_ratio']:.2f}x "
            f"| {'-' if not shares else f'{100 * median(shares):.2f} %'} "
            f"| {'-' if sim is None else f'{sim:.0f}'} | {'ok' if r['grads_match'] else 'DIFF'} |")
    lines += ["", "| goal | figure | threshold | verdict | from |", "|---|---|---|---|---|"]
    for key, rec in doc["goals"].items():
        fig = "-" if rec["figure"] is None else f"{rec['figure']:.4g}"
        src = rec["inputs"].get("row") or rec["inputs"].get("worst") or ""
        why = rec["inputs"].get("why_not_met", "")
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
    rows = [{"method": r["method"], "x": r["step_time_ratio"], "y": r["peak_bytes"] / MiB}
            for r in doc["rows"] if not r.get("unavailable")]
    link = doc["link"]
    pareto.write(path, rows, f"Measured step peak against step time, through an emulated "
                 f"{link['target']} link ({link['bandwidth'] / 1e6:.0f} MB/s)",
                 "step time / eager's (median of rotated rounds)", "whole-step peak, MiB (meter)")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_shaped",
                                description=__doc__.splitlines()[0])
    p.add_argument("--json", metavar="PATH", help="write the rows, goals and facts here")
    p.add_argument("--quick", action="store_true",
                   help="a smaller decoder and fewer rows: under 10 minutes on 2 cores")
    p.add_argument("--docs", action="store_true",
                   help="also rewrite the gpu-shaped block of docs/benchmarks.md and its plot")
    p.add_argument("--target", default="h200-pcie5", help="the link target (fxckpt.targets)")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, help="sequence length (default 256 quick, 512 full)")
    p.add_argument("--repeats", type=int, help="timed rounds (default 7 quick, 9 full)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=1,
                   help="torch.set_num_threads (the other core is left to the copy threads)")
    p.add_argument("--only", nargs="+", metavar="METHOD",
                   help="only these rows (eager, full_checkpoint and save_on_cpu always run: the "
                        "baseline and the budgets' sources)")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    import fxckpt
    from fxckpt.targets import derive

    args = parse_args(argv)
    cfg = QUICK if args.quick else FULL
    seq = args.seq or (256 if args.quick else 512)
    repeats = args.repeats or (7 if args.quick else 9)
    specs = method_specs(args.quick)
    if args.only:
        names = {s.name for s in specs}
        unknown = sorted(set(args.only) - names)
        if unknown:
            raise SystemExit(f"--only {' '.join(unknown)}: not a row here; choose from "
                             f"{', '.join(sorted(names))}")
        keep = {"eager", "full_checkpoint", "save_on_cpu", *args.only}
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
    forward_ms = block_forward_ms(cfg, args.batch, seq)
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
                         warmup=args.warmup, repeats=repeats, probe=plan_probe)
    link_facts["forward_ms_at_end"] = block_forward_ms(cfg, args.batch, seq)
    facts["wall_s"] = round(time.perf_counter() - started, 1)
    facts["loadavg_end"] = list(os.getloadavg())
    by = {r["method"]: r for r in rows}
    doc: dict[str, Any] = {
        "command": command, "machine": facts, "model": cfg.__dict__,
        "model_description": cfg.describe(), "batch": args.batch, "seq": seq,
        "repeats": repeats, "warmup": args.warmup, "link": link_facts,
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
