"""bench/check_gpu_numerics.py on the tiny model on the CPU: every check runs, its command line is
the GPU one's, and it holds one runner at a time (each built, read, dropped and its memory freed
before the next), which is what lets the 30-layer model's checks fit an 80 GB card beside each
runner's preallocated KV store."""

from __future__ import annotations

import math
import weakref

import pytest
import torch

from app.engine.hf.runner import DiffusionRunner
from bench import check_gpu_numerics


def test_the_command_line_takes_sizes_and_flags_in_any_order():
    args = check_gpu_numerics.parse_args(["6:float32", "--fused-moe", "30:bfloat16", "--device", "cuda"])
    assert args.sizes == [(6, torch.float32), (30, torch.bfloat16)] and args.fused_moe
    assert args.device == torch.device("cuda") and not args.tiny
    assert [size for size, _ in check_gpu_numerics.parse_args(["--device", "cuda"]).sizes] == [6, 6, 30]
    for bad in (["6-float32", "--device", "cuda"], ["6:float99", "--device", "cuda"], ["--device", "cpu"],
                ["--tiny", "--device", "cpu", "--fused-moe"], ["--flat-turn", "--device", "cuda"]):
        with pytest.raises(SystemExit):
            check_gpu_numerics.parse_args(bad)


def test_the_reads_are_text_of_every_length_four_draws_an_image_and_two_steps():
    from app.engine.tiny import build_config, build_tokenizer

    config = build_config(build_tokenizer())
    reads, names = check_gpu_numerics.make_reads(int(config.text_config.vocab_size), int(config.image_token_id),
                                                 b"frame")
    assert len(reads) == len(names) == 7
    lengths = [len(spec.prompt.ids) for spec in reads if not spec.prompt.images]
    assert min(lengths) == 40 and max(lengths) == 1500
    assert any(len(spec.canvases) == 4 for spec in reads)
    (image,) = [spec for spec in reads if spec.prompt.images]
    assert image.prompt.ids[-1] == config.image_token_id
    assert [spec.steps for spec in reads].count(2) == 1


@pytest.mark.timeout(300)
def test_every_check_runs_with_one_runner_alive_at_a_time(monkeypatch, capsys):
    alive: list[weakref.ref] = []
    most = [0]
    built = [0]
    freed = []
    init = DiffusionRunner.__init__

    def counted(self, *args, **kwargs):
        living = [ref for ref in alive if ref() is not None]
        most[0] = max(most[0], len(living) + 1)  # the runners alive while this one is built
        init(self, *args, **kwargs)
        alive.append(weakref.ref(self))
        built[0] += 1

    release = check_gpu_numerics.release

    def released(device):
        release(device)
        freed.append(sum(ref() is not None for ref in alive))

    monkeypatch.setattr(DiffusionRunner, "__init__", counted)
    monkeypatch.setattr(check_gpu_numerics, "PROMPT_TOKENS", (40, 200))  # shorter than the GPU's: quicker
    monkeypatch.setattr(check_gpu_numerics, "release", released)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the tiny model gains nothing from more; on a busy 2-core box they cost 10x
    try:
        check_gpu_numerics.main(["--tiny", "--device", "cpu"])
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert built[0] == 4  # eager alone (and transformers' reads), eager shared, pieces alone, pieces shared
    assert most[0] == 1, f"{most[0]} runners were alive at once"
    assert freed and max(freed) == 0  # every release left no runner behind
    lines = {line.split("[")[0].strip(): line for line in out.splitlines() if "top label" in line}
    assert set(lines) == {"(1) shared turn vs alone, eager", "(2) pieces vs eager, alone",
                          "(2) pieces vs eager, shared turn", "(4) transformers vs alone, eager"}, out
    for line in lines.values():  # float32: every read agrees, to its top label
        largest = [float(d) for d in line.split("[")[1].split("]")[0].split(",")]
        assert len(largest) == 6 and max(largest) < 2e-3, line  # 300, 300 x4, 40, 200, image, 2 steps
        agree, total = line.split("top label ")[1].split()[0].split("/")
        assert agree == total, line
    assert "2 turns shared" in lines["(1) shared turn vs alone, eager"]  # one turn, and the two-step's second
    assert "as uncaptured pieces, 0 eager fallbacks" in lines["(2) pieces vs eager, shared turn"]
    assert "vision static vs library" in out


def slot(*probabilities: float):
    from app.engine.base import SlotRead

    return SlotRead(tuple(math.log(p) for p in probabilities), 0)


def test_agreement_counts_confident_slots_and_the_probability_deviation():
    from app.engine.base import ReadResult

    # Full-vocabulary log-probabilities: renormalised over the labels (0.06 / 0.02 -> 0.75 / 0.25).
    base = [ReadResult(((slot(0.06, 0.02), slot(0.5, 0.48), slot(0.2, 0.1, 0.1)),), 10)]
    other = [ReadResult(((slot(0.02, 0.06), slot(0.48, 0.5), slot(0.2, 0.1, 0.1)),), 10)]
    found = check_gpu_numerics.agreement(base, other)
    assert (found.slots, found.confident, found.agree) == (3, 2, 1)  # the 0.51/0.49 slot is not confident
    assert found.largest_deviation == pytest.approx(0.5)
    assert found.mean_deviation == pytest.approx((0.5 + 0.5 + 0.0204 * 2) / 7, abs=1e-3)
    assert "1/2 confident slots (50.0 %)" in found.line()


def test_the_fp8_check_takes_its_own_size_and_refuses_fused_moe():
    args = check_gpu_numerics.parse_args(["--weights", "fp8", "--device", "cuda"])
    assert args.sizes == [(30, torch.bfloat16)] and args.reads == 300
    for bad in (["--weights", "fp8", "--fused-moe", "--device", "cuda"], ["--weights", "int4", "--device", "cuda"],
                ["--weights", "fp8", "--reads", "0", "--device", "cuda"]):
        with pytest.raises(SystemExit):
            check_gpu_numerics.parse_args(bad)
    reads = check_gpu_numerics.fp8_reads(2794, 6)
    assert [len(spec.prompt.ids) for spec in reads] == [60, 200, 500, 60, 200, 500]
    assert len({spec.prompt.ids for spec in reads}) == 6 and all(len(spec.canvases) == 1 for spec in reads)


@pytest.mark.timeout(300)
def test_the_fp8_check_runs_on_the_tiny_model(capsys):
    check_gpu_numerics.main(["--tiny", "--device", "cpu", "--weights", "fp8", "--reads", "12"])
    out = capsys.readouterr().out
    assert "12 reads; FP8: 41 projections and 6 layers' experts" in out
    line = next(line for line in out.splitlines() if "FP8 vs float32" in line)
    assert "over 36 slots" in line and "confident slots" in line
