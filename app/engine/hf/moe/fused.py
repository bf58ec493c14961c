"""The experts of a DiffusionGemma layer as two Triton kernels (FUSED_MOE, CUDA only).

Registered as transformers' experts implementation `djev_fused`: the token-expert pairs aligned by
expert without a host sync (so it replays inside a CUDA graph), gate/up and down as two kernels
reading the tokens by index, and the weighted top-k sum left to the compiled layer piece. It follows
the grouped_mm path's roundings step by step (only the order of fp32 accumulations differs;
tests/engine/hf/moe/test_fused.py checks it through Triton's interpreter). Triton is imported
lazily: the CPU install never needs it. A module whose banks are FP8 goes to the FP8 kernels
(app/engine/hf/moe/fp8.py). Design and numbers: docs/design.md §4.7 and §5.2.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from app.engine.hf import fp8
from app.engine.hf.moe import fp8 as fp8_moe
from app.engine.hf.moe.pairs import (
    ACTIVATIONS,
    BlockConfig,
    Tiles,
    align,
    both_tiles,
    pick_tiles,
    warm_up_tokens,
    weighted_sum,
)

if TYPE_CHECKING:
    from torch._library.custom_ops import CustomOpDef
    from transformers import DiffusionGemmaForBlockDiffusion, PreTrainedConfig
    from transformers.models.diffusion_gemma.modeling_diffusion_gemma import DiffusionGemmaTextExperts

IMPLEMENTATION = "djev_fused"  # the name registered in transformers' experts interface


# Tiles by the pairs an expert gets on average, from bench/bench_gpu_moe.py --sweep on an H200
# (docs/benchmarks.md). With 128 experts x top-8: up to 128 tokens (a canvas or four), 512 (eight to
# sixteen canvases, a prompt), 1024 (32 canvases), and past that (a batch of prompts) LARGE. There
# the work is compute-bound: with the rows in bf16 (weighted_sum) the kernels match transformers'
# grouped_mm (cuBLAS/CUTLASS grouped GEMM, its glue compiled): 2.62 vs 2.70 ms a layer at 10,240
# tokens, 2.47 with DOWN_TILES. (A choice between the two made outside the custom op would be a size
# guard in every compiled layer, recompiling each tile range of every shape on first use: seconds
# each, measured on the H200.)
TILES: Tiles = ((8, BlockConfig(16, 64, 128, 4, 3)), (32, BlockConfig(32, 64, 128, 4, 3)), (64, BlockConfig(64, 64, 64, 4, 4)))
LARGE = BlockConfig(128, 128, 64, 8, 3)
# The down kernel's own tiles where they differ (same block_m): its K is the expert FFN (704), and
# wider blocks of hidden columns are 6 % faster there (2.47 vs 2.62 ms a layer at 10,240 tokens).
DOWN_TILES = {LARGE: BlockConfig(128, 256, 64, 8, 3)}


def block_config(pairs: int, experts: int) -> BlockConfig:
    """The kernels' tiles for `pairs` token-expert pairs over `experts`. Few pairs an expert: small
    blocks, each chosen expert's weights streamed once (memory-bound: 3.4 TB/s at one canvas,
    against grouped_mm's 2.5); many: large tiles that reuse each weight tile over more rows."""
    return pick_tiles(pairs, experts, TILES, LARGE)


