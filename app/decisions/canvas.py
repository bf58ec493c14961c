"""The canvas a group reads: its answer template, `<turn|>`, padding to the width, and the noise
draws at the slots.

Noise is keyed by the request's seed and the canvas's own content (never by the canvas's position in
the decision), so a canvas reads the same whatever else the request asks: with `isolate`, neither the
question order nor added questions change any answer.
"""

from __future__ import annotations

import hashlib
import math
import random
from dataclasses import dataclass
from typing import Sequence

from app.decisions.errors import RequestError
from app.decisions.template import Template


@dataclass(frozen=True)
class Canvas:
    """A group's canvas before noise: the template, `<turn|>`, then padding to `width`."""

    ids: tuple[int, ...]
    slots: tuple[int, ...]
    label_ids: tuple[tuple[int, ...], ...]
    rows: int  # template + `<turn|>`: what the model reads (usage counts these)

    @property
    def width(self) -> int:
        return len(self.ids)


def build_canvas(template: Template, turn_close_id: int, pad_id: int, canvas_length: int, step: int) -> Canvas:
    """The template padded to a multiple of `step`; refused when it does not fit `canvas_length`."""
    rows = template.rows
    if rows > canvas_length:
        raise RequestError(
            f"answer template is {len(template.ids)} tokens; the canvas holds {canvas_length - 1}", ("questions",)
        )
    width = min(canvas_length, step * math.ceil(rows / step))
    ids = template.ids + (turn_close_id,) + (pad_id,) * (width - rows)
    return Canvas(ids=ids, slots=template.slots, label_ids=template.label_ids, rows=rows)


def content_seed(seed: int, content: Sequence[int], draw: int = 0) -> int:
    """A 63-bit seed from the request's seed, a token sequence (a canvas, a prompt) and a draw index.
    Stable across processes and machines (no Python `hash()`)."""
    digest = hashlib.blake2b(digest_size=8)
    digest.update(seed.to_bytes(16, "little", signed=True))
    digest.update(draw.to_bytes(4, "little"))
    digest.update(b"".join(int(token).to_bytes(4, "little") for token in content))
    return int.from_bytes(digest.digest(), "little") >> 1


def noised(canvas: Canvas, seed: int, vocab_size: int) -> tuple[int, ...]:
    """The canvas with each slot replaced by a uniformly drawn id (seeded, slot order)."""
    rng = random.Random(seed)
    out = list(canvas.ids)
    for slot in canvas.slots:
        out[slot] = rng.randrange(vocab_size)
    return tuple(out)


def draw_seeds(seed: int, canvas: Canvas, draws: range) -> list[int]:
    """The noise seed of each draw of this canvas."""
    return [content_seed(seed, canvas.ids, draw) for draw in draws]
