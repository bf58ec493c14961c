"""Images in the hf engine are decoded and run through the image processor in image workers before
their job is queued, never on the engine thread; the reads equal the inline path a direct runner
call takes, a broken image still fails only its own read with the same 422, cached features skip
preprocessing altogether, nothing preprocessed outlives its job, and a walk frame's later stages
take the sheet and the frame from the KV store instead of reading them again."""

from __future__ import annotations

import asyncio
import dataclasses
import re
import threading

import pytest

from app.engine.base import EngineInputError, GenerateSpec, ImageInput, Prompt, ReadSpec
from tests.conftest import make_tiny_reader
from tests.engine.hf.media import jpeg
from tests.engine.hf.test_reader import spec_for


class ThreadRecorder:
    """Wraps a callable and records the name of every thread that calls it."""

    def __init__(self, wrapped) -> None:
        self.wrapped = wrapped
        self.threads: list[str] = []

    def __call__(self, *args, **kwargs):
        self.threads.append(threading.current_thread().name)
        return self.wrapped(*args, **kwargs)


def recorded(reader):
    """The reader with its image processor and its engine turns (`FlatEngine.step`, which the reader
    runs on the engine thread) recorded."""
    runner = reader.runner
    runner.images.processor = ThreadRecorder(runner.images.processor)
    runner.flat.step = ThreadRecorder(runner.flat.step)
    return reader


def frame(colour: tuple[int, int, int], source: str) -> ImageInput:
    return ImageInput(jpeg(colour), "image/jpeg", source)


def image_spec(tokenizer, question: str, image: ImageInput, noise: list[int]) -> ReadSpec:
    prompt = Prompt(tuple(tokenizer.render_chat("Look.", question, 1, False)), (image,))
    return dataclasses.replace(spec_for(tokenizer, "unused", "q1: yes", noise), prompt=prompt)


def run_started(reader, scenario):
    async def main():
        await reader.start()
        try:
            return await scenario()
        finally:
            await reader.stop()

    return asyncio.run(main())


def assert_same_reads(a, b):
    assert a.prompt_tokens == b.prompt_tokens
    for canvas_a, canvas_b in zip(a.slots, b.slots, strict=True):
        for slot_a, slot_b in zip(canvas_a, canvas_b, strict=True):
            assert slot_a.argmax_id == slot_b.argmax_id
            assert slot_a.label_logprobs == pytest.approx(slot_b.label_logprobs, abs=1e-5)


def test_images_are_preprocessed_off_the_engine_thread_and_read_as_inline(tiny_dir, tokenizer):
    reader = recorded(make_tiny_reader(tiny_dir))
    specs = [image_spec(tokenizer, "what is ahead?", frame((200, 10, 10), "frame 0"), [5, 77]),
             image_spec(tokenizer, "what is ahead?", frame((10, 10, 200), "frame 1"), [9]),
             spec_for(tokenizer, "a text state", "q1: yes", [3])]

    async def scenario():
        return await reader.read(specs)

    through_reader = run_started(reader, scenario)
    runner = reader.runner
    engine_threads = set(runner.flat.step.threads)
    assert engine_threads and all(name.startswith("djev-engine") for name in engine_threads)
    assert len(runner.images.processor.threads) == 2  # one call per image set
    assert all(name.startswith("djev-images") for name in runner.images.processor.threads)
    assert runner.stats["images_preprocessed"] == 2 and runner.stats["images_preprocessed_inline"] == 0
    assert reader.images_held == 0  # nothing preprocessed outlives its job

    # A direct runner call (bench scripts, tests) still decodes inline, on its own thread.
    inline = make_tiny_reader(tiny_dir).runner
    inline.images.processor = ThreadRecorder(inline.images.processor)
    direct = inline.read(specs)
    assert inline.images.processor.threads == [threading.current_thread().name] * 2
    assert inline.stats["images_preprocessed_inline"] == 2
    assert through_reader[0].prompt_tokens > len(specs[0].prompt.ids)  # soft tokens expanded
    for a, b in zip(through_reader, direct, strict=True):
        assert_same_reads(a, b)


def test_an_image_generation_is_preprocessed_off_the_engine_thread(tiny_dir, tokenizer):
    reader = recorded(make_tiny_reader(tiny_dir))
    prompt = Prompt(tuple(tokenizer.render_chat("Look.", "describe it", 1, False)), (frame((30, 200, 30), "frame"),))
    spec = GenerateSpec(prompt, 16, (), seed=1, temperature=0.0)

    async def scenario():
        return await reader.generate(spec)

    generated = run_started(reader, scenario)
    runner = reader.runner
    assert runner.flat.step.threads and all(n.startswith("djev-engine") for n in runner.flat.step.threads)
    assert len(runner.images.processor.threads) == 1
    assert runner.images.processor.threads[0].startswith("djev-images")
    assert runner.stats["images_preprocessed_inline"] == 0 and reader.images_held == 0
    inline = make_tiny_reader(tiny_dir).runner.generate(spec, reader.info.canvas_length)
    assert generated.ids == inline.ids and generated.prompt_tokens == inline.prompt_tokens > len(prompt.ids)


