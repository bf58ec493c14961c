"""bench/bench_gpu_moe.py's pure parts (the timing itself needs a GPU): the --weights list, the
bytes an expert moves in each format, and the tile configurations a --sweep tries."""

from __future__ import annotations

import argparse

import pytest

from app.engine.hf.moe import fp8 as fp8_moe
from app.engine.hf.moe import fused as fused_moe
from app.engine.hf.moe.pairs import BlockConfig, pick_tiles
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


def test_a_layers_floor_is_its_weight_read_or_its_math_whichever_is_longer():
    # One token (8 experts): the bytes; 4,096 tokens (all 128 chosen): bf16's math passes its bytes.
    assert bench.floor_ms("bf16", 1, 8) == pytest.approx(8 * 11_894_784 / 3e12 * 1e3)
    math = 2 * 4096 * 8 * 3 * bench.HIDDEN * bench.INTER / 650e12 * 1e3
    assert math > 128 * 11_894_784 / 3e12 * 1e3
    assert bench.floor_ms("bf16", 4096, 128) == pytest.approx(math)
    assert bench.floor_ms("fp8", 4096, 128) == pytest.approx(max(math / 2, 128 * 5_964_288 / 3e12 * 1e3))
    assert bench.floor_ms("bf16", 1, 8, bandwidth_tbs=6.0) == pytest.approx(bench.floor_ms("bf16", 1, 8) / 2)


def measured(weights, tokens, ms, tile, down=None, served=False):
    return {"tokens": tokens, "weights": weights, "ms": ms, "experts_chosen": 128, "tile": list(tile),
            "down_tile": list(down or tile), "served": served}


SMALL, MIDDLE, LARGE = (16, 64, 128, 4, 3), (32, 64, 128, 4, 3), (64, 128, 64, 4, 4)


def test_the_summary_finds_the_fastest_tile_at_each_count_against_the_floor():
    floor = bench.floor_ms("bf16", 16, 128)
    rows = [{"tokens": 16, "weights": "bf16", "ms": 0.4, "experts_chosen": 128, "tile": None},  # grouped_mm
            measured("bf16", 16, 2.0 * floor, SMALL, served=True), measured("bf16", 16, 1.2 * floor, MIDDLE),
            measured("bf16", 2048, 9.0, LARGE, (64, 256, 64, 8, 3), served=True), measured("fp8", 16, 0.3, SMALL)]
    entries = bench.summary(rows)
    assert [(e["weights"], e["tokens"]) for e in entries] == [("bf16", 16), ("bf16", 2048), ("fp8", 16)]
    first = entries[0]
    assert first["rows_an_expert"] == 1 and first["served_x_floor"] == 2.0
    assert first["best_tile"] == list(MIDDLE) and first["best_x_floor"] == 1.2 and first["within"]
    assert entries[1]["best_down_tile"] == [64, 256, 64, 8, 3] and not entries[1]["within"]
    assert entries[2]["served_ms"] is None and entries[2]["served_x_floor"] is None
    text = "\n".join(bench.summary_lines(entries))
    assert f"{LARGE} ((64, 256, 64, 8, 3))" in text and "| yes |" in text and "| no |" in text


def test_the_proposed_tiles_are_the_fastest_by_rows_an_expert_merged_and_the_largest_past_them():
    entries = bench.summary([measured("bf16", 16, 1.0, SMALL), measured("bf16", 128, 1.0, SMALL),
                             measured("bf16", 512, 1.0, MIDDLE), measured("bf16", 1024, 1.0, LARGE),
                             measured("bf16", 2048, 1.0, LARGE), measured("fp8", 16, 1.0, SMALL)])
    buckets, large = bench.proposed_tiles(entries, "bf16")
    assert buckets == [(8.0, SMALL, SMALL), (32.0, MIDDLE, MIDDLE)]  # 1 and 8 rows merged; 64 is LARGE's
    assert large == (LARGE, LARGE)
    assert bench.proposed_tiles(entries, "fp8") == ([], (SMALL, SMALL))
    with pytest.raises(ValueError, match="no measured kernels for int4"):
        bench.proposed_tiles(entries, "int4")
    # In the kernels' form: each tile a BlockConfig the kernels take, the limits ascending.
    tiles = tuple((limit, BlockConfig(*tile)) for limit, tile, _ in buckets)
    assert pick_tiles(16 * 8, 128, tiles, BlockConfig(*large[0])) == BlockConfig(*SMALL)
    assert pick_tiles(2048 * 8, 128, tiles, BlockConfig(*large[0])) == BlockConfig(*LARGE)
