"""The hf reader's flat turns, on the tiny model: every turn one forward within
TURN_TOKENS, a steady read riding the turns of a long prompt or a big decision, a caller's half of a
turn, a dropped read's blocks released, a read the KV store cannot hold failing alone with a 503, a
failed turn failing only its own jobs, and generations streamed a pass a turn."""

from __future__ import annotations

import asyncio

import pytest

from app.engine.base import EngineError, EngineInputError, EngineUnavailable, GenerateSpec, Prompt, current_caller, new_caller
from app.engine.hf.layout import Kind
from tests.conftest import make_tiny_reader
from tests.engine.hf.test_reader import spec_for

LONG_STATE = " ".join(f"word{i % 97} and{i % 13}" for i in range(120))
BUDGET = 1024


def flat_reader(tiny_dir, **settings):
    settings.setdefault("turn_tokens", BUDGET)
    reader = make_tiny_reader(tiny_dir, **settings)
    turns: list[int] = []
    run = reader.runner.flat.turn.run

    def counted(parts):
        turns.append(sum(part.tokens for part in parts))
        return run(parts)

    reader.runner.flat.turn.run = counted
    return reader, turns


def many_canvases(tokenizer, n: int, tag: str):
    return [spec_for(tokenizer, f"{tag} {k}", "q1: yes", [5 + k % 7]) for k in range(n)]


def test_no_turn_takes_more_than_the_budget_and_every_read_is_answered(tiny_dir, tokenizer):
    reader, turns = flat_reader(tiny_dir, prefill_chunk=256)
    long = spec_for(tokenizer, LONG_STATE, "q1: yes", [42, 7])
    big = many_canvases(tokenizer, 60, "big")  # 60 prompts and canvases: more than a turn holds

    async def scenario():
        await reader.start()
        try:
            return await asyncio.gather(reader.read([long]), reader.read(big))
        finally:
            await reader.stop()

    long_result, big_results = asyncio.run(scenario())
    assert len(long_result[0].slots) == 2 and len(big_results) == 60
    assert max(turns) <= BUDGET and len(turns) > 2
    assert reader.stats["flat_turn_count"] == len(turns)


