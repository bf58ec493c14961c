"""CUDA-graph replay of the decoder pass.

A read is loaded into static buffers of a bucketed shape (rows, prompt KV length, canvas width) and
the graph captured for that shape is replayed; it reads what the eager path reads. Graphs share one
memory pool and one set of static KV buffers and are kept in a small LRU; shapes past the size
caps, or a capture that fails, go down the eager path. With `capture=False` the same static-buffer
path runs eagerly: that is how the CPU tests check the bucketing, padding and masks against the
plain path. Design and numbers: docs/design.md §4.7 and §5.2.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from app.engine.hf.graphs.encoder import copy_all, shared_view
from app.engine.hf.parts import decoder_layers, text_config

if TYPE_CHECKING:
    from transformers import DiffusionGemmaForBlockDiffusion
    from transformers.cache_utils import Cache
    from transformers.models.diffusion_gemma.modeling_diffusion_gemma import DiffusionGemmaDecoderTextAttention

    from app.engine.hf.prompts import EncodedPrompt

    # A row of a decoder pass: a prompt's KV and the canvas read over it.
    Row = tuple[EncodedPrompt, Sequence[int]]

log = logging.getLogger("djev.engine")

KV_BUCKET = 256


def bucket_rows(rows: int) -> int:
    size = 1
    while size < rows:
        size *= 2
    return size


def bucket_length(length: int) -> int:
    return max(KV_BUCKET, -(-length // KV_BUCKET) * KV_BUCKET)


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
        max_graphs: int = 32,
        max_token_slots: int = 36 * 1024,
        max_conditioning: int = 1 << 29,
    ) -> None:
        self.model = model
        self.layer_types = list(layer_types)
        # The first layer of each type: its KV length stands for every layer of that type.
        self.first_layer = {t: self.layer_types.index(t) for t in dict.fromkeys(self.layer_types)}
        self.device = device
        self.pad_id = pad_id
        self.capture = capture
        self.max_graphs = max_graphs
        self.max_token_slots = max_token_slots
        self.max_conditioning = max_conditioning  # rows x width x vocab elements (1 GiB in bf16 at the default)
        self.graphs: OrderedDict[tuple, _Graph] = OrderedDict()
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.disabled: str | None = None
        self.captures = 0
        self._storage: dict[str, torch.Tensor] = {}
        for layer in decoder_layers(model):
            append_in_place(layer.self_attn)

    def key(self, rows: Sequence[Row], conditioning: torch.Tensor | None = None) -> tuple | None:
        width = max(len(canvas) for _, canvas in rows)
        lengths = {t: bucket_length(max(encoded.layers[index][0].shape[2] for encoded, _ in rows))
                   for t, index in self.first_layer.items()}
        batch = bucket_rows(len(rows))
        if batch * (max(lengths.values()) + width) > self.max_token_slots:
            return None
        if conditioning is not None:
            if tuple(conditioning.shape[:2]) != (len(rows), width):
                return None
            if batch * width * conditioning.shape[2] > self.max_conditioning:
                return None
        return (batch, width, tuple(sorted(lengths.items())), conditioning is not None)

    def hidden(self, rows: Sequence[Row], conditioning: torch.Tensor | None = None) -> torch.Tensor | None:
        """The decoder's hidden states for `rows` ([len(rows), width, hidden]), or None to go eager.

        The tensor lives in the graphs' shared memory pool: it is valid until the next call, so the
        caller reads it right away (as DiffusionRunner does). Batches past `max_token_slots`
        (rows x (KV + canvas); the shared KV buffers hold that many tokens, about 7.7 GiB for the
        full model at the default, enough for 64 rows of 512-token prompts) stay eager: they are
        GPU-bound, where launch overhead no longer matters.

        `conditioning` ([rows, width, vocab], the previous step's processed logits) selects graphs
        with a static self-conditioning input: a multi-step read's later steps and every denoise pass
        of a generation after the first of its block. Past `max_conditioning` elements it goes eager."""
        if self.disabled is not None:
            return None
        key = self.key(rows, conditioning)
        if key is None:
            return None
        graph = self.graphs.get(key)
        try:
            if graph is None:
                graph = self._build(key, rows)
            else:
                self.graphs.move_to_end(key)
            self._load(graph, rows, conditioning)
            if graph.graph is not None:
                graph.graph.replay()
                output = graph.output
            else:
                output = self._forward(graph)
        except Exception as exc:  # noqa: BLE001 - a capture that fails must not fail reads: go eager
            self.disabled = f"{type(exc).__name__}: {exc}"
            self.graphs.clear()
            log.warning("CUDA graphs disabled, decoder passes run eagerly: %s", self.disabled)
            return None
        assert output is not None
        return output[: len(rows)]

    # ------------------------------------------------------------------ building

    def _build(self, key: tuple, rows: Sequence[Row]) -> _Graph:
        batch, width, lengths_items, conditioned = key
        lengths = dict(lengths_items)
        first = rows[0][0]
        keys, values = [], []
        cache = DynamicCache()
        for index, layer_type in enumerate(self.layer_types):
            k, v = first.layers[index]
            length = lengths[layer_type]
            # Room for the canvas after the prompt: the pass writes its own KV there (CanvasKV).
            # Token-major ([rows, tokens, heads, dim], seen as [rows, heads, tokens, dim]): a row's
            # prompt KV is one contiguous block, loaded with the whole batch in one foreach copy.
            full_k = self._view(f"k{index}", (batch, length + width, k.shape[1], k.shape[3]), k.dtype).transpose(1, 2)
            full_v = self._view(f"v{index}", (batch, length + width, v.shape[1], v.shape[3]), v.dtype).transpose(1, 2)
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
        # Measured from here: the graph's own self-conditioning input (rows x width x vocab, held per
        # graph) counts in `memory` with what the capture adds.
        before = torch.cuda.memory_allocated(self.device) if self.capture else 0
        if conditioned:
            graph.conditioning = torch.zeros((batch, width, text_config(self.model).vocab_size),
                                             dtype=self.model.dtype, device=self.device)
        self._load(graph, rows, None)
        if self.capture:
            stream = torch.cuda.Stream(device=self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm-up outside the capture (allocator, cuBLAS/cuDNN plans)
                    self._forward(graph)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            cuda_graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(cuda_graph, pool=self.pool):
                graph.output = self._forward(graph)
            graph.graph = cuda_graph
            graph.memory = torch.cuda.memory_allocated(self.device) - before
            self.captures += 1
        self.graphs[key] = graph
        while len(self.graphs) > self.max_graphs:
            self.graphs.popitem(last=False)
        return graph

    def _view(self, name: str, shape: tuple[int, int, int, int], dtype: torch.dtype) -> torch.Tensor:
        """A static KV buffer [rows, tokens, heads, dim] (each replay reloads its KV)."""
        return shared_view(self._storage, name, shape, dtype, self.device, self.max_token_slots)

    @property
    def memory_bytes(self) -> int:
        """GPU memory of the shared KV buffers plus what each capture added when it was built."""
        shared = sum(t.numel() * t.element_size() for t in self._storage.values())
        return shared + sum(graph.memory for graph in self.graphs.values())

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
        (and the self-conditioning logits, for graphs keyed with them)."""
        if graph.conditioning is not None and conditioning is not None:
            graph.conditioning[: len(rows)].copy_(conditioning)
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
