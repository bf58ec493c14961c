"""app/engine/hf/attention_kernel.py's kernel (a long prompt's chunks on CUDA) in Triton's interpreter
on the CPU, through checks.py in the CPU vLLM venv (it has Triton): the output and the log-sum-exp
against float64 arithmetic, rows and keys off the tiles' multiples, the keys a strided view of a
longer cache; and layers.chunk_attention_with the kernel (what chunk_attention runs on CUDA) against
it with torch's kernels only (the CPU path)."""

from __future__ import annotations

import pytest

from tests.vllm_support import REPO, interpreted_checks

CHECKS = REPO / "tests" / "engine" / "hf" / "attention" / "checks.py"


@pytest.fixture(scope="module")
def checked() -> dict:
    return interpreted_checks(CHECKS)


def exact(case: dict) -> bool:
    return case["out"] < 1e-4 and case["lse"] < 1e-4


def test_no_mask_equals_the_exact_attention_at_head_sizes_64_and_512(checked):
    for case in ("64:float32", "512:float32"):
        assert exact(checked[case]), (case, checked[case])
    assert checked["512:float32"]["shape"] == [1, 2, 20, 512]
    assert checked["512:float32"]["lse_shape"] == [1, 2, 20]


def test_the_accumulator_split_into_parts_of_the_head_size_changes_nothing(checked):
    for case in ("512:parts2", "64:parts4"):
        assert exact(checked[case]), (case, checked[case])
    assert checked["512:parts2"]["shape"] == [1, 2, 20, 512]


def test_query_heads_read_their_shared_kv_head(checked):
    assert exact(checked["64:groups"]) and checked["64:groups"]["shape"] == [1, 4, 21, 64]


def test_a_band_is_causal_within_its_window_and_writes_into_the_given_buffer(checked):
    for case in ("64:sliding", "64:causal", "64:causal_past"):
        assert exact(checked[case]), (case, checked[case])
    assert checked["64:sliding"]["into"] and checked["64:causal_past"]["into"]


def test_bfloat16_is_within_its_rounding(checked):
    case = checked["64:bfloat16"]
    assert case["out"] < 1e-2 and case["lse"] < 1e-4  # the output stored in bf16; the lse kept in fp32


def test_the_chunk_attention_through_the_kernel_equals_torchs(checked):
    for case in ("layers:full", "layers:sliding"):
        assert checked[case]["out"] < 1e-5, (case, checked[case])
        assert checked[case]["shape"] == [1, 24, 4, 64]
