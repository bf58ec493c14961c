"""The flat turn where work goes wrong or does not fit, on the tiny model: a failed turn fails its own
reads alone and gives back every block they held; work is prepared when a turn reaches it, so a burst
of camera frames sends only the frames a turn takes through the vision tower; work wider than a turn is
refused at once (and settings under which it could be, at start); an image's blocks are keyed by its
bytes alone."""

from __future__ import annotations

import asyncio
import dataclasses
import threading

import pytest

from app.engine.base import EngineError, EngineInputError, ImageInput, Prompt, ReadSpec
from app.engine.hf.engine import Solo, budget_problem
from app.engine.hf.prompts import token_keys
from app.engine.hf.reads import ReadProgram
from tests.conftest import make_tiny_reader
from tests.engine.hf.media import jpeg
from tests.engine.hf.test_reader import spec_for

# About 1,500 tokens: more than a turn of BUDGET holds, so a read of it fills its first turn alone.
LONGER_STATE = " ".join(f"word{i % 97} and{i % 13}" for i in range(400))
BUDGET = 1024


def flat_reader(tiny_dir, **settings):
    settings.setdefault("turn_tokens", BUDGET)
    return make_tiny_reader(tiny_dir, **settings)


def image_spec(tokenizer, colour: tuple[int, int, int], canvas_token: int = 5) -> ReadSpec:
    image = ImageInput(jpeg(colour), "image/jpeg", f"frame {colour}")
    spec = spec_for(tokenizer, "unused", "q1: yes", [canvas_token])
    return dataclasses.replace(spec, prompt=Prompt(tuple(tokenizer.render_chat("Look.", "what?", 1, False)), (image,)))


def test_a_failed_turn_fails_its_own_read_releases_its_blocks_and_the_queued_read_is_answered(tiny_dir, tokenizer):
    reader = flat_reader(tiny_dir, prefill_chunk=2048)
    flat = reader.runner.flat
    forward = flat.turn.forward
    turns: list[int] = []
    started, queued = threading.Event(), threading.Event()

    def broken_first(layout, sequences, inputs):
        turns.append(layout.tokens)
        if len(turns) == 1:
            started.set()
            queued.wait(10)  # the short read is queued while this turn runs
            raise RuntimeError("the model fell over")
        return forward(layout, sequences, inputs)

    flat.turn.forward = broken_first
    long = spec_for(tokenizer, LONGER_STATE, "q1: yes", [42])
    short = spec_for(tokenizer, "short", "q1: yes", [5])
    assert len(long.prompt.ids) > BUDGET

    async def scenario():
        await reader.start()
        try:
            first = asyncio.create_task(reader.read([long]))
            await asyncio.get_running_loop().run_in_executor(None, started.wait, 10)
            second = asyncio.create_task(reader.read([short]))
            await asyncio.sleep(0.05)
            queued.set()
            return await asyncio.gather(first, second, return_exceptions=True)
        finally:
            await reader.stop()

    failed, answered = asyncio.run(scenario())
    assert isinstance(failed, EngineError) and "the model fell over" in str(failed)
    assert not isinstance(answered, BaseException) and len(answered[0].slots) == 1  # queued behind: not failed
    assert turns[0] == BUDGET  # the long read's first chunk filled the failed turn alone
    assert flat.store.stats["blocks_used"] == 0  # the failed read's blocks went back to the store


def test_a_failed_turn_releases_a_program_and_the_next_turn_answers(tiny_dir, tokenizer):
    runner = flat_reader(tiny_dir).runner
    flat = runner.flat
    forward = flat.turn.forward
    flat.turn.forward = lambda *args: (_ for _ in ()).throw(RuntimeError("boom"))
    doomed = ReadProgram(runner, [spec_for(tokenizer, "doomed", "q1: yes", [5])], None)
    with pytest.raises(Exception, match="boom") as failure:
        flat.step([Solo(doomed)])
    assert [entry.work for entry in failure.value.entries] == [doomed]
    assert flat.store.stats["blocks_used"] == 0
    flat.turn.forward = forward
    assert len(runner.read([spec_for(tokenizer, "doomed", "q1: yes", [5])])[0].slots) == 1


