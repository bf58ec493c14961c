"""A prompt's images as the model takes them: decoded and processed off the engine thread
(`preprocess`, in HFReader's image workers), expanded into the prompt's soft tokens and uploaded
(`model_inputs`), through the vision tower together (`image_features`: a pass per patch layout,
replayed as a CUDA graph where one is held, features kept in a small LRU by the images' digests),
and scattered into the prompt's input embeddings (`input_embeds`).

`preprocess` touches neither the model nor the LRU: any thread may run it. Everything else runs on
the engine thread. `cached` only looks into the LRU (the event loop asks it).
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, Hashable, Mapping, TypeVar

import torch

from app.engine.base import CacheKey, EngineInputError, Prompt, decode_images
from app.engine.hf import pixels
from app.engine.hf.pixels import Resized

if TYPE_CHECKING:
    from transformers import DiffusionGemmaForBlockDiffusion
    from transformers.image_processing_utils import BaseImageProcessor

    from app.engine.hf.graphs.vision import VisionGraphs

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")

# Images' features kept by their digests: a frame restated in a later stage skips the tower (a few
# MiB an entry).
FEATURE_ENTRIES = 16


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


class LRU(Generic[K, V]):
    """A bounded mapping, least recently used out first. `in` does not touch the order, so the event
    loop may ask while the engine thread uses it (one dict lookup under the GIL)."""

    def __init__(self, entries: int) -> None:
        self.entries = entries
        self._items: OrderedDict[K, V] = OrderedDict()

    def get(self, key: K) -> V | None:
        item = self._items.get(key)
        if item is not None:
            self._items.move_to_end(key)
        return item

    def put(self, key: K, item: V) -> None:
        if self.entries <= 0:
            return
        self._items.pop(key, None)
        self._items[key] = item
        while len(self._items) > self.entries:
            self._items.popitem(last=False)

    def clear(self) -> None:
        self._items.clear()

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: object) -> bool:
        return key in self._items


class ImageInputs:
    """The model's images: preprocessing, soft-token expansion, the vision tower and its feature LRU."""

    def __init__(self, model: DiffusionGemmaForBlockDiffusion, image_processor: BaseImageProcessor | None,
                 device: torch.device, stats: Counter[str], *, entries: int) -> None:
        self.model = model
        self.config = model.config
        self.processor = image_processor
        self.device = device
        self.stats = stats
        # The images finished on the device (app/engine/hf/pixels.py): CUDA and a Gemma 4 processor.
        self.split_pixels = device.type == "cuda" and image_processor is not None and pixels.splittable(image_processor)
        self.features: LRU[tuple[str, ...], tuple[list[int], torch.Tensor]] = LRU(min(entries, FEATURE_ENTRIES))
        self.graphs: VisionGraphs | None = None  # the tower's CUDA graphs, by frame count (the runner's)
        self.chunk = 8  # the most images a pass takes (the graphs' largest bucket)

    def preprocess(self, prompt: Prompt) -> ProcessedImages:
        """Decode the prompt's images, convert them to RGB and run the image processor: CPU work that
        touches neither the model's weights nor the LRU, so a worker thread may run it while the
        engine thread runs turns. A file that does not decode is a 422 naming its source."""
        processor = self.processor
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

    def cached(self, key: CacheKey) -> bool:
        """Whether a read of the prompt with this `cache_key` skips decoding its images (their features
        are in the LRU). Safe to ask from the event loop."""
        return key[1] in self.features

    def model_inputs(self, prompt: Prompt, *, preprocessed: Preprocessed | None = None) -> dict[str, torch.Tensor]:
        """The prompt as the model takes it, on the device: `input_ids` [1, n] with each image
        placeholder expanded to its soft tokens, `mm_token_type_ids`, and either the images' features
        from the LRU (`image_features`: a frame restated in a later stage) or what the tower needs
        (`soft_token_counts`, `pixel_values`, `image_position_ids`). Images found in `preprocessed` are
        only uploaded; others are preprocessed here."""
        ids = list(prompt.ids)
        inputs: dict[str, torch.Tensor] = {}
        digests = prompt.cache_key[1]
        known = self.features.get(digests)
        if known is not None:
            counts, features = known
            self.stats["vision_hits"] += 1
            ids = self._expand_placeholders(ids, counts)
            inputs["image_features"] = features
        else:
            ready = preprocessed.get(digests) if preprocessed else None
            if isinstance(ready, EngineInputError):
                raise ready
            if ready is None:
                ready = self.preprocess(prompt)
                self.stats["images_preprocessed_inline"] += 1
            ids = self._expand_placeholders(ids, list(ready.counts))
            inputs["soft_token_counts"] = torch.tensor(ready.counts)
            if ready.resized is not None:
                processor = self.processor
                assert pixels.splittable(processor)  # only such a processor resizes (`preprocess`)
                inputs["pixel_values"], inputs["image_position_ids"] = pixels.patches(
                    processor, ready.resized, self.device, self.model.dtype)
            else:
                assert ready.pixel_values is not None and ready.image_position_ids is not None
                inputs["pixel_values"] = ready.pixel_values.to(self.device, self.model.dtype)
                inputs["image_position_ids"] = ready.image_position_ids.to(self.device)
        input_ids = torch.tensor([ids], dtype=torch.long, device=self.device)
        inputs["input_ids"] = input_ids
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

    def image_features(self, expanded: list[dict[str, torch.Tensor]], digests: list[tuple[str, ...]]) -> None:
        """Vision features for every prompt that needs them (sets `image_features`): the images of
        all those prompts go through the vision tower together, one pass per patch layout (frames
        of the same size from any number of camera sessions share it) of at most `chunk` images,
        replayed as a CUDA graph where one is held; new features go into the LRU."""
        groups: dict[tuple[int, ...], list[int]] = {}
        for number, inputs in enumerate(expanded):
            if "pixel_values" in inputs and "image_features" not in inputs:
                groups.setdefault(tuple(inputs["pixel_values"].shape[1:]), []).append(number)
        for members in groups.values():
            images = torch.cat([expanded[n]["pixel_values"] for n in members])
            positions = torch.cat([expanded[n]["image_position_ids"] for n in members])
            parts = [self._vision_pass(images[start:start + self.chunk], positions[start:start + self.chunk])
                     for start in range(0, int(images.shape[0]), self.chunk)]
            features = torch.cat(parts) if len(parts) > 1 else parts[0]
            sizes = [int(expanded[n]["soft_token_counts"].sum()) for n in members]
            for n, chunk in zip(members, torch.split(features, sizes)):
                expanded[n]["image_features"] = chunk
                if digests[n]:
                    self.features.put(digests[n], ([int(c) for c in expanded[n]["soft_token_counts"]], chunk))

    def _vision_pass(self, images: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """One vision tower pass over images of one patch layout: a graph replay where one is held,
        else the library's forward; their soft-token features [tokens, hidden] in the model's dtype."""
        features = self.graphs.features(images, positions) if self.graphs is not None else None
        if features is None:
            # @can_return_tuple takes return_dict; the signature it passes on does not say so.
            encoder = self.model.model.encoder
            output = encoder.get_image_features(images, positions, return_dict=True)  # pyright: ignore[reportCallIssue]
            features = output.pooler_output
            assert features is not None  # the tower's pooled features (ModelOutput declares every field optional)
        else:
            self.stats["vision_graph_replays"] += 1
        self.stats["vision_passes"] += 1
        return features.reshape(-1, features.shape[-1]).to(self.model.dtype)

    def input_embeds(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """A prompt's input embeddings [n, hidden] from its `model_inputs`, its image features (from
        the LRU, or through the vision tower where they are missing) scattered over its soft tokens, as
        the encoder model does before its text layers."""
        input_ids = inputs["input_ids"]
        embeds = self.model.model.encoder.get_input_embeddings()(input_ids)
        if "pixel_values" in inputs and "image_features" not in inputs:
            self.image_features([inputs], [()])
        features = inputs.get("image_features")
        if features is not None:
            mask = (input_ids == self.config.image_token_id).unsqueeze(-1)
            embeds = embeds.masked_scatter(mask, features.to(embeds.dtype))
        return embeds[0]
