"""Every engine turn of the hf runner ends with its device work done (`finish_turn`: a stream
synchronisation on CUDA, nothing on the CPU), as app/engine/base.py's scheduling contract asks: a
long prompt's chunks and a generation's commits, the steps that copy nothing back to the host."""

from __future__ import annotations

import torch

from app.engine.base import GenerateSpec, Prompt
from tests.conftest import make_tiny_reader
from tests.engine.hf.test_chunked import long_spec


def test_each_chunk_waits_for_its_device_work_before_its_turn_ends(tiny_dir, tokenizer, monkeypatch):
    """A chunk's turn ends once its device work is done (`finish_turn`, a stream synchronisation on
    CUDA), never with that work still queued behind the host for the next reads to wait out."""
    runner = make_tiny_reader(tiny_dir, flat_turn=False, prefill_chunk=48).runner
    waited: list[int] = []
    monkeypatch.setattr(runner, "finish_turn", lambda: waited.append(runner.stats["encoder_chunks"]))
    steps = runner.read_steps([long_spec(tokenizer)])
    at_turn_ends = []
    while True:
        try:
            next(steps)
        except StopIteration:
            break
        at_turn_ends.append((runner.stats["encoder_chunks"], len(waited)))
    chunks = -(-len(long_spec(tokenizer).prompt.ids) // 48)
    assert waited == list(range(1, chunks + 1))  # once after each chunk, in order
    assert all(encoded == synchronised for encoded, synchronised in at_turn_ends)


def test_finish_turn_synchronises_only_a_cuda_device(tiny_dir, monkeypatch):
    runner = make_tiny_reader(tiny_dir, flat_turn=False).runner
    calls: list[object] = []

    class Stream:
        def synchronize(self) -> None:
            calls.append("synchronised")

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: calls.append(device) or Stream())
    runner.finish_turn()
    assert calls == []  # the CPU runs each op to its end
    monkeypatch.setattr(runner, "device", torch.device("cuda", 0))
    runner.finish_turn()
    assert calls == [torch.device("cuda", 0), "synchronised"]


@torch.no_grad()
def test_a_generations_commit_turn_waits_for_its_device_work(tiny_dir, tokenizer, monkeypatch):
    """A finished block's commit (an encoder pass nothing reads back in that turn) ends with
    `finish_turn`, as every engine turn ends with its device work done (app/engine/base.py)."""
    runner = make_tiny_reader(tiny_dir, flat_turn=False).runner
    runner.generation["max_denoising_steps"] = 4
    prompt = Prompt(tuple(tokenizer.render_chat("Think.", "a state", 0, thinking=True)))
    state = runner.start_generation(GenerateSpec(prompt, 40, (), seed=11, temperature=0.0), 32)
    waited: list[int] = []
    monkeypatch.setattr(runner, "finish_turn", lambda: waited.append(runner.stats["encoder_passes"]))
    commits_before = runner.stats["encoder_passes"]
    while not state.done:
        runner.step_generation(state)
    commits = runner.stats["encoder_passes"] - commits_before
    assert commits >= 1  # 40 tokens in 32-wide blocks: the first block was committed
    assert waited == list(range(commits_before + 1, commits_before + commits + 1))  # right after each
