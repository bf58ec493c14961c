"""Images in the hf engine are decoded and run through the image processor in image workers before
their job is queued, never on the engine thread; the reads equal the inline path a direct runner
call takes, a broken image still fails only its own read with the same 422, cached features skip
preprocessing altogether, and nothing preprocessed outlives its job."""

from __future__ import annotations

import asyncio
import dataclasses
import re
import threading

import pytest

from app.engine.base import EngineInputError, GenerateSpec, ImageInput, Prompt, ReadSpec
from tests.conftest import make_tiny_reader
from tests.engine.hf.graphs.test_encoder import jpeg
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
    """The reader with its image processor and its engine entry points recorded."""
    runner = reader.runner
    runner.image_processor = ThreadRecorder(runner.image_processor)
    runner.read = ThreadRecorder(runner.read)
    runner.start_steps = ThreadRecorder(runner.start_steps)
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
    reader = recorded(make_tiny_reader(tiny_dir, flat_turn=False))
    specs = [image_spec(tokenizer, "what is ahead?", frame((200, 10, 10), "frame 0"), [5, 77]),
             image_spec(tokenizer, "what is ahead?", frame((10, 10, 200), "frame 1"), [9]),
             spec_for(tokenizer, "a text state", "q1: yes", [3])]

    async def scenario():
        return await reader.read(specs)

    through_reader = run_started(reader, scenario)
    runner = reader.runner
    engine_threads = set(runner.read.threads)
    assert engine_threads and all(name.startswith("djev-engine") for name in engine_threads)
    assert len(runner.image_processor.threads) == 2  # one call per image set
    assert all(name.startswith("djev-images") for name in runner.image_processor.threads)
    assert runner.stats["images_preprocessed"] == 2 and runner.stats["images_preprocessed_inline"] == 0
    assert reader.images_held == 0  # nothing preprocessed outlives its job

    # A direct runner call (bench scripts, tests) still decodes inline, on its own thread.
    inline = make_tiny_reader(tiny_dir, flat_turn=False).runner
    inline.image_processor = ThreadRecorder(inline.image_processor)
    direct = inline.read(specs)
    assert inline.image_processor.threads == [threading.current_thread().name] * 2
    assert inline.stats["images_preprocessed_inline"] == 2
    assert through_reader[0].prompt_tokens > len(specs[0].prompt.ids)  # soft tokens expanded
    for a, b in zip(through_reader, direct, strict=True):
        assert_same_reads(a, b)


def test_an_image_generation_is_preprocessed_off_the_engine_thread(tiny_dir, tokenizer):
    reader = recorded(make_tiny_reader(tiny_dir, flat_turn=False))
    prompt = Prompt(tuple(tokenizer.render_chat("Look.", "describe it", 1, False)), (frame((30, 200, 30), "frame"),))
    spec = GenerateSpec(prompt, 16, (), seed=1, temperature=0.0)

    async def scenario():
        return await reader.generate(spec)

    generated = run_started(reader, scenario)
    runner = reader.runner
    assert runner.start_steps.threads and all(n.startswith("djev-engine") for n in runner.start_steps.threads)
    assert len(runner.image_processor.threads) == 1
    assert runner.image_processor.threads[0].startswith("djev-images")
    assert runner.stats["images_preprocessed_inline"] == 0 and reader.images_held == 0
    inline = make_tiny_reader(tiny_dir, flat_turn=False).runner.generate(spec, reader.info.canvas_length)
    assert generated.ids == inline.ids and generated.prompt_tokens == inline.prompt_tokens > len(prompt.ids)


def test_a_broken_image_fails_only_its_own_read_with_the_same_error(tiny_dir, tokenizer):
    reader = recorded(make_tiny_reader(tiny_dir, flat_turn=False))
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
    direct = make_tiny_reader(tiny_dir, flat_turn=False).runner.read([good, bad])
    assert not isinstance(direct[0], Exception) and isinstance(direct[1], EngineInputError)
    assert direct[1].param == failed.param and direct[1].status == failed.status
    assert re.sub(" at 0x[0-9a-f]+", "", str(direct[1])) == re.sub(" at 0x[0-9a-f]+", "", str(failed))  # PIL names its buffer


