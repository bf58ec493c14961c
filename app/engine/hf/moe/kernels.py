"""The Triton kernels of app/engine/hf/moe/fused.py (imported only where Triton is: CUDA hosts, and the
CPU tests through Triton's interpreter). docs/design.md §4.7 describes them.

INTERPRETED (set when Triton runs its interpreter, as the CPU tests do) works around two gaps of
the interpreter (Triton 3.9) so that the CPU tests check the GPU's arithmetic:
- its `tl.dot` gives wrong results for bf16 operands, so there the operands go to fp32 first (a
  bf16 product is exact in fp32, and the tensor cores accumulate in fp32 as well);
- its fp32 -> bf16 conversion truncates where the GPU rounds to nearest even, so there `rounded`
  rounds with integer arithmetic on the bits.
On a GPU the flag is off: bf16 dots on the tensor cores, the hardware's conversion.

PRECISION is "ieee" for float32 models (Triton would otherwise multiply float32 in TF32, which
the numerics checks would see), "tf32" otherwise (ignored for bf16 operands)."""

import triton  # pyright: ignore[reportMissingImports]  # optional: Triton
import triton.language as tl  # pyright: ignore[reportMissingImports]  # optional: Triton
from triton.runtime.jit import JITFunction  # pyright: ignore[reportMissingImports]  # optional: Triton


@triton.jit
def gelu_tanh(x):
    inner = 0.7978845608028654 * (x + 0.044715 * x * x * x)
    return 0.5 * x * (1.0 + (2.0 * tl.sigmoid(2.0 * inner) - 1.0))


@triton.jit
def rounded(x, dtype: tl.constexpr, INTERPRETED: tl.constexpr):
    """fp32 `x` rounded to `dtype` (to nearest, ties to even) and back to fp32."""
    if INTERPRETED and dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    return x.to(dtype).to(tl.float32)


@triton.jit
def block_pairs(block_experts_ptr, pairs_ptr, total, BLOCK_M: tl.constexpr):
    """This program's block: its expert (or `experts` past the last run) and its pair ids, with
    which of them are real (the rest is a run's padding)."""
    block = tl.program_id(0)
    expert = tl.load(block_experts_ptr + block).to(tl.int64)
    pairs = tl.load(pairs_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    return expert, pairs, pairs < total


@triton.jit
def gate_up_kernel(x_ptr, w_ptr, out_ptr, pairs_ptr, block_experts_ptr,
                   total, hidden, inter, top_k, experts,
                   stride_xt, stride_we, stride_wn, stride_os,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   INTERPRETED: tl.constexpr, PRECISION: tl.constexpr):
    expert, pairs, valid = block_pairs(block_experts_ptr, pairs_ptr, total, BLOCK_M)
    if expert >= experts:
        return
    tokens = (pairs // top_k).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols_ok = cols < inter
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    weights = w_ptr + expert * stride_we
    for start in range(0, hidden, BLOCK_K):
        ks = start + tl.arange(0, BLOCK_K)
        ks_ok = ks < hidden
        x = tl.load(x_ptr + tokens[:, None] * stride_xt + ks[None, :],
                    mask=valid[:, None] & ks_ok[None, :], other=0.0)
        w_gate = tl.load(weights + cols[None, :] * stride_wn + ks[:, None],
                         mask=cols_ok[None, :] & ks_ok[:, None], other=0.0)
        w_up = tl.load(weights + (cols[None, :] + inter) * stride_wn + ks[:, None],
                       mask=cols_ok[None, :] & ks_ok[:, None], other=0.0)
        if INTERPRETED:
            x = x.to(tl.float32)
            w_gate = w_gate.to(tl.float32)
            w_up = w_up.to(tl.float32)
        gate += tl.dot(x, w_gate, input_precision=PRECISION)
        up += tl.dot(x, w_up, input_precision=PRECISION)
    dtype = out_ptr.dtype.element_ty
    gate = rounded(gate, dtype, INTERPRETED)
    up = rounded(up, dtype, INTERPRETED)
    activated = rounded(gelu_tanh(gate), dtype, INTERPRETED)
    product = rounded(activated * up, dtype, INTERPRETED).to(dtype)
    tl.store(out_ptr + pairs[:, None].to(tl.int64) * stride_os + cols[None, :], product,
             mask=valid[:, None] & cols_ok[None, :])


@triton.jit
def down_kernel(h_ptr, w_ptr, out_ptr, pairs_ptr, block_experts_ptr,
                total, hidden, inter, experts,
                stride_hs, stride_we, stride_wn, stride_os,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                INTERPRETED: tl.constexpr, PRECISION: tl.constexpr):
    expert, pairs, valid = block_pairs(block_experts_ptr, pairs_ptr, total, BLOCK_M)
    if expert >= experts:
        return
    pair_rows = pairs.to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols_ok = cols < hidden
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    weights = w_ptr + expert * stride_we
    for start in range(0, inter, BLOCK_K):
        ks = start + tl.arange(0, BLOCK_K)
        ks_ok = ks < inter
        h = tl.load(h_ptr + pair_rows[:, None] * stride_hs + ks[None, :],
                    mask=valid[:, None] & ks_ok[None, :], other=0.0)
        w = tl.load(weights + cols[None, :] * stride_wn + ks[:, None],
                    mask=cols_ok[None, :] & ks_ok[:, None], other=0.0)
        if INTERPRETED:
            h = h.to(tl.float32)
            w = w.to(tl.float32)
        acc += tl.dot(h, w, input_precision=PRECISION)
    dtype = out_ptr.dtype.element_ty
    out = rounded(acc, dtype, INTERPRETED).to(dtype)
    tl.store(out_ptr + pair_rows[:, None] * stride_os + cols[None, :], out,
             mask=valid[:, None] & cols_ok[None, :])


# Triton's interpreter (how the CPU tests run the kernels) makes @triton.jit kernels plain Python
# functions rather than JITFunctions; the kernels then work around its gaps (INTERPRETED).
RUN_INTERPRETED = not isinstance(gate_up_kernel, JITFunction)
