"""CUDA-graph replay of the vision tower, for camera frames from any number of sessions at once.

The graph holds the tower up to the strip of padding tokens, which stays outside, on the graph's
outputs; images are bucketed by count (IMAGE_BUCKETS; a larger batch of frames is split into passes of the
largest bucket by the caller, app/engine/hf/images.py) and patch layout.
Graphs are held in a GraphCache (app/engine/hf/graphs/cache.py), captured before `ready` from one
sample frame and never evicted. It gives the library's image features. With `capture=False` the same
path runs eagerly: the CPU tests check it against the library's forward. Design and numbers:
docs/design.md §4.7 and §5.2.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Sequence

import torch

from app.engine.hf.graphs.cache import GraphCache, capture
from app.engine.hf.layers import vision_attention

if TYPE_CHECKING:
    from transformers import DiffusionGemmaForBlockDiffusion

    from app.engine.hf.graphs.cache import PoolHandle

log = logging.getLogger("djev.engine")

# (images, patches, patch pixels)
VisionKey = tuple[int, int, int]
# Frames a vision pass takes, padded up to one of these (a camera burst from many sessions shares passes).
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
                 stats: Counter[str] | None = None, pool: PoolHandle | None = None,
                 buckets: Sequence[int] = IMAGE_BUCKETS) -> None:
        self.buckets = tuple(buckets)
        self.encoder = model.model.encoder
        self.tower = self.encoder.vision_tower
        self.device = device
        self.capture = capture
        self.stats: Counter[str] = stats if stats is not None else Counter()
        self.cache: GraphCache[VisionKey, _Graph] = GraphCache("vision", self._build, self.stats)
        self.captures = 0  # graphs captured (CUDA graphs; 0 on the static path)
        self.pool = pool if pool is not None or not capture else torch.cuda.graph_pool_handle()
        self._sample: tuple[torch.Tensor, torch.Tensor] | None = None  # the inputs a build loads first

    def key(self, pixel_values: torch.Tensor) -> VisionKey | None:
        count = int(pixel_values.shape[0])
        bucket = next((bucket for bucket in self.buckets if bucket >= count), None)
        if bucket is None:
            return None
        _, patches, patch_dim = pixel_values.shape
        return (bucket, int(patches), int(patch_dim))

    def prepare(self, pixel_values: torch.Tensor, positions: torch.Tensor) -> int:
        """Build (capture) the graph of every image bucket for this patch layout, from one sample
        image (its first); returns how many are held."""
        for bucket in self.buckets:
            batch = pixel_values[:1].expand(bucket, -1, -1)
            key = self.key(batch)
            if key is not None and key not in self.cache:
                self._sample = (batch, positions[:1].expand(bucket, -1, -1))
                self.cache.build(key)
        self._sample = None
        return len(self.cache)

    def features(self, pixel_values: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | None:
        """The soft-token features of every image ([total soft tokens, text hidden], in image order,
        as `get_image_features(...).pooler_output` gives them), or None to go eager (counted)."""
        images = int(pixel_values.shape[0])
        self._sample = (pixel_values, positions)
        try:
            graph = self.cache.get(self.key(pixel_values))
        finally:
            self._sample = None
        if graph is None:
            return None
        self._load(graph, pixel_values, positions)
        if graph.graph is not None:
            graph.graph.replay()
        else:
            graph.features, graph.valid = self._forward(graph)
        assert graph.features is not None and graph.valid is not None
        return graph.features[:images][graph.valid[:images]]

    def _load(self, graph: _Graph, pixel_values: torch.Tensor, positions: torch.Tensor) -> None:
        images = int(pixel_values.shape[0])
        graph.pixels[:images].copy_(pixel_values)
        graph.positions[:images].copy_(positions)
        if images < graph.images:  # padding images: a real image's layout, never an empty attention row
            graph.pixels[images:].copy_(pixel_values[:1].expand(graph.images - images, -1, -1))
            graph.positions[images:].copy_(positions[:1].expand(graph.images - images, -1, -1))

    def _build(self, key: VisionKey) -> _Graph:
        assert self._sample is not None, "a vision graph is built from the inputs of its first pass"
        pixel_values, positions = self._sample
        images = key[0]
        graph = _Graph(
            images=images,
            pixels=torch.zeros((images, *pixel_values.shape[1:]), dtype=pixel_values.dtype, device=self.device),
            positions=torch.zeros((images, *positions.shape[1:]), dtype=positions.dtype, device=self.device),
        )
        self._load(graph, pixel_values, positions)
        if self.capture:
            graph.graph, outputs = capture(partial(self._forward, graph), self.pool, self.device,
                                            first=partial(self._forward, graph), times=self.stats)
            self.captures += 1
            assert isinstance(outputs, tuple)
            graph.features, graph.valid = outputs
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
        with vision_attention():  # (the compiled layers take them inside too: app/engine/hf/layers.py)
            for layer in tower.encoder.layers[: config.num_hidden_layers]:
                hidden = layer(hidden, attention_mask=mask, position_embeddings=rotary, position_ids=positions)
        output_length = graph.pixels.shape[-2] // (config.pooling_kernel_size * config.pooling_kernel_size)
        pooled, valid = tower.pooler(hidden_states=hidden, pixel_position_ids=positions, padding_positions=padding,
                                     output_length=output_length)
        if config.standardize:
            pooled = (pooled - tower.std_bias.float()) * tower.std_scale.float()
        features = self.encoder.embed_vision(inputs_embeds=pooled.to(hidden.dtype))
        return features, valid
