"""Plans as terminal tables: the saved activations of each graph, a summary, and a sweep.

Uses ``rich`` (the ``cli`` extra) when it is installed, plain aligned text otherwise.
"""

from __future__ import annotations

import io
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TextIO

from fxckpt.planning.plan import Plan, PlannedActivation, PlannedWeight, describe_assumptions
from fxckpt.sizing import LongestFit, StepFit, top_step
from fxckpt.units import format_bytes as human_bytes

COLUMNS = ("module", "op", "shape", "dtype", "size", "decision", "reason")
WEIGHT_COLUMNS = ("parameter", "shape", "dtype", "size", "uses fw/bw", "decision", "per step", "reason")
SWEEP_COLUMNS = ("budget", "budget bytes", "step peak", "resident peak", "vs baseline",
                 "offloaded", "recomputed", "est. overhead", "fits")  # fmt: skip
# With --device-memory, a last column: the step on the card.
CARD_COLUMN = "on the card"
_STYLE = {"keep": "green", "offload": "cyan", "recompute": "yellow", "resident": "green", "stream": "cyan"}


def human_flops(n: float) -> str:
    for unit, scale in (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} FLOP"


def human_ms(ms: float) -> str:
    if ms >= 3_600_000:
        return f"{ms / 3_600_000:.1f} h"
    if ms >= 1000:
        return f"{ms / 1000:.1f} s"
    return f"{ms:.2f} ms"


def shape_text(shape: Sequence[Any]) -> str:
    return "×".join(str(s) for s in shape) if shape else "scalar"


def decision_text(a: PlannedActivation) -> str:
    """``keep``, ``recompute``, ``offload`` (to host memory) or ``offload → disk``."""
    if getattr(a.decision, "tier", "host") == "disk":
        return "offload → disk"
    return a.decision.kind


def row_cells(a: PlannedActivation) -> tuple[str, ...]:
    """One table row, in :data:`COLUMNS` order."""
    return (a.module or "-", a.op, shape_text(a.shape), a.dtype, human_bytes(a.bytes),
            decision_text(a), a.decision.reason)  # fmt: skip


def weight_cells(w: PlannedWeight) -> tuple[str, ...]:
    """One streamed weight's row, in :data:`WEIGHT_COLUMNS` order."""
    return (w.parameter or w.name, shape_text(w.shape), w.dtype, human_bytes(w.bytes),
            f"{w.forward_uses}/{w.backward_uses}", w.decision, human_bytes(w.step_h2d_bytes),
            w.reason)  # fmt: skip


def weights_title(plan: Plan) -> str:
    streamed = sum(w.decision == "stream" for w in plan.weights)
    return (f"graph {plan.name}: {len(plan.weights)} streamed weights, {streamed} copied per use "
            f"({human_bytes(plan.weight_h2d_bytes)} per step), {len(plan.weights) - streamed} "
            f"kept on the device ({human_bytes(plan.resident_weight_bytes)})")  # fmt: skip


@dataclass(frozen=True)
class Totals:
    """Figures over every graph of a run (see :func:`totals`)."""

    baseline_saved_bytes: int
    resident_peak_bytes: int
    offloaded_bytes: int
    recomputed_bytes: int
    recomputed_flops: float
    host_bytes: int
    disk_bytes: int
    est_overhead_ms: float
    over_budget: tuple[str, ...]  # names of graphs whose predicted step peak exceeds the budget


def totals(plans: Sequence[Plan]) -> Totals:
    """Sums over graphs.

    The resident peak is the sum of the graphs' peaks: with graph breaks, what an earlier
    graph saves stays resident while the later graphs run, so the sum bounds the step's peak.
    """
    return Totals(
        baseline_saved_bytes=sum(p.baseline_saved_bytes for p in plans),
        resident_peak_bytes=sum(p.resident_peak_bytes for p in plans),
        offloaded_bytes=sum(p.offloaded_bytes for p in plans),
        recomputed_bytes=sum(p.recomputed_bytes for p in plans),
        recomputed_flops=sum(p.recomputed_flops for p in plans),
        host_bytes=sum(p.host_bytes for p in plans),
        disk_bytes=sum(p.disk_bytes for p in plans),
        est_overhead_ms=sum(p.est_overhead_ms for p in plans),
        over_budget=tuple(
            p.name
            for p in plans
            if p.budget_bytes is not None and p.step is not None
            and p.step["total_bytes"] > p.budget_bytes
        ),
    )


