"""A generation as a program of the flat turn: its prompt (a chunk a turn where it is long), then a
denoise pass of its block a turn, the finished block committed (written into its sequence as prompt)
in the same turn as the next block's first pass.

The sampler's side of each pass is `BlockDiffusion`'s (app/engine/hf/generation.py: the block's
canvas, the sampler step, the stopping rule); the KV is the generation's own sequence in the store
(its prompt's prefix shared, its blocks private).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from app.engine.base import GenerateChunk, GenerateSpec, SlotRead
from app.engine.hf.generation import Generation, check_spec
from app.engine.hf.layout import Kind
from app.engine.hf.prompts import chunk_length
from app.engine.hf.turn import Part

if TYPE_CHECKING:
    from app.engine.hf.blocks import KVStore
    from app.engine.hf.host import Host
    from app.engine.hf.images import Preprocessed
    from app.engine.hf.prompts import PromptState


class GenerateProgram:
    """One generation, stepped by the flat engine: `prompts` to prepare, then `parts` and `take` once a
    turn; each turn's `chunks` for its caller; an `error` ends it."""

    def __init__(self, runner: Host, spec: GenerateSpec, canvas_length: int,
                 preprocessed: Preprocessed | None) -> None:
        check_spec(spec)
        self.runner = runner
        self.spec = spec
        self.canvas_length = canvas_length
        self.preprocessed = preprocessed
        self.state: PromptState | None = None
        self.gen: Generation | None = None
        self.commit: Part | None = None  # the finished block being written in the turn being built
        self.canvas: Part | None = None  # the block's denoise pass in the turn being built
        self.chunks: list[GenerateChunk] = []  # what the last turn gave the caller
        self.error: Exception | None = None
        self.turns = 0

    @property
    def prepared(self) -> bool:
        return self.state is not None

    def prompts(self) -> list:
        return [self.spec.prompt]

    def adopt(self, states: list[PromptState]) -> None:
        (state,) = states
        self.state = state
        if state.error is not None:
            self.error = state.error
            return
        spec = self.spec
        # Greedy decoding owes nothing to the seed: its starting canvas comes from a fixed one.
        generator = self.runner.seeded_generator(spec.seed if spec.temperature > 0.0 else 0)
        self.gen = Generation(spec=spec, canvas_length=self.canvas_length, length=state.length,
                              prompt_tokens=state.length, generator=generator, stop=frozenset(spec.stop_ids))
        if spec.max_tokens == 0:  # nothing to run: it ends as it starts
            self.gen.done = True
            self.chunks = [GenerateChunk(ids=(), done=True, prompt_tokens=state.length, passes=0)]

    @property
    def done(self) -> bool:
        return self.error is not None or (self.gen is not None and self.gen.done)

    def parts(self, store: KVStore, room: int, chunk: int, rows: int) -> list[Part]:
        """Its prompt's next chunk; once the prompt is written, the last block's commit and the next
        block's pass."""
        state = self.state
        assert state is not None and self.gen is not None
        if self.done or self.canvas is not None or rows < 1:  # (max_tokens 0: done when adopted)
            return []
        if state.complete:
            return self._passes(store, room)
        part = state.chunk(store, room, chunk_length(state.planned, chunk))
        if part is None:
            self.error = state.error
            return []
        return [part, *self._passes(store, room - part.tokens)] if state.complete else [part]

    def _passes(self, store: KVStore, room: int) -> list[Part]:
        gen, state = self.gen, self.state
        assert gen is not None and state is not None and state.sequence is not None
        parts: list[Part] = []
        if gen.pending is not None and self.commit is None:
            if len(gen.pending) > room:
                return []
            part = state.extend(store, gen.pending)
            if part is None:
                self.error = state.error
                return []
            self.commit = part
            parts.append(part)
            room -= part.tokens
        if room <= 0:
            return parts
        block = self.runner.blocks.next_block(gen)  # (drawn once: a block that does not fit waits as it is)
        width = int(block.canvas.shape[1])
        if width > room:
            return parts
        conditioning = block.conditioning[0] if block.conditioning is not None else None
        self.canvas = Part(Kind.CANVAS, state.sequence, state.planned, [int(t) for t in block.canvas[0].tolist()],
                           logits=tuple(range(width)), conditioning=conditioning)
        parts.append(self.canvas)
        return parts

    def slot_asks(self) -> None:
        """A generation reads no slots (its pass samples its whole canvas)."""
        return None

    def take(self, reads: Sequence[SlotRead] = ()) -> None:
        """The turn ran: the commit's tokens counted, the pass's sampler step, the chunk for the caller."""
        gen = self.gen
        assert gen is not None
        self.chunks = []
        self.turns += 1
        if self.commit is not None:
            gen.length += self.commit.tokens
            gen.pending = None
            self.commit = None
        if self.canvas is None:
            return
        hidden = self.canvas.hidden
        assert hidden is not None and gen.block is not None
        self.canvas = None
        self.runner.stats["generation_passes"] += 1
        block_ids = self.runner.blocks.sample_pass(gen, gen.block, hidden[None])
        if block_ids is not None:
            self.chunks.append(self.runner.blocks.end_block(gen, block_ids))

    def close(self, store: KVStore) -> None:
        if self.state is not None and self.state.sequence is not None:
            store.close(self.state.sequence)
