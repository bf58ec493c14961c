"""A small line plot drawn with Pillow (a project dependency), for benches that run where matplotlib is
not installed: panels stacked one above the other, sharing the x axis, each with its own y scale,
ticks, labels and a legend. Missing points (None or NaN) break the line."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

COLORS = ((31, 119, 180), (214, 39, 40), (44, 160, 44), (148, 103, 189))
WIDTH, PANEL_HEIGHT = 760, 300
LEFT, RIGHT, TOP, BOTTOM = 80, 24, 36, 44  # margins around each panel's plot area


@dataclass(frozen=True)
class Series:
    name: str
    ys: Sequence[float | None]


@dataclass(frozen=True)
class Panel:
    y_label: str
    series: Sequence[Series]
    y_max: float | None = None  # None: the largest value, rounded up to a tick


def nice_ticks(top: float, count: int = 5) -> list[float]:
    """0 up to at least `top` in round steps (1, 2 or 5 times a power of ten)."""
    if not top > 0:
        return [0.0, 1.0]
    raw = top / count
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    return [step * i for i in range(int(math.ceil(top / step - 1e-9)) + 1)]


def label(value: float) -> str:
    return f"{value:.0f}" if value == int(value) else f"{value:g}"


def _finite(value: float | None) -> bool:
    return value is not None and not math.isnan(value)


def plot_panels(path: str | Path, title: str, x_label: str, xs: Sequence[float], panels: Sequence[Panel]) -> Path:
    """Draw the panels over the points `xs` (each series has one y per x) and save a PNG at `path`."""
    from PIL import Image, ImageDraw, ImageFont

    font = ImageFont.load_default()
    height = 28 + PANEL_HEIGHT * len(panels)
    image = Image.new("RGB", (WIDTH, height), "white")
    draw = ImageDraw.Draw(image)
    draw.text((LEFT, 8), title, fill="black", font=font)
    x_ticks = sorted(set(xs))
    x_low, x_high = (min(x_ticks), max(x_ticks)) if x_ticks else (0.0, 1.0)
    if x_high == x_low:
        x_low, x_high = x_low - 1, x_high + 1
    for index, panel in enumerate(panels):
        top = 28 + index * PANEL_HEIGHT + TOP
        bottom = 28 + (index + 1) * PANEL_HEIGHT - BOTTOM
        left, right = LEFT, WIDTH - RIGHT
        values = [y for s in panel.series for y in s.ys if _finite(y)]
        y_ticks = nice_ticks(panel.y_max if panel.y_max is not None else max(values, default=1.0))
        y_high = y_ticks[-1]

        def px(x: float) -> float:
            return left + (x - x_low) / (x_high - x_low) * (right - left)

        def py(y: float) -> float:
            return bottom - y / y_high * (bottom - top)

        for tick in y_ticks:  # grid, y ticks and their labels
            draw.line([(left, py(tick)), (right, py(tick))], fill=(225, 225, 225))
            text = label(tick)
            draw.text((left - 8 - draw.textlength(text, font=font), py(tick) - 5), text, fill="black", font=font)
        for tick in x_ticks:
            draw.line([(px(tick), bottom), (px(tick), bottom + 4)], fill="black")
            text = label(tick)
            draw.text((px(tick) - draw.textlength(text, font=font) / 2, bottom + 7), text, fill="black", font=font)
        draw.rectangle([left, top, right, bottom], outline="black")
        draw.text((left - 70, top - 16), panel.y_label, fill="black", font=font)
        draw.text(((left + right) / 2 - draw.textlength(x_label, font=font) / 2, bottom + 22), x_label,
                  fill="black", font=font)
        for number, series in enumerate(panel.series):
            color = COLORS[number % len(COLORS)]
            points = [(px(x), py(y)) for x, y in zip(xs, series.ys) if _finite(y)]  # type: ignore[arg-type]
            if len(points) > 1:
                draw.line(points, fill=color, width=2)
            for x, y in points:
                draw.ellipse([x - 3, y - 3, x + 3, y + 3], fill=color)
            legend_y = top + 8 + 14 * number  # the legend, top right inside the plot area
            draw.line([(right - 150, legend_y + 5), (right - 130, legend_y + 5)], fill=color, width=2)
            draw.text((right - 124, legend_y), series.name, fill="black", font=font)
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    image.save(target, "PNG")
    return target
