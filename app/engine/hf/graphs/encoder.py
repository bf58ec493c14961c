"""CUDA-graph replay of the prompt-encoding (encoder) pass.

A batch of prompts (their input embeddings, right-padded to a bucket of rows and length, optionally
over a shared prefix's KV) is encoded by replaying a graph captured for its bucket, and each row's
KV is copied out exactly as an eager pass stores it. The buckets and the captured set are the shape
policy's (app/engine/hf/graphs/shapes.py); the graphs are held in a GraphCache
(app/engine/hf/graphs/cache.py), captured before `ready` and never evicted. Batches whose buckets hold
EAGER_TOKENS tokens or more run the same static path without a graph; prompts past the largest
bucket, or batches past the size cap, return None for the caller to encode eagerly (counted). With
`capture=False` the static path runs eagerly: that is how the CPU tests check it against the eager
encoder. Design and the numbers behind it: docs/design.md §4.7, §4.8 and §5.2.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from dataclasses import dataclass
from functools import partial
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import torch

from app.engine.hf.graphs.cache import GraphCache, capture
from app.engine.hf.graphs.shapes import EncoderKey, ShapePolicy
from app.engine.hf.parts import encoder_layers, pattern_length, through_first_layers

if TYPE_CHECKING:
    from transformers import DiffusionGemmaForBlockDiffusion

    from app.engine.hf.graphs.cache import PoolHandle

log = logging.getLogger("djev.engine")

# One encoded prompt as the decoder reads it: per layer (keys, values), each [1, heads, n, dim].
Layers = list[tuple[torch.Tensor, torch.Tensor]]
# What a pass's rows are encoded over: the prefixes' KV, one Layers for every row (a question sheet)
# or one per row (each walk frame's own sheet and image, all of one length), and that length. Each
# prefix's layers hold at least `length` tokens; only the first `length` are read.
Prefix = tuple[Sequence[Layers], int]


def token_major(tensor: torch.Tensor) -> torch.Tensor:
    """A [rows, heads, tokens, dim] view of a new tensor laid out [rows, tokens, heads, dim]."""
    rows, heads, tokens, dim = tensor.shape
    return tensor.new_empty((rows, tokens, heads, dim)).transpose(1, 2)


def copy_rows(rows: Sequence[Layers]) -> list[Layers]:
    """Copies of each row's layers ((keys, values) views [1, heads, tokens, dim], e.g. rows of a batch's
    cache), each laid out token-major, all made with one `torch._foreach_copy_`: where the views are
    token-major too, every copy is a contiguous block and a batch of prompts goes in a launch or a
    few."""
    sources = [tensor for layers in rows for pair in layers for tensor in pair]
    copies = [token_major(source) for source in sources]
    copy_all([copy[0] for copy in copies], [source[0] for source in sources])
    pairs = iter(zip(copies[::2], copies[1::2]))
    return [[next(pairs) for _ in layers] for layers in rows]


def copy_all(targets: Sequence[torch.Tensor], sources: Sequence[torch.Tensor]) -> None:
    """targets[i].copy_(sources[i]) for all i, in one `torch._foreach_copy_`. Its fast path (a
    launch or a few for the whole list) takes pairs of equal sizes and strides with no gaps, which
    [heads, tokens, dim] views of token-major buffers are; any other pair is copied on its own."""
    if targets:
        # torch binds its _foreach ops into its namespace at import; its stubs declare them in torch._C.
        torch._foreach_copy_(list(targets), list(sources))  # pyright: ignore[reportPrivateImportUsage]


def shared_view(storage: dict[str, torch.Tensor], name: str, shape: tuple[int, ...], dtype: torch.dtype,
                device: torch.device, slots: int) -> torch.Tensor:
    """A static tensor of `shape` ([rows, tokens, ...]) over the flat buffer `storage[name]`, made
    once for `slots` tokens of shape[2:] each: graphs never run at once, so every graph's static
    tensors view one set of buffers, the memory of one largest batch however many are held."""
    buffer = storage.get(name)
    if buffer is None:
        buffer = torch.zeros(slots * math.prod(shape[2:]), dtype=dtype, device=device)
        storage[name] = buffer
    return buffer[: math.prod(shape)].view(shape)


class _StaticKV:
    """What the encoder's attention layers write through: each layer's keys and values are copied
    into static buffers (views of storage shared by every graph: graphs never run at once, and a
    batch's KV is copied out, `copy_rows`, right after its replay). Only `update` is called, since positions and
    masks are passed in. With `prefix_slots`, the buffers' first slots hold a shared prefix's KV:
    the pass's own KV is written after them, and attention reads the whole buffer."""

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor], prefix_slots: int = 0) -> None:
        self.keys = keys
        self.values = values
        self.prefix_slots = prefix_slots

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        if not self.prefix_slots:
            keys.copy_(key_states)
            values.copy_(value_states)
            return key_states, value_states
        keys[:, :, self.prefix_slots:].copy_(key_states)
        values[:, :, self.prefix_slots:].copy_(value_states)
        return keys, values


