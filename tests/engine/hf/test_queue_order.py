"""The queue's order after a turn (`scheduler.after_turn`): light work first, a light read the budget
split before the reads that came since, heavy work behind it, and a heavy job that waited too long
ahead of the other heavy work. Turn by turn with `compose`'s shares: a steady read waits about one
turn behind any number of heavy requests, and a stream of light reads never keeps heavy work out. On
the tiny model, a steady read waits about one turn behind many heavy ones."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from app.engine.base import current_caller, new_caller
from app.engine.hf.scheduler import STARVED_TURNS, after_turn, compose
from tests.conftest import make_tiny_reader
from tests.engine.hf.test_reader import spec_for


@dataclass(eq=False)
class Job:
    name: str
    heavy: bool
    passed: int = 0
    want: int = 0  # tokens of work, for the turn-by-turn runs
    caller: int = 0

    def ask(self, room: int) -> int:
        tokens = min(self.want, room)
        self.want -= tokens
        return tokens


def names(jobs) -> list[str]:
    return [job.name for job in jobs]


def test_light_work_goes_first_and_a_split_read_before_newer_ones():
    heavy_ran, heavy_waited, split, light_waited = Job("H1", True), Job("H2", True), Job("L1", False), Job("L2", False)
    new_light, new_heavy = Job("L3", False), Job("H3", True)
    order = after_turn([heavy_ran, heavy_waited, split, light_waited], [new_light, new_heavy],
                       ran={id(heavy_ran), id(split)})
    assert names(order) == ["L1", "L2", "L3", "H2", "H3", "H1"]
    assert (heavy_ran.passed, heavy_waited.passed, split.passed, light_waited.passed) == (0, 1, 0, 1)


def test_a_heavy_job_that_waited_too_long_goes_ahead_of_the_other_heavy_work():
    starving, light, other = Job("H", True, passed=STARVED_TURNS - 1), Job("L", False), Job("H2", True)
    assert names(after_turn([other, starving, light], [], ran={id(other)})) == ["L", "H", "H2"]
    assert starving.passed == STARVED_TURNS
    assert names(after_turn([light, starving], [], ran={id(starving)})) == ["L", "H"]  # it ran: back in line
    assert starving.passed == 0


def run_turns(queue: list[Job], budget: int, turns: int, arrivals=lambda turn: []) -> list[list[str]]:
    """Turn after turn as the reader runs them: `compose` over the queue, then `after_turn`; the names
    of each turn's work. A job is finished when it has no tokens left."""
    taken: list[list[str]] = []
    for turn in range(turns):
        ran = compose(queue, budget, lambda job, room: job.ask(room))
        taken.append(names(ran))
        unfinished = [job for job in queue if job.want]
        queue[:] = after_turn(unfinished, arrivals(turn), {id(job) for job in ran})
    return taken


def test_a_steady_read_waits_one_turn_behind_any_number_of_starved_heavy_requests():
    # 25 heavy requests, each more than half a turn of work: a turn holds two of them, so after a few
    # turns most are starved. A steady read that arrives then still runs in the next turn.
    heavy = [Job(f"H{n}", True, want=3000, caller=n + 1) for n in range(25)]
    queue = list(heavy)
    run_turns(queue, 1000, 8)
    assert sum(job.passed >= STARVED_TURNS for job in queue) > 2
    steady = Job("S", False, want=40, caller=99)
    taken = run_turns(queue, 1000, 1, arrivals=lambda turn: [steady])  # it arrives during this turn
    taken += run_turns(queue, 1000, 1)
    assert "S" in taken[1] and steady.want == 0


def test_a_stream_of_light_reads_never_keeps_heavy_work_out():
    heavy = Job("H", True, want=2000, caller=1)
    callers = iter(range(100, 10_000))

    def light(turn: int) -> list[Job]:  # more light work every turn than a turn holds
        return [Job(f"L{turn}.{n}", False, want=100, caller=next(callers)) for n in range(20)]

    queue = [heavy, *light(-1)]
    taken = run_turns(queue, 1000, 6, arrivals=light)
    assert all("H" in turn for turn in taken[:4]) and heavy.want == 0  # half of every turn, 4 turns


def steady_waits(reader, tokenizer, burst: list, after_turns: int) -> list[int]:
    """Send `burst` (each read its own caller's) to `reader`, then, once `after_turns` turns ran, three
    steady reads one after another: the turns each waited from its arrival to the turn that read it."""
    turns: list[set[tuple[int, ...]]] = []  # each turn's canvases
    run = reader.runner.flat.turn.run

    def seen(parts):
        turns.append({tuple(part.ids) for part in parts if part.kind.value == "canvas"})
        return run(parts)

    reader.runner.flat.turn.run = seen
    waited: list[int] = []

    async def as_caller(specs):
        current_caller.set(new_caller())
        return await reader.read(specs)

    async def scenario():
        await reader.start()
        try:
            tasks = [asyncio.create_task(as_caller([spec])) for spec in burst]
            while len(turns) < after_turns:
                await asyncio.sleep(0.005)
            for n in range(3):
                steady = spec_for(tokenizer, f"steady {n}", "q1: yes", [7 + n])
                arrived = len(turns)
                await as_caller([steady])
                waited.append(next(i for i, turn in enumerate(turns) if steady.canvases[0] in turn) - arrived)
            await asyncio.gather(*tasks)
        finally:
            await reader.stop()

    asyncio.run(scenario())
    return waited


def test_a_steady_read_waits_about_one_turn_behind_many_heavy_requests(tiny_dir, tokenizer):
    reader = make_tiny_reader(tiny_dir, turn_tokens=1024, prefill_chunk=512)
    state = " ".join(f"word{i % 97} and{i % 13}" for i in range(400))  # ~1,500 tokens: 3 chunks of 512
    heavy = [spec_for(tokenizer, f"{n} {state}", "q1: yes", [40 + n]) for n in range(6)]
    # the turn running when it came, then its own
    assert max(steady_waits(reader, tokenizer, heavy, after_turns=2)) <= 1


def test_a_steady_read_waits_about_one_turn_behind_many_reads_of_a_third_of_a_turn(tiny_dir, tokenizer):
    # Reads that each fit a turn but take a third of it (a 200-question decision's reads, scaled to the
    # budget) are heavy: counted light, they went first and kept the steady read waiting turn after turn.
    reader = make_tiny_reader(tiny_dir, turn_tokens=1024, prefill_chunk=1024)
    state = " ".join(f"word{i % 97} and{i % 13}" for i in range(60))  # ~390 tokens
    medium = [spec_for(tokenizer, f"{n} {state}", "q1: yes", [40 + n]) for n in range(16)]
    assert all(1024 // 4 < len(spec.prompt.ids) <= 1024 // 2 for spec in medium)
    waited = steady_waits(reader, tokenizer, medium, after_turns=1)
    assert max(waited) <= 1, waited
