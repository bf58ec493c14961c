"""bench/bench_gpu_moe.py's pure parts (the timing itself needs a GPU): the --weights list, the
bytes an expert moves in each format, and the tile configurations a --sweep tries."""

from __future__ import annotations

import argparse

import pytest

from app.engine.hf.moe import fp8 as fp8_moe
from app.engine.hf.moe import fused as fused_moe
from app.engine.hf.moe.pairs import BlockConfig
from bench import bench_gpu_moe as bench


def test_the_weights_list_takes_bf16_and_fp8_only():
    assert bench.weights_list("bf16") == ["bf16"]
    assert bench.weights_list("bf16, fp8") == ["bf16", "fp8"]
    for text in ("int4", "bf16,fp4", ",", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            bench.weights_list(text)


def test_an_fp8_expert_moves_half_the_bytes_plus_its_scales():
    weights = 3 * bench.HIDDEN * bench.INTER  # gate, up and down: 5,947,392 for the full model
    assert bench.expert_bytes("bf16") == 2 * weights == 11_894_784
    assert bench.expert_bytes("fp8") == weights + 4 * (2 * bench.INTER + bench.HIDDEN) == 5_964_288
    assert bench.expert_bytes("fp8", hidden=8, inter=4) == 96 + 4 * 16


@pytest.mark.parametrize("large,sweep,down_sweep", [
    (fused_moe.LARGE, bench.SWEEP, bench.DOWN_SWEEP),
    (fp8_moe.LARGE, bench.FP8_SWEEP, bench.FP8_DOWN_SWEEP),
])
def test_a_sweep_tries_every_other_tile_and_the_large_tiles_down_tiles(large, sweep, down_sweep):
    small = BlockConfig(*sweep[0])
    tries = bench.sweep_tries(small, large, sweep, down_sweep, BlockConfig)
    assert [label for label, _, _ in tries] == [f"sweep {values}" for values in sweep[1:]]
    assert all(down is None for _, _, down in tries)
    tries = bench.sweep_tries(large, large, sweep, down_sweep, BlockConfig)
    downs = [(config, down) for label, config, down in tries if label.startswith("down")]
    assert downs == [(large, BlockConfig(*values)) for values in down_sweep]
    assert all(down.block_m == large.block_m for _, down in downs)  # the kernels share the blocks of pairs
    assert large not in [config for label, config, _ in tries if label.startswith("sweep")]


def test_every_swept_tile_is_one_the_kernels_can_take():
    for values in bench.SWEEP + bench.DOWN_SWEEP + bench.FP8_SWEEP + bench.FP8_DOWN_SWEEP:
        block_m, block_n, block_k, warps, stages = values
        assert all(size >= 16 and size & (size - 1) == 0 for size in (block_m, block_n, block_k)), values
        assert warps in (4, 8) and 2 <= stages <= 5, values
