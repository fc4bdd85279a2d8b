"""``fxckpt inspect``: plan a model offline, on meta tensors, and show the plan.

Exit codes: 0 done; 1 planning failed; 2 bad flags, options or target (one line on stderr).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn, TextIO

from fxckpt.errors import FxckptError, OptionsError
from fxckpt.sizing import OPTIMIZERS

USAGE_ERROR = 2
FAILURE = 1
_FLAG_TO_OPTION = {
    "budget": "memory_budget",
    "stride": "segment_stride",
    "width": "segment_width",
    "offload": "offload",
    "min_offload": "min_offload_bytes",
    "bandwidth": "bandwidth",
    "host_budget": "host_budget",
    "offload_dir_bandwidth": "offload_dir_bandwidth",
    "cost_model": "cost_model",
    "blocks": "blocks",
}


class UsageError(Exception):
    """A bad command line; main() prints it on one line and exits with code 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see `fxckpt inspect --help`)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="fxckpt", description="fxckpt: keep / recompute / offload planning.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    p = sub.add_parser(
        "inspect",
        help="plan a model offline (meta tensors) and show the plan",
        description="Plan one training step of a model offline, on meta tensors: no weight or "
        "activation memory is allocated. TARGET is pkg.module:factory or path/model.py:factory "
        "(imports and runs that code); or use --hf-config.",
    )
    p.add_argument("target", nargs="?", metavar="TARGET",
                   help="pkg.module:factory or path/to/model.py:factory")  # fmt: skip
    hf = p.add_argument_group("Hugging Face config (reads JSON only, never remote code)")
    hf.add_argument("--hf-config", metavar="PATH", help="a config.json, or a folder holding one")
    hf.add_argument("--batch", type=int, default=1, help="batch size (default 1)")
    hf.add_argument("--seq", type=int, default=2048, help="tokens per sequence (default 2048)")
    hf.add_argument("--dtype", default="bfloat16", help="bfloat16 (default), float16, float32")
    opts = p.add_argument_group("options (as fxckpt.Options)")
    opts.add_argument("--budget", metavar="B",
                      help='memory_budget: the step\'s device peak, weights included: "24GiB", '
                           'bytes, a fraction such as 0.5 (from the lowest plan to plain '
                           'torch.compile), or none')  # fmt: skip
    opts.add_argument("--stride", metavar="N", help="segment_stride (0: no segments)")
    opts.add_argument("--width", metavar="N", help="segment_width (default: the stride)")
    opts.add_argument("--offload", metavar="MODE", help="auto, never or all")
    opts.add_argument("--min-offload", metavar="B", help="min_offload_bytes, e.g. 1MiB")
    opts.add_argument("--bandwidth", metavar="BW", help='host<->device bandwidth, e.g. "25GB/s"')
    opts.add_argument("--host-budget", metavar="B",
                      help='host_budget: "64GiB", bytes, a fraction of this machine\'s RAM, auto '
                           "or none")  # fmt: skip
    opts.add_argument("--offload-dir-bandwidth", metavar="BW",
                      help='plan a disk tier of this bandwidth, e.g. "3GB/s": offloads the host '
                           "budget cannot hold go to disk")  # fmt: skip
    opts.add_argument("--cost-model", metavar="M", help="flops, profile or unit")
    opts.add_argument("--blocks", metavar="REGEX", help="module paths of the repeated blocks")
    card = p.add_argument_group("the card: will the step fit?")
    card.add_argument("--device-memory", metavar="SIZE|CARD",
                      help='the device\'s memory: "80GiB", or a card (h100-80gb, h200, a100-80gb, '
                           'a100-40gb, l40s, rtx4090, rtx3090); the budget is then "auto" for it '
                           "unless --budget says otherwise, and the summary says whether the "
                           "step fits")  # fmt: skip
    card.add_argument("--optimizer", choices=OPTIMIZERS, default="none",
                      help="the optimizer whose state the step starts with (default none): "
                           "adamw holds 2 tensors per parameter, sgd (momentum) 1, each in the "
                           "parameter's dtype; float32 master weights and moments (mixed "
                           "precision) hold more: plan with --dtype float32 for them")  # fmt: skip
    card.add_argument("--max-seq", metavar="LIMIT", nargs="?", const=0, type=int,
                      help="with --device-memory: the longest sequence that fits, for plain "
                           "torch.compile, per-block checkpointing and fxckpt, searched from --seq "
                           "up to LIMIT tokens (default 32 x --seq); the model is traced once "
                           "(--hf-config, or a factory that takes seq=...)")  # fmt: skip
    weights = p.add_argument_group("streamed weights (as fxckpt.stream_weights)")
    weights.add_argument("--stream-weights", metavar="REGEX", nargs="?", const="",
                         help="keep weights in host memory: those of modules matching REGEX "
                              "(no REGEX: every module)")  # fmt: skip
    weights.add_argument("--frozen-only", action="store_true",
                         help="stream only weights that do not require grad (a LoRA base)")
    out = p.add_argument_group("output")
    out.add_argument("--format", choices=("table", "json"), default="table")
    out.add_argument("--html", metavar="PATH", help="also write a self-contained HTML report")
    out.add_argument("--sweep", metavar="B,B,...",
                     help="plan once per budget (e.g. 1.0,0.5,0.25,0.1) and show the trade-off")  # fmt: skip
    out.add_argument("-o", "--output", metavar="PATH", help="write the table or JSON here")
    out.add_argument("-q", "--quiet", action="store_true", help="no progress lines on stderr")
    out.add_argument("--traceback", action="store_true", help="show tracebacks of failures")
    return parser


