"""torch.compile (TORCH_COMPILE) where the flat turn does not compile it itself, and the start-up
warm-up that makes every compile and Triton kernel happen before `ready`.

The flat forward compiles its two layer bodies itself (`FlatForward.compile`); here the vision tower's
encoder layers get one compiled body for all of them. `warm_up` runs a few reads of every kind through
the runner before the graphs are captured. Why, and why not whole layers: docs/design.md §4.7 and §5.2.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn
    from transformers import DiffusionGemmaForBlockDiffusion

    from app.engine.base import Prompt, ReadSpec
    from app.engine.hf.runner import DiffusionRunner

log = logging.getLogger("djev.engine")

# Compiled variants torch keeps per piece before it runs that piece eagerly: (static, dynamic) x
# two layer kinds x a few input layouts stays well inside it.
RECOMPILE_LIMIT = 64


def vision_layers(model: DiffusionGemmaForBlockDiffusion) -> list[nn.Module]:
    """The vision tower's encoder layers, or none for a model without one."""
    tower = getattr(model.model.encoder, "vision_tower", None)
    encoder = getattr(tower, "encoder", None)
    return list(getattr(encoder, "layers", ()))


def reads_images(runner: DiffusionRunner) -> bool:
    """Whether the runner reads images: it has an image processor and its model a vision tower."""
    return getattr(runner, "image_processor", None) is not None and bool(vision_layers(runner.model))


def configure_thread() -> None:
    """torch.compile's limits for the calling thread: torch keeps them per thread, so every thread
    that runs the model calls this (HFReader's engine thread does, at its start). A compiled piece past
    the recompile limit, or one that fails to compile, runs eagerly instead of failing the read."""
    import torch._dynamo

    config = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):  # the name changed across torch releases
        if hasattr(config, name):
            setattr(config, name, max(getattr(config, name), RECOMPILE_LIMIT))
    config.suppress_errors = True


def compile_vision(model: DiffusionGemmaForBlockDiffusion, backend: str = "inductor") -> int:
    """Give every vision encoder layer its forward compiled (one body for all of them); returns how many.
    Configures the calling thread (`configure_thread`); other threads that run the model must configure
    themselves."""
    import functools

    import torch

    from app.engine.hf.layers import install_vision

    configure_thread()
    vision = vision_layers(model)
    install_vision(vision, compile=functools.partial(torch.compile, backend=backend, dynamic=None))
    log.info("torch.compile (%s) on the %d vision layers (the flat forward compiles its own layer bodies)", backend,
             len(vision))
    return len(vision)


# The warm-up's batch sizes: the first read compiles each piece for its shapes, the second once more
# as dynamic, which then serves every other size.
WARM_UP_ROWS = (1, 2)
# The canvases of the warm-up's multi-step read (more than the self-conditioned graphs' one row).
WARM_UP_CANVASES = 4


def warm_up(runner: DiffusionRunner, canvas_length: int) -> float:
    """Compile before the first request does: a text read at each of WARM_UP_ROWS batch sizes through
    the runner's own turns, a long prompt read in chunks, a read of an image when the runner reads
    images (the vision layers compile there, not on a walker's first frame), and a two-step read of
    several canvases (a self-conditioned turn). Returns the seconds it took; the image features these
    reads leave in the LRU are dropped, and the counters start again at zero."""
    import time

    started = time.perf_counter()
    width = max(4, canvas_length)
    base = _text_base(runner)
    parts: dict[str, float] = {}

    def timed(part: str, specs: list[ReadSpec]) -> None:
        begun = time.perf_counter()
        _read_all(runner, specs)
        parts[part] = time.perf_counter() - begun

    for count in WARM_UP_ROWS:
        timed(f"{count} row{'s' * (count > 1)}", [
            _read_of(runner, tuple(range(base + 97 * row, base + 97 * row + 64 + 16 * row)), width)
            for row in range(count)])
    chunk = runner.prefill_chunk
    if 2 * chunk + 64 <= runner.max_prompt_tokens:  # a long prompt's chunks: the first, a full one after it, a short last
        timed("a long prompt", [_read_of(runner, tuple(base + i % 997 for i in range(2 * chunk + 64)), width)])
    if reads_images(runner):
        timed("an image", [_read_of(runner, sample_image_prompt(runner), width)])
    # A multi-step read of several canvases: its second step reads a self-conditioning signal, a path
    # none of the reads above takes.
    timed("a multi-step read", [_read_of(runner, tuple(range(base, base + 64)), width, canvases=WARM_UP_CANVASES,
                                         steps=2)])
    log.info("the warm-up's reads: %s", ", ".join(f"{part} {seconds:.1f} s" for part, seconds in parts.items()))
    runner.images.features.clear()
    runner.stats.clear()  # the counters (and /metrics) start at the first request
    return time.perf_counter() - started


