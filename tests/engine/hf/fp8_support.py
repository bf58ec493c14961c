"""What the FP8 tests share: the reads they compare and the bound they hold them to, and a tiny
compressed-tensors FP8 checkpoint in the layout of RedHatAI/diffusiongemma-26B-A4B-it-FP8-dynamic,
written with compressed-tensors' own quantization and compression (as llm-compressor saves one), with
the broken variants the loader must refuse.

The tiny checkpoint is loaded in bf16, the experts of the layers it stores (the decoder's, which the
encoder's are tied to) opened into one Linear per expert and projection (`experts.<e>.gate_proj`, ...),
compressed-tensors' FP8_DYNAMIC scheme applied to every Linear but those a real release keeps in bf16
(routers, vision tower, embed_vision, self-conditioning, lm_head), each weight's per-channel scale
computed by compressed-tensors' `calculate_qparams` from the weight's range (memoryless min-max, the
scheme's observer), the model compressed by `ModelCompressor` ("float-quantized": e4m3 weights, bf16
scales [out, 1]), and the tensors the checkpoint held before written under their names, with the
per-expert tensors in place of the fused banks; `ModelCompressor.update_config` writes the
quantization_config into config.json.
"""

from __future__ import annotations

import json
import math
import random
import re
import shutil
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from app.engine.base import ReadSpec

WEIGHTS = "model.safetensors"
# What a real release keeps unquantized (its `ignore` list names these modules).
KEPT_BF16 = ("router", "vision_tower", "embed_vision", "self_conditioning", "lm_head")
PER_EXPERT = re.compile(r"model\.decoder\.layers\.\d+\.experts\.\d+\.(gate_proj|up_proj|down_proj)\.weight(_scale)?")


class Expert(nn.Module):
    """One expert as three Linears: the per-expert layout compressed-tensors targets and saves."""

    def __init__(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> None:
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = (linear_of(weight) for weight in (gate, up, down))


def linear_of(weight: torch.Tensor) -> nn.Linear:
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False, dtype=weight.dtype)
    with torch.no_grad():
        linear.weight.copy_(weight)
    return linear


def per_expert(experts: nn.Module) -> nn.ModuleList:
    """A fused experts module's banks as one `Expert` each (gate: the first half of gate_up_proj's rows)."""
    gate_up, down = experts.get_parameter("gate_up_proj").detach(), experts.get_parameter("down_proj").detach()
    half = gate_up.shape[1] // 2
    return nn.ModuleList(Expert(gate_up[e, :half], gate_up[e, half:], down[e]) for e in range(gate_up.shape[0]))


def write_fp8_checkpoint(source: Path, target: Path) -> Path:
    """The tiny checkpoint at `source` as a compressed-tensors FP8 checkpoint at `target` (see above)."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config, preset_name_to_scheme
    from compressed_tensors.quantization.utils import calculate_qparams
    from transformers import DiffusionGemmaForBlockDiffusion

    from app.engine.hf.parts import decoder_layers

    with safe_open(str(source / WEIGHTS), "pt") as stored:
        saved = set(stored.keys())
    model = DiffusionGemmaForBlockDiffusion.from_pretrained(str(source), dtype=torch.bfloat16)
    for layer in decoder_layers(model):
        layer.experts = per_expert(layer.experts)
    ignore = [name for name, module in model.named_modules()
              if isinstance(module, nn.Linear) and any(part in name for part in KEPT_BF16)]
    config = QuantizationConfig(config_groups={"group_0": preset_name_to_scheme("FP8_DYNAMIC", ["Linear"])},
                                ignore=ignore)
    apply_quantization_config(model, config, show_progress=False)
    with torch.no_grad():
        for module in model.modules():
            scheme = getattr(module, "quantization_scheme", None)
            if scheme is None:
                continue
            weight = module.get_parameter("weight").detach()
            scale, _ = calculate_qparams(weight.amin(dim=1, keepdim=True), weight.amax(dim=1, keepdim=True),
                                         scheme.weights)
            module.get_parameter("weight_scale").copy_(scale)
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format="float-quantized")
    compressor.compress_model(model)
    tensors = {name: tensor.detach().contiguous() for name, tensor in model.state_dict().items()
               if name in saved or name.removesuffix("_scale") in saved or PER_EXPERT.fullmatch(name)}
    target.mkdir(parents=True, exist_ok=True)
    for path in source.iterdir():
        if path.name != WEIGHTS:
            shutil.copy(path, target / path.name)
    save_file(tensors, str(target / WEIGHTS), metadata={"format": "pt"})
    compressor.update_config(str(target))
    return target


def read_tensors(checkpoint: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(checkpoint / WEIGHTS), "pt") as stored:
        return {name: stored.get_tensor(name) for name in stored.keys()}


def variant(source: Path, target: Path, tensors: Callable[[dict[str, torch.Tensor]], None] | None = None,
            quantization: Callable[[dict], None] | None = None) -> Path:
    """A copy of the checkpoint at `source` with its tensors and its quantization_config changed in place
    by the functions given."""
    shutil.copytree(source, target)
    if tensors is not None:
        changed = read_tensors(source)
        tensors(changed)
        save_file(changed, str(target / WEIGHTS), metadata={"format": "pt"})
    if quantization is not None:
        config = json.loads((target / "config.json").read_text())
        quantization(config["quantization_config"])
        (target / "config.json").write_text(json.dumps(config, indent=2))
    return target


# ---------------------------------------------------------------------------------------- reads

STATE_WORDS = ("the quick brown fox jumps over a lazy dog; the customer says everything is down before the demo, "
               "billing wants a refund, the ticket is calm or furious").split()


def read_specs(tokenizer, count: int = 30, canvases: int = 3, seed: int = 0) -> list[ReadSpec]:
    """`count` yes/no reads of random states of 3 to 40 words, each over `canvases` noise draws."""
    from tests.engine.hf.test_reader import spec_for

    rng = random.Random(seed)
    specs = []
    for _ in range(count):
        state = " ".join(rng.choice(STATE_WORDS) for _ in range(rng.randint(3, 40)))
        specs.append(spec_for(tokenizer, state, "q1: yes", [rng.randrange(100, 2000) for _ in range(canvases)]))
    return specs


def yes_probabilities(reader, specs: list[ReadSpec]) -> list[float]:
    """Each canvas's probability of "yes" between the two labels (its label distribution)."""
    found = []
    for result in reader.runner.read(specs):
        for canvas in result.slots:
            for slot in canvas:
                yes, no = (math.exp(logprob) for logprob in slot.label_logprobs)
                found.append(yes / (yes + no))
    return found


