"""Which work a turn takes, and in what order the queue stands after it. Pure: the work is asked
through a callback, so the rules are tested with stand-ins.

The queue's order is the fair order: light work first, heavy work behind it (`after_turn`). A turn
walks the queue asking each piece of work for what it runs within the room left. In a first walk two
shares hold: while work of other callers (decisions) waits, one caller takes at most half the budget,
so a decision of 200 questions cannot keep a steady client's read out of turn after turn; and while
both light and heavy work wait, each kind takes at most half, so any number of heavy requests leave a
steady read room in the next turn, and a stream of light reads leaves heavy work half of every turn.
Then the room left is offered in the same order again. What does not fit waits for the next turn, in
its place.
"""

from __future__ import annotations

from collections import Counter
from typing import Callable, Protocol, Sequence, TypeVar


class Work(Protocol):
    @property
    def caller(self) -> int: ...

    @property
    def heavy(self) -> bool: ...


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
    taken: Counter[int] = Counter()  # by caller
    kinds: Counter[bool] = Counter()  # by heaviness
    used = 0
    chosen: set[int] = set()
    fair = len({work.caller for work in queue}) > 1
    mixed = len({work.heavy for work in queue}) > 1
    share = budget // 2
    for capped in ((True, False) if fair or mixed else (False,)):
        for work in queue:
            room = budget - used
            if room <= 0:
                break
            if capped:
                if fair:
                    room = min(room, share - taken[work.caller])
                if mixed:
                    room = min(room, share - kinds[work.heavy])
                if room <= 0:
                    continue
            tokens = ask(work, room)
            if tokens:
                used += tokens
                taken[work.caller] += tokens
                kinds[work.heavy] += tokens
                chosen.add(id(work))
    return [work for work in queue if id(work) in chosen]


class Queued(Protocol):
    """A job as the queue orders it: whether it is heavy (more than a turn's work by nature: a long
    prompt, a multi-step read, a generation), and the turns it has waited without running."""

    heavy: bool
    passed: int


Q = TypeVar("Q", bound=Queued)

# A heavy job that waited this many turns in a row without running goes ahead of the other heavy work.
STARVED_TURNS = 4


def after_turn(unfinished: Sequence[Q], arrived: Sequence[Q], ran: set[int]) -> list[Q]:
    """The queue's order for the next turn, from the jobs of the turn that are not finished (in their
    order; `ran`: the ids of those that took part) and the jobs that arrived meanwhile. Light work goes
    first, the turn's before the new (a light read the budget split finishes before the reads that
    came since); heavy work follows: a heavy job that waited STARVED_TURNS turns in a row, then what
    waited, what arrived, then what ran. With `compose`'s shares (each kind at most half the turn while
    the other waits) a steady client's read waits about one turn behind any number of heavy requests,
    and light work never holds heavy work back for good."""
    for job in unfinished:
        job.passed = 0 if id(job) in ran else job.passed + 1
    starved = [job for job in unfinished if job.heavy and job.passed >= STARVED_TURNS]
    light = [job for job in (*unfinished, *arrived) if not job.heavy]
    waited = [job for job in unfinished if job.heavy and id(job) not in ran and job.passed < STARVED_TURNS]
    again = [job for job in unfinished if job.heavy and id(job) in ran]
    return [*light, *starved, *waited, *(job for job in arrived if job.heavy), *again]
