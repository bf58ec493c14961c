"""Prompt encoding for DiffusionRunner: a prompt's KV (what the decoder reads), the bounded LRU of
encoded prompts, the shared-prefix LRU (`PrefixIndex`), image expansion and features, and batched
encoder passes, replayed as CUDA graphs (app/engine/hf/graphs/encoder.py) where a bucket fits and
eager otherwise.

`preprocess` (image decoding and the image processor) touches neither the model nor the caches:
HFReader runs it in worker threads and hands the result over (`Preprocessed`); without one a
prompt is preprocessed inline. Design: docs/design.md §4.7.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Generator, Generic, Iterator, Mapping, Sequence, TypeVar

import torch
import torch.nn.functional as F

from app.engine.base import CacheKey, EngineInputError, Prompt, decode_images
from app.engine.hf import pixels
from app.engine.hf.graphs.encoder import Layers, Prefix, copy_rows
from app.engine.hf.layers import CHUNK_MASKS
from app.engine.hf.pixels import Resized

if TYPE_CHECKING:
    from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion, DiffusionGemmaTextConfig
    from transformers.cache_utils import Cache, CacheLayerMixin, DynamicCache
    from transformers.image_processing_utils import BaseImageProcessor

    from app.engine.hf.graphs.encoder import EncoderGraphs
    from app.engine.hf.graphs.shapes import ShapePolicy
    from app.engine.hf.graphs.vision import VisionGraphs

K = TypeVar("K")
V = TypeVar("V")
Found = TypeVar("Found")
Item = TypeVar("Item")


@dataclass
class EncodedPrompt:
    """A prompt's KV as the decoder reads it: per layer, keys and values of shape [1, heads, n, dim]
    (sliding-window layers keep only their window). Never mutated once stored."""

    layers: Layers
    length: int  # prompt tokens as the model saw them, image soft tokens included

    @property
    def nbytes(self) -> int:
        """The memory its KV takes."""
        return sum(keys.numel() * keys.element_size() + values.numel() * values.element_size()
                   for keys, values in self.layers)


def cache_kv(cache: Cache) -> Layers:
    """Each layer's keys and values in a cache that a pass has filled. The library types a cache's
    layers as any kind (linear attention, placeholders) and their tensors as optional; a
    DiffusionGemma pass leaves attention layers holding both (TypeError otherwise)."""
    return [layer_kv(layer) for layer in cache.layers]


def layer_kv(layer: object) -> tuple[torch.Tensor, torch.Tensor]:
    """A filled cache layer's keys and values (TypeError for a layer without both)."""
    from transformers.cache_utils import CacheLayerMixin

    if not isinstance(layer, CacheLayerMixin) or layer.keys is None or layer.values is None:
        raise TypeError(f"a cache layer without keys and values: {type(layer).__name__}")
    return layer.keys, layer.values


def hold(layer: CacheLayerMixin, keys: torch.Tensor, values: torch.Tensor, length: int | None = None) -> None:
    """`layer` made to hold `keys` and `values` as they are (`update` would copy them once more,
    concatenated onto nothing); a sliding layer counts `length` tokens seen."""
    layer.lazy_initialization(keys, values)
    layer.keys, layer.values = keys, values
    if length is not None and hasattr(layer, "cumulative_length"):
        layer.cumulative_length = length


# A chunk's time grows with the earlier tokens its full-attention layers read: on the H200 a 2048-token
# chunk took ~100 ms at the start of a prompt and ~360 ms past 100k tokens, where the attention of a
# token to ~38k earlier ones costs about as much as the rest of its layers (docs/benchmarks.md, long
# states). So a chunk is shortened as the prompt grows, to about CHUNK_TURN x a first chunk's time:
# a long prompt's turn never holds the other reads much longer than a short prompt's.
CHUNK_KEY_TOKENS = 38_000
CHUNK_TURN = 2.0
CHUNK_ALIGN = 128


# Image prompts encoded whole kept as sources per set of images (a frame's stages, a few sessions').
IMAGE_SOURCES = 4


