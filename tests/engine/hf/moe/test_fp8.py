"""The experts with FP8 weight banks (app/engine/hf/moe/fp8.py).

The reference (plain torch, the CPU's path) runs here: against the same arithmetic in float64, and
against the bf16 experts within the bound FP8 costs. The Triton kernels run in Triton's interpreter
on the CPU, in the CPU vLLM venv (.venv-vllm has Triton), through tests/engine/hf/moe/fp8_checks.py:
the product rows' quantization kernel bit for bit, and every tile against the reference. Then the
wiring: which path a module takes (its tokens quantized before the op), torch.compile over it, and
every input the FP8 path refuses."""

from __future__ import annotations

import sys
import types

import pytest
import torch
import torch.nn.functional as F

from app.engine.hf import fp8
from app.engine.hf.moe import fp8 as fp8_moe
from app.engine.hf.moe import fused as fused_moe
from app.engine.hf.moe.pairs import warm_up_tokens, weighted_sum
from tests.vllm_support import REPO, interpreted_checks

CHECKS = REPO / "tests" / "engine" / "hf" / "moe" / "fp8_checks.py"

# The FP8 experts' rows against the bf16 experts' on the full model's shapes (hidden 2816, expert FFN
# 704) with random weights, measured on the CPU reference over four seeds, float32 and bfloat16
# activations: 6.4 to 6.6 % of the rows' norm over all pairs, 7.2 to 7.8 % in the worst pair's row
# (at this test's seed 6.5 / 6.6 % and 7.2 / 7.6 %). Each projection rounds both operands to e4m3's
# 3 mantissa bits (about 2.5 % RMS each), and the down step's input carries the gate/up step's error.
FP8_ROWS_BOUND = 0.07  # relative Frobenius error of all rows
FP8_ROW_BOUND = 0.085  # relative error of the worst row


def random_banks(experts: int, hidden: int, inter: int, generator: torch.Generator,
                 dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor, fp8_moe.Banks]:
    """(gate_up, down) in `dtype` and their FP8 banks."""
    gate_up = (torch.randn(experts, 2 * inter, hidden, generator=generator) * hidden ** -0.5).to(dtype)
    down = (torch.randn(experts, hidden, inter, generator=generator) * inter ** -0.5).to(dtype)
    return gate_up, down, fp8_moe.Banks(*fp8.quantize_weight(gate_up), *fp8.quantize_weight(down))


def routes(tokens: int, experts: int, top_k: int, generator: torch.Generator) -> torch.Tensor:
    return torch.stack([torch.randperm(experts, generator=generator)[:top_k] for _ in range(tokens)])


