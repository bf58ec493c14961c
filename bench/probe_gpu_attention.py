"""Which kernel reads a long prompt's chunk fastest on CUDA, as app/engine/hf/layers.py
`chunk_attention` calls it: a chunk's queries over the KV of every earlier token and its own.

- Full-attention layer (16 query heads on 2 KV heads of head size 512), at each prompt length:
  - `sdpa`: the path without Triton: the earlier tokens through SDPA's memory-efficient kernel (every
    query head of a KV head stacked along the tokens), the chunk's own causally, the two softmaxes
    merged by their log-sum-exps;
  - `triton M/N/w/s/p`: the same with the earlier tokens through app/engine/hf/attention_kernel.py's
    kernel at each candidate tile (query rows a program holds / keys a step reads / warps / stages /
    parts of the head size the accumulator is split into);
  - `triton band M/N/w/s/p`: the kernel's one banded pass over every key (no merge; slower: its
    mask's registers).
- Sliding layer (16 query heads on 8 KV heads of 256, a 1,024-token window: the chunk's queries over
  the 1,023 earlier tokens it keeps and its own): `sdpa` (the masked grouped attention),
  FlexAttention with a sliding block mask, and the Triton kernel's candidate tiles.

Each is checked against float64 arithmetic at the shortest length (the sliding layer: its one size)
and timed after a warm-up call.

    python bench/probe_gpu_attention.py                      # on CUDA; prints two tables
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from app.engine.hf import layers  # noqa: E402
from bench.common import markdown_table  # noqa: E402

Kernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
Tile = tuple[int, int, int, int, int]
FULL_TILES: tuple[Tile, ...] = ((64, 64, 8, 1, 1), (128, 64, 8, 1, 2), (128, 32, 8, 2, 2), (128, 64, 8, 1, 4))
SLIDING_TILES: tuple[Tile, ...] = ((64, 64, 4, 1, 1), (128, 64, 8, 1, 1), (64, 64, 4, 2, 1), (128, 32, 8, 2, 1),
                                   (128, 64, 8, 1, 2), (64, 32, 4, 3, 1))


def sdpa(window: int | None) -> Kernel:
    return lambda q, k, v: layers.chunk_attention_with(None, q, k, v, 1.0, window)


def triton(tile: Tile, window: int | None) -> Kernel:
    from app.engine.hf.attention_kernel import attention

    def kernel(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return attention(*args, **kwargs, tile=tile)

    return lambda q, k, v: layers.chunk_attention_with(kernel, q, k, v, 1.0, window)


def band(tile: Tile) -> Kernel:
    from app.engine.hf.attention_kernel import attention

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        batch, heads, tokens, dim = q.shape
        out = q.new_empty(batch, tokens, heads, dim)
        attention(q, k, v, 1.0, band=(k.shape[2] - tokens, k.shape[2]), out=out.transpose(1, 2), tile=tile)
        return out

    return run


def flex_sliding(tokens: int, past: int, window: int) -> Kernel:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    def band(b: Any, h: Any, query: Any, key: Any) -> Any:
        return (key <= query + past) & (key > query + past - window)

    block_mask = create_block_mask(band, None, None, tokens, past + tokens, device="cuda")
    compiled = torch.compile(flex_attention, dynamic=False)
    return lambda q, k, v: compiled(q, k, v, block_mask=block_mask, scale=1.0, enable_gqa=True).transpose(1, 2)


def exact(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None) -> torch.Tensor:
    tokens, keys = q.shape[2], k.shape[2]
    groups = q.shape[1] // k.shape[1]
    positions = torch.arange(tokens, device=q.device).unsqueeze(1) + keys - tokens
    columns = torch.arange(keys, device=q.device).unsqueeze(0)
    visible = (columns <= positions) & (columns > positions - (window or keys))
    out = torch.empty(q.shape, dtype=torch.float64, device=q.device)
    for head in range(q.shape[1]):  # a head at a time: float64 scores of 16 heads would not fit at 32k
        scores = torch.matmul(q[:, head].double(), k[:, head // groups].double().transpose(-1, -2))
        out[:, head] = torch.matmul(torch.softmax(scores.masked_fill(~visible, float("-inf")), -1),
                                    v[:, head // groups].double())
    return out.transpose(1, 2)


def timed(kernel: Kernel, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, reps: int) -> float:
    kernel(q, k, v)
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(reps):
        kernel(q, k, v)
    torch.cuda.synchronize()
    return (time.perf_counter() - started) / reps * 1000


def tensors(heads: int, kv_heads: int, tokens: int, keys: int, dim: int,
            generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    def normed(*shape: int) -> torch.Tensor:  # RMS-normed as the layer's q_norm / k_norm leave them
        x = torch.randn(*shape, generator=generator, device="cuda")
        return (x / x.pow(2).mean(-1, keepdim=True).sqrt()).to(torch.bfloat16)

    return normed(1, heads, tokens, dim), normed(1, kv_heads, keys, dim), normed(1, kv_heads, keys, dim)


def measure(kernels: dict[str, Kernel], shapes: list[tuple[int, int, int, int, int]], window: int | None,
            reps: int, generator: torch.Generator) -> list[list[str]]:
    """One row per kernel: its largest error at the first shape, then ms at each shape."""
    rows = []
    checked = tensors(*shapes[0], generator=generator)
    want = exact(*checked, window)
    for name, kernel in kernels.items():
        try:
            error = (kernel(*checked).double() - want).abs().max().item()
            times = []
            for shape in shapes:
                big = tensors(*shape, generator=generator)
                times.append(f"{timed(kernel, *big, reps):.2f}")
                del big
            rows.append([name, f"{error:.2e}", *times])
        except Exception as failure:  # noqa: BLE001 - a probe: say why and go on
            print(f"{name}: {type(failure).__name__}: {str(failure)[:300]}")
            continue
        print(rows[-1], flush=True)
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="32768,100000", help="earlier tokens a full layer's chunk reads")
    parser.add_argument("--chunk", type=int, default=2048)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    generator = torch.Generator(device="cuda").manual_seed(0)
    lengths = [int(part) for part in args.lengths.split(",")]
    chunk = args.chunk

    full: dict[str, Kernel] = {"sdpa": sdpa(None)}
    full.update({"triton " + "/".join(map(str, tile)): triton(tile, None) for tile in FULL_TILES})
    full["triton band 128/64/8/1/2"] = band((128, 64, 8, 1, 2))
    shapes = [(16, 2, chunk, length + chunk, 512) for length in lengths]
    rows = measure(full, shapes, None, args.reps, generator)
    print(f"\nA full-attention layer's chunk ({chunk} queries x 16 heads, 2 KV heads of 512):\n")
    print(markdown_table(["kernel", "max abs error", *[f"ms, {n} earlier tokens" for n in lengths]], rows))

    window = 1024
    sliding: dict[str, Kernel] = {"sdpa, masked": sdpa(window)}
    try:
        sliding["flex, sliding block mask"] = flex_sliding(chunk, window - 1, window)
    except Exception as error:  # noqa: BLE001
        print(f"flex sliding: {error}")
    sliding.update({"triton " + "/".join(map(str, tile)): triton(tile, window) for tile in SLIDING_TILES})
    rows = measure(sliding, [(16, 8, chunk, window - 1 + chunk, 256)], window, args.reps, generator)
    print(f"\nA sliding layer's chunk ({chunk} queries x 16 heads over {window - 1} + {chunk} keys, 8 KV heads "
          f"of 256, window {window}):\n")
    print(markdown_table(["kernel", "max abs error", "ms"], rows))


if __name__ == "__main__":
    main()
