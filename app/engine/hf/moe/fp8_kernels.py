"""The Triton kernels of app/engine/hf/moe/fp8.py: the experts with FP8 (e4m3) weight banks, the
activations quantized per row inside the kernels (imported only where Triton is: CUDA hosts, and
the CPU tests through Triton's interpreter). docs/design.md §4.7 describes them.

Each kernel reads its block's rows twice: a first pass over K for each row's largest magnitude
(its scale: max|row| / 448, at least 1e-12), then the main loop, which loads the rows in the
model's dtype, divides them by their scale (rounded division, as torch's), clamps to ±448 and
casts them to e4m3, and multiplies them with the weights' e4m3 tiles on the FP8 tensor cores
(fp32 accumulators, promoted to full fp32 once per BLOCK_K: Hopper accumulates FP8 products in
fewer bits). The row and channel scales are applied once, after the loop, in the reference's
order: (acc x row scale) x channel scale.

Triton's interpreter (Triton 3.9 in .venv-vllm) runs e4m3 loads, e4m3 -> fp32 conversions and
e4m3 x e4m3 dots exactly (a dot goes through fp16, where every e4m3 value and product is exact),
but its fp32 -> e4m3 conversion does not round as the GPU does (`cvt.rn.satfinite`): it rounds
half away from zero on the bits dropped, and a round-up that overflows the mantissa does not carry
into the exponent (31.1 becomes 16, not 32). So there (INTERPRETED) `e4m3_rounded` rounds to the
e4m3 grid first, to nearest even with integer arithmetic on the bits (its subnormals, below 2^-6,
in steps of 2^-9, through an fp32 addition), and the cast then only re-encodes a value it holds
exactly. On a GPU the flag is off: the hardware's conversion.
"""

import triton  # pyright: ignore[reportMissingImports]  # optional: Triton
import triton.language as tl  # pyright: ignore[reportMissingImports]  # optional: Triton

from app.engine.hf.moe.kernels import block_pairs, gelu_tanh, rounded


@triton.jit
def e4m3_rounded(x):
    """fp32 `x` (|x| <= 448) rounded to the nearest e4m3 value (ties to even), as fp32."""
    bits = x.to(tl.uint32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & 0xFFF00000).to(tl.float32, bitcast=True)
    magnitude = tl.abs(x)
    subnormal = (magnitude + 16384.0) - 16384.0  # 2^14's ulp is 2^-9, e4m3's subnormal step
    subnormal = (subnormal.to(tl.uint32, bitcast=True) | (bits & 0x80000000)).to(tl.float32, bitcast=True)
    return tl.where(magnitude < 0.015625, subnormal, normal)