def test_a_broken_image_fails_only_its_own_read_with_the_same_error(tiny_dir, tokenizer):
    reader = recorded(make_tiny_reader(tiny_dir))
    good = image_spec(tokenizer, "what is ahead?", frame((200, 10, 10), "frame 0"), [5])
    bad = image_spec(tokenizer, "what is ahead?", ImageInput(b"\xff\xd8 not really a jpeg", "image/jpeg", "frame 7"),
                     [5])
    other = image_spec(tokenizer, "what is ahead?", frame((10, 10, 200), "frame 1"), [9])

    async def scenario():
        return await asyncio.gather(reader.read([good, bad]), reader.read([other]), return_exceptions=True)

    failed, fine = run_started(reader, scenario)
    assert isinstance(failed, EngineInputError)
    assert failed.status == 422 and failed.param == "frame 7"
    assert str(failed).startswith("frame 7: not a decodable image")
    assert not isinstance(fine, BaseException) and len(fine) == 1
    # All three sets were preprocessed in the workers; the error was raised on the engine thread.
    assert reader.runner.stats["images_preprocessed"] == 3 and reader.runner.stats["images_preprocessed_inline"] == 0

    # The inline path: per spec, the same error for the broken image only.
    direct = make_tiny_reader(tiny_dir).runner.read([good, bad])
    assert not isinstance(direct[0], Exception) and isinstance(direct[1], EngineInputError)
    assert direct[1].param == failed.param and direct[1].status == failed.status
    assert re.sub(" at 0x[0-9a-f]+", "", str(direct[1])) == re.sub(" at 0x[0-9a-f]+", "", str(failed))  # PIL names its buffer


def test_a_model_without_an_image_processor_refuses_images_as_before(tiny_dir, tokenizer):
    reader = make_tiny_reader(tiny_dir)
    reader.runner.image_processor = reader.runner.images.processor = None
    spec = image_spec(tokenizer, "what is ahead?", frame((200, 10, 10), "frame 0"), [5])

    async def scenario():
        return await asyncio.gather(reader.read([spec]), reader.read([spec_for(tokenizer, "text", "q1: yes", [3])]),
                                    return_exceptions=True)

    refused, text = run_started(reader, scenario)
    assert isinstance(refused, EngineInputError) and refused.status == 422 and refused.param == "images"
    assert str(refused) == "this model has no image processor"
    assert not isinstance(text, BaseException)


def test_cached_features_and_cached_prompts_skip_preprocessing(tiny_dir, tokenizer):
    reader = recorded(make_tiny_reader(tiny_dir))
    image = frame((30, 200, 30), "frame")
    first = image_spec(tokenizer, "what is ahead?", image, [5])
    restated = image_spec(tokenizer, "ahead: wall. which side?", image, [5])  # a later stage, same frame

    async def scenario():
        await reader.read([first])
        processed = len(reader.runner.images.processor.threads)
        await reader.read([restated])  # vision-LRU hit: neither decoded nor processed
        await reader.read([first])  # KV hit: its features from the LRU, the tower never runs
        return processed

    processed = run_started(reader, scenario)
    runner = reader.runner
    assert processed == 1 and len(runner.images.processor.threads) == 1
    assert runner.stats["images_preprocessed"] == 1 and runner.stats["images_preprocessed_inline"] == 0
    assert runner.stats["vision_hits"] == 2 and runner.stats["vision_passes"] == 1 and runner.stats["kv_hits"] == 1


def test_past_the_budget_the_engine_thread_decodes_and_reads_the_same(tiny_dir, tokenizer):
    reader = recorded(make_tiny_reader(tiny_dir))
    reader.image_budget = 0
    spec = image_spec(tokenizer, "what is ahead?", frame((200, 10, 10), "frame 0"), [5, 77])

    async def scenario():
        return await reader.read([spec])

    (result,) = run_started(reader, scenario)
    runner = reader.runner
    assert runner.stats["images_preprocessed"] == 0 and runner.stats["images_preprocessed_inline"] == 1
    assert len(runner.images.processor.threads) == 1
    assert set(runner.images.processor.threads) == set(runner.flat.step.threads)  # the engine thread, as before
    (direct,) = make_tiny_reader(tiny_dir).runner.read([spec])
    assert_same_reads(result, direct)


