"""Which kernel reads a long prompt's earlier tokens fastest for one chunk in a full-attention layer
(head_dim 512, 2 KV heads, 16 query heads: the query heads of a KV head stacked along the tokens, as
app/engine/hf/layers.py `chunk_attention` does), with its log-sum-exp:

- `efficient`: SDPA's memory-efficient kernel (what `chunk_attention` calls on CUDA);
- `blocks`: the keys in blocks, scores as a float32 matmul (TF32 tensor cores: the bf16 inputs are
  exact in TF32), an online softmax across blocks, the probabilities in bf16 for the value matmul;
- `flex`: torch's FlexAttention (Triton), when it compiles for this head size;
- `triton M/N/w/s`: bench/wide_attention.py's flash-style kernel at each of its TILES.

Each is timed at the prompt lengths given and checked against float32 arithmetic at a short one.

Then a sliding-window layer's chunk (16 query heads on 8 KV heads of 256, a 1,024-token window: the
chunk's 2,048 queries over the 1,023 earlier tokens it keeps and itself): `grouped_attention` under
the small mask (what `chunk_attention` does) against FlexAttention with a sliding block mask, which
skips the blocks the window hides.

    python bench/probe_gpu_attention.py                      # on CUDA; prints a table
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import markdown_table  # noqa: E402

Kernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def efficient(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, False, scale=1.0)[:2]
    return out, lse[..., :q.shape[2]]


def blocks(block: int) -> Kernel:
    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        previous = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = True
        try:
            qf = q.float()
            out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
            peak = torch.full(q.shape[:-1], float("-inf"), device=q.device)
            total = torch.zeros(q.shape[:-1], device=q.device)
            for start in range(0, k.shape[2], block):
                scores = torch.matmul(qf, k[:, :, start:start + block].float().transpose(-1, -2))
                new_peak = torch.maximum(peak, scores.amax(-1))
                rescale = torch.exp(peak - new_peak)
                probs = torch.exp(scores - new_peak.unsqueeze(-1))
                total = total * rescale + probs.sum(-1)
                out = out * rescale.unsqueeze(-1) + torch.matmul(probs.to(v.dtype), v[:, :, start:start + block]).float()
                peak = new_peak
            return (out / total.unsqueeze(-1)).to(q.dtype), peak + torch.log(total)
        finally:
            torch.backends.cuda.matmul.allow_tf32 = previous

    return run


def flex() -> Kernel:
    from torch.nn.attention.flex_attention import flex_attention

    compiled = torch.compile(flex_attention, dynamic=False)

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out, lse = compiled(q, k, v, scale=1.0, return_lse=True)
        return out, lse

    return run


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scores = torch.matmul(q.double(), k.double().transpose(-1, -2))
    return torch.matmul(torch.softmax(scores, -1), v.double()), torch.logsumexp(scores, -1)


def timed(kernel: Kernel, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, reps: int) -> float:
    kernel(q, k, v)
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(reps):
        kernel(q, k, v)
    torch.cuda.synchronize()
    return (time.perf_counter() - started) / reps * 1000


def sliding(chunk: int, reps: int) -> list[list[str]]:
    """The sliding layer's chunk: (kernel, max abs error against float64, ms)."""
    from app.engine.hf.layers import chunk_attention

    device = torch.device("cuda")
    heads, kv_heads, dim, window = 16, 8, 256, 1024
    past = window - 1
    generator = torch.Generator(device=device).manual_seed(1)

    def normed(*shape: int) -> torch.Tensor:
        x = torch.randn(*shape, generator=generator, device=device)
        return (x / x.pow(2).mean(-1, keepdim=True).sqrt()).to(torch.bfloat16)

    q, k, v = normed(1, heads, chunk, dim), normed(1, kv_heads, past + chunk, dim), normed(1, kv_heads, past + chunk, dim)
    rows = torch.arange(chunk, device=device).unsqueeze(1) + past
    columns = torch.arange(past + chunk, device=device).unsqueeze(0)
    mask = (columns <= rows) & (columns > rows - window)
    scores = torch.matmul(q.double(), k.double().repeat_interleave(2, 1).transpose(-1, -2)).masked_fill(~mask, float("-inf"))
    want = torch.matmul(torch.softmax(scores, -1), v.double().repeat_interleave(2, 1)).transpose(1, 2)
    kernels: dict[str, Callable[[], torch.Tensor]] = {
        "grouped_attention, masked": lambda: chunk_attention(q, k, v, 1.0, window)}
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        def band(b: Any, h: Any, query: Any, key: Any) -> Any:
            return (key <= query + past) & (key > query + past - window)

        block_mask = create_block_mask(band, None, None, chunk, past + chunk, device="cuda")
        compiled = torch.compile(flex_attention, dynamic=False)
        kernels["flex, sliding block mask"] = lambda: compiled(q, k, v, block_mask=block_mask, scale=1.0,
                                                               enable_gqa=True).transpose(1, 2)
    except Exception as error:  # noqa: BLE001 - a probe: say why and go on
        print(f"flex sliding: {error}")
    out = []
    for name, kernel in kernels.items():
        try:
            error = (kernel().double() - want).abs().max().item()
            kernel()
            torch.cuda.synchronize()
            started = time.perf_counter()
            for _ in range(reps):
                kernel()
            torch.cuda.synchronize()
            out.append([name, f"{error:.2e}", f"{(time.perf_counter() - started) / reps * 1000:.2f}"])
        except Exception as failure:  # noqa: BLE001
            print(f"{name}: {type(failure).__name__}: {failure}")
        print(out[-1] if out else name, flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="32768,100000")
    parser.add_argument("--chunk", type=int, default=2048)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    device = torch.device("cuda")
    kv_heads, groups, dim = 2, 8, 512
    queries = groups * args.chunk
    kernels: dict[str, Kernel] = {"efficient": efficient, "blocks 4096": blocks(4096), "blocks 16384": blocks(16384)}
    try:
        kernels["flex"] = flex()
    except Exception as error:  # noqa: BLE001 - a probe: say why and go on
        print(f"flex: {error}")
    from bench.wide_attention import TILES, wide_attention

    for tile in TILES:
        kernels["triton " + "/".join(map(str, tile))] = (
            lambda q, k, v, tile=tile: wide_attention(q, k, v, 1.0, tile))
    generator = torch.Generator(device=device).manual_seed(0)

    def tensors(length: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        def normed(*shape: int) -> torch.Tensor:  # RMS-normed as the layer's q_norm / k_norm leave them
            x = torch.randn(*shape, generator=generator, device=device)
            return (x / x.pow(2).mean(-1, keepdim=True).sqrt()).to(torch.bfloat16)

        return normed(1, kv_heads, queries, dim), normed(1, kv_heads, length, dim), normed(1, kv_heads, length, dim)

    rows = []
    q, k, v = tensors(4096)
    want_out, want_lse = reference(q, k, v)
    for name, kernel in list(kernels.items()):
        try:
            out, lse = kernel(q, k, v)
            error = (out.double() - want_out).abs().max().item()
            lse_error = (lse.double() - want_lse).abs().max().item()
        except Exception as failure:  # noqa: BLE001
            print(f"{name}: {type(failure).__name__}: {failure}")
            del kernels[name]
            continue
        times = []
        for length in [int(part) for part in args.lengths.split(",")]:
            big = tensors(length)
            times.append(f"{timed(kernel, *big, args.reps):.1f}")
            del big
            torch.cuda.empty_cache()
        rows.append([name, f"{error:.2e}", f"{lse_error:.2e}", *times])
        print(rows[-1], flush=True)
    print(markdown_table(["kernel", "max abs error (out, 4k keys)", "lse error", *[f"ms at {n} keys" for n in
                                                                               args.lengths.split(",")]], rows))
    print("\nA sliding layer's chunk (16 x 2048 queries over 1,023 + 2,048 keys, window 1,024):\n")
    print(markdown_table(["kernel", "max abs error", "ms"], sliding(args.chunk, args.reps)))


if __name__ == "__main__":
    main()
