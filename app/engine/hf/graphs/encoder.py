"""CUDA-graph replay of the prompt-encoding (encoder) pass.

A batch of prompts (their input embeddings, right-padded to a bucket of rows and length, optionally
over a shared prefix's KV) is encoded by replaying a graph captured for its bucket, and each row's
KV is copied out exactly as an eager pass stores it. Batches whose buckets hold EAGER_TOKENS tokens
or more run the same static path without a graph; prompts past the largest bucket, or batches past
the size cap, return None for the caller to encode eagerly. With `capture=False` the static path
runs eagerly: that is how the CPU tests check it against the eager encoder. Design and the numbers
behind it: docs/design.md §4.7 and §5.2.
"""

from __future__ import annotations

import logging
import math
from collections import OrderedDict
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import torch

from app.engine.hf.parts import encoder_layers

if TYPE_CHECKING:
    from transformers import DiffusionGemmaForBlockDiffusion

log = logging.getLogger("djev.engine")

ROW_BUCKETS = (1, 2, 4, 8, 16, 32)
# Fine steps where batches are large (a padded token costs a token's full compute: at 32 rows of
# 300-token prompts a 512 bucket made the encoder 1.7x slower than 320 would), coarse where prompts
# are long and batches small. Every bucket is captured only when a batch needs it.
LENGTH_BUCKETS = (64, 128, 192, 256, 320, 384, 448, 512, 640, 768, 896, 1024, 1536, 2048, 3072, 4096)

# A batch whose buckets hold this many tokens (rows x length) or more runs without a graph, unpadded
# but for EAGER_STEP (chosen by bench_gpu_decisions --eager-tokens: 8192 against 4096 at 32 clients).
EAGER_TOKENS = 8192
EAGER_STEP = 8

# One encoded prompt as the decoder reads it: per layer (keys, values), each [1, heads, n, dim].
Layers = list[tuple[torch.Tensor, torch.Tensor]]


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


