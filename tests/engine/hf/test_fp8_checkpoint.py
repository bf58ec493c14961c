"""A compressed-tensors FP8 checkpoint in the RedHatAI layout (written by compressed-tensors itself:
tests/engine/hf/fp8_support.py) loads as FP8 straight onto the device: each expert's tensors packed
into the banks, the projections as stored, the rest as stored, no wide copy allocated; it reads within
the FP8 bound of the float32 model; and every checkpoint the loader cannot take is refused, naming
the tensor or the field."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest
import torch

from app.engine.hf import fp8
from app.engine.hf.checkpoint_fp8 import CheckpointFormatError, load_fp8_checkpoint
from app.engine.hf.memory import unique_bytes
from app.engine.hf.parts import decoder_layers, encoder_layers
from app.engine.hf.quantize import Fp8Linear, is_fp8_model
from tests.conftest import make_tiny_reader
from tests.engine.hf.fp8_support import (
    AGREEMENT_BOUND,
    LAYER_BOUND,
    LAYER_MEAN_BOUND,
    MEAN_BOUND,
    Deviation,
    layer_errors,
    read_specs,
    read_tensors,
    variant,
    write_fp8_checkpoint,
    yes_probabilities,
)
from tests.memory import cpu_memory

EXPERT = re.compile(r"model\.decoder\.layers\.(\d+)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")


@pytest.fixture(scope="module")
def fp8_dir(tiny_dir, tmp_path_factory) -> Path:
    return write_fp8_checkpoint(tiny_dir, tmp_path_factory.mktemp("fp8") / "model")


@pytest.fixture(scope="module")
def stored(fp8_dir) -> dict[str, torch.Tensor]:
    return read_tensors(fp8_dir)


def test_the_written_checkpoint_has_the_released_layout(fp8_dir, stored):
    quantization = json.loads((fp8_dir / "config.json").read_text())["quantization_config"]
    assert quantization["quant_method"] == "compressed-tensors" and quantization["format"] == "float-quantized"
    assert quantization["quantization_status"] == "compressed"
    group = quantization["config_groups"]["group_0"]
    assert group["targets"] == ["Linear"]
    assert {key: group["weights"][key] for key in ("num_bits", "type", "strategy", "symmetric", "dynamic")} == \
        {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False}
    assert {key: group["input_activations"][key] for key in ("type", "strategy", "dynamic")} == \
        {"type": "float", "strategy": "token", "dynamic": True}
    assert "model.decoder.layers.0.router.proj" in quantization["ignore"] and "lm_head" in quantization["ignore"]
    experts = [EXPERT.fullmatch(name) for name in stored]
    assert sum(match is not None for match in experts) == 6 * 4 * 3  # layers x experts x projections
    assert not any(name.endswith(("experts.gate_up_proj", "experts.down_proj")) for name in stored)
    assert stored["model.decoder.layers.0.experts.3.up_proj.weight"].dtype == fp8.E4M3
    assert stored["model.decoder.layers.0.experts.3.up_proj.weight_scale"].shape == (32, 1)
    assert stored["model.decoder.layers.0.self_attn.q_proj.weight"].dtype == fp8.E4M3
    assert stored["model.decoder.layers.0.self_attn.q_proj.weight_scale"].dtype == torch.bfloat16
    assert stored["model.decoder.layers.0.router.proj.weight"].dtype == torch.bfloat16


def test_loading_packs_each_expert_into_its_bank_and_keeps_the_rest_as_stored(fp8_dir, stored, caplog):
    with caplog.at_level(logging.INFO, logger="djev.engine"):
        model = make_tiny_reader(fp8_dir).runner.model  # QUANTIZE empty: the checkpoint's own format
    assert "weights: fp8 (checkpoint)" in caplog.text and is_fp8_model(model)
    half = model.config.text_config.moe_intermediate_size
    packed = 0
    for name, tensor in stored.items():
        match = EXPERT.fullmatch(name)
        if match is None:
            continue
        layer, expert, projection = int(match[1]), int(match[2]), match[3]
        experts = decoder_layers(model)[layer].experts
        bank = "down_proj" if projection == "down_proj" else "gate_up_proj"
        rows = {"gate_proj": slice(0, half), "up_proj": slice(half, 2 * half), "down_proj": slice(None)}[projection]
        q = experts.get_parameter(bank)[expert, rows]
        scale = experts.get_parameter(bank + "_scale")[expert, rows]
        assert torch.equal(q.view(torch.uint8), tensor.view(torch.uint8)), name
        assert torch.equal(scale, stored[name + "_scale"].float().flatten()), name
        packed += 1
    assert packed == 72
    for encoder, decoder in zip(encoder_layers(model), decoder_layers(model), strict=True):
        assert encoder.experts.get_parameter("gate_up_proj") is decoder.experts.get_parameter("gate_up_proj")
        assert encoder.self_attn.q_proj is decoder.self_attn.q_proj and isinstance(decoder.self_attn.q_proj, Fp8Linear)
    projection = decoder_layers(model)[2].mlp.down_proj
    assert isinstance(projection, Fp8Linear)
    name = "model.decoder.layers.2.mlp.down_proj.weight"
    assert torch.equal(projection.weight.view(torch.uint8), stored[name].view(torch.uint8))
    assert torch.equal(projection.weight_scale, stored[name + "_scale"].float().flatten())
    # Everything else as stored (bf16 there, float32 on the CPU), every alias of a tied tensor the same one.
    parameters = dict(model.named_parameters(remove_duplicate=False))
    for name in ("model.decoder.layers.1.router.proj.weight", "model.decoder.embed_tokens.weight",
                 "model.encoder.vision_tower.encoder.layers.0.mlp.up_proj.linear.weight",
                 "model.decoder.self_conditioning.gate_proj.weight", "model.decoder.layers.4.input_layernorm.weight"):
        assert parameters[name].dtype == torch.float32 and torch.equal(parameters[name], stored[name].float()), name
    assert parameters["lm_head.weight"] is parameters["model.encoder.language_model.embed_tokens.weight"]
    assert torch.equal(model.get_buffer("model.encoder.language_model.layers.3.layer_scalar"),
                       stored["model.encoder.language_model.layers.3.layer_scalar"].float())


def test_the_loaded_checkpoint_reads_within_the_fp8_bound(tiny_dir, fp8_dir):
    reference = make_tiny_reader(tiny_dir)
    loaded = make_tiny_reader(fp8_dir)
    errors = layer_errors(reference.runner.model, loaded.runner.model, reference.tokenizer)
    assert all(0.005 < error < LAYER_BOUND for error in errors), errors
    assert sum(errors) / len(errors) < LAYER_MEAN_BOUND, errors
    specs = read_specs(reference.tokenizer)
    deviation = Deviation.between(yes_probabilities(reference, specs), yes_probabilities(loaded, specs))
    assert 0 < deviation.mean < MEAN_BOUND and deviation.agreement >= AGREEMENT_BOUND, deviation


def test_the_load_allocates_the_model_and_nothing_wide(fp8_dir):
    """What stays allocated is the model's own bytes, and at its peak the load held those and the
    shard safetensors maps while it is read (host memory, on CUDA too), nothing more: no wide copy of
    any weight, no bank assembled beside the model's."""
    model, held, peak = cpu_memory(lambda: load_fp8_checkpoint(fp8_dir, torch.device("cpu"), torch.float32))
    own = unique_bytes(model)
    assert held == own
    assert peak <= own + (fp8_dir / "model.safetensors").stat().st_size


