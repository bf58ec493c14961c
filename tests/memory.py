"""What a piece of work allocates on the CPU, from torch.profiler's allocation and release events."""

from __future__ import annotations

from typing import Callable, TypeVar

from torch.profiler import ProfilerActivity, profile

T = TypeVar("T")


def cpu_memory(build: Callable[[], T]) -> tuple[T, int, int]:
    """What `build()` returns, the CPU bytes torch still held from it when it returned, and the most
    it held at once while it ran (the events summed in time order)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        made = build()
    events = sorted((event for event in prof.profiler.kineto_results.events() if event.name() == "[memory]"),
                    key=lambda event: event.start_ns())
    held = peak = 0
    for event in events:
        held += event.nbytes()
        peak = max(peak, held)
    return made, held, peak
