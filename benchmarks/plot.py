"""Plot memory against step time per method, and put the table into docs/benchmarks.md.

    python -m benchmarks.plot docs/benchmarks/cpu_quick.json

Reads a JSON written by ``cpu_bench.py --json`` (or ``gpu_check.py --json``), writes a PNG
beside it (one panel per sequence length: saved activations left on the device against step
time over eager, one labelled point per method) and replaces the block between
``<!-- cpu-table:start -->`` and ``<!-- cpu-table:end -->`` (``gpu-table`` for gpu_check) in
docs/benchmarks.md with the run's command, date, machine and table. Needs matplotlib
(``pip install matplotlib``).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

DOC = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"
MiB = 2**20
FAMILY = {  # colour by where a method comes from, marker by method
    "eager": ("#444444", "o"),
    "full_checkpoint": ("#444444", "s"),
    "save_on_cpu": ("#444444", "D"),
    "compiled": ("#1f77b4", "o"),
    "torch_offload": ("#1f77b4", "D"),
    "torch_budget": ("#1f77b4", "^"),
}
FXCKPT_MARKERS = ("*", "P", "X", "v", "h", "p", "<", ">")


def _style(method: str, fx_seen: list[str]) -> tuple[str, str]:
    if method in FAMILY:
        return FAMILY[method]
    if method not in fx_seen:
        fx_seen.append(method)
    return "#d62728", FXCKPT_MARKERS[fx_seen.index(method) % len(FXCKPT_MARKERS)]


def _quartiles(r: dict[str, Any]) -> tuple[float, float]:
    xs = sorted(r.get("step_ratios") or [r["step_ratio_min"], r["step_ratio_max"]])
    lo, hi = (len(xs) - 1) * 0.25, (len(xs) - 1) * 0.75

    def at(q: float) -> float:
        i = int(q)
        return xs[i] + (xs[min(i + 1, len(xs) - 1)] - xs[i]) * (q - i)

    return at(lo), at(hi)


def _rows(doc: dict[str, Any]) -> list[dict[str, Any]]:
    if "rows" in doc:
        return list(doc["rows"])
    return [r for s in doc.get("checks", []) if s.get("check") == "table" for r in s.get("rows", [])]


def _machine(doc: dict[str, Any]) -> dict[str, Any]:
    # gpu_check writes the GPU and torch at the top level.
    return doc.get("machine") or {"gpu": doc.get("gpu"), "torch": doc.get("torch"),
                                  "wall_s": doc.get("wall_s")}


def plot(doc: dict[str, Any], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in _rows(doc) if not r.get("unavailable")]
    seqs = sorted({r["seq"] for r in rows})
    fig, axes = plt.subplots(1, len(seqs), figsize=(5.4 * len(seqs) + 2.2, 4.6), squeeze=False)
    gpu = bool(_machine(doc).get("gpu"))
    unit, scale = ("GiB", 2**30) if gpu else ("MiB", MiB)
    fx_seen: list[str] = []
    handles: dict[str, Any] = {}
    medians = [r["step_time_ratio"] for r in rows]
    for ax, seq in zip(axes[0], seqs, strict=True):
        for r in (r for r in rows if r["seq"] == seq):
            colour, marker = _style(r["method"], fx_seen)
            x, y = r["step_time_ratio"], r["measured_resident_bytes"] / scale
            lo, hi = _quartiles(r)
            h = ax.errorbar(x, y, xerr=[[max(0.0, x - lo)], [max(0.0, hi - x)]], fmt=marker,
                            color=colour, ms=10 if marker == "*" else 7, capsize=2,
                            elinewidth=0.7, alpha=0.9, label=r["method"])  # fmt: skip
            handles.setdefault(r["method"], h)
        ax.set_title(f"seq {seq} x batch {rows[0]['batch']}")
        ax.set_xlabel("step time / eager (median; bars: quartiles of per-round ratios)")
        ax.set_ylabel(f"left on the device by a forward, measured ({unit})")
        ax.set_yscale("symlog", linthresh=0.1 if not gpu else 0.01)
        ax.set_xlim(min(medians) - 0.15, max(medians) + 0.25)
        ax.grid(True, alpha=0.3)
    fig.legend(list(handles.values()), list(handles), loc="center right", fontsize=8,
               title="grey: eager mode\nblue: torch.compile\nred: fxckpt", title_fontsize=8)
    m = doc.get("machine", {})
    fig.suptitle(f"Memory against step time (lower left is better)\n{m.get('gpu', m.get('cpu', ''))}"
                 f", torch {m.get('torch', '?')}, {m.get('date', '')}", fontsize=10)
    fig.tight_layout(rect=(0, 0, 0.84, 0.93))
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def docs_block(doc: dict[str, Any], image: Path) -> str:
    from benchmarks.cpu_bench import markdown_table

    m = _machine(doc)
    where = m.get("gpu") or f"{m.get('cpu', '?')}, {m.get('cores', '?')} cores"
    load = ""
    if "loadavg_start" in m:
        load = (f"; load average {m['loadavg_start'][0]:.1f} at the start and "
                f"{m.get('loadavg_end', [float('nan')])[0]:.1f} at the end (a shared machine)")
    lines = [
        f"Command: `{doc['command']}`  ",
        f"Date: {m.get('date', '?')}; machine: {where}; torch {m.get('torch', '?')}, "
        f"torch threads {m.get('torch_threads', '?')}{load}; wall {m.get('wall_s', doc.get('wall_s', '?'))} s.",
        "",
        markdown_table(_rows(doc)),
        "",
    ]
    if "goals" in doc:  # the five goals: figure, threshold, verdict
        lines += ["| goal | figure | threshold | verdict |", "|---|---|---|---|"]
        for key, g in doc["goals"].items():
            fig = "-" if g.get("figure") is None else f"{g['figure']:.4g}"
            sign = "<=" if g.get("better") == "lower" else ">="
            lines.append(f"| {key} | {fig} | {sign} {g['threshold']} | {g['verdict']} |")
        lines.append("")
    if "checks" in doc:  # gpu_check: every check's verdict, and fxckpt against the baselines
        lines += ["| check | status | why |", "|---|---|---|"]
        lines += [f"| {c['check']} | {c['status']} | {c.get('why', '')} |" for c in doc["checks"]]
        versus = [r for c in doc["checks"] if c["check"] == "table" for r in c.get("versus", [])]
        if versus:
            lines += ["", "| seq | fxckpt | against | peak ratio | step time ratio | exposed copy ms |",
                      "|---|---|---|---|---|---|"]
            lines += [f"| {r['seq']} | {r['method']} | {r['baseline']} | {r['peak_ratio']:.2f} | "
                      f"{r['step_time_ratio']:.2f} | {r['exposed_copy_ms']:.1f} |" for r in versus]
        lines.append("")
    lines += [
        f"![memory against step time]({image.relative_to(DOC.parent).as_posix()})",
    ]
    return "\n".join(lines)


def update_doc(block: str, key: str, doc_path: Path = DOC) -> bool:
    start, end = f"<!-- {key}:start -->", f"<!-- {key}:end -->"
    text = doc_path.read_text() if doc_path.exists() else ""
    pattern = re.compile(re.escape(start) + ".*?" + re.escape(end), re.S)
    if not pattern.search(text):
        print(f"{doc_path} has no {start} ... {end} block; table not written there")
        return False
    doc_path.write_text(pattern.sub(lambda _: f"{start}\n{block}\n{end}", text))
    return True


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.plot", description=__doc__.splitlines()[0])
    p.add_argument("json", nargs="?", default="docs/benchmarks/cpu_quick.json",
                   help="a JSON from cpu_bench.py or gpu_check.py")
    p.add_argument("--out", help="the image (default: the JSON's path with .png)")
    p.add_argument("--no-doc", action="store_true", help="only draw, leave the docs alone")
    args = p.parse_args(argv)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("benchmarks.plot needs matplotlib: pip install matplotlib")
        return 1
    src = Path(args.json)
    doc = json.loads(src.read_text())
    out = Path(args.out) if args.out else src.with_suffix(".png")
    plot(doc, out)
    print(f"wrote {out}")
    if not args.no_doc:
        key = "gpu-table" if "checks" in doc else "cpu-table"
        image = out.resolve()
        if DOC.parent in image.parents and update_doc(docs_block(doc, image), key):
            print(f"updated the {key} block of {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
