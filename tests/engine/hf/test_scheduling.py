"""The hf engine's scheduling contract (app/engine/base.py), on a fake runner that records what the
engine thread was asked to do: arrival order kept, a read waits at most one pass behind a
generation or a heavy read's step, cancelled work is never run, failures reach exactly the callers
they belong to."""

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


def spec(tag: int, canvases: int = 1, tokens: int = 1, steps: int = 1) -> ReadSpec:
    """A read the fake runner knows by its tag (the prompt's first id); `tokens` prompt ids."""
    return ReadSpec(Prompt((tag,) * tokens), tuple((tag,) for _ in range(canvases)), (0,), ((1, 2),), steps=steps)


class FakeRunner:
    """Stands in for DiffusionRunner: every call is logged; reads and passes take `delay` seconds."""

    def __init__(self, delay: float = 0.03, passes: int = 6, chunk: int = 4, max_rows: int = 64) -> None:
        self.delay = delay
        self.passes = passes
        self.chunk = chunk  # prompt ids a step encodes (PREFILL_CHUNK)
        self.max_rows = max_rows
        self.stats: Counter[str] = Counter()
        self.log: list[tuple[str, object]] = []
        self.lock = threading.Lock()
        self.fail_tag: int | None = None
        self.crash = False
        self.flat = None  # the row path's turns (the flat turn's have tests/engine/hf/flat/test_reader.py)
        self.allocations = [0, 0]  # (device allocations, retries) as the allocator would count them
        self.retries_a_read = 0

    def allocator_counts(self):
        return tuple(self.allocations)

    def read(self, specs, preprocessed=None):
        time.sleep(self.delay)
        with self.lock:
            self.log.append(("read", [s.prompt.ids[0] for s in specs]))
            self.allocations[0] += self.retries_a_read
            self.allocations[1] += self.retries_a_read
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

    def needs_chunks(self, prompt):
        return len(prompt.ids) > self.chunk

    def long_encoding(self, prompt):
        """As DiffusionRunner's, over `chunk` (the reader's prefill_chunk): light prompts of more
        than half of it count their tokens."""
        n = len(prompt.ids)
        return n if 2 * n > self.chunk and not self.needs_chunks(prompt) else 0

    def read_steps(self, specs, preprocessed=None):
        """Like DiffusionRunner.read_steps: a step per chunk of a long prompt and per decoder pass
        (`steps` passes a group of max_rows canvases), each taking `delay` and logged."""
        tag = specs[0].prompt.ids[0]
        steps = sum(-(-len(s.prompt.ids) // self.chunk) if self.needs_chunks(s.prompt) else 0 for s in specs)
        rows = sum(len(s.canvases) for s in specs)
        steps += -(-rows // self.max_rows) * max(s.steps for s in specs)
        for number in range(steps):
            if number:
                yield
            time.sleep(self.delay)
            with self.lock:
                self.log.append(("step", tag))
        return [ReadResult(slots=tuple((SlotRead((-0.5, -1.0), 1),) for _ in s.canvases), prompt_tokens=1)
                for s in specs]

    def start_steps(self, spec, canvas_length, preprocessed=None):
        """Like DiffusionRunner.start_steps for a short prompt: one step, its encoding."""
        time.sleep(self.delay)
        self.log.append(("encode", spec.seed))
        return {"spec": spec, "done": 0}
        yield  # (a generator, as the runner's is)

    def step_generation(self, state):
        time.sleep(self.delay)
        state["done"] += 1
        self.log.append(("pass", state["spec"].seed))
        if state["done"] == self.passes:
            return GenerateChunk(ids=(7,) * state["done"], done=True, stopped=False, prompt_tokens=1,
                                 passes=state["done"])
        return None


def make_reader(runner: FakeRunner, max_rows: int = 64, gather_ms: float = 0, gather_rows: int = 0) -> HFReader:
    runner.max_rows = max_rows
    options = HFOptions(device="cpu", max_prompt_tokens=100, kv_cache_entries=0, max_batch_rows=max_rows,
                        gather_ms=gather_ms, gather_rows=gather_rows,
                        queue_limit=64, served_name="fake", canvas_length=16, tiny=True, torch_threads=0,
                        cuda_graphs=False, torch_compile=False, fused_moe=False, prefill_chunk=runner.chunk)
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


def test_a_steady_client_waits_at_most_one_step_of_one_heavy_request_beside_them():
    """The heavy burst of the served bench, on the fake engine: a long prompt (26 chunks), a read of
    many canvases (4 passes), a multi-step read (8 steps) and a long thought (60 passes) take turns
    with a steady client's one-canvas reads, which each wait at most one step or pass of one of them
    (counted in engine turns, not wall time: a light read waiting goes before the next step), while
    all of them finish."""
    runner = FakeRunner(delay=0.004, passes=60)
    reader = make_reader(runner, max_rows=8)
    waits: list[int] = []

    async def steady() -> None:
        for tag in range(200, 215):
            before = len(runner.log)
            await reader.read([spec(tag)])
            waits.append(len(runner.log) - before - 1)  # turns of others between its arrival and its read

    async def scenario():
        await reader.start()
        heavy = [asyncio.create_task(reader.read([spec(1, tokens=26 * runner.chunk)])),
                 asyncio.create_task(reader.read([spec(2, canvases=4 * 8)])),
                 asyncio.create_task(reader.read([spec(3, canvases=2, steps=8)])),
                 asyncio.create_task(reader.generate(GenerateSpec(Prompt((4,)), 64, (), seed=4)))]
        await asyncio.sleep(0.02)  # the burst is in the queue and running
        await steady()
        results = await asyncio.gather(*heavy)
        await reader.stop()
        return results

    results = run(scenario())
    assert len(results[0]) == 1 and len(results[1][0].slots) == 32 and len(results[2][0].slots) == 2
    assert max(waits) <= 1, waits  # the step running when it came, and no other
    steps = [tag for kind, tag in runner.log if kind == "step"]
    assert steps.count(1) == 26 + 1 and steps.count(2) == 4 and steps.count(3) == 8  # 26 chunks, then its pass
    assert runner.stats["heavy_turns"] == 27 + 4 + 8
    # every turn is counted under its kind, with its time (the average turn is what a read waits)
    assert runner.stats["heavy_turn_count"] == 27 + 4 + 8
    assert runner.stats["read_turn_count"] == 15  # the steady client's reads, one batch each
    assert runner.stats["generation_turn_count"] == 60 + 1  # its prompt's encoding, then a pass a turn
    assert runner.stats["heavy_turn_ms"] >= 4 * (27 + 4 + 8) * 0.9  # the fake's passes take 4 ms
    assert runner.stats["read_turn_ms"] >= 4 * 15 * 0.9


def test_a_heavy_read_whose_caller_leaves_stops_at_its_next_step():
    runner = FakeRunner(delay=0.01)
    reader = make_reader(runner, max_rows=8)

    async def scenario():
        await reader.start()
        task = asyncio.create_task(reader.read([spec(7, tokens=100 * runner.chunk)]))
        await asyncio.sleep(0.1)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await asyncio.sleep(0.1)
        taken = len(runner.log)
        await asyncio.sleep(0.1)
        await reader.stop()
        return taken

    taken = run(scenario())
    assert len(runner.log) == taken < 100  # no step ran after the caller left


def test_out_of_memory_fails_only_the_batch_that_hit_it_as_a_503():
    import torch

    runner = FakeRunner(delay=0.01)
    reader = make_reader(runner)
    real = runner.read

    def read(specs, preprocessed=None):
        if specs[0].prompt.ids[0] == 66:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        return real(specs, preprocessed)

    runner.read = read

    async def scenario():
        await reader.start()
        with pytest.raises(EngineUnavailable, match="out of GPU memory"):
            await reader.read([spec(66)])
        after = await reader.read([spec(67)])  # the next read is served as before
        await reader.stop()
        return after

    assert len(run(scenario())) == 1
    assert runner.stats["out_of_memory"] == 1 and reader.degraded is None  # nothing degraded for others


def test_batches_are_shared_fairly_among_callers():
    """A decision of many reads (200 questions: 40 reads of 4 canvases) ahead of a steady client's
    one read: the steady read rides the first batch, not the eleventh; a lone caller's reads still
    fill whole batches."""
    from app.engine.base import current_caller

    runner = FakeRunner(delay=0.02)
    reader = make_reader(runner, max_rows=16)

    async def decision(caller: int, tags: range, canvases: int):
        current_caller.set(caller)  # as the web layer does around a decision (this task's own context)
        return await asyncio.gather(*(reader.read([spec(tag, canvases=canvases)]) for tag in tags))

    async def scenario():
        await reader.start()
        blocker = asyncio.create_task(reader.read([spec(999)]))  # a batch runs while the rest queue
        await asyncio.sleep(0.005)
        big = asyncio.create_task(decision(1, range(100, 140), 4))
        await asyncio.sleep(0.001)
        steady = asyncio.create_task(decision(2, range(7, 8), 1))
        await asyncio.gather(blocker, big, steady)
        lone = asyncio.create_task(decision(3, range(300, 340), 4))
        await lone
        await reader.stop()

    run(scenario())
    batches = [tags for kind, tags in runner.log if kind == "read"]
    where = next(number for number, tags in enumerate(batches) if 7 in tags)
    assert where <= 2, batches  # behind the running batch and at most the one formed with it
    lone = [tags for tags in batches if any(tag >= 300 for tag in tags)]
    assert len(lone) <= 11 and all(len(tags) == 4 for tags in lone[1:])  # full batches (the first may go alone)
    flat = [tag for tags in batches for tag in tags if 100 <= tag < 140]
    assert flat == sorted(flat)  # one caller's reads keep their order


def test_a_batch_encodes_at_most_one_chunk_of_long_prompts():
    """A decision of five reads over long prompts (each under PREFILL_CHUNK, all five far over it:
    the served bench's 200 questions, 1.8k tokens a group) queued with a steady client's short read:
    the steady read rides the first batch with one of them, never a batch that encodes all five,
    and the long reads keep their order over the batches they take."""
    from app.engine.base import current_caller

    runner = FakeRunner(delay=0.01, chunk=8)
    reader = make_reader(runner, max_rows=16)

    async def decision(caller: int, tags: range, tokens: int):
        current_caller.set(caller)
        return await asyncio.gather(*(reader.read([spec(tag, tokens=tokens)]) for tag in tags))

    async def scenario():
        await reader.start()
        blocker = asyncio.create_task(reader.read([spec(999)]))
        await asyncio.sleep(0.003)
        big = asyncio.create_task(decision(1, range(100, 105), 7))  # 7 of 8: light, long
        steady = asyncio.create_task(decision(2, range(7, 8), 1))
        await asyncio.gather(blocker, big, steady)
        await reader.stop()

    run(scenario())
    batches = [tags for kind, tags in runner.log if kind == "read"]
    assert batches[1:] == [[100, 7], [101], [102], [103], [104]], batches
    assert all(sum(1 for tag in tags if 100 <= tag < 105) <= 1 for tags in batches)


def test_the_gather_counts_light_reads_queued_behind_a_step():
    """Beside heavy work the light reads queue behind steps; the gather counts them all (the batch
    takes them from anywhere in the queue), so it ends once the last batch's callers are back
    instead of waiting its whole window every time."""
    runner = FakeRunner(delay=0.002)
    reader = make_reader(runner, max_rows=8, gather_ms=200)

    async def scenario():
        await reader.start()
        # two callers in one batch: the reader is busy, and the next gather wants 2 rows
        await asyncio.gather(reader.read([spec(1)]), reader.read([spec(2)]))
        heavy = asyncio.create_task(reader.read([spec(50, canvases=2, steps=40)]))
        await asyncio.sleep(0.01)  # its steps run
        started = time.perf_counter()
        first = asyncio.create_task(reader.read([spec(3)]))  # goes after the step running, then gathers
        await asyncio.sleep(0.008)  # a few steps on: queued behind the heavy read, back in line
        await asyncio.gather(first, reader.read([spec(4)]))
        waited = time.perf_counter() - started
        heavy.cancel()
        await reader.stop()
        return waited

    assert run(scenario()) < 0.15  # not the 200 ms window


@pytest.mark.parametrize("cap", [0, 2])
def test_batch_gather_rows_caps_what_the_gather_waits_for(cap):
    """BATCH_GATHER_ROWS: the gather ends once that many canvases are queued, even when the last
    batch had more (0: it waits for the last batch's count, here until its 200 ms window ends)."""
    runner = FakeRunner(delay=0.002)
    reader = make_reader(runner, max_rows=8, gather_ms=200, gather_rows=cap)

    async def scenario():
        await reader.start()
        # the last batch: two callers (busy, as under load), 4 canvases
        await asyncio.gather(reader.read([spec(1, canvases=2)]), reader.read([spec(11, canvases=2)]))
        started = time.perf_counter()
        first = asyncio.create_task(reader.read([spec(2)]))
        await asyncio.sleep(0.01)
        await asyncio.gather(first, reader.read([spec(3)]))
        waited = time.perf_counter() - started
        await reader.stop()
        return waited

    waited = run(scenario())
    assert (waited < 0.1) if cap else (waited > 0.19), waited


def test_at_debug_every_turn_and_gather_is_logged(caplog):
    """LOG_LEVEL=debug gives the scheduler's trace: each engine turn with its work, time, jobs, rows
    and what waits behind it, and each gather's wait; at INFO neither is logged."""
    import logging

    runner = FakeRunner(delay=0.002)
    reader = make_reader(runner, max_rows=8, gather_ms=5)

    async def scenario():
        await reader.start()
        await asyncio.gather(reader.read([spec(1)]), reader.read([spec(2)]))  # busy: the next batch gathers
        await reader.read([spec(3)])
        await reader.stop()

    with caplog.at_level(logging.INFO, logger="djev.engine"):
        run(scenario())
    assert not [r for r in caplog.records if r.levelno == logging.DEBUG]
    reader = make_reader(runner, max_rows=8, gather_ms=5)
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="djev.engine"):
        run(scenario())
    turns = [r.getMessage() for r in caplog.records if r.getMessage().startswith("engine turn:")]
    assert len(turns) == 2 and "a read batch" in turns[0] and "2 job(s), 2 row(s)" in turns[0], turns
    assert "queued after it: 0 light read(s) of 0 row(s), 0 heavy, 0 generation(s)" in turns[1]
    gathers = [r.getMessage() for r in caplog.records if r.getMessage().startswith("batch gather:")]
    assert len(gathers) == 1 and "1 of 2 wanted row(s)" in gathers[0], gathers


def test_a_turn_past_the_slow_bound_is_logged_and_counted(monkeypatch, caplog):
    import app.engine.hf.reader as reader_module

    monkeypatch.setattr(reader_module, "SLOW_TURN_S", 0.04)
    runner = FakeRunner(delay=0.06)
    runner.retries_a_read = 2  # the allocator freed its cache twice during the turn: the warning says so
    reader = make_reader(runner)

    async def scenario():
        await reader.start()
        await reader.read([spec(1)])
        await reader.stop()

    with caplog.at_level("WARNING", logger="djev.engine"):
        run(scenario())
    assert runner.stats["slow_turns"] == 1 and runner.stats["allocator_retries"] == 2
    assert any("an engine turn took" in r.message and "a read batch for 1 request" in r.message
               and "for memory 2 time(s), 2 after freeing its cache" in r.message for r in caplog.records)
    monkeypatch.setattr(reader_module, "SLOW_TURN_S", 10.0)
    runner = FakeRunner(delay=0.01)
    reader = make_reader(runner)
    run(scenario())
    assert runner.stats["slow_turns"] == 0


def test_the_collectors_full_passes_are_timed_while_the_reader_runs():
    import gc

    runner = FakeRunner()
    reader = make_reader(runner)

    async def scenario():
        await reader.start()
        gc.collect()
        gc.collect(1)  # a younger generation's pass is not counted
        await reader.stop()

    run(scenario())
    assert runner.stats["gc_full_passes"] == 1 and runner.stats["gc_full_ms"] >= 0
    gc.collect()  # after stop: no longer watched
    assert runner.stats["gc_full_passes"] == 1
