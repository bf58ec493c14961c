"""The benches' models: the full-size DiffusionGemma 26B-A4B config, the random-weight builder every
bench uses, the reader `djev serve` would make over random weights, and the model-side knobs the
benches turn (the vision tower's attention kernel order; grouped_mm's view of an experts module).

The builder (`build_model`) allocates each unique weight once on the device. The model's decoder
layers are its encoder's (tied), so the full-size model's unique weights are 47.35 GiB in bf16;
built under a device context the decoder's layers are allocated before they are tied and the
build peaks near twice that (out of memory on an 80 GB H100). Here the parameters are made on the
meta device, the ties are made there (app/engine/hf/meta.py), then every distinct tensor gets one
real tensor on the device, shared by every name that shares it, and the model's own initialisation
fills them. With `weights="fp8"` the text layers' projections and experts are made FP8 on the meta
device first (app/engine/hf/quantize.py's format), so they are allocated in e4m3 and drawn there:
no bf16 copy of them ever exists (the full model in bf16 would leave no room beside the FP8 one).

torch and transformers are imported where used, as in bench/common.py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from app.engine.hf.meta import materialise, parameters_on_meta

if TYPE_CHECKING:
    import torch
    from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion

__all__ = ["materialise", "parameters_on_meta"]  # the builder's steps, where the benches have always found them

# The published config of google/diffusiongemma-26B-A4B-it. The rest -- RoPE per layer type, softcap 30,
# tied embeddings, the 5:1 sliding:full pattern with the last layer full -- are the config class's
# defaults. Built this way it has 25.42 B parameters.
FULL_TEXT_CONFIG: dict[str, Any] = dict(
    vocab_size=262_144,
    hidden_size=2816,
    intermediate_size=2112,  # the dense MLP beside the experts
    num_hidden_layers=30,
    num_attention_heads=16,
    num_key_value_heads=8,  # sliding layers: 8 KV heads x 256
    head_dim=256,
    global_head_dim=512,  # full layers: 2 KV heads x 512, K = V
    num_global_key_value_heads=2,
    attention_k_eq_v=True,
    sliding_window=1024,
    num_experts=128,
    top_k_experts=8,
    moe_intermediate_size=704,
    enable_moe_block=True,
    max_position_embeddings=262_144,
    use_bidirectional_attention="vision",
)
FULL_MODEL_NAME = "random-26B-A4B"  # the name a reader over the full-size random weights serves as


# ---------------------------------------------------------------------------------------- configs

def full_config(tokenizer: Any = None, **text: Any) -> DiffusionGemmaConfig:
    """The full-size config (`text` overrides FULL_TEXT_CONFIG's fields). With a tokenizer, the
    image ids are that tokenizer's (the benches serve with the tiny model's: the real one needs the
    checkpoint); without one, the config class's defaults."""
    from transformers import DiffusionGemmaConfig

    ids: dict[str, int] = {}
    if tokenizer is not None:
        ids = {key: int(tokenizer.convert_tokens_to_ids(token)) for key, token in
               (("boi_token_id", "<|image>"), ("eoi_token_id", "<image|>"), ("image_token_id", "<|image|>"))}
    return DiffusionGemmaConfig(text_config={**FULL_TEXT_CONFIG, **text}, vision_config={"model_type": "gemma4_vision"},
                                canvas_length=256, **ids)


def model_config(tiny: bool, tokenizer: Any = None) -> DiffusionGemmaConfig:
    """The tiny model's config (app/engine/tiny.py) or the full-size one; `tokenizer` as in
    `full_config` (the tiny config takes its own tokenizer's ids in any case)."""
    if tiny:
        from app.engine.tiny import build_config, build_tokenizer

        return build_config(tokenizer or build_tokenizer())
    return full_config(tokenizer)


def image_processor(tiny: bool) -> Any:
    """The image processor the server would load: the tiny checkpoint's (8 px patches, 70 soft
    tokens), or Gemma 4's defaults (16 px patches, 280 soft tokens)."""
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    from app.engine.tiny import TINY_IMAGE_SOFT_TOKENS, TINY_PATCH_SIZE, TINY_POOLING_KERNEL

    if tiny:
        return Gemma4ImageProcessorPil(patch_size=TINY_PATCH_SIZE, pooling_kernel_size=TINY_POOLING_KERNEL,
                                       max_soft_tokens=TINY_IMAGE_SOFT_TOKENS)
    return Gemma4ImageProcessorPil()