def test_a_cancelled_read_gives_its_preprocessed_images_back(tiny_dir, tokenizer):
    reader = make_tiny_reader(tiny_dir)
    runner = reader.runner
    started, release = threading.Event(), threading.Event()
    plain_step = runner.flat.step

    def held_step(jobs):
        started.set()
        release.wait(10)  # hold the engine thread so the next read waits in the queue
        return plain_step(jobs)

    runner.flat.step = held_step
    blocker = spec_for(tokenizer, "hold the engine", "q1: yes", [1])
    queued = image_spec(tokenizer, "what is ahead?", frame((200, 10, 10), "frame 0"), [5])

    async def scenario():
        first = asyncio.create_task(reader.read([blocker]))
        await asyncio.to_thread(started.wait, 10)
        second = asyncio.create_task(reader.read([queued]))
        for _ in range(500):  # until it is preprocessed and queued behind the blocker
            if runner.stats["images_preprocessed"]:
                break
            await asyncio.sleep(0.01)
        held = reader.images_held
        second.cancel()
        release.set()
        await first
        for _ in range(100):  # the loop drops the cancelled read at its turn
            if not reader.stats["queue_depth"]:
                break
            await asyncio.sleep(0.01)
        return held, second.cancelled()

    held, cancelled = run_started(reader, scenario)
    assert held == 1 and cancelled
    assert reader.images_held == 0
    assert runner.stats["vision_passes"] == 0  # the cancelled read never ran


SHEET = "Question q1: Is the way ahead clear?\n  yes\n  no\n\nQuestion q2: Which side is the obstacle on?\n  A: left\n  B: right"


def frame_prompts(tokenizer, colour=(90, 160, 40)):
    """A walk frame's two stages: the same sheet and frame, the second with the first's answer restated."""
    from app.decisions.prompt import restated_state

    image = (ImageInput(jpeg(colour), "image/jpeg", "frame"),)
    first = Prompt(tuple(tokenizer.render_chat(SHEET, "Walking forward.", 1, False)), image)
    second = Prompt(tuple(tokenizer.render_chat(SHEET, restated_state("Walking forward.", ["q1: no"]), 1, False)),
                    image)
    return first, second


def read_of(tokenizer, prompt: Prompt, noise: tuple[int, ...] = (5,)) -> ReadSpec:
    return dataclasses.replace(spec_for(tokenizer, "unused", "q1: yes", list(noise)), prompt=prompt)


def frame_end(runner, prompt: Prompt) -> int:
    """Where the prompt's last image ends among its ids as the model reads them (soft tokens expanded)."""
    ids = runner.images.model_inputs(prompt)["input_ids"][0].tolist()
    return max(position for position, token in enumerate(ids) if token == runner.image_token_id) + 1


def whole_blocks(runner, tokens: int) -> int:
    """The tokens of the KV store's whole blocks among the first `tokens` (what a prefix can share)."""
    size = runner.flat.store.block_tokens
    return tokens // size * size


def test_a_restated_stage_takes_the_first_stages_sheet_and_frame_from_the_store_and_reads_the_same(tiny_dir, tokenizer):
    """The gated second stage of a walk frame: the sheet and the frame (every KV block before the
    restated answers) come from the KV store, neither the vision tower nor the frame's tokens run
    again, and it reads what the prompt read whole reads; another frame shares none of the first's."""
    first, second = frame_prompts(tokenizer)
    fresh = make_tiny_reader(tiny_dir).runner
    shared = whole_blocks(fresh, frame_end(fresh, second))
    assert shared > int(fresh.text_config.sliding_window)  # past the tiny model's window: its sliding blocks too
    (whole,) = fresh.read([read_of(tokenizer, second)])
    runner = make_tiny_reader(tiny_dir).runner
    store = runner.flat.store
    runner.read([read_of(tokenizer, first)])
    hits, passes = store.stats["hit_tokens"], runner.stats["vision_passes"]
    (reused,) = runner.read([read_of(tokenizer, second)])
    assert store.stats["hit_tokens"] - hits >= shared
    assert runner.stats["vision_passes"] == passes  # the frame's features reused
    assert_same_reads(whole, reused)
    other = frame_prompts(tokenizer, colour=(10, 10, 200))[1]  # another frame: at most the text before it shared
    hits = store.stats["hit_tokens"]
    runner.read([read_of(tokenizer, other)])
    assert store.stats["hit_tokens"] - hits < shared
    assert runner.stats["vision_passes"] == passes + 1


