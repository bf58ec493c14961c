"""Run by tests/engine/hf/moe/test_fp8.py in the CPU vLLM venv (.venv-vllm has Triton; the main venv
does not need it) with TRITON_INTERPRET=1: Triton's interpreter runs the FP8 experts' kernels
(app/engine/hf/moe/fp8_kernels.py) on CPU tensors. Prints one JSON object of measurements; the test
asserts on them.

    python tests/engine/hf/moe/fp8_checks.py
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[4]))
os.environ["TRITON_INTERPRET"] = "1"  # read when Triton's kernels are first defined: before any import of them

import torch  # noqa: E402
import triton  # noqa: E402

from app.engine.hf import fp8  # noqa: E402
from app.engine.hf.moe import fp8 as fp8_moe  # noqa: E402
from app.engine.hf.moe.fp8_kernels import fp8_quantize_kernel  # noqa: E402
from app.engine.hf.moe.kernels import RUN_INTERPRETED  # noqa: E402
from app.engine.hf.moe.pairs import warm_up_tokens  # noqa: E402


def e4m3_grid() -> torch.Tensor:
    """Every finite non-negative e4m3 value, ascending."""
    values = torch.arange(128, dtype=torch.uint8).view(fp8.E4M3).to(torch.float32)
    return values[~values.isnan()]


def quantize_rows(x: torch.Tensor, block_m: int, block_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`x`'s rows through `fp8_quantize_kernel`, `block_m` rows a program: (e4m3 rows, float32 scales)."""
    q = torch.empty(x.shape, dtype=fp8.E4M3)
    scales = torch.empty(x.shape[0])
    fp8_quantize_kernel[(triton.cdiv(x.shape[0], block_m),)](
        x, q, scales, x.shape[0], x.shape[1], x.stride(0), q.stride(0), BLOCK_M=block_m, BLOCK_K=block_k,
        INTERPRETED=RUN_INTERPRETED)
    return q, scales


def quantize_case() -> dict:
    """The product rows' quantization kernel (`fp8_quantize_kernel`, as fp8_expert_rows launches it:
    several programs of rows, the last one partial, the row width in several steps) against
    app/engine/hf/fp8.py's `quantize_tokens`, bit for bit: random rows over eight decades (bf16 and
    fp32), a zero row, and rows of scale exactly 1 (their largest value is 448) holding every
    midpoint between neighbouring e4m3 values (ties, subnormal ones included) and every e4m3 value
    itself."""
    generator = torch.Generator().manual_seed(1)
    grid = e4m3_grid()
    midpoints = (grid[1:] + grid[:-1]) / 2
    exact_rows = torch.cat([grid, -grid, midpoints, -midpoints])
    width = 256
    exact_rows = torch.cat([exact_rows, torch.zeros(-exact_rows.numel() % (width - 1))]).view(-1, width - 1)
    exact_rows = torch.cat([torch.full((exact_rows.shape[0], 1), 448.0), exact_rows], dim=1)
    spread = 10.0 ** torch.randint(-4, 4, (40, 1), generator=generator)
    random_rows = torch.randn(40, width, generator=generator) * spread * torch.rand(40, width, generator=generator)
    rows = torch.cat([exact_rows, random_rows, torch.zeros(1, width)])
    results = {"ties": int(midpoints.numel() * 2), "subnormal_ties": int((midpoints < 2 ** -6).sum() * 2)}
    block_m = 8  # 43 rows: six programs, the last with three
    for dtype in (torch.float32, torch.bfloat16):
        x = rows.to(dtype)
        q, scales = quantize_rows(x, block_m, 64)
        want_q, want_scales = fp8.quantize_tokens(x)
        narrow = x[:, :200]  # strided rows, a partial last step of columns
        narrow_q, narrow_scales = quantize_rows(narrow, block_m, 128)
        want_narrow_q, want_narrow_scales = fp8.quantize_tokens(narrow)
        name = str(dtype).removeprefix("torch.")
        results[name] = {
            "values": q.numel() + narrow_q.numel(), "rows": x.shape[0], "programs": triton.cdiv(x.shape[0], block_m),
            "q_mismatches": int((q.view(torch.uint8) != want_q.view(torch.uint8)).sum())
            + int((narrow_q.view(torch.uint8) != want_narrow_q.view(torch.uint8)).sum()),
            "scale_mismatches": int((scales != want_scales).sum()) + int((narrow_scales != want_narrow_scales).sum()),
            "zero_row_scale": scales[-1].item(),
        }
    return results


