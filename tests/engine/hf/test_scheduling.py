"""The hf engine's scheduling contract (app/engine/base.py), on a fake runner that records what the
engine thread was asked to do: arrival order kept, a read waits at most one pass behind a
generation, cancelled work is never run, failures reach exactly the callers they belong to."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter

import pytest

from app.engine.base import (
    EngineError,
    EngineInputError,
    EngineUnavailable,
    GenerateChunk,
    GenerateSpec,
    Prompt,
    ReaderInfo,
    ReadResult,
    ReadSpec,
    SlotRead,
)
from app.engine.hf.reader import HFOptions, HFReader


def spec(tag: int, canvases: int = 1) -> ReadSpec:
    return ReadSpec(Prompt((tag,)), tuple((tag,) for _ in range(canvases)), (0,), ((1, 2),))


class FakeRunner:
    """Stands in for DiffusionRunner: every call is logged; reads and passes take `delay` seconds."""

    def __init__(self, delay: float = 0.03, passes: int = 6) -> None:
        self.delay = delay
        self.passes = passes
        self.stats: Counter[str] = Counter()
        self.log: list[tuple[str, object]] = []
        self.lock = threading.Lock()
        self.fail_tag: int | None = None
        self.crash = False

    def read(self, specs, preprocessed=None):
        time.sleep(self.delay)
        with self.lock:
            self.log.append(("read", [s.prompt.ids[0] for s in specs]))
        if self.crash:
            raise RuntimeError("the model fell over")
        out = []
        for s in specs:
            if s.prompt.ids[0] == self.fail_tag:
                out.append(EngineInputError("unreadable", param="state"))
            else:
                slots = tuple((SlotRead((-0.5, -1.0), 1),) for _ in s.canvases)
                out.append(ReadResult(slots=slots, prompt_tokens=1))
        return out

    def start_generation(self, spec, canvas_length, preprocessed=None):
        time.sleep(self.delay)
        self.log.append(("encode", spec.seed))
        return {"spec": spec, "done": 0}

    def step_generation(self, state):
        time.sleep(self.delay)
        state["done"] += 1
        self.log.append(("pass", state["spec"].seed))
        if state["done"] == self.passes:
            return GenerateChunk(ids=(7,) * state["done"], done=True, stopped=False, prompt_tokens=1,
                                 passes=state["done"])
        return None


def make_reader(runner: FakeRunner, max_rows: int = 64, gather_ms: float = 0) -> HFReader:
    options = HFOptions(device="cpu", max_prompt_tokens=100, kv_cache_entries=0, max_batch_rows=max_rows,
                        gather_ms=gather_ms,
                        queue_limit=64, served_name="fake", canvas_length=16, tiny=True, torch_threads=0,
                        cuda_graphs=False, torch_compile=False, fused_moe=False)
    info = ReaderInfo(model="fake", engine="hf", device="cpu", tiny=True, canvas_length=16)
    return HFReader(runner, None, info, options)


def run(coro):
    return asyncio.run(coro)


def test_reads_keep_arrival_order_and_wait_at_most_one_batch():
    runner = FakeRunner(delay=0.05)
    reader = make_reader(runner, max_rows=4)

    async def scenario():
        await reader.start()
        tasks = []
        for tag in range(12):  # 12 one-canvas reads, 3 at a time, while batches of 4 run
            tasks.append(asyncio.create_task(reader.read([spec(tag)])))
            if tag % 3 == 2:
                await asyncio.sleep(0.02)
        await asyncio.gather(*tasks)
        await reader.stop()

    run(scenario())
    batches = [tags for kind, tags in runner.log if kind == "read"]
    flat = [tag for batch in batches for tag in batch]
    assert flat == list(range(12)), "a later read was served before an earlier one"
    assert all(len(batch) <= 4 for batch in batches)


def test_a_read_waits_at_most_one_pass_behind_a_generation():
    runner = FakeRunner(delay=0.03, passes=20)
    reader = make_reader(runner)

    async def scenario():
        await reader.start()
        generation = asyncio.create_task(reader.generate(GenerateSpec(Prompt((1,)), 64, (), seed=5)))
        await asyncio.sleep(0.2)  # the generation is several passes in
        before = len(runner.log)
        await reader.read([spec(99)])
        after = runner.log[before:]
        result = await generation
        await reader.stop()
        return after, result

    after, result = run(scenario())
    read_at = next(i for i, (kind, _) in enumerate(after) if kind == "read")
    assert read_at <= 1, f"the read waited {read_at} passes: {after[:read_at + 1]}"
    assert result.passes == 20 and len(result.ids) == 20


def test_a_cancelled_read_is_never_run():
    runner = FakeRunner(delay=0.1)
    reader = make_reader(runner, max_rows=1)

    async def scenario():
        await reader.start()
        first = asyncio.create_task(reader.read([spec(1)]))
        await asyncio.sleep(0.02)  # spec 1 is running; spec 2 waits in the queue
        second = asyncio.create_task(reader.read([spec(2)]))
        third = asyncio.create_task(reader.read([spec(3)]))
        await asyncio.sleep(0.01)
        second.cancel()
        await first
        await third
        with pytest.raises(asyncio.CancelledError):
            await second
        await reader.stop()

    run(scenario())
    served = [tag for kind, tags in runner.log if kind == "read" for tag in tags]
    assert served == [1, 3]


def test_a_generation_whose_caller_leaves_stops_at_its_next_pass():
    runner = FakeRunner(delay=0.03, passes=1000)
    reader = make_reader(runner)

    async def scenario():
        await reader.start()
        task = asyncio.create_task(reader.generate(GenerateSpec(Prompt((1,)), 4096, (), seed=9)))
        await asyncio.sleep(0.2)
        task.cancel()
        await asyncio.sleep(0.1)
        passes = sum(1 for kind, _ in runner.log if kind == "pass")
        await asyncio.sleep(0.3)
        later = sum(1 for kind, _ in runner.log if kind == "pass")
        assert reader.stats["queue_depth"] == 0
        await reader.stop()
        return passes, later

    passes, later = run(scenario())
    assert later - passes <= 1 and passes < 20


def test_an_unreadable_read_fails_alone_and_a_crash_fails_its_batch():
    runner = FakeRunner(delay=0.05)
    reader = make_reader(runner)

    async def scenario():
        await reader.start()
        runner.fail_tag = 2
        blocker = asyncio.create_task(reader.read([spec(0)]))
        await asyncio.sleep(0.01)
        good = asyncio.create_task(reader.read([spec(1)]))
        bad = asyncio.create_task(reader.read([spec(2)]))
        await blocker
        assert len(await good) == 1
        with pytest.raises(EngineInputError):
            await bad
        runner.crash = True
        with pytest.raises(EngineError, match="the model fell over"):
            await reader.read([spec(4)])
        runner.crash = False
        assert len(await reader.read([spec(5)])) == 1  # the loop survived
        await reader.stop()

    run(scenario())


def after_a_busy_batch(gather_ms: float, second_round) -> tuple[list, float]:
    """Reads 1, 2 and 3 as one busy batch, then `second_round(reader)`: the batches read, and the
    seconds the second round took."""
    runner = FakeRunner(delay=0.05)
    reader = make_reader(runner, gather_ms=gather_ms)

    async def scenario():
        await reader.start()
        await asyncio.gather(*(reader.read([spec(tag)]) for tag in (1, 2, 3)))
        started = time.perf_counter()
        await second_round(reader)
        took = time.perf_counter() - started
        await reader.stop()
        return took

    took = run(scenario())
    return [tags for kind, tags in runner.log if kind == "read"], took


def test_the_gather_ends_once_the_last_batchs_callers_are_back():
    async def back(reader):
        second = [asyncio.create_task(reader.read([spec(tag)])) for tag in (4, 5)]
        await asyncio.sleep(0.02)
        second.append(asyncio.create_task(reader.read([spec(6)])))  # the third caller back, a little late
        await asyncio.gather(*second)

    batches, took = after_a_busy_batch(500, back)
    assert batches == [[1, 2, 3], [4, 5, 6]]  # the late caller rode the batch...
    assert took < 0.02 + 0.05 + 0.2  # ...which started when it arrived, not at the 500 ms window's end


def test_the_gather_window_bounds_the_wait_for_callers_that_do_not_come_back():
    async def two_of_three(reader):
        await asyncio.gather(reader.read([spec(4)]), reader.read([spec(5)]))  # one caller of three gone

    batches, took = after_a_busy_batch(100, two_of_three)
    assert batches == [[1, 2, 3], [4, 5]]
    assert 0.1 + 0.05 <= took < 0.1 + 0.05 + 0.15  # the whole window, then the batch


def test_under_load_a_batch_gathers_reads_that_arrive_just_after_it_is_formed():
    runner = FakeRunner(delay=0.05)
    reader = make_reader(runner, gather_ms=40)

    async def scenario():
        await reader.start()
        first = [asyncio.create_task(reader.read([spec(tag)])) for tag in (1, 2)]  # a busy batch
        await asyncio.gather(*first)
        late = [asyncio.create_task(reader.read([spec(3)]))]
        await asyncio.sleep(0.01)  # arrives inside the gather window of the batch spec 3 starts
        late.append(asyncio.create_task(reader.read([spec(4)])))
        await asyncio.gather(*late)
        alone_started = time.perf_counter()
        await reader.read([spec(5)])  # the last batch served two callers: still gathers once
        await reader.read([spec(6)])  # a lone caller after a lone batch: no wait
        lone = time.perf_counter() - alone_started
        await reader.stop()
        return lone

    lone = run(scenario())
    batches = [tags for kind, tags in runner.log if kind == "read"]
    assert batches[:2] == [[1, 2], [3, 4]]
    assert lone < 0.05 * 2 + 0.04 + 0.03  # two reads, at most one gather


def test_the_heap_is_set_aside_again_after_a_pass_builds_new_graphs(monkeypatch):
    from types import SimpleNamespace

    from app.engine.hf import reader as hf

    runner = FakeRunner(delay=0.0)
    runner.graphs = SimpleNamespace(captures=0)
    settled = []
    monkeypatch.setattr(hf, "settle_heap", lambda: settled.append(1) or 0)
    reader = make_reader(runner)
    read = runner.read

    def capturing_read(specs, *rest):
        if any(s.prompt.ids[0] == 2 for s in specs):
            runner.graphs.captures += 1  # this pass captured a graph
        return read(specs, *rest)

    runner.read = capturing_read

    async def scenario():
        await reader.start()
        for tag in (1, 2, 3):
            await reader.read([spec(tag)])
        await reader.stop()

    run(scenario())
    assert len(settled) == 1  # after the pass that built, not after the others


def test_a_read_waiting_in_the_gather_window_when_the_engine_stops_is_told_so():
    async def stopped_while_gathering(reader):
        waiting = asyncio.create_task(reader.read([spec(4)]))
        await asyncio.sleep(0.05)  # popped from the queue, inside the 5 s window
        await reader.stop()
        with pytest.raises(EngineUnavailable):
            await asyncio.wait_for(waiting, 1.0)  # told at once, not left to its own timeout

    after_a_busy_batch(5000, stopped_while_gathering)
