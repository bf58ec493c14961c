"""CUDA-graph replay of the decoder pass.

A read is loaded into static buffers of a bucketed shape (rows, canvas width, prompt KV length:
app/engine/hf/graphs/shapes.py) and the graph captured for that shape is replayed; it reads what the
eager path reads (padding rows, canvas positions and KV slots are masked out). Graphs share one
memory pool and one set of static buffers, and are held in a GraphCache (app/engine/hf/graphs/cache.py):
captured before `ready`, never evicted; a shape outside the set goes down the eager path, counted.
With `capture=False` the same static-buffer path runs eagerly: that is how the CPU tests check the
bucketing, padding and masks against the plain path. Design and numbers: docs/design.md §4.7, §4.8, §5.2.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Sequence

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from app.engine.hf.graphs.cache import GraphCache, capture
from app.engine.hf.graphs.encoder import copy_all, shared_view
from app.engine.hf.graphs.shapes import FIRST_KV_BUCKET, DecoderKey, ShapePolicy, doubling
from app.engine.hf.parts import decoder_layers, encoder_layers, pattern_length, text_config, through_first_layers

if TYPE_CHECKING:
    from transformers import DiffusionGemmaForBlockDiffusion
    from transformers.cache_utils import Cache
    from transformers.models.diffusion_gemma.modeling_diffusion_gemma import DiffusionGemmaDecoderTextAttention

    from app.engine.hf.graphs.cache import PoolHandle
    from app.engine.hf.prompts import EncodedPrompt

    # A row of a decoder pass: a prompt's KV and the canvas read over it.
    Row = tuple[EncodedPrompt, Sequence[int]]

log = logging.getLogger("djev.engine")


def bucket_rows(rows: int) -> int:
    """Rows padded up to a power of two."""
    return doubling(1, rows)[-1]


def bucket_length(length: int) -> int:
    """A prompt's KV length padded up to FIRST_KV_BUCKET, twice that, four times, ..."""
    return doubling(FIRST_KV_BUCKET, length)[-1]


@dataclass(frozen=True)
class CanvasKV:
    """A graph's static KV buffers of one layer, [rows, heads, prompt + canvas, dim], the prompt in
    the first `length` positions. transformers' decoder attention concatenates the prompt KV with
    the canvas's in every layer (a copy of the whole prompt KV, 21 ms a pass at 32 rows on an H200);
    `append_in_place` writes the canvas's KV after the prompt instead and attends over the buffer."""

    keys: torch.Tensor
    values: torch.Tensor
    length: int


class CanvasLayer(DynamicLayer):
    """A graph's cache layer: a DynamicLayer over the static prompt KV buffers, with the CanvasKV
    the pass writes the canvas's KV into."""

    def __init__(self, canvas_kv: CanvasKV) -> None:
        super().__init__()
        self.canvas_kv = canvas_kv


