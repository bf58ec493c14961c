"""Block-diffusion generation, step by step: the part of DiffusionRunner that writes thoughts and raw
completions.

A generation owns a KV cache of its own (the prompt, then every committed block). Each call of
`step_generation` runs exactly one model pass, so the batching loop can put reads between any two:
a denoise pass of the current block (decoder, self-conditioned after the first, through the decoder
graphs when they are on), or, right after a block finished, that block's commit through the encoder
(its own step). A block finishes when its argmax canvas is stable and confident, or at the step cap
(random weights never stop early: every block takes all its passes).

The sampler step is app/engine/hf/sampler.py's, shared with multi-step reads; `temperature` scales the
checkpoint's t_max -> t_min schedule (0 = greedy: argmax everywhere, seed-independent), `top_p`
keeps each position's nucleus.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import TYPE_CHECKING, Generator, cast

import torch

from app.engine.base import CacheKey, GenerateChunk, GenerateResult, GenerateSpec, Prompt
from app.engine.hf.generation_state import Block, Generation, check_spec
from app.engine.hf.prompts import EncodedPrompt, Preprocessed, PromptCache, cache_kv
from app.engine.hf.sampler import sample_step, temperature_at

if TYPE_CHECKING:
    from transformers import DiffusionGemmaForBlockDiffusion
    from transformers.cache_utils import DynamicCache

    from app.engine.hf.flat.engine import FlatEngine
    from app.engine.hf.flat.host import Host
    from app.engine.hf.graphs.decoder import DecoderGraphs


class GenerationMixin:
    """Generation for DiffusionRunner (which provides the model, the graphs, the stats and the
    prompt encoding these methods use)."""

    model: DiffusionGemmaForBlockDiffusion
    graphs: DecoderGraphs | None
    device: torch.device
    vocab_size: int
    generation: dict[str, float]
    stats: Counter[str]
    prompts: PromptCache[CacheKey, EncodedPrompt]
    flat: FlatEngine | None

    if TYPE_CHECKING:  # PromptEncodingMixin's and DiffusionRunner's own
        def _encode_into_cache(self, prompt: Prompt, preprocessed: Preprocessed | None = None) -> tuple[DynamicCache, int]:
            ...

        def cache_holding(self, encoded: EncodedPrompt) -> DynamicCache: ...

        def needs_chunks(self, prompt: Prompt) -> bool: ...

        def encode_steps(self, prompt: Prompt, preprocessed: Preprocessed | None = None) -> Generator[None, None, EncodedPrompt]:
            ...

        def seeded_generator(self, seed: int) -> torch.Generator: ...

        def logits(self, hidden: torch.Tensor) -> torch.Tensor: ...

        def finish_turn(self) -> None: ...

    def start_generation(
        self, spec: GenerateSpec, canvas_length: int, preprocessed: Preprocessed | None = None,
    ) -> Generation:
        """`start_steps` run to its end, in one call (tests and benches; the engine steps it)."""
        steps = self.start_steps(spec, canvas_length, preprocessed)
        while True:
            try:
                next(steps)
            except StopIteration as stop:
                return stop.value

    def start_steps(
        self, spec: GenerateSpec, canvas_length: int, preprocessed: Preprocessed | None = None,
    ) -> Generator[None, None, Generation]:
        """A generation ready to step, its prompt encoded into a KV cache of its own that generation
        extends block by block, as a stepwise generator like `read_steps`: a prompt of more than
        `prefill_chunk` tokens is encoded in chunks like a read's (`encode_steps`, a yield between two),
        so no turn of a generation encodes more than a read's turn does, and a prompt in the LRU is
        taken from there; any other prompt in one pass (`_encode_into_cache`). `preprocessed`: the
        prompt's images, already decoded off this thread (HFReader)."""
        if self.flat is not None:
            from app.engine.hf.flat.generate import GenerateProgram

            program = GenerateProgram(cast("Host", self), spec, canvas_length, preprocessed)
            return (yield from self.flat.start_generation(program))
        check_spec(spec)
        if self.needs_chunks(spec.prompt) or spec.prompt.cache_key in self.prompts:
            encoded = yield from self.encode_steps(spec.prompt, preprocessed)
            cache, length = self.cache_holding(encoded), encoded.length
        else:
            with torch.no_grad():
                cache, length = self._encode_into_cache(spec.prompt, preprocessed)
        # Greedy decoding owes nothing to the seed: its starting canvas comes from a fixed one.
        generator = self.seeded_generator(spec.seed if spec.temperature > 0.0 else 0)
        return Generation(spec=spec, canvas_length=canvas_length, cache=cache, length=length,
                          prompt_tokens=length, generator=generator, stop=frozenset(spec.stop_ids))

    @torch.no_grad()
    def step_generation(self, gen: Generation) -> GenerateChunk | None:
        """Exactly one model pass of `gen`: a denoise pass of its current block, or, right after a
        block finished, that block's commit through the encoder (its own step, returning None).
        Returns a chunk when the pass committed tokens or ended the generation, else None."""
        if gen.cache is None and self.flat is not None:  # a generation of the flat turn
            return self.flat.step_generation(gen)
        if gen.done:
            raise RuntimeError("this generation has finished")
        if gen.pending is not None:
            self._commit(gen, gen.pending)
            self.finish_turn()  # its own turn: nothing reads the commit back, so wait for it here
            gen.pending = None
            return None
        if gen.spec.max_tokens - len(gen.produced) <= 0:  # max_tokens 0: nothing to run
            gen.done = True
            return GenerateChunk(ids=(), done=True, prompt_tokens=gen.prompt_tokens, passes=gen.passes)
        block = self.next_block(gen)
        block_ids = self._denoise_pass(gen, block)
        return None if block_ids is None else self.end_block(gen, block_ids)

    def next_block(self, gen: Generation) -> Block:
        """The block `gen` is denoising: a new random canvas when it has none, as wide as the tokens
        still wanted (in steps of 16), at most its canvas length."""
        if gen.block is None:
            remaining_tokens = gen.spec.max_tokens - len(gen.produced)
            width = min(gen.canvas_length, max(16, 16 * math.ceil(remaining_tokens / 16)))
            gen.block = self._new_block(gen, width)
        return gen.block

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

    @torch.no_grad()
    def generate(self, spec: GenerateSpec, canvas_length: int) -> GenerateResult:
        """Block diffusion: denoise a random canvas until stable and confident (or the step cap),
        commit its argmax through the encoder, repeat; stop at a stop id or `max_tokens`."""
        gen = self.start_generation(spec, canvas_length)
        ids: list[int] = []
        while True:
            chunk = self.step_generation(gen)
            if chunk is None:
                continue
            ids.extend(chunk.ids)
            if chunk.done:
                return GenerateResult(ids=tuple(ids), stopped=chunk.stopped, prompt_tokens=chunk.prompt_tokens,
                                      passes=chunk.passes)

    def _new_block(self, gen: Generation, width: int) -> Block:
        canvas = torch.randint(0, self.vocab_size, (1, width), generator=gen.generator, device=self.device)
        positions = (gen.length + torch.arange(width, device=self.device)).unsqueeze(0)
        steps = int(self.generation["max_denoising_steps"])
        return Block(canvas=canvas, positions=positions, steps=steps, remaining=steps)

    def _denoise_pass(self, gen: Generation, block: Block) -> list[int] | None:
        """One decoder pass and sampler step over `block`; its argmax ids once it is stable and
        confident or out of steps, else None."""
        assert gen.cache is not None, "a generation of the row path"
        hidden = None
        if self.graphs is not None:  # the read path's decoder graphs, over the generation's own cache
            context = EncodedPrompt(cache_kv(gen.cache), gen.length)
            hidden = self.graphs.hidden([(context, block.canvas[0].tolist())], block.conditioning)
            if hidden is not None:
                self.stats["graph_replays"] += 1
        if hidden is None:
            hidden = self.model.model(
                past_key_values=gen.cache,
                decoder_input_ids=block.canvas,
                decoder_position_ids=block.positions,
                self_conditioning_logits=block.conditioning,
            ).last_hidden_state
        self.stats["decoder_passes"] += 1
        self.stats["generation_passes"] += 1
        return self.sample_pass(gen, block, hidden)

    def sample_pass(self, gen: Generation, block: Block, hidden: torch.Tensor) -> list[int] | None:
        """The sampler step after a decoder pass over `block` (its hidden states [1, width, H]): the
        block's next canvas and self-conditioning; its argmax ids once it is stable and confident or
        out of steps, else None."""
        settings = self.generation
        gen.passes += 1
        temperature = gen.spec.temperature * temperature_at(block.remaining, block.steps, settings["t_min"],
                                                            settings["t_max"])
        step = sample_step(self.logits(hidden)[0], temperature, top_p=gen.spec.top_p,
                           entropy_bound=settings["entropy_bound"], vocab_size=self.vocab_size,
                           generator=gen.generator)
        block.canvas = step.tokens.unsqueeze(0)
        block.conditioning = step.conditioning.unsqueeze(0).to(self.model.dtype)
        block.remaining -= 1
        stable_needed = int(settings["stability_threshold"]) + 1
        block.history = (block.history + [step.argmax])[-stable_needed:]
        finished = block.remaining == 0
        if len(block.history) >= stable_needed and all(torch.equal(h, step.argmax) for h in block.history):
            finished = finished or float(step.entropy.mean()) < settings["confidence_threshold"]
        return [int(t) for t in step.argmax.tolist()] if finished else None

    def _commit(self, gen: Generation, block_ids: list[int]) -> None:
        """Encode a finished block into the generation's cache: the next block reads it as prompt."""
        assert gen.cache is not None, "a generation of the row path"
        width = len(block_ids)
        ids = torch.tensor([block_ids], dtype=torch.long, device=self.device)
        positions = (gen.length + torch.arange(width, device=self.device)).unsqueeze(0)
        self.model.model.encoder(input_ids=ids, past_key_values=gen.cache, position_ids=positions)
        self.stats["encoder_passes"] += 1
        gen.length += width