def _round_up(value: int) -> int:
    return -(-value // EAGER_STEP) * EAGER_STEP


def bucket_of(value: int, buckets: Sequence[int]) -> int | None:
    """The smallest bucket that holds `value`, or None past the largest."""
    return next((bucket for bucket in buckets if bucket >= value), None)


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


# A static pass's shape: (rows, suffix length, prefix slots); prefix slots are 0 without a prefix.
Key = tuple[int, int, int]


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
        max_graphs: int = 32,
        max_token_slots: int = 16 * 1024,
        eager_tokens: int = EAGER_TOKENS,
        row_buckets: Sequence[int] = ROW_BUCKETS,
        length_buckets: Sequence[int] = LENGTH_BUCKETS,
    ) -> None:
        self.encoder = model.model.encoder
        self.text_model = self.encoder.language_model
        self.layers = encoder_layers(model)
        self.layer_types = list(layer_types)
        self.device = device
        self.sliding_window = sliding_window
        self.capture = capture
        self.max_graphs = max_graphs
        self.max_token_slots = max_token_slots
        self.eager_tokens = eager_tokens
        self.row_buckets = tuple(row_buckets)
        self.length_buckets = tuple(length_buckets)
        self.graphs: OrderedDict[Key, _Graph] = OrderedDict()
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.disabled: str | None = None
        self.captures = 0
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
        return shared + sum(graph.memory for graph in self.graphs.values())

    def key(self, rows: int, longest: int, prefix: int = 0) -> Key | None:
        """(rows, length, prefix slots) of the static pass for a batch of `rows` suffixes of at most
        `longest` tokens over a shared prefix of `prefix` tokens (0: none): its buckets (the prefix's
        slots a length bucket too), or where the buckets hold `eager_tokens` (EAGER_TOKENS) or more,
        its own rows and its lengths rounded up to EAGER_STEP; None past the caps, and for a prefix
        whose pass would not fit the sliding window."""
        batch = bucket_of(rows, self.row_buckets)
        length = bucket_of(longest, self.length_buckets)
        slots = bucket_of(prefix, self.length_buckets) if prefix else 0
        if batch is None or length is None or slots is None:
            return None
        if batch * length >= self.eager_tokens:
            batch, length, slots = rows, _round_up(longest), _round_up(prefix)
        if batch * (slots + length) > self.max_token_slots or (slots and slots + length > self.sliding_window):
            return None
        return batch, length, slots

    def graphed(self, key: Key) -> bool:
        """Whether the pass for `key` is replayed from a graph: buckets under `eager_tokens` (an
        unbucketed key is never one: its buckets would hold more)."""
        rows, length, slots = key
        return (rows in self.row_buckets and length in self.length_buckets and rows * length < self.eager_tokens
                and (not slots or slots in self.length_buckets))

    def fits(self, rows: int, longest: int, prefix: int = 0) -> bool:
        return self.disabled is None and self.key(rows, longest, prefix) is not None

    # ------------------------------------------------------------------ encoding

    def encode_ids(self, rows: Sequence[Sequence[int]], pad_id: int,
                   prefix: tuple[Layers, int] | None = None) -> list[Layers] | None:
        """Each row's KV, or None to go eager (no bucket, or graphs disabled). With `prefix` (its
        layers and length), the rows are suffixes of that prefix, and each row's KV is the whole
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

    def encode_embeds(self, rows: Sequence[torch.Tensor]) -> list[Layers] | None:
        """The same from input embeddings ([n, hidden] each, e.g. with image features scattered in)."""
        key = self._key_or_none(len(rows), max(int(embeds.shape[0]) for embeds in rows), 0)
        if key is None:
            return None
        def load(graph: _Graph) -> None:
            for row, embeds in enumerate(rows):
                graph.embeds[row, : embeds.shape[0]].copy_(embeds)

        return self._run(key, [int(embeds.shape[0]) for embeds in rows], load)

    def _key_or_none(self, rows: int, longest: int, prefix: int) -> Key | None:
        if self.disabled is not None or rows == 0 or longest == 0:
            return None
        return self.key(rows, longest, prefix)

    def _run(self, key: Key, lengths: list[int], load: Callable[[_Graph], object],
             prefix: tuple[Layers, int] | None = None) -> list[Layers] | None:
        try:
            self.last_graphed = self.graphed(key)
            graph = self.graphs.get(key)
            if graph is None:
                graph = self._build(key)
                if self.last_graphed:
                    self._hold(key, graph)
            else:
                self.graphs.move_to_end(key)
            load(graph)
            prefix_length = self._load_prefix(graph, prefix) if prefix else 0
            if graph.graph is not None:
                graph.graph.replay()
            else:
                self._forward(graph)
            return self._rows_layers(graph, lengths, prefix_length)
        except Exception as exc:  # noqa: BLE001 - a capture that fails must not fail reads: go eager
            self.disabled = f"{type(exc).__name__}: {exc}"
            self.graphs.clear()
            log.warning("encoder CUDA graphs disabled, prompts are encoded eagerly: %s", self.disabled)
            return None

    def _load_prefix(self, graph: _Graph, prefix: tuple[Layers, int]) -> int:
        """The shared prefix's KV into every row's first slots, right-aligned, and its length into
        the static input every graph reads (`prefix_length`); returns the length."""
        layers, length = prefix
        slots = graph.cache.prefix_slots
        targets, sources = [], []
        for index, (keys, values) in enumerate(layers):
            for buffer, source in ((graph.cache.keys[index], keys), (graph.cache.values[index], values)):
                targets.append(buffer[:, :, slots - length:slots])
                sources.append(source.expand(graph.rows, -1, -1, -1))
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
        return shared_view(self._storage, name, shape, dtype, self.device, self.max_token_slots)

    def _build(self, key: Key) -> _Graph:
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
        before = torch.cuda.memory_allocated(self.device) if self.capture else 0
        if self.capture and self.graphed(key):
            stream = torch.cuda.Stream(device=self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm-up outside the capture (allocator, cuBLAS plans)
                    self._forward(graph)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            cuda_graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(cuda_graph, pool=self.pool):
                self._forward(graph)
            graph.graph = cuda_graph
            graph.memory = torch.cuda.memory_allocated(self.device) - before
            self.captures += 1
            log.info("captured the encoder pass for %d rows x %d tokens after %d prefix slots (%.0f MiB)", batch,
                     length, slots, graph.memory / 2**20)
        return graph

    def _hold(self, key: Key, graph: _Graph) -> None:
        self.graphs[key] = graph
        while len(self.graphs) > self.max_graphs:
            self.graphs.popitem(last=False)

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
