"""A generation's state between its steps, shared by the row path (generation.py) and the flat
turn's programs (app/engine/hf/flat/generate.py): the request's checks, the block being denoised, and
what has been produced."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from app.engine.base import EngineInputError, GenerateSpec

if TYPE_CHECKING:
    from transformers.cache_utils import DynamicCache


def check_spec(spec: GenerateSpec) -> None:
    """The request's sampler fields, as the row path checks them (a 400 naming the field)."""
    if not (math.isfinite(spec.temperature) and spec.temperature >= 0.0):
        raise EngineInputError(f"temperature must be a number >= 0, got {spec.temperature}", param="temperature")
    if not (math.isfinite(spec.top_p) and 0.0 < spec.top_p <= 1.0):
        raise EngineInputError(f"top_p must be in (0, 1], got {spec.top_p}", param="top_p")
    if spec.max_tokens < 0:
        raise EngineInputError(f"max_tokens must be >= 0, got {spec.max_tokens}", param="max_tokens")


@dataclass
class Block:
    """The block a generation is denoising."""

    canvas: torch.Tensor  # [1, width] the current noisy canvas
    positions: torch.Tensor  # [1, width]
    steps: int  # the step cap (the temperature schedule runs over it)
    remaining: int  # steps left, counting down
    conditioning: torch.Tensor | None = None  # the previous pass's processed logits
    history: list[torch.Tensor] = field(default_factory=list)  # the last argmax canvases


@dataclass
class Generation:
    """A generation in flight, stepped by `DiffusionRunner.step_generation`. Dropping it frees its
    cache; nothing else refers to it."""

    spec: GenerateSpec
    canvas_length: int
    cache: DynamicCache | None  # the prompt's KV, then every committed block's (None: the flat turn's store holds it)
    length: int  # tokens in `cache`
    prompt_tokens: int
    generator: torch.Generator
    stop: frozenset[int]
    produced: list[int] = field(default_factory=list)
    passes: int = 0  # denoise passes so far
    block: Block | None = None
    pending: list[int] | None = None  # a finished block's ids, committed by the next step
    done: bool = False