@dataclass(frozen=True)
class Deviation:
    """How far one model's label probabilities are from another's over the same reads."""

    mean: float  # mean |p - p'|
    largest: float
    agreement: float  # share of reads whose more probable label is the same

    @classmethod
    def between(cls, want: list[float], got: list[float]) -> Deviation:
        gaps = [abs(a - b) for a, b in zip(want, got, strict=True)]
        same = sum((a > 0.5) == (b > 0.5) for a, b in zip(want, got, strict=True))
        return cls(statistics.fmean(gaps), max(gaps), same / len(gaps))


# The bounds FP8 reads of the tiny model are held to, against its float32 reads (`read_specs`: 90
# canvases). The tiny model is random with weights of spread 0.3, which makes it far more sensitive to
# rounding than a trained model: bf16 weights alone (the served dtype) move its "yes" probabilities by
# a mean of 0.034 (0.53 at most) and flip 4 of the 90 labels. FP8 rounds each weight and activation to
# 3 mantissa bits (one projection: 3.5 % relative RMS error) and measured a mean of 0.150 (0.75 at
# most, 84 % of labels the same) quantized at load, 0.148 (0.86, 83 %) from the compressed-tensors
# checkpoint; two unrelated sets of reads (the same reads shuffled) differ by a mean of 0.39 and agree
# on 53 %.
MEAN_BOUND = 0.25
AGREEMENT_BOUND = 0.7
# One text layer run on the input the float32 layer got: its output's relative error (||delta|| / ||out||),
# measured 0.021 to 0.086 over the tiny model's six layers and four prompts (a mean of 0.045 on
# LAYER_PROMPT), quantized at load or from the checkpoint.
LAYER_BOUND = 0.12
LAYER_MEAN_BOUND = 0.06
LAYER_PROMPT = "the quick brown fox jumps over the lazy dog; everything is down before the demo " * 3


def layer_errors(reference: nn.Module, model: nn.Module, tokenizer) -> list[float]:
    """Each encoder text layer of `model` run on what the same layer of `reference` was given in a
    forward of LAYER_PROMPT: the relative error of its output against the reference layer's."""
    from app.engine.hf.parts import encoder_layers

    given: list[tuple[tuple, dict, torch.Tensor]] = []

    def keep(module: nn.Module, args: tuple, kwargs: dict, output) -> None:
        given.append((args, kwargs, output[0] if isinstance(output, tuple) else output))

    hooks = [layer.register_forward_hook(keep, with_kwargs=True) for layer in encoder_layers(reference)]
    ids = torch.tensor([tokenizer.encode(LAYER_PROMPT)])
    try:
        with torch.no_grad():
            reference.get_submodule("model.encoder.language_model")(input_ids=ids)
    finally:
        for hook in hooks:
            hook.remove()
    errors = []
    with torch.no_grad():
        for layer, (args, kwargs, want) in zip(encoder_layers(model), given, strict=True):
            got = layer(*args, **{**kwargs, "past_key_values": None})  # the forward's cache holds this prompt already
            got = got[0] if isinstance(got, tuple) else got
            errors.append(float((got - want).norm() / want.norm()))
    return errors