# --------------------------------------------------------------------------------------------
# Flags -> Options
# --------------------------------------------------------------------------------------------


def budget_value(text: str) -> Any:
    """A ``--budget`` word as Options takes it: none, int bytes, float fraction or a string."""
    t = text.strip()
    if t.lower() in ("none", "off"):
        return None
    if re.fullmatch(r"\d+", t):
        return int(t)
    if re.fullmatch(r"[+-]?(\d+\.\d*|\.\d+|\d+)([eE][+-]?\d+)?", t):
        return float(t)
    return t


def _int_or_text(text: str) -> Any:
    return int(text) if re.fullmatch(r"[+-]?\d+", text.strip()) else text


def options_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The Options fields the flags set, converted as the Python API would receive them."""
    convert = {"budget": budget_value, "stride": _int_or_text, "width": _int_or_text,
               "min_offload": _int_or_text, "host_budget": budget_value}  # fmt: skip
    out: dict[str, Any] = {}
    for flag, option in _FLAG_TO_OPTION.items():
        value = getattr(args, flag)
        if value is not None:
            out[option] = convert.get(flag, lambda v: v)(value)
    return out


def sweep_budgets(text: str) -> list[tuple[str, Any]]:
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise UsageError("--sweep needs budgets, e.g. --sweep 1.0,0.5,0.25,0.1")
    return [(t, budget_value(t)) for t in items]


# --------------------------------------------------------------------------------------------
# Targets
# --------------------------------------------------------------------------------------------


# --------------------------------------------------------------------------------------------
# Running
# --------------------------------------------------------------------------------------------


class ProgressLine:
    """One status line on stderr, rewritten in place on a terminal; plain lines otherwise."""

    def __init__(self, stream: TextIO, enabled: bool) -> None:
        self.stream, self.enabled = stream, enabled
        self.tty = enabled and stream.isatty()
        self.start = time.perf_counter()

    def __call__(self, message: str) -> None:
        if not self.enabled:
            return
        line = f"[{time.perf_counter() - self.start:6.1f}s] {message}"
        if self.tty:
            self.stream.write("\r\033[K" + line)
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def done(self) -> None:
        if self.tty:
            self.stream.write("\r\033[K")
            self.stream.flush()


def run_inspect(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    from fxckpt import sizing
    from fxckpt.inspect import inspect_options, plan_workload
    from fxckpt.options import auto_budget
    from fxckpt.report import json_doc, table
    from fxckpt.workloads import hf_workload, load_factory

    if (args.target is None) == (args.hf_config is None):
        raise UsageError("give either TARGET (pkg.module:factory) or --hf-config PATH")
    if args.sweep and args.html:
        raise UsageError("--sweep and --html cannot be combined: run them separately")
    if args.max_seq is not None and (args.sweep or not args.device_memory):
        raise UsageError("--max-seq searches against a card: give --device-memory, and no --sweep")
    flags = options_from_args(args)
    device = sizing.device_memory(args.device_memory) if args.device_memory else None
    if device is not None:
        if "memory_budget" in flags and flags["memory_budget"] is None:
            raise UsageError("--device-memory checks the step's peak, which only a budget "
                             "accounts: drop --budget none (the budget is then the card's)")
        if flags.get("memory_budget", "auto") == "auto":
            flags["memory_budget"] = auto_budget(device)
    budgets = sweep_budgets(args.sweep) if args.sweep else [(args.budget or "none", None)]
    if device is not None:
        budgets = [(label, auto_budget(device) if v == "auto" else v) for label, v in budgets]
    # Every budget is validated before any work starts.
    runs = [(label, inspect_options(**({**flags, "memory_budget": v} if args.sweep else flags)))
            for label, v in budgets]  # fmt: skip
    progress = ProgressLine(err, not args.quiet)
    if args.hf_config is not None:
        _quiet_transformers()
        progress(f"building the model from {args.hf_config} on the meta device")
        work = hf_workload(args.hf_config, batch=args.batch, seq=args.seq, dtype=args.dtype)
        target = f"{args.hf_config}: {work.description}"
    else:
        progress(f"importing {args.target}")
        work = load_factory(args.target)
        target = args.target
    work.optimizer = args.optimizer
    if args.stream_weights is not None:
        work.stream_weights = {"modules": args.stream_weights or None, "frozen_only": args.frozen_only}
    elif args.frozen_only:
        raise UsageError("--frozen-only chooses among streamed weights: add --stream-weights")
    if args.max_seq is not None and device is not None:
        return _run_max_seq(args, work, flags, runs[0][1], device, target, progress, out, err)
    results = []
    for label, opts in runs:
        if args.sweep:
            progress(f"budget {label}")
        plans = plan_workload(work, opts, progress=progress)
        fit = sizing.step_fit(plans, optimizer=args.optimizer, device_memory_bytes=device)
        results.append(table.SweepRow(label, plans, fit))
    progress.done()
    _warn_host_memory([r.plans for r in results])
    options = runs[0][1].to_dict()
    fit = results[0].fit
    sink = open(args.output, "w") if args.output else out  # noqa: SIM115
    try:
        if args.sweep and args.format == "json":
            json.dump(json_doc.sweep_document(results, options, target=target), sink, indent=1)
            sink.write("\n")
        elif args.sweep:
            table.print_sweep(results, sink, heading=f"budget sweep: {target}")
        elif args.format == "json":
            json.dump(json_doc.document(results[0].plans, options, target=target, fit=fit), sink, indent=1)
            sink.write("\n")
        else:
            table.print_plans(results[0].plans, sink, heading=target, fit=fit)
    finally:
        if sink is not out:
            sink.close()
    if args.html:
        from fxckpt.report.html import render_html

        page = render_html(results[0].plans, options=options, target=target, fit=fit)
        Path(args.html).write_text(page, encoding="utf-8")
        if not args.quiet:
            err.write(f"wrote {args.html}\n")
    return 0


def _run_max_seq(args: argparse.Namespace, work: Any, flags: dict[str, Any], opts: Any,
                 device: int, target: str, progress: ProgressLine, out: TextIO, err: TextIO) -> int:
    """``--max-seq``: the plan at --seq, then each strategy's longest sequence on the card."""
    from fxckpt import sizing
    from fxckpt.report import json_doc, table
    from fxckpt.seq_fit import longest_sequences, plan_lengths
    from fxckpt.units import format_bytes

    limit = flags["memory_budget"]
    if not isinstance(limit, int):
        raise UsageError(f"--max-seq searches against bytes: --budget {args.budget} is not a size "
                         "(write one such as 70GiB, or leave --budget out for the card's)")  # fmt: skip
    seq = work.seq or args.seq
    ceiling = args.max_seq or 32 * seq
    if ceiling < seq:
        raise UsageError(f"--max-seq {args.max_seq} is below the starting length {seq}: give a "
                         "larger limit, or a smaller --seq")  # fmt: skip
    base = {k: v for k, v in flags.items() if k != "memory_budget"}
    with plan_lengths(work, progress=progress) as plan_at:
        progress(f"the plan at {seq} tokens")
        plans = plan_at(opts, seq)
        fits = longest_sequences(plan_at, limit=limit, seq=seq, ceiling=ceiling, base=base,
                                 say=progress)  # fmt: skip
    progress.done()
    _warn_host_memory([plans])
    fit = sizing.step_fit(plans, optimizer=args.optimizer, device_memory_bytes=device)
    options = opts.to_dict()
    title = (f"longest sequence whose step fits {format_bytes(limit)} (the usable part of "
             f"{format_bytes(device)})")  # fmt: skip
    lengths = json_doc.fit_document(fits, limit_bytes=limit, device_memory_bytes=device,
                                    quantum=sizing.seq_quantum(seq),
                                    batch=args.batch if args.hf_config else None)  # fmt: skip
    sink = open(args.output, "w") if args.output else out  # noqa: SIM115
    try:
        if args.format == "json":
            doc = json_doc.document(plans, options, target=target, fit=fit, lengths=lengths)
            json.dump(doc, sink, indent=1)
            sink.write("\n")
        else:
            table.print_plans(plans, sink, heading=target, fit=fit)
            table.print_lengths(fits, sink, heading=title)
    finally:
        if sink is not out:
            sink.close()
    if args.html:
        from fxckpt.report.html import render_html

        page = render_html(plans, options=options, target=target, fit=fit, lengths=fits,
                           lengths_title=title)  # fmt: skip
        Path(args.html).write_text(page, encoding="utf-8")
        if not args.quiet:
            err.write(f"wrote {args.html}\n")
    return 0


