"""bench/wide_attention.py's kernel (a candidate for a long prompt's chunks at head size 512) in
Triton's interpreter on the CPU, through tests/bench/wide_attention_checks.py in the CPU vLLM venv
(it has Triton): the output and the log-sum-exp against float64 arithmetic, rows and keys off the
tiles' multiples, the keys a strided view of a longer cache."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from tests.vllm_support import REPO, require_vllm

CHECKS = REPO / "tests" / "bench" / "wide_attention_checks.py"


@pytest.fixture(scope="module")
def checked() -> dict:
    python = require_vllm()
    done = subprocess.run([str(python), str(CHECKS)], cwd=REPO, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "TRITON_INTERPRET": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_float32_equals_the_exact_attention_at_head_sizes_64_and_512(checked):
    for case in ("64x37x70:float32", "512x20x45:float32"):
        assert checked[case]["out"] < 1e-4 and checked[case]["lse"] < 1e-4, (case, checked[case])
    assert checked["512x20x45:float32"]["shape"] == [1, 2, 20, 512]
    assert checked["512x20x45:float32"]["lse_shape"] == [1, 2, 20]


def test_bfloat16_is_within_its_rounding(checked):
    case = checked["64x50x33:bfloat16"]
    assert case["out"] < 1e-2 and case["lse"] < 1e-4  # the output stored in bf16; the lse kept in fp32