# The start-up frame probe: this many camera frames read at once, each its own picture after a
# prompt of FRAME_PROMPT_TOKENS text ids (about the walk page's first stage: its instructions and
# criteria), twice: the first round untimed.
FRAME_PROBE = 16
FRAME_PROMPT_TOKENS = 200


def measure_frames(runner: DiffusionRunner, canvas_length: int, frames: int = FRAME_PROBE) -> float:
    """Camera frames a second the engine reads when `frames` come at once, each a new picture: what
    camera admission starts from before any session has been measured (`ReaderInfo.frame_rate`).
    The reads' blocks go back to the store, their features leave the LRU, and the counters are put
    back as they were (the graphs captured before it are counted there, for /metrics)."""
    import time

    from app.engine.base import ImageInput, Prompt

    base = _text_base(runner)
    image_id = runner.model.config.image_token_id
    assert image_id is not None  # called only for a runner that reads images
    width = max(4, canvas_length)
    counters = dict(runner.stats)
    rate = 0.0
    for round_ in range(2):
        specs = [_read_of(runner, Prompt((*range(base + n, base + n + FRAME_PROMPT_TOKENS), int(image_id)),
                                         (ImageInput(_grey_jpeg(shade=2 * (round_ * frames + n) % 251), "image/jpeg",
                                                     "frame probe"),)), width)
                 for n in range(frames)]
        begun = time.perf_counter()
        _read_all(runner, specs)
        rate = frames / (time.perf_counter() - begun)
    runner.images.features.clear()
    runner.stats.clear()
    runner.stats.update(counters)
    return rate


def sample_image_prompt(runner: DiffusionRunner) -> Prompt:
    """A short prompt of plain text ids and one grey camera-sized frame: the warm-up's image read,
    and the patch layout the vision graphs are captured for."""
    from app.engine.base import ImageInput, Prompt

    base = _text_base(runner)
    image_id = runner.model.config.image_token_id
    assert image_id is not None  # a model with an image processor and a vision tower has an image token
    return Prompt((*range(base, base + 32), int(image_id)), (ImageInput(_grey_jpeg(), "image/jpeg", "warm-up"),))


def _text_base(runner: DiffusionRunner) -> int:
    """The first of the warm-ups' ordinary text ids, clear of the special and image ids."""
    return min(1000, runner.vocab_size // 4)


def _read_of(runner: DiffusionRunner, prompt: Prompt | tuple[int, ...], width: int, canvases: int = 1,
             steps: int = 1) -> ReadSpec:
    """A warm-up read: `prompt` (or its ids), `canvases` blank canvases of `width`, one slot."""
    from app.engine.base import Prompt, ReadSpec

    base = _text_base(runner)
    return ReadSpec(prompt if isinstance(prompt, Prompt) else Prompt(prompt), tuple((0,) * width for _ in range(canvases)),
                    (1,), ((base, base + 1),), steps=steps)


def _read_all(runner: DiffusionRunner, specs: list[ReadSpec]) -> None:
    failed = [result for result in runner.read(specs) if isinstance(result, Exception)]
    if failed:
        raise RuntimeError(f"the warm-up read failed: {failed[0]}")


def _grey_jpeg(shade: int = 128) -> bytes:
    """A small grey JPEG: the image processor pads every picture to the same patch budget, so its
    shapes are a camera frame's. Another `shade` is another picture (another digest)."""
    import io

    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (64, 48), (shade, shade, shade)).save(buffer, "JPEG")
    return buffer.getvalue()
