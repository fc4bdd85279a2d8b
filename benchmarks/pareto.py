"""A Pareto plot as a standalone SVG: measured peak against step time, one labelled point per
method, the points no other method beats on both counts joined by a line. No dependency."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any
from xml.sax.saxutils import escape

W, H, PAD_L, PAD_R, PAD_T, PAD_B = 860, 520, 70, 280, 30, 50
COLOURS = {"fxckpt": "#d62728", "torch": "#1f77b4", "eager": "#444444"}


def family(method: str) -> str:
    if method.startswith("fxckpt"):
        return "fxckpt"
    if method in ("compiled", "torch_offload") or method.startswith("torch_budget"):
        return "torch"
    return "eager"


def frontier(points: Sequence[tuple[float, float]]) -> list[int]:
    """Indices of the points no other point beats on both x and y (lower is better)."""
    keep = []
    for i, (x, y) in enumerate(points):
        beaten = any((x2 <= x and y2 <= y) and (x2 < x or y2 < y)
                     for j, (x2, y2) in enumerate(points) if j != i)
        if not beaten:
            keep.append(i)
    return sorted(keep, key=lambda i: points[i][0])


def svg(rows: Sequence[dict[str, Any]], title: str, x_label: str, y_label: str) -> str:
    """``rows``: dicts with ``method``, ``x`` and ``y``."""
    xs = [r["x"] for r in rows]
    ys = [r["y"] for r in rows]
    x0, x1 = min(xs), max(xs)
    y0, y1 = 0.0, max(ys)
    x0, x1 = x0 - 0.05 * (x1 - x0 or 1), x1 + 0.05 * (x1 - x0 or 1)
    y1 = y1 * 1.08 or 1.0

    def px(x: float) -> float:
        return PAD_L + (x - x0) / (x1 - x0) * (W - PAD_L - PAD_R)

    def py(y: float) -> float:
        return H - PAD_B - (y - y0) / (y1 - y0) * (H - PAD_T - PAD_B)

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" '
           f'font-family="sans-serif" font-size="11">',
           f'<rect width="{W}" height="{H}" fill="white"/>',
           f'<text x="{PAD_L}" y="18" font-size="13">{escape(title)}</text>']
    for k in range(6):  # grid and ticks
        gx, gy = x0 + (x1 - x0) * k / 5, y0 + (y1 - y0) * k / 5
        out.append(f'<line x1="{px(gx):.1f}" y1="{PAD_T}" x2="{px(gx):.1f}" y2="{H - PAD_B}" '
                   'stroke="#eee"/>')
        out.append(f'<line x1="{PAD_L}" y1="{py(gy):.1f}" x2="{W - PAD_R}" y2="{py(gy):.1f}" '
                   'stroke="#eee"/>')
        out.append(f'<text x="{px(gx):.1f}" y="{H - PAD_B + 14}" text-anchor="middle">'
                   f'{gx:.2f}</text>')
        out.append(f'<text x="{PAD_L - 6}" y="{py(gy) + 4:.1f}" text-anchor="end">{gy:.1f}</text>')
    out.append(f'<text x="{(PAD_L + W - PAD_R) / 2}" y="{H - 12}" text-anchor="middle">'
               f'{escape(x_label)}</text>')
    out.append(f'<text x="16" y="{(PAD_T + H - PAD_B) / 2}" text-anchor="middle" '
               f'transform="rotate(-90 16 {(PAD_T + H - PAD_B) / 2})">{escape(y_label)}</text>')
    front = frontier(list(zip(xs, ys, strict=True)))
    line = " ".join(f"{px(xs[i]):.1f},{py(ys[i]):.1f}" for i in front)
    out.append(f'<polyline points="{line}" fill="none" stroke="#999" stroke-dasharray="4 3"/>')
    # Points carry numbers; the key on the right names them (clustered labels would collide).
    legend_y = PAD_T + 10
    for k, r in enumerate(rows, start=1):
        colour = COLOURS[family(r["method"])]
        cx, cy = px(r["x"]), py(r["y"])
        out.append(f'<circle cx="{cx:.1f}" cy="{cy:.1f}" r="4" fill="{colour}"/>')
        out.append(f'<text x="{cx + 5:.1f}" y="{cy - 5 - 8 * (k % 3):.1f}" fill="{colour}" '
                   f'font-size="10">{k}</text>')
        out.append(f'<text x="{W - PAD_R + 14}" y="{legend_y}" fill="{colour}">{k}: '
                   f'{escape(r["method"])} ({r["x"]:.2f}x, {r["y"]:.1f})</text>')
        legend_y += 14
    out.append(f'<text x="{W - PAD_R + 14}" y="{legend_y + 8}" fill="#777">dashed: the Pareto '
               'front; red fxckpt, blue torch, grey eager</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def write(path: Path, rows: Sequence[dict[str, Any]], title: str, x_label: str,
          y_label: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(svg(rows, title, x_label, y_label))
