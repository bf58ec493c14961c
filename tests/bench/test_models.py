"""The benches' random-weight builder (bench/models.py `build_model`) on the tiny config, on the CPU,
against a normal build (the model made under a device context, as the benches built before): each
unique weight is allocated once and nothing more, the decoder's layers are the encoder's, the
buffers are the normal build's, the weights have the initialisation's statistics, and with the
same weights the reads are the same."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import DiffusionGemmaForBlockDiffusion

from app.engine.hf.parts import decoder_layers, encoder_layers
from app.engine.hf.runner import DiffusionRunner
from app.engine.tiny import build_config, build_tokenizer
from bench.models import build_model
from bench.workload import Specs
from tests.memory import cpu_memory


def normal_build(config) -> DiffusionGemmaForBlockDiffusion:
    """The build the benches made before: the model's constructor under the device context (every
    module allocated and drawn as it is made, the ties made last), in float32 as on the CPU."""
    torch.manual_seed(0)
    with torch.device("cpu"):
        model = DiffusionGemmaForBlockDiffusion(config).eval()
    assert model.dtype == torch.float32
    return model


def storages(model: torch.nn.Module) -> dict[int, int]:
    """The distinct storages the model's parameters and buffers hold: {address: bytes}."""
    return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
            for t in [*model.parameters(), *model.buffers()]}


def build_peak(build) -> tuple[torch.nn.Module, int]:
    """What `build()` returns, and the most CPU memory torch held at once while it ran."""
    model, _, peak = cpu_memory(build)
    return model, peak


@pytest.fixture(scope="module")
def config():
    return build_config(build_tokenizer())


@pytest.fixture(scope="module")
def normal(config):
    return normal_build(config)


@pytest.fixture(scope="module")
def built(config):
    return build_model(config, "cpu", torch.float32, None)


def test_the_decoder_layers_are_the_encoder_layers(built):
    pairs = list(zip(encoder_layers(built), decoder_layers(built), strict=True))
    assert pairs
    for encoder, decoder in pairs:
        encoder_params, decoder_params = dict(encoder.named_parameters()), dict(decoder.named_parameters())
        assert encoder_params.keys() == decoder_params.keys()
        for name, param in encoder_params.items():
            assert param is decoder_params[name] and param.data_ptr() == decoder_params[name].data_ptr(), name
    embeddings = built.model.decoder.embed_tokens.weight
    assert built.model.encoder.language_model.embed_tokens.weight is embeddings and built.lm_head.weight is embeddings
    for target, source in built.all_tied_weights_keys.items():
        assert built.get_parameter(target).data_ptr() == built.get_parameter(source).data_ptr(), target


def test_what_a_normal_build_ties_is_one_tensor_and_each_is_allocated_once(config, normal):
    groups: dict[int, list[str]] = {}
    for name, param in normal.named_parameters(remove_duplicate=False):
        groups.setdefault(param.untyped_storage().data_ptr(), []).append(name)
    assert max(len(names) for names in groups.values()) == 3  # the embeddings: encoder, decoder, lm_head

    built, peak = build_peak(lambda: build_model(config, "cpu", torch.float32, None))
    parameters = dict(built.named_parameters(remove_duplicate=False))
    for names in groups.values():
        assert len({parameters[name].untyped_storage().data_ptr() for name in names}) == 1, names
    unique = storages(normal)
    assert len(storages(built)) == len(unique) and sum(storages(built).values()) == sum(unique.values())
    # The build held nothing but the model's unique bytes at any moment; the normal build held the
    # decoder's layers twice over before it tied them.
    assert peak == sum(unique.values())
    _, normal_peak = build_peak(lambda: normal_build(config))
    assert normal_peak > 1.5 * sum(unique.values())


def test_every_buffer_is_what_a_normal_build_gives_it(normal, built):
    normal_buffers, built_buffers = dict(normal.named_buffers()), dict(built.named_buffers())
    assert normal_buffers.keys() == built_buffers.keys()
    assert any(name.endswith("inv_freq") for name in built_buffers)
    assert any(name.endswith("layer_scalar") for name in built_buffers)
    assert any(name.endswith("embed_scale") for name in built_buffers)
    for name, buffer in normal_buffers.items():
        assert built_buffers[name].dtype == buffer.dtype and torch.equal(built_buffers[name], buffer), name


