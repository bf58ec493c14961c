"""Answers and confidence: Jev's shapes, the reference's meaning, and Jev's formulas."""

from __future__ import annotations

import pytest

from app.decisions.questions import (
    CHOICE,
    NOUL,
    SCORE,
    choice_confidence,
    entropy,
    score_confidence,
    softmax,
    top_index,
)
from app.decisions.request import parse_decision
from tests.conftest import LIMITS


def questions():
    return parse_decision({"state": "x", "questions": {
        "n": {"type": "noul"},
        "c": {"type": "choice", "criteria": {"billing": None, "outage": None, "feature": None}},
        "s": {"type": "score", "criteria": ["calm", "annoyed", {"level": "furious"}]},
    }}, LIMITS).questions


def test_noul_answer_has_exactly_type_and_noul():
    n, _, _ = questions()
    assert NOUL.answer(n, [0.7, 0.3], "djev") == {"type": "noul", "noul": 0.7}


def test_choice_answer_keeps_option_order_and_reference_confidence():
    _, c, _ = questions()
    answer = CHOICE.answer(c, [0.15, 0.7, 0.15], "djev")
    assert answer["choice"] == "outage"
    assert list(answer["probabilities"]) == ["billing", "outage", "feature"]
    assert answer["confidence"] == 0.7


def test_score_answer_is_zero_based_with_string_keys_and_legend_as_sent():
    _, _, s = questions()
    answer = SCORE.answer(s, [0.7, 0.15, 0.15], "djev")
    assert answer["score"] == pytest.approx(0.45)
    assert answer["legend"] == {"0": "calm", "1": "annoyed", "2": {"level": "furious"}}
    assert answer["probabilities"] == {"0": 0.7, "1": 0.15, "2": 0.15}
    assert answer["confidence"] == 0.7


@pytest.mark.parametrize("probs, expected", [
    ([0.41] + [0.59 / 7] * 7, 0.3257142857),  # 8 options, recorded by Jev
    ([0.7, 0.3], 0.4),
    ([0.99] + [0.0025] * 4, 0.9875),
    ([0.5, 0.5], 0.0),
    ([1.0], 1.0),
])
def test_jev_choice_confidence(probs, expected):
    assert choice_confidence(probs, "jev") == pytest.approx(expected, abs=1e-9)


@pytest.mark.parametrize("probs, expected", [
    ([0.01, 0.06, 0.35, 0.57, 0.01], 0.575),
    ([0.28, 0.48, 0.24, 0.0], 0.48),
    ([0.37, 0.03, 0.25, 0.35], 0.0),
])
def test_jev_score_confidence(probs, expected):
    assert score_confidence(probs, "jev") == pytest.approx(expected, abs=1e-9)


def test_reference_confidence_is_the_top_probability():
    assert choice_confidence([0.51, 0.49], "djev") == 0.51
    assert choice_confidence([0.51, 0.49], "jev") == pytest.approx(0.02)
    assert score_confidence([0.2, 0.5, 0.3], "djev") == 0.5


def test_ties_go_to_the_earliest_alternative():
    assert top_index([0.4, 0.4, 0.2]) == 0
    assert top_index([0.2, 0.4, 0.4]) == 1


def test_softmax_renormalises_over_labels_and_entropy_is_in_nats():
    import math

    probs = softmax([math.log(0.07), math.log(0.03)])  # 90 % of the mass outside the labels
    assert probs == pytest.approx([0.7, 0.3])
    assert entropy([0.5, 0.5]) == pytest.approx(math.log(2))
    assert entropy([1.0, 0.0]) == 0.0
