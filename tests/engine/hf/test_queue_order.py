"""The queue's order after a turn (`scheduler.after_turn`): light work first, a light read the budget
split before the reads that came since, heavy work behind it, and a heavy job that waited too long
ahead of everything; on the tiny model, a steady read waits about one turn behind many heavy ones."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from app.engine.base import current_caller, new_caller
from app.engine.hf.scheduler import STARVED_TURNS, after_turn
from tests.conftest import make_tiny_reader
from tests.engine.hf.test_reader import spec_for


@dataclass(eq=False)
class Job:
    name: str
    heavy: bool
    passed: int = 0


def names(jobs) -> list[str]:
    return [job.name for job in jobs]


def test_light_work_goes_first_and_a_split_read_before_newer_ones():
    heavy_ran, heavy_waited, split, light_waited = Job("H1", True), Job("H2", True), Job("L1", False), Job("L2", False)
    new_light, new_heavy = Job("L3", False), Job("H3", True)
    order = after_turn([heavy_ran, heavy_waited, split, light_waited], [new_light, new_heavy],
                       ran={id(heavy_ran), id(split)})
    assert names(order) == ["L1", "L2", "L3", "H2", "H3", "H1"]
    assert (heavy_ran.passed, heavy_waited.passed, split.passed, light_waited.passed) == (0, 1, 0, 1)


def test_a_heavy_job_that_waited_too_long_goes_ahead_of_everything():
    starving, light = Job("H", True, passed=STARVED_TURNS - 1), Job("L", False)
    assert names(after_turn([starving, light], [], ran=set())) == ["H", "L"]
    assert starving.passed == STARVED_TURNS
    assert names(after_turn([light, starving], [], ran={id(starving)})) == ["L", "H"]  # it ran: back in line
    assert starving.passed == 0


def test_a_steady_read_waits_about_one_turn_behind_many_heavy_requests(tiny_dir, tokenizer):
    reader = make_tiny_reader(tiny_dir, turn_tokens=1024, prefill_chunk=512)
    turns: list[set[tuple[int, ...]]] = []  # each turn's canvases
    run = reader.runner.flat.turn.run

    def seen(parts):
        turns.append({tuple(part.ids) for part in parts if part.kind.value == "canvas"})
        return run(parts)

    reader.runner.flat.turn.run = seen
    state = " ".join(f"word{i % 97} and{i % 13}" for i in range(400))  # ~1,500 tokens: 3 chunks of 512
    heavy = [spec_for(tokenizer, f"{n} {state}", "q1: yes", [40 + n]) for n in range(6)]
    waited: list[int] = []

    async def as_caller(specs):
        current_caller.set(new_caller())
        return await reader.read(specs)

    async def scenario():
        await reader.start()
        try:
            burst = [asyncio.create_task(as_caller([spec])) for spec in heavy]
            while len(turns) < 2:  # the heavy requests fill turns
                await asyncio.sleep(0.005)
            for n in range(3):
                steady = spec_for(tokenizer, f"steady {n}", "q1: yes", [7 + n])
                arrived = len(turns)
                await as_caller([steady])
                waited.append(next(i for i, turn in enumerate(turns) if steady.canvases[0] in turn) - arrived)
            await asyncio.gather(*burst)
        finally:
            await reader.stop()

    asyncio.run(scenario())
    assert max(waited) <= 1  # the turn running when it came, then its own
