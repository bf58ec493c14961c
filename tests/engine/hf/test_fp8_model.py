"""FP8 weights on the tiny model, on the CPU: an Fp8Linear computes app/engine/hf/fp8.py's reference
product (and torch._scaled_mm's, the CUDA path, agrees with it), `quantize_model` converts every text
projection and experts bank once (the decoder's layers share the encoder's), nothing else, a layer at
a time, and the FP8 model's layers and reads stay within stated bounds of the float32 model's.
QUANTIZE picks it at load."""

from __future__ import annotations

import logging
import weakref

import pytest
import torch
from torch import nn
from transformers import DiffusionGemmaForBlockDiffusion

from app.build import hf_options
from app.cli import build_parser, settings_from_args
from app.config import Settings
from app.engine.hf import fp8
from app.engine.hf.memory import unique_bytes
from app.engine.hf.parts import decoder_layers, encoder_layers, layer_types
from app.engine.hf.quantize import BANKS, PROJECTIONS, Fp8Linear, is_fp8_model, quantize_model, scaled_mm_linear
from tests.conftest import make_tiny_reader
from tests.engine.hf.fp8_support import (
    AGREEMENT_BOUND,
    LAYER_BOUND,
    LAYER_MEAN_BOUND,
    MEAN_BOUND,
    Deviation,
    layer_errors,
    read_specs,
    yes_probabilities,
)

# One projection's relative RMS error against the float32 product: e4m3 keeps 3 mantissa bits, so
# each weight and each activation is off by at most 2^-4 of itself (about 2.5 % RMS); the product
# measured 3.5 % at both shapes below.
LINEAR_BOUND = 0.05


def linear(in_features: int, out_features: int, seed: int) -> nn.Linear:
    torch.manual_seed(seed)
    layer = nn.Linear(in_features, out_features, bias=False)
    nn.init.normal_(layer.weight, std=0.3)
    return layer