def test_a_walk_decisions_gated_stage_reuses_the_frames_prompt(tiny_dir):
    from app import build
    from app.config import Settings
    from app.decisions.request import parse_decision
    from app.decisions.run import Decider
    from tests.conftest import LIMITS

    reader = make_tiny_reader(tiny_dir)
    runner = reader.runner
    prompts: list[Prompt] = []  # every read's prompt, in the order the turns took them
    step = runner.flat.step

    def noted(jobs):
        for job in jobs:
            prompts.extend(spec.prompt for spec in getattr(job, "specs", ()) if spec.prompt not in prompts)
        return step(jobs)

    runner.flat.step = noted
    body = {"state": "Walking forward.", "samples": 1,
            "questions": {"clear": {"type": "noul", "instructions": "Is the way ahead clear?"},
                          "side": {"type": "choice", "instructions": "Which side is the obstacle on?",
                                   "criteria": {"left": None, "right": None}, "ask_if": {"clear": ["yes", "no"]}}}}
    image = ImageInput(jpeg((200, 120, 30)), "image/jpeg", "frame")

    async def go():
        await reader.start()
        try:
            decider = Decider(reader, build.read_settings(Settings.of(canvas=64)))
            return await decider.decide(parse_decision(body, LIMITS, images=[image]))
        finally:
            await reader.stop()

    outcome = asyncio.run(go())
    assert outcome.diagnostics["stages"] == [["clear"], ["side"]]
    assert reader.stats["vision_passes"] == 1  # the gated stage never ran the frame through the tower again
    # ... nor read it again: its sheet and frame's KV came from the store.
    first, gated = prompts
    fresh = make_tiny_reader(tiny_dir).runner
    assert first.images == gated.images and first.ids != gated.ids
    assert runner.flat.store.stats["hit_tokens"] >= whole_blocks(fresh, frame_end(fresh, gated)) > 0


# A sheet of several questions ahead of the frame: a prefix of many KV blocks, past the tiny model's window.
LONG_SHEET = SHEET + "".join(f"\n\nQuestion q{n}: Is sign number {n} in view?\n  yes\n  no" for n in range(3, 9))
COLOURS = ((90, 160, 40), (10, 10, 200), (200, 30, 30))


def frames_of_one_sheet(tokenizer, restated: bool = False):
    from app.decisions.prompt import restated_state

    state = restated_state("Walking forward.", ["q1: no"]) if restated else "Walking forward."
    text = tuple(tokenizer.render_chat(LONG_SHEET, state, 1, False))
    return [Prompt(text, (ImageInput(jpeg(colour), "image/jpeg", "frame"),)) for colour in COLOURS]


def test_frames_of_one_sheet_share_the_sheets_kv_and_read_what_each_reads_alone(tiny_dir, tokenizer):
    """The first frame writes the sheet's KV; later frames of the sheet take it from the store up to
    their frame, and each reads what it reads alone on a fresh engine."""
    frames = frames_of_one_sheet(tokenizer)
    image_at = frames[0].ids.index(tokenizer.image_placeholder_id)  # the sheet's tokens: the same before every frame
    runner = make_tiny_reader(tiny_dir).runner
    sheet = whole_blocks(runner, image_at)
    assert sheet > int(runner.text_config.sliding_window)
    store = runner.flat.store
    runner.read([read_of(tokenizer, frames[0])])
    hits = store.stats["hit_tokens"]
    together = runner.read([read_of(tokenizer, frame, (5, 9)) for frame in frames[1:]])
    assert store.stats["hit_tokens"] - hits >= 2 * sheet
    for frame, got in zip(frames[1:], together, strict=True):
        (alone,) = make_tiny_reader(tiny_dir).runner.read([read_of(tokenizer, frame, (5, 9))])
        assert_same_reads(alone, got)


def test_the_gated_stages_of_several_frames_share_one_turn_each_over_its_own_frame(tiny_dir, tokenizer):
    """The restated stages of three frames, read together: each takes its own frame's first stage from
    the store (the sheet and its frame), none runs the vision tower again, all in one turn, and each
    reads what it reads alone."""
    runner = make_tiny_reader(tiny_dir).runner
    store = runner.flat.store
    runner.read([read_of(tokenizer, frame) for frame in frames_of_one_sheet(tokenizer)])
    seconds = frames_of_one_sheet(tokenizer, restated=True)
    shared = sum(whole_blocks(runner, frame_end(make_tiny_reader(tiny_dir).runner, frame)) for frame in seconds)
    passes, hits, turns = runner.stats["vision_passes"], store.stats["hit_tokens"], runner.stats["flat_turns"]
    together = runner.read([read_of(tokenizer, frame) for frame in seconds])
    assert store.stats["hit_tokens"] - hits >= shared
    assert runner.stats["vision_passes"] == passes and runner.stats["flat_turns"] - turns == 1
    for frame, got in zip(seconds, together, strict=True):
        (alone,) = make_tiny_reader(tiny_dir).runner.read([read_of(tokenizer, frame)])
        assert_same_reads(alone, got)
