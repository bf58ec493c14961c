"""Gemma 4's image preprocessing split in two: the resize on the CPU, the rest on the device.

The worker thread runs the processor's own RGB conversion and resize and hands over the uint8
image; the engine thread does the rescale, patches, positions and padding on the device, bit for
bit the library's result (tests/engine/hf/test_pixels.py). Only processors that match this recipe
take the split (`splittable`); any other runs whole. Design and numbers: docs/design.md §4.7, §5.2.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, Sequence, TypeGuard

import numpy as np
import torch

if TYPE_CHECKING:
    from PIL import Image


@dataclass(frozen=True)
class Resized:
    """Images resized by the processor's own code, still uint8 [channels, height, width]."""

    images: tuple[np.ndarray, ...]
    counts: tuple[int, ...]  # soft tokens per image


class SplitProcessor(Protocol):
    """What the split reads of an image processor that follows the recipe (transformers'
    Gemma4ImageProcessorPil does): its settings and its own conversion and resize."""

    @property
    def patch_size(self) -> int: ...

    @property
    def max_soft_tokens(self) -> int: ...

    @property
    def pooling_kernel_size(self) -> int: ...

    @property
    def rescale_factor(self) -> float: ...

    @property
    def resample(self) -> Image.Resampling: ...

    def process_image(self, image: Image.Image, *, do_convert_rgb: bool) -> np.ndarray: ...

    def aspect_ratio_preserving_resize(self, image: np.ndarray, patch_size: int, max_patches: int,
                                       pooling_kernel_size: int, resample: Image.Resampling) -> np.ndarray: ...


def splittable(processor: object) -> TypeGuard[SplitProcessor]:
    """Whether `processor` (any object) follows the recipe above: Gemma 4's resize, rescale, no
    normalisation."""
    needed = ("aspect_ratio_preserving_resize", "process_image", "patch_size", "max_soft_tokens",
              "pooling_kernel_size", "rescale_factor", "resample")
    return (all(hasattr(processor, name) for name in needed)
            and getattr(processor, "do_resize", False) and getattr(processor, "do_rescale", False)
            and not getattr(processor, "do_normalize", True) and getattr(processor, "do_convert_rgb", False))


def max_patches(processor: SplitProcessor) -> int:
    return int(processor.max_soft_tokens) * int(processor.pooling_kernel_size) ** 2


def resize(processor: SplitProcessor, pictures: Sequence[Image.Image]) -> Resized:
    """The CPU half (blocking: a worker thread): each RGB PIL image as the processor resizes it."""
    patch, pool = int(processor.patch_size), int(processor.pooling_kernel_size)
    images, counts = [], []
    for picture in pictures:
        array = processor.process_image(picture, do_convert_rgb=True)  # uint8, channels first
        array = processor.aspect_ratio_preserving_resize(
            image=array, patch_size=patch, max_patches=max_patches(processor), pooling_kernel_size=pool,
            resample=processor.resample)
        array = np.ascontiguousarray(array)
        images.append(array)
        counts.append((array.shape[1] // patch) * (array.shape[2] // patch) // pool**2)
    return Resized(tuple(images), tuple(counts))


def patches(processor: SplitProcessor, resized: Resized, device: torch.device,
            dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The device half: (pixel_values [images, max_patches, patch*patch*3] in `dtype`, positions
    [images, max_patches, 2]), as the processor would have made them."""
    patch, budget = int(processor.patch_size), max_patches(processor)
    pixels, positions = [], []
    for array in resized.images:
        image = torch.from_numpy(array).to(device, non_blocking=False)
        # The library rescales in float64 and stores float32; the same here, on the device.
        image = (image.to(torch.float64) * float(processor.rescale_factor)).to(torch.float32)
        channels, height, width = image.shape
        rows, cols = height // patch, width // patch
        grid = image.reshape(channels, rows, patch, cols, patch).permute(1, 3, 2, 4, 0).reshape(rows * cols, -1)
        ys, xs = torch.meshgrid(torch.arange(rows, device=device), torch.arange(cols, device=device), indexing="ij")
        where = torch.stack([xs, ys], dim=-1).reshape(rows * cols, 2)
        padded = torch.zeros((budget, grid.shape[1]), dtype=torch.float32, device=device)
        padded[: grid.shape[0]] = grid
        place = torch.full((budget, 2), -1, dtype=torch.long, device=device)
        place[: where.shape[0]] = where
        pixels.append(padded)
        positions.append(place)
    return torch.stack(pixels).to(dtype), torch.stack(positions)