# Summary labels shown as alarms (red in the table, "bad" in the HTML).
ALARMS = ("OVER BUDGET", "DOES NOT FIT")


def summary_items(plans: Sequence[Plan], fit: StepFit | None = None) -> list[tuple[str, str]]:
    """(label, value) lines of the summary under the tables; ``fit``: the step against a card
    (``--device-memory``, ``--optimizer``)."""
    t = totals(plans)
    base = t.baseline_saved_bytes

    def share(n: int) -> str:
        return f"{human_bytes(n)} ({100 * n / base:.0f}% of baseline)" if base else human_bytes(n)

    budgets = [p.budget_bytes for p in plans if p.budget_bytes is not None]
    budget = human_bytes(max(budgets)) if budgets else "none"
    top = top_step(plans)
    items = [
        ("graphs", str(len(plans))),
        ("baseline saved (plain min-cut)", human_bytes(base)),
        ("budget (the step's device peak)", budget),
    ]
    if fit is not None:
        items.append(("predicted step peak", fit.parts()))
        if fit.device_memory_bytes is not None:
            items.append(("device memory" if fit.fits else "DOES NOT FIT", fit.verdict()))
    elif top is not None:
        items.append(("predicted step peak", f"{human_bytes(top['total_bytes'])}: start "
                      f"{human_bytes(top['start_bytes'])}, gradients "
                      f"{human_bytes(top['gradients_bytes'])}, activations "
                      f"{human_bytes(top['activations_bytes'])}"))  # fmt: skip
    items += [
        ("saved activations at their peak (plan)", share(t.resident_peak_bytes)),
        ("offloaded to host", share(t.host_bytes)),
        ("offloaded to disk", share(t.disk_bytes)),
        ("recomputed", share(t.recomputed_bytes)
         + (f", {human_flops(t.recomputed_flops)}" if t.recomputed_flops else "")),
        ("est. added step time", human_ms(t.est_overhead_ms)),
        *_step_time(plans),
        ("device / host / disk", " / ".join(human_bytes(n) for n in (
            t.resident_peak_bytes, t.host_bytes, t.disk_bytes))),
    ]
    if any(p.weights for p in plans):
        items.append(("streamed weights",
                      f"{human_bytes(sum(w.bytes for p in plans for w in p.weights))} in host "
                      f"memory, {human_bytes(sum(p.weight_h2d_bytes for p in plans))} copied per "
                      f"step, {human_bytes(sum(p.resident_weight_bytes for p in plans))} kept on "
                      "the device"))  # fmt: skip
    items += model_waste(plans)
    hosts = {p.options.get("host_budget") for p in plans} - {None}
    if hosts:
        items.append(("host budget", ", ".join(sorted(
            human_bytes(h) if isinstance(h, int) else str(h) for h in hosts))))  # fmt: skip
    assumed = {describe_assumptions(p.assumptions) for p in plans if p.assumptions}
    for line in sorted(assumed):  # the cost model's figures and where each came from
        items.append(("assumed", line))
    for p in plans:
        if p.name in t.over_budget and p.budget_bytes is not None and p.step is not None:
            items.append(("OVER BUDGET", f"with graph {p.name} the step peaks at "
                          f"{human_bytes(p.step['total_bytes'])} > {human_bytes(p.budget_bytes)}; "
                          "showing the smallest plan found"))  # fmt: skip
    return items


def _step_time(plans: Sequence[Plan]) -> list[tuple[str, str]]:
    """The predicted step time (compute and what the plan adds), each graph run once."""
    ms = [p.timeline["predicted_step_ms"] for p in plans
          if p.timeline and "predicted_step_ms" in p.timeline]  # fmt: skip
    if not ms:
        return []
    label = "predicted step time" + (" (each graph run once)" if len(plans) > 1 else "")
    return [(label, human_ms(float(sum(ms))))]


MASK_OPS = ("masked_fill", "where", "expand", "full", "_to_copy", "bitwise_and", "logical_and", "le", "lt")


