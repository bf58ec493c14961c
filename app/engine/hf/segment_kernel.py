"""Attention by segment over a flat turn in Triton: one launch a layer for every segment of the turn,
reading each segment's stored keys through its sequence's block table. Imported only where Triton is
(CUDA hosts, and the CPU tests through Triton's interpreter); `SegmentAttention` in attention.py
builds the metadata once a turn and calls `segment_attention` once a layer.

A flash-style forward, as app/engine/hf/attention_kernel.py's (the long prompt's chunks), over a
list of work items: each program holds up to BLOCK_M query rows of one segment and one query head
(its KV head `head // groups`), and keeps a float32 accumulator over a part of the head size.

- The stored keys: positions [key_start, key_end) of the segment's sequence, each read at its slot
  `table[position // B − first_block] · B + position % B` of its layer's pool (B tokens a block). A
  prompt segment's own keys are among them (the forward writes them before attention), under its
  causal mask and, on a sliding layer, its window; the programs skip the key blocks wholly outside
  their rows' band.
- A canvas's own keys: rows [own_start, own_end) of the turn's new keys, after the stored ones, with
  no mask (a canvas reads itself bidirectionally). A prompt segment has none (own_start = own_end).

The lengths and every per-segment number are read from the metadata, not passed as arguments, so one
compile per head size and tile serves every turn (nothing compiles after `ready`).
"""

from __future__ import annotations

import torch
import triton  # pyright: ignore[reportMissingImports]  # optional: Triton
import triton.language as tl  # pyright: ignore[reportMissingImports]  # optional: Triton
from triton.runtime.jit import JITFunction  # pyright: ignore[reportMissingImports]  # optional: Triton

# The metadata's columns: one int32 row per segment.
Q_START, Q_END, POSITION, KEY_START, KEY_END, OWN_START, OWN_END, WINDOW, TABLE, FIRST_BLOCK = range(10)
SEGMENT_FIELDS = 10
# (query rows a program holds, keys a step reads, warps, pipeline stages, parts of the head size the
# accumulator is split into), per head size, measured on an H100 (bench/bench_gpu_segments.py). A
# turn's segments are mostly short (a canvas is 16 to 256 tokens, a new state's prompt a few hundred),
# so a program holds 64 rows: the served ticket's turn in 0.160 ms a full-attention layer, where
# (64, 64, 8, 1, 2) took 0.236. A turn with a segment of at least LONG_ROWS query rows (a long prompt's
# chunk) takes LONG_TILES: 128 rows a program read the 100k earlier keys of a 1,024-row chunk in 18.4
# ms a full-attention layer, 183 TFLOP/s, where (64, 64, 8, 1, 2) took 37.9; and its sliding layer in
# 0.120 ms where (64, 64, 4, 1, 1) took 0.163.
TILES: dict[int, tuple[int, int, int, int, int]] = {512: (64, 32, 8, 2, 1), 256: (64, 64, 4, 1, 1)}
LONG_TILES: dict[int, tuple[int, int, int, int, int]] = {512: (128, 32, 8, 2, 2), 256: (128, 64, 8, 2, 1)}
LONG_ROWS = 512
SMALL_TILE = (32, 32, 4, 1, 1)  # any other head size (the tiny test model's)