@triton.jit
def row_scales(rows, valid, width, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """Each of the BLOCK_M rows' FP8 scale (fp32): its largest magnitude over `width` / 448, at
    least 1e-12 (padding rows get that, and quantize to 0)."""
    largest = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for start in range(0, width, BLOCK_K):
        ks = start + tl.arange(0, BLOCK_K)
        x = tl.load(rows + ks[None, :], mask=valid[:, None] & (ks < width)[None, :], other=0.0)
        largest = tl.maximum(largest, tl.max(tl.abs(x.to(tl.float32)), axis=1))
    return tl.maximum(tl.math.div_rn(largest, 448.0), 1e-12)


@triton.jit
def quantized(x, scales, INTERPRETED: tl.constexpr):
    """Rows `x` [BLOCK_M, BLOCK_K] divided by their scales, as e4m3 (to nearest, saturated at 448)."""
    q = tl.math.div_rn(x.to(tl.float32), scales[:, None])
    q = tl.minimum(tl.maximum(q, -448.0), 448.0)
    if INTERPRETED:
        q = e4m3_rounded(q)
    return q.to(tl.float8e4nv)


@triton.jit
def fp8_gate_up_kernel(x_ptr, w_ptr, w_scale_ptr, out_ptr, pairs_ptr, block_experts_ptr,
                       total, hidden, inter, top_k, experts,
                       stride_xt, stride_we, stride_wn, stride_se, stride_os,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       INTERPRETED: tl.constexpr):
    expert, pairs, valid = block_pairs(block_experts_ptr, pairs_ptr, total, BLOCK_M)
    if expert >= experts:
        return
    x_rows = x_ptr + (pairs // top_k).to(tl.int64)[:, None] * stride_xt
    x_scales = row_scales(x_rows, valid, hidden, BLOCK_M, BLOCK_K)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols_ok = cols < inter
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    weights = w_ptr + expert * stride_we
    for start in range(0, hidden, BLOCK_K):
        ks = start + tl.arange(0, BLOCK_K)
        ks_ok = ks < hidden
        x = tl.load(x_rows + ks[None, :], mask=valid[:, None] & ks_ok[None, :], other=0.0)
        xq = quantized(x, x_scales, INTERPRETED)
        w_gate = tl.load(weights + cols[None, :] * stride_wn + ks[:, None],
                         mask=cols_ok[None, :] & ks_ok[:, None], other=0.0)
        w_up = tl.load(weights + (cols[None, :] + inter) * stride_wn + ks[:, None],
                       mask=cols_ok[None, :] & ks_ok[:, None], other=0.0)
        gate += tl.dot(xq, w_gate, max_num_imprecise_acc=BLOCK_K)
        up += tl.dot(xq, w_up, max_num_imprecise_acc=BLOCK_K)
    scales = w_scale_ptr + expert * stride_se
    gate_scales = tl.load(scales + cols, mask=cols_ok, other=0.0)
    up_scales = tl.load(scales + inter + cols, mask=cols_ok, other=0.0)
    dtype = out_ptr.dtype.element_ty
    gate = rounded(gate * x_scales[:, None] * gate_scales[None, :], dtype, INTERPRETED)
    up = rounded(up * x_scales[:, None] * up_scales[None, :], dtype, INTERPRETED)
    activated = rounded(gelu_tanh(gate), dtype, INTERPRETED)
    product = rounded(activated * up, dtype, INTERPRETED).to(dtype)
    tl.store(out_ptr + pairs[:, None].to(tl.int64) * stride_os + cols[None, :], product,
             mask=valid[:, None] & cols_ok[None, :])


@triton.jit
def fp8_down_kernel(h_ptr, w_ptr, w_scale_ptr, out_ptr, pairs_ptr, block_experts_ptr,
                    total, hidden, inter, experts,
                    stride_hs, stride_we, stride_wn, stride_se, stride_os,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    INTERPRETED: tl.constexpr):
    expert, pairs, valid = block_pairs(block_experts_ptr, pairs_ptr, total, BLOCK_M)
    if expert >= experts:
        return
    pair_rows = pairs.to(tl.int64)
    h_rows = h_ptr + pair_rows[:, None] * stride_hs
    h_scales = row_scales(h_rows, valid, inter, BLOCK_M, BLOCK_K)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols_ok = cols < hidden
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    weights = w_ptr + expert * stride_we
    for start in range(0, inter, BLOCK_K):
        ks = start + tl.arange(0, BLOCK_K)
        ks_ok = ks < inter
        h = tl.load(h_rows + ks[None, :], mask=valid[:, None] & ks_ok[None, :], other=0.0)
        hq = quantized(h, h_scales, INTERPRETED)
        w = tl.load(weights + cols[None, :] * stride_wn + ks[:, None],
                    mask=cols_ok[None, :] & ks_ok[:, None], other=0.0)
        acc += tl.dot(hq, w, max_num_imprecise_acc=BLOCK_K)
    channel_scales = tl.load(w_scale_ptr + expert * stride_se + cols, mask=cols_ok, other=0.0)
    dtype = out_ptr.dtype.element_ty
    out = rounded(acc * h_scales[:, None] * channel_scales[None, :], dtype, INTERPRETED).to(dtype)
    tl.store(out_ptr + pair_rows[:, None] * stride_os + cols[None, :], out,
             mask=valid[:, None] & cols_ok[None, :])
