"""Gemma 4's image preprocessing split between the CPU and the device (app/engine/hf/pixels.py): on the
CPU here, the split gives exactly the library processor's pixel values, positions and soft-token
counts, for frames of several sizes and modes; a read through the split equals the whole path."""

from __future__ import annotations

import dataclasses
import io

import numpy as np
import pytest
import torch
from PIL import Image

from app.engine.base import ImageInput, Prompt
from app.engine.hf import pixels
from tests.conftest import make_tiny_reader
from tests.engine.hf.test_reader import spec_for


def picture(size: tuple[int, int], mode: str = "RGB", seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    channels = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
    data = rng.integers(0, 256, (size[1], size[0], channels), dtype=np.uint8)
    image = Image.fromarray(data[..., 0] if channels == 1 else data, mode)
    return image.convert("RGB")  # as decode_images hands them over


def gemma4_processor(**options):
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    return Gemma4ImageProcessorPil(**options)


@pytest.mark.parametrize("options", [{}, {"max_soft_tokens": 70}])
def test_the_split_equals_the_library_processor_bit_for_bit(options):
    processor = gemma4_processor(**options)
    assert pixels.splittable(processor)
    frames = [picture((512, 384), seed=1), picture((300, 500), "RGBA", seed=2), picture((40, 30), "L", seed=3),
              picture((2000, 90), seed=4)]
    expected = processor(frames, return_tensors="pt")
    resized = pixels.resize(processor, frames)
    values, positions = pixels.patches(processor, resized, torch.device("cpu"), torch.float32)
    assert resized.counts == tuple(int(n) for n in expected["num_soft_tokens_per_image"])
    assert values.dtype == expected["pixel_values"].dtype
    assert torch.equal(values, expected["pixel_values"])
    assert torch.equal(positions, expected["image_position_ids"])
    bf16, _ = pixels.patches(processor, resized, torch.device("cpu"), torch.bfloat16)
    assert torch.equal(bf16, expected["pixel_values"].to(torch.bfloat16))
    assert all(image.dtype == np.uint8 for image in resized.images)  # what crosses to the device: 1 byte a value


def test_only_processors_of_that_recipe_are_split():
    assert not pixels.splittable(gemma4_processor(do_normalize=True))
    assert not pixels.splittable(gemma4_processor(do_rescale=False))
    assert not pixels.splittable(object())


def jpeg(size: tuple[int, int], seed: int) -> bytes:
    buffer = io.BytesIO()
    picture(size, seed=seed).save(buffer, "JPEG", quality=80)
    return buffer.getvalue()


@torch.no_grad()
def test_a_read_through_the_split_equals_the_whole_path(tiny_dir, tokenizer):
    whole, split = make_tiny_reader(tiny_dir).runner, make_tiny_reader(tiny_dir).runner
    if not pixels.splittable(split.images.processor):
        pytest.skip("the tiny checkpoint's image processor is not Gemma 4's")
    split.images.split_pixels = True  # the CUDA default, forced on the CPU
    assert not whole.images.split_pixels  # the CPU keeps the library's whole path
    image = ImageInput(jpeg((96, 72), seed=5), "image/jpeg", "frame")
    prompt = Prompt(tuple(tokenizer.render_chat("Look.", "what is ahead?", 1, False)), (image,))
    spec = dataclasses.replace(spec_for(tokenizer, "unused", "q1: yes", [3]), prompt=prompt)
    ready = split.images.preprocess(prompt)
    assert ready.resized is not None and ready.pixel_values is None
    a = whole.read([spec])[0]
    b = split.read([spec], {prompt.cache_key[1]: ready})[0]
    assert a.prompt_tokens == b.prompt_tokens
    assert [[s.label_logprobs for s in canvas] for canvas in a.slots] == \
        [[s.label_logprobs for s in canvas] for canvas in b.slots]