def expert_rows(hidden_states: torch.Tensor, top_k_index: torch.Tensor, gate_up_proj: torch.Tensor,
                down_proj: torch.Tensor, config: BlockConfig | None = None,
                down: BlockConfig | None = None) -> torch.Tensor:
    """Every token-expert pair's expert output [tokens x top_k, hidden] in the model's dtype, before
    its routing weight: the kernels with the tiles given (bench/bench_gpu_moe.py tries several);
    None = block_config's. `down`, if given, is the down kernel's own tiles (same block_m)."""
    import triton  # pyright: ignore[reportMissingImports]  # optional: Triton

    from app.engine.hf.moe.kernels import RUN_INTERPRETED, down_kernel, gate_up_kernel

    tokens, hidden = hidden_states.shape
    experts, double_inter, _ = gate_up_proj.shape
    inter = double_inter // 2
    top_k = top_k_index.shape[1]
    total = tokens * top_k
    config, down = both_tiles(config or block_config(total, experts), down, DOWN_TILES)
    precision = "ieee" if hidden_states.dtype == torch.float32 else "tf32"
    x = hidden_states.contiguous()
    gate_up_proj = gate_up_proj.contiguous()
    down_proj = down_proj.contiguous()
    pairs, block_experts = align(top_k_index, experts, config.block_m)
    blocks = block_experts.numel()
    activated = torch.empty((total, inter), dtype=x.dtype, device=x.device)
    # For the checker: without Triton (.venv) @triton.jit is unresolved and a kernel is its plain function,
    # which takes no [grid]; with it, Triton types kernel[grid] as the kernel's own signature, though the
    # launcher also takes the launch options num_warps and num_stages.
    gate_up_kernel[(blocks, triton.cdiv(inter, config.block_n))](  # pyright: ignore[reportIndexIssue]
        x, gate_up_proj, activated, pairs, block_experts,
        total, hidden, inter, top_k, experts,
        x.stride(0), gate_up_proj.stride(0), gate_up_proj.stride(1), activated.stride(0),
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        INTERPRETED=RUN_INTERPRETED, PRECISION=precision,
        num_warps=config.num_warps, num_stages=config.num_stages)  # pyright: ignore[reportCallIssue]
    rows = torch.empty((total, hidden), dtype=x.dtype, device=x.device)
    down_kernel[(blocks, triton.cdiv(hidden, down.block_n))](  # pyright: ignore[reportIndexIssue]
        activated, down_proj, rows, pairs, block_experts,
        total, hidden, inter, experts,
        activated.stride(0), down_proj.stride(0), down_proj.stride(1), rows.stride(0),
        BLOCK_M=down.block_m, BLOCK_N=down.block_n, BLOCK_K=down.block_k,
        INTERPRETED=RUN_INTERPRETED, PRECISION=precision,
        num_warps=down.num_warps, num_stages=down.num_stages)  # pyright: ignore[reportCallIssue]
    return rows


# ---------------------------------------------------------------------------------------- wiring

_OP: CustomOpDef | None = None


def _custom_op() -> CustomOpDef:
    """`expert_rows` as a torch custom op, so torch.compile (TORCH_COMPILE compiles the layer piece
    that calls the experts) treats it as one opaque call with a known output shape instead of
    tracing Triton."""
    global _OP
    if _OP is None:
        def rows(hidden_states: torch.Tensor, top_k_index: torch.Tensor, gate_up_proj: torch.Tensor,
                 down_proj: torch.Tensor) -> torch.Tensor:
            return expert_rows(hidden_states, top_k_index, gate_up_proj, down_proj)

        op = torch.library.custom_op("djev::expert_rows", mutates_args=())(rows)

        @op.register_fake
        def _(hidden_states, top_k_index, gate_up_proj, down_proj):  # noqa: ANN001, ANN202
            return hidden_states.new_empty((top_k_index.numel(), hidden_states.shape[1]))

        _OP = op
    return _OP


