"""bench/profile_gpu.py's pure parts: the floor a turn's tokens set (`turn_floor`) on the full-size
shapes, the model's shape as a built model has it, the op families by name, and how the device's
events become a turn's table (stage ranges, the kernels' union, the host's time between them). The
script's CPU run is tests/bench/test_smoke.py's."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch.profiler import DeviceType

from bench.models import full_config
from bench.profile_gpu import (
    HOST,
    SLOT_RANGE,
    VISION_RANGE,
    family,
    full_shape,
    model_shape,
    timed_events,
    turn_floor,
    turn_table,
    union_ms,
)

EXPERT_WEIGHTS = 3 * 704 * 2816  # one expert's gate-up (2 x 704 x 2816) and down (704 x 2816)


def test_full_shape_is_the_model_configs_arithmetic():
    shape = full_shape()
    assert len(shape.layers) == 30 and sum(layer.sliding for layer in shape.layers) == 25
    assert shape.layers[-1].sliding is False and shape.window == 1024 and shape.weight_bytes == 2
    # An expert layer's weights: 1.42 GiB in bf16; the other weights a layer: ~55e6 on average.
    assert 128 * EXPERT_WEIGHTS * 2 / 2**30 == pytest.approx(1.42, abs=0.005)
    assert sum(layer.dense_params for layer in shape.layers) / 30 == pytest.approx(55e6, rel=0.01)
    assert {layer.query_width for layer in shape.layers} == {16 * 256, 16 * 512}


def test_full_shape_is_the_built_models():
    from transformers import DiffusionGemmaForBlockDiffusion

    with torch.device("meta"):
        model = DiffusionGemmaForBlockDiffusion(full_config()).to(torch.bfloat16)
    assert model_shape(model) == full_shape()


def test_turn_floor_of_one_token_by_hand():
    floor = turn_floor(1, 0)
    # One token touches its 8 experts a layer: 8 x 5.95e6 weights x 2 bytes x 30 layers at 3.0 TB/s.
    assert floor["experts_touched_a_layer"] == pytest.approx(8.0)
    assert floor["expert_bytes_ms"] == pytest.approx(8 * EXPERT_WEIGHTS * 2 * 30 / 3e12 * 1000)  # 0.9516 ms
    assert floor["expert_math_ms"] == pytest.approx(2 * 8 * EXPERT_WEIGHTS * 30 / 650e12 * 1000)
    # The other weights: 25 sliding layers of 52,805,632 and 5 full of 67,223,552, 2 FLOP each.
    assert floor["other_math_ms"] == pytest.approx(2 * (25 * 52_805_632 + 5 * 67_223_552) / 650e12 * 1000)
    # One query-key pair a layer: 4 x 16 heads x 256 (sliding) or x 512 (full) FLOP.
    assert floor["attention_math_ms"] == pytest.approx((25 * 4 * 4096 + 5 * 4 * 8192) / 650e12 * 1000)
    assert floor["floor_ms"] == pytest.approx(0.95158 + 0.005096, abs=1e-5)
    assert floor["tokens"] == 1


def test_turn_floor_grows_with_tokens():
    floors = [turn_floor(tokens, 0)["floor_ms"] for tokens in (1, 16, 128, 1024, 4096, 16384)]
    assert floors == sorted(floors) and len(set(floors)) == len(floors)
    assert turn_floor(1000, 256, canvases=16, prompts=16)["floor_ms"] > turn_floor(1000, 0, prompts=16)["floor_ms"]
    # More bandwidth lowers a floor the experts' weights bound (1024 tokens), not one their math bounds
    # (4096); more TFLOP/s lowers both.
    assert turn_floor(1024, 0, bandwidth_tbs=4.8)["floor_ms"] < turn_floor(1024, 0)["floor_ms"]
    assert turn_floor(4096, 0, bandwidth_tbs=4.8)["floor_ms"] == turn_floor(4096, 0)["floor_ms"]
    assert turn_floor(4096, 0, tflops=990)["floor_ms"] < turn_floor(4096, 0)["floor_ms"]


def test_expert_bytes_saturate_at_every_expert():
    every = 128 * EXPERT_WEIGHTS * 2 * 30 / 3e12 * 1000  # all 42.5 GiB of experts: 15.2 ms at 3 TB/s
    few, many, more = (turn_floor(tokens, 0) for tokens in (16, 2048, 32768))
    assert few["experts_touched_a_layer"] == pytest.approx(128 * (1 - (1 - 8 / 128) ** 16))  # 82.3
    assert few["expert_bytes_ms"] < every
    assert many["experts_touched_a_layer"] == pytest.approx(128) and more["experts_touched_a_layer"] == pytest.approx(128)
    assert many["expert_bytes_ms"] == pytest.approx(every) == more["expert_bytes_ms"]
    # Past saturation the experts' math overtakes their weights' read (at ~3,500 tokens on these numbers).
    assert many["expert_math_ms"] < many["expert_bytes_ms"] and more["expert_math_ms"] > more["expert_bytes_ms"]
    assert more["floor_ms"] == pytest.approx(more["expert_math_ms"] + more["other_math_ms"] + more["attention_math_ms"])


def test_attention_is_causal_within_the_window_and_the_canvas_reads_its_prompt():
    def attention(prompt: int, canvas: int, prompts: int = 1, canvases: int = 1) -> float:
        return turn_floor(prompt, canvas, prompts=prompts, canvases=canvases)["attention_math_ms"] * 650e12 / 1000

    sliding, full = 4 * 4096, 4 * 8192
    # A prompt of 2048: 1024 x 1025 / 2 + 1024 x 1024 pairs on a sliding layer, 2048 x 2049 / 2 on a full one.
    assert attention(2048, 0) == pytest.approx(25 * sliding * (1024 * 1025 / 2 + 1024 * 1024) + 5 * full * 2048 * 2049 / 2)
    # Two prompts of 100 are two triangles, not one of 200.
    assert attention(200, 0, prompts=2) == pytest.approx((25 * sliding + 5 * full) * 2 * 100 * 101 / 2)
    # A canvas of 16 over a prompt of 100: each of its tokens with the 116 keys.
    assert attention(100, 16) - attention(100, 0) == pytest.approx((25 * sliding + 5 * full) * 16 * 116)


@pytest.mark.parametrize("name, expected", [
    ("gate_up_kernel", "experts"),
    ("down_kernel", "experts"),
    ("cutlass::device_kernel<cutlass::gemm::kernel::GemmUniversal<cutlass::gemm::GroupProblemShape<>>>", "experts"),
    ("triton_red_fused__to_copy__unsafe_view_add_expert_rows_mean_mul_pow_view_0", "router and sort"),
    ("void at_cuda_detail::cub::detail::radix_sort::DeviceRadixSortOnesweepKernel<long>", "router and sort"),
    ("void at::native::sbtopk::gatherTopK<float, unsigned int, 2, false>", "router and sort"),
    ("aten::histc", "router and sort"),
    ("_segments", "attention"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x128x64", "attention"),
    ("triton_red_fused__to_copy__unsafe_view_add_div_index_mean_mul_pow_select_unsqueeze_view_where_4",
     "norms and rotary"),
    ("triton_per_fused__to_copy__unsafe_view_add_cat_mean_mul_neg_pow_slice_unsqueeze_view_1", "norms and rotary"),
    ("aten::cos", "norms and rotary"),
    ("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_TNT", "dense projections"),
    ("aten::mm", "dense projections"),
    ("memcpy128", "copies"),
    ("triton_poi_fused__unsafe_view_gelu_mul_6", "other"),
    (f"{VISION_RANGE}: cudnn_generated_fort_native_sdpa_sm90_flash_fprop", "vision tower"),
    (f"{VISION_RANGE}: nvjet_sm90_tst_128x192_64x5_2x1_v_bz_coopB_TNN", "vision tower"),
    (f"{SLOT_RANGE}: nvjet_sm90_tst_128x192_64x5_2x1_v_bz_coopB_TNN", "slot reads"),
    (f"{SLOT_RANGE}: memcpy128", "slot reads"),
])
def test_families_by_name_first_match_wins(name, expected):
    assert family(name) == expected


def test_union_counts_overlaps_once():
    assert union_ms([(0, 1000), (500, 1500), (3000, 4000), (3100, 3200)]) == pytest.approx(2.5)
    assert union_ms([]) == 0.0


def event(name: str, device: DeviceType, start: float, end: float, *, id: int = 0, linked: int = 0,
          annotation: bool = False, self_cpu: float = 0.0) -> SimpleNamespace:
    return SimpleNamespace(name=name, device_type=device, time_range=SimpleNamespace(start=start, end=end), id=id,
                           linked_correlation_id=linked, is_user_annotation=annotation, self_cpu_time_total=self_cpu)


def test_device_kernels_go_to_the_stage_that_launched_them():
    cpu, cuda = DeviceType.CPU, DeviceType.CUDA
    events = [
        event("aten::mm", cpu, 0, 10, id=1),  # launches the forward's GEMM
        event(VISION_RANGE, cpu, 20, 60, id=2, annotation=True),
        event("aten::_scaled_dot_product_cudnn_attention", cpu, 25, 30, id=3),  # inside the vision range
        event(VISION_RANGE, cuda, 150, 260, annotation=True),  # the range's span on the device
        event("cudaLaunchKernel", cpu, 26, 27, id=900, linked=3),  # a runtime call: no launcher of its own
        event("nvjet_gemm", cuda, 100, 150, linked=1),
        event("cudnn_sdpa_fprop", cuda, 150, 200, linked=3),
        event("unlinked_kernel", cuda, 210, 260),  # no op linked: inside the range's device span
        event("memcpy128", cuda, 400, 420),  # no op linked, outside every span
    ]
    timed = timed_events(events, on_cuda=True)
    assert [(name, ms) for name, ms, _, _ in timed] == [
        ("nvjet_gemm", 0.05), (f"{VISION_RANGE}: cudnn_sdpa_fprop", 0.05), (f"{VISION_RANGE}: unlinked_kernel", 0.05),
        ("memcpy128", 0.02)]
    table = turn_table(timed, wall_ms=0.5, top=3)
    families = table["families"]
    assert families["vision tower"]["ms"] == pytest.approx(0.1) and families["vision tower"]["count"] == 2
    assert families["dense projections"]["ms"] == pytest.approx(0.05) and families["copies"]["ms"] == pytest.approx(0.02)
    # The kernels' union: [100, 200), [210, 260) and [400, 420): 0.17 ms of the 0.5 ms wall; the rest is
    # the host's (the gaps between them, and before and after).
    assert table["busy_ms"] == pytest.approx(0.17) and families[HOST]["ms"] == pytest.approx(0.33)
    assert families[HOST]["share"] == pytest.approx(0.66) and table["kernels_ms"] == pytest.approx(0.17)
    assert [entry["name"] for entry in table["top"]] == ["nvjet_gemm", f"{VISION_RANGE}: cudnn_sdpa_fprop",
                                                        f"{VISION_RANGE}: unlinked_kernel"]  # ties keep their order


def test_cpu_ops_inside_a_stage_are_the_stages():
    cpu = DeviceType.CPU
    events = [
        event(SLOT_RANGE, cpu, 100, 200, id=1, annotation=True, self_cpu=30.0),  # the range: not an op
        event("aten::mm", cpu, 110, 150, id=2, self_cpu=40.0),
        event("aten::mm", cpu, 0, 50, id=3, self_cpu=50.0),
    ]
    timed = timed_events(events, on_cuda=False)
    assert [(name, ms) for name, ms, _, _ in timed] == [(f"{SLOT_RANGE}: aten::mm", 0.04), ("aten::mm", 0.05)]
    assert family(timed[0][0]) == "slot reads"
