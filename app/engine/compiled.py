"""Parts of the model's layers compiled with torch.compile (TORCH_COMPILE), under the CUDA graphs.

A CUDA graph removes launch overhead but replays every kernel eager PyTorch launched: in one
DiffusionGemma layer that is about a hundred small elementwise and reduction kernels (ten RMS norms
of eight kernels each, the router's softmax and top-k arithmetic, the experts' sort, gathers and
weighted sum) around the few large ones. Compiling fuses them into a few generated kernels; the
graphs then capture the compiled kernels as they captured the eager ones (the warm-up calls before
each capture are where a new shape compiles).

What is compiled: each layer's RMS norms, its dense MLP, its router and its experts, as modules.
Not the layer as a whole: a layer's forward indexes the KV cache by its own layer number, which
torch.compile specialises on, so the 30 layers would compile 30 times over for every shape (minutes,
measured: docs/benchmarks.md). These parts hold no per-layer constants, so every layer shares one
compiled body per part and shape; a dimension seen to change compiles once more as dynamic.
Attention (projections, rotary, the cache, SDPA) stays eager, as do the embeddings, the masks and
the vision tower.
"""

from __future__ import annotations

import logging
from typing import Any, Iterator

log = logging.getLogger("djev.engine")

# Compiled variants torch keeps per part before it runs that part eagerly: (static, dynamic) x a
# few input layouts stays well inside it.
RECOMPILE_LIMIT = 64
PARTS = ("mlp", "router", "experts")


def model_layers(model: Any) -> list[Any]:
    """The prompt encoder's and the decoder's layers of a DiffusionGemma model."""
    inner = model.model
    return [*inner.encoder.language_model.layers, *inner.decoder.layers]


def compiled_parts(model: Any) -> Iterator[Any]:
    """The modules `compile_parts` compiles: per layer its norms (attention's too), MLP, router and
    experts."""
    for layer in model_layers(model):
        for name in PARTS:
            part = getattr(layer, name, None)
            if part is not None:
                yield part
        for module in layer.modules():
            if type(module).__name__.endswith("RMSNorm"):
                yield module


def configure_thread() -> None:
    """torch.compile's limits for the calling thread: torch keeps them per thread, so every thread
    that runs the model calls this (HFReader's engine thread does, at its start). A part past the
    recompile limit, or one that fails to compile, runs eagerly instead of failing the read."""
    import torch._dynamo

    config = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):  # the name changed across torch releases
        if hasattr(config, name):
            setattr(config, name, max(getattr(config, name), RECOMPILE_LIMIT))
    config.suppress_errors = True


def compile_parts(model: Any, backend: str = "inductor") -> int:
    """Compile the parts in place (`nn.Module.compile`); returns how many modules. Configures the
    calling thread (`configure_thread`); other threads that run the model must configure themselves."""
    configure_thread()
    count = 0
    for part in compiled_parts(model):
        part.compile(backend=backend, dynamic=None)
        count += 1
    log.info("torch.compile (%s) on %d norm, MLP, router and experts modules: each new shape compiles on first use",
             backend, count)
    return count


def warm_up(runner: Any, canvas_length: int, rows: tuple[int, ...] = (1, 2)) -> float:
    """Compile before the first request does: one text read at each of `rows` batch sizes (the
    first compiles each part for its shapes, the second once more as dynamic), through the runner's
    own path, CUDA graphs included. Returns the seconds it took (about 25 s on an H200, measured);
    the prompt KV these reads leave in the LRU is dropped."""
    import time

    from app.engine.base import Prompt, ReadSpec

    started = time.perf_counter()
    width = max(4, canvas_length)
    base = min(1000, runner.vocab_size // 4)  # ordinary text ids, clear of the special and image ids
    for count in rows:
        specs = [ReadSpec(Prompt(tuple(range(base + 97 * row, base + 97 * row + 64 + 16 * row))),
                          ((0,) * width,), (1,), ((base, base + 1),)) for row in range(count)]
        failed = [result for result in runner.read(specs) if isinstance(result, Exception)]
        if failed:
            raise RuntimeError(f"the warm-up read failed: {failed[0]}")
    runner.prompts.clear()
    runner.stats.clear()  # the counters (and /metrics) start at the first request
    return time.perf_counter() - started