def experts_forward(module: DiffusionGemmaTextExperts, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
    """The forward transformers calls for a DiffusionGemma experts module under IMPLEMENTATION (a
    module with FP8 banks goes through the FP8 kernels: app/engine/hf/moe/fp8.py)."""
    if fp8_moe.has_fp8_banks(module):
        return fp8_moe.fp8_experts_forward(module, hidden_states, top_k_index, top_k_weights)
    rows = _custom_op()(hidden_states, top_k_index, module.gate_up_proj, module.down_proj)
    return weighted_sum(rows, top_k_weights)


def unsupported(config: PreTrainedConfig) -> str | None:
    """Why the kernels cannot run this model's experts, or None when they can."""
    text = getattr(config, "text_config", config)
    activation = getattr(text, "hidden_activation", None)
    if activation not in ACTIVATIONS:
        return f"the experts' activation is {activation!r}, the kernel computes {', '.join(ACTIVATIONS)}"
    if not getattr(text, "num_experts", None):
        return "the model has no experts"
    try:
        import triton  # noqa: F401  # pyright: ignore[reportMissingImports]  # optional: Triton
    except ImportError as exc:
        return f"Triton is not importable ({exc})"
    return None


def use_fused_experts(model: DiffusionGemmaForBlockDiffusion) -> str | None:
    """Switch `model`'s experts to the kernels (registering IMPLEMENTATION in transformers' experts
    interface); returns None, or why they cannot run it (the model keeps its implementation). A
    model with FP8 experts gets the FP8 kernels (app/engine/hf/moe/fp8.py), where its GPU has them."""
    reason = unsupported(model.config) or fp8_moe.fp8_problem(model)
    if reason is not None:
        return reason
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    ALL_EXPERTS_FUNCTIONS.register(IMPLEMENTATION, experts_forward)
    model.set_experts_implementation(IMPLEMENTATION)
    return None


def warm_up_experts(model: DiffusionGemmaForBlockDiffusion) -> float:
    """Compile every Triton tile a batch can pick before the server is ready, on the first experts
    module's own weights (the FP8 kernels' tiles where its banks are FP8); returns the seconds it
    took (nothing is compiled later: `compiled_kernels` counts what was)."""
    import time

    started = time.perf_counter()
    experts_module = next(iter(fp8_moe.experts_modules(model)), None)
    if experts_module is None:
        return 0.0
    gate_up = experts_module.get_parameter("gate_up_proj")
    down = experts_module.get_parameter("down_proj")
    experts, _, hidden = gate_up.shape
    text = getattr(model.config, "text_config", model.config)
    top_k = int(getattr(text, "top_k_experts", None) or getattr(text, "num_experts_per_tok", 8))
    if fp8.is_fp8(gate_up):
        fp8_moe.warm_up(experts_module, fp8_moe.activation_dtype(model), top_k)
        torch.cuda.synchronize(gate_up.device)
        return time.perf_counter() - started
    generator = torch.Generator(device=gate_up.device).manual_seed(0)
    with torch.no_grad():
        for tokens in warm_up_tokens(int(experts), top_k, TILES):
            states = torch.randn((tokens, int(hidden)), dtype=gate_up.dtype, device=gate_up.device, generator=generator)
            index = torch.randint(0, int(experts), (tokens, top_k), device=gate_up.device, generator=generator)
            expert_rows(states, index, gate_up, down)
    torch.cuda.synchronize(gate_up.device)
    return time.perf_counter() - started


def compiled_kernels() -> int:
    """Triton kernels compiled so far for the expert kernels, bf16 and FP8 (every tile and
    specialisation); 0 where Triton was never imported."""
    import sys

    if "triton" not in sys.modules:
        return 0
    from app.engine.hf.moe.fp8_kernels import fp8_down_kernel, fp8_gate_up_kernel, fp8_quantize_kernel
    from app.engine.hf.moe.kernels import down_kernel, gate_up_kernel

    return jit_compiles(gate_up_kernel, down_kernel, fp8_gate_up_kernel, fp8_quantize_kernel, fp8_down_kernel)


def jit_compiles(*kernels: object) -> int:
    """How many binaries Triton has compiled for these @triton.jit kernels (every specialisation)."""
    total = 0
    for kernel in kernels:
        caches = getattr(kernel, "device_caches", None) or {}
        for entry in caches.values():
            total += len(entry[0]) if isinstance(entry, tuple) and entry else 0
    return total