@dataclass
class _Graph:
    rows: int
    length: int
    embeds: torch.Tensor  # [rows, length, hidden] input embeddings, right-padded
    cache: _StaticKV
    graph: torch.cuda.CUDAGraph | None = None
    memory: int = 0


class EncoderGraphs:
    def __init__(
        self,
        model: DiffusionGemmaForBlockDiffusion,
        layer_types: Sequence[str],
        device: torch.device,
        *,
        sliding_window: int,
        capture: bool,
        policy: ShapePolicy,
        stats: Counter[str] | None = None,
        pool: PoolHandle | None = None,
    ) -> None:
        self.encoder = model.model.encoder
        self.text_model = self.encoder.language_model
        self.layers = encoder_layers(model)
        self.layer_types = list(layer_types)
        self.pattern = pattern_length(self.layer_types)  # layers from the first that hold one of each type
        self.device = device
        self.sliding_window = sliding_window
        self.capture = capture
        self.policy = policy
        self.stats: Counter[str] = stats if stats is not None else Counter()
        self.cache: GraphCache[EncoderKey, _Graph] = GraphCache("encoder", self._build, self.stats,
                                                                      policy.encoder_pieces)
        self.captures = 0  # graphs captured (CUDA graphs; 0 on the static path)
        self.pool = pool if pool is not None or not capture else torch.cuda.graph_pool_handle()
        self.last_graphed = False  # whether the last pass was a replay (else unbucketed, eager)
        self._storage: dict[str, torch.Tensor] = {}  # flat buffers every graph's static tensors view
        # A shared prefix's length, read by every graph at replay (graphs never run at once).
        self.prefix_length = torch.zeros(1, dtype=torch.long, device=device)

    @property
    def buffers(self) -> Mapping[str, torch.Tensor]:
        """The flat static buffers every graph's tensors view, by name ("embeds", then "k<layer>" and
        "v<layer>"), each made when a graph first needs it; a read-only view of the mapping."""
        return MappingProxyType(self._storage)

    @property
    def memory_bytes(self) -> int:
        """GPU memory the graphs hold: the shared static buffers (inputs and KV of the largest batch)
        plus what each capture added to the pool when it was built."""
        shared = sum(t.numel() * t.element_size() for t in self.buffers.values())
        return shared + sum(graph.memory for graph in self.cache.graphs())

    def key(self, rows: int, longest: int, prefix: int = 0) -> EncoderKey | None:
        """The static pass's shape for `rows` suffixes of at most `longest` tokens over a prefix of
        `prefix` tokens: `ShapePolicy.encoder_key`."""
        return self.policy.encoder_key(rows, longest, prefix)

    def graphed(self, key: EncoderKey) -> bool:
        """Whether the pass for `key` is replayed from a graph (`ShapePolicy.encoder_graphed`)."""
        return self.policy.encoder_graphed(key)

    def fits(self, rows: int, longest: int, prefix: int = 0) -> bool:
        return self.key(rows, longest, prefix) is not None

    def prepare(self, key: EncoderKey) -> bool:
        """Build (capture) the graph for `key` ahead of use; False where it cannot be built."""
        return key in self.cache or self.cache.build(key) is not None

    # ------------------------------------------------------------------ encoding

    def encode_ids(self, rows: Sequence[Sequence[int]], pad_id: int,
                   prefix: Prefix | None = None) -> list[Layers] | None:
        """Each row's KV, or None to go eager (no bucket, or graphs disabled). With `prefix`, the
        rows are suffixes of its prefixes (one shared, or one each), and each row's KV is the whole
        prompt's."""
        key = self._key_or_none(len(rows), max(len(ids) for ids in rows), prefix[1] if prefix else 0)
        if key is None:
            return None
        length = key[1]
        padded = torch.full((len(rows), length), pad_id, dtype=torch.long)
        for row, ids in enumerate(rows):
            if ids:
                padded[row, : len(ids)] = torch.tensor(list(ids), dtype=torch.long)
        embeds = self.encoder.get_input_embeddings()(padded.to(self.device))
        return self._run(key, [len(ids) for ids in rows], lambda graph: graph.embeds[: len(rows)].copy_(embeds),
                         prefix)

    def encode_embeds(self, rows: Sequence[torch.Tensor], prefix: Prefix | None = None) -> list[Layers] | None:
        """The same from input embeddings ([n, hidden] each, e.g. with image features scattered in)."""
        key = self._key_or_none(len(rows), max(int(embeds.shape[0]) for embeds in rows), prefix[1] if prefix else 0)
        if key is None:
            return None

        def load(graph: _Graph) -> None:
            for row, embeds in enumerate(rows):
                graph.embeds[row, : embeds.shape[0]].copy_(embeds)

        return self._run(key, [int(embeds.shape[0]) for embeds in rows], load, prefix)

    def _key_or_none(self, rows: int, longest: int, prefix: int) -> EncoderKey | None:
        if rows == 0 or longest == 0:
            return None
        key = self.key(rows, longest, prefix)
        if key is None:
            self.stats["encoder_graph_fallbacks"] += 1
        return key

    def _run(self, key: EncoderKey, lengths: list[int], load: Callable[[_Graph], object],
             prefix: Prefix | None = None) -> list[Layers] | None:
        """The pass for `key`: a held graph's replay, or for an unbucketed key the static path
        without a graph; None (the caller encodes eagerly) where a graphed key has no graph (frozen
        and not held, or its capture failed: counted). A failure while replaying fails this pass."""
        self.last_graphed = self.graphed(key)
        graph = self.cache.get(key) if self.last_graphed else self._build(key)
        if graph is None:
            return None
        load(graph)
        prefix_length = self._load_prefix(graph, prefix) if prefix else 0
        if graph.graph is not None:
            graph.graph.replay()
        else:
            self._forward(graph)
        return self._rows_layers(graph, lengths, prefix_length)

    def _load_prefix(self, graph: _Graph, prefix: Prefix) -> int:
        """The prefixes' KV into the rows' first slots, right-aligned (one shared prefix into every
        row, padding rows too; one per row into its row), and their length into the static input
        every graph reads (`prefix_length`); returns the length."""
        rows, length = prefix
        slots = graph.cache.prefix_slots
        targets, sources = [], []
        for row, layers in enumerate(rows):
            start, stop = (0, graph.rows) if len(rows) == 1 else (row, row + 1)
            for index, (keys, values) in enumerate(layers):
                for buffer, source in ((graph.cache.keys[index], keys), (graph.cache.values[index], values)):
                    targets.append(buffer[start:stop, :, slots - length:slots])
                    sources.append(source[:, :, :length].expand(stop - start, -1, -1, -1))
        copy_all(targets, sources)
        self.prefix_length.fill_(length)
        return length

    def _rows_layers(self, graph: _Graph, lengths: list[int], prefix_length: int = 0) -> list[Layers]:
        """Each row's real tokens, its prefix's included, out of the graph's buffers (copies: the next
        replay overwrites them), each sliding layer cropped to the last window - 1 tokens as
        DynamicCache keeps them; all in one `copy_rows`."""
        slots = graph.cache.prefix_slots
        rows = []
        for row, n in enumerate(lengths):
            end, total = slots + n, prefix_length + n
            layers: Layers = []
            for index, layer_type in enumerate(self.layer_types):
                keep = min(total, self.sliding_window - 1) if layer_type == "sliding_attention" else total
                keys, values = graph.cache.keys[index], graph.cache.values[index]
                layers.append((keys[row:row + 1, :, end - keep:end], values[row:row + 1, :, end - keep:end]))
            rows.append(layers)
        return copy_rows(rows)

    # ------------------------------------------------------------------ building

    def _view(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return shared_view(self._storage, name, shape, dtype, self.device, self.policy.encoder_slots)

    def _build(self, key: EncoderKey) -> _Graph:
        batch, length, slots = key
        hidden = self.text_model.config.hidden_size
        dtype = self.text_model.embed_tokens.weight.dtype
        keys, values = [], []
        for index, attention in enumerate(layer.self_attn for layer in self.layers):
            heads = attention.k_proj.out_features // attention.head_dim
            # token-major; attention sees [rows, heads, tokens, dim]
            shape = (batch, slots + length, heads, attention.head_dim)
            keys.append(self._view(f"k{index}", shape, dtype).transpose(1, 2))
            values.append(self._view(f"v{index}", shape, dtype).transpose(1, 2))
        graph = _Graph(
            rows=batch, length=length,
            embeds=self._view("embeds", (batch, length, hidden), dtype),
            cache=_StaticKV(keys, values, slots),
        )
        if self.capture and self.graphed(key):
            before = torch.cuda.memory_allocated(self.device)
            forward = partial(self._forward, graph)
            first = through_first_layers(self.text_model, self.pattern, forward) if self.cache.first_run(key) else None
            graph.graph, _ = capture(forward, self.pool, self.device,
                                     first=first, times=self.stats)
            self.captures += 1
            graph.memory = torch.cuda.memory_allocated(self.device) - before
            log.debug("captured the encoder pass for %d rows x %d tokens after %d prefix slots (%.0f MiB)", batch,
                      length, slots, graph.memory / 2**20)
        return graph

    def _forward(self, graph: _Graph) -> None:
        """The encoder pass over the static inputs: causal attention without a mask (None makes SDPA
        run its causal kernels), the sliding window's mask only where the bucket is longer than it.
        Over a prefix, positions start at its length and one mask serves every layer: the prefix's
        tokens and the suffix causally (`key` only builds such a pass inside the window)."""
        length = graph.length
        index = torch.arange(length, device=self.device)
        masks: dict[str, torch.Tensor | None] = {"full_attention": None, "sliding_attention": None}
        positions = index.view(1, -1).expand(graph.rows, -1)
        slots = graph.cache.prefix_slots
        if slots:
            keys = torch.arange(slots + length, device=self.device).view(1, -1)
            visible = (keys >= slots - self.prefix_length) & (keys <= slots + index.view(-1, 1))
            mask = visible.view(1, 1, length, slots + length)
            masks = {"full_attention": mask, "sliding_attention": mask}
            positions = positions + self.prefix_length
        elif length > self.sliding_window:
            query, key = index.view(-1, 1), index.view(1, -1)
            masks["sliding_attention"] = ((key <= query) & (query - key < self.sliding_window)).view(1, 1, length, length)
        self.text_model(inputs_embeds=graph.embeds, attention_mask=masks, position_ids=positions,
                        past_key_values=graph.cache)