def dequantized(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.double() * scale.double().unsqueeze(-1)


# ------------------------------------------------------------------------------ the reference


@pytest.mark.parametrize("dtype,products_tolerance,rows_tolerance",
                         [(torch.float32, 2 ** -20, 2 ** -20), (torch.bfloat16, 2 ** -6, 2 ** -8)])
def test_the_reference_is_the_dequantized_arithmetic(dtype, products_tolerance, rows_tolerance):
    """Each step against float64 from the same quantized operands, relative to its largest value:
    within float32's accumulation error, or in bfloat16 what its roundings allow (gate, up, the
    activation and their product each rounded to 2^-9 of itself, a bf16 step; the down step's output
    once). The rows are pair token x top_k + slot's."""
    generator = torch.Generator().manual_seed(3)
    experts, hidden, inter, top_k, tokens = 4, 2816, 704, 2, 13
    _, _, banks = random_banks(experts, hidden, inter, generator)
    x = torch.randn(tokens, hidden, generator=generator).to(dtype)
    index = routes(tokens, experts, top_k, generator)
    products = fp8_moe.reference_products(x, index, banks.gate_up, banks.gate_up_scale)
    rows = fp8_moe.reference_expert_rows(x, index, *banks)
    assert products.dtype == rows.dtype == dtype and rows.shape == (tokens * top_k, hidden)
    assert torch.equal(rows, fp8_moe.reference_down(products, index, banks.down, banks.down_scale))

    xq, x_scale = fp8.quantize_tokens(x)
    hq, h_scale = fp8.quantize_tokens(products)  # the down step quantizes the rounded products
    for pair, expert in enumerate(index.reshape(-1).tolist()):
        token = pair // top_k
        gate, up = (dequantized(xq[token], x_scale[token]) @ dequantized(banks.gate_up[expert], banks.gate_up_scale[expert]).T
                    ).chunk(2)
        product = F.gelu(gate, approximate="tanh") * up
        error = (products[pair].double() - product).abs().max().item()
        assert error <= products_tolerance * product.abs().max().item(), (pair, expert)
        row = dequantized(hq[pair], h_scale[pair]) @ dequantized(banks.down[expert], banks.down_scale[expert]).T
        assert (rows[pair].double() - row).abs().max().item() <= rows_tolerance * row.abs().max().item(), (pair, expert)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_rows_stay_within_the_stated_bound_of_the_bf16_experts(dtype):
    """The FP8 reference against the unquantized experts with the bf16 kernels' roundings (what
    fused.expert_rows and grouped_mm compute), on the full model's shapes: FP8_ROWS_BOUND over all
    rows, FP8_ROW_BOUND for the worst; and clearly off them (the weights are quantized)."""
    generator = torch.Generator().manual_seed(4)
    experts, hidden, inter, top_k, tokens = 4, 2816, 704, 2, 24
    gate_up, down, banks = random_banks(experts, hidden, inter, generator, dtype)
    x = torch.randn(tokens, hidden, generator=generator).to(dtype)
    index = routes(tokens, experts, top_k, generator)
    rows = fp8_moe.reference_expert_rows(x, index, *banks).double()
    unquantized = torch.empty_like(rows)
    for pair, expert in enumerate(index.reshape(-1).tolist()):
        gate, up = F.linear(x[pair // top_k], gate_up[expert]).chunk(2)
        unquantized[pair] = F.linear(F.gelu(gate, approximate="tanh") * up, down[expert]).double()
    overall = ((rows - unquantized).norm() / unquantized.norm()).item()
    worst = ((rows - unquantized).norm(dim=1) / unquantized.norm(dim=1)).max().item()
    assert 0.03 <= overall <= FP8_ROWS_BOUND, overall
    assert worst <= FP8_ROW_BOUND, worst


# -------------------------------------------------------------------- the kernels, interpreted


@pytest.fixture(scope="module")
def interpreted():
    return interpreted_checks(CHECKS)


def test_the_checks_ran_in_the_interpreter(interpreted):
    assert interpreted["interpreted"] is True


def test_the_kernels_quantize_rows_bit_for_bit_as_the_reference(interpreted):
    """fp8_quantize_kernel over every tie between two e4m3 values (subnormal ones too) and eight
    decades of random rows, in float32 and bfloat16, several programs of rows: the same e4m3 bits
    and scales as fp8.quantize_tokens, and a row of zeros gets the smallest scale."""
    quantize = interpreted["quantize"]
    assert quantize["ties"] >= 250 and quantize["subnormal_ties"] >= 14
    for dtype in ("float32", "bfloat16"):
        case = quantize[dtype]
        assert case["values"] > 10_000 and case["programs"] > 1 and case["rows"] % 8
        assert (case["q_mismatches"], case["scale_mismatches"]) == (0, 0), case
        assert case["zero_row_scale"] == torch.tensor(fp8.MIN_SCALE, dtype=torch.float32).item()


def test_every_fp8_tile_configuration_is_exercised(interpreted):
    cases = interpreted["kernels"]
    assert {case["block_m"] for case in cases} == {c.block_m for _, c in fp8_moe.TILES} | {fp8_moe.LARGE.block_m}
    large_down = fp8_moe.DOWN_TILES.get(fp8_moe.LARGE, fp8_moe.LARGE)  # the down kernel's tiles past 64 pairs
    assert large_down.block_n in {case["down_block_n"] for case in cases}
    assert sum(case["unused_expert"] for case in cases) >= 6  # an expert no token chose
    assert all(case["tokens"] % 2 == 1 for case in cases)  # odd token counts: partial blocks


def test_fp8_kernels_equal_the_reference(interpreted):
    """float32: only the order of fp32 accumulations differs; bfloat16: the same bits but for a
    rounding that an fp32 difference tips (none at these seeds)."""
    for case in interpreted["kernels"]:
        assert case["out_dtype"] == case["dtype"], case
        assert case["zero_token_rows"] == 0.0, case
        if case["dtype"] == "float32":
            assert case["max_diff"] <= 1e-6 * case["scale"], case
        else:
            assert case["max_diff"] <= case["scale"] * 2 ** -8, case
            assert case["differing"] <= case["values"] // 100, case


def test_the_fp8_warm_up_runs_every_tile(interpreted):
    warm_up = interpreted["warm_up"]
    assert warm_up["block_m"] == sorted({c.block_m for _, c in fp8_moe.TILES} | {fp8_moe.LARGE.block_m})
    assert any(count * 2 % 16 == 0 for count in warm_up["counts"]) and any(count * 2 % 16 for count in warm_up["counts"])


def test_the_warm_up_counts_pick_every_fp8_tile_of_the_full_model():
    """128 experts x top-8: each tile compiled with its pair count divisible by 16 and not."""
    counts = warm_up_tokens(128, 8, fp8_moe.TILES)
    picked: dict[fused_moe.BlockConfig, set[bool]] = {}
    for tokens in counts:
        picked.setdefault(fp8_moe.block_config(tokens * 8, 128), set()).add(tokens * 8 % 16 == 0)
    assert set(picked) == {c for _, c in fp8_moe.TILES} | {fp8_moe.LARGE}
    assert all(kinds == {True, False} for kinds in picked.values()), picked


# ------------------------------------------------------------------------------------ the wiring


def quantize_experts(model: torch.nn.Module) -> int:
    """`model`'s experts banks turned FP8 in place, in the format the loader makes (module docstring
    of app/engine/hf/moe/fp8.py); returns how many modules."""
    modules = fp8_moe.experts_modules(model)
    for module in modules:
        for name in ("gate_up_proj", "down_proj"):
            q, scale = fp8.quantize_weight(module.get_parameter(name).detach())
            setattr(module, name, torch.nn.Parameter(q, requires_grad=False))
            setattr(module, f"{name}_scale", torch.nn.Parameter(scale, requires_grad=False))
    return len(modules)


@pytest.fixture
def tiny_model(tiny_dir):
    from transformers import DiffusionGemmaForBlockDiffusion

    return DiffusionGemmaForBlockDiffusion.from_pretrained(str(tiny_dir), dtype=torch.float32).eval()


def experts_inputs(module, tokens: int = 9, seed: int = 5):
    generator = torch.Generator().manual_seed(seed)
    experts, _, hidden = module.get_parameter("gate_up_proj").shape
    x = torch.randn(tokens, hidden, generator=generator)
    index = routes(tokens, experts - 1, 2, generator)  # the last expert chosen by none
    weights = torch.rand(tokens, 2, generator=generator)
    return x, index, weights


class Spy:
    """Counts the calls of a function it stands in for."""

    def __init__(self, function):
        self.function, self.calls = function, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.function(*args, **kwargs)


def test_an_fp8_module_on_the_cpu_goes_through_the_reference(tiny_model, monkeypatch):
    """Its tokens quantized before the op, the op's reference from them: the same rows as
    reference_expert_rows from the hidden states."""
    spy = Spy(fp8_moe.quantized_reference_rows)
    monkeypatch.setattr(fp8_moe, "quantized_reference_rows", spy)
    assert quantize_experts(tiny_model) >= 2
    assert fp8_moe.activation_dtype(tiny_model) == torch.float32
    fp8_moe.use_fp8_experts(tiny_model)
    assert tiny_model.get_experts_implementation()[""] == fp8_moe.IMPLEMENTATION
    module = fp8_moe.experts_modules(tiny_model)[0]
    x, index, weights = experts_inputs(module)
    with torch.no_grad():
        out = module(x, index, weights)
    assert spy.calls == 1
    want = weighted_sum(fp8_moe.reference_expert_rows(x, index, *fp8_moe.module_banks(module)), weights)
    assert torch.equal(out, want)
    assert out.abs().max().item() > 0.1


def test_a_bf16_model_with_fp8_experts_computes_in_bf16(tiny_dir):
    """Its float32 scales do not make it a float32 model: the warm-up and the rows are bf16."""
    from transformers import DiffusionGemmaForBlockDiffusion

    model = DiffusionGemmaForBlockDiffusion.from_pretrained(str(tiny_dir), dtype=torch.bfloat16).eval()
    quantize_experts(model)
    assert fp8_moe.activation_dtype(model) == torch.bfloat16
    fp8_moe.use_fp8_experts(model)
    module = fp8_moe.experts_modules(model)[0]
    x, index, weights = experts_inputs(module)
    with torch.no_grad():
        out = module(x.bfloat16(), index, weights)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, weighted_sum(fp8_moe.reference_expert_rows(x.bfloat16(), index, *fp8_moe.module_banks(module)),
                                         weights))


def test_a_bf16_module_under_the_fp8_implementation_keeps_grouped_mm(tiny_model, monkeypatch):
    from transformers.integrations.moe import grouped_mm_experts_forward

    spy = Spy(fp8_moe.quantized_reference_rows)
    monkeypatch.setattr(fp8_moe, "quantized_reference_rows", spy)
    fp8_moe.use_fp8_experts(tiny_model)  # no FP8 module: nothing to refuse
    module = fp8_moe.experts_modules(tiny_model)[0]
    x, index, weights = experts_inputs(module)
    with torch.no_grad():
        out = module(x, index, weights)
        want = grouped_mm_experts_forward(module, x, index, weights)
    assert spy.calls == 0 and torch.equal(out, want)


def test_the_fused_implementation_sends_fp8_banks_to_the_fp8_op(tiny_model, monkeypatch):
    """use_fused_experts (the loader's call on CUDA) takes an FP8 model, and its forward sends FP8
    banks to the FP8 op (the reference on the CPU; Triton's absence is stubbed out here)."""
    quantize_experts(tiny_model)
    monkeypatch.setattr(fused_moe, "unsupported", lambda config: None)
    assert fused_moe.use_fused_experts(tiny_model) is None
    assert tiny_model.get_experts_implementation()[""] == fused_moe.IMPLEMENTATION
    module = fp8_moe.experts_modules(tiny_model)[0]
    x, index, weights = experts_inputs(module)
    with torch.no_grad():
        out = module(x, index, weights)
    assert torch.equal(out, weighted_sum(fp8_moe.reference_expert_rows(x, index, *fp8_moe.module_banks(module)), weights))


def test_the_tiny_model_reads_every_layer_through_fp8_experts(tiny_model, monkeypatch):
    """The whole model with its experts in FP8: the encoder's and the decoder's pass each run every
    layer's experts through the FP8 op. (How far its hidden states move says little: the tiny random
    model moves 4 % for a 0.1 % change of its experts' weights.)"""
    from transformers.cache_utils import DynamicCache

    spy = Spy(fp8_moe.quantized_reference_rows)
    monkeypatch.setattr(fp8_moe, "quantized_reference_rows", spy)

    @torch.no_grad()
    def hidden():
        cache = DynamicCache()
        tiny_model.model.encoder(input_ids=torch.arange(100, 140).unsqueeze(0), past_key_values=cache, use_cache=True)
        return tiny_model.model(past_key_values=cache, decoder_input_ids=torch.arange(200, 216).unsqueeze(0),
                                decoder_position_ids=torch.arange(40, 56).unsqueeze(0)).last_hidden_state

    before = hidden()
    layers = quantize_experts(tiny_model)
    fp8_moe.use_fp8_experts(tiny_model)
    after = hidden()
    assert spy.calls == 2 * tiny_model.config.text_config.num_hidden_layers and layers >= spy.calls // 2
    assert bool(after.isfinite().all()) and not torch.equal(after, before)


def test_the_op_compiles_as_one_opaque_call(tiny_model):
    quantize_experts(tiny_model)
    fp8_moe.use_fp8_experts(tiny_model)
    module = fp8_moe.experts_modules(tiny_model)[0]
    x, index, weights = experts_inputs(module, tokens=11)
    compiled = torch.compile(lambda *inputs: module(*inputs), backend="aot_eager", fullgraph=True, dynamic=True)
    with torch.no_grad():
        assert torch.equal(compiled(x, index, weights), module(x, index, weights))
        x, index, weights = experts_inputs(module, tokens=5, seed=6)
        assert torch.equal(compiled(x, index, weights), module(x, index, weights))


# ------------------------------------------------------------------------------- refused inputs


def valid_case():
    generator = torch.Generator().manual_seed(7)
    _, _, banks = random_banks(3, 32, 16, generator)
    named = dict(zip(("gate_up", "gate_up_scale", "down", "down_scale"), banks))
    return torch.randn(5, 32, generator=generator), routes(5, 3, 2, generator), named


def wrong(field: str, change):
    def apply(x, index, banks):
        if field in ("x", "index"):
            return (change(x), index) if field == "x" else (x, change(index)), banks
        return (x, index), {**banks, field: change(banks[field])}

    return apply


REFUSED = {
    "gate_up_proj_scale is missing": wrong("gate_up_scale", lambda t: None),
    "down_proj_scale is missing": wrong("down_scale", lambda t: None),
    "gate_up_proj_scale is torch.float32 [3, 16]": wrong("gate_up_scale", lambda t: t[:, :16]),
    "down_proj_scale is torch.bfloat16": wrong("down_scale", lambda t: t.bfloat16()),
    "gate_up_proj_scale is on meta": wrong("gate_up_scale", lambda t: t.to("meta")),
    "down_proj is torch.bfloat16": wrong("down", lambda t: t.to(torch.bfloat16)),
    "gate_up_proj is torch.float32": wrong("gate_up", lambda t: t.to(torch.float32)),
    "gate_up_proj has shape [96, 32]": wrong("gate_up", lambda t: t.reshape(-1, 32)),
    "gate_up_proj has shape [3, 31, 32]": wrong("gate_up", lambda t: t[:, :31]),
    "down_proj has shape [3, 32, 8]": wrong("down", lambda t: t[:, :, :8]),
    "hidden_states has shape [5, 31]": wrong("x", lambda t: t[:, :31]),
    "hidden_states is torch.float64": wrong("x", lambda t: t.double()),
    "top_k_index is torch.float32": wrong("index", lambda t: t.float()),
    "top_k_index is torch.int64 [4, 2]": wrong("index", lambda t: t[:4]),
}


@pytest.mark.parametrize("path", ["reference_expert_rows", "fp8_expert_rows"])
@pytest.mark.parametrize("message", list(REFUSED))
def test_every_malformed_input_is_refused_by_name(message, path):
    x, index, banks = valid_case()
    (x, index), banks = REFUSED[message](x, index, banks)
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        getattr(fp8_moe, path)(x, index, *banks.values())


QUANTIZED_REFUSED = {
    "the quantized hidden_states are torch.float32 [5, 32]": lambda xq, scale, dtype: (xq.float(), scale, dtype),
    "the quantized hidden_states are torch.float8_e4m3fn [5, 31]": lambda xq, scale, dtype: (xq[:, :31], scale, dtype),
    "the hidden_states' scales are torch.float32 [4]": lambda xq, scale, dtype: (xq, scale[:4], dtype),
    "the hidden_states' scales are torch.bfloat16 [5]": lambda xq, scale, dtype: (xq, scale.bfloat16(), dtype),
    "hidden_states is torch.float64": lambda xq, scale, dtype: (xq, scale, torch.float64),
}


@pytest.mark.parametrize("message", list(QUANTIZED_REFUSED))
def test_the_op_refuses_malformed_quantized_tokens_by_name(message):
    """The op takes the tokens quantized (fp8_experts_forward quantizes them before it)."""
    x, index, banks = valid_case()
    xq, x_scale, dtype = QUANTIZED_REFUSED[message](*fp8.quantize_tokens(x), x.dtype)
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        fp8_moe.rows_op()(xq, x_scale, index, *banks.values(), dtype)
    with pytest.raises(ValueError, match="top_k_index is torch.int64 \\[4, 2\\]"):
        fp8_moe.rows_op()(*fp8.quantize_tokens(x), index[:4], *banks.values(), x.dtype)


def test_a_module_without_its_scales_is_refused_by_name(tiny_model):
    quantize_experts(tiny_model)
    module = fp8_moe.experts_modules(tiny_model)[1]
    del module.down_proj_scale
    with pytest.raises(ValueError, match="down_proj_scale is missing"):
        fp8_moe.use_fp8_experts(tiny_model)
    with pytest.raises(ValueError, match="gate_up_proj_scale is a str, not a tensor"):
        fp8_moe.module_banks(types.SimpleNamespace(gate_up_proj=module.gate_up_proj, gate_up_proj_scale="1.0"))


def test_an_fp8_model_with_another_activation_is_refused(tiny_model):
    before = tiny_model.get_experts_implementation()
    quantize_experts(tiny_model)
    tiny_model.config.text_config.hidden_activation = "silu"
    with pytest.raises(RuntimeError, match="'silu'"):
        fp8_moe.use_fp8_experts(tiny_model)
    assert "silu" in (fp8_moe.fp8_problem(tiny_model) or "")
    assert tiny_model.get_experts_implementation() == before


def test_tiles_whose_blocks_differ_are_refused():
    x, index, banks = valid_case()
    with pytest.raises(ValueError, match="block_m must match"):
        fp8_moe.fp8_expert_rows(x, index, *banks.values(), config=fp8_moe.TILES[0][1], down_config=fp8_moe.LARGE)


def test_fp8_kernels_need_triton_and_fp8_tensor_cores(monkeypatch):
    assert fp8_moe.kernels_unavailable(torch.device("cpu")) is None  # the reference runs anywhere
    monkeypatch.setitem(sys.modules, "triton", None)
    assert "Triton is not importable" in (fp8_moe.kernels_unavailable(torch.device("cuda")) or "")
    monkeypatch.setitem(sys.modules, "triton", types.ModuleType("triton"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (8, 0))
    assert "8.0 has no FP8 tensor cores" in (fp8_moe.kernels_unavailable(torch.device("cuda")) or "")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (9, 0))
    assert fp8_moe.kernels_unavailable(torch.device("cuda")) is None

