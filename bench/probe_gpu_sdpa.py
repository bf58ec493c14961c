"""What each of SDPA's kernels costs at the attention shapes the served passes run, first call and
steady: a kernel that builds something for each new shape (cuDNN's attention builds an execution
plan) pays it on the host, in an engine turn, whenever a pass meets a shape it had not seen.

For each shape (a layer type's heads, the rows and tokens of a served pass; every query head of a
KV head stacked along the tokens, as app/engine/hf/layers.py `grouped_attention` calls SDPA, with a
boolean mask) and each kernel: the first call, the steady mean of `--repeats` calls, and the first
call at a key length one shorter (a new prompt length). Then how far cuDNN's output is from the
memory-efficient kernel's. bf16 on CUDA; `--tiny` takes two small shapes, and on the CPU only the
math kernel runs (the smoke test of this script: `--tiny --device cpu`).

    python bench/probe_gpu_sdpa.py --out docs/results/h200_probe_sdpa.json     # on CUDA
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import header, machine, markdown_table, write_json  # noqa: E402

# (what it stands for, rows, KV heads, query rows a KV head holds (query heads per KV head x tokens),
# keys, head size): DiffusionGemma's sliding layers have 16 query heads on 8 KV heads of 256, its
# full layers 16 on 2 of 512 (docs/design.md §2); the vision tower 12 heads of 64.
SHAPES: tuple[tuple[str, int, int, int, int, int], ...] = (
    ("decoder, 32 canvases of 16 over 256-token prompts, sliding", 32, 8, 2 * 16, 272, 256),
    ("the same, full", 32, 2, 8 * 16, 272, 512),
    ("decoder, 1 canvas of 32 over a 300-token prompt, sliding", 1, 8, 2 * 32, 332, 256),
    ("decoder, 64 canvases of 16, sliding", 64, 8, 2 * 16, 272, 256),
    ("encoder, 32 suffixes of 160 over a 512-token prefix, sliding", 32, 8, 2 * 160, 672, 256),
    ("the same, full", 32, 2, 8 * 160, 672, 512),
    ("encoder, 8 prompts of 1,024, sliding", 8, 8, 2 * 1024, 1024, 256),
    ("encoder, 8 walk frames of 300 over a 512-token prefix, sliding", 8, 8, 2 * 300, 812, 256),
    # The vision tower (12 heads of 64, every head its own KV) over a frame's patch budget of 2,520.
    ("vision tower, 1 frame of 2,520 patches", 1, 12, 2520, 2520, 64),
    ("vision tower, 8 frames of 2,520 patches", 8, 12, 2520, 2520, 64),
)
SMALL_SHAPES = (("small, sliding-like", 2, 2, 2 * 8, 40, 16), ("small, full-like", 2, 1, 4 * 8, 40, 32))
KERNELS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_ms(call: Callable[[], torch.Tensor], device: torch.device, repeats: int) -> tuple[float, float]:
    """(the first call, the steady mean of `repeats` calls after three more), in ms."""
    sync(device)
    started = time.perf_counter()
    call()
    sync(device)
    first = (time.perf_counter() - started) * 1000
    for _ in range(3):
        call()
    sync(device)
    started = time.perf_counter()
    for _ in range(repeats):
        call()
    sync(device)
    return first, (time.perf_counter() - started) * 1000 / repeats


def probe_shape(shape: tuple[str, int, int, int, int, int], kernels: dict[str, SDPBackend], device: torch.device,
                dtype: torch.dtype, repeats: int) -> dict[str, Any]:
    name, rows, kv_heads, queries, keys, dim = shape
    generator = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(rows, kv_heads, queries, dim, device=device, dtype=dtype, generator=generator)
    k = torch.randn(rows, kv_heads, keys, dim, device=device, dtype=dtype, generator=generator)
    v = torch.randn(rows, kv_heads, keys, dim, device=device, dtype=dtype, generator=generator)
    mask = torch.rand(rows, 1, queries, keys, device=device, generator=generator) > 0.2
    mask[..., -1] = True  # every query row sees a key
    scale = dim ** -0.5
    result: dict[str, Any] = {"shape": name, "rows": rows, "kv_heads": kv_heads, "queries": queries, "keys": keys,
                              "head_size": dim}
    outputs: dict[str, torch.Tensor] = {}
    for label, kernel in kernels.items():
        try:
            with sdpa_kernel([kernel]):
                first, steady = timed_ms(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale),
                                         device, repeats)
                shorter, _ = timed_ms(lambda: F.scaled_dot_product_attention(
                    q, k[:, :, :-1], v[:, :, :-1], attn_mask=mask[..., 1:], scale=scale), device, 1)
                outputs[label] = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale).float()
            result[label] = {"first_ms": round(first, 2), "steady_ms": round(steady, 3),
                             "new_length_first_ms": round(shorter, 2)}
        except RuntimeError as exc:  # the kernel does not take this shape (cuDNN past head size 256)
            result[label] = {"error": str(exc).splitlines()[0][:120]}
    if "cudnn" in outputs and "efficient" in outputs:
        result["cudnn_vs_efficient_max_abs"] = float((outputs["cudnn"] - outputs["efficient"]).abs().max())
    return result


def cell(entry: dict[str, Any]) -> str:
    if "error" in entry:
        return f"- ({entry['error'][:40]})"
    return f"{entry['first_ms']:g} / {entry['steady_ms']:g} / {entry['new_length_first_ms']:g}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tiny", action="store_true", help="two small shapes (with --device cpu: the smoke test)")
    parser.add_argument("--repeats", type=int, default=20, help="calls in the steady mean")
    parser.add_argument("--out", help="write the rows as JSON here")
    args = parser.parse_args()
    device = torch.device(args.device)
    on_cuda = device.type == "cuda"
    kernels = KERNELS if on_cuda else {"math": SDPBackend.MATH}
    shapes = SMALL_SHAPES if args.tiny else SHAPES
    dtype = torch.bfloat16 if on_cuda else torch.float32
    rows = [probe_shape(shape, kernels, device, dtype, args.repeats) for shape in shapes]
    info = machine()
    columns = ["shape", *(f"{label}: first / steady / new length (ms)" for label in kernels)]
    print(header("probe_gpu_sdpa: SDPA's kernels at the served attention shapes", info))
    print()
    print(markdown_table(columns, [[row["shape"], *(cell(row[label]) for label in kernels)] for row in rows]))
    if args.out:
        write_json(args.out, {"machine": info, "cudnn": torch.backends.cudnn.version() if on_cuda else None,
                              "repeats": args.repeats, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
