"""bench/check_gpu_numerics.py on the tiny model on the CPU: every check runs, its command line is
the GPU one's, and it holds one runner at a time (each built, read, dropped and its memory freed
before the next), which is what lets the 30-layer model's checks fit an 80 GB card beside the flat
turn's preallocated KV store."""

from __future__ import annotations

import weakref

import pytest
import torch

from app.engine.hf.runner import DiffusionRunner
from bench import check_gpu_numerics


def test_the_command_line_takes_sizes_and_flags_in_any_order():
    args = check_gpu_numerics.parse_args(["6:float32", "--flat-turn", "30:bfloat16", "--split", "--device", "cuda"])
    assert args.sizes == [(6, torch.float32), (30, torch.bfloat16)] and args.flat_turn and args.split
    assert not args.fused_moe and args.device == torch.device("cuda")
    assert [size for size, _ in check_gpu_numerics.parse_args(["--device", "cuda"]).sizes] == [6, 6, 30]
    for bad in (["6-float32", "--device", "cuda"], ["6:float99", "--device", "cuda"], ["--device", "cpu"],
                ["--tiny", "--device", "cpu", "--fused-moe"]):
        with pytest.raises(SystemExit):
            check_gpu_numerics.parse_args(bad)


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
        check_gpu_numerics.main(["--tiny", "--device", "cpu", "--flat-turn"])
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert built[0] >= 14  # the row path's 7, the prefix check's 6, the flat turn's 2 (one builds twice over)
    assert most[0] == 1, f"{most[0]} runners were alive at once"
    assert freed and max(freed) == 0  # every release left no runner behind
    for line in ("batched vs alone", "encoder static vs alone", "graph replay vs both static", "static vs whole",
                 "vision static vs library", "flat turn alone vs row path alone", "flat graphs batched vs eager"):
        assert line in out, line