def test_work_is_prepared_only_when_a_turn_reaches_it(tiny_dir, tokenizer):
    runner = flat_reader(tiny_dir, prefill_chunk=2048).runner
    programs = [ReadProgram(runner, [spec_for(tokenizer, f"{n} {LONGER_STATE}", "q1: yes", [5])], None)
                for n in range(3)]
    runner.flat.step([Solo(program) for program in programs])
    assert [program.prepared for program in programs] == [True, False, False]  # the first filled the turn
    used = runner.flat.store.stats["blocks_used"]
    assert 0 < used <= -(-BUDGET // runner.flat.store.block_tokens) * 2  # its first chunk's blocks alone


def test_a_burst_of_frames_sends_only_the_frames_a_turn_takes_through_the_vision_tower(tiny_dir, tokenizer):
    runner = flat_reader(tiny_dir).runner
    seen: list[int] = []
    features = runner.images.image_features

    def counted(expanded, digests):
        seen.append(len(expanded))
        return features(expanded, digests)

    runner.images.image_features = counted
    frames = [ReadProgram(runner, [image_spec(tokenizer, (10 * n, 200, 30))], None) for n in range(30)]
    report = runner.flat.step([Solo(program) for program in frames])
    taken = len(report.ran)
    assert 0 < taken < len(frames)  # a turn holds some of the burst
    embedded = sum(1 for program in frames if program.states and any(
        state.embeds is not None for state in program.states.values()))
    assert 0 < embedded <= taken
    assert seen == [embedded]  # the images the turn took, together in one call; none of the frames left waiting
    assert sum(program.prepared for program in frames) <= taken + 1  # the walk stops once the turn is full
    while not all(program.done for program in frames):
        runner.flat.step([Solo(program) for program in frames if not program.done])
    assert sum(seen) == len(frames)  # each frame through the tower once


def test_a_frame_whose_kv_is_stored_skips_the_vision_tower(tiny_dir, tokenizer):
    runner = flat_reader(tiny_dir).runner
    spec = image_spec(tokenizer, (1, 2, 250))
    first = runner.read([spec])[0]
    runner.images.features.clear()  # the features forgotten: only the KV store can spare the tower now
    before = runner.stats["vision_passes"]
    again = runner.read([dataclasses.replace(spec, seed=spec.seed + 1)])[0]
    assert runner.stats["vision_passes"] == before
    assert first.prompt_tokens == again.prompt_tokens


def test_a_canvas_wider_than_a_turn_is_refused_at_once_naming_turn_tokens(tiny_dir, tokenizer):
    reader = flat_reader(tiny_dir)
    wide = dataclasses.replace(spec_for(tokenizer, "wide", "q1: yes", [5]), canvases=((5,) * (BUDGET + 1),))

    async def scenario():
        await reader.start()
        try:
            with pytest.raises(EngineInputError, match="TURN_TOKENS 1024") as refused:
                await asyncio.wait_for(reader.read([wide]), timeout=5)
            return refused.value
        finally:
            await reader.stop()

    refused = asyncio.run(scenario())
    assert refused.status == 400 and "1025 tokens" in str(refused)
    assert reader.runner.stats["flat_turns"] == 0 and reader.images_held == 0


def test_settings_where_a_canvas_beside_an_image_cannot_fit_a_turn_are_refused_at_start(tiny_dir):
    assert budget_problem(1024, 128, 280) is None
    problem = budget_problem(1024, 900, 280)
    assert problem is not None and "TURN_TOKENS 1024" in problem and "CANVAS 900" in problem and "1180" in problem
    with pytest.raises(ValueError, match="set TURN_TOKENS to at least"):
        make_tiny_reader(tiny_dir, turn_tokens=1024, canvas=1000)


def test_min_turn_tokens_is_one_constant_the_settings_check():
    from app.config import MIN_TURN_TOKENS, Settings

    with pytest.raises(ValueError, match=f"TURN_TOKENS must be at least {MIN_TURN_TOKENS}"):
        Settings.of(turn_tokens=MIN_TURN_TOKENS - 1)
    assert Settings.of(turn_tokens=MIN_TURN_TOKENS).hf.turn_tokens == MIN_TURN_TOKENS


def test_every_image_is_keyed_by_its_digest_and_no_run_goes_without_one():
    image = 7
    ids = [1, image, image, 2, image, image, image, 3]
    keys, runs = token_keys(ids, ("a", "b"), image)
    assert runs == [(1, 3), (4, 7)]
    assert keys == [1, ("a", 0), ("a", 1), 2, ("b", 0), ("b", 1), ("b", 2), 3]
    other, _ = token_keys(ids, ("a", "c"), image)
    assert other[:4] == keys[:4] and other[4:7] != keys[4:7]  # another second image shares only the first's keys
    with pytest.raises(EngineInputError, match="more runs of image tokens than its 1 image"):
        token_keys(ids, ("a",), image)


def test_two_different_images_never_share_blocks(tiny_dir, tokenizer):
    runner = flat_reader(tiny_dir).runner
    red, blue = image_spec(tokenizer, (250, 0, 0)), image_spec(tokenizer, (0, 0, 250))
    runner.read([red])
    hits = runner.flat.store.stats["hit_tokens"]
    runner.read([blue])
    shared = runner.flat.store.stats["hit_tokens"] - hits
    first_image = next(position for position, token in enumerate(red.prompt.ids) if token == runner.image_token_id)
    assert shared <= first_image  # at most the text before the image: none of its soft tokens' blocks
