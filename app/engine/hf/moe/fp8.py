"""The experts of a DiffusionGemma layer with FP8 (e4m3) weight banks (app/engine/hf/fp8.py's format).

An experts module holds `gate_up_proj` [E, 2I, H] and `down_proj` [E, H, I] as float8_e4m3fn, with
float32 scales per output channel `gate_up_proj_scale` [E, 2I] and `down_proj_scale` [E, H]. Each
projection quantizes its input rows per row at run time (app/engine/hf/fp8.py's `quantize_tokens`),
accumulates q_x·q_w in fp32, applies the row's and the channel's scales and rounds to the model's
dtype; the rest follows the bf16 kernels' roundings (gate and up rounded, then the activation, then
their product), and the down projection quantizes each pair's product row (width I) the same way.

Where the activations are quantized: each row once. The tokens' rows are quantized by
`fp8_experts_forward` with `fp8.quantize_tokens` (torch ops) before the custom op, so that inside
the compiled layer bodies torch.compile fuses that with the norm before it; the op takes e4m3 rows
and their float32 scales. (Compiled by inductor, that division is Triton's `/`, approximate, unless
torch._inductor.config.eager_numerics.division_rounding (TORCHINDUCTOR_EMULATE_DIVISION_ROUNDING=1)
makes it div_rn as eager's: off, a compiled layer's quantized tokens may differ from the reference's
by a step where a quotient lies within its error of an e4m3 rounding boundary, and a scale by an
ulp.) Between the two GEMMs one small Triton kernel quantizes each pair's
product row. (The kernels first quantized inside the GEMMs, in every program of a row block: gate/up
re-quantized each row for each of its 704 / BLOCK_N column blocks, down for each of its 2816 /
BLOCK_N, about 6 and 22 times with an exact division per element; measured on an H100 at 2,048
tokens the FP8 kernels then took 2.58 ms a layer at their best tiles against the bf16 kernels' 1.0,
and 0.56 against 0.62 at 128 tokens.)

Two paths compute it: `reference_expert_rows`, plain torch (the CPU's path: it has no FP8 matmul),
and `fp8_expert_rows`, Triton kernels (app/engine/hf/moe/fp8_kernels.py: gate/up, the product rows'
quantization, down), CUDA only (compute capability 8.9 or later); each quantizes the tokens itself
and shares the rest with the op (`quantized_reference_rows`, `quantized_kernel_rows`). The op, picked
by the tensors' device, is what transformers reaches through `experts_forward` under IMPLEMENTATION
(`use_fp8_experts`), or through the bf16 kernels' implementation when their module holds FP8 banks
(app/engine/hf/moe/fused.py). Design: docs/design.md §4.7.
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
# Those timings are of the kernels that quantized their activations inside themselves; the tiles are
# not yet measured again with the rows quantized once outside them. `fp8_quantize_kernel`'s shape
# (QUANTIZE_ROWS rows a program, up to QUANTIZE_WIDTH columns a step) is a first guess, unmeasured.
QUANTIZE_ROWS = 4
QUANTIZE_WIDTH = 1024
QUANTIZE_WARPS = 4


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


def check_quantized_inputs(xq: torch.Tensor, x_scale: torch.Tensor, dtype: torch.dtype, top_k_index: torch.Tensor,
                           banks: Banks) -> None:
    """`check_inputs` for hidden states already quantized (`fp8.quantize_tokens`: e4m3 rows and their
    float32 scales) from hidden states in `dtype`."""
    hidden = banks.gate_up.shape[2]
    if xq.dtype != fp8.E4M3 or xq.dim() != 2 or xq.shape[1] != hidden:
        raise ValueError(f"the quantized hidden_states are {xq.dtype} {_shape(xq)}, expected {fp8.E4M3} "
                         f"[tokens, {hidden}]")
    if x_scale.dtype != torch.float32 or tuple(x_scale.shape) != (xq.shape[0],):
        raise ValueError(f"the hidden_states' scales are {x_scale.dtype} {_shape(x_scale)}, expected torch.float32 "
                         f"[{xq.shape[0]}] (one a token)")
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"hidden_states is {dtype}, expected bfloat16, float16 or float32")
    if top_k_index.dim() != 2 or top_k_index.shape[0] != xq.shape[0] or top_k_index.is_floating_point():
        raise ValueError(f"top_k_index is {top_k_index.dtype} {_shape(top_k_index)}, expected integer "
                         f"[{xq.shape[0]}, top_k]")
    if any(tensor.device != banks.gate_up.device for tensor in (xq, x_scale, top_k_index)):
        raise ValueError(f"hidden_states ({xq.device}, scales {x_scale.device}) and top_k_index "
                         f"({top_k_index.device}) must be on the experts' device ({banks.gate_up.device})")


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
    xq, x_scale = fp8.quantize_tokens(hidden_states)
    return quantized_products(xq, x_scale, hidden_states.dtype, top_k_index, gate_up, gate_up_scale)


def quantized_products(xq: torch.Tensor, x_scale: torch.Tensor, dtype: torch.dtype, top_k_index: torch.Tensor,
                       gate_up: torch.Tensor, gate_up_scale: torch.Tensor) -> torch.Tensor:
    """`reference_products` from the tokens already quantized (`fp8.quantize_tokens`' xq, x_scale) of
    hidden states in `dtype`."""
    top_k = top_k_index.shape[1]
    inter = gate_up.shape[1] // 2
    flat = top_k_index.reshape(-1)
    products = torch.empty((flat.numel(), inter), dtype=dtype, device=xq.device)
    for expert in flat.unique().tolist():
        pairs = (flat == expert).nonzero().squeeze(1)
        tokens = pairs // top_k
        gate, up = fp8.quantized_linear(xq[tokens], x_scale[tokens], gate_up[expert], gate_up_scale[expert],
                                        dtype).split(inter, -1)
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
    xq, x_scale = fp8.quantize_tokens(hidden_states)
    return quantized_reference_rows(xq, x_scale, hidden_states.dtype, top_k_index, banks)


def quantized_reference_rows(xq: torch.Tensor, x_scale: torch.Tensor, dtype: torch.dtype, top_k_index: torch.Tensor,
                             banks: Banks) -> torch.Tensor:
    """`reference_expert_rows` from the tokens already quantized (inputs checked by the caller)."""
    products = quantized_products(xq, x_scale, dtype, top_k_index, banks.gate_up, banks.gate_up_scale)
    return reference_down(products, top_k_index, banks.down, banks.down_scale)


# ---------------------------------------------------------------------------------------- kernels

def fp8_expert_rows(hidden_states: torch.Tensor, top_k_index: torch.Tensor, gate_up: torch.Tensor,
                    gate_up_scale: torch.Tensor, down: torch.Tensor, down_scale: torch.Tensor,
                    config: BlockConfig | None = None, down_config: BlockConfig | None = None) -> torch.Tensor:
    """`reference_expert_rows` through the Triton kernels, with the tiles given (the bench tries
    several); None = block_config's. `down_config`, if given, is the down kernel's (same block_m).
    The tokens are quantized here, as `fp8_experts_forward` does before the op."""
    banks = check_banks(gate_up, gate_up_scale, down, down_scale)
    check_inputs(hidden_states, top_k_index, banks)
    xq, x_scale = fp8.quantize_tokens(hidden_states)
    return quantized_kernel_rows(xq, x_scale, hidden_states.dtype, top_k_index, banks, config, down_config)


def quantized_kernel_rows(xq: torch.Tensor, x_scale: torch.Tensor, dtype: torch.dtype, top_k_index: torch.Tensor,
                          banks: Banks, config: BlockConfig | None = None,
                          down_config: BlockConfig | None = None) -> torch.Tensor:
    """`fp8_expert_rows` from the tokens already quantized (inputs checked by the caller): gate/up
    writes the pairs' product rows in `dtype`, `fp8_quantize_kernel` quantizes each once, down reads
    them in e4m3."""
    tokens, hidden = xq.shape
    experts, double_inter, _ = banks.gate_up.shape
    inter = double_inter // 2
    top_k = top_k_index.shape[1]
    total = tokens * top_k
    config, down_config = both_tiles(config or block_config(total, experts), down_config, DOWN_TILES)
    import triton  # pyright: ignore[reportMissingImports]  # optional: Triton

    from app.engine.hf.moe.fp8_kernels import fp8_down_kernel, fp8_gate_up_kernel, fp8_quantize_kernel
    from app.engine.hf.moe.kernels import RUN_INTERPRETED

    xq, x_scale = xq.contiguous(), x_scale.contiguous()
    gate_up, gate_up_scale = banks.gate_up.contiguous(), banks.gate_up_scale.contiguous()
    down, down_scale = banks.down.contiguous(), banks.down_scale.contiguous()
    device = xq.device
    pairs, block_experts = align(top_k_index, experts, config.block_m)
    blocks = block_experts.numel()
    products = torch.empty((total, inter), dtype=dtype, device=device)
    # As in fused.expert_rows: without Triton (.venv) a kernel is its plain function, which takes no [grid].
    fp8_gate_up_kernel[(blocks, triton.cdiv(inter, config.block_n))](  # pyright: ignore[reportIndexIssue]
        xq, x_scale, gate_up, gate_up_scale, products, pairs, block_experts,
        total, hidden, inter, top_k, experts,
        xq.stride(0), gate_up.stride(0), gate_up.stride(1), gate_up_scale.stride(0), products.stride(0),
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, INTERPRETED=RUN_INTERPRETED,
        num_warps=config.num_warps, num_stages=config.num_stages)  # pyright: ignore[reportCallIssue]
    hq = torch.empty((total, inter), dtype=fp8.E4M3, device=device)
    h_scale = torch.empty((total,), dtype=torch.float32, device=device)
    fp8_quantize_kernel[(max(1, triton.cdiv(total, QUANTIZE_ROWS)),)](  # pyright: ignore[reportIndexIssue]
        products, hq, h_scale, total, inter, products.stride(0), hq.stride(0),
        BLOCK_M=QUANTIZE_ROWS, BLOCK_K=min(triton.next_power_of_2(inter), QUANTIZE_WIDTH),
        INTERPRETED=RUN_INTERPRETED, num_warps=QUANTIZE_WARPS)  # pyright: ignore[reportCallIssue]
    rows = torch.empty((total, hidden), dtype=dtype, device=device)
    fp8_down_kernel[(blocks, triton.cdiv(hidden, down_config.block_n))](  # pyright: ignore[reportIndexIssue]
        hq, h_scale, down, down_scale, rows, pairs, block_experts,
        total, hidden, inter, experts,
        hq.stride(0), down.stride(0), down.stride(1), down_scale.stride(0), rows.stride(0),
        BLOCK_M=down_config.block_m, BLOCK_N=down_config.block_n, BLOCK_K=down_config.block_k,
        INTERPRETED=RUN_INTERPRETED,
        num_warps=down_config.num_warps, num_stages=down_config.num_stages)  # pyright: ignore[reportCallIssue]
    return rows


# ---------------------------------------------------------------------------------------- wiring

_OP: CustomOpDef | None = None


def rows_op() -> CustomOpDef:
    """The pairs' rows as one torch custom op, `djev::fp8_expert_rows`, so torch.compile treats the
    experts as one opaque call with a known output shape. It takes the tokens already quantized
    (e4m3 [tokens, H], their float32 scales [tokens]) and the dtype of the hidden states they came
    from, the rows' dtype: the kernels for CUDA tensors, the reference for any other device's."""
    global _OP
    if _OP is None:
        def rows(xq: torch.Tensor, x_scale: torch.Tensor, top_k_index: torch.Tensor, gate_up: torch.Tensor,
                 gate_up_scale: torch.Tensor, down: torch.Tensor, down_scale: torch.Tensor,
                 dtype: torch.dtype) -> torch.Tensor:
            banks = check_banks(gate_up, gate_up_scale, down, down_scale)
            check_quantized_inputs(xq, x_scale, dtype, top_k_index, banks)
            path = quantized_kernel_rows if xq.is_cuda else quantized_reference_rows
            return path(xq, x_scale, dtype, top_k_index, banks)

        op = torch.library.custom_op("djev::fp8_expert_rows", mutates_args=())(rows)

        @op.register_fake
        def _(xq, x_scale, top_k_index, gate_up, gate_up_scale, down, down_scale, dtype):  # noqa: ANN001, ANN202
            return xq.new_empty((top_k_index.numel(), xq.shape[1]), dtype=dtype)

        _OP = op
    return _OP


def fp8_experts_forward(module: DiffusionGemmaTextExperts, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                        top_k_weights: torch.Tensor) -> torch.Tensor:
    """An FP8 experts module's output: its tokens quantized once (`fp8.quantize_tokens`, torch ops
    that torch.compile fuses with what comes before), their pairs' rows (`rows_op`) times their
    routing weights, summed."""
    banks = module_banks(module)  # the inputs are checked where the op runs (not traced: no shape guards)
    xq, x_scale = fp8.quantize_tokens(hidden_states)
    rows = rows_op()(xq, x_scale, top_k_index, *banks, hidden_states.dtype)
    return weighted_sum(rows, top_k_weights)


def experts_forward(module: DiffusionGemmaTextExperts, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
    """The forward transformers calls under IMPLEMENTATION: FP8 banks through `rows_op` (the tokens
    quantized before it), any other module through transformers' own grouped_mm experts."""
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
