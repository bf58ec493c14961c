"""FP8 weights for the text layers of a DiffusionGemma model: each dense projection an `Fp8Linear`,
each experts module's two banks in e4m3 with their scales, and the conversion of a bf16 or float32
model to them, one layer at a time (`quantize_model`). The format and its arithmetic are
app/engine/hf/fp8.py's; the experts' forward over the banks is app/engine/hf/moe/fp8.py's. Pure: no I/O.

What is converted: in every text layer the attention's q/k/v/o projections (full layers have no
v_proj), the dense MLP's gate/up/down, and the experts' `gate_up_proj` [E, 2I, H] and `down_proj`
[E, H, I], which keep their names and gain `gate_up_proj_scale` [E, 2I] and `down_proj_scale` [E, H]
(float32, one scale per output channel). The decoder's layers hold the encoder's weights (tied): each
weight is converted once and the FP8 module or bank is set on both. Everything else (the router,
norms, embeddings and unembedding, the vision tower, self-conditioning, embed_vision) stays as it is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

import torch
from torch import nn

from app.engine.hf import fp8

if TYPE_CHECKING:
    from transformers import DiffusionGemmaForBlockDiffusion

    from app.engine.base import StartupProgress

# The dense projections converted, by the submodule of a text layer that holds them.
PROJECTIONS = (("self_attn", ("q_proj", "k_proj", "v_proj", "o_proj")), ("mlp", ("gate_proj", "up_proj", "down_proj")))
# An experts module's banks; each gains a float32 scale named with SCALE_SUFFIX.
BANKS = ("gate_up_proj", "down_proj")
SCALE_SUFFIX = "_scale"
PHASE = "quantizing the weights to FP8"


class Fp8Linear(nn.Module):
    """A bias-free linear layer whose weight is e4m3 [out, in] with one float32 scale per output
    channel ([out]). Its input is quantized per token: on CUDA the product is `torch._scaled_mm`'s,
    elsewhere app/engine/hf/fp8.py's reference (slow: for tests and the CPU)."""

    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor) -> None:
        super().__init__()
        if weight.dtype != fp8.E4M3 or weight.dim() != 2:
            raise ValueError(f"an Fp8Linear's weight is a 2-D {fp8.E4M3} tensor, not {weight.dtype} {tuple(weight.shape)}")
        if weight_scale.dtype != torch.float32 or tuple(weight_scale.shape) != (weight.shape[0],):
            raise ValueError(f"an Fp8Linear's weight_scale is float32 [{weight.shape[0]}], not {weight_scale.dtype} "
                             f"{tuple(weight_scale.shape)}")
        self.out_features, self.in_features = int(weight.shape[0]), int(weight.shape[1])
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.weight_scale = nn.Parameter(weight_scale, requires_grad=False)

    @classmethod
    def empty(cls, in_features: int, out_features: int, device: torch.device | str | None = None) -> Fp8Linear:
        """One with uninitialised weights (on the meta device: nothing is allocated), to be filled."""
        return cls(torch.empty(out_features, in_features, dtype=fp8.E4M3, device=device),
                   torch.empty(out_features, dtype=torch.float32, device=device))

    @classmethod
    def from_linear(cls, linear: nn.Module, device: torch.device | str | None = None) -> Fp8Linear:
        """`linear`'s weight quantized (on `device`; None: where it is)."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"only an nn.Linear converts to an Fp8Linear, not a {type(linear).__name__}")
        if linear.bias is not None:
            raise ValueError("this linear layer has a bias: djev's FP8 projections have none (DiffusionGemma's text "
                             "layers have none)")
        weight = linear.weight.detach()
        with torch.no_grad():
            q, scale = fp8.quantize_weight(weight if device is None else weight.to(device))
        return cls(q, scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if flat.is_cuda:
            out = scaled_mm_linear(flat, self.weight, self.weight_scale)
        else:
            out = fp8.linear(flat, self.weight, self.weight_scale)
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, weight={fp8.E4M3}"


def scaled_mm_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`fp8.linear` through `torch._scaled_mm` (row-wise scales: the activations' per token, the
    weight's per output channel): what `Fp8Linear` runs on CUDA. The per-token quantization is torch
    ops, which torch.compile fuses inside the compiled layer bodies."""
    xq, x_scale = fp8.quantize_tokens(x)
    # torch's FP8 GEMM (cuBLASLt on CUDA); the stubs do not export it, torch.nn.functional.scaled_mm wraps it.
    return torch._scaled_mm(xq, q.t(), scale_a=x_scale.unsqueeze(1),  # pyright: ignore[reportPrivateImportUsage]
                            scale_b=scale.to(torch.float32).unsqueeze(0), out_dtype=x.dtype)


@dataclass(frozen=True)
class Fp8Counts:
    """What a conversion made FP8, each tied weight once."""

    projections: int  # dense projections (Fp8Linear modules)
    experts: int  # experts modules' pairs of banks


