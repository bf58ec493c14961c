"""The model's layers compiled with torch.compile (TORCH_COMPILE), under the CUDA graphs.

What is compiled: each text layer's two pieces around the attention (app/engine/hf/layers.py), one
compiled body per piece, layer kind and shape, and the vision tower's encoder layers, one body for
all of them; the embeddings and the masks stay eager. The graphs capture the compiled kernels as
they captured the eager ones. Why, and why not whole layers: docs/design.md §4.7 and §5.2.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn
    from transformers import DiffusionGemmaForBlockDiffusion

    from app.engine.base import Prompt, ReadSpec
    from app.engine.hf.layers import TextLayer
    from app.engine.hf.runner import DiffusionRunner

log = logging.getLogger("djev.engine")

# Compiled variants torch keeps per piece before it runs that piece eagerly: (static, dynamic) x
# two layer kinds x a few input layouts stays well inside it.
RECOMPILE_LIMIT = 64


def model_layers(model: DiffusionGemmaForBlockDiffusion) -> list[TextLayer]:
    """The prompt encoder's and the decoder's layers of a DiffusionGemma model."""
    from app.engine.hf.parts import decoder_layers, encoder_layers

    return [*encoder_layers(model), *decoder_layers(model)]


def vision_layers(model: DiffusionGemmaForBlockDiffusion) -> list[nn.Module]:
    """The vision tower's encoder layers, or none for a model without one."""
    tower = getattr(model.model.encoder, "vision_tower", None)
    encoder = getattr(tower, "encoder", None)
    return list(getattr(encoder, "layers", ()))


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


def compile_layers(model: DiffusionGemmaForBlockDiffusion, backend: str = "inductor", *, text: bool = True) -> int:
    """Give every text layer the split forward with its two pieces compiled (app/engine/hf/layers.py),
    and every vision encoder layer its forward compiled; returns how many text layers (0 with `text`
    False: the flat turn, whose forward runs the layers' pieces itself, compiles the vision layers
    alone). Configures the calling thread (`configure_thread`); other threads that run the model must
    configure themselves."""
    import functools

    import torch

    from app.engine.hf.layers import install, install_vision

    configure_thread()
    layers = model_layers(model) if text else []
    compiled = functools.partial(torch.compile, backend=backend, dynamic=None)
    if layers:
        install(layers, compile=compiled)
    vision = vision_layers(model)
    install_vision(vision, compile=compiled)
    if layers:
        log.info("torch.compile (%s) on the %d text layers' attention inputs and feed-forward halves and the %d "
                 "vision layers: each new shape compiles on first use", backend, len(layers), len(vision))
    else:
        log.info("torch.compile (%s) on the %d vision layers (the flat turn compiles its own layer bodies)", backend,
                 len(vision))
    return len(layers)


# The warm-up's batch sizes: the first read compiles each piece for its shapes, the second once more
# as dynamic, which then serves every other size.
WARM_UP_ROWS = (1, 2)
# The canvases of the warm-up's multi-step read (more than the self-conditioned graphs' one row).
WARM_UP_CANVASES = 4


def warm_up(runner: DiffusionRunner, canvas_length: int) -> float:
    """Compile before the first request does: one text read at each of WARM_UP_ROWS batch sizes, through the runner's
    own path, CUDA graphs included, one long prompt encoded in chunks (their shapes compile here, not
    on the first long state: 6.3 s on an H200, measured), one read of an image when the runner reads images (the
    vision layers compile there, not on a walker's first frame), and a two-step read of several canvases (the eager
    self-conditioned decoder pass). Returns the seconds it took (about
    50 s on an H200, measured); the prompt KV and vision features these reads leave in the LRUs are
    dropped."""
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
    if getattr(runner, "image_processor", None) is not None and vision_layers(runner.model):
        timed("an image", [_read_of(runner, sample_image_prompt(runner), width)])
    # A multi-step read of several canvases: its second step is the eager self-conditioned decoder
    # pass (the conditioned graphs hold one row), a path none of the reads above takes. (The one
    # turn of 1.6-2.3 s such a pass took beside the served bench's heavy burst was not a first use:
    # it came back with its exact shape warmed here, and went with a shorter interpreter switch
    # interval, SWITCH_INTERVAL_MS; docs/design.md §5.2.)
    timed("a multi-step read", [_read_of(runner, tuple(range(base, base + 64)), width, canvases=WARM_UP_CANVASES,
                                         steps=2)])
    log.info("the warm-up's reads: %s", ", ".join(f"{part} {seconds:.1f} s" for part, seconds in parts.items()))
    runner.clear_caches()
    runner.stats.clear()  # the counters (and /metrics) start at the first request
    return time.perf_counter() - started


def sample_image_prompt(runner: DiffusionRunner) -> Prompt:
    """A short prompt of plain text ids and one grey camera-sized frame: the warm-up's image read,
    and the patch layout the vision graphs are captured for."""
    from app.engine.base import ImageInput, Prompt

    base = _text_base(runner)
    image_id = runner.config.image_token_id
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


def _grey_jpeg() -> bytes:
    """A small grey JPEG: the image processor pads every picture to the same patch budget, so its
    shapes are a camera frame's."""
    import io

    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (64, 48), (128, 128, 128)).save(buffer, "JPEG")
    return buffer.getvalue()
