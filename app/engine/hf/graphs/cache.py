"""The one graph cache the flat turn's pieces and the vision tower's graphs use: graphs by key, built on
first use until `freeze`, then only looked up. A key that is not held once frozen, or whose capture
failed, is a fallback: the caller runs that pass eagerly, and the cache counts it. Nothing is ever
evicted (the set is bounded: token-count buckets, frame counts), and a failure
while replaying fails only that pass: it never turns graphs off for everyone.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from typing import TYPE_CHECKING, Callable, Generic, Hashable, Iterator, TypeVar

import torch

if TYPE_CHECKING:
    from torch.cuda import _POOL_HANDLE as PoolHandle  # torch types its pool handle privately

log = logging.getLogger("djev.engine")

K = TypeVar("K", bound=Hashable)
G = TypeVar("G")


# What `capture` times, in milliseconds (the runner's counters; the start-up log sums them).
CAPTURE_PHASES = ("graph_warm_ms", "graph_record_ms", "graph_instantiate_ms")


def capture(forward: Callable[[], object], pool: PoolHandle | None, device: torch.device, *,
            first: Callable[[], object] | None, times: Counter[str] | None = None,
            ) -> tuple[torch.cuda.CUDAGraph, object]:
    """Capture `forward` into a CUDA graph over the shared memory `pool`; returns the graph and what
    the captured call returned (its outputs live in the pool and are rewritten by every replay).

    `first`, where given, runs once on a side stream before the recording. A shape's first run is needed: without
    it the captures of new shapes failed on the H200 (a compiled piece's first call of a shape
    copies from the host), and one failed capture left the pool recording, failing every capture
    after it (docs/benchmarks.md). The vision graphs run their whole pass first (the flat turn's
    pieces capture on a stream of their own: app/engine/hf/forward.py).

    Unlike `torch.cuda.graph`, nothing is freed before each capture (its `empty_cache` returned the
    warm run's memory to the device, only for the next warm run to ask for it again); the start-up
    empties the cache once, after the last capture. `times` gets the milliseconds of each phase
    (CAPTURE_PHASES): the warm run, the recording, and the instantiation (`capture_end`)."""
    phases = times if times is not None else Counter()
    started = time.perf_counter()
    stream = torch.cuda.Stream(device=device)
    stream.wait_stream(torch.cuda.current_stream(device))
    if first is not None:
        with torch.cuda.stream(stream):
            first()
    torch.cuda.synchronize(device)
    recorded = time.perf_counter()
    phases["graph_warm_ms"] += round((recorded - started) * 1000)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        graph.capture_begin(pool=pool)
        try:
            output = forward()
        finally:
            ended = time.perf_counter()
            graph.capture_end()
    torch.cuda.current_stream(device).wait_stream(stream)
    phases["graph_record_ms"] += round((ended - recorded) * 1000)
    phases["graph_instantiate_ms"] += round((time.perf_counter() - ended) * 1000)
    return graph, output


class GraphCache(Generic[K, G]):
    """Graphs of one kind (`name`: "flat", "vision") by key. `build(key)` makes one (capturing it
    where the kind captures). Counts go into `stats` (the runner's counters, which /metrics exports):
    `<name>_graphs_built`, `<name>_graph_fallbacks`, and the milliseconds building took."""

    def __init__(self, name: str, build: Callable[[K], G], stats: Counter[str]) -> None:
        self.name = name
        self._build = build
        self.stats = stats
        self._held: dict[K, G] = {}
        self.failed: dict[K, str] = {}  # keys whose build failed, and why: their passes run eagerly
        self.frozen = False

    def get(self, key: K | None) -> G | None:
        """The graph for `key`, built now if the cache is not frozen; None for the eager path (no
        key: the shape is past the policy's caps; frozen and not held; a failed build), counted."""
        if key is None:
            self.stats[f"{self.name}_graph_fallbacks"] += 1
            return None
        graph = self._held.get(key)
        if graph is not None:
            return graph
        if self.frozen or key in self.failed:
            self.stats[f"{self.name}_graph_fallbacks"] += 1
            return None
        return self.build(key)

    def build(self, key: K) -> G | None:
        """Build and hold the graph for `key` (None where its build fails: logged, and the key's
        passes go eager). Out of memory is not a failure of the key: it propagates."""
        started = time.perf_counter()
        try:
            graph = self._build(key)
        except torch.OutOfMemoryError:
            raise
        except Exception as exc:  # noqa: BLE001 - a shape that cannot be captured runs eagerly
            self.failed[key] = f"{type(exc).__name__}: {exc}"
            self.stats[f"{self.name}_graph_failures"] += 1
            log.warning("%s graph %s cannot be built, its passes run eagerly: %s", self.name, key, self.failed[key])
            # A capture that failed half-way can leave the shared pool recording, and every capture
            # after it fails too: build nothing more (every other key is a counted fallback).
            self.frozen = True
            return None
        self._held[key] = graph
        self.stats[f"{self.name}_graphs_built"] += 1
        self.stats[f"{self.name}_graph_build_ms"] += round((time.perf_counter() - started) * 1000)
        return graph

    def freeze(self) -> None:
        """From now on only look up: a missing key is a counted fallback, never a capture."""
        self.frozen = True

    def __contains__(self, key: object) -> bool:
        return key in self._held

    def __len__(self) -> int:
        return len(self._held)

    def __iter__(self) -> Iterator[K]:
        return iter(self._held)

    def graphs(self) -> list[G]:
        return list(self._held.values())

    def clear(self) -> None:
        self._held.clear()
        self.failed.clear()
        self.frozen = False