def test_a_model_without_an_image_processor_refuses_images_as_before(tiny_dir, tokenizer):
    reader = make_tiny_reader(tiny_dir, flat_turn=False)
    reader.runner.image_processor = None
    spec = image_spec(tokenizer, "what is ahead?", frame((200, 10, 10), "frame 0"), [5])

    async def scenario():
        return await asyncio.gather(reader.read([spec]), reader.read([spec_for(tokenizer, "text", "q1: yes", [3])]),
                                    return_exceptions=True)

    refused, text = run_started(reader, scenario)
    assert isinstance(refused, EngineInputError) and refused.status == 422 and refused.param == "images"
    assert str(refused) == "this model has no image processor"
    assert not isinstance(text, BaseException)


def test_cached_features_and_cached_prompts_skip_preprocessing(tiny_dir, tokenizer):
    reader = recorded(make_tiny_reader(tiny_dir, flat_turn=False))
    image = frame((30, 200, 30), "frame")
    first = image_spec(tokenizer, "what is ahead?", image, [5])
    restated = image_spec(tokenizer, "ahead: wall. which side?", image, [5])  # a later stage, same frame

    async def scenario():
        await reader.read([first])
        processed = len(reader.runner.image_processor.threads)
        await reader.read([restated])  # vision-LRU hit: neither decoded nor processed
        await reader.read([first])  # KV hit: not even expanded
        return processed

    processed = run_started(reader, scenario)
    runner = reader.runner
    assert processed == 1 and len(runner.image_processor.threads) == 1
    assert runner.stats["images_preprocessed"] == 1 and runner.stats["images_preprocessed_inline"] == 0
    assert runner.stats["vision_hits"] == 1 and runner.stats["vision_passes"] == 1 and runner.stats["kv_hits"] == 1


def test_past_the_budget_the_engine_thread_decodes_and_reads_the_same(tiny_dir, tokenizer):
    reader = recorded(make_tiny_reader(tiny_dir, flat_turn=False))
    reader.image_budget = 0
    spec = image_spec(tokenizer, "what is ahead?", frame((200, 10, 10), "frame 0"), [5, 77])

    async def scenario():
        return await reader.read([spec])

    (result,) = run_started(reader, scenario)
    runner = reader.runner
    assert runner.stats["images_preprocessed"] == 0 and runner.stats["images_preprocessed_inline"] == 1
    assert runner.image_processor.threads == runner.read.threads  # the engine thread, as before
    (direct,) = make_tiny_reader(tiny_dir, flat_turn=False).runner.read([spec])
    assert_same_reads(result, direct)


def test_a_cancelled_read_gives_its_preprocessed_images_back(tiny_dir, tokenizer):
    reader = make_tiny_reader(tiny_dir, flat_turn=False)
    runner = reader.runner
    started, release = threading.Event(), threading.Event()
    plain_read = runner.read

    def held_read(specs, *args):
        started.set()
        release.wait(10)  # hold the engine thread so the next read waits in the queue
        return plain_read(specs, *args)

    runner.read = held_read
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


@pytest.fixture(scope="module")
def wide_dir(tmp_path_factory):
    """The tiny checkpoint with a 512-token sliding window: a frame's prompt (145 tokens) fits inside it,
    as a walk frame's ~500 fit the full model's 1,024 (a prompt past the window has its sliding
    layers cropped, and its prefix cannot be sliced from it)."""
    import json

    from app.engine.tiny import write_tiny_model

    directory = write_tiny_model(tmp_path_factory.mktemp("wide") / "model")
    config_path = directory / "config.json"
    config = json.loads(config_path.read_text())
    config["text_config"]["sliding_window"] = 512
    config_path.write_text(json.dumps(config))
    return directory


def test_a_restated_stage_is_encoded_over_the_first_stages_prefix_and_reads_the_same(wide_dir, tiny_dir, tokenizer):
    """The gated second stage of a walk frame: only its restated suffix is encoded, over the first
    stage's KV of the sheet and the frame; its KV equals the prompt encoded whole."""
    from tests.engine.hf.graphs.test_encoder import assert_same_kv

    first, second = frame_prompts(tokenizer)
    narrow = make_tiny_reader(tiny_dir, flat_turn=False).runner  # the tiny model's own 64-token window: the source is cropped
    narrow.encode_many([first])
    narrow.encode_many([second])
    assert narrow.stats["image_prefix_hits"] == 0
    runner = make_tiny_reader(wide_dir).runner
    runner.encode_many([first])
    before = dict(runner.stats)
    (reused,) = runner.encode_many([second])
    assert runner.stats["image_prefix_hits"] == 1
    assert runner.stats["vision_passes"] == before.get("vision_passes", 0)  # the frame's features reused
    (whole,) = make_tiny_reader(wide_dir).runner.encode_many([second])
    assert_same_kv(whole, reused)
    other = frame_prompts(tokenizer, colour=(10, 10, 200))[1]  # another frame: no source, encoded whole
    runner.encode_many([other])
    assert runner.stats["image_prefix_hits"] == 1