def quantized_banks(experts: int, hidden: int, inter: int, generator: torch.Generator) -> fp8_moe.Banks:
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=generator) / hidden ** 0.5
    down = torch.randn(experts, hidden, inter, generator=generator) / inter ** 0.5
    return fp8_moe.Banks(*fp8.quantize_weight(gate_up), *fp8.quantize_weight(down))


def kernel_cases() -> list[dict]:
    """Each tile configuration (the one block_config picks for the shape, and the large tiles'
    own down tiles), in float32 and bfloat16, against the reference on the same inputs: odd token
    counts, a hidden size and an expert FFN that leave partial tiles, a token of zeros, and an
    expert no token chose."""
    results = []
    generator = torch.Generator().manual_seed(0)
    shapes = {  # tokens, hidden, inter, experts, top_k: the pairs an expert gets pick each config
        "16": (7, 64, 48, 8, 2),
        "32": (41, 96, 48, 4, 3),
        "64": (101, 160, 80, 4, 2),
        "128": (301, 64, 32, 2, 2),
    }
    for name, (tokens, hidden, inter, experts, top_k) in shapes.items():
        config = fp8_moe.block_config(tokens * top_k, experts)
        banks = quantized_banks(experts, hidden, inter, generator)
        for dtype in (torch.float32, torch.bfloat16):
            x = (torch.randn(tokens, hidden, generator=generator) * 3).to(dtype)
            x[tokens // 2] = 0  # a row of zeros: scale 1e-12, quantized to zeros
            choices = experts - 1 if experts > top_k else experts  # the last expert left out when possible
            index = torch.stack([torch.randperm(choices, generator=generator)[:top_k] for _ in range(tokens)])
            want = fp8_moe.reference_expert_rows(x, index, *banks)
            got = fp8_moe.fp8_expert_rows(x, index, *banks)
            diff = (got.double() - want.double()).abs()
            results.append({
                "case": name, "tokens": tokens, "dtype": str(dtype).removeprefix("torch."), "block_m": config.block_m,
                "down_block_n": fp8_moe.DOWN_TILES.get(config, config).block_n,
                "shape": list(got.shape), "out_dtype": str(got.dtype).removeprefix("torch."),
                "unused_expert": experts > top_k and not bool((index == experts - 1).any()),
                "max_diff": diff.max().item(), "differing": int((diff > 0).sum()), "values": diff.numel(),
                "scale": want.abs().max().item(), "zero_token_rows": want.view(tokens, top_k, -1)[tokens // 2].abs().max().item(),
            })
    return results


def warm_up_case() -> dict:
    """`fp8_moe.warm_up` (what fused.warm_up_experts runs for an FP8 model) over a small experts
    module: it runs, and its token counts pick every tile."""
    from types import SimpleNamespace

    generator = torch.Generator().manual_seed(2)
    experts, top_k = 4, 2
    module = SimpleNamespace(**dict(zip(("gate_up_proj", "gate_up_proj_scale", "down_proj", "down_proj_scale"),
                                        quantized_banks(experts, 64, 32, generator))))
    fp8_moe.warm_up(module, torch.bfloat16, top_k)
    counts = warm_up_tokens(experts, top_k, fp8_moe.TILES)
    return {"counts": counts, "block_m": sorted({fp8_moe.block_config(n * top_k, experts).block_m for n in counts})}


if __name__ == "__main__":
    print(json.dumps({"interpreted": RUN_INTERPRETED, "quantize": quantize_case(), "kernels": kernel_cases(),
                      "warm_up": warm_up_case()}))
