"""Run by tests/engine/hf/attention/test_attention_kernel.py in the CPU vLLM venv (it has Triton) with
TRITON_INTERPRET=1: app/engine/hf/attention_kernel.py's kernel on CPU tensors against float64
arithmetic. Prints one JSON object of the largest errors per case; the tests assert on them.

    TRITON_INTERPRET=1 python tests/engine/hf/attention/checks.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[4]))

import torch  # noqa: E402

from app.engine.hf.attention_kernel import attention  # noqa: E402


def exact(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
          band: tuple[int, int] | None) -> tuple[torch.Tensor, torch.Tensor]:
    groups = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(groups, 1), v.double().repeat_interleave(groups, 1)
    scores = torch.matmul(q.double(), k.transpose(-1, -2)) * scale
    if band is not None:
        offset, window = band
        positions = torch.arange(q.shape[2]).unsqueeze(1) + offset
        keys = torch.arange(k.shape[2]).unsqueeze(0)
        scores = scores.masked_fill(~((keys <= positions) & (keys > positions - window)), float("-inf"))
    return torch.matmul(torch.softmax(scores, -1), v), torch.logsumexp(scores, -1)


def main() -> None:
    generator = torch.Generator().manual_seed(0)
    results = {}
    # name: (head size, query heads, kv heads, query rows, keys, dtype, tile, band, write into a
    # transposed buffer); rows and keys off the tiles' multiples, bands starting past the first key block
    cases = {
        "64:float32": (64, 2, 2, 37, 70, torch.float32, (32, 32, 4, 1, 1), None, False),
        "512:float32": (512, 2, 2, 20, 45, torch.float32, (16, 16, 4, 1, 1), None, False),
        "64:bfloat16": (64, 2, 2, 50, 33, torch.bfloat16, (32, 16, 4, 1, 1), None, False),
        "512:parts2": (512, 2, 2, 20, 45, torch.float32, (16, 16, 4, 1, 2), None, False),
        "64:parts4": (64, 2, 2, 37, 70, torch.float32, (32, 32, 4, 1, 4), None, False),
        "64:groups": (64, 4, 2, 21, 40, torch.float32, (16, 16, 4, 1, 1), None, False),
        "64:sliding": (64, 4, 2, 40, 40 + 11, torch.float32, (16, 16, 4, 1, 1), (11, 12), True),
        "64:causal": (64, 2, 1, 33, 33, torch.float32, (16, 16, 4, 1, 2), (0, 10**6), False),
        "64:causal_past": (64, 2, 2, 19, 19 + 30, torch.float32, (16, 16, 4, 1, 1), (30, 10**6), True),
    }
    for name, (dim, heads, kv_heads, rows, keys, dtype, tile, band, transposed) in cases.items():
        q = torch.randn(1, heads, rows, dim, generator=generator).to(dtype)
        # the keys and values a view of a longer cache, as chunk_attention passes the earlier tokens
        cache = torch.randn(1, kv_heads, keys + 9, dim, generator=generator).to(dtype)
        k, v = cache[:, :, :keys], (cache[:, :, :keys] * 0.5 + 0.1).to(dtype)
        into = torch.full((1, rows, heads, dim), float("nan"), dtype=dtype).transpose(1, 2) if transposed else None
        out, lse = attention(q, k, v, 0.3, band=band, out=into, tile=tile)
        want_out, want_lse = exact(q, k, v, 0.3, band)
        results[name] = {"out": (out.double() - want_out).abs().max().item(),
                         "lse": (lse.double() - want_lse).abs().max().item(),
                         "shape": list(out.shape), "lse_shape": list(lse.shape),
                         "into": into is not None and out.data_ptr() == into.data_ptr()}
    results.update(through_layers(generator))
    print(json.dumps(results))


def through_layers(generator: torch.Generator) -> dict:
    """layers.chunk_attention_with the kernel (what chunk_attention runs on CUDA) against it with
    torch's kernels only (the CPU path), for a full-attention layer's chunk (queries sharing KV heads,
    earlier tokens) and a sliding layer's (a window shorter than the earlier tokens it holds)."""
    from app.engine.hf.layers import chunk_attention_with

    out = {}
    for name, (window, held) in {"layers:full": (None, 50), "layers:sliding": (16, 15)}.items():
        q = torch.randn(1, 4, 24, 64, generator=generator)
        k, v = torch.randn(1, 2, held + 24, 64, generator=generator), torch.randn(1, 2, held + 24, 64, generator=generator)
        got = chunk_attention_with(attention, q, k, v, 0.2, window)
        want = chunk_attention_with(None, q, k, v, 0.2, window)
        out[name] = {"out": (got.double() - want.double()).abs().max().item(), "shape": list(got.shape)}
    return out


if __name__ == "__main__":
    main()
