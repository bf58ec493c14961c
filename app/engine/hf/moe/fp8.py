"""The experts of a DiffusionGemma layer with FP8 (e4m3) weight banks (app/engine/hf/fp8.py's format).

An experts module holds `gate_up_proj` [E, 2I, H] and `down_proj` [E, H, I] as float8_e4m3fn, with
float32 scales per output channel `gate_up_proj_scale` [E, 2I] and `down_proj_scale` [E, H]. Each
projection quantizes its input rows per row at run time (app/engine/hf/fp8.py's `quantize_tokens`),
accumulates q_x·q_w in fp32, applies the row's and the channel's scales and rounds to the model's
dtype; the rest follows the bf16 kernels' roundings (gate and up rounded, then the activation, then
their product), and the down projection quantizes each pair's product row (width I) the same way.

Two paths compute it: `reference_expert_rows`, plain torch (the CPU's path: it has no FP8 matmul),
and `fp8_expert_rows`, two Triton kernels (app/engine/hf/moe/fp8_kernels.py) that quantize the
activations inside themselves, CUDA only (compute capability 8.9 or later). Both sit behind one
torch custom op, picked by the tensors' device, that transformers reaches through `experts_forward`
under IMPLEMENTATION (`use_fp8_experts`), or through the bf16 kernels' implementation when their
module holds FP8 banks (app/engine/hf/moe/fused.py). Design: docs/design.md §4.7.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.nn.functional as F

from app.engine.hf import fp8
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
    from transformers import DiffusionGemmaForBlockDiffusion
    from transformers.models.diffusion_gemma.modeling_diffusion_gemma import DiffusionGemmaTextExperts

IMPLEMENTATION = "djev_fp8"  # the name registered in transformers' experts interface
MIN_CAPABILITY = (8, 9)  # FP8 tensor cores (Ada, Hopper and later)

# Tiles by the pairs an expert gets on average, the bf16 kernels' ranges (pairs.warm_up_tokens reads
# the limits). From `bench/bench_gpu_moe.py --weights fp8 --tokens 128,2048 --sweep` on an H100
# (docs/benchmarks.md): at 128 tokens (8 pairs an expert) (16, 128, 128, 4, 4) took 0.559 ms a layer
# against 0.641 for the first guess; at 2,048 (past 64 pairs an expert) (64, 128, 64, 4, 4) took
# 2.58 ms against 3.38 for (128, 128, 128, 8, 3). The middle buckets are still first guesses.
TILES: Tiles = ((8, BlockConfig(16, 128, 128, 4, 4)), (32, BlockConfig(32, 64, 128, 4, 4)),
                (64, BlockConfig(64, 64, 128, 4, 4)))
LARGE = BlockConfig(64, 128, 64, 4, 4)
DOWN_TILES: dict[BlockConfig, BlockConfig] = {}  # the down kernel's where they differ: none measured faster


class Banks(NamedTuple):
    """One layer's FP8 experts: the weights and their per-output-channel scales."""

    gate_up: torch.Tensor  # e4m3 [E, 2I, H]
    gate_up_scale: torch.Tensor  # float32 [E, 2I]
    down: torch.Tensor  # e4m3 [E, H, I]
    down_scale: torch.Tensor  # float32 [E, H]


def block_config(pairs: int, experts: int) -> BlockConfig:
    """The FP8 kernels' tiles for `pairs` token-expert pairs over `experts`."""
    return pick_tiles(pairs, experts, TILES, LARGE)


# ---------------------------------------------------------------------------------------- checks

def _shape(tensor: torch.Tensor) -> list[int]:
    return list(tensor.shape)


