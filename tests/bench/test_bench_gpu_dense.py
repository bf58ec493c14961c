"""bench/bench_gpu_dense.py's pure parts: the full-size layers' projection shapes and their bytes."""

from __future__ import annotations

from bench import bench_gpu_dense
from bench.models import FULL_TEXT_CONFIG


def test_a_sliding_and_a_full_layers_projections():
    sliding = bench_gpu_dense.layer_shapes(FULL_TEXT_CONFIG, True)
    assert sliding == [("q", 2816, 4096), ("k", 2816, 2048), ("v", 2816, 2048), ("o", 4096, 2816),
                       ("gate", 2816, 2112), ("up", 2816, 2112), ("down", 2112, 2816)]
    full = bench_gpu_dense.layer_shapes(FULL_TEXT_CONFIG, False)
    assert full == [("q", 2816, 8192), ("k", 2816, 1024), ("o", 8192, 2816),  # K = V: no v projection
                    ("gate", 2816, 2112), ("up", 2816, 2112), ("down", 2112, 2816)]


def test_a_turns_dense_bytes_halve_in_fp8():
    bf16 = bench_gpu_dense.turn_bytes(FULL_TEXT_CONFIG, 2)
    assert bench_gpu_dense.turn_bytes(FULL_TEXT_CONFIG, 1) * 2 == bf16
    assert 2.5 * 2**30 < bf16 < 3.5 * 2**30  # ~3 GiB of the 47.35 GiB: the experts are the rest


def test_the_token_counts_parse():
    assert bench_gpu_dense.parse_args(["--tokens", "16,4096"]).tokens == [16, 4096]