@pytest.mark.parametrize("in_features, out_features", [(64, 128), (2816, 704)])
def test_an_fp8_linear_is_the_reference_product_and_near_the_float32_one(in_features, out_features):
    wide = linear(in_features, out_features, seed=in_features)
    layer = Fp8Linear.from_linear(wide)
    assert (layer.in_features, layer.out_features) == (in_features, out_features)
    assert layer.weight.dtype == fp8.E4M3 and tuple(layer.weight.shape) == (out_features, in_features)
    assert layer.weight_scale.dtype == torch.float32 and tuple(layer.weight_scale.shape) == (out_features,)
    assert not layer.weight.requires_grad and not layer.weight_scale.requires_grad
    q, scale = fp8.quantize_weight(wide.weight.detach())
    assert torch.equal(layer.weight.view(torch.uint8), q.view(torch.uint8)) and torch.equal(layer.weight_scale, scale)

    x = torch.randn(3, 5, in_features, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got, want = layer(x), wide(x)
    assert got.shape == (3, 5, out_features) and got.dtype == torch.float32
    assert torch.equal(got, fp8.linear(x.reshape(15, in_features), q, scale).reshape(3, 5, out_features))
    error = float((got - want).norm() / want.norm())
    assert 0.01 < error < LINEAR_BOUND  # FP8 rounds (it is not the float32 product), within the bound

    # The CUDA path, torch._scaled_mm with row-wise scales, runs on the CPU too: the same product up to
    # the float32 summation order (measured 4e-7 of the largest value), and in bf16 up to the final
    # rounding (one bf16 step, at most 2^-7 of a value: 5 of 10,560 values at 2816 inputs, none at 64).
    flat = x.reshape(15, in_features)
    reference = fp8.linear(flat, q, scale)
    assert float((scaled_mm_linear(flat, q, scale) - reference).abs().max()) <= 2e-6 * float(reference.abs().max())
    half = flat.bfloat16()
    assert torch.allclose(scaled_mm_linear(half, q, scale).float(), fp8.linear(half, q, scale).float(), rtol=2**-7, atol=0)


def test_an_fp8_linear_refuses_a_bias_and_a_wide_weight():
    with pytest.raises(ValueError, match="bias"):
        Fp8Linear.from_linear(nn.Linear(16, 16, bias=True))
    with pytest.raises(TypeError, match="nn.Linear"):
        Fp8Linear.from_linear(nn.Conv1d(16, 16, 1))
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        Fp8Linear(torch.zeros(16, 16), torch.ones(16))
    with pytest.raises(ValueError, match=r"weight_scale is float32 \[16\]"):
        Fp8Linear(torch.zeros(16, 16).to(fp8.E4M3), torch.ones(16, 1))


def converted_names(model: nn.Module) -> set[str]:
    """The names (every alias) of the tensors `quantize_model` replaces."""
    names = set()
    for stack, layers in (("model.encoder.language_model.layers", encoder_layers(model)),
                          ("model.decoder.layers", decoder_layers(model))):
        for index, layer in enumerate(layers):
            for part, projections in PROJECTIONS:
                names |= {f"{stack}.{index}.{part}.{name}.weight" for name in projections
                          if getattr(getattr(layer, part), name) is not None}
            names |= {f"{stack}.{index}.experts.{bank}" for bank in BANKS}
    return names


def converted_bytes(model: nn.Module, names: set[str]) -> tuple[int, int]:
    """The bytes of the tensors named (each tied one once), and of what they become in FP8 (e4m3, and
    a float32 scale a row)."""
    unique = {model.get_parameter(name).data_ptr(): model.get_parameter(name) for name in names}
    return (sum(param.nbytes for param in unique.values()),
            sum(param.numel() + 4 * param[..., 0].numel() for param in unique.values()))


def test_quantize_model_converts_each_projection_and_bank_once_and_nothing_else(tiny_dir):
    model = DiffusionGemmaForBlockDiffusion.from_pretrained(str(tiny_dir)).eval()
    converted = converted_names(model)
    before = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
    assert converted <= before.keys()
    wide_bytes = unique_bytes(model)
    wide_converted, fp8_converted = converted_bytes(model, converted)
    assert not is_fp8_model(model)

    # Each layer's wide weights are released before the next layer is converted.
    layers = encoder_layers(model)
    wide = [[weakref.ref(model.get_parameter(name)) for name in converted
             if name.startswith(f"model.encoder.language_model.layers.{index}.")] for index in range(len(layers))]
    assert all(len(refs) in (6 + 2, 7 + 2) for refs in wide)  # the projections and the two banks
    reports = []

    def progress(phase: str, done: int, total: int) -> None:
        reports.append((phase, done, total))
        for index, refs in enumerate(wide):
            released = [ref() is None for ref in refs]
            assert all(released) if index < done else not any(released), (done, index)

    counts = quantize_model(model, progress)
    assert reports == [("quantizing the weights to FP8", done, len(layers)) for done in range(1, len(layers) + 1)]
    kinds = layer_types(model)
    assert counts.projections == 7 * kinds.count("sliding_attention") + 6 * kinds.count("full_attention") == 41
    assert counts.experts == len(layers) == 6
    assert is_fp8_model(model)

    config = model.config.text_config
    experts, hidden, inter = config.num_experts, config.hidden_size, config.moe_intermediate_size
    for encoder, decoder in zip(encoder_layers(model), decoder_layers(model), strict=True):
        for part, projections in PROJECTIONS:
            for name in projections:
                module = getattr(getattr(encoder, part), name)
                if module is None:
                    continue
                assert isinstance(module, Fp8Linear) and getattr(getattr(decoder, part), name) is module
        for bank, shape in (("gate_up_proj", (experts, 2 * inter, hidden)), ("down_proj", (experts, hidden, inter))):
            q, scale = encoder.experts.get_parameter(bank), encoder.experts.get_parameter(bank + "_scale")
            assert q.dtype == fp8.E4M3 and tuple(q.shape) == shape
            assert scale.dtype == torch.float32 and tuple(scale.shape) == shape[:2]
            assert decoder.experts.get_parameter(bank) is q and decoder.experts.get_parameter(bank + "_scale") is scale
            # The bank holds each expert quantized as the format says, close to the float32 weights.
            want_q, want_scale = fp8.quantize_weight(before[f"model.decoder.layers.{encoder.layer_idx}.experts.{bank}"])
            assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(scale, want_scale)
        assert isinstance(encoder.router.proj, nn.Linear) and encoder.router.proj.weight.dtype == torch.float32

    after = model.state_dict()
    for name, tensor in before.items():
        if name not in converted:
            assert torch.equal(after[name], tensor), name  # the router, norms, embeddings, vision, self-conditioning
    assert not any(isinstance(module, Fp8Linear) for module in model.model.encoder.vision_tower.modules())
    assert model.lm_head.weight is model.model.decoder.embed_tokens.weight
    assert unique_bytes(model) == wide_bytes - wide_converted + fp8_converted < 0.6 * wide_bytes

    with pytest.raises(ValueError, match="FP8 already"):
        quantize_model(model)


def test_fp8_layers_and_reads_stay_within_the_bound_of_float32(tiny_dir):
    reference = make_tiny_reader(tiny_dir)
    quantized = make_tiny_reader(tiny_dir, quantize="fp8")
    assert is_fp8_model(quantized.runner.model) and not is_fp8_model(reference.runner.model)

    errors = layer_errors(reference.runner.model, quantized.runner.model, reference.tokenizer)
    assert all(0.005 < error < LAYER_BOUND for error in errors), errors
    assert sum(errors) / len(errors) < LAYER_MEAN_BOUND, errors

    specs = read_specs(reference.tokenizer)
    deviation = Deviation.between(yes_probabilities(reference, specs), yes_probabilities(quantized, specs))
    assert 0 < deviation.mean < MEAN_BOUND and deviation.agreement >= AGREEMENT_BOUND, deviation


def test_quantize_picks_the_weights_at_load_and_says_which(tiny_dir, caplog):
    with caplog.at_level(logging.INFO, logger="djev.engine"):
        plain = make_tiny_reader(tiny_dir)
    assert not is_fp8_model(plain.runner.model) and "weights: fp32" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="djev.engine"):
        quantized = make_tiny_reader(tiny_dir, quantize="fp8")
    assert is_fp8_model(quantized.runner.model)
    assert quantized.runner.model.dtype == torch.float32  # what the engine computes in: the embeddings', not e4m3
    assert "weights: fp8 (quantized at load: 41 projections, 6 layers' experts)" in caplog.text


def test_the_quantize_setting_reaches_the_engine_and_refuses_other_formats():
    settings = settings_from_args(build_parser().parse_args(["serve", "--quantize", "fp8"]))
    assert settings.hf.quantize == "fp8" and hf_options(settings, "m", tiny=False).quantize == "fp8"
    assert Settings.from_env({"QUANTIZE": ""}).hf.quantize == "" == hf_options(Settings(), "m", tiny=False).quantize
    with pytest.raises(ValueError, match="QUANTIZE must be empty or fp8, not 'int4'"):
        Settings.from_env({"QUANTIZE": "int4"})