def check_banks(gate_up: torch.Tensor | None, gate_up_scale: torch.Tensor | None, down: torch.Tensor | None,
                down_scale: torch.Tensor | None) -> Banks:
    """The banks, or a ValueError naming the tensor that breaks the format (module docstring)."""
    for name, weight in (("gate_up_proj", gate_up), ("down_proj", down)):
        if weight is None:
            raise ValueError(f"{name} is missing")
        if weight.dtype != fp8.E4M3:
            raise ValueError(f"{name} is {weight.dtype}, FP8 experts need {fp8.E4M3} for both banks")
        if weight.dim() != 3:
            raise ValueError(f"{name} has shape {_shape(weight)}, expected [experts, out, in]")
    assert gate_up is not None and down is not None  # checked above
    experts, double_inter, hidden = gate_up.shape
    if double_inter % 2:
        raise ValueError(f"gate_up_proj has shape {_shape(gate_up)}: its rows are gate then up, an even count")
    if tuple(down.shape) != (experts, hidden, double_inter // 2):
        raise ValueError(f"down_proj has shape {_shape(down)}, expected {[experts, hidden, double_inter // 2]} "
                         f"from gate_up_proj's {_shape(gate_up)}")
    for name, weight, scale in (("gate_up_proj", gate_up, gate_up_scale), ("down_proj", down, down_scale)):
        if scale is None:
            raise ValueError(f"{name}_scale is missing: FP8 {name} needs its float32 scales per output channel "
                             f"{_shape(weight)[:2]}")
        if scale.dtype != torch.float32 or tuple(scale.shape) != tuple(weight.shape[:2]):
            raise ValueError(f"{name}_scale is {scale.dtype} {_shape(scale)}, expected torch.float32 "
                             f"{_shape(weight)[:2]} (one scale per output channel of {name})")
        if scale.device != weight.device:
            raise ValueError(f"{name}_scale is on {scale.device}, {name} on {weight.device}")
    assert gate_up_scale is not None and down_scale is not None  # checked above
    return Banks(gate_up, gate_up_scale, down, down_scale)


def check_inputs(hidden_states: torch.Tensor, top_k_index: torch.Tensor, banks: Banks) -> None:
    """A ValueError naming the input that does not fit `banks`."""
    hidden = banks.gate_up.shape[2]
    if hidden_states.dim() != 2 or hidden_states.shape[1] != hidden:
        raise ValueError(f"hidden_states has shape {_shape(hidden_states)}, expected [tokens, {hidden}]")
    if hidden_states.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"hidden_states is {hidden_states.dtype}, expected bfloat16, float16 or float32")
    if top_k_index.dim() != 2 or top_k_index.shape[0] != hidden_states.shape[0] or top_k_index.is_floating_point():
        raise ValueError(f"top_k_index is {top_k_index.dtype} {_shape(top_k_index)}, expected integer "
                         f"[{hidden_states.shape[0]}, top_k]")
    if hidden_states.device != banks.gate_up.device or top_k_index.device != banks.gate_up.device:
        raise ValueError(f"hidden_states ({hidden_states.device}) and top_k_index ({top_k_index.device}) must be "
                         f"on the experts' device ({banks.gate_up.device})")


def tensor_of(module: object, name: str) -> torch.Tensor | None:
    """`module`'s tensor `name` (a parameter or buffer), None where it has none."""
    value = getattr(module, name, None)
    if value is not None and not isinstance(value, torch.Tensor):
        raise ValueError(f"{name} is a {type(value).__name__}, not a tensor")
    return value


def module_banks(module: object) -> Banks:
    """An experts module's FP8 banks (its `gate_up_proj_scale` and `down_proj_scale` included), or a
    ValueError naming what is missing or malformed."""
    return check_banks(*(tensor_of(module, name) for name in ("gate_up_proj", "gate_up_proj_scale",
                                                              "down_proj", "down_proj_scale")))


def has_fp8_banks(module: object) -> bool:
    """Whether an experts module (or anything holding `gate_up_proj`) keeps its banks in FP8."""
    gate_up = tensor_of(module, "gate_up_proj")
    return gate_up is not None and fp8.is_fp8(gate_up)


# ------------------------------------------------------------------------------------- reference

