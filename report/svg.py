"""Plots as inline SVG for an HTML5 page (no XML declaration, no namespace), drawn here: no plotting library."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from html import escape

WIDTH, HEIGHT = 680, 340
LEFT, RIGHT, TOP, BOTTOM = 70, 20, 56, 52
PLOT_W, PLOT_H = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
FONT = 'font-family="system-ui, sans-serif"'
GRID = "#e5e5e5"
AXIS = "#444"


@dataclass(frozen=True)
class Series:
    name: str
    color: str
    values: Sequence[float]  # bars: one value per category; lines: sorted samples


def _text(x: float, y: float, text: str, *, anchor: str = "middle", size: int = 12, extra: str = "") -> str:
    return (f'<text x="{x:.1f}" y="{y:.1f}" text-anchor="{anchor}" {FONT} font-size="{size}" {extra}>'
            f"{escape(text)}</text>")


def _frame(title: str, x_label: str, y_label: str, body: list[str], legend: Sequence[Series] = ()) -> str:
    parts = [f'<svg class="plot" width="{WIDTH}" height="{HEIGHT}" viewBox="0 0 {WIDTH} {HEIGHT}" role="img" '
             f'aria-label="{escape(title)}">',
             f"<title>{escape(title)}</title>",
             _text(WIDTH / 2, 20, title, size=14, extra='font-weight="bold"'),
             *body,
             f'<line x1="{LEFT}" y1="{TOP + PLOT_H}" x2="{LEFT + PLOT_W}" y2="{TOP + PLOT_H}" stroke="{AXIS}"/>',
             f'<line x1="{LEFT}" y1="{TOP}" x2="{LEFT}" y2="{TOP + PLOT_H}" stroke="{AXIS}"/>',
             _text(LEFT + PLOT_W / 2, HEIGHT - 12, x_label),
             _text(16, TOP + PLOT_H / 2, y_label, extra=f'transform="rotate(-90 16 {TOP + PLOT_H / 2:.1f})"')]
    x, y = float(LEFT), TOP - 16  # a row between the title and the plot: it hides no data
    for series in legend:
        parts.append(f'<rect x="{x:.1f}" y="{y - 9}" width="12" height="12" fill="{series.color}"/>')
        parts.append(_text(x + 18, y + 1, series.name, anchor="start"))
        x += 18 + 7 * len(series.name) + 24  # about 7 px per character at 12 px
    parts.append("</svg>")
    return "\n".join(parts)


def nice_step(span: float, ticks: int = 5) -> float:
    """A step of 1, 2 or 5 times a power of ten that cuts `span` into about `ticks` parts."""
    if span <= 0:
        return 1.0
    raw = span / ticks
    power = 10.0 ** math.floor(math.log10(raw))
    return next(m * power for m in (1, 2, 5, 10) if m * power >= raw)


def _y_axis(top: float, *, fraction: bool = False) -> tuple[list[str], float]:
    """Horizontal grid lines and labels from 0 to a nice value >= top; returns them and that value."""
    step = 0.2 if fraction else nice_step(top)
    high = 1.0 if fraction else max(step, math.ceil(top / step) * step)
    parts = []
    for i in range(round(high / step) + 1):
        value = i * step
        y = TOP + PLOT_H - value / high * PLOT_H
        parts.append(f'<line x1="{LEFT}" y1="{y:.1f}" x2="{LEFT + PLOT_W}" y2="{y:.1f}" stroke="{GRID}"/>')
        label = f"{value:.0%}" if fraction else f"{value:g}"
        parts.append(_text(LEFT - 6, y + 4, label, anchor="end"))
    return parts, high


def stacked_bars(title: str, categories: Sequence[str], series: Sequence[Series], *, x_label: str, y_label: str) -> str:
    """One bar per category, the series stacked in it (bottom first); the count written above each bar."""
    totals = [sum(s.values[i] for s in series) for i in range(len(categories))]
    body, high = _y_axis(max(totals, default=0) or 1)
    slot = PLOT_W / max(1, len(categories))
    width = slot * 0.6
    for i, category in enumerate(categories):
        x = LEFT + i * slot + (slot - width) / 2
        base = 0.0
        for s in series:
            value = s.values[i]
            if value <= 0:
                continue
            y0, y1 = TOP + PLOT_H - base / high * PLOT_H, TOP + PLOT_H - (base + value) / high * PLOT_H
            body.append(f'<rect x="{x:.1f}" y="{y1:.1f}" width="{width:.1f}" height="{y0 - y1:.1f}" '
                        f'fill="{s.color}"><title>{escape(f"{category}, {s.name}: {value:g}")}</title></rect>')
            base += value
        if totals[i]:
            body.append(_text(x + width / 2, TOP + PLOT_H - totals[i] / high * PLOT_H - 4, f"{totals[i]:g}"))
        body.append(_text(x + width / 2, TOP + PLOT_H + 16, category))
    return _frame(title, x_label, y_label, body, legend=series)


def log_histogram(title: str, values: Sequence[float], *, low_exp: int, high_exp: int, bins_per_decade: int,
                  x_label: str, y_label: str, marker: tuple[float, str] | None = None) -> str:
    """Counts of values in log-spaced bins from 10**low_exp to 10**high_exp; smaller values (0 too) fall in the
    first bin, larger ones in the last. `marker` draws a dashed vertical line (a threshold) with its label."""
    n_bins = (high_exp - low_exp) * bins_per_decade
    counts = [0] * n_bins
    for value in values:
        position = (math.log10(value) - low_exp) * bins_per_decade if value > 0 else 0.0
        counts[min(n_bins - 1, max(0, math.floor(position)))] += 1
    body, high = _y_axis(max(counts, default=0) or 1)
    bin_w = PLOT_W / n_bins
    over = "#e15759"  # bins at or beyond the marker

    def x_of(exp: float) -> float:
        return LEFT + (exp - low_exp) / (high_exp - low_exp) * PLOT_W

    for exp in range(low_exp, high_exp + 1):
        x = x_of(exp)
        body.append(f'<line x1="{x:.1f}" y1="{TOP + PLOT_H}" x2="{x:.1f}" y2="{TOP + PLOT_H + 5}" stroke="{AXIS}"/>')
        body.append(_text(x, TOP + PLOT_H + 18, f"1e{exp}" if exp else "1"))
    for i, count in enumerate(counts):
        if count:
            h = count / high * PLOT_H
            x = LEFT + i * bin_w
            lo = 10 ** (low_exp + i / bins_per_decade)
            hi = 10 ** (low_exp + (i + 1) / bins_per_decade)
            color = over if marker is not None and lo >= marker[0] * 0.999 else "#4e79a7"
            body.append(f'<rect x="{x + 1:.1f}" y="{TOP + PLOT_H - h:.1f}" width="{bin_w - 2:.1f}" height="{h:.1f}" '
                        f'fill="{color}"><title>{escape(f"{lo:.1e} to {hi:.1e}: {count}")}</title></rect>')
    if marker is not None and marker[0] > 0:
        x = x_of(min(high_exp, max(low_exp, math.log10(marker[0]))))
        body.append(f'<line x1="{x:.1f}" y1="{TOP}" x2="{x:.1f}" y2="{TOP + PLOT_H}" stroke="#e15759" '
                    'stroke-dasharray="5,4" stroke-width="2"/>')
        body.append(_text(x - 4, TOP + 14, marker[1], anchor="end", extra='fill="#e15759"'))
    return _frame(title, x_label, y_label, body)


def cdf(title: str, series: Sequence[Series], *, x_label: str, y_label: str, unit_scale: float = 1.0,
        unit: str = "", marks: Sequence[float] = (0.5, 0.99)) -> str:
    """One step line per series of sorted samples (times unit_scale on the x axis), share of samples on the y
    axis; the quantiles in `marks` are dots with their value."""
    top = max((v * unit_scale for s in series for v in s.values[-1:]), default=0.0) or 1.0
    step = nice_step(top)
    high_x = max(step, math.ceil(top / step) * step)
    body, _ = _y_axis(1.0, fraction=True)
    for i in range(round(high_x / step) + 1):
        x = LEFT + i * step / high_x * PLOT_W
        body.append(f'<line x1="{x:.1f}" y1="{TOP + PLOT_H}" x2="{x:.1f}" y2="{TOP + PLOT_H + 5}" stroke="{AXIS}"/>')
        body.append(_text(x, TOP + PLOT_H + 18, f"{i * step:g}"))

    def point(value: float, share: float) -> tuple[float, float]:
        return LEFT + value * unit_scale / high_x * PLOT_W, TOP + PLOT_H - share * PLOT_H

    for s in series:
        n = len(s.values)
        if not n:
            continue
        coords = [point(s.values[0], 0.0)]
        for i, value in enumerate(s.values):
            coords += [point(value, i / n), point(value, (i + 1) / n)]
        path = " ".join(f"{x:.1f},{y:.1f}" for x, y in coords)
        body.append(f'<polyline points="{path}" fill="none" stroke="{s.color}" stroke-width="2"/>')
        for q in marks:
            value = s.values[max(0, math.ceil(q * n) - 1)]
            x, y = point(value, q)
            body.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3.5" fill="{s.color}">'
                        f'<title>{escape(f"{s.name} p{q * 100:g}: {value * unit_scale:.3g}")}</title></circle>')
    # The marked quantiles' values go in the legend: labels next to the dots collide.
    legend = [Series(_with_marks(s, marks, unit_scale, unit), s.color, ()) for s in series]
    return _frame(title, x_label, y_label, body, legend=legend)


def _with_marks(series: Series, marks: Sequence[float], unit_scale: float, unit: str) -> str:
    n = len(series.values)
    if not n:
        return f"{series.name}: no samples"
    values = [series.values[max(0, math.ceil(q * n) - 1)] * unit_scale for q in marks]
    return series.name + "".join(f", p{q * 100:g} {v:.3g}{unit}" for q, v in zip(marks, values, strict=True))
