"""What the hf reader watches besides its turns: the garbage collector's full passes (a pause no turn
explains shows there), and what was built after `ready` (graphs captured, code compiled, Triton kernels:
none should be). `settle_heap` sets the start-up's objects aside from the collector's passes."""

from __future__ import annotations

import gc
import logging
import sys
import time
from collections import Counter
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from app.engine.hf.runner import DiffusionRunner

log = logging.getLogger("djev.engine")

SLOW_GC_S = 0.1


def settle_heap() -> None:
    """Set every object alive now (the model, the libraries, the compiled code) aside from the
    garbage collector's passes, which otherwise walk them all in every full pass: several hundred
    thousand objects, ~170 ms a pass on this project's CPU box, and a 32-prompt read on an H200
    that now and then took 500 ms more than its median (docs/benchmarks.md). Called once the model
    is loaded and warmed up (they stay alive for good, so cyclic garbage of the start-up stays too:
    a few objects, once). Cheap; counting what it set aside (`gc.get_freeze_count`) walks them all."""
    gc.freeze()


class CollectorWatch:
    """Times the garbage collector's full passes into `stats` (`gc_full_passes`, `gc_full_ms`) and
    logs one past SLOW_GC_S: a full pass stops every thread, the engine's included, so a stall that
    no engine turn explains shows here. Registered while the reader runs."""

    def __init__(self, stats: Counter[str]) -> None:
        self.stats = stats
        self.started = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if info.get("generation") != 2:
            return
        if phase == "start":
            self.started = time.perf_counter()
            return
        seconds = time.perf_counter() - self.started
        self.stats["gc_full_passes"] += 1
        self.stats["gc_full_ms"] += round(seconds * 1000)
        if seconds > SLOW_GC_S:
            log.warning("a full pass of the garbage collector took %.0f ms (%s objects collected)",
                        seconds * 1000, info.get("collected"))


def compile_counts(runner: DiffusionRunner) -> tuple[int, int, int]:
    """(CUDA graphs captured, graphs torch.compile has built, Triton kernels compiled) so far: after
    `ready` none of them should grow (`HFReader` counts any that does, and the seconds of its turn).
    The first two leave long-lived objects behind (hundreds of thousands for a compile), which
    `settle_heap` should set aside again, or every full pass of the collector walks them (150-200 ms
    pauses measured on the H200 after new shapes compiled: docs/benchmarks.md)."""
    captures = sum(graphs.captures for graphs in (runner.images.graphs, runner.flat.forward.graphs)
                   if graphs is not None)
    dynamo = sys.modules.get("torch._dynamo.utils")
    compiled = int(dynamo.counters["stats"].get("unique_graphs", 0)) if dynamo is not None else 0
    triton = 0
    if "triton" in sys.modules:
        from app.engine.hf.moe.fused import compiled_kernels

        triton = compiled_kernels()
        kernel = sys.modules.get("app.engine.hf.segment_kernel")
        if kernel is not None:
            triton += kernel.compiled_kernels()
    return captures, compiled, triton