# The released checkpoint's vision tower (its config.json): the text config is bench/models.py's FULL_TEXT_CONFIG.
RELEASED_VISION = dict(model_type="gemma4_vision", num_hidden_layers=27, hidden_size=1152, intermediate_size=4304,
                       num_attention_heads=16, num_key_value_heads=16, head_dim=72, standardize=True, patch_size=16,
                       position_embedding_size=10240, default_output_length=280)
# Tensors of RedHatAI/diffusiongemma-26B-A4B-it-FP8-dynamic as its safetensors header lists them (24,232
# in one shard): name, dtype, shape.
RELEASED = (
    ("model.decoder.layers.8.experts.87.down_proj.weight", fp8.E4M3, (2816, 704)),
    ("model.decoder.layers.8.experts.87.gate_proj.weight", fp8.E4M3, (704, 2816)),
    ("model.decoder.layers.0.experts.0.down_proj.weight_scale", torch.bfloat16, (2816, 1)),
    ("model.decoder.layers.0.experts.127.up_proj.weight_scale", torch.bfloat16, (704, 1)),
    ("model.decoder.layers.8.mlp.down_proj.weight", fp8.E4M3, (2816, 2112)),
    ("model.decoder.layers.8.self_attn.q_proj.weight", fp8.E4M3, (4096, 2816)),
    ("model.decoder.layers.8.self_attn.k_proj.weight", fp8.E4M3, (2048, 2816)),
    ("model.decoder.layers.8.self_attn.o_proj.weight", fp8.E4M3, (2816, 4096)),
    ("model.decoder.embed_tokens.weight", torch.bfloat16, (262144, 2816)),
)


def test_the_loader_expects_exactly_the_released_checkpoints_tensors():
    """The full-size model, built on the meta device as the loader builds it, reads exactly as many
    tensors as the released FP8 checkpoint holds, and takes its tensors' dtypes and shapes."""
    from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion

    from app.engine.hf.checkpoint_fp8 import expected_slots
    from app.engine.hf.meta import parameters_on_meta
    from app.engine.hf.quantize import install_empty_fp8
    from bench.models import FULL_TEXT_CONFIG

    config = DiffusionGemmaConfig(text_config=FULL_TEXT_CONFIG, vision_config=RELEASED_VISION, canvas_length=256)
    with parameters_on_meta():
        model = DiffusionGemmaForBlockDiffusion(config)
    install_empty_fp8(model)
    slots = expected_slots(model)
    assert len({id(slot) for slot in slots.values()}) == 24232
    for name, dtype, shape in RELEASED:
        assert slots[name].problem(name, torch.empty(shape, dtype=dtype, device="meta")) is None, name