def test_a_short_read_rides_the_turns_of_a_long_prompt(tiny_dir, tokenizer):
    reader, turns = flat_reader(tiny_dir, prefill_chunk=48)
    canvases: list[set[tuple[int, ...]]] = []  # each turn's canvases
    run = reader.runner.flat.turn.run

    def seen(parts):
        canvases.append({tuple(part.ids) for part in parts if part.kind is Kind.CANVAS})
        return run(parts)

    reader.runner.flat.turn.run = seen
    long = spec_for(tokenizer, LONG_STATE, "q1: yes", [42, 7])
    chunks = -(-len(long.prompt.ids) // 48)
    order: list[str] = []
    waited: list[int] = []  # turns from a short read's arrival to the turn that read its canvas

    async def scenario():
        await reader.start()
        try:
            task = asyncio.create_task(reader.read([long]))
            task.add_done_callback(lambda _: order.append("long"))
            await asyncio.sleep(0)  # queued first
            for n in range(3):
                short = spec_for(tokenizer, f"short {n}", "q1: yes", [50 + n])
                arrived = len(canvases)
                await reader.read([short])
                waited.append(next(i for i, turn in enumerate(canvases) if short.canvases[0] in turn) - arrived)
                order.append(f"short {n}")
            await task
        finally:
            await reader.stop()

    asyncio.run(scenario())
    assert order == ["short 0", "short 1", "short 2", "long"]
    # Each short read rode the turn after the one running when it came, and added no turn of its own:
    # there were no more turns than the long prompt's chunks (its canvases rode its last chunk; a turn
    # a short read shared may take two chunks, the second walk offering the room the read left).
    assert max(waited) <= 1 and len(canvases) <= chunks


def test_one_caller_takes_at_most_half_a_turn_while_another_waits(tiny_dir, tokenizer):
    reader, turns = flat_reader(tiny_dir)
    big = many_canvases(tokenizer, 80, "decision")
    steady = spec_for(tokenizer, "steady", "q1: yes", [5])

    async def as_caller(specs):
        current_caller.set(new_caller())
        return await reader.read(specs)

    async def scenario():
        await reader.start()
        try:
            heavy = asyncio.create_task(as_caller(big))
            await asyncio.sleep(0)
            await as_caller([steady])
            turns_when_steady_done = len(turns)
            await heavy
            return turns_when_steady_done
        finally:
            await reader.stop()

    assert asyncio.run(scenario()) == 1  # the steady read shared the decision's first turn
    assert len(turns) >= 2


def test_a_dropped_read_releases_its_blocks(tiny_dir, tokenizer):
    reader, turns = flat_reader(tiny_dir, prefill_chunk=48)
    long = spec_for(tokenizer, LONG_STATE, "q1: yes", [42])
    store = reader.runner.flat.store

    async def scenario():
        await reader.start()
        try:
            task = asyncio.create_task(reader.read([long]))
            while len(turns) < 2:
                await asyncio.sleep(0.01)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            (after,) = await reader.read([spec_for(tokenizer, "after", "q1: yes", [5])])  # the turn that drops it
            return after
        finally:
            await reader.stop()

    after = asyncio.run(scenario())
    assert len(after.slots) == 1
    assert store.stats["blocks_used"] == 0  # nothing still referenced: the long prompt's blocks released


def test_a_read_the_store_cannot_hold_fails_alone_with_a_503(tiny_dir, tokenizer, caplog):
    from app.engine.hf.sizing import floor_blocks

    # A store of a turn's floor plus one longest state (MAX_PROMPT_TOKENS 800): each long state fits it
    # alone, four at once do not.
    sizes = flat_reader(tiny_dir)[0].runner.flat.store.stats
    floor = floor_blocks(BUDGET, 64, 16)  # the tiny model's window is 64 tokens
    store = floor * (sizes["full_block_bytes"] + sizes["sliding_block_bytes"]) + 50 * sizes["full_block_bytes"]
    reader, _ = flat_reader(tiny_dir, prompt_cache_gb=store / 2**30, prefill_chunk=48, max_prompt_tokens=800)
    assert reader.runner.max_prompt_tokens == 800
    longs = [spec_for(tokenizer, f"{n} {LONG_STATE}", "q1: yes", [42]) for n in range(4)]
    assert all(len(spec.prompt.ids) * 4 > (floor + 50) * 16 for spec in longs)

    async def scenario():
        await reader.start()
        try:
            return await asyncio.gather(*(reader.read([spec]) for spec in longs), return_exceptions=True)
        finally:
            await reader.stop()

    outcomes = asyncio.run(scenario())
    failed = [outcome for outcome in outcomes if isinstance(outcome, BaseException)]
    assert failed and all(isinstance(f, EngineUnavailable) and "KV store is full" in str(f) for f in failed)
    assert len(failed) < len(longs)  # the others were answered
    assert reader.runner.flat.store.stats["store_full"] >= 1
    assert reader.runner.stats["flat_store_full"] == reader.runner.flat.store.stats["store_full"]  # /metrics
    assert any("KV store had no room" in record.getMessage() for record in caplog.records)
    assert reader.runner.flat.store.stats["blocks_used"] == 0


def test_a_state_past_what_the_store_holds_is_refused_at_once_with_both_numbers(tiny_dir, tokenizer):
    reader, turns = flat_reader(tiny_dir, max_prompt_tokens=200)
    long = spec_for(tokenizer, LONG_STATE, "q1: yes", [42])

    async def scenario():
        await reader.start()
        try:
            with pytest.raises(EngineInputError) as refused:
                await reader.read([long])
            return refused.value
        finally:
            await reader.stop()

    refused = asyncio.run(scenario())
    assert refused.status == 400 and refused.error_type == "max_tokens_exceeded"  # Jev's context error
    assert f"is {len(long.prompt.ids)} tokens" in str(refused) and "at most 200" in str(refused)
    assert not turns  # refused before it was queued


def test_a_failed_turn_fails_its_jobs_and_the_next_turn_runs(tiny_dir, tokenizer):
    reader, _ = flat_reader(tiny_dir)
    forward = reader.runner.flat.forward
    calls = []

    def broken_once(*args):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("the model fell over")
        return forward(*args)

    reader.runner.flat.turn.forward = broken_once

    async def scenario():
        await reader.start()
        try:
            with pytest.raises(EngineError, match="the model fell over"):
                await reader.read([spec_for(tokenizer, "first", "q1: yes", [5])])
            return await reader.read([spec_for(tokenizer, "second", "q1: yes", [5])])
        finally:
            await reader.stop()

    (second,) = asyncio.run(scenario())
    assert len(second.slots) == 1


def test_a_generation_streams_a_pass_a_turn_beside_reads(tiny_dir, tokenizer):
    reader, turns = flat_reader(tiny_dir, prefill_chunk=48)
    prompt = Prompt(tuple(tokenizer.render_chat("Think.", LONG_STATE, 0, thinking=True)))
    spec = GenerateSpec(prompt, 20, (), seed=3, temperature=0.0)
    expected = make_tiny_reader(tiny_dir).runner.generate(spec, 128)

    async def scenario():
        await reader.start()
        try:
            chunks = []
            stream = reader.stream(spec)
            read = asyncio.create_task(reader.read([spec_for(tokenizer, "beside", "q1: yes", [5])]))
            async for chunk in stream:
                chunks.append(chunk)
            await read
            return chunks, read.done()
        finally:
            await reader.stop()

    chunks, read_done = asyncio.run(scenario())
    assert read_done and chunks[-1].done
    assert tuple(token for chunk in chunks for token in chunk.ids) == expected.ids
    assert max(turns) <= BUDGET


def test_images_are_preprocessed_off_the_engine_thread(tiny_dir, tokenizer):
    import dataclasses
    import threading

    from app.engine.base import ImageInput
    from tests.engine.hf.media import jpeg

    reader, _ = flat_reader(tiny_dir)
    runner = reader.runner
    processor, threads = runner.images.processor, []

    def recorded(*args, **kwargs):
        threads.append(threading.current_thread().name)
        return processor(*args, **kwargs)

    runner.images.processor = recorded
    image = ImageInput(jpeg((200, 10, 10)), "image/jpeg", "frame")
    spec = dataclasses.replace(spec_for(tokenizer, "unused", "q1: yes", [5]),
                               prompt=Prompt(tuple(tokenizer.render_chat("Look.", "what?", 1, False)), (image,)))

    async def scenario():
        await reader.start()
        try:
            return await reader.read([spec])
        finally:
            await reader.stop()

    (result,) = asyncio.run(scenario())
    assert result.prompt_tokens > len(spec.prompt.ids)  # the soft tokens expanded
    assert threads and all(name.startswith("djev-images") for name in threads)
    assert runner.stats["images_preprocessed_inline"] == 0 and reader.images_held == 0


def test_the_turn_budget_is_turn_tokens_or_by_the_device(tiny_dir):
    from app.engine.hf.loader import CPU_TURN_TOKENS, CUDA_TURN_TOKENS, turn_tokens

    assert turn_tokens(0, on_cuda=True) == CUDA_TURN_TOKENS == 4096
    assert turn_tokens(0, on_cuda=False) == CPU_TURN_TOKENS == 2048
    assert turn_tokens(4096, on_cuda=False) == 4096
    assert make_tiny_reader(tiny_dir).runner.flat.budget == CPU_TURN_TOKENS
    assert make_tiny_reader(tiny_dir, turn_tokens=3000).runner.flat.budget == 3000


def test_the_vision_tower_keeps_its_graphs_by_frame_count_and_reads_as_the_library(tiny_dir, tokenizer):
    """The vision tower's graphs (by frame count, beside the flat turn's own by token count, which only
    CUDA captures), their static-buffer path run eagerly on the CPU: one graph per image bucket from a
    sample frame, and three frames padded into the 4-image bucket read what the library's tower reads."""
    import dataclasses

    from app.engine.base import ImageInput
    from app.engine.hf.compiled import sample_image_prompt
    from app.engine.hf.graphs.vision import IMAGE_BUCKETS
    from tests.engine.hf.media import jpeg

    runner = make_tiny_reader(tiny_dir).runner
    assert runner.images.graphs is None and runner.flat.forward.graphs is None  # the CPU server: no graphs
    runner.use_vision_graphs(capture=False)
    assert runner.images.graphs is not None and runner.flat.forward.graphs is None
    assert runner.prepare_vision_graphs(sample_image_prompt(runner)) == len(IMAGE_BUCKETS)
    assert len(runner.images.features) == 0  # the sample frame's features are not kept
    frames = tuple(ImageInput(jpeg(colour), "image/jpeg", f"frame {n}")
                   for n, colour in enumerate([(200, 10, 10), (10, 200, 10), (10, 10, 200)]))
    spec = dataclasses.replace(spec_for(tokenizer, "unused", "q1: yes", [5, 9]),
                               prompt=Prompt(tuple(tokenizer.render_chat("Look.", "ahead?", 3, False)), frames))
    (graphed,) = runner.read([spec])
    assert runner.stats["vision_graph_replays"] == runner.stats["vision_passes"] == 1
    library = make_tiny_reader(tiny_dir).runner
    (expected,) = library.read([spec])
    assert library.stats["vision_graph_replays"] == 0 and library.stats["vision_passes"] == 1
    assert graphed.prompt_tokens == expected.prompt_tokens > len(spec.prompt.ids)
    for canvas_a, canvas_b in zip(graphed.slots, expected.slots, strict=True):
        for slot_a, slot_b in zip(canvas_a, canvas_b, strict=True):
            assert slot_a.argmax_id == slot_b.argmax_id
            assert slot_a.label_logprobs == pytest.approx(slot_b.label_logprobs, abs=1e-4)


def test_a_turns_reads_go_through_the_unembedding_once_for_every_program(tiny_dir, tokenizer):
    from app.engine.hf.engine import Solo
    from app.engine.hf.reads import ReadProgram

    reader, _ = flat_reader(tiny_dir)
    runner = reader.runner
    alone = [runner.read([spec])[0] for spec in many_canvases(tokenizer, 4, "apart")]
    calls: list[int] = []
    read = runner.slot_reads_at

    def counted(hidden, labels):
        calls.append(len(labels))
        return read(hidden, labels)

    runner.slot_reads_at = counted
    programs = [ReadProgram(runner, [spec], None) for spec in many_canvases(tokenizer, 4, "apart")]
    while not all(program.done for program in programs):
        runner.flat.step([Solo(program) for program in programs])
    assert calls == [4]  # one call, the 4 programs' slots together
    for program, want in zip(programs, alone):
        got = program.results[0]
        assert not isinstance(got, Exception) and got is not None and not isinstance(want, Exception)
        assert [p for slot in got.slots[0] for p in slot.label_logprobs] == pytest.approx(
            [p for slot in want.slots[0] for p in slot.label_logprobs], abs=1e-5)
