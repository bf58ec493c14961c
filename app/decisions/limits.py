"""What one request may ask for: the server's limits and the defaults a request leaves out."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Limits:
    """What one request may ask for, and the defaults of what it leaves out. Built from
    `Settings` by `app.build.limits`; every value is defined in `app.config`."""

    max_questions: int
    max_samples: int
    max_think: int
    max_steps: int
    max_id_length: int
    max_images: int
    max_image_bytes: int
    max_total_image_bytes: int
    confidence: str
    isolate: bool
    default_seed: int
    auto_max: int
    auto_threshold: float
    debias: str  # the `debias` of a request that sends none
