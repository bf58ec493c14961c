"""The served bench's stage table (bench/served_load.py `StageTimer`) times the stages the runner runs:
the row path's, or the flat turn's (FLAT_TURN=1), never a stage that no longer runs."""

from __future__ import annotations

from bench.served_load import FLAT_STAGES, ROW_STAGES, StageTimer
from tests.conftest import make_tiny_reader
from tests.engine.hf.test_reader import spec_for


def test_the_row_path_times_its_passes(tiny_dir, tokenizer):
    runner = make_tiny_reader(tiny_dir, flat_turn=False).runner
    with StageTimer(runner) as timer:
        runner.read([spec_for(tokenizer, "a state", "q1: yes", [5, 6])])
    summary = timer.summary(1.0)
    assert tuple(summary) == ROW_STAGES
    assert summary["read_steps"]["calls"] == 1 and summary["decoder_hidden"]["calls"] == 1
    assert "read_steps" not in runner.__dict__  # unwrapped after


def test_the_flat_turn_times_its_forward_and_attention(tiny_dir, tokenizer):
    runner = make_tiny_reader(tiny_dir, flat_turn=True).runner
    with StageTimer(runner) as timer:
        runner.read([spec_for(tokenizer, "a state", "q1: yes", [5, 6])])
    summary = timer.summary(1.0)
    assert tuple(summary) == FLAT_STAGES
    assert summary["flat.step"]["calls"] == 1 and summary["flat.turn.forward"]["calls"] == 1
    assert summary["flat.attention.attend"]["calls"] == len(runner.model.model.decoder.layers)
    assert summary["slot_reads_at"]["calls"] == 1
    assert runner.flat.turn.forward is runner.flat.forward  # put back, not dropped
    with StageTimer(runner):  # twice, as the served bench times its loops one after the other
        runner.read([spec_for(tokenizer, "again", "q1: yes", [5])])
    assert runner.flat.turn.forward is runner.flat.forward and "step" not in runner.flat.__dict__