def test_a_walk_decisions_gated_stage_reuses_the_frames_prompt(wide_dir):
    from app import build
    from app.config import Settings
    from app.decisions.request import parse_decision
    from app.decisions.run import Decider
    from tests.conftest import LIMITS

    reader = make_tiny_reader(wide_dir, flat_turn=False)  # the row path's image-prefix encoding
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
    assert reader.stats["image_prefix_hits"] == 1 and reader.stats["vision_passes"] == 1


# A sheet long enough for a shared prefix (PREFIX_MIN tokens) ahead of the frame.
LONG_SHEET = SHEET + "".join(f"\n\nQuestion q{n}: Is sign number {n} in view?\n  yes\n  no" for n in range(3, 9))
COLOURS = ((90, 160, 40), (10, 10, 200), (200, 30, 30))


def frames_of_one_sheet(tokenizer, restated: bool = False):
    from app.decisions.prompt import restated_state

    state = restated_state("Walking forward.", ["q1: no"]) if restated else "Walking forward."
    text = tuple(tokenizer.render_chat(LONG_SHEET, state, 1, False))
    return [Prompt(text, (ImageInput(jpeg(colour), "image/jpeg", "frame"),)) for colour in COLOURS]


def wide_graphed(wide_dir):
    from tests.engine.hf.graphs.test_encoder import graphed_runner

    return graphed_runner(wide_dir, lengths=(16, 32, 64, 128, 256, 384))


def test_frames_of_one_sheet_are_encoded_over_the_sheets_kv_and_equal_the_whole_encoding(wide_dir, tokenizer):
    """The first frame is encoded whole; later frames of the sheet take its KV up to the frame
    (sliced once, then kept) and encode only the frame and what follows it, in one pass."""
    from tests.engine.hf.graphs.test_encoder import assert_same_kv

    frames = frames_of_one_sheet(tokenizer)
    runner = wide_graphed(wide_dir)
    runner.encode_many(frames[:1])
    assert runner.stats["prefix_hits"] == 0
    passes = runner.stats["encoder_passes"]
    encoded = runner.encode_many(frames[1:])
    assert runner.stats["prefix_hits"] == 2 and runner.stats["prefixes_sliced"] == 1
    assert runner.stats["encoder_passes"] - passes == 1
    eager = make_tiny_reader(wide_dir).runner
    for prompt, kv in zip(frames[1:], encoded):
        assert_same_kv(eager.encode_many([prompt])[0], kv)


def test_the_gated_stages_of_several_frames_share_one_pass_each_over_its_own_frame(wide_dir, tokenizer):
    from tests.engine.hf.graphs.test_encoder import assert_same_kv

    runner = wide_graphed(wide_dir)
    runner.encode_many(frames_of_one_sheet(tokenizer))
    passes, hits = runner.stats["encoder_passes"], runner.stats["image_prefix_hits"]
    seconds = frames_of_one_sheet(tokenizer, restated=True)
    encoded = runner.encode_many(seconds)
    assert runner.stats["image_prefix_hits"] - hits == 3 and runner.stats["encoder_passes"] - passes == 1
    eager = make_tiny_reader(wide_dir).runner
    for prompt, kv in zip(seconds, encoded):
        assert_same_kv(eager.encode_many([prompt])[0], kv)


@pytest.mark.parametrize("prefix_slots, reused", [((256,), True), ((64,), False)])
def test_with_encoder_graphs_the_restated_stage_takes_the_static_path_or_is_encoded_whole(
        wide_dir, tokenizer, prefix_slots, reused):
    """On the graphs' static path where the shared prefix fits a prefix bucket; where none holds it,
    encoded whole as before (and nothing is sliced for it). The KV is the whole encoding's either way."""
    from tests.engine.hf.graphs.test_encoder import assert_same_kv, graphed_runner

    first, second = frame_prompts(tokenizer)
    runner = graphed_runner(wide_dir, lengths=(16, 32, 64, 128, 256))
    runner.policy = dataclasses.replace(runner.policy, prefix_slots=prefix_slots)
    runner.encoder_graphs.policy = runner.policy
    runner.encode_many([first])
    (encoded,) = runner.encode_many([second])
    assert runner.stats["image_prefix_hits"] == (1 if reused else 0)
    assert_same_kv(make_tiny_reader(wide_dir).runner.encode_many([second])[0], encoded)
