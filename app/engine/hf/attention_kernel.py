"""A Triton attention kernel for a long prompt's chunks on CUDA, where torch's own kernels are slow:
head sizes past flash attention's 256 (the full-attention layers' 512, where SDPA falls back to its
memory-efficient kernel at about a fifth of the H200's rate), and the sliding layers' window, which
SDPA reads through a dense mask. Imported only where Triton is (CUDA hosts, and the CPU tests through
Triton's interpreter); docs/design.md §4.9 gives the measurements behind it.

A flash-style forward pass: each program holds a block of query rows of one query head (its KV head
`head // groups`) and a float32 accumulator over a part of the head size, streams the keys and values
in blocks with an online softmax, and stores the output and the log-sum-exp per row, which
`layers.chunk_attention` needs to merge the softmax over earlier tokens with the chunk's own.

- No mask: every key, as a full-attention layer reads the tokens before a chunk.
- A band `(offset, window)`: query row r sits at position offset + r and reads the keys in
  (position - window, position]: causal, and the sliding window. The programs skip the key blocks
  wholly outside their rows' band.
- With `parts` 2, two programs share a block of query rows, each computing the scores (the
  query-key product done twice) but holding half the accumulator: at head size 512 on the H200 that
  ran faster than one program holding it whole (28.7 against 36.5 ms a chunk at 100k keys; the
  probe in docs/benchmarks.md).

INTERPRETED (Triton's interpreter, the CPU tests) works around its wrong bf16 `tl.dot` by taking the
operands to fp32 (a bf16 product is exact in fp32, and the tensor cores accumulate in fp32 too).
The lengths are left unspecialised, so one compile per head size and tile serves every prompt
length (nothing compiles after `ready`: the start-up warm-up encodes a chunked prompt)."""

from __future__ import annotations

import math

import torch
import triton  # pyright: ignore[reportMissingImports]  # optional: Triton
import triton.language as tl  # pyright: ignore[reportMissingImports]  # optional: Triton
from triton.runtime.jit import JITFunction  # pyright: ignore[reportMissingImports]  # optional: Triton

# (query rows a program holds, keys a step reads, warps, pipeline stages, parts of the head size the
# accumulator is split into), per head size: the fastest of the candidate tiles timed on an H200
# (docs/benchmarks.md).
TILES: dict[int, tuple[int, int, int, int, int]] = {512: (128, 64, 8, 1, 2), 256: (128, 64, 8, 1, 1)}
SMALL_TILE = (64, 32, 4, 1, 1)  # any other head size (the tiny test model's)

# The lengths a prompt changes are not specialised (one compile serves every prompt). The strides
# are: Triton's specialisation on multiples of 16 is what lets it load the tiles in wide vectors (the
# H200 probe: 82 ms a chunk with every integer unspecialised, 26-29 ms otherwise), and
# every stride here is a multiple of the head size, so the compiles stay one per head size and tile.
_LENGTHS = ("rows", "keys", "offset", "window")