def _warn_host_memory(runs: Sequence[Sequence[Any]]) -> None:
    """Warn where a run's plans send more to host memory than this machine has RAM."""
    from fxckpt import _host
    from fxckpt.units import format_bytes

    need = max(sum(p.host_bytes for p in plans) for plans in runs)
    try:
        ram = _host.total_bytes()
    except FxckptError:
        return
    if need > ram:
        warnings.warn(
            f"the plan sends {format_bytes(need)} of activations to host memory; this machine "
            f"has {format_bytes(ram)} of RAM. Train where the host holds that beside the process, "
            "or give --host-budget (the rest is recomputed or kept) or an offload_dir.",
            stacklevel=2,
        )


def _quiet_transformers() -> None:
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
    except ImportError:
        pass


def _one_line_warning(message: Warning | str, category: type[Warning], *_: Any, **__: Any) -> None:
    # The planner warns when a budget cannot be met; a file name and a source line would only
    # bury the message, which already names the graph and the way out.
    text = str(message).removeprefix("fxckpt: ")
    sys.stderr.write(f"fxckpt inspect: warning: {text}\n")


def _silence_stdout() -> None:
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # keep the interpreter's final flush quiet
    except (OSError, ValueError):
        pass


def main(argv: Sequence[str] | None = None) -> int:
    """The ``fxckpt`` console script."""
    out, err = sys.stdout, sys.stderr
    args: argparse.Namespace | None = None
    try:
        args = build_parser().parse_args(argv)
        with warnings.catch_warnings():
            warnings.showwarning = _one_line_warning
            return run_inspect(args, out, err)
    except UsageError as e:
        err.write(f"fxckpt inspect: error: {e}\n")
        return USAGE_ERROR
    except FxckptError as e:
        from fxckpt.inspect import TargetError

        if args is not None and args.traceback:
            raise
        code = USAGE_ERROR if isinstance(e, (OptionsError, TargetError)) else FAILURE
        err.write(f"fxckpt inspect: error: {e}\n")
        return code
    except SystemExit as e:  # --help, or a usage error
        return e.code if isinstance(e.code, int) else 0
    except BrokenPipeError:  # `fxckpt inspect ... | head`: the reader left; so do we
        _silence_stdout()
        return FAILURE
    except KeyboardInterrupt:
        err.write("fxckpt inspect: interrupted\n")
        return 130
    except Exception as e:
        if args is not None and args.traceback:
            raise
        err.write(f"fxckpt inspect: error: {type(e).__name__}: {e} (rerun with --traceback)\n")
        return FAILURE


if __name__ == "__main__":
    sys.exit(main())