def model_waste(plans: Sequence[Plan]) -> list[tuple[str, str]]:
    """What the model itself could stop keeping, where it is among the largest kept tensors:
    a loss's log-softmax over the vocabulary (float32, whatever the model's dtype), or an
    attention mask built as a sequence x sequence tensor. Said once each, with the fix."""
    items = []
    top = largest_kept(plans)
    soft = [a for a in top if a.op.startswith("_log_softmax")]
    if soft:
        a = soft[0]
        items.append(("in the model", f"the loss's {a.dtype} log-softmax over the vocabulary "
                      f"({shape_text(a.shape)}, {human_bytes(a.bytes)}) is among the largest "
                      "tensors kept: a chunked cross-entropy (the loss over slices of the "
                      "sequence) never holds it whole"))  # fmt: skip
    # batch x 1 x queries x keys: one mask broadcast over the heads
    masks = [a for a in top if a.op.split(".")[0] in MASK_OPS and len(a.shape) == 4
             and a.shape[1] == 1 and a.shape[2] == a.shape[3]]  # fmt: skip
    if masks:
        a = masks[0]
        items.append(("in the model", f"an attention mask built whole ({shape_text(a.shape)}, "
                      f"{human_bytes(a.bytes)}) is among the largest tensors kept: attention's "
                      "causal path (SDPA with is_causal and no mask tensor) never builds it"))  # fmt: skip
    return items


def largest_kept(plans: Sequence[Plan], n: int = 5) -> list[PlannedActivation]:
    """The ``n`` biggest tensors the plans keep on the device: what stands between a plan and a
    lower peak."""
    kept = [a for p in plans for a in p.activations if a.decision.kind == "keep"]
    return sorted(kept, key=lambda a: -a.bytes)[:n]


def graph_title(plan: Plan) -> str:
    budget = "none" if plan.budget_bytes is None else human_bytes(plan.budget_bytes)
    return (f"graph {plan.name}: {len(plan.activations)} saved tensors, baseline "
            f"{human_bytes(plan.baseline_saved_bytes)}, resident peak "
            f"{human_bytes(plan.resident_peak_bytes)}, budget {budget}")  # fmt: skip


@dataclass(frozen=True)
class SweepRow:
    """One budget of a ``--sweep`` and what the plans reached under it; ``fit``: the step's
    predicted peak and parts, against the card where one is given."""

    budget: str
    plans: Sequence[Plan]
    fit: StepFit | None = None

    def cells(self, card: bool = False) -> tuple[str, ...]:
        """The row; ``card``: with the :data:`CARD_COLUMN` cell."""
        t = totals(self.plans)
        budgets = [p.budget_bytes for p in self.plans if p.budget_bytes is not None]
        pct = 100 * t.resident_peak_bytes / t.baseline_saved_bytes if t.baseline_saved_bytes else 0
        cells = (self.budget, human_bytes(max(budgets)) if budgets else "none",
                 human_bytes(self.fit.total_bytes) if self.fit else "-",
                 human_bytes(t.resident_peak_bytes), f"{pct:.0f}%", human_bytes(t.offloaded_bytes),
                 human_bytes(t.recomputed_bytes), human_ms(t.est_overhead_ms),
                 "no" if t.over_budget else "yes")  # fmt: skip
        if not card:
            return cells
        room = None if self.fit is None else self.fit.room
        if room is None:
            return (*cells, "-")
        return (*cells, "yes" if room >= 0 else f"no, by {human_bytes(-room)}")


def _console(out: TextIO) -> Any:
    from rich.console import Console

    # Piped output has no terminal width; 80 columns would fold every reason into slivers. A
    # COLUMNS the user sets is the width, piped or not.
    columns = os.environ.get("COLUMNS", "")
    width = int(columns) if columns.isdigit() and int(columns) > 0 else None if out.isatty() else 200
    return Console(file=out, width=width, highlight=False, soft_wrap=False)


