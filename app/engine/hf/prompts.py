"""A prompt as the flat turn writes it: its ids as the model sees them (each image placeholder expanded
to its soft tokens), a key per token for the block hashes (an image's soft tokens share one id, so
their keys carry the image's digest), its image blocks, the embeddings of an image prompt given whole,
and its sequence in the KV store; and how much of it fits a turn.

`prepare` makes them for a program's prompts as a turn first reaches it (the runner's `model_inputs`:
each image placeholder expanded, its pixels on the device); `embed_images` then runs the vision tower
once for every image the turn's parts take, together, and gives those parts their embeddings. An image
whose prompt's KV the store already holds never goes through the tower.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Hashable, Sequence

import torch

from app.engine.base import EngineInputError, EngineUnavailable, Prompt
from app.engine.hf.blocks import StoreFull
from app.engine.hf.layout import Kind
from app.engine.hf.turn import Part

if TYPE_CHECKING:
    from app.engine.hf.blocks import KVStore, SequenceKV
    from app.engine.hf.host import Host
    from app.engine.hf.images import Preprocessed


# A chunk's time grows with the earlier tokens its full-attention layers read: on the H200 a 2048-token
# chunk took ~100 ms at the start of a prompt and ~360 ms past 100k tokens, where the attention of a
# token to ~38k earlier ones costs about as much as the rest of its layers (docs/benchmarks.md, long
# states). So a chunk is shortened as the prompt grows, to about CHUNK_TURN x a first chunk's time:
# a long prompt's turn never holds the other reads much longer than a short prompt's.
CHUNK_KEY_TOKENS = 38_000
CHUNK_TURN = 2.0
CHUNK_ALIGN = 128


def chunk_length(start: int, prefill_chunk: int) -> int:
    """How many tokens the chunk of a prompt at `start` takes: `prefill_chunk` while the prompt is
    short, then fewer, in multiples of CHUNK_ALIGN (never fewer than one multiple, nor more than
    `prefill_chunk`)."""
    budget = prefill_chunk * CHUNK_TURN * CHUNK_KEY_TOKENS / (CHUNK_KEY_TOKENS + start)
    if budget >= prefill_chunk:
        return prefill_chunk
    return min(prefill_chunk, max(CHUNK_ALIGN, int(budget) // CHUNK_ALIGN * CHUNK_ALIGN))


@dataclass(eq=False)
class PromptState:
    """One prompt of a program: what is written of it, what a turn may add."""

    prompt: Prompt
    ids: list[int] = field(default_factory=list)
    keys: list[Hashable] = field(default_factory=list)
    images: list[tuple[int, int]] = field(default_factory=list)  # soft-token runs, prompt positions
    inputs: dict[str, torch.Tensor] | None = None  # an image prompt's model inputs, until `embed_images`
    embeds: torch.Tensor | None = None  # [n, hidden] an image prompt's input embeddings (`embed_images`)
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
        nothing fits, or the store has no room: then `error` says so where this read gives way (it
        fails alone, with a 503), else it waits for the next turn (`KVStore.give_way`)."""
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
            if store.give_way():  # the turn's first read without room fails; any other waits a turn
                self.error = EngineUnavailable(f"the engine's KV store is full: {exc}; try again")
            return None
        self.planned = end
        images = tuple((max(first, start) - start, min(last, end) - start) for first, last in self.images
                       if first < end and last > start)
        # A part holding image tokens is embedded whole (`embed_images`); text is embedded from its ids.
        return Part(Kind.PROMPT, self.sequence, start, self.ids[start:end], images=images,
                    source=self if images else None)


    def extend(self, store: KVStore, ids: Sequence[int]) -> Part | None:
        """Text appended to a written prompt (a generation's finished block), as one part for the turn
        being built; None where the store has no room for it (with `error` set where it fails, else
        nothing appended: it waits a turn)."""
        self.ids.extend(ids)
        self.keys.extend(ids)
        part = self.chunk(store, len(ids), len(ids))
        if part is None and self.error is None:
            del self.ids[len(self.ids) - len(ids):], self.keys[len(self.keys) - len(ids):]
        return part


def prepare(runner: Host, store: KVStore, prompts: Sequence[Prompt],
            preprocessed: Preprocessed | None) -> list[PromptState]:
    """The prompts' states, each with its sequence opened in `store` (its cached prefix shared); a
    prompt that cannot be read gets its `error` (too long, an image that does not decode). No image
    goes through the vision tower here (`embed_images`)."""
    states = [PromptState(prompt) for prompt in prompts]
    image_token = runner.image_token_id
    for state in states:
        prompt = state.prompt
        if prompt.images:
            try:
                state.inputs = runner.images.model_inputs(prompt, preprocessed=preprocessed)
                state.ids = [int(token) for token in state.inputs["input_ids"][0].tolist()]
                if state.length > runner.max_prompt_tokens:
                    raise runner.too_long(state.length)
                state.keys, state.images = token_keys(state.ids, prompt.cache_key[1], image_token)
            except EngineInputError as exc:
                state.error = exc
                continue
        else:
            state.ids = list(prompt.ids)
            state.keys = list(prompt.ids)
            if state.length > runner.max_prompt_tokens:
                state.error = runner.too_long(state.length)
                continue
        state.sequence = store.open(state.keys)
        state.planned = state.sequence.written
        # A hit when every whole block came from the store (only a partial last block is written again).
        whole = state.length - state.length % store.block_tokens
        runner.stats["kv_hits" if state.sequence.cached >= whole > 0 else "kv_misses"] += 1
    return states


def embed_images(runner: Host, parts: Sequence[Part]) -> None:
    """The embeddings of the parts of a turn that hold image tokens: the images of their prompts not yet
    embedded go through the vision tower together (one pass per patch layout; features already in the
    vision LRU skip it), then each part gets its rows of its prompt's embeddings."""
    waiting = [part for part in parts if isinstance(part.source, PromptState) and part.embeds is None]
    states = list({id(part.source): part.source for part in waiting if isinstance(part.source, PromptState)}.values())
    new = [state for state in states if state.embeds is None]
    if new:
        runner.images.image_features([state.inputs for state in new if state.inputs is not None],
                                     [state.prompt.cache_key[1] for state in new if state.inputs is not None])
        for state in new:
            assert state.inputs is not None, "an image prompt keeps its inputs until it is embedded"
            state.embeds = runner.images.input_embeds(state.inputs)
            state.inputs = None  # its pixels: not needed again
    for part in waiting:
        source = part.source
        assert isinstance(source, PromptState) and source.embeds is not None
        part.embeds = source.embeds[part.position:part.position + part.tokens]


def token_keys(ids: Sequence[int], digests: Sequence[str],
               image_token: int) -> tuple[list[Hashable], list[tuple[int, int]]]:
    """A hashable key per token and the runs of image soft tokens: a text token's key is its id; a soft
    token's is its image's digest and its index in the image (every soft token has the same id), so two
    prompts share an image's blocks only where their images' bytes are the same. A run of soft tokens
    without an image of its own (more runs than `digests`) is an EngineInputError, never a shared key."""
    keys: list[Hashable] = []
    runs: list[tuple[int, int]] = []
    for position, token in enumerate(ids):
        if token != image_token:
            keys.append(token)
            continue
        if not runs or runs[-1][1] != position:
            if len(runs) == len(digests):
                raise EngineInputError(f"the prompt holds more runs of image tokens than its {len(digests)} "
                                       f"image(s)", status=422, param="images")
            runs.append((position, position))
        first = runs[-1][0]
        runs[-1] = (first, position + 1)
        keys.append((digests[len(runs) - 1], position - first))
    return keys, runs
