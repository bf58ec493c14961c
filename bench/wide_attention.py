"""A candidate kernel for a long prompt's chunks: softmax attention with no mask, for head sizes past
flash attention's 256 (the full-attention layers' 512), returning the log-sum-exp per query row as
app/engine/hf/layers.py `attention_with_lse` does. A Triton flash-style forward pass: each program
holds a block of query rows and its float32 accumulator over the whole head size, and streams the
keys and values in blocks with an online softmax.

Not used by the server: `bench/probe_gpu_attention.py` times it on the GPU against SDPA's
memory-efficient kernel (what `chunk_attention` calls), over the tile shapes in TILES; it moves into
the engine only if it wins there. Correctness is checked on the CPU in Triton's interpreter
(tests/bench/test_wide_attention.py).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

# (rows of queries a program holds, keys a step reads, warps, pipeline stages): the probe's candidates.
TILES = ((64, 32, 8, 1), (64, 32, 8, 2), (64, 64, 8, 1), (128, 32, 8, 1), (32, 64, 4, 2))


@triton.jit
def _forward(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr,
             q_batch, q_head, q_row, k_batch, k_head, k_row, v_batch, v_head, v_row,
             o_batch, o_head, o_row, heads, rows, keys, scale,
             DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, INTERPRETED: tl.constexpr):
    block = tl.program_id(0)
    batch_head = tl.program_id(1)
    batch = batch_head // heads
    head = batch_head % heads
    row_ids = block * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, DIM)
    row_ok = row_ids < rows
    q = tl.load(q_ptr + batch * q_batch + head * q_head + row_ids[:, None] * q_row + dims[None, :],
                mask=row_ok[:, None], other=0.0)
    if INTERPRETED:  # the interpreter's bf16 dot is wrong; a bf16 product is exact in fp32
        q = q.to(tl.float32)
    log2_scale = scale * 1.4426950408889634  # exp(x) = exp2(x * log2(e))
    peak = tl.full([BLOCK_M], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DIM], tl.float32)
    for start in range(0, keys, BLOCK_N):
        key_ids = start + tl.arange(0, BLOCK_N)
        key_ok = key_ids < keys
        k = tl.load(k_ptr + batch * k_batch + head * k_head + key_ids[None, :] * k_row + dims[:, None],
                    mask=key_ok[None, :], other=0.0)
        if INTERPRETED:
            k = k.to(tl.float32)
        scores = tl.dot(q, k) * log2_scale
        scores = tl.where(key_ok[None, :], scores, float("-inf"))
        new_peak = tl.maximum(peak, tl.max(scores, 1))
        rescale = tl.exp2(peak - new_peak)
        probs = tl.exp2(scores - new_peak[:, None])
        total = total * rescale + tl.sum(probs, 1)
        v = tl.load(v_ptr + batch * v_batch + head * v_head + key_ids[:, None] * v_row + dims[None, :],
                    mask=key_ok[:, None], other=0.0)
        weights = probs.to(v_ptr.dtype.element_ty)  # as flash attention, the probabilities in the inputs' type
        if INTERPRETED:
            weights, v = weights.to(tl.float32), v.to(tl.float32)
        acc = acc * rescale[:, None] + tl.dot(weights, v)
        peak = new_peak
    out = acc / total[:, None]
    tl.store(o_ptr + batch * o_batch + head * o_head + row_ids[:, None] * o_row + dims[None, :],
             out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None])
    lse = (peak + tl.log2(total)) / 1.4426950408889634  # back to natural log
    tl.store(lse_ptr + batch_head * rows + row_ids, lse, mask=row_ok)


# Triton's interpreter (the CPU tests) makes @triton.jit kernels plain functions.
INTERPRETED = not isinstance(_forward, JITFunction)


def wide_attention(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
                   tile: tuple[int, int, int, int] = TILES[0]) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [batch, heads, rows, dim], lse [batch, heads, rows] float32) of softmax(q·kᵀ·scale)·v, no
    mask; `keys` and `values` have as many heads as `queries` (stack query heads along the rows first,
    as `chunk_attention` does). The last dimension must be contiguous; the head size a power of two."""
    batch, heads, rows, dim = queries.shape
    if dim & (dim - 1) or keys.shape[:2] != (batch, heads) or values.shape[-1] != dim:
        raise ValueError(f"shapes {tuple(queries.shape)}, {tuple(keys.shape)}, {tuple(values.shape)}")
    for tensor in (queries, keys, values):
        if tensor.stride(-1) != 1:
            raise ValueError("the head dimension must be contiguous")
    out = torch.empty_like(queries)
    lse = torch.empty((batch, heads, rows), dtype=torch.float32, device=queries.device)
    block_m, block_n, warps, stages = tile
    grid = (math.ceil(rows / block_m), batch * heads)
    _forward[grid](queries, keys, values, out, lse,
                   queries.stride(0), queries.stride(1), queries.stride(2),
                   keys.stride(0), keys.stride(1), keys.stride(2),
                   values.stride(0), values.stride(1), values.stride(2),
                   out.stride(0), out.stride(1), out.stride(2), heads, rows, keys.shape[2], scale,
                   DIM=dim, BLOCK_M=block_m, BLOCK_N=block_n, INTERPRETED=INTERPRETED, num_warps=warps,
                   num_stages=stages)
    return out, lse