def drop(name: str):
    return lambda tensors: tensors.pop(name)


def replace(name: str, make):
    def change(tensors: dict[str, torch.Tensor]) -> None:
        tensors[name] = make(tensors[name])
    return change


def set_field(path: str, value):
    def change(quantization: dict) -> None:
        *parents, last = path.split(".")
        section = quantization
        for part in parents:
            section = section[part]
        section[last] = value
    return change


BROKEN = {
    "a missing expert": (dict(tensors=drop("model.decoder.layers.0.experts.1.up_proj.weight")),
                         "lacks 1 tensor(s) the model needs: model.encoder.language_model.layers.0.experts.1.up_proj.weight"
                         " = model.decoder.layers.0.experts.1.up_proj.weight"),
    "a missing scale": (dict(tensors=drop("model.decoder.layers.5.self_attn.o_proj.weight_scale")),
                        "model.decoder.layers.5.self_attn.o_proj.weight_scale"),
    "a missing norm": (dict(tensors=drop("model.decoder.layers.2.post_feedforward_layernorm_1.weight")),
                       "model.decoder.layers.2.post_feedforward_layernorm_1.weight"),
    "a wrong shape": (dict(tensors=replace("model.decoder.layers.2.self_attn.q_proj.weight", lambda t: t[:64])),
                      "model.decoder.layers.2.self_attn.q_proj.weight has shape [64, 64]: djev expects [128, 64]"),
    "a wrong expert shape": (dict(tensors=replace("model.decoder.layers.3.experts.2.down_proj.weight",
                                                  lambda t: t.T.contiguous())),
                             "model.decoder.layers.3.experts.2.down_proj.weight has shape [32, 64]: djev expects [64, 32]"),
    "a wrong scale shape": (dict(tensors=replace("model.decoder.layers.1.mlp.up_proj.weight_scale", lambda t: t[:64])),
                            "model.decoder.layers.1.mlp.up_proj.weight_scale has shape [64, 1]: djev expects [128, 1]"),
    "an unquantized projection": (dict(tensors=replace("model.decoder.layers.4.mlp.gate_proj.weight",
                                                       lambda t: t.to(torch.bfloat16))),
                                  "model.decoder.layers.4.mlp.gate_proj.weight is torch.bfloat16: djev reads it as "
                                  "float8_e4m3fn"),
    "a quantized router": (dict(tensors=replace("model.decoder.layers.0.router.proj.weight", lambda t: t.to(fp8.E4M3))),
                           "model.decoder.layers.0.router.proj.weight is torch.float8_e4m3fn: djev reads it as a bf16 "
                           "or float tensor"),
    "per-tensor weights": (dict(quantization=set_field("config_groups.group_0.weights.strategy", "tensor")),
                           "quantization_config.config_groups.group_0.weights.strategy is 'tensor': djev loads 'channel'"),
    "static activations": (dict(quantization=set_field("config_groups.group_0.input_activations.dynamic", False)),
                           "quantization_config.config_groups.group_0.input_activations.dynamic is False: djev loads True"),
    "weights only": (dict(quantization=set_field("config_groups.group_0.input_activations", None)),
                     "quantization_config.config_groups.group_0.input_activations is None"),
    "4-bit weights": (dict(quantization=set_field("config_groups.group_0.weights.num_bits", 4)),
                      "quantization_config.config_groups.group_0.weights.num_bits is 4: djev loads 8"),
    "integer weights": (dict(quantization=set_field("config_groups.group_0.weights.type", "int")),
                        "quantization_config.config_groups.group_0.weights.type is 'int': djev loads 'float'"),
    "groups": (dict(quantization=set_field("config_groups.group_0.weights.group_size", 128)),
               "quantization_config.config_groups.group_0.weights.group_size is 128: djev loads none"),
    "another format": (dict(quantization=set_field("format", "pack-quantized")),
                       "quantization_config.format is 'pack-quantized': djev loads 'float-quantized'"),
    "another method": (dict(quantization=set_field("quant_method", "gptq")),
                       "quantization_config.quant_method is 'gptq': djev loads compressed-tensors FP8 checkpoints"),
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_a_checkpoint_djev_cannot_load_is_refused_naming_what(fp8_dir, tmp_path, case):
    changes, message = BROKEN[case]
    broken = variant(fp8_dir, tmp_path / "broken", **changes)
    with pytest.raises(CheckpointFormatError) as refused:
        make_tiny_reader(broken)
    assert message in str(refused.value)
