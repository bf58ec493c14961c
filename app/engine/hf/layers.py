"""The text layers' two bodies around their attention, which the flat forward runs on every token of a
turn (and torch.compile compiles once for all 30 layers, TORCH_COMPILE), and the vision tower's layer
forward, compiled once for every layer of the tower. The arithmetic is the library's, op for op
(tests/engine/hf/test_compiled.py); why and the numbers: docs/design.md §4.7 and §5.2.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

if TYPE_CHECKING:
    from transformers.models.diffusion_gemma.modeling_diffusion_gemma import (
        DiffusionGemmaDecoderTextLayer,
        DiffusionGemmaEncoderTextLayer,
    )

    # A text layer of the prompt encoder or of the decoder (the flat forward runs the encoder's: they are tied).
    TextLayer = DiffusionGemmaEncoderTextLayer | DiffusionGemmaDecoderTextLayer

# A forward as `install_vision` gives it to a layer.
Forward = Callable[..., torch.Tensor]


def attention_inputs(layer: TextLayer, hidden_states: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Queries, keys and values [batch, heads, tokens, head_dim] of a layer's attention."""
    from transformers.models.diffusion_gemma.modeling_diffusion_gemma import apply_rotary_pos_emb

    attention = layer.self_attn
    x = layer.input_layernorm(hidden_states)
    shape = (*x.shape[:-1], -1, attention.head_dim)
    queries = attention.q_norm(attention.q_proj(x).view(shape))
    queries = apply_rotary_pos_emb(queries, cos, sin, unsqueeze_dim=2).transpose(1, 2)
    keys = attention.k_proj(x).view(shape)
    values = attention.v_proj(x).view(shape) if attention.v_proj is not None else keys  # full layers: K = V
    keys = apply_rotary_pos_emb(attention.k_norm(keys), cos, sin, unsqueeze_dim=2).transpose(1, 2)
    values = attention.v_norm(values).transpose(1, 2)
    return queries, keys, values


def unscaled_output(layer: TextLayer, attention_out: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """A layer's output from its attention's output [batch, tokens, heads, head_dim] and its input,
    before its `layer_scalar`: the forward scales each token by its own stack's (the encoder's and the
    decoder's are separate buffers), app/engine/hf/forward.py."""
    hidden = layer.self_attn.o_proj(attention_out.reshape(*residual.shape[:-1], -1).contiguous())
    hidden = residual + layer.post_attention_layernorm(hidden)
    residual = hidden
    dense = layer.post_feedforward_layernorm_1(layer.mlp(layer.pre_feedforward_layernorm(hidden)))
    flat = residual.reshape(-1, residual.shape[-1])
    _, top_k_weights, top_k_index = layer.router(flat)
    experts = layer.experts(layer.pre_feedforward_layernorm_2(flat), top_k_index, top_k_weights)
    experts = layer.post_feedforward_layernorm_2(experts.reshape(residual.shape))
    return residual + layer.post_feedforward_layernorm(dense + experts)


# The vision tower's attention kernels, in priority order. Unlike the text passes', its shapes are
# few and fixed (images to a bucket x the processor's 2,520 patches), and on CUDA they run as graphs
# captured before ready, so cuDNN builds its plan for each once, at capture, never in a served turn
# Steady, cuDNN took 0.109 /
# 0.749 ms a layer for 1 / 8 frames against the memory-efficient kernel's 0.272 / 1.955 on the H200
# (docs/benchmarks.md, SDPA timed alone at the tower's shapes). Without graphs (CUDA_GRAPHS=0) the
# first pass of each image count builds its plan on the host: up to 0.6 s, once.
VISION_ATTENTION = (SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.FLASH_ATTENTION,
                    SDPBackend.MATH)


def vision_attention() -> Any:
    """The kernels the vision tower's attention may take, VISION_ATTENTION first (a context)."""
    return sdpa_kernel(list(VISION_ATTENTION), set_priority=True)


def vision_layer(layer: nn.Module, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor] | None,
                 attention_mask: torch.Tensor | None, position_ids: torch.Tensor | None) -> torch.Tensor:
    """A vision encoder layer's own forward, with the layer an argument: compiled once, it serves
    every layer of the tower (a vision layer reads no layer number). Its attention takes
    VISION_ATTENTION's kernels (inside the compiled body, so the trace of each shape takes them)."""
    with vision_attention():
        return type(layer).forward(layer, hidden_states, position_embeddings=position_embeddings,
                                   attention_mask=attention_mask, position_ids=position_ids)


def install_vision(layers: Sequence[nn.Module], compile: Callable[[Callable], Callable] | None = None) -> None:
    """Give each vision encoder layer a forward through `vision_layer` (compiled when `compile` is
    given): the tower's norms, rotary and residual kernels fused instead of replayed one by one."""
    body = compile(vision_layer) if compile else vision_layer
    for layer in layers:
        layer.forward = _vision_forward(layer, body)


def _vision_forward(layer: nn.Module, body: Forward) -> Forward:
    def forward(hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
                attention_mask: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                **kwargs: Any) -> torch.Tensor:
        return body(layer, hidden_states, position_embeddings, attention_mask, position_ids)

    # A marker: Python functions take attributes, typeshed's FunctionType declares none.
    forward.djev_split = True  # pyright: ignore[reportFunctionMemberAccess]
    return forward
