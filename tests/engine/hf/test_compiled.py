"""TORCH_COMPILE where the flat turn does not compile it itself (app/engine/hf/compiled.py,
app/engine/hf/layers.py), on the CPU with torch.compile's `aot_eager` backend (it traces and runs what
inductor would compile, in seconds): the compiled vision layers see exactly what the library's see and
no text layer is touched, the warm-up leaves nothing behind, and the engine thread gets the compile
limits (torch keeps them per thread). The flat forward's own compiled layer bodies:
tests/engine/hf/test_pieces.py."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from types import SimpleNamespace

import torch

from app.engine.base import Prompt
from app.engine.hf import compiled
from tests.conftest import make_tiny_reader
from tests.engine.hf.test_reader import spec_for


def test_warm_up_reads_then_leaves_no_features_sequence_or_counter_behind(tiny_dir):
    runner = make_tiny_reader(tiny_dir).runner
    read, specs = runner.read, []
    runner.read = lambda batch, *rest: (specs.extend(batch), read(batch, *rest))[1]
    seconds = compiled.warm_up(runner, canvas_length=16)
    assert seconds > 0
    # rows 1 and 2, a long prompt in chunks (three: the first, a full one, a short last), an image,
    # then a two-step read of several canvases (its second step a self-conditioned turn)
    assert [len(spec.prompt.images) for spec in specs] == [0, 0, 0, 0, 1, 0]
    assert specs[5].steps == 2 and len(specs[5].canvases) == compiled.WARM_UP_CANVASES > 1
    long = specs[3].prompt
    assert len(long.ids) == 2 * runner.prefill_chunk + 64 and runner.prefill_chunk < len(long.ids)
    assert len(runner.images.features) == 0  # the warm-up image's features dropped
    assert runner.flat.store.stats["blocks_used"] == 0  # no sequence of the warm-up still holds its blocks
    assert not runner.stats


@torch.no_grad()
def test_compiled_vision_layers_see_exactly_what_the_library_sees(tiny_dir):
    import io

    from PIL import Image

    from app.engine.base import ImageInput

    eager, runner = make_tiny_reader(tiny_dir).runner, make_tiny_reader(tiny_dir).runner
    buffer = io.BytesIO()
    Image.new("RGB", (80, 60), (200, 40, 90)).save(buffer, "JPEG")
    prompt = Prompt((5, 6, int(eager.config.image_token_id), 7), (ImageInput(buffer.getvalue(), "image/jpeg"),))

    def features(reader_runner):
        inputs = reader_runner.images.model_inputs(prompt)
        return reader_runner.images.input_embeds(inputs)

    expected = features(eager)
    vision = compiled.vision_layers(runner.model)
    assert compiled.compile_vision(runner.model, backend="aot_eager") == len(vision) > 0
    assert all(getattr(layer.forward, "djev_split", False) for layer in vision)
    assert torch.equal(features(runner), expected)


def test_compile_limits_are_set_on_the_calling_thread_and_the_engine_thread(tiny_dir):
    import torch._dynamo

    seen: list[int] = []
    thread = threading.Thread(target=lambda: seen.append(torch._dynamo.config.recompile_limit))
    compiled.configure_thread()
    assert torch._dynamo.config.recompile_limit >= compiled.RECOMPILE_LIMIT
    assert torch._dynamo.config.suppress_errors
    thread.start()
    thread.join()
    assert seen[0] < compiled.RECOMPILE_LIMIT  # torch keeps these per thread: hence the engine thread's own call

    async def engine_thread_limit(on_cuda: bool) -> int:
        reader = make_tiny_reader(tiny_dir)
        reader.options = dataclasses.replace(reader.options, torch_compile=True)
        runner = reader.runner
        device, limits, plain_step = runner.device, [], runner.flat.step

        def step_noting_the_limit(jobs):  # runs on the engine thread, after its set-up
            runner.device = device  # the turn itself runs on the CPU
            limits.append(torch._dynamo.config.recompile_limit)
            return plain_step(jobs)

        runner.flat.step = step_noting_the_limit
        await reader.start()
        try:
            if on_cuda:  # what the engine thread's set-up reads of the device (it starts with the first turn)
                runner.device = SimpleNamespace(type="cuda")
            await reader.read([spec_for(reader.tokenizer, "a state", "q1: yes", [5])])
        finally:
            await reader.stop()
        return limits[0]

    assert asyncio.run(engine_thread_limit(on_cuda=True)) >= compiled.RECOMPILE_LIMIT
    assert asyncio.run(engine_thread_limit(on_cuda=False)) < compiled.RECOMPILE_LIMIT  # the CPU engine never compiles


def test_compile_vision_compiles_the_vision_layers_alone(tiny_dir):
    """The text layers keep the library's own modules: the flat forward runs its own bodies over them
    (and compiles those itself, `FlatForward.compile`)."""
    from app.engine.hf.parts import decoder_layers, encoder_layers

    runner = make_tiny_reader(tiny_dir).runner
    vision = compiled.vision_layers(runner.model)
    assert compiled.compile_vision(runner.model, backend="aot_eager") == len(vision) > 0
    assert all(getattr(layer.forward, "djev_split", False) for layer in vision)
    text = [*encoder_layers(runner.model), *decoder_layers(runner.model)]
    assert text and not any("forward" in vars(layer) for layer in text)


def test_the_frame_probe_reads_distinct_frames_and_leaves_nothing_behind(tiny_dir):
    runner = make_tiny_reader(tiny_dir).runner
    runner.stats["flat_graphs_built"] = 8  # as the captures before it leave the counters
    counters = dict(runner.stats)
    read, specs = runner.read, []
    runner.read = lambda batch, *rest: (specs.extend(batch), read(batch, *rest))[1]
    rate = compiled.measure_frames(runner, canvas_length=16, frames=3)
    assert rate > 0
    assert len(specs) == 6  # two rounds of three, the first untimed
    digests = {image.data for spec in specs for image in spec.prompt.images}
    assert len(digests) == 6  # every frame a new picture: none read from the KV store or the LRU
    assert all(len(spec.prompt.ids) == compiled.FRAME_PROMPT_TOKENS + 1 for spec in specs)
    assert len(runner.images.features) == 0
    assert runner.flat.store.stats["blocks_used"] == 0
    assert dict(runner.stats) == counters  # the probe's reads counted nowhere; the captures still are
