"""Images for the engine's tests: a small JPEG of one colour (the image processor pads every picture to
the same patch budget, so its shapes are a camera frame's)."""

from __future__ import annotations

import io


def jpeg(colour: tuple[int, int, int]) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (64, 48), colour).save(buffer, "JPEG")
    return buffer.getvalue()