def append_in_place(attention: DiffusionGemmaDecoderTextAttention) -> None:
    """Give a decoder attention module an `append_to_cache` that writes into a graph's CanvasKV
    when its cache layer has one, and concatenates as transformers does otherwise (eager passes)."""
    original = attention.append_to_cache
    if getattr(original, "canvas_kv", False):
        return

    def append_to_cache(past_key_values: Cache, key_states: torch.Tensor,
                        value_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        layer = past_key_values.layers[attention.layer_idx]
        if not isinstance(layer, CanvasLayer):
            return original(past_key_values, key_states, value_states)
        buffers = layer.canvas_kv
        end = buffers.length + key_states.shape[2]
        buffers.keys[:, :, buffers.length:end].copy_(key_states)
        buffers.values[:, :, buffers.length:end].copy_(value_states)
        return buffers.keys[:, :, :end], buffers.values[:, :, :end]

    # A marker: Python functions take attributes, typeshed's FunctionType declares none.
    append_to_cache.canvas_kv = True  # pyright: ignore[reportFunctionMemberAccess]
    attention.append_to_cache = append_to_cache


@dataclass
class _Graph:
    rows: int
    width: int
    lengths: dict[str, int]  # layer type -> bucketed KV length
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    canvas: torch.Tensor
    positions: torch.Tensor
    masks: dict[str, torch.Tensor]
    cache: DynamicCache
    conditioning: torch.Tensor | None = None  # [rows, width, vocab] self-conditioning logits, if keyed so
    graph: torch.cuda.CUDAGraph | None = None
    output: torch.Tensor | None = None
    memory: int = 0


class DecoderGraphs:
    def __init__(
        self,
        model: DiffusionGemmaForBlockDiffusion,
        layer_types: Sequence[str],
        device: torch.device,
        *,
        pad_id: int,
        capture: bool,
        policy: ShapePolicy,
        stats: Counter[str] | None = None,
        pool: PoolHandle | None = None,
    ) -> None:
        self.model = model
        self.layer_types = list(layer_types)
        self.pattern = pattern_length(self.layer_types)  # layers from the first that hold one of each type
        # The first layer of each type: its KV length stands for every layer of that type.
        self.first_layer = {t: self.layer_types.index(t) for t in dict.fromkeys(self.layer_types)}
        self.device = device
        self.pad_id = pad_id
        self.capture = capture
        self.policy = policy
        self.stats: Counter[str] = stats if stats is not None else Counter()
        self.cache: GraphCache[DecoderKey, _Graph] = GraphCache("decoder", self._build, self.stats,
                                                                      policy.decoder_pieces)
        self.captures = 0  # graphs captured (CUDA graphs; 0 on the static path)
        self.pool = pool if pool is not None or not capture else torch.cuda.graph_pool_handle()
        self.vocab = int(text_config(model).vocab_size)
        self._storage: dict[str, torch.Tensor] = {}
        for layer in decoder_layers(model):
            append_in_place(layer.self_attn)

    def key(self, rows: Sequence[Row], conditioning: torch.Tensor | None = None) -> DecoderKey | None:
        width = max(len(canvas) for _, canvas in rows)
        if conditioning is not None and tuple(conditioning.shape[:2]) != (len(rows), width):
            return None
        longest = max(encoded.layers[index][0].shape[2] for encoded, _ in rows for index in self.first_layer.values())
        return self.policy.decoder_key(len(rows), width, longest, conditioning is not None)

    def hidden(self, rows: Sequence[Row], conditioning: torch.Tensor | None = None) -> torch.Tensor | None:
        """The decoder's hidden states for `rows` ([len(rows), width, hidden]), or None to go eager
        (a shape outside the captured set: counted by the cache).

        The tensor lives in the graphs' shared memory pool: it is valid until the next call, so the
        caller reads it right away (as DiffusionRunner does). `conditioning` ([rows, width, vocab],
        the previous step's processed logits) selects graphs with a static self-conditioning input: a
        multi-step read's later steps and every denoise pass of a generation after the first of its
        block. A failure while loading or replaying fails this pass only."""
        graph = self.cache.get(self.key(rows, conditioning))
        if graph is None:
            return None
        self._load(graph, rows, conditioning)
        if graph.graph is not None:
            graph.graph.replay()
            output = graph.output
        else:
            output = self._forward(graph)
        assert output is not None
        width = max(len(canvas) for _, canvas in rows)
        return output[: len(rows), :width]

    # ------------------------------------------------------------------ building

    def prepare(self, key: DecoderKey) -> bool:
        """Build (capture) the graph for `key` ahead of use; False where it cannot be built."""
        return key in self.cache or self.cache.build(key) is not None

    def _kv_shapes(self) -> list[tuple[int, int]]:
        """(KV heads, head dim) of each layer's prompt KV, as the encoder's attention writes it."""
        shapes = []
        for layer in encoder_layers(self.model):
            attention = layer.self_attn
            shapes.append((attention.k_proj.out_features // attention.head_dim, attention.head_dim))
        return shapes

    def _build(self, key: DecoderKey) -> _Graph:
        batch, width, full, sliding, conditioned = key
        lengths = {t: sliding if t == "sliding_attention" else full for t in self.first_layer}
        dtype = self.model.dtype
        keys, values = [], []
        cache = DynamicCache()
        for index, ((heads, dim), layer_type) in enumerate(zip(self._kv_shapes(), self.layer_types)):
            length = lengths[layer_type]
            # Room for the canvas after the prompt: the pass writes its own KV there (CanvasKV).
            # Token-major ([rows, tokens, heads, dim], seen as [rows, heads, tokens, dim]): a row's
            # prompt KV is one contiguous block, loaded with the whole batch in one foreach copy.
            full_k = self._view(f"k{index}", (batch, length + width, heads, dim), dtype).transpose(1, 2)
            full_v = self._view(f"v{index}", (batch, length + width, heads, dim), dtype).transpose(1, 2)
            keys.append(full_k[:, :, :length])
            values.append(full_v[:, :, :length])
            layer = CanvasLayer(CanvasKV(full_k, full_v, length))
            cache.layers.append(layer)  # the layer update() fills, in place of the DynamicLayer it would add
            cache.update(keys[-1], values[-1], index)
            # Point the cache at the static buffers themselves (update() stored a copy).
            layer.keys, layer.values = keys[-1], values[-1]
        graph = _Graph(
            rows=batch, width=width, lengths=lengths, keys=keys, values=values,
            canvas=torch.full((batch, width), self.pad_id, dtype=torch.long, device=self.device),
            positions=torch.zeros((batch, width), dtype=torch.long, device=self.device),
            masks={t: torch.zeros((batch, 1, width, n + width), dtype=torch.bool, device=self.device)
                   for t, n in lengths.items()},
            cache=cache,
        )
        if conditioned:  # one shared input: graphs never run at once
            flat = self._view("conditioning", (batch, width, self.vocab), dtype, slots=self.policy.conditioned_rows
                              * self.policy.canvas)
            graph.conditioning = flat
        self._load(graph, [], None)
        if self.capture:
            before = torch.cuda.memory_allocated(self.device)
            forward = partial(self._forward, graph)
            first = (through_first_layers(self.model.model.decoder, self.pattern, forward)
                     if self.cache.first_run(key) else None)
            graph.graph, output = capture(forward, self.pool, self.device,
                                          first=first, times=self.stats)
            self.captures += 1
            assert isinstance(output, torch.Tensor)
            graph.output = output
            graph.memory = torch.cuda.memory_allocated(self.device) - before
        return graph

    def _view(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, slots: int | None = None) -> torch.Tensor:
        """A static buffer [rows, tokens, ...] over shared storage (each replay reloads it)."""
        return shared_view(self._storage, name, shape, dtype, self.device,
                           self.policy.decoder_slots if slots is None else slots)

    @property
    def memory_bytes(self) -> int:
        """GPU memory of the shared buffers plus what each capture added when it was built."""
        shared = sum(t.numel() * t.element_size() for t in self._storage.values())
        return shared + sum(graph.memory for graph in self.cache.graphs())

    def _forward(self, graph: _Graph) -> torch.Tensor:
        return self.model.model(
            past_key_values=graph.cache,
            decoder_input_ids=graph.canvas,
            decoder_attention_mask=graph.masks,
            decoder_position_ids=graph.positions,
            self_conditioning_logits=graph.conditioning,
        ).last_hidden_state

    def _load(self, graph: _Graph, rows: Sequence[Row], conditioning: torch.Tensor | None) -> None:
        """Copy a batch into the static buffers: KV left-padded to the bucket, masks, canvas, positions
        (and the self-conditioning logits, for graphs keyed with them). Padding rows and positions
        attend to their own canvas only: no NaN, and nothing real reads them."""
        if graph.conditioning is not None and conditioning is not None:
            graph.conditioning[: len(rows), : conditioning.shape[1]].copy_(conditioning)
        width = graph.width
        masks = {t: torch.zeros(graph.masks[t].shape, dtype=torch.bool) for t in graph.lengths}
        canvas = torch.full((graph.rows, width), self.pad_id, dtype=torch.long)
        positions = torch.zeros((graph.rows, width), dtype=torch.long)
        targets: list[torch.Tensor] = []
        sources: list[torch.Tensor] = []
        for row, (encoded, canvas_ids) in enumerate(rows):
            for index, layer_type in enumerate(self.layer_types):
                k, v = encoded.layers[index]
                bucket = graph.lengths[layer_type]
                n = k.shape[2]
                targets += [graph.keys[index][row, :, bucket - n:], graph.values[index][row, :, bucket - n:]]
                sources += [k[0], v[0]]
            canvas[row, : len(canvas_ids)] = torch.tensor(canvas_ids, dtype=torch.long)
            positions[row] = encoded.length + torch.arange(width)
            for layer_type, index in self.first_layer.items():
                bucket = graph.lengths[layer_type]
                n = encoded.layers[index][0].shape[2]
                masks[layer_type][row, :, :, bucket - n:bucket] = True
                masks[layer_type][row, :, :, bucket:bucket + len(canvas_ids)] = True
        for row in range(len(rows), graph.rows):  # padding rows attend to their own canvas: no NaN
            for layer_type, bucket in graph.lengths.items():
                masks[layer_type][row, :, :, bucket:bucket + width] = True
        copy_all(targets, sources)
        for layer_type in graph.lengths:
            graph.masks[layer_type].copy_(masks[layer_type])
        graph.canvas.copy_(canvas)
        graph.positions.copy_(positions)
