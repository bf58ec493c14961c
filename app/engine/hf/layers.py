"""Each text layer's forward in three pieces, so that torch.compile (TORCH_COMPILE) fuses everything
but the attention itself, and compiles it once for all 30 layers.

`install` gives every layer a forward of three calls: `attention_inputs` (compiled), the cache and
attention as the library does them (eager; under a mask, `grouped_attention`), `feed_forward`
(compiled). The compiled pieces read no layer number. The arithmetic is the library's, op for op,
but for the grouped attention's blocking (tests/engine/hf/test_compiled.py). Why and the numbers:
docs/design.md §4.7 and §5.2.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

if TYPE_CHECKING:
    from transformers.cache_utils import Cache
    from transformers.models.diffusion_gemma.modeling_diffusion_gemma import (
        DiffusionGemmaDecoderTextAttention,
        DiffusionGemmaDecoderTextLayer,
        DiffusionGemmaEncoderTextAttention,
        DiffusionGemmaEncoderTextLayer,
    )

    # A text layer of the prompt encoder or of the decoder, and its attention module.
    TextLayer = DiffusionGemmaEncoderTextLayer | DiffusionGemmaDecoderTextLayer
    TextAttention = DiffusionGemmaEncoderTextAttention | DiffusionGemmaDecoderTextAttention

log = logging.getLogger("djev.engine")

# A forward as `install` and `install_vision` give it to a layer.
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


def feed_forward(layer: TextLayer, attention_out: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """The layer's output from its attention's output [batch, tokens, heads, head_dim] and its input."""
    return unscaled_output(layer, attention_out, residual) * layer.layer_scalar


def unscaled_output(layer: TextLayer, attention_out: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """`feed_forward` before the layer's `layer_scalar`: the flat turn scales each token by its own
    stack's (the encoder's and the decoder's are separate buffers), app/engine/hf/flat/forward.py."""
    hidden = layer.self_attn.o_proj(attention_out.reshape(*residual.shape[:-1], -1).contiguous())
    hidden = residual + layer.post_attention_layernorm(hidden)
    residual = hidden
    dense = layer.post_feedforward_layernorm_1(layer.mlp(layer.pre_feedforward_layernorm(hidden)))
    flat = residual.reshape(-1, residual.shape[-1])
    _, top_k_weights, top_k_index = layer.router(flat)
    experts = layer.experts(layer.pre_feedforward_layernorm_2(flat), top_k_index, top_k_weights)
    experts = layer.post_feedforward_layernorm_2(experts.reshape(residual.shape))
    return residual + layer.post_feedforward_layernorm(dense + experts)


@dataclass(frozen=True)
class ChunkMask:
    """The attention mask of a long prompt's chunk after the first, never materialised over the
    prompt: each of the chunk's queries sees every earlier token in a full-attention layer, the last
    `sliding_window` in a sliding one, and the chunk's own tokens causally (`chunk_attention`)."""


CHUNK_MASK = ChunkMask()
# The encoder's masks for a chunk after the first, by layer type (the encoder takes them as a dict).
CHUNK_MASKS = {"full_attention": CHUNK_MASK, "sliding_attention": CHUNK_MASK}


