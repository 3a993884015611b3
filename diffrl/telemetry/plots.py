"""The report's pictures, drawn with Pillow: a line plot with round ticks, images side by side.

A line plot needs no plotting library: `line_plot` draws series of {step: value} on one pair of
axes with `nice_ticks` (1, 2, 2.5 or 5 times a power of ten) and a legend; `side_by_side` puts
labelled images next to each other. Apart from `report` (what the report says) because they
know nothing of runs or metrics; the benchmarks draw their own curves with `line_plot` too.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont

from diffrl.files import atomic_file


def side_by_side(images: list[Path], labels: list[str], out: Path) -> Path:
    """The images next to each other, each with its label above it."""
    opened = [Image.open(p).convert("RGB") for p in images]
    font = ImageFont.load_default()
    label_h, gap = 16, 8
    width = sum(i.width for i in opened) + gap * (len(opened) + 1)
    height = max(i.height for i in opened) + label_h + 2 * gap
    canvas = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(canvas)
    x = gap
    for image, label in zip(opened, labels, strict=True):
        draw.text((x, gap // 2), label, fill="black", font=font)
        canvas.paste(image, (x, gap + label_h))
        x += image.width + gap
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(out) as tmp:
        canvas.save(tmp)
    return out


def nice_ticks(lo: float, hi: float, count: int = 5, *, integer: bool = False) -> list[float]:
    """Round tick values, 1, 2, 2.5 or 5 times a power of ten apart, from at or below `lo` to at or
    above `hi`, about `count` of them (an axis then reads 0, 0.25, 0.5, ... rather than 0.0469,
    0.211, ...). `integer`: whole-number steps only (training steps). A flat range gets one unit
    around it."""
    if not (math.isfinite(lo) and math.isfinite(hi)) or hi < lo or count < 2:
        raise ValueError(f"nice_ticks needs finite lo <= hi and count >= 2, got {lo}, {hi}, {count}")
    if hi == lo:
        lo, hi = lo - 0.5, hi + 0.5
    power = math.floor(math.log10((hi - lo) / (count - 1)))
    multiples = (1, 2, 5) if integer else (1, 2, 2.5, 5)
    steps = sorted(m * 10.0**p for p in range(power - 1, power + 2) for m in multiples)
    if integer:
        steps = [step for step in steps if step >= 1 and step == round(step)] or [1.0]
    for step in steps:  # the finest step that needs at most count + 1 ticks
        first, last = math.floor(lo / step + 1e-9), math.ceil(hi / step - 1e-9)
        if last - first + 1 <= count + 1:
            break
    # round away float noise (0.30000000000000004) so labels print as the round numbers they are
    return [round(i * step, 10) for i in range(first, last + 1)]


def line_plot(
    series: Sequence[tuple],
    out: Path,
    *,
    title: str = "",
    size: tuple[int, int] = (800, 420),
) -> Path:
    """A line plot of `(label, {step: value}, rgb[, line width[, connect]])` series sharing one x
    (step) and one y axis; the legend is a column right of the plot. A series with connect=False
    is drawn as points only."""
    series = [(*entry, 2, True)[:5] if len(entry) == 3 else (*entry, True)[:5] for entry in series]
    width, height = size
    font = ImageFont.load_default()
    measure = ImageDraw.Draw(Image.new("RGB", (1, 1)))
    legend_w = max((measure.textlength(entry[0], font=font) for entry in series), default=0)
    left, right, top, bottom = 60, int(legend_w) + 40, 30, 50
    points = [(s, v) for _, data, _, _, _ in series for s, v in data.items() if math.isfinite(v)]
    image = Image.new("RGB", size, "white")
    draw = ImageDraw.Draw(image)
    draw.text((left, 8), title, fill="black", font=font)
    if not points:
        out.parent.mkdir(parents=True, exist_ok=True)
        with atomic_file(out) as tmp:
            image.save(tmp)
        return out
    x_ticks = nice_ticks(min(p[0] for p in points), max(p[0] for p in points), integer=True)
    y_ticks = nice_ticks(min(p[1] for p in points), max(p[1] for p in points))
    (x_lo, x_hi), (y_lo, y_hi) = (x_ticks[0], x_ticks[-1]), (y_ticks[0], y_ticks[-1])

    def xy(step: float, value: float) -> tuple[float, float]:
        return (
            left + (step - x_lo) / (x_hi - x_lo) * (width - left - right),
            top + (y_hi - value) / (y_hi - y_lo) * (height - top - bottom),
        )

    for value in y_ticks:
        y = xy(x_lo, value)[1]
        draw.line([left, y, width - right, y], fill=(225, 225, 225))  # grid: read values across
        draw.line([left - 4, y, left, y], fill="black")
        draw.text((4, y - 6), f"{value:g}", fill="black", font=font)
    for step in x_ticks:
        x = xy(step, y_lo)[0]
        draw.line([x, height - bottom, x, height - bottom + 4], fill="black")
        draw.text((x - 10, height - bottom + 6), f"{step:g}", fill="black", font=font)
    draw.rectangle([left, top, width - right, height - bottom], outline="black")
    draw.text((width // 2 - 10, height - 18), "step", fill="black", font=font)
    legend_x, legend_y = width - right + 12, top
    for label, data, color, line_width, connect in series:
        coords = [xy(s, v) for s, v in sorted(data.items()) if math.isfinite(v)]
        if connect and len(coords) > 1:
            draw.line(coords, fill=color, width=line_width)
        for cx, cy in coords if len(coords) < 40 or not connect else []:
            draw.ellipse([cx - 3, cy - 3, cx + 3, cy + 3], fill=color)
        draw.line([legend_x - 10, legend_y + 6, legend_x - 2, legend_y + 6], fill=color, width=line_width)
        draw.text((legend_x, legend_y), label, fill=color, font=font)
        legend_y += 14
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(out) as tmp:
        image.save(tmp)
    return out


__all__ = ["line_plot", "nice_ticks", "side_by_side"]