def served_dtype(device: str) -> torch.dtype:
    """The dtype the server loads in on the device: bf16 on CUDA, float32 on the CPU."""
    import torch

    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


def served_experts(device: str) -> str | None:
    """The experts implementation the server loads with: grouped_mm on CUDA (the eager loop is 13x
    slower on an H200), transformers' own choice on the CPU."""
    import torch

    return "grouped_mm" if torch.device(device).type == "cuda" else None


# ---------------------------------------------------------------------------------------- the builder

# build_model's weights: the served dtype throughout, or FP8 text layers (QUANTIZE=fp8's format) beside it.
WEIGHTS = ("bf16", "fp8")


def build_model(config: DiffusionGemmaConfig, device: str, dtype: torch.dtype, experts: str | None,
                seed: int = 0, weights: str = "bf16") -> DiffusionGemmaForBlockDiffusion:
    """DiffusionGemma with random weights on `device`, each unique weight allocated once.

    Built with its parameters on the meta device (`parameters_on_meta`: the buffers are built as a
    normal build makes them), tied there, then materialised (`materialise`) and given random values
    by the model's own initialisation (`initialise`, drawn after `torch.manual_seed(seed)`).
    `experts`: the experts implementation (None: transformers' own choice). `weights`: "bf16", every
    weight in `dtype`; "fp8", the text layers' projections and experts in FP8 (`random_fp8`: random
    e4m3 values with a scale per output channel, made on the device), the rest in `dtype`."""
    import torch
    from transformers import DiffusionGemmaForBlockDiffusion

    from app.engine.hf.quantize import install_empty_fp8

    if weights not in WEIGHTS:
        raise ValueError(f"weights must be one of {', '.join(WEIGHTS)}, not {weights!r}")
    kwargs: dict[str, Any] = {"dtype": dtype, "attn_implementation": "sdpa"}
    if experts:
        kwargs["experts_implementation"] = experts
    with parameters_on_meta():
        model = DiffusionGemmaForBlockDiffusion._from_config(config, **kwargs)
    if weights == "fp8":
        install_empty_fp8(model)
    materialise(model, torch.device(device))
    torch.manual_seed(seed)
    initialise(model)
    if weights == "fp8":
        random_fp8(model, float(getattr(config.text_config, "initializer_range", 0.02)))
    if experts and getattr(model.config, "_experts_implementation", experts) != experts:
        model.set_experts_implementation(experts)
    return model.eval()


def initialise(model: DiffusionGemmaForBlockDiffusion) -> None:
    """Random values in every parameter, by the model's own initialisation (`_init_weights`: normal
    with std `initializer_range`, ones for the norms and scales, the padding row zero), each tied
    tensor once, by the module a normal build keeps it from: the tie's source. A module whose every
    parameter is a tie target is left out (a normal build drew its own tensor, then replaced it by
    the source's), and so is one with no parameters (its buffers hold the build's values already)."""
    from app.engine.hf.fp8 import is_fp8
    from app.engine.hf.quantize import Fp8Linear

    targets = set(model.all_tied_weights_keys)
    for prefix, module in model.named_modules():
        names = [f"{prefix}.{name}" if prefix else name for name, _ in module.named_parameters(recurse=False)]
        # An FP8 module (drawn by `random_fp8`: the initialisation draws no e4m3) is left out too.
        fp8 = isinstance(module, Fp8Linear) or any(is_fp8(param) for param in module.parameters(recurse=False))
        module._is_hf_initialized = fp8 or not names or all(name in targets for name in names)  # type: ignore[attr-defined]
    model.initialize_weights()


