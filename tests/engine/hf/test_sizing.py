"""The KV store's split between its pools (app/engine/hf/sizing.py): a long state gets every full
block it needs beside short prompts' share; a store too small for the longest state asked holds what it
can, and says so; one too small for a turn's work is refused."""

from __future__ import annotations

import pytest
import torch

from app.engine.hf.blocks import BLOCK_TOKENS, LayerShape, block_bytes
from app.engine.hf.sizing import CAMERA_STORE_SHARE, camera_sessions, floor_blocks, plan_store

GiB = 2**30
# The full size's layers: 5 full (2 KV heads x 512), 25 sliding (8 x 256), bf16: 320 KiB and 3.2 MiB a block.
FULL = block_bytes([LayerShape(False, 2, 512)] * 5, BLOCK_TOKENS, torch.bfloat16)
SLIDING = block_bytes([LayerShape(True, 8, 256)] * 25, BLOCK_TOKENS, torch.bfloat16)


def plan(store: float, wanted: int = 131072, budget: int = 4096):
    return plan_store(int(store * GiB), FULL, SLIDING, block_tokens=BLOCK_TOKENS, window=1024, budget=budget,
                      wanted_prompt_tokens=wanted)


def test_an_80_gb_cards_store_holds_a_128k_state_beside_short_prompts():
    split = plan(23.0)
    assert split.max_prompt_tokens == 131072
    assert split.full_blocks - split.sliding_blocks >= 131072 // BLOCK_TOKENS  # the longest state's full blocks
    assert split.full_bytes + split.sliding_bytes <= 23 * GiB
    assert split.short_tokens > 90_000  # and ~95k tokens of short prompts at once
    assert "states up to 131072 tokens" in split.line()


def test_the_110k_state_that_failed_in_7_8_gib_now_fits():
    split = plan(7.8)
    assert split.max_prompt_tokens == 131072
    assert split.full_blocks >= -(-110_000 // BLOCK_TOKENS) + split.sliding_blocks


def test_a_store_too_small_for_the_longest_state_holds_what_it_can_and_says_so():
    split = plan(2.0)
    floor = floor_blocks(4096, 1024, BLOCK_TOKENS)
    assert split.sliding_blocks == floor  # a turn's work beside a long state's window, and no more
    assert split.max_prompt_tokens == (split.full_blocks - floor) * BLOCK_TOKENS < 131072
    assert split.full_bytes + split.sliding_bytes <= 2 * GiB
    assert "not 131072" in split.line()


def test_a_store_that_cannot_hold_a_turns_work_is_refused():
    with pytest.raises(ValueError, match="give PROMPT_CACHE_GB more"):
        plan(0.5)


def test_one_kind_of_layer_gets_one_pool():
    only_full = plan_store(GiB, FULL, 0, block_tokens=BLOCK_TOKENS, window=1024, budget=4096, wanted_prompt_tokens=8192)
    assert only_full.sliding_blocks == 0 and only_full.full_blocks == GiB // FULL
    only_sliding = plan_store(2 * GiB, 0, SLIDING, block_tokens=BLOCK_TOKENS, window=1024, budget=4096,
                              wanted_prompt_tokens=8192)
    assert only_sliding.full_blocks == 0 and only_sliding.max_prompt_tokens == 8192


def test_camera_sessions_fill_half_the_store_with_a_frame_each():
    # An 80 GB card's 15 GiB store (bf16 weights) with the full-size model's frames (280 image + 200 text tokens).
    split = plan(15.1)
    sessions = camera_sessions(split.short_tokens, 480)
    assert sessions == int(split.short_tokens * CAMERA_STORE_SHARE) // 480
    assert 50 <= sessions <= 70  # more than the 32 a fixed MAX_SESSIONS allowed
    assert camera_sessions(split.short_tokens, 480, share=1.0) == split.short_tokens // 480
    assert camera_sessions(100, 480) == 1  # a store too small for one frame still holds one session


def test_a_frame_of_no_tokens_is_refused():
    with pytest.raises(ValueError, match="at least one token"):
        camera_sessions(60_000, 0)
