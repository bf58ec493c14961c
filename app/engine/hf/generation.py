"""Block diffusion for generations, the sampler's side of it: a generation's state between its turns
(the request's checks, the block being denoised, what it has produced), and `BlockDiffusion`, what
happens around each denoise pass: a block's first canvas, the sampler step after a pass, and a
finished block cut at a stop id or `max_tokens`. The passes themselves are the flat turn's
(app/engine/hf/generations.py steps a generation through them)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch

from app.engine.base import EngineInputError, GenerateChunk, GenerateSpec
from app.engine.hf.sampler import sample_step, temperature_at


def check_spec(spec: GenerateSpec) -> None:
    """The request's sampler fields (a 400 naming the field)."""
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
    """A generation in flight: what the sampler keeps between its passes (its KV is its sequence's,
    in the flat turn's store)."""

    spec: GenerateSpec
    canvas_length: int
    length: int  # tokens written (the prompt, then every committed block)
    prompt_tokens: int
    generator: torch.Generator
    stop: frozenset[int]
    produced: list[int] = field(default_factory=list)
    passes: int = 0  # denoise passes so far
    block: Block | None = None
    pending: list[int] | None = None  # a finished block's ids, committed by the next turn
    done: bool = False


class BlockDiffusion:
    """The sampler's side of block diffusion, for one model: `settings` the checkpoint's generation
    settings (GENERATION_DEFAULTS' names), `logits` its head over hidden states."""

    def __init__(self, settings: dict[str, float], vocab_size: int, device: torch.device, dtype: torch.dtype,
                 logits: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.settings = settings
        self.vocab_size = vocab_size
        self.device = device
        self.dtype = dtype
        self.logits = logits

    def next_block(self, gen: Generation) -> Block:
        """The block `gen` is denoising: a new random canvas when it has none, as wide as the tokens
        still wanted (in steps of 16), at most its canvas length."""
        if gen.block is None:
            remaining_tokens = gen.spec.max_tokens - len(gen.produced)
            width = min(gen.canvas_length, max(16, 16 * math.ceil(remaining_tokens / 16)))
            canvas = torch.randint(0, self.vocab_size, (1, width), generator=gen.generator, device=self.device)
            positions = (gen.length + torch.arange(width, device=self.device)).unsqueeze(0)
            steps = int(self.settings["max_denoising_steps"])
            gen.block = Block(canvas=canvas, positions=positions, steps=steps, remaining=steps)
        return gen.block

    def sample_pass(self, gen: Generation, block: Block, hidden: torch.Tensor) -> list[int] | None:
        """The sampler step after a decoder pass over `block` (its hidden states [1, width, H]): the
        block's next canvas and self-conditioning; its argmax ids once it is stable and confident or
        out of steps, else None."""
        settings = self.settings
        gen.passes += 1
        temperature = gen.spec.temperature * temperature_at(block.remaining, block.steps, settings["t_min"],
                                                            settings["t_max"])
        step = sample_step(self.logits(hidden)[0], temperature, top_p=gen.spec.top_p,
                           entropy_bound=settings["entropy_bound"], vocab_size=self.vocab_size,
                           generator=gen.generator)
        block.canvas = step.tokens.unsqueeze(0)
        block.conditioning = step.conditioning.unsqueeze(0).to(self.dtype)
        block.remaining -= 1
        stable_needed = int(settings["stability_threshold"]) + 1
        block.history = (block.history + [step.argmax])[-stable_needed:]
        finished = block.remaining == 0
        if len(block.history) >= stable_needed and all(torch.equal(h, step.argmax) for h in block.history):
            finished = finished or float(step.entropy.mean()) < settings["confidence_threshold"]
        return [int(t) for t in step.argmax.tolist()] if finished else None

    def end_block(self, gen: Generation, block_ids: list[int]) -> GenerateChunk:
        """A finished block's ids taken up to a stop id and `max_tokens`: the chunk it gives, and the
        block left to commit unless the generation is done."""
        remaining_tokens = gen.spec.max_tokens - len(gen.produced)
        gen.block = None
        cut = next((i for i, token in enumerate(block_ids) if token in gen.stop), None)
        take = (block_ids if cut is None else block_ids[:cut])[:remaining_tokens]
        gen.produced.extend(take)
        stopped = cut is not None and cut < remaining_tokens
        if stopped or len(gen.produced) >= gen.spec.max_tokens:
            gen.done = True
        else:
            gen.pending = block_ids
        return GenerateChunk(ids=tuple(take), done=gen.done, stopped=stopped, prompt_tokens=gen.prompt_tokens,
                             passes=gen.passes)