def attend(layer: TextLayer, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
           attention_mask: torch.Tensor | None, past_key_values: Cache | None, kwargs: dict[str, Any]) -> torch.Tensor:
    """The cache and attention, as the library's attention modules do them."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from transformers.models.diffusion_gemma.modeling_diffusion_gemma import (
        DiffusionGemmaDecoderTextAttention,
        eager_attention_forward,
    )

    attention = layer.self_attn
    if past_key_values is not None:
        if isinstance(attention, DiffusionGemmaDecoderTextAttention):  # it reads the prompt's cache, never writes it
            keys, values = attention.append_to_cache(past_key_values, keys, values)
        else:
            keys, values = past_key_values.update(keys, values, attention.layer_idx)
    if isinstance(attention_mask, ChunkMask):
        return chunk_attention(queries, keys, values, attention.scaling, attention.sliding_window)
    if attention_mask is not None and uses_grouped_attention(attention, queries, keys, attention_mask):
        return grouped_attention(queries, keys, values, attention_mask, attention.scaling)
    interface = ALL_ATTENTION_FUNCTIONS.get_interface(
        attention.config._attn_implementation,  # pyright: ignore[reportArgumentType]  # declared str; None is handled
        eager_attention_forward)
    out, _ = interface(attention, queries, keys, values, attention_mask, dropout=0.0, scaling=attention.scaling,
                       sliding_window=attention.sliding_window, is_causal=attention.is_causal, **kwargs)
    return out


def uses_grouped_attention(attention: TextAttention, queries: torch.Tensor, keys: torch.Tensor,
                           mask: torch.Tensor | None) -> bool:
    """Whether `attend` runs `grouped_attention` instead of the library's SDPA call for this
    attention module and these queries [batch, heads, tokens, dim], keys and mask: SDPA configured,
    query heads sharing KV heads, several query tokens and a mask shared by the heads (the decoder's;
    an encoder pass's padding or sliding-window mask). Without a mask the library already runs
    SDPA's own grouped-query kernels."""
    return (attention.config._attn_implementation == "sdpa" and isinstance(mask, torch.Tensor)
            and mask.dim() == 4 and mask.shape[1] == 1 and queries.shape[2] > 1
            and queries.shape[1] > keys.shape[1] and queries.shape[1] % keys.shape[1] == 0)


def grouped_attention(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                      scaling: float) -> torch.Tensor:
    """SDPA for query heads that share KV heads under a mask, as [batch, tokens, heads, head_dim].

    With a mask, the library repeats every KV head for each query head that reads it (SDPA's
    grouped-query kernels take no mask): a copy of the whole KV in every layer, 120 copy kernels and
    ~15 ms of a 32-row decoder pass on an H200 (docs/benchmarks.md). Here the query heads of a KV
    head are stacked along the tokens instead ([batch, kv heads, group x tokens, dim]) and the mask
    repeated to match: each query row meets the same keys, values and mask row as before."""
    batch, heads, tokens, dim = queries.shape
    groups = heads // keys.shape[1]
    stacked = queries.reshape(batch, keys.shape[1], groups * tokens, dim)
    out = torch.nn.functional.scaled_dot_product_attention(
        stacked, keys, values, attn_mask=mask.repeat(1, 1, groups, 1), scale=scaling)
    return out.reshape(batch, heads, tokens, dim).transpose(1, 2)


def chunk_attention(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float,
                    window: int | None) -> torch.Tensor:
    """Attention for a chunk of a long prompt, as [batch, tokens, heads, head_dim]: its queries
    [batch, heads, tokens, dim] are the last `tokens` positions of `keys`/`values` [batch, kv heads,
    keys, dim] (the cache after the chunk was appended).

    A sliding layer holds at most its window before the chunk: a small mask over those keys. A
    full-attention layer holds the whole prompt so far, where a mask would be tokens x prompt (a
    110k-token prompt's last chunk: gigabytes, and SDPA's slow masked kernels): the earlier tokens
    are read without any mask, every query head of a KV head stacked along the tokens as in
    `grouped_attention`, the chunk's own tokens causally, and the two softmaxes merged by their
    log-sum-exps.

    On CUDA in bf16 or fp16, where Triton is, app/engine/hf/attention_kernel.py's kernel reads the
    earlier tokens (about twice as fast as SDPA's memory-efficient kernel at head size 512 on an
    H200) and a sliding layer's whole band (a fifth of the masked SDPA's time): docs/benchmarks.md has
    the probe. `chunk_attention_with` is the same with the kernel given (None: torch's only). Where
    the kernel does not build on this GPU (its tiles need more shared memory than, say, a consumer
    card has), the first chunk says so in the log and every chunk after takes torch's path; the
    start-up's chunked warm-up meets that before `ready`."""
    kernel = kernel_for(queries)
    if kernel is not None:
        try:
            return chunk_attention_with(kernel, queries, keys, values, scaling, window)
        except Exception as exc:  # noqa: BLE001 - only Triton's own failures are caught; the rest re-raise
            if not type(exc).__module__.startswith("triton"):
                raise
            KERNEL_FAILURES.append(f"{type(exc).__name__}: {exc}"[:300])
            log.warning("the Triton chunk attention does not run on this GPU (%s); long prompts take torch's "
                        "kernels", KERNEL_FAILURES[-1])
    return chunk_attention_with(None, queries, keys, values, scaling, window)


# Why the Triton chunk attention stopped being used in this process (empty while it is used).
KERNEL_FAILURES: list[str] = []


def kernel_for(queries: torch.Tensor) -> Callable[..., tuple[torch.Tensor, torch.Tensor]] | None:
    """The Triton kernel for a chunk of these queries: on CUDA in bf16 or fp16, where Triton imports
    and the kernel has not failed to build here; else None (torch's kernels)."""
    if KERNEL_FAILURES or not queries.is_cuda or queries.dtype not in (torch.bfloat16, torch.float16):
        return None
    return triton_kernel()


def chunk_attention_with(kernel: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None, queries: torch.Tensor,
                         keys: torch.Tensor, values: torch.Tensor, scaling: float, window: int | None) -> torch.Tensor:
    """`chunk_attention` through `kernel` (`attention_kernel.attention`'s signature), or through
    torch's kernels alone where it is None."""
    batch, heads, tokens, dim = queries.shape
    past = keys.shape[2] - tokens
    if window is not None and kernel is not None:  # the band in one pass, written in the layout the layer reads
        out = queries.new_empty(batch, tokens, heads, dim)
        kernel(queries, keys, values, scaling, band=(past, window), out=out.transpose(1, 2))
        return out
    if window is not None:
        rows = torch.arange(tokens, device=queries.device).unsqueeze(1) + past
        columns = torch.arange(keys.shape[2], device=queries.device).unsqueeze(0)
        mask = (columns <= rows) & (columns > rows - window)
        return grouped_attention(queries, keys, values, mask[None, None], scaling)
    kv_heads = keys.shape[1]
    groups = heads // kv_heads
    own_keys = keys[:, :, past:].repeat_interleave(groups, dim=1)  # the chunk's KV: small to repeat
    own_values = values[:, :, past:].repeat_interleave(groups, dim=1)
    out, lse = attention_with_lse(queries, own_keys, own_values, scaling, causal=True)
    if past > 0:
        # Stacked, a program's query rows share a KV head (the form the kernel was tuned in).
        stacked = queries.reshape(batch, kv_heads, groups * tokens, dim)
        earlier_keys, earlier_values = keys[:, :, :past], values[:, :, :past]
        earlier, earlier_lse = (kernel(stacked, earlier_keys, earlier_values, scaling) if kernel is not None else
                                attention_with_lse(stacked, earlier_keys, earlier_values, scaling, causal=False))
        earlier = earlier.reshape(batch, heads, tokens, -1)
        earlier_lse = earlier_lse.reshape(batch, heads, tokens)
        total = torch.logaddexp(lse, earlier_lse)
        out = (out.float() * torch.exp(lse - total).unsqueeze(-1)
               + earlier.float() * torch.exp(earlier_lse - total).unsqueeze(-1))
    return out.to(queries.dtype).transpose(1, 2)


@functools.cache
def triton_kernel() -> Callable[..., tuple[torch.Tensor, torch.Tensor]] | None:
    """attention_kernel.attention where Triton imports (CUDA builds of torch ship it), else None."""
    try:
        from app.engine.hf.attention_kernel import attention
    except ImportError:
        return None
    return attention


def attention_with_lse(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float,
                       causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention without a mask (or causal, for as many keys as queries) and its
    log-sum-exp per query row (float32), from the kernels SDPA dispatches to, which return both: on
    CUDA the memory-efficient one, on the CPU the flash one (DEVICE is one or the other; on the CPU
    12x faster than the float32 arithmetic it stands for, a tiny-model chunk over 30k tokens)."""
    if queries.is_cuda:
        out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
            queries, keys, values, None, True, 0.0, causal, scale=scaling)[:2]
        return out, lse[..., :queries.shape[2]]  # the kernel pads the rows of its log-sum-exp
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(queries, keys, values, 0.0, causal,
                                                                         scale=scaling)
    return out, lse.float()


def choose_attention_kernels() -> None:
    """Leave cuDNN out of SDPA's choices (process-wide; the engine thread is the one that runs the
    model). cuDNN's attention builds an execution plan for each new shape it meets, on the host: on
    the H200 one such call took 1,641 ms, the first sliding layer of an eager 32-row decoder pass
    over a prompt length not seen before (the other 24 reused its plan), and the served passes meet
    new lengths all the time, since each new state's prompt has its own (docs/benchmarks.md, the
    first call of each kernel at each served shape). SDPA's memory-efficient kernel, which the
    full-attention layers' 512-wide heads took already, builds nothing."""
    torch.backends.cuda.enable_cudnn_sdp(False)