def reference_products(hidden_states: torch.Tensor, top_k_index: torch.Tensor, gate_up: torch.Tensor,
                       gate_up_scale: torch.Tensor) -> torch.Tensor:
    """The gate/up step, each pair's round(round(gelu_tanh(gate)) x up) [tokens x top_k, I] in the
    hidden states' dtype, gate and up each an FP8 product rounded to that dtype."""
    top_k = top_k_index.shape[1]
    inter = gate_up.shape[1] // 2
    dtype = hidden_states.dtype
    flat = top_k_index.reshape(-1)
    products = hidden_states.new_empty((flat.numel(), inter))
    for expert in flat.unique().tolist():
        pairs = (flat == expert).nonzero().squeeze(1)
        gate, up = fp8.linear(hidden_states[pairs // top_k], gate_up[expert], gate_up_scale[expert]).split(inter, -1)
        activated = F.gelu(gate.to(torch.float32), approximate="tanh").to(dtype)
        products[pairs] = (activated.to(torch.float32) * up.to(torch.float32)).to(dtype)
    return products


def reference_down(products: torch.Tensor, top_k_index: torch.Tensor, down: torch.Tensor,
                   down_scale: torch.Tensor) -> torch.Tensor:
    """The down step: each pair's product row quantized per row, its FP8 product with its expert's
    down bank [tokens x top_k, H], rounded to the products' dtype."""
    flat = top_k_index.reshape(-1)
    rows = products.new_empty((flat.numel(), down.shape[1]))
    for expert in flat.unique().tolist():
        pairs = (flat == expert).nonzero().squeeze(1)
        rows[pairs] = fp8.linear(products[pairs], down[expert], down_scale[expert])
    return rows


def reference_expert_rows(hidden_states: torch.Tensor, top_k_index: torch.Tensor, gate_up: torch.Tensor,
                          gate_up_scale: torch.Tensor, down: torch.Tensor, down_scale: torch.Tensor) -> torch.Tensor:
    """Every pair's expert output [tokens x top_k, H] (pair = token x top_k + slot, as
    fused.expert_rows), before its routing weight: the FP8 arithmetic in plain torch."""
    banks = check_banks(gate_up, gate_up_scale, down, down_scale)
    check_inputs(hidden_states, top_k_index, banks)
    products = reference_products(hidden_states, top_k_index, gate_up, gate_up_scale)
    return reference_down(products, top_k_index, down, down_scale)


# ---------------------------------------------------------------------------------------- kernels

def fp8_expert_rows(hidden_states: torch.Tensor, top_k_index: torch.Tensor, gate_up: torch.Tensor,
                    gate_up_scale: torch.Tensor, down: torch.Tensor, down_scale: torch.Tensor,
                    config: BlockConfig | None = None, down_config: BlockConfig | None = None) -> torch.Tensor:
    """`reference_expert_rows` through the Triton kernels, with the tiles given (the bench tries
    several); None = block_config's. `down_config`, if given, is the down kernel's (same block_m)."""
    banks = check_banks(gate_up, gate_up_scale, down, down_scale)
    check_inputs(hidden_states, top_k_index, banks)
    tokens, hidden = hidden_states.shape
    experts, double_inter, _ = gate_up.shape
    inter = double_inter // 2
    top_k = top_k_index.shape[1]
    total = tokens * top_k
    config, down_config = both_tiles(config or block_config(total, experts), down_config, DOWN_TILES)
    import triton  # pyright: ignore[reportMissingImports]  # optional: Triton

    from app.engine.hf.moe.fp8_kernels import fp8_down_kernel, fp8_gate_up_kernel
    from app.engine.hf.moe.kernels import RUN_INTERPRETED

    x = hidden_states.contiguous()
    gate_up, gate_up_scale = gate_up.contiguous(), gate_up_scale.contiguous()
    down, down_scale = down.contiguous(), down_scale.contiguous()
    pairs, block_experts = align(top_k_index, experts, config.block_m)
    blocks = block_experts.numel()
    products = torch.empty((total, inter), dtype=x.dtype, device=x.device)
    # As in fused.expert_rows: without Triton (.venv) a kernel is its plain function, which takes no [grid].
    fp8_gate_up_kernel[(blocks, triton.cdiv(inter, config.block_n))](  # pyright: ignore[reportIndexIssue]
        x, gate_up, gate_up_scale, products, pairs, block_experts,
        total, hidden, inter, top_k, experts,
        x.stride(0), gate_up.stride(0), gate_up.stride(1), gate_up_scale.stride(0), products.stride(0),
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, INTERPRETED=RUN_INTERPRETED,
        num_warps=config.num_warps, num_stages=config.num_stages)  # pyright: ignore[reportCallIssue]
    rows = torch.empty((total, hidden), dtype=x.dtype, device=x.device)
    fp8_down_kernel[(blocks, triton.cdiv(hidden, down_config.block_n))](  # pyright: ignore[reportIndexIssue]
        products, down, down_scale, rows, pairs, block_experts,
        total, hidden, inter, experts,
        products.stride(0), down.stride(0), down.stride(1), down_scale.stride(0), rows.stride(0),
        BLOCK_M=down_config.block_m, BLOCK_N=down_config.block_n, BLOCK_K=down_config.block_k,
        INTERPRETED=RUN_INTERPRETED,
        num_warps=down_config.num_warps, num_stages=down_config.num_stages)  # pyright: ignore[reportCallIssue]
    return rows


# ---------------------------------------------------------------------------------------- wiring

_OP: CustomOpDef | None = None


def rows_op() -> CustomOpDef:
    """The pairs' rows as one torch custom op, `djev::fp8_expert_rows`, so torch.compile treats the
    experts as one opaque call with a known output shape: the kernels for CUDA tensors, the
    reference for any other device's."""
    global _OP
    if _OP is None:
        def rows(hidden_states: torch.Tensor, top_k_index: torch.Tensor, gate_up: torch.Tensor,
                 gate_up_scale: torch.Tensor, down: torch.Tensor, down_scale: torch.Tensor) -> torch.Tensor:
            path = fp8_expert_rows if hidden_states.is_cuda else reference_expert_rows
            return path(hidden_states, top_k_index, gate_up, gate_up_scale, down, down_scale)

        op = torch.library.custom_op("djev::fp8_expert_rows", mutates_args=())(rows)

        @op.register_fake
        def _(hidden_states, top_k_index, gate_up, gate_up_scale, down, down_scale):  # noqa: ANN001, ANN202
            return hidden_states.new_empty((top_k_index.numel(), hidden_states.shape[1]))

        _OP = op
    return _OP


def fp8_experts_forward(module: DiffusionGemmaTextExperts, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                        top_k_weights: torch.Tensor) -> torch.Tensor:
    """An FP8 experts module's output: its pairs' rows (`rows_op`) times their routing weights, summed."""
    banks = module_banks(module)  # the inputs are checked where the op runs (not traced: no shape guards)
    return weighted_sum(rows_op()(hidden_states, top_k_index, *banks), top_k_weights)


def experts_forward(module: DiffusionGemmaTextExperts, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
    """The forward transformers calls under IMPLEMENTATION: FP8 banks through `rows_op`, any other
    module through transformers' own grouped_mm experts."""
    if has_fp8_banks(module):
        return fp8_experts_forward(module, hidden_states, top_k_index, top_k_weights)
    from transformers.integrations.moe import grouped_mm_experts_forward

    return grouped_mm_experts_forward(module, hidden_states, top_k_index, top_k_weights)


def kernels_unavailable(device: torch.device) -> str | None:
    """Why FP8 experts cannot run on `device`, or None: any device but CUDA runs the reference; CUDA
    needs Triton and FP8 tensor cores."""
    if device.type != "cuda":
        return None
    try:
        import triton  # noqa: F401  # pyright: ignore[reportMissingImports]  # optional: Triton
    except ImportError as exc:
        return f"Triton is not importable ({exc})"
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CAPABILITY:
        return f"compute capability {capability[0]}.{capability[1]} has no FP8 tensor cores (8.9 or later)"
    return None


def experts_modules(model: torch.nn.Module) -> list[DiffusionGemmaTextExperts]:
    from transformers.models.diffusion_gemma.modeling_diffusion_gemma import DiffusionGemmaTextExperts

    return [module for module in model.modules() if isinstance(module, DiffusionGemmaTextExperts)]


def fp8_problem(model: DiffusionGemmaForBlockDiffusion) -> str | None:
    """Why `model`'s FP8 experts cannot run where it is, or None (also where it has none): each
    FP8 module's banks checked, the activation and the device's kernels."""
    modules = [module for module in experts_modules(model) if has_fp8_banks(module)]
    if not modules:
        return None
    for module in modules:
        module_banks(module)  # a malformed bank is a broken checkpoint: raised, not a reason
    text = getattr(model.config, "text_config", model.config)
    activation = getattr(text, "hidden_activation", None)
    if activation not in ACTIVATIONS:
        return f"the experts' activation is {activation!r}, the FP8 experts compute {', '.join(ACTIVATIONS)}"
    return kernels_unavailable(modules[0].get_parameter("gate_up_proj").device)


def use_fp8_experts(model: DiffusionGemmaForBlockDiffusion) -> None:
    """Switch `model`'s experts to IMPLEMENTATION (registered in transformers' experts interface):
    FP8 modules through the kernels on CUDA, the reference elsewhere; any other module through
    grouped_mm. A ValueError where a module's banks are malformed, a RuntimeError where its FP8
    experts cannot run (`fp8_problem`)."""
    problem = fp8_problem(model)
    if problem is not None:
        raise RuntimeError(f"FP8 experts cannot run: {problem}")
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    ALL_EXPERTS_FUNCTIONS.register(IMPLEMENTATION, experts_forward)
    model.set_experts_implementation(IMPLEMENTATION)


def activation_dtype(model: DiffusionGemmaForBlockDiffusion) -> torch.dtype:
    """The dtype the model computes in, its input embeddings' (never quantized; a parameter of an
    FP8 model may be e4m3 or a float32 scale)."""
    embeddings = model.get_input_embeddings()
    assert isinstance(embeddings, torch.nn.Embedding), type(embeddings)
    return embeddings.weight.dtype


def warm_up(module: object, dtype: torch.dtype, top_k: int) -> None:
    """Compile every FP8 tile a batch can pick (each pair count divisible by 16 and not), on this
    module's own banks with `dtype` activations."""
    banks = module_banks(module)
    experts, _, hidden = banks.gate_up.shape
    device = banks.gate_up.device
    generator = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for tokens in warm_up_tokens(int(experts), top_k, TILES):
            states = torch.randn((tokens, int(hidden)), dtype=dtype, device=device, generator=generator)
            index = torch.randint(0, int(experts), (tokens, top_k), device=device, generator=generator)
            fp8_expert_rows(states, index, *banks)
