"""The one graph cache the decoder, encoder and vision graphs share: graphs by shape key, built on
first use until `freeze`, then only looked up. A key that is not held once frozen, or whose capture
failed, is a fallback: the caller runs that pass eagerly, and the cache counts it. Nothing is ever
evicted (the set is bounded by the shape policy, app/engine/hf/graphs/shapes.py), and a failure
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


def capture(forward: Callable[[], object], pool: PoolHandle | None, device: torch.device) -> tuple[torch.cuda.CUDAGraph, object]:
    """Run `forward` once on a side stream, then capture it into a CUDA graph over the shared memory
    `pool`; returns the graph and what the captured call returned (its outputs live in the pool and
    are rewritten by every replay). The run before is needed for every shape, not only a kind's
    first: without it the captures of new shapes failed on the H200 (a compiled piece's first call
    of a shape copies from the host), and one failed capture left the pool recording, failing every
    capture after it (docs/benchmarks.md)."""
    stream = torch.cuda.Stream(device=device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        forward()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        output = forward()
    return graph, output


class GraphCache(Generic[K, G]):
    """Graphs of one kind (`name`: "decoder", "encoder", "vision") by key. `build(key)` makes one
    (capturing it where the kind captures). Counts go into `stats` (the runner's counters, which
    /metrics exports): `<name>_graphs_built`, `<name>_graph_fallbacks`, and the milliseconds building took."""

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