@triton.jit(do_not_specialize=_LENGTHS)
def _forward(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr,
             q_batch, q_head, q_row, k_batch, k_head, k_row, v_batch, v_head, v_row,
             o_batch, o_head, o_row, heads, groups, rows, keys, offset, window, scale,
             DIM: tl.constexpr, PART: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
             BANDED: tl.constexpr, INTERPRETED: tl.constexpr):
    block = tl.program_id(0)
    batch_head = tl.program_id(1)
    part = tl.program_id(2)
    batch = batch_head // heads
    head = batch_head % heads
    kv_head = head // groups
    row_ids = block * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, DIM)
    out_dims = part * PART + tl.arange(0, PART)  # the output columns this program holds
    row_ok = row_ids < rows
    q = tl.load(q_ptr + batch * q_batch + head * q_head + row_ids[:, None] * q_row + dims[None, :],
                mask=row_ok[:, None], other=0.0)
    if INTERPRETED:
        q = q.to(tl.float32)
    log2_scale = scale * 1.4426950408889634  # exp(x) = exp2(x * log2(e))
    k_base = k_ptr + batch * k_batch + kv_head * k_head
    v_base = v_ptr + batch * v_batch + kv_head * v_head
    peak = tl.full([BLOCK_M], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, PART], tl.float32)
    positions = row_ids + offset
    low = 0
    high = keys
    if BANDED:  # only the key blocks some row of this block can see
        low = tl.maximum(block * BLOCK_M + offset - window + 1, 0) // BLOCK_N * BLOCK_N
        high = tl.minimum(block * BLOCK_M + BLOCK_M + offset, keys)
    for start in range(low, high, BLOCK_N):
        key_ids = start + tl.arange(0, BLOCK_N)
        key_ok = key_ids < keys
        k = tl.load(k_base + key_ids[None, :] * k_row + dims[:, None], mask=key_ok[None, :], other=0.0)
        if INTERPRETED:
            k = k.to(tl.float32)
        scores = tl.dot(q, k) * log2_scale
        visible = key_ok[None, :]
        if BANDED:
            visible = visible & (key_ids[None, :] <= positions[:, None]) & (key_ids[None, :] > positions[:, None] - window)
        scores = tl.where(visible, scores, float("-inf"))
        new_peak = tl.maximum(peak, tl.max(scores, 1))
        # a row that has seen no key yet keeps a peak of -inf: subtract 0 there, not -inf (NaN)
        shift = tl.where(new_peak == float("-inf"), 0.0, new_peak)
        rescale = tl.exp2(peak - shift)
        probs = tl.exp2(scores - shift[:, None])
        total = total * rescale + tl.sum(probs, 1)
        v = tl.load(v_base + key_ids[:, None] * v_row + out_dims[None, :], mask=key_ok[:, None], other=0.0)
        weights = probs.to(v_ptr.dtype.element_ty)  # as flash attention, the probabilities in the inputs' type
        if INTERPRETED:
            weights, v = weights.to(tl.float32), v.to(tl.float32)
        acc = acc * rescale[:, None] + tl.dot(weights, v)
        peak = new_peak
    out = acc / total[:, None]
    tl.store(o_ptr + batch * o_batch + head * o_head + row_ids[:, None] * o_row + out_dims[None, :],
             out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None])
    if part == 0:
        lse = (peak + tl.log2(total)) / 1.4426950408889634  # back to natural log
        tl.store(lse_ptr + batch_head * rows + row_ids, lse, mask=row_ok)


# Triton's interpreter (the CPU tests) makes @triton.jit kernels plain functions.
INTERPRETED = not isinstance(_forward, JITFunction)


def attention(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float, *,
              band: tuple[int, int] | None = None, out: torch.Tensor | None = None,
              tile: tuple[int, int, int, int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [batch, heads, rows, dim], lse [batch, heads, rows] float32) of softmax(q·kᵀ·scale)·v.

    `queries` [batch, heads, rows, dim]; `keys`, `values` [batch, kv heads, keys, dim], kv heads
    dividing heads (query head h reads KV head h // (heads / kv heads)); `band` as the module says
    (None: no mask); `out`, where given, any [batch, heads, rows, dim] view to write into (e.g. a
    transposed [batch, rows, heads, dim] buffer). The last dimension of each must be contiguous, the
    head size a power of two."""
    batch, heads, rows, dim = queries.shape
    kv_heads = keys.shape[1]
    if (dim & (dim - 1) or keys.shape[0] != batch or heads % kv_heads or values.shape[:3] != keys.shape[:3]
            or keys.shape[-1] != dim or values.shape[-1] != dim):
        raise ValueError(f"shapes {tuple(queries.shape)}, {tuple(keys.shape)}, {tuple(values.shape)}")
    if out is None:
        out = torch.empty_like(queries)
    for tensor in (queries, keys, values, out):
        if tensor.stride(-1) != 1:
            raise ValueError("the head dimension must be contiguous")
    block_m, block_n, warps, stages, parts = tile or TILES.get(dim, SMALL_TILE)
    if dim % parts:
        raise ValueError(f"head size {dim} does not split into {parts} parts")
    lse = torch.empty((batch, heads, rows), dtype=torch.float32, device=queries.device)
    offset, window = band if band is not None else (0, 0)
    grid = (math.ceil(rows / block_m), batch * heads, parts)
    # For the checker: without Triton @triton.jit is unresolved and the kernel its plain function (no [grid]).
    _forward[grid](queries, keys, values, out, lse,  # pyright: ignore[reportIndexIssue]
                   queries.stride(0), queries.stride(1), queries.stride(2),
                   keys.stride(0), keys.stride(1), keys.stride(2),
                   values.stride(0), values.stride(1), values.stride(2),
                   out.stride(0), out.stride(1), out.stride(2), heads, heads // kv_heads, rows, keys.shape[2],
                   offset, window, scale,
                   DIM=dim, PART=dim // parts, BLOCK_M=block_m, BLOCK_N=block_n, BANDED=band is not None,
                   INTERPRETED=INTERPRETED, num_warps=warps, num_stages=stages)  # pyright: ignore[reportCallIssue]
    return out, lse


def compiled_kernels() -> int:
    """Compiles of the kernel so far (every head size, tile and specialisation)."""
    from app.engine.hf.moe.fused import jit_compiles

    return jit_compiles(_forward)
