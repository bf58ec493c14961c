"""The experts as Triton kernels (app/engine/hf/moe/fused.py, FUSED_MOE).

The alignment, the tile choice and the wiring are plain torch and run here. The kernels run in
Triton's interpreter on the CPU, in the CPU vLLM venv (.venv-vllm, which has Triton; the main venv
does not need it), through tests/engine/hf/moe/fused_checks.py: against float64 and transformers' own
grouped_mm experts, for every tile configuration, and inside the tiny model, eager and compiled."""

from __future__ import annotations

import json
import subprocess

import pytest
import torch

from app.engine.hf.moe import fused as fused_moe
from tests.vllm_support import REPO, require_vllm

CHECKS = REPO / "tests" / "engine" / "hf" / "moe" / "fused_checks.py"


@pytest.mark.parametrize("block_m", [16, 32, 64])
def test_align_sorts_pairs_by_expert_in_padded_blocks(block_m):
    generator = torch.Generator().manual_seed(block_m)
    experts, top_k, tokens = 6, 2, 37
    index = torch.stack([torch.randperm(experts - 1, generator=generator)[:top_k] for _ in range(tokens)])
    pairs, block_experts = fused_moe.align(index, experts, block_m)
    total = tokens * top_k
    flat = index.reshape(-1)
    assert pairs.numel() == block_experts.numel() * block_m
    assert pairs.numel() >= total + experts * (block_m - 1)  # room for the worst padding, from shapes alone
    seen = []
    for block, expert in enumerate(block_experts.tolist()):
        entries = pairs[block * block_m:(block + 1) * block_m].tolist()
        real = [p for p in entries if p < total]
        if expert == experts:  # past the last run: nothing but padding
            assert not real
            continue
        assert all(int(flat[p]) == expert for p in real)
        assert entries == real + [total] * (block_m - len(real))  # padding only at a run's end
        seen.extend(real)
    assert sorted(seen) == list(range(total))  # every pair exactly once
    assert seen == sorted(seen, key=lambda p: int(flat[p]))  # by expert, stable within one
    assert experts - 1 not in block_experts.tolist()  # an expert no token chose gets no block


def test_tiles_grow_with_the_pairs_an_expert_gets():
    def block_m(tokens, experts=128, top_k=8):
        return fused_moe.block_config(tokens * top_k, experts).block_m

    assert [block_m(t) for t in (32, 128, 129, 300, 512, 1024, 1025, 9600)] == [16, 16, 32, 32, 32, 64, 128, 128]
    assert fused_moe.block_config(9600 * 8, 128) == fused_moe.LARGE  # 32 prompts of 300 tokens


def test_a_model_the_kernels_cannot_run_keeps_its_experts(tiny_dir, monkeypatch):
    from transformers import DiffusionGemmaForBlockDiffusion

    model = DiffusionGemmaForBlockDiffusion.from_pretrained(str(tiny_dir), dtype=torch.float32)
    before = model.get_experts_implementation()
    model.config.text_config.hidden_activation = "silu"
    assert "silu" in fused_moe.use_fused_experts(model)
    assert model.get_experts_implementation() == before
    model.config.text_config.hidden_activation = "gelu_pytorch_tanh"
    monkeypatch.setitem(__import__("sys").modules, "triton", None)  # Triton not importable
    assert "Triton" in fused_moe.use_fused_experts(model)
    assert model.get_experts_implementation() == before


@pytest.fixture(scope="module")
def interpreted(tiny_dir):
    python = require_vllm()
    done = subprocess.run([str(python), str(CHECKS), str(tiny_dir)], cwd=REPO, capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_every_tile_configuration_is_exercised(interpreted):
    assert {case["block_m"] for case in interpreted["kernels"]} == \
        {c.block_m for _, c in fused_moe.TILES} | {fused_moe.LARGE.block_m}


def test_float32_kernels_equal_the_exact_experts(interpreted):
    for case in interpreted["kernels"]:
        if case["dtype"] == "float32":
            assert case["out_dtype"] == "float32"
            assert case["fused_error"] <= 1e-6 * max(1.0, case["scale"]) * 4, case


def test_bfloat16_kernels_round_as_transformers_does(interpreted):
    """Every rounding of the grouped_mm path is kept, so the kernels are exactly as far from float64
    as transformers' own experts, and within a bf16 step or two of its output."""
    for case in interpreted["kernels"]:
        if case["dtype"] == "bfloat16":
            assert case["out_dtype"] == "bfloat16"
            assert case["fused_error"] <= case["library_error"] * 1.25 + 1e-3, case
            assert case["vs_library"] <= case["scale"] * 2 ** -6, case


def test_the_tiny_model_reads_the_same_through_the_kernels_eager_and_compiled(interpreted):
    model = interpreted["model"]
    assert (model["before"], model["after"], model["reason"]) == ("grouped_mm", fused_moe.IMPLEMENTATION, None)
    assert model["fused_vs_library"] <= 1e-4 * max(1.0, model["scale"])
    assert model["flat_vs_fused"] <= 1e-4 * max(1.0, model["scale"])  # the flat turn's forward, with the kernels
    assert model["compiled_vs_fused"] <= 1e-6  # its compiled layer bodies, against its eager ones


def test_the_tile_choice_adds_no_recompile_for_new_batch_sizes(interpreted):
    """The tiles are chosen inside the custom op, so after the first dynamic compile a turn of any
    size, in any tile range, reuses the compiled layer bodies (a guard per tile range would recompile
    them on a server's first turn of each range: seconds each on a GPU)."""
    model = interpreted["model"]
    assert len(model["tile_ranges_read"]) >= 3
    assert model["graphs_after_more_sizes"] == model["graphs_after_two_sizes"]