def common_length(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading ids `a` and `b` share."""
    n = min(len(a), len(b))
    for index in range(n):
        if a[index] != b[index]:
            return index
    return n


def chunk_length(start: int, prefill_chunk: int) -> int:
    """How many tokens the chunk at `start` encodes: `prefill_chunk` while the prompt is short, then
    fewer, in multiples of CHUNK_ALIGN (never fewer than one multiple, nor more than `prefill_chunk`)."""
    budget = prefill_chunk * CHUNK_TURN * CHUNK_KEY_TOKENS / (CHUNK_KEY_TOKENS + start)
    if budget >= prefill_chunk:
        return prefill_chunk
    return min(prefill_chunk, max(CHUNK_ALIGN, int(budget) // CHUNK_ALIGN * CHUNK_ALIGN))


def chunk_bounds(length: int, prefill_chunk: int) -> list[tuple[int, int]]:
    """The (start, end) of each chunk of a `length`-token prompt's encoding."""
    bounds, start = [], 0
    while start < length:
        end = min(length, start + chunk_length(start, prefill_chunk))
        bounds.append((start, end))
        start = end
    return bounds


def prompt_layer(length: int) -> CacheLayerMixin:
    """A full-attention cache layer for a prompt of `length` tokens encoded in chunks: its keys and
    values are written into buffers of the whole prompt's size, laid out as `copy_rows` leaves KV,
    instead of concatenated anew for every chunk. The filled buffers are the encoded prompt's KV as
    they are: no chunk holds the KV twice, and nothing is copied at the end."""
    from transformers.cache_utils import DynamicLayer

    from app.engine.hf.graphs.encoder import token_major

    class PromptLayer(DynamicLayer):
        filled = 0

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object,
                   **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
            if not self.is_initialized:
                self.dtype, self.device = key_states.dtype, key_states.device
                rows, heads, _, dim = key_states.shape
                self.key_buffer = token_major(key_states.new_empty((rows, heads, length, dim)))
                self.value_buffer = token_major(value_states.new_empty((rows, value_states.shape[1], length,
                                                                        value_states.shape[3])))
                self.is_initialized = True
            end = self.filled + key_states.shape[2]
            self.key_buffer[:, :, self.filled:end].copy_(key_states)
            self.value_buffer[:, :, self.filled:end].copy_(value_states)
            self.filled = end
            self.keys, self.values = self.key_buffer[:, :, :end], self.value_buffer[:, :, :end]
            return self.keys, self.values

    return PromptLayer()


def copy_layers(cache: Cache) -> Layers:
    """A filled cache's layers as `copy_rows` lays them out: a `prompt_layer`'s as they are, the
    others copied one layer at a time, each layer's own tensors let go as soon as it is copied."""
    layers: Layers = []
    for layer in cache.layers:
        pair = layer_kv(layer)
        layers.append(pair if hasattr(layer, "key_buffer") else copy_rows([[pair]])[0][0])
        layer.keys = layer.values = None  # pyright: ignore[reportAttributeAccessIssue]  # layer_kv: an attention layer
    return layers


@dataclass(frozen=True)
class ProcessedImages:
    """A prompt's images as the vision tower takes them, still on the CPU: what decoding, RGB
    conversion and the image processor made of them. Any thread may build one (`preprocess`); the
    engine thread only uploads it (and, with `resized`, finishes it on the device)."""

    counts: tuple[int, ...]  # soft tokens per image
    pixel_values: torch.Tensor | None  # [images, patches, patch pixels], already in the model's dtype
    image_position_ids: torch.Tensor | None  # [images, patches, 2]
    # With `split_pixels`: the images only resized (uint8); the engine thread finishes them on the
    # device (app/engine/hf/pixels.py), and the two tensors above are None.
    resized: Resized | None = None


# Images preprocessed off the engine thread, by the digests of a prompt's images (`Prompt.cache_key[1]`):
# the result, or the EngineInputError preprocessing raised, raised again on the engine thread for each
# prompt that holds those images, exactly where inline preprocessing would have raised it.
Preprocessed = Mapping[tuple[str, ...], "ProcessedImages | EngineInputError"]

# A prompt waiting to be encoded: its cache key and the indices of the prompts that have it.
Pending = tuple[CacheKey, list[int]]


class PromptCache(Generic[K, V]):
    """Bounded LRU of encoded prompts: a repeated prompt (the same state, the same question sheet)
    pays its encoder pass once. (Also of image features, and of shared prefixes' KV.) Bounded in
    entries, and with `max_bytes` also in the bytes its items hold (`size`): a few long states'
    KV (tens of MiB to GiBs each) cannot fill the GPU however few entries they are. An item larger
    than `max_bytes` alone is not kept."""

    def __init__(self, entries: int, max_bytes: int = 0, size: Callable[[V], int] | None = None) -> None:
        self.entries = entries
        self.max_bytes = max_bytes  # 0: no byte bound
        self._size = size or (lambda item: 0)
        self._items: OrderedDict[K, V] = OrderedDict()
        self._sizes: dict[K, int] = {}
        self.bytes = 0  # what the items held now take

    def get(self, key: K) -> V | None:
        item = self._items.get(key)
        if item is not None:
            self._items.move_to_end(key)
        return item

    def put(self, key: K, item: V) -> None:
        if self.entries <= 0:
            return
        size = self._size(item) if self.max_bytes else 0
        if self.max_bytes and size > self.max_bytes:
            self._drop(key)
            return
        self._drop(key)
        self._items[key] = item
        self._sizes[key] = size
        self.bytes += size
        while len(self._items) > self.entries or (self.max_bytes and self.bytes > self.max_bytes):
            self._drop(next(iter(self._items)))

    def _drop(self, key: K) -> None:
        if key in self._items:
            del self._items[key]
            self.bytes -= self._sizes.pop(key, 0)

    def __len__(self) -> int:
        return len(self._items)

    def values(self) -> list:
        """The entries held, least recently used first, as a list, without touching the LRU order
        (on the engine thread, or while nothing else uses the cache)."""
        return list(self._items.values())

    def clear(self) -> None:
        self._items.clear()
        self._sizes.clear()
        self.bytes = 0

    def __contains__(self, key: object) -> bool:
        """Membership without touching the LRU order, so the event loop may ask while the engine
        thread uses the cache (one dict lookup under the GIL); the answer may be stale by the time
        the entry is read, which costs only an inline preprocess or one done for nothing."""
        return key in self._items


# Shared prefixes are found at multiples of PREFIX_BLOCK tokens and used from PREFIX_MIN tokens on (a
# shorter one saves less than its mask costs); PREFIX_SEEN block hashes are remembered. At most
# PREFIX_ENTRIES prefixes' KV are kept (fewer where KV_CACHE_ENTRIES is lower): ~220 KiB a token at
# full size, so a 150-token sheet is ~32 MiB and the bound, prefixes as long as the 1,024-token
# window, 3.5 GiB.
PREFIX_BLOCK = 16
PREFIX_MIN = 64
PREFIX_SEEN = 8192
PREFIX_ENTRIES = 16


class PrefixIndex:
    """Which earlier prompt began with the same tokens as a new one. Every prompt's prefixes at
    multiples of `block` tokens (each leaving at least one token after it) are remembered by a
    chained hash, the hash of the previous block's hash and the block's ids, so finding the longest
    one takes one hash and one lookup per block. A hash names the last prompt that had it (by its
    cache key); the caller checks that prompt's ids before it trusts one (a hash may collide). Pure:
    no tensors, no model."""

    def __init__(self, block: int = PREFIX_BLOCK, minimum: int = PREFIX_MIN, entries: int = PREFIX_SEEN) -> None:
        self.block = block
        self.minimum = minimum
        self.entries = entries
        self._seen: OrderedDict[int, CacheKey] = OrderedDict()

    def hashes(self, ids: Sequence[int]) -> list[int]:
        """The chained hashes of ids[:block], ids[:2 * block], ..., each shorter than `ids`."""
        chained: list[int] = []
        value = 0
        for end in range(self.block, len(ids), self.block):
            value = hash((value, tuple(ids[end - self.block:end])))
            chained.append(value)
        return chained

    def longest(self, hashes: Sequence[int], found: Callable[[int], Found | None]) -> tuple[int, Found] | None:
        """(tokens, what `found` returned) for the longest prefix of at least `minimum` tokens for
        which found(hash) returns something; None for none."""
        return next(self.hits(hashes, found), None)

    def hits(self, hashes: Sequence[int], found: Callable[[int], Found | None]) -> Iterator[tuple[int, Found]]:
        """(tokens, what `found` returned) for every prefix of at least `minimum` tokens for which
        found(hash) returns something, longest first."""
        for blocks in range(len(hashes), 0, -1):
            if blocks * self.block < self.minimum:
                break
            hit = found(hashes[blocks - 1])
            if hit is not None:
                yield blocks * self.block, hit

    def lengths(self, longest: int) -> range:
        """The prefix lengths a prompt that shares `longest` tokens may use, longest first: the
        multiples of `block` from `longest` down to `minimum`."""
        first = -(-self.minimum // self.block) * self.block
        return range(longest // self.block * self.block, first - 1, -self.block)

    def seen(self, hashes: Sequence[int], key: CacheKey) -> tuple[int, CacheKey] | None:
        """(tokens, cache key) of the longest prefix whose hash another prompt recorded last (one
        `key` itself recorded last is passed over)."""
        def other(value: int) -> CacheKey | None:
            found = self._seen.get(value)
            return None if found == key else found

        return self.longest(hashes, other)

    def record(self, hashes: Sequence[int], key: CacheKey) -> None:
        for value in hashes:
            self._seen[value] = key
            self._seen.move_to_end(value)
        while len(self._seen) > self.entries:
            self._seen.popitem(last=False)

    def clear(self) -> None:
        self._seen.clear()


@dataclass
class _PrefixGroup:
    """Prompts to encode over one shared prefix: its ids, where its KV comes from, and the items."""

    value: int  # the chained hash of its ids: its key in the prefix LRU
    ids: tuple[int, ...]
    source: CacheKey | None  # the cache key of a prompt that begins with it (its KV sliced), or None
    items: list[Pending]
    encoded: EncodedPrompt | None = None


class PromptEncodingMixin:
    """Prompt encoding for DiffusionRunner (which provides the model, config, caches and stats)."""

    model: DiffusionGemmaForBlockDiffusion
    config: DiffusionGemmaConfig
    text_config: DiffusionGemmaTextConfig
    device: torch.device
    image_processor: BaseImageProcessor | None
    split_pixels: bool  # images finished on the device (app/engine/hf/pixels.py): CUDA and a Gemma 4 processor
    max_prompt_tokens: int
    max_rows: int
    prefill_chunk: int
    prompts: PromptCache[CacheKey, EncodedPrompt]
    vision: PromptCache[tuple[str, ...], tuple[list[int], torch.Tensor]]  # images' (soft tokens, features)
    prefixes: PromptCache[int, tuple[tuple[int, ...], EncodedPrompt]]  # shared prefixes' (ids, KV), by chained hash
    prefix_index: PrefixIndex
    image_sources: PromptCache[tuple[str, ...], tuple[CacheKey, ...]]  # image prompts encoded whole, newest first
    encoder_graphs: EncoderGraphs | None
    policy: ShapePolicy
    vision_graphs: VisionGraphs | None
    stats: Counter[str]
    step_note: str  # DiffusionRunner's: what the last step did, for the slow-turn warning
    pad_id: int  # DiffusionRunner's

    def preprocess(self, prompt: Prompt) -> ProcessedImages:
        """Decode the prompt's images, convert them to RGB and run the image processor: CPU work that
        touches neither the model's weights nor the caches, so a worker thread may run it while the
        engine thread runs passes. A file that does not decode is a 422 naming its source."""
        processor = self.image_processor
        if processor is None:
            raise EngineInputError("this model has no image processor", status=422, param="images")
        if self.split_pixels:
            assert pixels.splittable(processor)  # split_pixels is set for such a processor only
            resized = pixels.resize(processor, decode_images(prompt))
            return ProcessedImages(counts=resized.counts, pixel_values=None, image_position_ids=None, resized=resized)
        processed = processor(decode_images(prompt), return_tensors="pt")
        return ProcessedImages(
            counts=tuple(int(n) for n in processed["num_soft_tokens_per_image"]),
            pixel_values=processed["pixel_values"].to(self.model.dtype),  # the cast off the engine thread too
            image_position_ids=processed["image_position_ids"],
        )

    def images_cached(self, key: CacheKey) -> bool:
        """Whether a read of the prompt with this `cache_key` will skip decoding its images: its KV
        or its images' features are in the LRUs (a generation never reuses them). Safe to ask from
        the event loop (see `PromptCache.__contains__`)."""
        return key in self.prompts or key[1] in self.vision

    def model_inputs(
        self, prompt: Prompt, *, reuse_vision: bool = False, preprocessed: Preprocessed | None = None,
    ) -> dict[str, torch.Tensor]:
        """The prompt as the encoder takes it, on the device: `input_ids` [1, n] with each image
        placeholder expanded to its soft tokens, and for an image prompt `mm_token_type_ids`,
        `soft_token_counts`, `pixel_values` and `image_position_ids`. With `reuse_vision`, images
        whose features are in the vision LRU (a walk frame's later stages restate the same frame)
        skip decoding and come back as `image_features` instead. Images found in `preprocessed`
        are only uploaded; others are preprocessed here. `input_embeds` embeds the result."""
        ids = list(prompt.ids)
        inputs: dict[str, torch.Tensor] = {}
        digests = prompt.cache_key[1] if prompt.images else ()
        known = self.vision.get(digests) if prompt.images and reuse_vision else None
        if known is not None:
            counts, features = known
            self.stats["vision_hits"] += 1
            ids = self._expand_placeholders(ids, counts)
            inputs["image_features"] = features
        elif prompt.images:
            ready = preprocessed.get(digests) if preprocessed else None
            if isinstance(ready, EngineInputError):
                raise ready
            if ready is None:
                ready = self.preprocess(prompt)
                self.stats["images_preprocessed_inline"] += 1
            ids = self._expand_placeholders(ids, list(ready.counts))
            inputs["soft_token_counts"] = torch.tensor(ready.counts)
            if ready.resized is not None:
                processor = self.image_processor
                assert pixels.splittable(processor)  # only such a processor resizes (`preprocess`)
                inputs["pixel_values"], inputs["image_position_ids"] = pixels.patches(
                    processor, ready.resized, self.device, self.model.dtype)
            else:
                assert ready.pixel_values is not None and ready.image_position_ids is not None
                inputs["pixel_values"] = ready.pixel_values.to(self.device, self.model.dtype)
                inputs["image_position_ids"] = ready.image_position_ids.to(self.device)
        if len(ids) > self.max_prompt_tokens:
            raise self.too_long(len(ids))
        input_ids = torch.tensor([ids], dtype=torch.long, device=self.device)
        inputs["input_ids"] = input_ids
        if prompt.images:
            inputs["mm_token_type_ids"] = (input_ids == self.config.image_token_id).long()
        return inputs

    def _expand_placeholders(self, ids: list[int], counts: list[int]) -> list[int]:
        """Each image placeholder becomes begin-of-image, its soft tokens, end-of-image."""
        expanded: list[int] = []
        placeholder, begin, end = self.config.image_token_id, self.config.boi_token_id, self.config.eoi_token_id
        images_seen = 0
        for token in ids:
            if token == placeholder and images_seen < len(counts):
                assert begin is not None and end is not None  # a model that reads images has both
                expanded.append(begin)
                expanded.extend([token] * counts[images_seen])
                expanded.append(end)
                images_seen += 1
            else:
                expanded.append(token)
        if images_seen != len(counts):
            raise EngineInputError(
                f"the prompt has {images_seen} image placeholders for {len(counts)} images", status=422,
                param="images",
            )
        return expanded

    def _new_cache(self) -> DynamicCache:
        from transformers.cache_utils import DynamicCache

        return DynamicCache(config=self.text_config)

    @torch.no_grad()
    def encode(self, prompt: Prompt) -> EncodedPrompt:
        """The prompt's KV, from the LRU or from one encoder pass."""
        outcome = self.encode_many([prompt])[0]
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    def _encode_into_cache(self, prompt: Prompt, preprocessed: Preprocessed | None = None) -> tuple[DynamicCache, int]:
        """The prompt encoded into a fresh cache that generation may extend; (cache, prompt tokens incl.
        images). A text prompt shorter than the sliding window takes the reads' path (the LRU, or an
        encoder graph replay on CUDA) and its KV is loaded into the cache, which then holds exactly
        what an eager pass leaves there; any other prompt gets one eager encoder pass."""
        if self._graph_encodable(prompt):
            encoded = self.encode(prompt)
            cache = self._new_cache()
            for index, (keys, values) in enumerate(encoded.layers):
                cache.update(keys, values, index)  # the cache concatenates later blocks: the LRU's tensors stay as they are
            return cache, encoded.length
        inputs = self.model_inputs(prompt, preprocessed=preprocessed)
        inputs.pop("soft_token_counts", None)
        length = int(inputs["input_ids"].shape[1])
        cache = self._new_cache()
        positions = torch.arange(length, device=self.device).unsqueeze(0)
        self.model.model.encoder(past_key_values=cache, position_ids=positions, **inputs)
        self.stats["encoder_passes"] += 1
        return cache, length

    def _graph_encodable(self, prompt: Prompt) -> bool:
        """Whether a generation's prompt may be encoded like a read's: encoder graphs are held (CUDA),
        the prompt is text that fits one, and it is shorter than the sliding window (so the sliding
        layers' KV needs no crop before the cache takes it)."""
        graphs = self.encoder_graphs
        n = len(prompt.ids)
        return (graphs is not None and not prompt.images and 0 < n < graphs.sliding_window
                and n <= self.max_prompt_tokens and graphs.fits(1, n))

    @torch.no_grad()
    def encode_many(
        self, prompts: Sequence[Prompt], preprocessed: Preprocessed | None = None,
    ) -> list[EncodedPrompt | Exception]:
        """Encode several prompts: prompts missing from the LRU share encoder passes (at most
        `max_rows` prompts and `max_prompt_tokens` padded tokens a pass, and, with encoder graphs, one
        bucket). With encoder graphs, text prompts that begin like an earlier one are encoded over
        that shared prefix (`_by_prefix`). Image prompts' images go through the vision tower together
        (taken from `preprocessed` where they are there), then share passes like text. A prompt that
        cannot be read gets its exception."""
        results: list[EncodedPrompt | Exception | None] = [None] * len(prompts)
        pending: dict[CacheKey, list[int]] = {}
        for index, prompt in enumerate(prompts):
            key = prompt.cache_key
            cached = self.prompts.get(key)
            if cached is not None:
                self.stats["kv_hits"] += 1
                results[index] = cached
            elif key in pending:
                pending[key].append(index)
            elif not prompt.images and len(prompt.ids) > self.max_prompt_tokens:
                results[index] = self.too_long(len(prompt.ids))
            else:
                pending[key] = [index]
        text = [(key, indices) for key, indices in pending.items() if not prompts[indices[0]].images]
        images = [(key, indices) for key, indices in pending.items() if prompts[indices[0]].images]
        text, groups = self._by_prefix(text)
        self._encode_whole(text, results)  # first: a new prefix is sliced from a prompt encoded whole
        self._encode_whole(self._encode_over_prefixes(groups, results), results)
        images = self._over_image_prefixes(images, results)
        embedded: list[Pending] = []
        expanded: list[dict[str, torch.Tensor]] = []
        for key, indices in images:
            try:
                expanded.append(self.model_inputs(prompts[indices[0]], reuse_vision=True, preprocessed=preprocessed))
                embedded.append((key, indices))
            except EngineInputError as exc:
                for index in indices:
                    results[index] = exc
        self.image_features(expanded, [key[1] for key, _ in embedded])
        embeds = {key: self.input_embeds(inputs) for (key, _), inputs in zip(embedded, expanded)}
        whole_images, groups = self._by_prefix(embedded, embeds)
        self._encode_whole(whole_images, results, embeds)
        self._encode_whole(self._encode_over_prefixes(groups, results, embeds), results, embeds)
        for key, _ in embedded:
            sources = self.image_sources.get(key[1]) or ()
            self.image_sources.put(key[1], (key, *sources[:IMAGE_SOURCES - 1]))
        outcomes = [result for result in results if result is not None]
        assert len(outcomes) == len(results), "every prompt has its KV or its exception"
        return outcomes

    def _encode_whole(self, items: list[Pending], results: list[EncodedPrompt | Exception | None],
                      embeds: Mapping[CacheKey, torch.Tensor] | None = None) -> None:
        """Prompts encoded whole, in passes (`_prompt_batches`): text prompts from their ids, image
        prompts (`embeds`: their input embeddings, by cache key) from their embeddings."""
        if embeds is None:
            for batch in self._prompt_batches(items, [len(key[0]) for key, _ in items]):
                rows = [list(key[0]) for key, _ in batch]
                self._store(batch, self._encode_ids(rows), [len(ids) for ids in rows], results)
            return
        for batch in self._prompt_batches(items, [int(embeds[key].shape[0]) for key, _ in items]):
            self._store(batch, self._encode_embeds([embeds[key] for key, _ in batch]),
                        [int(embeds[key].shape[0]) for key, _ in batch], results)

    def _prompt_batches(self, items: list[Item], lengths: list[int], prefix: int = 0) -> list[list[Item]]:
        """`items` grouped into encoder passes, shortest first: a pass holds at most `max_rows` rows and
        `max_prompt_tokens` padded tokens, and, with encoder graphs, stays inside one graph bucket
        whenever the prompts alone fit one. With a shared `prefix` (tokens), `lengths` are what
        follows it, and the padded-token cap counts those only."""
        graphs = self.encoder_graphs
        batches: list[list[Item]] = []
        batch: list[Item] = []
        longest = 0
        for item, length in sorted(zip(items, lengths), key=lambda pair: pair[1]):
            grown = max(longest, length)
            full = len(batch) >= self.max_rows or grown * (len(batch) + 1) > self.max_prompt_tokens
            if graphs is not None and batch and graphs.fits(len(batch), longest, prefix):
                full = full or not graphs.fits(len(batch) + 1, grown, prefix)
            if batch and full:
                batches.append(batch)
                batch, grown = [], length
            batch.append(item)
            longest = grown
        if batch:
            batches.append(batch)
        return batches

    # ------------------------------------------------------------------ shared prefixes

    def _over_image_prefixes(self, images: list[Pending], results: list[EncodedPrompt | Exception | None]) -> list[Pending]:
        """Image prompts that begin as one encoded whole before with the same images, through every
        image (a walk frame's gated stage: the question sheet and the frame lead both prompts, the
        restated answers follow), encoded as their text suffix over that prompt's first tokens' KV.
        With encoder graphs, on their static path: the prompts whose prefixes have one length (the
        frames of one sheet, each over its own frame) share passes, each row over its own prefix;
        a prompt no pass holds is encoded whole. Without (the CPU), each eagerly over its prefix as
        a long prompt's chunk is. Returns the prompts left to encode whole."""
        graphs = self.encoder_graphs
        rest: list[Pending] = []
        over: dict[int, list[tuple[Pending, EncodedPrompt, list[int]]]] = {}  # by prefix length
        for item in images:
            found = self._image_prefix(item[0])
            if found is None:
                rest.append(item)
            elif graphs is None:
                source, length, suffix = found
                prefix = EncodedPrompt(copy_rows([[(k[:, :, :length], v[:, :, :length])
                                                    for k, v in source.layers]])[0], length)
                self._store([item], [self._encode_over(prefix, suffix)], [length + len(suffix)], results)
                self.stats["image_prefix_hits"] += 1
            else:
                over.setdefault(found[1], []).append((item, found[0], found[2]))
        for length, members in over.items():
            assert graphs is not None  # (members are gathered only with graphs)
            for batch in self._prompt_batches(members, [len(suffix) for _, _, suffix in members], length):
                rows = [suffix for _, _, suffix in batch]
                layers = self._static_pass(rows, ([source.layers for _, source, _ in batch], length))
                if layers is None:
                    rest.extend(item for item, _, _ in batch)
                    continue
                self._store([item for item, _, _ in batch], layers, [length + len(row) for row in rows], results)
                self.stats["image_prefix_hits"] += len(batch)
        return rest

    def _image_prefix(self, key: CacheKey) -> tuple[EncodedPrompt, int, list[int]] | None:
        """(the source prompt's KV, the shared prefix's tokens as the model saw them, the text suffix)
        for an image prompt that another one, encoded whole and still in the LRU uncropped, began as
        through all the same images; None where none did, or (with graphs) no pass holds it."""
        window = int(self.text_config.sliding_window)
        ids, digests = key
        known = self.vision.get(digests)
        if known is None:
            return None
        for source_key in self.image_sources.get(digests) or ():
            source = self.prompts.get(source_key)
            if source is None or source.length >= window:  # gone, or its sliding layers cropped
                continue
            shared = common_length(ids, source_key[0])
            if shared >= len(ids) or ids[:shared].count(self.config.image_token_id) != len(digests):
                continue  # nothing follows the images, or the prompts part before the last image
            length = shared + sum(count + 1 for count in known[0])  # each placeholder: begin, soft tokens, end
            suffix = list(ids[shared:])
            graphs = self.encoder_graphs
            if length > source.length or (graphs is not None and not graphs.fits(1, len(suffix), length)):
                return None  # (with graphs and no bucket for it: whole, as before)
            return source, length, suffix
        return None

    def cache_holding(self, encoded: EncodedPrompt) -> DynamicCache:
        """A fresh cache holding an encoded prompt's KV as it is (the LRU's tensors: a pass over it
        concatenates onto them, never writes into them), each sliding layer counting the whole
        prompt as seen, as one eager pass over the prompt leaves a cache."""
        from transformers.cache_utils import CacheLayerMixin

        cache = self._new_cache()
        for layer, (keys, values) in zip(cache.layers, encoded.layers):
            assert isinstance(layer, CacheLayerMixin)
            hold(layer, keys, values, encoded.length)
        return cache

    def _encode_over(self, prefix: EncodedPrompt, ids: list[int]) -> Layers:
        """`ids` encoded eagerly over `prefix`'s KV as a long prompt's chunk is (`ChunkMask`): the
        whole prompt's layers."""
        cache = self.cache_holding(prefix)
        encoder = self.model.model.encoder
        with torch.no_grad():
            tokens = torch.tensor([ids], dtype=torch.long, device=self.device)
            positions = torch.arange(prefix.length, prefix.length + len(ids), device=self.device).unsqueeze(0)
            encoder.language_model(inputs_embeds=encoder.get_input_embeddings()(tokens), position_ids=positions,
                                   attention_mask=CHUNK_MASKS, past_key_values=cache)
        self.stats["encoder_passes"] += 1
        return copy_layers(cache)

    def _by_prefix(self, items: list[Pending], embeds: Mapping[CacheKey, torch.Tensor] | None = None,
                   ) -> tuple[list[Pending], list[_PrefixGroup]]:
        """The prompts to encode split into those encoded whole and groups over a shared prefix.
        A prompt may use any prefix (PREFIX_MIN tokens or more, at 16-token blocks) that is in the
        prefix LRU, or that another prompt began with where none is cached or it is longer than the
        longest cached by PREFIX_MIN tokens or more (so a sheet's prompts do not make a prefix for
        each pair of states that begin alike), and that a pass over it fits. Of those within
        PREFIX_MIN tokens of its longest it takes the one the most prompts of the call may take,
        the longest of them on a tie: each group is an encoder pass of its own, so tickets whose
        states begin with the same word share the sheet's pass rather than a pass over the sheet and
        that word, while two sheets that begin alike keep a prefix each. Text prompts' prefixes come from all
        their ids; image prompts' (`embeds`: their input embeddings, by cache key) from the text
        ahead of their first image, so the frames of one question sheet share the sheet's KV and
        only the frame and what follows it is encoded. Only with encoder graphs (the static path
        runs passes over a prefix). Every prompt's prefixes are recorded for later ones."""
        graphs = self.encoder_graphs
        if graphs is None or self.prefixes.entries <= 0:
            return items, []
        index = self.prefix_index
        # (the prompt, its ids a prefix comes from, and its options: tokens, the chained hash, the
        # prompt a new prefix is sliced from, a cached prefix's KV)
        plans: list[tuple[Pending, tuple[int, ...], list[tuple[int, int, CacheKey | None, EncodedPrompt | None]]]] = []
        for item in items:
            key = item[0]
            ids = key[0]
            size = len(ids)
            if embeds is not None:  # the text before the first image (a prefix ends before it), and the whole
                lead = ids.index(self.config.image_token_id) if self.config.image_token_id in ids else len(ids)
                ids, size = ids[:lead + 1], int(embeds[key].shape[0])
            hashes = index.hashes(ids)
            cached = list(index.hits(hashes, lambda value, ids=ids: self._cached_prefix(value, ids)))
            seen = index.seen(hashes, key)
            index.record(hashes, key)
            options: list[tuple[int, int, CacheKey | None, EncodedPrompt | None]] = []
            if seen is not None and (not cached or seen[0] - cached[0][0] >= index.minimum):
                options += [(length, hashes[length // index.block - 1], seen[1], None) for length in index.lengths(seen[0])
                            if not cached or length - cached[0][0] >= index.minimum]
            options += [(length, hashes[length // index.block - 1], None, encoded) for length, encoded in cached]
            plans.append((item, ids, [option for option in options if graphs.fits(1, size - option[0], option[0])]))
        takers = Counter(option[1] for _, _, options in plans for option in options)
        whole: list[Pending] = []
        groups: dict[int, _PrefixGroup] = {}
        for item, ids, options in plans:
            group = None
            if options:  # within PREFIX_MIN of its longest: a sheet's prompts never trade it for a shared header
                longest = max(option[0] for option in options)
                near = [option for option in options if longest - option[0] < index.minimum]
                length, value, source, encoded = max(near, key=lambda option: (takers[option[1]], option[0]))
                group = self._join(groups, value, ids[:length], source, encoded)
            if group is None:
                whole.append(item)
            else:
                group.items.append(item)
        return whole, list(groups.values())

    @staticmethod
    def _join(groups: dict[int, _PrefixGroup], value: int, ids: tuple[int, ...], source: CacheKey | None,
              encoded: EncodedPrompt | None) -> _PrefixGroup | None:
        """The group of the prefix `ids` (its chained hash `value`), made on first use: a new prefix
        names the prompt it is sliced from (`source`, its cache key), a cached one brings its KV
        (`encoded`). None where another prefix holds the hash (a collision): that prompt is encoded
        whole."""
        group = groups.get(value)
        if group is None:
            group = groups[value] = _PrefixGroup(value=value, ids=ids, items=[], source=source, encoded=encoded)
        return group if group.ids == ids else None

    def _cached_prefix(self, value: int, ids: tuple[int, ...]) -> EncodedPrompt | None:
        entry = self.prefixes.get(value)
        if entry is None or ids[: len(entry[0])] != entry[0]:
            return None
        return entry[1]

    def _encode_over_prefixes(self, groups: list[_PrefixGroup], results: list[EncodedPrompt | Exception | None],
                              embeds: Mapping[CacheKey, torch.Tensor] | None = None) -> list[Pending]:
        """Each group's prefix KV (cached, sliced from the prompt that began with it, or encoded),
        then its prompts' suffixes in passes over it: text prompts' ids, or image prompts'
        embeddings (`embeds`, by cache key). Returns the prompts of the batches the static path
        turned down, for the caller to encode whole."""
        graphs = self.encoder_graphs
        refused: list[Pending] = []
        for group in groups:
            assert graphs is not None  # (`_by_prefix` makes groups only with graphs)
            if group.encoded is None:
                group.encoded = self._prefix_kv(group)
                self.prefixes.put(group.value, (group.ids, group.encoded))
            length = len(group.ids)
            prefix = ([group.encoded.layers], length)
            items = group.items
            sizes = {key: (int(embeds[key].shape[0]) if embeds is not None else len(key[0])) for key, _ in items}
            for batch in self._prompt_batches(items, [sizes[key] - length for key, _ in items], length):
                if embeds is None:
                    layers = self._static_pass([list(key[0][length:]) for key, _ in batch], prefix)
                else:
                    layers = self._counted(graphs, graphs.encode_embeds([embeds[key][length:] for key, _ in batch], prefix))
                if layers is None:
                    refused.extend(batch)
                    continue
                self.stats["prefix_hits"] += len(batch)
                self._store(batch, layers, [sizes[key] for key, _ in batch], results)
        return refused

    def _prefix_kv(self, group: _PrefixGroup) -> EncodedPrompt:
        """A new shared prefix's KV: the first tokens of the prompt that began with it where that
        prompt's KV is in the LRU whole (no sliding layer cropped) and its ids do begin with the
        prefix (a hash names it), else one pass of its own."""
        length = len(group.ids)
        key = group.source
        source = self.prompts.get(key) if key is not None else None
        if (key is not None and source is not None and source.length < int(self.text_config.sliding_window)
                and key[0][:length] == group.ids):
            self.stats["prefixes_sliced"] += 1
            layers = [(keys[:, :, :length], values[:, :, :length]) for keys, values in source.layers]
            return EncodedPrompt(copy_rows([layers])[0], length)
        self.stats["prefixes_encoded"] += 1
        return EncodedPrompt(self._encode_ids([list(group.ids)])[0], length)

    def _static_pass(self, rows: list[list[int]], prefix: Prefix | None = None) -> list[Layers] | None:
        """Each row's KV from one pass on the encoder graphs' static path (with `prefix`, the rows are
        suffixes of its prefixes and each row's KV is the whole prompt's); None where the path turns
        it down."""
        graphs = self.encoder_graphs
        if graphs is None:
            return None
        return self._counted(graphs, graphs.encode_ids(rows, self.pad_id, prefix=prefix))

    def _store(self, batch: list[Pending], layers: list[Layers], lengths: list[int],
               results: list[EncodedPrompt | Exception | None]) -> None:
        self.stats["kv_misses"] += len(batch)
        for (key, indices), row_layers, length in zip(batch, layers, lengths):
            encoded = EncodedPrompt(row_layers, length)
            self.prompts.put(key, encoded)
            for index in indices:
                results[index] = encoded

    def image_features(self, expanded: list[dict[str, torch.Tensor]], digests: list[tuple[str, ...]]) -> None:
        """Vision features for every prompt that needs them (sets `image_features`): the images of
        all those prompts go through the vision tower together, one pass per patch layout (frames
        of the same size from any number of camera sessions share it), replayed as a CUDA graph
        where one is held; new features go into the vision LRU."""
        groups: dict[tuple[int, ...], list[int]] = {}
        for number, inputs in enumerate(expanded):
            if "pixel_values" in inputs and "image_features" not in inputs:
                groups.setdefault(tuple(inputs["pixel_values"].shape[1:]), []).append(number)
        for members in groups.values():
            pixels = torch.cat([expanded[n]["pixel_values"] for n in members])
            positions = torch.cat([expanded[n]["image_position_ids"] for n in members])
            parts: list[torch.Tensor] = []
            start = 0
            # The images of many sessions in passes of the largest image bucket (each pads to a graph).
            for count in self.policy.image_chunks(int(pixels.shape[0])):
                parts.append(self._vision_pass(pixels[start:start + count], positions[start:start + count]))
                start += count
            features = torch.cat(parts) if len(parts) > 1 else parts[0]
            sizes = [int(expanded[n]["soft_token_counts"].sum()) for n in members]
            for n, chunk in zip(members, torch.split(features, sizes)):
                expanded[n]["image_features"] = chunk
                if digests[n]:
                    self.vision.put(digests[n], ([int(c) for c in expanded[n]["soft_token_counts"]], chunk))

    def _vision_pass(self, pixels: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """One vision tower pass over images of one patch layout: a graph replay where one is held,
        else the library's forward; their soft-token features [tokens, hidden] in the model's dtype."""
        features = self.vision_graphs.features(pixels, positions) if self.vision_graphs is not None else None
        if features is None:
            # @can_return_tuple takes return_dict; the signature it passes on does not say so.
            encoder = self.model.model.encoder
            output = encoder.get_image_features(pixels, positions, return_dict=True)  # pyright: ignore[reportCallIssue]
            features = output.pooler_output
            assert features is not None  # the tower's pooled features (ModelOutput declares every field optional)
        else:
            self.stats["vision_graph_replays"] += 1
        self.stats["vision_passes"] += 1
        return features.reshape(-1, features.shape[-1]).to(self.model.dtype)

    def input_embeds(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """A prompt's input embeddings [n, hidden] from its `model_inputs`, its image features (from
        the vision LRU, or through the vision tower where they are missing) scattered over its soft
        tokens, as the encoder model does before its text layers."""
        input_ids = inputs["input_ids"]
        embeds = self.model.model.encoder.get_input_embeddings()(input_ids)
        if "pixel_values" in inputs and "image_features" not in inputs:
            self.image_features([inputs], [()])
        features = inputs.get("image_features")
        if features is not None:
            mask = (input_ids == self.config.image_token_id).unsqueeze(-1)
            embeds = embeds.masked_scatter(mask, features.to(embeds.dtype))
        return embeds[0]

    def _encode_ids(self, rows: list[list[int]]) -> list[Layers]:
        """Each row's KV layers: one pass on the encoder graphs' static path, or one eager
        left-padded encoder pass."""
        replayed = self._static_pass(rows)
        if replayed is not None:
            return replayed
        self.stats["encoder_passes"] += 1
        embeds = self.model.model.encoder.get_input_embeddings()(self._left_padded(rows))
        return self._encode_eager(embeds, [len(ids) for ids in rows])

    def _encode_embeds(self, rows: list[torch.Tensor]) -> list[Layers]:
        graphs = self.encoder_graphs
        if graphs is not None:
            replayed = self._counted(graphs, graphs.encode_embeds(rows))
            if replayed is not None:
                return replayed
        self.stats["encoder_passes"] += 1
        lengths = [int(row.shape[0]) for row in rows]
        longest = max(lengths)
        embeds = torch.stack([F.pad(row, (0, 0, longest - row.shape[0], 0)) for row in rows])
        return self._encode_eager(embeds, lengths)

    def _counted(self, graphs: EncoderGraphs, replayed: list[Layers] | None) -> list[Layers] | None:
        """`replayed` as it is, a pass on the encoder graphs' static path counted where there was one:
        a replay, or a large batch's ungraphed pass."""
        if replayed is not None:
            self.stats["encoder_passes"] += 1
            graphed = graphs.last_graphed
            self.stats["encoder_graph_replays" if graphed else "encoder_unbucketed_passes"] += 1
        return replayed

    def _left_padded(self, rows: list[list[int]]) -> torch.Tensor:
        longest = max(len(ids) for ids in rows)
        pad = self.pad_id
        return torch.tensor([[pad] * (longest - len(ids)) + ids for ids in rows], device=self.device)

    def _encode_eager(self, embeds: torch.Tensor, lengths: list[int]) -> list[Layers]:
        """The eager encoder pass over left-padded embeddings; each row's layers, left padding dropped."""
        longest = int(embeds.shape[1])
        attention = None  # no padding: no mask, so SDPA runs its causal kernels (a mask is ~4x slower at 8k)
        if min(lengths) < longest:
            attention = torch.tensor([[0] * (longest - n) + [1] * n for n in lengths], device=self.device)
        offsets = torch.tensor([longest - n for n in lengths], device=self.device).unsqueeze(1)
        positions = (torch.arange(longest, device=self.device).unsqueeze(0) - offsets).clamp_min(0)
        cache = self._new_cache()
        self.model.model.encoder.language_model(inputs_embeds=embeds, attention_mask=attention,
                                                position_ids=positions, past_key_values=cache)
        filled = cache_kv(cache)
        rows: list[Layers] = []
        for row, length in enumerate(lengths):
            layers: Layers = []
            for keys, values in filled:
                start = max(0, keys.shape[2] - length)  # drop the left padding this layer still holds
                layers.append((keys[row:row + 1, :, start:], values[row:row + 1, :, start:]))
            rows.append(layers)
        return copy_rows(rows)  # laid out as the encoder graphs leave KV (prompt_graphs.py)

    def encode_steps(self, prompt: Prompt, preprocessed: Preprocessed | None = None) -> Generator[None, None, EncodedPrompt]:
        """A long prompt's KV encoded in chunks of up to `prefill_chunk` tokens (shorter as the prompt
        grows: `chunk_length`), each chunk one encoder pass over the KV of the chunks before it (the
        full-attention layers written into the prompt's own buffers, `prompt_layer`; the
        sliding-window layers keep their window), with a yield between two chunks so other reads run
        between them; stored in the LRU like any other prompt. Its images (ahead of the text) go through
        the vision tower first."""
        key = prompt.cache_key
        cached = self.prompts.get(key)
        if cached is not None:
            self.stats["kv_hits"] += 1
            return cached
        encoder = self.model.model.encoder
        embed = encoder.get_input_embeddings()
        with torch.no_grad():
            if prompt.images:  # the image features merged into the whole prompt's embeddings first
                inputs = self.model_inputs(prompt, reuse_vision=True, preprocessed=preprocessed)
                self.image_features([inputs], [key[1]])
                whole = self.input_embeds(inputs)
                length = int(whole.shape[0])

                def embeds_of(start: int, end: int) -> torch.Tensor:
                    return whole[None, start:end]
            else:  # text alone: each chunk's embeddings as it comes (a 110k prompt's whole are 0.6 GB)
                length = len(prompt.ids)
                ids = torch.tensor([prompt.ids[:self.max_prompt_tokens]], dtype=torch.long, device=self.device)

                def embeds_of(start: int, end: int) -> torch.Tensor:
                    return embed(ids[:, start:end])
        if length > self.max_prompt_tokens:
            raise self.too_long(length)
        cache = self._new_cache()
        for index, layer in enumerate(cache.layers):
            if not getattr(layer, "is_sliding", True):
                cache.layers[index] = prompt_layer(length)
        bounds = chunk_bounds(length, self.prefill_chunk)
        for number, (start, end) in enumerate(bounds, 1):
            if start:
                yield  # between two chunks: other work may run
            self.step_note = f"chunk {number} of {len(bounds)} ({end - start} tokens at {start}) of a {length}-token prompt"
            with torch.no_grad():
                positions = torch.arange(start, end, device=self.device).unsqueeze(0)
                encoder.language_model(inputs_embeds=embeds_of(start, end), position_ids=positions,
                                       attention_mask=CHUNK_MASKS if start else None, past_key_values=cache)
            self.stats["encoder_passes"] += 1
            self.stats["encoder_chunks"] += 1
            self.finish_turn()
        encoded = EncodedPrompt(copy_layers(cache), length)
        self.prompts.put(key, encoded)
        self.stats["kv_misses"] += 1
        self.stats["prompts_chunked"] += 1
        return encoded

    def finish_turn(self) -> None:
        """Wait for the device work a chunk launched before the turn ends. CUDA runs kernels behind
        the host: a chunk's turn would end as soon as its kernels were queued, the next reads' kernels
        would queue behind several chunks, and their answers (and the first read that copies to the
        host) would wait out that backlog, seconds at 110k tokens, though every turn looked short.
        Waiting here makes a turn's wall time its device time, as the scheduling contract means it
        (app/engine/base.py). Nothing to wait for on the CPU."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def too_long(self, length: int) -> EngineInputError:
        return EngineInputError(
            f"the prompt is {length} tokens; this server reads at most {self.max_prompt_tokens} (MAX_PROMPT_TOKENS, "
            "within what its KV store holds)",
            status=400, param="state", error_type="max_tokens_exceeded",
        )