def tile_for(dim: int, dtype: torch.dtype, long: bool = False) -> tuple[int, int, int, int, int]:
    """The tile for a head size, in a turn with a segment of LONG_ROWS or more (`long`) or without;
    4-byte inputs (float32: the checks) take half the rows and keys, to fit the tiles of a head size
    of 512 in shared memory."""
    tile = (LONG_TILES if long else TILES).get(dim, SMALL_TILE)
    if dtype.itemsize > 2:
        tile = (max(16, tile[0] // 2), max(16, tile[1] // 2), *tile[2:])
    return tile


@triton.jit
def _segments(q_ptr, k_new_ptr, v_new_ptr, k_pool_ptr, v_pool_ptr, o_ptr, segments_ptr, items_ptr, table_ptr,
              q_row, q_head, kn_row, kn_head, vn_row, vn_head, kp_slot, kp_head, vp_slot, vp_head,
              o_row, o_head, heads, groups, scale,
              DIM: tl.constexpr, PART: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_TOKENS: tl.constexpr, FIELDS: tl.constexpr, INTERPRETED: tl.constexpr,
              PRECISION: tl.constexpr):
    item = tl.program_id(0)
    head = tl.program_id(1)
    part = tl.program_id(2)
    kv_head = head // groups
    segment = tl.load(items_ptr + item * 2)
    first_row = tl.load(items_ptr + item * 2 + 1)
    meta = segments_ptr + segment * FIELDS
    q_start = tl.load(meta + 0)
    q_end = tl.load(meta + 1)
    position = tl.load(meta + 2)
    key_start = tl.load(meta + 3)
    key_end = tl.load(meta + 4)
    own_start = tl.load(meta + 5)
    own_end = tl.load(meta + 6)
    window = tl.load(meta + 7)  # 0: no window (a full-attention layer, or a canvas)
    table = tl.load(meta + 8)
    first_block = tl.load(meta + 9)

    rows = first_row + tl.arange(0, BLOCK_M)
    row_ok = rows < q_end
    positions = position + (rows - q_start)
    dims = tl.arange(0, DIM)
    out_dims = part * PART + tl.arange(0, PART)
    q = tl.load(q_ptr + rows[:, None] * q_row + head * q_head + dims[None, :], mask=row_ok[:, None], other=0.0)
    if INTERPRETED:
        q = q.to(tl.float32)
    log2_scale = scale * 1.4426950408889634
    peak = tl.full([BLOCK_M], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, PART], tl.float32)

    # The stored keys, under the causal mask where the segment is a prompt's (own_start == own_end).
    # (Branch-free: the bounds and masks of a canvas are those of a prompt with every limit lifted.)
    causal = own_start == own_end
    banded = causal & (window > 0)
    canvas = own_start != own_end
    unbanded = canvas | (window == 0)
    last_position = position + tl.minimum(first_row + BLOCK_M, q_end) - q_start - 1
    high = tl.where(causal, tl.minimum(key_end, last_position + 1), key_end)
    low = tl.where(banded, tl.maximum(key_start, position + (first_row - q_start) - window + 1), key_start)
    for start in range(low, high, BLOCK_N):
        key_pos = start + tl.arange(0, BLOCK_N)
        key_ok = key_pos < high
        block = tl.load(table_ptr + table + key_pos // BLOCK_TOKENS - first_block, mask=key_ok, other=0)
        slots = block.to(tl.int64) * BLOCK_TOKENS + key_pos % BLOCK_TOKENS
        k = tl.load(k_pool_ptr + slots[None, :] * kp_slot + kv_head * kp_head + dims[:, None],
                    mask=key_ok[None, :], other=0.0)
        if INTERPRETED:
            k = k.to(tl.float32)
        scores = tl.dot(q, k, input_precision=PRECISION) * log2_scale
        visible = (key_ok[None, :] & ((key_pos[None, :] <= positions[:, None]) | canvas)
                   & ((key_pos[None, :] > positions[:, None] - window) | unbanded))
        scores = tl.where(visible, scores, float("-inf"))
        new_peak = tl.maximum(peak, tl.max(scores, 1))
        shift = tl.where(new_peak == float("-inf"), 0.0, new_peak)  # a row with no key seen yet: not NaN
        rescale = tl.exp2(peak - shift)
        probs = tl.exp2(scores - shift[:, None])
        total = total * rescale + tl.sum(probs, 1)
        v = tl.load(v_pool_ptr + slots[:, None] * vp_slot + kv_head * vp_head + out_dims[None, :],
                    mask=key_ok[:, None], other=0.0)
        weights = probs.to(v_pool_ptr.dtype.element_ty)
        if INTERPRETED:
            weights, v = weights.to(tl.float32), v.to(tl.float32)
        acc = acc * rescale[:, None] + tl.dot(weights, v, input_precision=PRECISION)
        peak = new_peak

    # A canvas's own keys, after the stored ones: every canvas token sees every other.
    for start in range(own_start, own_end, BLOCK_N):
        key_rows = start + tl.arange(0, BLOCK_N)
        key_ok = key_rows < own_end
        k = tl.load(k_new_ptr + key_rows[None, :] * kn_row + kv_head * kn_head + dims[:, None],
                    mask=key_ok[None, :], other=0.0)
        if INTERPRETED:
            k = k.to(tl.float32)
        scores = tl.where(key_ok[None, :], tl.dot(q, k, input_precision=PRECISION) * log2_scale, float("-inf"))
        new_peak = tl.maximum(peak, tl.max(scores, 1))
        shift = tl.where(new_peak == float("-inf"), 0.0, new_peak)
        rescale = tl.exp2(peak - shift)
        probs = tl.exp2(scores - shift[:, None])
        total = total * rescale + tl.sum(probs, 1)
        v = tl.load(v_new_ptr + key_rows[:, None] * vn_row + kv_head * vn_head + out_dims[None, :],
                    mask=key_ok[:, None], other=0.0)
        weights = probs.to(v_new_ptr.dtype.element_ty)
        if INTERPRETED:
            weights, v = weights.to(tl.float32), v.to(tl.float32)
        acc = acc * rescale[:, None] + tl.dot(weights, v, input_precision=PRECISION)
        peak = new_peak

    out = acc / total[:, None]
    tl.store(o_ptr + rows[:, None] * o_row + head * o_head + out_dims[None, :], out.to(o_ptr.dtype.element_ty),
             mask=row_ok[:, None])


# Triton's interpreter (the CPU tests) makes @triton.jit kernels plain functions.
INTERPRETED = not isinstance(_segments, JITFunction)


def segment_attention(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, key_pool: torch.Tensor,
                      value_pool: torch.Tensor, out: torch.Tensor, segments: torch.Tensor, items: torch.Tensor,
                      table: torch.Tensor, scale: float, *, block_tokens: int,
                      tile: tuple[int, int, int, int, int]) -> torch.Tensor:
    """Write every segment's attention output into `out` [≥ T, heads, dim] and return it.

    `queries` [heads, ≥ T, dim] and the turn's new `keys`, `values` [kv heads, ≥ T, dim] (rows past the
    segments' are not read); `key_pool`, `value_pool` the layer's pools [blocks, block_tokens, kv heads,
    dim]; `segments` [segments, SEGMENT_FIELDS] int32, `items` [items, 2] int32 (segment, first query
    row: BLOCK_M rows from there, within the segment), `table` int32 block ids, all on the device. The
    head dimension of every tensor must be contiguous, the head size a power of two."""
    heads, _, dim = queries.shape
    kv_heads = keys.shape[0]
    if dim & (dim - 1) or heads % kv_heads or key_pool.shape[-1] != dim or key_pool.shape[-2] != kv_heads:
        raise ValueError(f"shapes {tuple(queries.shape)}, {tuple(keys.shape)}, pool {tuple(key_pool.shape)}")
    for tensor in (queries, keys, values, key_pool, value_pool, out):
        if tensor.stride(-1) != 1:
            raise ValueError("the head dimension must be contiguous")
    block_m, block_n, warps, stages, parts = tile
    if items.shape[0] == 0:
        return out
    grid = (items.shape[0], heads, parts)
    # For the checker: without Triton @triton.jit is unresolved and the kernel its plain function (no [grid]).
    _segments[grid](queries, keys, values, key_pool, value_pool, out, segments, items, table,  # pyright: ignore[reportIndexIssue]
                    queries.stride(1), queries.stride(0), keys.stride(1), keys.stride(0),
                    values.stride(1), values.stride(0), key_pool.stride(1), key_pool.stride(2),
                    value_pool.stride(1), value_pool.stride(2), out.stride(0), out.stride(1),
                    heads, heads // kv_heads, scale,
                    DIM=dim, PART=dim // parts, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_TOKENS=block_tokens,
                    FIELDS=SEGMENT_FIELDS, INTERPRETED=INTERPRETED,
                    # float32 (the numerics checks) in full precision, not TF32; ignored for bf16 operands
                    PRECISION="ieee" if queries.dtype == torch.float32 else "tf32",
                    num_warps=warps, num_stages=stages)  # pyright: ignore[reportCallIssue]
    return out


def compiled_kernels() -> int:
    """Compiles of the kernel so far (every head size, tile and specialisation)."""
    from app.engine.hf.moe.fused import jit_compiles

    return jit_compiles(_segments)
