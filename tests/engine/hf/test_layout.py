"""The flat turn's layout (app/engine/hf/layout.py), pure: segments end to end, each token's
position and stack, the logit rows, and the keys each segment's attention reads on either kind of
layer (transformers' canvas rule: the prompt's last W - 1 keys plus the whole canvas)."""

from __future__ import annotations

import pytest

from app.engine.hf.layout import KeySpan, Kind, Segment, TurnLayout, key_span

W = 8  # the sliding window


def prompt(sequence: int, tokens: int, position: int = 0, **fields) -> Segment:
    return Segment(Kind.PROMPT, sequence, tokens, position, **fields)


def canvas(sequence: int, tokens: int, position: int, **fields) -> Segment:
    return Segment(Kind.CANVAS, sequence, tokens, position, **fields)


def test_segments_lie_end_to_end_with_their_positions_and_stacks():
    layout = TurnLayout.of([prompt(0, 3, position=5), canvas(0, 2, position=8, logits=(1,)),
                            canvas(1, 2, position=4, logits=(0, 1))])
    assert [item.start for item in layout.placed] == [0, 3, 5] and layout.tokens == 7
    assert layout.positions() == [5, 6, 7, 8, 9, 4, 5]
    assert layout.canvas_tokens() == [False] * 3 + [True] * 4
    assert layout.logit_rows() == [4, 5, 6] and layout.logit_counts() == [0, 1, 2]
    assert [item.segment for item in layout.prompt_runs()] == [prompt(0, 3, position=5)]


def test_a_prompt_reads_its_sequence_causally_and_a_sliding_layer_its_window():
    tail = prompt(0, 4, position=20)
    assert key_span(tail, sliding=False, window=W) == KeySpan(0, 24, own=False, causal=True, window=None)
    # A sliding layer: the first query (position 20) sees positions 13..20, so W - 1 earlier keys are read.
    assert key_span(tail, sliding=True, window=W) == KeySpan(13, 24, own=False, causal=True, window=W)
    assert key_span(prompt(0, 4, position=2), sliding=True, window=W).start == 0


def test_a_canvas_reads_its_whole_prompt_or_its_last_w_minus_1_and_itself():
    read = canvas(0, 16, position=30)
    assert key_span(read, sliding=False, window=W) == KeySpan(0, 30, own=True, causal=False, window=None)
    assert key_span(read, sliding=True, window=W) == KeySpan(23, 30, own=True, causal=False, window=None)
    assert key_span(canvas(0, 16, position=3), sliding=True, window=W).start == 0


@pytest.mark.parametrize("segment, message", [
    (prompt(0, 0), "at least one token"),
    (canvas(0, 4, 10, images=((0, 2),)), "no image"),
    (prompt(0, 4, conditioned=True), "only a canvas"),
    (prompt(0, 4, images=((2, 6),)), "image block"),
    (prompt(0, 6, images=((3, 5), (1, 2))), "image block"),
    (canvas(0, 4, 10, logits=(4,)), "logit offsets"),
])
def test_a_malformed_segment_is_refused(segment, message):
    with pytest.raises(ValueError, match=message):
        TurnLayout.of([segment])


def test_a_sequences_prompt_segments_are_contiguous_and_its_canvases_follow_them():
    TurnLayout.of([prompt(0, 4, position=0), prompt(0, 4, position=4), canvas(0, 8, position=8)])
    with pytest.raises(ValueError, match="not contiguous"):
        TurnLayout.of([prompt(0, 4, position=0), prompt(0, 4, position=5)])
    with pytest.raises(ValueError, match="ahead of its prompt's end"):
        TurnLayout.of([prompt(0, 4, position=0), canvas(0, 8, position=2)])
    with pytest.raises(ValueError, match="at least one segment"):
        TurnLayout.of([])