def print_plans(plans: Sequence[Plan], out: TextIO, *, heading: str = "",
                fit: StepFit | None = None) -> None:
    """A table of saved activations per graph, then the summary."""
    try:
        from rich import box
        from rich.table import Table
    except ImportError:
        out.write(plain_plans(plans, heading=heading, fit=fit))
        return
    console = _console(out)
    if heading:
        console.print(f"[bold]{heading}[/bold]")
    for plan in plans:
        table = Table(title=graph_title(plan), box=box.SIMPLE_HEAD, title_justify="left")
        for col in COLUMNS:
            table.add_column(col, justify="right" if col == "size" else "left",
                             overflow="fold", no_wrap=col in ("op", "size", "decision"))  # fmt: skip
        for a in plan.activations:
            cells = list(row_cells(a))
            cells[5] = f"[{_STYLE[a.decision.kind]}]{cells[5]}[/]"
            table.add_row(*cells)
        console.print(table)
        if plan.weights:
            table = Table(title=weights_title(plan), box=box.SIMPLE_HEAD, title_justify="left")
            for col in WEIGHT_COLUMNS:
                table.add_column(col, justify="right" if col in ("size", "per step") else "left",
                                 overflow="fold", no_wrap=col != "reason")  # fmt: skip
            for w in plan.weights:
                cells = list(weight_cells(w))
                cells[5] = f"[{_STYLE[w.decision]}]{cells[5]}[/]"
                table.add_row(*cells)
            console.print(table)
        for note in plan.notes:
            console.print(f"  note: {note}", markup=False)
    summary = Table(title="summary", show_header=False, box=box.ROUNDED, title_justify="left")
    summary.add_column(style="bold")
    summary.add_column()
    for label, value in summary_items(plans, fit):
        style = "bold red" if label in ALARMS else ""
        summary.add_row(label, value, style=style)
    console.print(summary)


def print_sweep(rows: Sequence[SweepRow], out: TextIO, *, heading: str = "") -> None:
    """Budget -> resident peak and estimated overhead, one row per budget (the Pareto view)."""
    card = any(r.fit is not None and r.fit.fits is not None for r in rows)
    columns = (*SWEEP_COLUMNS, CARD_COLUMN) if card else SWEEP_COLUMNS
    try:
        from rich import box
        from rich.table import Table
    except ImportError:
        out.write(_plain(columns, [r.cells(card) for r in rows], heading))
        return
    table = Table(title=heading or "budget sweep", box=box.SIMPLE_HEAD, title_justify="left")
    for col in columns:
        table.add_column(col, justify="left" if col == "budget" else "right")
    for r in rows:
        cells = r.cells(card)
        bad = cells[len(SWEEP_COLUMNS) - 1] == "no" or (card and cells[-1].startswith("no"))
        table.add_row(*cells, style="red" if bad else "")
    _console(out).print(table)


LENGTH_COLUMNS = ("strategy", "longest sequence", "step peak there", "predicted step time", "plans")


def length_rows(fits: Sequence[LongestFit]) -> list[tuple[str, ...]]:
    """One row per strategy of ``--max-seq``."""
    rows: list[tuple[str, ...]] = []
    for f in fits:
        if f.max_seq is None:
            rows.append((f.name, "none fits", "-", "-", str(len(f.probes))))
            continue
        longest = f"{f.max_seq}" + (" (the search's limit)" if f.capped else "")
        peak = human_bytes(f.total_bytes) if f.total_bytes is not None else "-"
        ms = human_ms(f.predicted_step_ms) if f.predicted_step_ms is not None else "-"
        rows.append((f.name, longest, peak, ms, str(len(f.probes))))
    return rows


def print_lengths(fits: Sequence[LongestFit], out: TextIO, *, heading: str) -> None:
    """``--max-seq``'s table: each strategy's longest sequence and its step there."""
    try:
        from rich import box
        from rich.table import Table
    except ImportError:
        out.write(_plain(LENGTH_COLUMNS, length_rows(fits), heading))
        return
    table = Table(title=heading, box=box.SIMPLE_HEAD, title_justify="left")
    for col in LENGTH_COLUMNS:
        table.add_column(col, justify="left" if col == "strategy" else "right")
    for row in length_rows(fits):
        table.add_row(*row)
    _console(out).print(table)


def plain_plans(plans: Sequence[Plan], *, heading: str = "", fit: StepFit | None = None) -> str:
    """The same tables as plain text, for terminals without ``rich``."""
    buf = io.StringIO()
    if heading:
        buf.write(heading + "\n")
    for plan in plans:
        buf.write(_plain(COLUMNS, [row_cells(a) for a in plan.activations], graph_title(plan)))
        if plan.weights:
            buf.write(_plain(WEIGHT_COLUMNS, [weight_cells(w) for w in plan.weights], weights_title(plan)))
        for note in plan.notes:
            buf.write(f"  note: {note}\n")
    buf.write(_plain(("summary", ""), summary_items(plans, fit), ""))
    return buf.getvalue()


def _plain(header: Sequence[str], rows: Sequence[Sequence[str]], title: str) -> str:
    widths = [max([len(h), *(len(r[i]) for r in rows)]) for i, h in enumerate(header)]
    lines = [title] if title else []
    lines.append("  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)).rstrip())
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    return "\n".join(lines) + "\n\n"
