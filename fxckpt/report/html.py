"""Plans as one self-contained HTML page: an inline SVG memory chart per graph, and the tables.

No scripts, fonts or images are fetched: the page opens offline. A plan with a ``timeline``
(from the memory simulator: ``{"forward_end", "baseline", "plan", "budget"}``, bytes per
forward+backward position) gets a memory timeline comparing plain min-cut with the plan;
a plan without one gets the bytes kept, offloaded and recomputed per block instead.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from html import escape
from typing import Any

from fxckpt.planning.plan import Plan
from fxckpt.report.table import (
    ALARMS,
    COLUMNS,
    LENGTH_COLUMNS,
    WEIGHT_COLUMNS,
    graph_title,
    human_bytes,
    largest_kept,
    length_rows,
    row_cells,
    summary_items,
    weight_cells,
    weights_title,
)
from fxckpt.sizing import LongestFit, StepFit
from fxckpt.units import option_value

W, H = 1000, 330  # SVG viewBox
# One name per figure in every chart: what plain min-cut saves (the yardstick of the summary),
# and the simulator's baseline, the plan's own partition before anything is offloaded.
BASELINE = "plain min-cut saves"
UNOFFLOADED = "this partition with nothing offloaded"
X_TICKS = 4  # intervals on a timeline's position axis
LEFT, RIGHT, TOP, BOTTOM = 92, 16, 30, 46
MAX_POINTS = 1000  # longer timelines are max-pooled: a peak is never averaged away
COLORS = {"baseline": "#9aa0a6", "plan": "#1a73e8", "budget": "#d93025",
          "keep": "#34a853", "offload": "#12b5cb", "recompute": "#f9ab00"}  # fmt: skip
_CSS = """
body{font:14px/1.45 system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:24px;color:#202124}
h1{font-size:22px;margin:0 0 4px} h2{font-size:17px;margin:28px 0 6px}
.muted{color:#5f6368} .bad{color:#d93025;font-weight:600}
table{border-collapse:collapse;font-size:13px} td,th{padding:3px 10px;text-align:left}
table.rows tr:nth-child(even){background:#f6f8fa} th{border-bottom:1px solid #ccc}
table.rows{width:100%} table.rows td{overflow-wrap:anywhere;vertical-align:top}
table.rows td:nth-child(5){text-align:right;white-space:nowrap}
table.rows td:last-child{min-width:16em}
table.summary td:first-child{font-weight:600;padding-right:24px}
.keep{color:#188038} .offload{color:#098591} .recompute{color:#b06000}
svg{max-width:100%;height:auto;font:12px system-ui,sans-serif}
svg text{fill:#3c4043} .legend span{display:inline-block;margin-right:18px}
.swatch{display:inline-block;width:14px;height:10px;margin-right:5px;vertical-align:middle}
.dash{border-top:2px dashed #d93025;height:0;width:18px;display:inline-block;margin-right:5px}
details{margin-top:8px} summary{cursor:pointer;color:#1a73e8}
"""


def _pool(values: Sequence[int], n: int) -> list[int]:
    """At most ``n`` values, each the max of a run of ``values``."""
    if len(values) <= n:
        return [int(v) for v in values]
    step = len(values) / n
    return [int(max(values[int(i * step) : max(int((i + 1) * step), int(i * step) + 1)]))
            for i in range(n)]  # fmt: skip


def _ticks(top: float) -> tuple[list[float], str, int]:
    """About five round values from 0 to ``top`` bytes, all in one unit: (values, unit, scale)."""
    unit, scale = "B", 1
    for name, size in (("KiB", 2**10), ("MiB", 2**20), ("GiB", 2**30), ("TiB", 2**40)):
        if top >= size:
            unit, scale = name, size
    raw = top / scale / 5
    nice = (0.1, 0.2, 0.25, 0.5, 1, 2, 2.5, 5, 10, 20, 25, 50, 100, 200, 250, 500, 1000)
    step = next((m for m in nice if m >= raw), nice[-1]) * scale
    return [i * step for i in range(int(top // step) + 1)], unit, scale


def _tick_label(v: float, unit: str, scale: int) -> str:
    return "0" if v == 0 else f"{v / scale:g} {unit}"


def _axes(top: float, x_label: str, y_label: str) -> list[str]:
    parts = []
    plot_h = H - TOP - BOTTOM
    ticks, unit, scale = _ticks(top)
    for v in ticks:
        y = TOP + plot_h * (1 - v / top) if top else H - BOTTOM
        parts.append(f'<line x1="{LEFT}" x2="{W - RIGHT}" y1="{y:.1f}" y2="{y:.1f}" '
                     f'stroke="#e8eaed"/><text x="{LEFT - 6}" y="{y + 4:.1f}" '
                     f'text-anchor="end">{escape(_tick_label(v, unit, scale))}</text>')  # fmt: skip
    parts.append(f'<line x1="{LEFT}" x2="{LEFT}" y1="{TOP}" y2="{H - BOTTOM}" stroke="#5f6368"/>')
    parts.append(f'<line x1="{LEFT}" x2="{W - RIGHT}" y1="{H - BOTTOM}" y2="{H - BOTTOM}" '
                 'stroke="#5f6368"/>')  # fmt: skip
    parts.append(f'<text x="{(LEFT + W - RIGHT) / 2}" y="{H - 10}" text-anchor="middle">'
                 f"{escape(x_label)}</text>")  # fmt: skip
    mid = TOP + plot_h / 2
    parts.append(f'<text x="12" y="{mid}" text-anchor="middle" '
                 f'transform="rotate(-90 12 {mid})">{escape(y_label)}</text>')  # fmt: skip
    return parts


def _timeline_marks(x: Callable[[float], float], y: Callable[[float], float], n: int,
                    fwd_end: int, min_cut_peak: int, budget: Any) -> list[str]:
    """The timeline's marks: the end of the forward, plain min-cut's peak and the budget."""
    parts: list[str] = []
    if 0 < fwd_end < n:
        fx = x(fwd_end)
        parts.append(f'<line x1="{fx:.1f}" x2="{fx:.1f}" y1="{TOP}" y2="{H - BOTTOM}" '
                     'stroke="#5f6368" stroke-dasharray="2 3"/>'
                     f'<text x="{fx - 6:.1f}" y="{TOP - 8}" text-anchor="end">forward</text>'
                     f'<text x="{fx + 6:.1f}" y="{TOP - 8}">backward</text>')  # fmt: skip
    if min_cut_peak:
        my = y(min_cut_peak)
        parts.append(f'<line x1="{LEFT}" x2="{W - RIGHT}" y1="{my:.1f}" y2="{my:.1f}" '
                     f'stroke="{COLORS["baseline"]}" stroke-width="1.5" stroke-dasharray="2 3"/>'
                     f'<text x="{LEFT + 6}" y="{my - 5:.1f}">{BASELINE} '
                     f"{escape(human_bytes(min_cut_peak))}</text>")  # fmt: skip
    if budget:
        by = y(int(budget))
        parts.append(f'<line x1="{LEFT}" x2="{W - RIGHT}" y1="{by:.1f}" y2="{by:.1f}" '
                     f'stroke="{COLORS["budget"]}" stroke-width="1.5" stroke-dasharray="6 4"/>'
                     f'<text x="{W - RIGHT - 4}" y="{by - 5:.1f}" text-anchor="end" '
                     f'style="fill:{COLORS["budget"]}">budget {escape(human_bytes(int(budget)))}'
                     "</text>")  # fmt: skip
    return parts


def timeline_svg(timeline: Mapping[str, Any], title: str, min_cut_peak: int = 0) -> str:
    """The graph's own live bytes over the step (the planner's model, what existed before the
    step left out): baseline (grey area), plan (blue), the graph's target (red).

    ``min_cut_peak`` (grey dashed) is what plain min-cut holds at the end of the forward: all
    it saves. The simulator's baseline is the plan's own partition with nothing offloaded,
    which is lower when the plan recomputes.
    """
    base = [int(v) for v in timeline.get("baseline") or []]
    plan = [int(v) for v in timeline.get("plan") or []]
    n = max(len(base), len(plan), 1)
    fwd_end = int(timeline.get("forward_end", 0))
    budget = timeline.get("budget")
    top = max([*base, *plan, int(budget or 0), min_cut_peak, 1]) * 1.08
    plot_w, plot_h = W - LEFT - RIGHT, H - TOP - BOTTOM

    def x(position: float) -> float:
        return LEFT + plot_w * position / n

    def y(v: float) -> float:
        return TOP + plot_h * (1 - v / top)

    def path(values: list[int]) -> str:
        pooled = _pool(values, MAX_POINTS)
        width = n / len(pooled)  # positions per pooled point
        # a step chart: each position holds its value until the next one
        pts = []
        for i, v in enumerate(pooled):
            pts.append(f"{x(i * width):.1f},{y(v):.1f} {x((i + 1) * width):.1f},{y(v):.1f}")
        return " ".join(pts)

    parts = [f'<svg viewBox="0 0 {W} {H}" role="img" xmlns="http://www.w3.org/2000/svg">',
             f"<title>{escape(title)}</title>", *_axes(top, "forward → backward (graph nodes in execution order)", "live bytes of the graph")]  # fmt: skip
    if base:
        pts = path(base)
        parts.append(f'<polygon points="{x(0):.1f},{y(0):.1f} {pts} '
                     f'{x(n):.1f},{y(0):.1f}" fill="{COLORS["baseline"]}" '
                     f'fill-opacity="0.35"><title>{UNOFFLOADED}, peak '
                     f"{escape(human_bytes(max(base)))}</title></polygon>")  # fmt: skip
    if plan:
        parts.append(f'<polyline points="{path(plan)}" fill="none" stroke="{COLORS["plan"]}" '
                     f'stroke-width="2"><title>fxckpt plan, peak {escape(human_bytes(max(plan)))}'
                     "</title></polyline>")  # fmt: skip
    for i in range(X_TICKS + 1):  # the position axis: node positions in execution order
        at = round(i * n / X_TICKS)
        parts.append(f'<line x1="{x(at):.1f}" x2="{x(at):.1f}" y1="{H - BOTTOM}" '
                     f'y2="{H - BOTTOM + 5}" stroke="#5f6368"/><text class="xtick" x="{x(at):.1f}" '
                     f'y="{H - BOTTOM + 17}" text-anchor="middle">{at}</text>')  # fmt: skip
    parts += _timeline_marks(x, y, n, fwd_end, min_cut_peak, budget)
    parts.append("</svg>")
    legend = ('<div class="legend">'
              f'<span><i class="swatch" style="background:{COLORS["baseline"]};opacity:.5"></i>'
              f"{UNOFFLOADED}</span>"
              f'<span><i class="dash" style="border-color:{COLORS["baseline"]}"></i>{BASELINE}</span>'
              f'<span><i class="swatch" style="background:{COLORS["plan"]}"></i>fxckpt plan</span>'
              '<span><i class="dash"></i>the graph\'s target under memory_budget</span></div>')  # fmt: skip
    return "\n".join(parts) + legend


def blocks_svg(plan: Plan, title: str) -> str:
    """Without a timeline: bytes kept, offloaded and recomputed per block (stacked bars)."""
    groups: dict[str, dict[str, int]] = {}
    seen: set[str] = set()
    for a in plan.activations:
        key = a.storage or a.name
        if key in seen:
            continue
        seen.add(key)
        label = "outside blocks" if a.block is None else f"block {a.block}"
        bucket = groups.setdefault(label, {"keep": 0, "offload": 0, "recompute": 0})
        bucket[a.decision.kind] += a.bytes
    labels = sorted(groups, key=lambda s: (s != "outside blocks", int(s.split()[-1]) if s.startswith("block") else -1))  # fmt: skip
    top = max([sum(g.values()) for g in groups.values()] + [1]) * 1.08
    plot_w, plot_h = W - LEFT - RIGHT, H - TOP - BOTTOM
    slot = plot_w / max(len(labels), 1)
    bar = max(min(slot * 0.7, 60), 1.0)
    parts = [f'<svg viewBox="0 0 {W} {H}" role="img" xmlns="http://www.w3.org/2000/svg">',
             f"<title>{escape(title)}</title>", *_axes(top, "block (in execution order)", "saved bytes by decision")]  # fmt: skip
    for i, label in enumerate(labels):
        x0 = LEFT + slot * i + (slot - bar) / 2
        y0 = float(H - BOTTOM)
        for kind in ("keep", "offload", "recompute"):
            v = groups[label][kind]
            if not v:
                continue
            h = plot_h * v / top
            y0 -= h
            parts.append(f'<rect x="{x0:.1f}" y="{y0:.1f}" width="{bar:.1f}" height="{h:.1f}" '
                         f'fill="{COLORS[kind]}"><title>{escape(label)}: {kind} '
                         f"{escape(human_bytes(v))}</title></rect>")  # fmt: skip
        if len(labels) <= 40 or i % max(1, len(labels) // 20) == 0:
            short = label.replace("block ", "")
            parts.append(f'<text x="{x0 + bar / 2:.1f}" y="{H - BOTTOM + 14}" '
                         f'text-anchor="middle">{escape(short)}</text>')  # fmt: skip
    parts.append("</svg>")
    legend = '<div class="legend">' + "".join(
        f'<span><i class="swatch" style="background:{COLORS[k]}"></i>{k}</span>'
        for k in ("keep", "offload", "recompute")
    ) + "</div>"
    return "\n".join(parts) + legend


def overview_svg(plan: Plan) -> str:
    """Horizontal bars: the step's predicted device peak and its parts, what plain min-cut
    saves against what the plan keeps, moves and recomputes, with the budget (the step's
    device peak) as a dashed line."""
    step = plan.step or {}
    bars = [("plan: the step's device peak", int(step.get("total_bytes") or 0), COLORS["plan"]),
            ("  held when the step starts", int(step.get("start_bytes") or 0), COLORS["baseline"]),
            ("  gradients at the peak", int(step.get("gradients_bytes") or 0), COLORS["baseline"]),
            ("  activations at the peak", int(step.get("activations_bytes") or 0), COLORS["baseline"]),
            ] if step else [("plan: the graph's own step peak", plan.predicted_step_peak_bytes or 0,
                             COLORS["plan"])]  # fmt: skip
    bars += [(BASELINE, plan.baseline_saved_bytes, COLORS["baseline"]),
             ("plan: saved activations at their peak", plan.resident_peak_bytes, COLORS["plan"]),
             ("plan: offloaded to host", plan.host_bytes, COLORS["offload"]),
             ("plan: recomputed in the backward", plan.recomputed_bytes, COLORS["recompute"])]  # fmt: skip
    if plan.disk_bytes:
        bars.insert(len(bars) - 1, ("plan: offloaded to disk", plan.disk_bytes, COLORS["offload"]))
    budget = plan.budget_bytes
    top = max([b[1] for b in bars] + [budget or 0, 1]) * 1.05
    left, row, height = 250, 26, 26 * len(bars) + 30
    span = W - left - RIGHT - 90
    parts = [f'<svg viewBox="0 0 {W} {height}" role="img" xmlns="http://www.w3.org/2000/svg">',
             f"<title>{escape(graph_title(plan))}</title>"]  # fmt: skip
    for i, (label, value, color) in enumerate(bars):
        y = 8 + i * row
        w = span * value / top
        parts.append(f'<text x="{left - 8}" y="{y + 14}" text-anchor="end">{escape(label)}</text>'
                     f'<rect x="{left}" y="{y}" width="{max(w, 0.5):.1f}" height="{row - 8}" '
                     f'fill="{color}"/><text x="{left + w + 6:.1f}" y="{y + 14}">'
                     f"{escape(human_bytes(value))}</text>")  # fmt: skip
    if budget is not None:
        bx = left + span * budget / top
        parts.append(f'<line x1="{bx:.1f}" x2="{bx:.1f}" y1="2" y2="{height - 18}" '
                     f'stroke="{COLORS["budget"]}" stroke-width="1.5" stroke-dasharray="6 4"/>'
                     f'<text x="{bx:.1f}" y="{height - 4}" text-anchor="middle" '
                     f'style="fill:{COLORS["budget"]}">budget {escape(human_bytes(budget))}</text>')  # fmt: skip
    parts.append("</svg>")
    return "\n".join(parts)


def _rows(columns: tuple[str, ...], rows: Sequence[tuple[tuple[str, ...], str]], summary: str) -> str:
    """A folding table: each row's cells, the decision's (column 5) styled by its class."""
    head = "".join(f"<th>{escape(c)}</th>" for c in columns)
    body = []
    for cells, kind in rows:
        out = [escape(c) for c in cells]
        out[5] = f'<span class="{kind}">{out[5]}</span>'
        body.append("<tr>" + "".join(f"<td>{c}</td>" for c in out) + "</tr>")
    is_open = " open" if len(body) <= 200 else ""
    return (f"<details{is_open}><summary>{escape(summary)}</summary>"
            f'<table class="rows"><thead><tr>{head}</tr></thead><tbody>'
            + "\n".join(body) + "</tbody></table></details>")  # fmt: skip


def _table(plan: Plan) -> str:
    rows = [(row_cells(a), a.decision.kind) for a in plan.activations]
    return _rows(COLUMNS, rows, f"{len(rows)} saved tensors")


def _weights_table(plan: Plan) -> str:
    # A kept weight is styled as a kept tensor, a streamed one as an offloaded one.
    rows = [(weight_cells(w), "keep" if w.decision == "resident" else "offload") for w in plan.weights]
    return _rows(WEIGHT_COLUMNS, rows, weights_title(plan))


def render_html(
    plans: Sequence[Plan], *, options: Mapping[str, Any], target: str = "", title: str = "",
    fit: StepFit | None = None, lengths: Sequence[LongestFit] = (), lengths_title: str = "",
) -> str:
    """The whole page as a string; ``lengths``: ``--max-seq``'s strategies."""
    heading = title or (f"fxckpt plan: {target}" if target else "fxckpt plan")
    opts = ", ".join(f"{k}={option_value(k, v)}" for k, v in options.items() if v is not None)
    summary = "".join(
        f'<tr class="{"bad" if label in ALARMS else ""}"><td>{escape(label)}</td>'
        f"<td>{escape(value)}</td></tr>"
        for label, value in summary_items(plans, fit)
    )
    body = [f"<h1>{escape(heading)}</h1>",
            f'<div class="muted">options: {escape(opts)}</div>',
            f'<h2>summary</h2><table class="summary">{summary}</table>']  # fmt: skip
    if lengths:
        head = "".join(f"<th>{escape(c)}</th>" for c in LENGTH_COLUMNS)
        rows = "".join("<tr>" + "".join(f"<td>{escape(c)}</td>" for c in r) + "</tr>"
                       for r in length_rows(lengths))  # fmt: skip
        body.append(f"<h2>{escape(lengths_title)}</h2>"
                    f'<table class="rows"><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>')
    kept = largest_kept(plans)
    if kept:
        items = "".join(f"<li><b>{escape(human_bytes(a.bytes))}</b> "
                        f"{escape(a.module or '(outside any module)')} "
                        f"{escape(a.op)} {escape(' × '.join(map(str, a.shape)))} {escape(a.dtype)}"
                        f' <span class="muted">({escape(a.decision.reason)})</span></li>'
                        for a in kept)  # fmt: skip
        body.append(f"<h2>largest tensors kept on the device</h2><ul>{items}</ul>")
    for plan in plans:
        name = graph_title(plan)
        body.append(f"<h2>{escape(name)}</h2>")
        body.append(overview_svg(plan))
        if plan.timeline:
            body.append('<p class="muted">The bytes this graph has live on the device at each '
                        "point of its forward and backward (the planner's model: what the step "
                        "held when it started is left out), against what memory_budget leaves "
                        "it.</p>")  # fmt: skip
            body.append(timeline_svg(plan.timeline, name, plan.baseline_saved_bytes))
        else:
            body.append('<p class="muted">This plan carries no memory timeline, so the chart '
                        "shows the saved bytes of each block by decision: <b>keep</b> stays on "
                        "the device, <b>offload</b> goes to host memory between forward and "
                        "backward, <b>recompute</b> is rebuilt in the backward.</p>")  # fmt: skip
            body.append(blocks_svg(plan, name))
        for note in plan.notes:
            body.append(f'<div class="muted">note: {escape(note)}</div>')
        body.append(_table(plan))
        if plan.weights:
            body.append(_weights_table(plan))
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{escape(heading)}</title><style>{_CSS}</style></head><body>\n"
            + "\n".join(body) + "\n</body></html>\n")  # fmt: skip