def quantize_bank(bank: torch.Tensor, device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scale): an experts bank [E, out, in] as e4m3 with float32 scales [E, out], on `device`
    (None: where it is), quantized an expert at a time so the float32 work is one expert's."""
    target = bank.device if device is None else torch.device(device)
    q = torch.empty(bank.shape, dtype=fp8.E4M3, device=target)
    scale = torch.empty(bank.shape[:2], dtype=torch.float32, device=target)
    with torch.no_grad():
        for expert in range(bank.shape[0]):
            q[expert], scale[expert] = fp8.quantize_weight(bank[expert].detach().to(target))
    return q, scale


def empty_bank(bank: torch.Tensor, device: torch.device | str = "meta") -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scale) of `bank`'s shape, uninitialised (on the meta device: nothing is allocated)."""
    return (torch.empty(bank.shape, dtype=fp8.E4M3, device=device),
            torch.empty(bank.shape[:2], dtype=torch.float32, device=device))


def text_layer_groups(model: DiffusionGemmaForBlockDiffusion) -> list[tuple[nn.Module, ...]]:
    """Each text layer with the layers that share its weights: (encoder layer, decoder layer) by index."""
    from app.engine.hf.parts import decoder_layers, encoder_layers

    return list(zip(encoder_layers(model), decoder_layers(model), strict=True))


def convert_layer(layers: Sequence[nn.Module], make_linear: Callable[[nn.Module], Fp8Linear],
                  make_bank: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]) -> Fp8Counts:
    """Replace the projections and experts banks of `layers` (layers that may share weights) by
    FP8 ones `make_linear` and `make_bank` make, once per distinct weight, set on every layer that
    shares it."""
    projections = experts_made = 0
    for part, names in PROJECTIONS:
        for name in names:
            made: dict[int, tuple[torch.Tensor, Fp8Linear]] = {}  # the wide weight kept alive while its id is a key
            for layer in layers:
                parent = getattr(layer, part)
                linear = getattr(parent, name, None)
                if linear is None:  # v_proj on a full attention layer (K = V)
                    continue
                weight = linear.get_parameter("weight")
                if id(weight) not in made:
                    made[id(weight)] = (weight, make_linear(linear))
                    projections += 1
                setattr(parent, name, made[id(weight)][1])
    banks: dict[int, tuple[torch.Tensor, dict[str, nn.Parameter]]] = {}  # the wide bank kept alive, as above
    for layer in layers:
        experts = getattr(layer, "experts", None)
        if experts is None:
            continue
        first = experts.get_parameter(BANKS[0])
        if id(first) not in banks:
            made_banks: dict[str, nn.Parameter] = {}
            for name in BANKS:
                q, scale = make_bank(experts.get_parameter(name))
                made_banks[name] = nn.Parameter(q, requires_grad=False)
                made_banks[name + SCALE_SUFFIX] = nn.Parameter(scale, requires_grad=False)
            banks[id(first)] = (first, made_banks)
            experts_made += 1
        for name, param in banks[id(first)][1].items():
            setattr(experts, name, param)
    return Fp8Counts(projections, experts_made)


def quantize_model(model: DiffusionGemmaForBlockDiffusion, progress: StartupProgress | None = None,
                   device: torch.device | str | None = None) -> Fp8Counts:
    """Convert `model`'s text layers to FP8 in place, a layer at a time: each layer's wide weights
    are released (unless something else holds them) before the next is converted, so the memory at
    its peak is the FP8 weights plus one layer's wide ones. `device`: where the FP8 weights go (None:
    where each wide weight is), so a model loaded on the host can be quantized onto the GPU a layer at
    a time. `progress` hears each layer done. Returns what was converted."""
    if is_fp8_model(model):
        raise ValueError("the model's weights are FP8 already")
    groups = text_layer_groups(model)
    projections = experts = 0
    for index, layers in enumerate(groups):
        counts = convert_layer(layers, lambda linear: Fp8Linear.from_linear(linear, device),
                               lambda bank: quantize_bank(bank, device))
        projections += counts.projections
        experts += counts.experts
        if progress is not None:
            progress(PHASE, index + 1, len(groups))
    return Fp8Counts(projections, experts)


def install_empty_fp8(model: DiffusionGemmaForBlockDiffusion) -> Fp8Counts:
    """Give a model built on the meta device (app/engine/hf/meta.py) its FP8 modules and banks, empty
    on the meta device, before it is materialised and filled (from an FP8 checkpoint, or randomly)."""
    def linear(module: nn.Module) -> Fp8Linear:
        if not isinstance(module, nn.Linear):
            raise TypeError(f"expected an nn.Linear projection, not a {type(module).__name__}")
        if module.bias is not None:
            raise ValueError("a projection with a bias cannot be FP8: djev's FP8 projections have none")
        return Fp8Linear.empty(module.in_features, module.out_features, device="meta")

    projections = experts = 0
    for layers in text_layer_groups(model):
        counts = convert_layer(layers, linear, empty_bank)
        projections += counts.projections
        experts += counts.experts
    return Fp8Counts(projections, experts)


def is_fp8_model(model: nn.Module) -> bool:
    """Whether the model holds FP8 weights (an Fp8Linear, or an experts bank in e4m3)."""
    for module in model.modules():
        if isinstance(module, Fp8Linear):
            return True
        bank = getattr(module, BANKS[0], None)
        if isinstance(bank, torch.Tensor) and fp8.is_fp8(bank):
            return True
    return False
