"""Image checks before a decision reaches the engine: a real image of a format we read, within the
pixel limit. Only the header is read here (PIL opens lazily); nothing is decoded."""

from __future__ import annotations

import io
import warnings
from typing import Sequence

from app.engine.base import ImageInput
from app.web.errors import HTTPError

FORMATS = {"JPEG", "PNG", "WEBP", "GIF", "BMP"}


def check_images(images: Sequence[ImageInput], max_pixels: int) -> None:
    from PIL import Image

    for image in images:
        where = image.source
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error", Image.DecompressionBombWarning)
                with Image.open(io.BytesIO(image.data)) as opened:
                    kind, (width, height) = opened.format, opened.size
        except Image.DecompressionBombWarning:
            raise HTTPError(400, f"{where}: the image has too many pixels", param=where) from None
        except Exception:  # noqa: BLE001 - whatever PIL cannot open is not an image we read
            raise HTTPError(422, f"{where}: not an image (JPEG, PNG, WebP, GIF or BMP)", param=where,
                            loc=(where,)) from None
        if kind not in FORMATS:
            raise HTTPError(422, f"{where}: {kind} images are not supported (JPEG, PNG, WebP, GIF or BMP)",
                            param=where, loc=(where,))
        if width * height > max_pixels:
            raise HTTPError(400, f"{where}: {width}x{height} is more than {max_pixels} pixels", param=where)
