"""Run by tests/bench/test_wide_attention.py in the CPU vLLM venv (it has Triton) with
TRITON_INTERPRET=1: bench/wide_attention.py's kernel on CPU tensors against float64 arithmetic.
Prints one JSON object of the largest errors; the test asserts on them.

    TRITON_INTERPRET=1 python tests/bench/wide_attention_checks.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from bench.wide_attention import wide_attention  # noqa: E402


def exact(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    scores = torch.matmul(q.double(), k.double().transpose(-1, -2)) * scale
    return torch.matmul(torch.softmax(scores, -1), v.double()), torch.logsumexp(scores, -1)


def main() -> None:
    generator = torch.Generator().manual_seed(0)
    results = {}
    # (head size, query rows, keys, dtype, tile): rows and keys off the tiles' multiples
    cases = [(64, 37, 70, torch.float32, (32, 32, 4, 1)), (512, 20, 45, torch.float32, (16, 16, 4, 1)),
             (64, 50, 33, torch.bfloat16, (32, 16, 4, 1))]
    for dim, rows, keys, dtype, tile in cases:
        q = torch.randn(1, 2, rows, dim, generator=generator).to(dtype)
        # the keys and values a view of a longer cache, as chunk_attention passes the earlier tokens
        cache = torch.randn(1, 2, keys + 9, dim, generator=generator).to(dtype)
        k, v = cache[:, :, :keys], (cache[:, :, :keys] * 0.5 + 0.1).to(dtype)
        out, lse = wide_attention(q, k, v, 0.3, tile)
        want_out, want_lse = exact(q, k, v, 0.3)
        results[f"{dim}x{rows}x{keys}:{str(dtype).split('.')[-1]}"] = {
            "out": (out.double() - want_out).abs().max().item(),
            "lse": (lse.double() - want_lse).abs().max().item(),
            "shape": list(out.shape), "lse_shape": list(lse.shape)}
    print(json.dumps(results))


if __name__ == "__main__":
    main()
