"""A prompt as the flat turn writes it: its ids as the model sees them (each image placeholder expanded
to its soft tokens), a key per token for the block hashes (an image's soft tokens share one id, so
their keys carry the image's digest), its image blocks, the embeddings of an image prompt given whole,
and its sequence in the KV store; and how much of it fits a turn.

`prepare` makes them for the prompts of the programs that join a turn, their new images through the
vision tower together (the runner's `model_inputs` and image features, as the row path does).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Hashable, Sequence

import torch

from app.engine.base import EngineInputError, EngineUnavailable, Prompt
from app.engine.hf.flat.blocks import StoreFull
from app.engine.hf.flat.layout import Kind
from app.engine.hf.flat.turn import Part

if TYPE_CHECKING:
    from app.engine.hf.flat.blocks import KVStore, SequenceKV
    from app.engine.hf.flat.host import Host
    from app.engine.hf.prompts import Preprocessed


@dataclass(eq=False)
class PromptState:
    """One prompt of a program: what is written of it, what a turn may add."""

    prompt: Prompt
    ids: list[int] = field(default_factory=list)
    keys: list[Hashable] = field(default_factory=list)
    images: list[tuple[int, int]] = field(default_factory=list)  # soft-token runs, prompt positions
    embeds: torch.Tensor | None = None  # [n, hidden] an image prompt's input embeddings
    sequence: SequenceKV | None = None
    planned: int = 0  # positions [0, planned) written or in the turn being built
    error: Exception | None = None

    @property
    def length(self) -> int:
        return len(self.ids)

    @property
    def complete(self) -> bool:
        """Every position written, or in the turn being built (a canvas may then ride that turn)."""
        return self.error is None and self.planned >= self.length

    def chunk(self, store: KVStore, room: int, chunk: int) -> Part | None:
        """The next run of this prompt for the turn being built: at most `chunk` tokens and `room`, ending
        at an image's edge rather than inside it (a whole image may be all the part holds). None when
        nothing fits, or the store has no room (then `error` says so: the reads of this prompt fail
        alone, with a 503)."""
        assert self.sequence is not None
        start = self.planned
        end = min(self.length, start + min(room, chunk))
        for first, last in self.images:
            if first < end < last:  # never split an image: stop before it, or take it whole
                end = first if first > start else (last if last - start <= room else start)
        if end <= start:
            return None
        try:
            store.reserve(self.sequence, self.keys[self.sequence.reserved:end])
        except StoreFull as exc:
            self.error = EngineUnavailable(f"the engine's KV store is full: {exc}; try again")
            return None
        self.planned = end
        images = tuple((max(first, start) - start, min(last, end) - start) for first, last in self.images
                       if first < end and last > start)
        embeds = self.embeds[start:end] if self.embeds is not None and end <= self.embeds.shape[0] else None
        return Part(Kind.PROMPT, self.sequence, start, self.ids[start:end], images=images, embeds=embeds)


    def extend(self, store: KVStore, ids: Sequence[int]) -> Part | None:
        """Text appended to a written prompt (a generation's finished block), as one part for the turn
        being built; None, with `error` set, where the store has no room for it."""
        self.ids.extend(ids)
        self.keys.extend(ids)
        return self.chunk(store, len(ids), len(ids))


def prepare(runner: Host, store: KVStore, prompts: Sequence[Prompt],
            preprocessed: Preprocessed | None) -> list[PromptState]:
    """The prompts' states, each with its sequence opened in `store` (its cached prefix shared); a
    prompt that cannot be read gets its `error` (too long, an image that does not decode)."""
    states = [PromptState(prompt) for prompt in prompts]
    images: list[tuple[PromptState, dict[str, torch.Tensor]]] = []
    for state in states:
        prompt = state.prompt
        if not prompt.images:
            if len(prompt.ids) > runner.max_prompt_tokens:
                state.error = runner.too_long(len(prompt.ids))
            state.ids = list(prompt.ids)
            continue
        try:
            images.append((state, runner.model_inputs(prompt, reuse_vision=True, preprocessed=preprocessed)))
        except EngineInputError as exc:
            state.error = exc
    if images:
        runner.image_features([inputs for _, inputs in images], [state.prompt.cache_key[1] for state, _ in images])
    for state, inputs in images:
        state.ids = [int(token) for token in inputs["input_ids"][0].tolist()]
        state.embeds = runner.input_embeds(inputs)
    image_token = runner.image_token_id
    for state in states:
        if state.error is not None:
            continue
        state.keys, state.images = token_keys(state.ids, state.prompt.cache_key[1], image_token)
        state.sequence = store.open(state.keys)
        state.planned = state.sequence.written
        # The row path's prompt-cache counters: a hit when every whole block came from the store (only
        # a partial last block is written again).
        whole = state.length - state.length % store.block_tokens
        runner.stats["kv_hits" if state.sequence.cached >= whole > 0 else "kv_misses"] += 1
    return states


def token_keys(ids: Sequence[int], digests: Sequence[str],
               image_token: int) -> tuple[list[Hashable], list[tuple[int, int]]]:
    """A hashable key per token and the runs of image soft tokens: a text token's key is its id; a soft
    token's is its image's digest and its index in the image (every soft token has the same id)."""
    keys: list[Hashable] = []
    runs: list[tuple[int, int]] = []
    image = -1
    for position, token in enumerate(ids):
        if token != image_token:
            keys.append(token)
            continue
        if not runs or runs[-1][1] != position:
            image += 1
            runs.append((position, position))
        first = runs[-1][0]
        runs[-1] = (first, position + 1)
        keys.append((digests[image] if image < len(digests) else "", position - first))
    return keys, runs