def install(layers: Sequence[TextLayer], compile: Callable[[Callable], Callable] | None = None) -> None:
    """Give each layer the split forward; `compile` wraps the two compiled pieces (None: eager)."""
    inputs = compile(attention_inputs) if compile else attention_inputs
    rest = compile(feed_forward) if compile else feed_forward
    for layer in layers:
        layer.forward = _split_forward(layer, inputs, rest)


def _split_forward(layer: TextLayer, inputs: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
                   rest: Callable[..., torch.Tensor]) -> Forward:
    def forward(hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor],
                attention_mask: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                past_key_values: Cache | None = None, **kwargs: Any) -> torch.Tensor:
        cos, sin = position_embeddings
        queries, keys, values = inputs(layer, hidden_states, cos, sin)
        out = attend(layer, queries, keys, values, attention_mask, past_key_values,
                     {"position_ids": position_ids, **kwargs})
        return rest(layer, out, hidden_states)

    # A marker: Python functions take attributes, typeshed's FunctionType declares none.
    forward.djev_split = True  # pyright: ignore[reportFunctionMemberAccess]
    return forward


# The vision tower's attention kernels, in priority order. Unlike the text passes', its shapes are
# few and fixed (images to a bucket x the processor's 2,520 patches), and on CUDA they run as graphs
# captured before ready, so cuDNN builds its plan for each once, at capture, never in a served turn
# (the text passes leave cuDNN out for that: `choose_attention_kernels`). Steady, cuDNN took 0.109 /
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
