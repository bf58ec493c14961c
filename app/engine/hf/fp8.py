"""FP8 (e4m3) weights: the format djev keeps them in and the arithmetic every FP8 path follows.

A weight [..., out, in] is stored as e4m3 with one float32 scale per output channel ([..., out]):
`weight ~= q * scale[..., None]`. Activations are quantized per token at run time, one float32
scale per row: `x ~= xq * x_scale[:, None]`. A product is then `(xq @ q.T) * x_scale[:, None] *
scale[None, :]`, accumulated in float32 and rounded once to the activations' dtype.

The functions here are that arithmetic in plain torch: the reference the Triton kernels are tested
against (app/engine/hf/moe/), and what runs where no FP8 matmul does (the CPU). Pure: no I/O.
"""

from __future__ import annotations

import torch

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0  # the largest finite e4m3fn value
# A row of zeros gets this scale rather than 0 (its quantized values are 0 either way).
MIN_SCALE = 1e-12


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scale): `weight` [..., out, in] as e4m3 with one float32 scale per output channel
    [..., out], each channel's largest magnitude mapped to E4M3_MAX."""
    wide = weight.to(torch.float32)
    scale = (wide.abs().amax(dim=-1) / E4M3_MAX).clamp(min=MIN_SCALE)
    q = (wide / scale.unsqueeze(-1)).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return q, scale


def quantize_tokens(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(xq, x_scale): activations [tokens, features] as e4m3 with one float32 scale per token."""
    wide = x.to(torch.float32)
    scale = (wide.abs().amax(dim=-1) / E4M3_MAX).clamp(min=MIN_SCALE)
    q = (wide / scale.unsqueeze(-1)).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The float32 values `q` [..., out, in] with its per-row `scale` [..., out] stand for."""
    return q.to(torch.float32) * scale.to(torch.float32).unsqueeze(-1)


def linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`x` [tokens, in] times the FP8 weight (q [out, in], scale [out]) transposed, the activations
    quantized per token: float32 accumulation, rounded once to x's dtype."""
    xq, x_scale = quantize_tokens(x)
    return quantized_linear(xq, x_scale, q, scale, x.dtype)


def quantized_linear(xq: torch.Tensor, x_scale: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                     dtype: torch.dtype) -> torch.Tensor:
    """`linear` from activations already quantized (`quantize_tokens`' xq, x_scale), rounded once
    to `dtype`."""
    product = xq.to(torch.float32) @ q.to(torch.float32).T
    return (product * x_scale.unsqueeze(-1) * scale.to(torch.float32).unsqueeze(0)).to(dtype)


def is_fp8(tensor: torch.Tensor) -> bool:
    return tensor.dtype == E4M3
