"""The Triton kernels of app/engine/hf/moe/fp8.py: the experts with FP8 (e4m3) weight banks
(imported only where Triton is: CUDA hosts, and the CPU tests through Triton's interpreter).
docs/design.md §4.7 describes them.

Both GEMM kernels read their activations already in e4m3, with one fp32 scale a row: the tokens'
rows quantized by app/engine/hf/fp8.py's `quantize_tokens` before the experts' op (torch ops, which
torch.compile fuses with the norm before them), the pairs' product rows by `fp8_quantize_kernel`
between the two GEMMs. Each quantizes a row once. (Quantizing inside the GEMMs, as these kernels
first did, redid it in every program of a row block: gate/up's grid has 704 / BLOCK_N column blocks
and down's 2816 / BLOCK_N, so every row was quantized about 6 and 22 times, each time an exact
division per element; measured on an H100 at 2,048 tokens that took the FP8 kernels to 2.58 ms a
layer at their best tiles, where the bf16 kernels take 1.0 ms.)

`fp8_quantize_kernel` reads a block of rows twice: a first pass for each row's largest magnitude
(its scale: max|row| / 448, at least 1e-12, `row_scales`), then the rows in the model's dtype
divided by their scale (rounded division, as torch's), clamped to ±448 and cast to e4m3
(`quantized`). The GEMMs multiply e4m3 x e4m3 tiles on the FP8 tensor cores (fp32 accumulators,
promoted to full fp32 once per BLOCK_K: Hopper accumulates FP8 products in fewer bits) and apply
the row and channel scales once, after the loop, in the reference's order: (acc x row scale) x
channel scale.

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
def fp8_quantize_kernel(x_ptr, q_ptr, scale_ptr, rows, width, stride_x, stride_q,
                        BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, INTERPRETED: tl.constexpr):
    """Rows [rows, width] quantized per row, BLOCK_M rows a program: each row's scale (`row_scales`)
    to `scale_ptr` [rows] (fp32), its e4m3 values (`quantized`) to `q_ptr` [rows, width]."""
    row = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    valid = row < rows
    x_rows = x_ptr + row.to(tl.int64)[:, None] * stride_x
    q_rows = q_ptr + row.to(tl.int64)[:, None] * stride_q
    scales = row_scales(x_rows, valid, width, BLOCK_M, BLOCK_K)
    tl.store(scale_ptr + row, scales, mask=valid)
    for start in range(0, width, BLOCK_K):
        ks = start + tl.arange(0, BLOCK_K)
        mask = valid[:, None] & (ks < width)[None, :]
        x = tl.load(x_rows + ks[None, :], mask=mask, other=0.0)
        tl.store(q_rows + ks[None, :], quantized(x, scales, INTERPRETED), mask=mask)


@triton.jit
def fp8_gate_up_kernel(xq_ptr, x_scale_ptr, w_ptr, w_scale_ptr, out_ptr, pairs_ptr, block_experts_ptr,
                       total, hidden, inter, top_k, experts,
                       stride_xt, stride_we, stride_wn, stride_se, stride_os,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       INTERPRETED: tl.constexpr):
    expert, pairs, valid = block_pairs(block_experts_ptr, pairs_ptr, total, BLOCK_M)
    if expert >= experts:
        return
    tokens = (pairs // top_k).to(tl.int64)
    x_rows = xq_ptr + tokens[:, None] * stride_xt
    x_scales = tl.load(x_scale_ptr + tokens, mask=valid, other=0.0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols_ok = cols < inter
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    weights = w_ptr + expert * stride_we
    for start in range(0, hidden, BLOCK_K):
        ks = start + tl.arange(0, BLOCK_K)
        ks_ok = ks < hidden
        xq = tl.load(x_rows + ks[None, :], mask=valid[:, None] & ks_ok[None, :], other=0.0)
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
def fp8_down_kernel(hq_ptr, h_scale_ptr, w_ptr, w_scale_ptr, out_ptr, pairs_ptr, block_experts_ptr,
                    total, hidden, inter, experts,
                    stride_hs, stride_we, stride_wn, stride_se, stride_os,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    INTERPRETED: tl.constexpr):
    expert, pairs, valid = block_pairs(block_experts_ptr, pairs_ptr, total, BLOCK_M)
    if expert >= experts:
        return
    pair_rows = pairs.to(tl.int64)
    h_rows = hq_ptr + pair_rows[:, None] * stride_hs
    h_scales = tl.load(h_scale_ptr + pair_rows, mask=valid, other=0.0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols_ok = cols < hidden
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    weights = w_ptr + expert * stride_we
    for start in range(0, inter, BLOCK_K):
        ks = start + tl.arange(0, BLOCK_K)
        ks_ok = ks < inter
        hq = tl.load(h_rows + ks[None, :], mask=valid[:, None] & ks_ok[None, :], other=0.0)
        w = tl.load(weights + cols[None, :] * stride_wn + ks[:, None],
                    mask=cols_ok[None, :] & ks_ok[:, None], other=0.0)
        acc += tl.dot(hq, w, max_num_imprecise_acc=BLOCK_K)
    channel_scales = tl.load(w_scale_ptr + expert * stride_se + cols, mask=cols_ok, other=0.0)
    dtype = out_ptr.dtype.element_ty
    out = rounded(acc * h_scales[:, None] * channel_scales[None, :], dtype, INTERPRETED).to(dtype)
    tl.store(out_ptr + pair_rows[:, None] * stride_os + cols[None, :], out,
             mask=valid[:, None] & cols_ok[None, :])
