"""The reliability diagram of `djev eval` as a PNG, drawn with Pillow: one panel per bucket (and
one for all questions), each bin's accuracy as a bar against the diagonal of perfect calibration,
the bin's mean confidence as a tick, and the bucket's ECE in the title."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Mapping

PANEL = 260  # pixels a side of one panel's plot area
MARGIN = 34
COLUMNS = 3


def draw_reliability(panels: Mapping[str, dict], path: Path) -> None:
    """`panels`: title -> a metrics JSON (`Metrics.as_json`: count, ece, bins); written to `path`."""
    from PIL import Image, ImageDraw, ImageFont

    titles = list(panels)
    columns = min(COLUMNS, max(1, len(titles)))
    rows = max(1, math.ceil(len(titles) / columns))
    cell = PANEL + 2 * MARGIN
    image = Image.new("RGB", (columns * cell, rows * cell), "white")
    draw = ImageDraw.Draw(image)
    font = ImageFont.load_default()
    for index, title in enumerate(titles):
        metrics = panels[title]
        left = (index % columns) * cell + MARGIN
        top = (index // columns) * cell + MARGIN
        right, bottom = left + PANEL, top + PANEL
        draw.rectangle((left, top, right, bottom), outline="black")
        draw.line((left, bottom, right, top), fill=(160, 160, 160))  # perfect calibration
        for b in metrics["bins"]:
            x0 = left + b["lower"] * PANEL
            x1 = left + b["upper"] * PANEL
            if b["count"]:
                draw.rectangle((x0 + 1, bottom - b["accuracy"] * PANEL, x1 - 1, bottom),
                               fill=(70, 120, 200), outline=(40, 80, 150))
                y = bottom - b["confidence"] * PANEL
                draw.line((x0 + 1, y, x1 - 1, y), fill=(220, 60, 40), width=2)
        draw.text((left, top - 26), f"{title}: n={metrics['count']} ECE={metrics['ece']:.3f}", fill="black", font=font)
        draw.text((left, bottom + 4), "confidence 0 .. 1", fill=(90, 90, 90), font=font)
        draw.text((left - MARGIN + 2, top - 12), "accuracy", fill=(90, 90, 90), font=font)
    image.save(path, format="PNG")
