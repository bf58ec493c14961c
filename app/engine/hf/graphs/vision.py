"""CUDA-graph replay of the vision tower, for camera frames from any number of sessions at once.

The graph holds the tower up to the strip of padding tokens, which stays outside, on the graph's
outputs; images are bucketed by count and patch count, at most `max_graphs` (LRU). It gives the
library's image features. With `capture=False` the same path runs eagerly: the CPU tests check it
against the library's forward. Design and numbers: docs/design.md §4.7 and §5.2.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from app.engine.hf.graphs.encoder import bucket_of

if TYPE_CHECKING:
    from transformers import DiffusionGemmaForBlockDiffusion

log = logging.getLogger("djev.engine")

IMAGE_BUCKETS = (1, 2, 4, 8)


@dataclass
class _Graph:
    images: int
    pixels: torch.Tensor  # [images, patches, patch_dim]
    positions: torch.Tensor  # [images, patches, 2], (-1, -1) for padding patches
    features: torch.Tensor | None = None  # [images, soft tokens, text hidden] (graph output)
    valid: torch.Tensor | None = None  # [images, soft tokens] which soft tokens are real
    graph: torch.cuda.CUDAGraph | None = None


class VisionGraphs:
    def __init__(self, model: DiffusionGemmaForBlockDiffusion, device: torch.device, *, capture: bool,
                 max_graphs: int = 8) -> None:
        self.encoder = model.model.encoder
        self.tower = self.encoder.vision_tower
        self.device = device
        self.capture = capture
        self.max_graphs = max_graphs
        self.graphs: OrderedDict[tuple[int, ...], _Graph] = OrderedDict()
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.disabled: str | None = None
        self.captures = 0

    def features(self, pixel_values: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | None:
        """The soft-token features of every image ([total soft tokens, text hidden], in image order,
        as `get_image_features(...).pooler_output` gives them), or None to go eager."""
        images = int(pixel_values.shape[0])
        bucket = bucket_of(images, IMAGE_BUCKETS)
        if self.disabled is not None or bucket is None:
            return None
        key = (bucket, *pixel_values.shape[1:])
        try:
            graph = self.graphs.get(key)
            if graph is None:
                graph = self._build(key, pixel_values, positions)
            else:
                self.graphs.move_to_end(key)
            self._load(graph, pixel_values, positions)
            if graph.graph is not None:
                graph.graph.replay()
            else:
                graph.features, graph.valid = self._forward(graph)
            assert graph.features is not None and graph.valid is not None
            return graph.features[:images][graph.valid[:images]]
        except Exception as exc:  # noqa: BLE001 - a capture that fails must not fail reads: go eager
            self.disabled = f"{type(exc).__name__}: {exc}"
            self.graphs.clear()
            log.warning("vision CUDA graphs disabled, the vision tower runs eagerly: %s", self.disabled)
            return None

    def _load(self, graph: _Graph, pixel_values: torch.Tensor, positions: torch.Tensor) -> None:
        images = int(pixel_values.shape[0])
        graph.pixels[:images].copy_(pixel_values)
        graph.positions[:images].copy_(positions)
        if images < graph.images:  # padding images: a real image's layout, never an empty attention row
            graph.pixels[images:].copy_(pixel_values[:1].expand(graph.images - images, -1, -1))
            graph.positions[images:].copy_(positions[:1].expand(graph.images - images, -1, -1))

    def _build(self, key: tuple[int, ...], pixel_values: torch.Tensor, positions: torch.Tensor) -> _Graph:
        images = key[0]
        graph = _Graph(
            images=images,
            pixels=torch.zeros((images, *pixel_values.shape[1:]), dtype=pixel_values.dtype, device=self.device),
            positions=torch.zeros((images, *positions.shape[1:]), dtype=positions.dtype, device=self.device),
        )
        self._load(graph, pixel_values, positions)
        if self.capture:
            stream = torch.cuda.Stream(device=self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                for _ in range(2):
                    self._forward(graph)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            cuda_graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(cuda_graph, pool=self.pool):
                graph.features, graph.valid = self._forward(graph)
            graph.graph = cuda_graph
            self.captures += 1
        self.graphs[key] = graph
        while len(self.graphs) > self.max_graphs:
            self.graphs.popitem(last=False)
        return graph

    def _forward(self, graph: _Graph) -> tuple[torch.Tensor, torch.Tensor]:
        """The vision tower up to the padding strip, with the model's own modules."""
        tower = self.tower
        config = tower.config
        positions = graph.positions
        padding = (positions == -1).all(dim=-1)  # [images, patches]
        hidden = tower.patch_embedder(graph.pixels, positions, padding)
        mask = (~padding)[:, None, None, :].expand(-1, 1, padding.shape[1], -1)  # every patch sees every real patch
        rotary = tower.encoder.rotary_emb(hidden, positions)
        for layer in tower.encoder.layers[: config.num_hidden_layers]:
            hidden = layer(hidden, attention_mask=mask, position_embeddings=rotary, position_ids=positions)
        output_length = graph.pixels.shape[-2] // (config.pooling_kernel_size * config.pooling_kernel_size)
        pooled, valid = tower.pooler(hidden_states=hidden, pixel_position_ids=positions, padding_positions=padding,
                                     output_length=output_length)
        if config.standardize:
            pooled = (pooled - tower.std_bias.float()) * tower.std_scale.float()
        features = self.encoder.embed_vision(inputs_embeds=pooled.to(hidden.dtype))
        return features, valid