def random_fp8(model: DiffusionGemmaForBlockDiffusion, std: float) -> None:
    """Random values in every FP8 weight, each tied one once: a normal draw with the
    initialisation's spread (`std`), quantized to e4m3 with a scale per output channel, one
    projection or one expert at a time on the weight's device (no wide copy of a layer)."""
    import torch

    from app.engine.hf import fp8
    from app.engine.hf.quantize import BANKS, SCALE_SUFFIX, Fp8Linear

    def draw(q: torch.Tensor, scale: torch.Tensor) -> None:
        values, scales = fp8.quantize_weight(torch.randn(q.shape, device=q.device) * std)
        q.copy_(values)
        scale.copy_(scales)

    drawn: set[int] = set()
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, Fp8Linear) and id(module.weight) not in drawn:
                drawn.add(id(module.weight))
                draw(module.weight, module.weight_scale)
                continue
            for name in BANKS:
                bank = getattr(module, name, None)
                if not isinstance(bank, torch.Tensor) or not fp8.is_fp8(bank) or id(bank) in drawn:
                    continue
                drawn.add(id(bank))
                scale = module.get_parameter(name + SCALE_SUFFIX)
                for expert in range(bank.shape[0]):
                    draw(bank[expert], scale[expert])


# ---------------------------------------------------------------------------------------- random-weight readers

def random_model(tiny: bool, device: str, weights: str = "bf16") -> tuple[DiffusionGemmaForBlockDiffusion, Any, Any]:
    """(model, tokenizer, image processor) as the server would serve them, the weights random: the
    tiny config or the full-size one (with the tiny tokenizer's image ids), in the server's dtype
    and experts implementation for the device; `weights` as `build_model` takes it."""
    from app.engine.tiny import build_tokenizer

    tokenizer = build_tokenizer()
    model = build_model(model_config(tiny, tokenizer), device, served_dtype(device), served_experts(device),
                        weights=weights)
    return model, tokenizer, image_processor(tiny)


def served_name(tiny: bool) -> str:
    return "tiny" if tiny else FULL_MODEL_NAME


def random_weights(settings: Any) -> str:
    """The random weights' format for `settings`: "fp8" where QUANTIZE is fp8 (what quantizing a bf16
    checkpoint at load would give, made on the device directly), else "bf16"."""
    return "fp8" if settings.hf.quantize == "fp8" else "bf16"


def load_random(tiny: bool, device: str, settings: Any, progress: Any = None, weights: str = "bf16") -> Any:
    """The reader `djev serve` makes (`hf_reader`: fused experts, compiled layers, graphs captured,
    as `settings` ask) over random weights (`weights`: "bf16" or "fp8", as `build_model` takes it):
    the `load` a served bench gives `cli.serve`."""
    from app.build import hf_options
    from app.engine.hf.loader import hf_reader

    model, tokenizer, processor = random_model(tiny, device, weights)
    return hf_reader(model, tokenizer, processor, hf_options(settings, served_name(tiny), tiny=tiny), progress=progress)


# ---------------------------------------------------------------------------------------- knobs and views

# --vision-attention: which kernel the vision tower's attention tries first (an A/B of
# app.engine.hf.layers.VISION_ATTENTION, which the served engine takes as it is).
VISION_KERNELS = {"cudnn": "CUDNN_ATTENTION", "efficient": "EFFICIENT_ATTENTION", "flash": "FLASH_ATTENTION"}


def choose_vision_attention(name: str) -> None:
    """Put the VISION_KERNELS kernel `name` first in the vision tower's order, the rest kept."""
    from torch.nn.attention import SDPBackend

    from app.engine.hf import layers

    first = getattr(SDPBackend, VISION_KERNELS[name])
    layers.VISION_ATTENTION = (first, *(kernel for kernel in layers.VISION_ATTENTION if kernel != first))


class Experts:
    """What transformers' grouped_mm experts forward reads from a module: one layer's experts as two
    tensors (bench/bench_gpu_moe.py, and the fused kernels' CPU checks)."""

    def __init__(self, gate_up: Any, down: Any) -> None:
        import torch.nn.functional as F

        self.gate_up_proj, self.down_proj = gate_up, down
        self.num_experts = gate_up.shape[0]
        self.act_fn = lambda t: F.gelu(t, approximate="tanh")
        self.has_gate, self.has_bias, self.is_transposed = True, False, False
        self.has_post_expert_norm, self._is_expert_parallel = False, False

    def _apply_gate(self, gate_up_out: Any) -> Any:
        gate, up = gate_up_out.chunk(2, dim=-1)
        return self.act_fn(gate) * up
