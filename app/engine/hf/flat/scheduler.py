"""Which work a flat turn takes: the token budget, shared fairly. Pure: the work is asked through a
callback, so the rule is tested with stand-ins.

The queue's order is the fair order (arrival, and work that ran goes back behind what waits). A turn
walks it asking each piece of work for what it runs within the room left. While work of other callers
(decisions) waits, one caller takes at most half the budget in a first walk, so a decision of 200
questions cannot keep a steady client's read out of turn after turn; then the room left is offered
in the same order again. What does not fit waits for the next turn, in its place.
"""

from __future__ import annotations

from collections import Counter
from typing import Callable, Protocol, Sequence, TypeVar


class Work(Protocol):
    @property
    def caller(self) -> int: ...


W = TypeVar("W", bound=Work)


class TurnFailed(Exception):
    """A turn raised: `entries`, the work that took part in it (each already released by the engine),
    fails with `cause`; the rest of the queue is untouched."""

    def __init__(self, entries: Sequence[object], cause: Exception) -> None:
        super().__init__(f"a flat turn failed: {cause!r}")
        self.entries = list(entries)
        self.cause = cause


def compose(queue: Sequence[W], budget: int, ask: Callable[[W, int], int]) -> list[W]:
    """The work that takes part in a turn of `budget` tokens, in queue order. `ask(work, room)` adds
    what `work` runs within `room` tokens to the turn and says how many tokens that is (0: nothing
    fits, or it has nothing to run now); it may be asked twice in one turn and then adds to what it
    took."""
    taken: Counter[int] = Counter()
    used = 0
    chosen: set[int] = set()
    fair = len({work.caller for work in queue}) > 1
    share = budget // 2
    for capped in ((True, False) if fair else (False,)):
        for work in queue:
            room = budget - used
            if room <= 0:
                break
            if capped:
                room = min(room, share - taken[work.caller])
                if room <= 0:
                    continue
            tokens = ask(work, room)
            if tokens:
                used += tokens
                taken[work.caller] += tokens
                chosen.add(id(work))
    return [work for work in queue if id(work) in chosen]
