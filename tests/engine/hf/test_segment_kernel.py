"""The flat turn's segment kernel (app/engine/hf/segment_kernel.py, CUDA) in Triton's interpreter on the
CPU, through segment_kernel_checks.py in the CPU vLLM venv (it has Triton): one launch a layer over a turn of
every kind of segment (a prompt's tail past released sliding blocks, a fresh prompt, a one-token tail,
canvases over prompts written earlier and in the same turn, one past a tile's rows) against the CPU
reference, SDPA segment by segment. And the metadata the kernel reads (`kernel_metadata`), which is
pure and checked here directly."""

from __future__ import annotations

import pytest
import torch

from app.engine.hf.attention import kernel_metadata
from app.engine.hf.blocks import KVStore, LayerShape
from app.engine.hf.layout import Kind, Segment, TurnLayout
from tests.vllm_support import REPO, interpreted_checks

CHECKS = REPO / "tests" / "engine" / "hf" / "segment_kernel_checks.py"


@pytest.fixture(scope="module")
def checked() -> dict:
    return interpreted_checks(CHECKS)


def test_every_kind_of_segment_reads_what_the_reference_reads_in_one_launch(checked):
    assert checked["float32"]["diff"] < 1e-5, checked


def test_bf16_reads_within_its_precision(checked):
    assert checked["bfloat16"]["diff"] < 0.05, checked


def test_the_full_sizes_head_sizes_512_and_256_read_the_same(checked):
    assert checked["full_size_heads"]["diff"] < 1e-4, checked


def test_a_long_prompts_chunk_takes_the_long_tiles_and_reads_the_same(checked):
    long = checked["long_chunk"]
    assert long["diff"] < 1e-4, long
    assert long["tiles"] == long["long_tiles"] and long["tiles"] != checked["full_size_heads"]["tiles"]


def test_rows_past_the_turns_tokens_are_neither_read_nor_written(checked):
    assert checked["padded"]["diff"] < 1e-5, checked
    assert all(case["padding_untouched"] for case in checked.values()), checked


def test_every_part_of_the_metadata_starts_on_16_bytes_so_no_turn_compiles_the_kernel_again(checked):
    assert all(case["aligned"] for case in checked.values()), checked


def test_the_metadata_names_each_segments_keys_blocks_and_work_items():
    store = KVStore([LayerShape(False, 1, 8), LayerShape(True, 1, 8)], window=20, max_bytes=1 << 20, device="cpu",
                    dtype=torch.float32)
    sequence = store.open([])
    store.reserve(sequence, list(range(70)))
    store.mark_written(sequence, 40)  # the sliding blocks before position 40 - 19 = 21 go: block 0
    layout = TurnLayout.of([Segment(Kind.PROMPT, 0, 30, 40), Segment(Kind.CANVAS, 0, 5, 70)])
    segments, items, table = kernel_metadata(layout, [sequence], sliding=False, window=20, block_tokens=16, block_m=16)
    assert segments[0] == [0, 30, 40, 0, 70, 0, 0, 0, 0, 0]  # a prompt: every earlier key, no own keys, no window
    assert segments[1] == [30, 35, 70, 0, 70, 30, 35, 0, 5, 0]  # a canvas: its own rows after the stored keys
    assert table == sequence.full * 2
    assert items == [[0, 0], [0, 16], [1, 30]]
    segments, items, table = kernel_metadata(layout, [sequence], sliding=True, window=20, block_tokens=16, block_m=16)
    assert segments[0][3:5] == [21, 70] and segments[0][7] == 20 and segments[0][9] == 1  # from block 1: the window
    assert segments[1][3:5] == [51, 70] and segments[1][9] == 3  # a canvas reads the last W - 1 positions
    assert table[:4] == sequence.sliding[1:5] and table[4:] == sequence.sliding[3:5]


def test_a_segment_reaching_a_released_sliding_block_is_refused():
    store = KVStore([LayerShape(True, 1, 8)], window=20, max_bytes=1 << 20, device="cpu", dtype=torch.float32)
    sequence = store.open([])
    store.reserve(sequence, list(range(80)))
    store.mark_written(sequence, 80)
    layout = TurnLayout.of([Segment(Kind.PROMPT, 0, 8, 0)])  # positions long released
    with pytest.raises(ValueError, match="released sliding blocks"):
        kernel_metadata(layout, [sequence], sliding=True, window=20, block_tokens=16, block_m=16)
