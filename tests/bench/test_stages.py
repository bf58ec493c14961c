"""The served bench's stage table (bench/served_load.py `StageTimer`) times the stages the runner runs:
an engine turn's step, the vision tower in it, its forward, its attention by segment, the slot reads;
and puts every one back after."""

from __future__ import annotations

import dataclasses

from app.engine.base import ImageInput, Prompt
from bench.served_load import STAGES, StageTimer
from bench.workload import frames
from tests.conftest import make_tiny_reader
from tests.engine.hf.test_reader import spec_for


def test_an_engine_turn_times_its_forward_attention_vision_and_slot_reads(tiny_dir, tokenizer):
    runner = make_tiny_reader(tiny_dir).runner
    text = spec_for(tokenizer, "a state", "q1: yes", [5, 6])
    image = dataclasses.replace(spec_for(tokenizer, "a frame", "q1: yes", [7]), prompt=Prompt(
        tuple(tokenizer.render_chat("Look.", "a frame", 1, False)), (ImageInput(frames(1)[0], "image/jpeg", "frame"),)))
    with StageTimer(runner) as timer:
        runner.read([text, image])
    summary = timer.summary(1.0)
    assert tuple(summary) == STAGES
    assert summary["flat.step"]["calls"] == 1 and summary["flat.turn.forward"]["calls"] == 1
    assert summary["images.image_features"]["calls"] == 1 and summary["images.image_features"]["rows_a_call"] == 1
    assert summary["flat.attention.attend"]["calls"] == len(runner.model.model.decoder.layers)
    assert summary["slot_reads_at"]["calls"] == 1
    assert runner.flat.turn.forward is runner.flat.forward  # put back, not dropped
    for owner, name in ((runner.flat, "step"), (runner.images, "image_features"), (runner, "slot_reads_at"),
                        (runner.flat.attention, "attend")):
        assert name not in vars(owner), name  # the class's method again
    with StageTimer(runner):  # twice, as the served bench times its loops one after the other
        runner.read([spec_for(tokenizer, "again", "q1: yes", [5])])
    assert runner.flat.turn.forward is runner.flat.forward and "step" not in runner.flat.__dict__