def test_the_weights_have_the_initialisations_statistics(config, normal, built):
    """The random draws differ from a normal build's (it draws once more as each module is made),
    so each weight is held to the normal build's: the same constants where the initialisation sets
    one, the same mean and spread within five standard errors where it draws."""
    built_params = {name: param.detach() for name, param in built.named_parameters()}
    drawn = 0
    for name, param in normal.named_parameters():
        want, got = param.detach(), built_params[name]
        assert got.shape == want.shape and got.dtype == want.dtype, name
        if bool((want == want.flatten()[0]).all()):  # a constant: ones, zeros
            assert torch.equal(got, want), name
            continue
        drawn += 1
        count = want.numel()
        spread = float(want.std())
        assert abs(float(got.mean()) - float(want.mean())) <= 5 * spread / math.sqrt(count), name
        assert abs(float(got.std()) / spread - 1) <= 5 / math.sqrt(2 * count), name
    assert drawn > 50
    text_range = config.text_config.initializer_range
    weight = built.model.decoder.layers[0].self_attn.q_proj.weight.detach()
    assert abs(float(weight.std()) / text_range - 1) < 0.05 and abs(float(weight.mean())) < 0.02
    embeddings = built.model.decoder.embed_tokens
    assert not embeddings.weight[embeddings.padding_idx].any()  # the padding row, as the embedding's init leaves it


def test_with_the_same_weights_the_reads_are_a_normal_builds(config, normal):
    same = build_model(config, "cpu", torch.float32, None)
    same.load_state_dict(normal.state_dict())
    assert len(storages(same)) == len(storages(normal))  # loading kept the ties
    specs = Specs(int(config.text_config.vocab_size), 60)
    reads = [specs.read(), specs.read(canvases=3), Specs(int(config.text_config.vocab_size), 200, seed=1).read()]

    def read_all(model):
        runner = DiffusionRunner(model, None, device=torch.device("cpu"), max_prompt_tokens=4096, max_rows=16,
                                 turn_tokens=2048)
        return runner.read(reads)

    want, got = read_all(normal), read_all(same)
    for wanted, result in zip(want, got, strict=True):
        for canvas_want, canvas_got in zip(wanted.slots, result.slots, strict=True):
            for slot_want, slot_got in zip(canvas_want, canvas_got, strict=True):
                assert max(abs(a - b) for a, b in zip(slot_want.label_logprobs, slot_got.label_logprobs)) <= 1e-5
                assert slot_want.argmax_id == slot_got.argmax_id


def test_fp8_weights_are_made_fp8_on_the_device_with_the_initialisations_spread(config, built):
    """weights="fp8": the text layers' projections and experts are allocated in e4m3 (each tied one
    once) and drawn there, a projection or an expert at a time, so the build never holds more than the
    FP8 model and a few float32 copies of its largest single projection; their values have the
    initialisation's spread; the rest is drawn as a bf16 build draws it."""
    from app.engine.hf import fp8
    from app.engine.hf.quantize import Fp8Linear, is_fp8_model

    model, peak = build_peak(lambda: build_model(config, "cpu", torch.float32, None, weights="fp8"))
    assert is_fp8_model(model) and not is_fp8_model(built)
    held = sum(storages(model).values())
    layer = encoder_layers(model)[0]
    largest = max(max(module.weight.numel() for module in model.modules() if isinstance(module, Fp8Linear)),
                  layer.experts.get_parameter("gate_up_proj")[0].numel())
    assert peak <= held + 4 * 4 * largest  # measured: 3 float32 copies
    assert held < 0.6 * sum(storages(built).values())
    for encoder, decoder in zip(encoder_layers(model), decoder_layers(model), strict=True):
        assert isinstance(encoder.self_attn.q_proj, Fp8Linear) and decoder.self_attn.q_proj is encoder.self_attn.q_proj
        assert decoder.experts.get_parameter("down_proj") is encoder.experts.get_parameter("down_proj")
    text_range = config.text_config.initializer_range
    for q, scale in ((layer.self_attn.q_proj.weight, layer.self_attn.q_proj.weight_scale),
                     (layer.experts.get_parameter("gate_up_proj"), layer.experts.get_parameter("gate_up_proj_scale"))):
        assert q.dtype == fp8.E4M3
        values = fp8.dequantize(q, scale)
        assert abs(float(values.std()) / text_range - 1) < 0.05 and abs(float(values.mean())) < 0.02
        assert torch.allclose(values.abs().amax(dim=-1), scale * fp8.E4M3_MAX)  # each row's largest value is e4m3's
    assert torch.equal(layer.input_layernorm.weight, torch.ones_like(layer.input_layernorm.weight))
    with pytest.raises(ValueError, match="weights must be one of bf16, fp8"):
        build_model(config, "cpu", torch.float32, None, weights="int4")
