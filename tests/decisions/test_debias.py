"""Order-free options (`debias`, docs/quality.md): the pure orders, shifts, mapping back, averaging
and prior division first; then, on the tiny model, what the modes do to real reads. The tiny model's
numbers are random: these tests prove the mechanics, not that any answer got better."""

from __future__ import annotations

import dataclasses
import math

import pytest

from app.decisions import debias
from app.decisions.debias import (
    Debias,
    PriorCache,
    canonical_order,
    combine,
    divide_prior,
    rotated_order,
    rotation_count,
    rotation_weights,
    shift,
    shown_labels,
    shown_orders,
    shown_question,
    to_caller,
)
from app.decisions.errors import RequestError
from app.decisions.estimate import QuestionEstimate
from app.decisions.questions import CHOICE, NOUL, SCORE, Alternative, Question
from app.decisions.request import parse_decision
from tests.conftest import LIMITS


def choice(*names: str, qid: str = "c") -> Question:
    return Question(qid, 1, CHOICE, "pick", tuple(Alternative(name, None) for name in names))


def score(*levels: str, qid: str = "s") -> Question:
    return Question(qid, 1, SCORE, "how much", tuple(Alternative(level, None, legend=level) for level in levels))


def noul(qid: str = "n") -> Question:
    return Question(qid, 1, NOUL, "yes?", (Alternative("yes", None), Alternative("no", None)))


def estimate(probs, slot=5, entropies=(0.5,), stderr=None, agreement=None) -> QuestionEstimate:
    probs = tuple(probs)
    return QuestionEstimate(probs, max(range(len(probs)), key=lambda i: (probs[i], -i)), tuple(entropies), slot,
                            0.9, True, stderr, agreement)


# ------------------------------------------------------------------ modes


@pytest.mark.parametrize("mode, order, prior", [
    ("off", "off", False), ("canonical", "canonical", False), ("rotate", "rotate", False), ("prior", "off", True),
    ("canonical+prior", "canonical", True), ("rotate+prior", "rotate", True),
])
def test_each_mode_parses_and_spells_itself_back(mode, order, prior):
    parsed = Debias.parse(mode)
    assert (parsed.order, parsed.prior, parsed.mode) == (order, prior, mode)
    assert parsed.off == (mode == "off")


@pytest.mark.parametrize("mode", ["", "Rotate", "prior+rotate", "canonical+rotate", "rotate+prior+prior", "on"])
def test_other_spellings_are_not_modes(mode):
    with pytest.raises(ValueError, match="debias must be one of"):
        Debias.parse(mode)


def test_the_settings_know_the_same_modes():
    from app.config import DEBIAS_MODES

    assert DEBIAS_MODES == debias.MODES


# ------------------------------------------------------------------ orders


def test_the_canonical_order_depends_only_on_the_names():
    names = ("delta", "alpha", "Charlie", "bravo", "échelon")
    order = canonical_order(choice(*names))
    assert [names[i] for i in order] == ["Charlie", "alpha", "bravo", "delta", "échelon"]  # code points
    shuffled = ("bravo", "échelon", "delta", "Charlie", "alpha")
    assert [shuffled[i] for i in canonical_order(choice(*shuffled))] == [names[i] for i in order]
    assert canonical_order(noul()) == (1, 0)  # no before yes
    assert canonical_order(score("low", "mid", "high")) == (0, 1, 2)  # levels keep their order


def test_shifts_are_evenly_spaced_and_rounded_half_up():
    assert [shift(j, 4, 4) for j in range(4)] == [0, 1, 2, 3]
    assert [shift(j, 10, 8) for j in range(8)] == [0, 1, 3, 4, 5, 6, 8, 9]  # 1.25 -> 1, 2.5 -> 3, 7.5 -> 8
    assert [shift(j, 2, 4) for j in range(4)] == [0, 1, 1, 0]  # 0.5 -> 1, 1.5 -> 2 = 0
    for n in range(2, 40):
        k = min(n, 8)
        assert len({shift(j, n, k) for j in range(k)}) == k  # distinct whenever K <= n


def test_rotations_put_every_option_at_every_position_once():
    question = choice("d", "b", "a", "c", "e")
    k = rotation_count([question], 8)
    assert k == 5
    orders = [rotated_order(question, j, k) for j in range(k)]
    assert orders[0] == canonical_order(question)
    for position in range(5):
        assert sorted(order[position] for order in orders) == [0, 1, 2, 3, 4]
    names = question.names
    assert [names[i] for i in orders[1]] == ["b", "c", "d", "e", "a"]  # the canonical list shifted by one


def test_a_score_is_read_forwards_and_reversed():
    question = score("calm", "annoyed", "furious")
    assert rotation_count([question], 8) == 2
    assert [rotated_order(question, j, 2) for j in range(2)] == [(0, 1, 2), (2, 1, 0)]


def test_a_canvas_of_several_questions_uses_the_largest_k():
    questions = [noul(), choice("a", "b", "c", "d"), score("lo", "hi")]
    views = shown_orders("rotate", questions, 8)
    assert len(views) == 4
    assert [view["n"] for view in views] == [(1, 0), (0, 1), (0, 1), (1, 0)]  # each listing twice
    assert [view["s"] for view in views] == [(0, 1), (1, 0), (1, 0), (0, 1)]
    assert len({view["c"] for view in views}) == 4
    many = choice(*[f"o{i:02d}" for i in range(20)])
    assert rotation_count([many], 8) == 8 and rotation_count([many], 3) == 3
    assert shown_orders("off", questions, 8) == [{}]
    assert shown_orders("canonical", questions, 8) == [{"n": (1, 0), "c": (0, 1, 2, 3), "s": (0, 1)}]


def test_shown_questions_and_labels():
    question = choice("b", "a", "c")
    shown = shown_question(question, (1, 0, 2))
    assert shown.names == ("a", "b", "c") and shown.qid == question.qid
    assert shown_question(question, (0, 1, 2)) is question and shown_question(question, None) is question
    assert shown_labels(question, ("A", "B", "C"), (1, 0, 2)) == ("A", "B", "C")  # letters go by position
    assert shown_labels(noul(), ("yes", "no"), (1, 0)) == ("no", "yes")  # noul's labels are its answers
    assert shown_labels(score("lo", "hi"), ("1", "2"), (1, 0)) == ("1", "2")  # 1 is the top of a reversed scale


def test_to_caller_undoes_the_shown_order():
    order = (2, 0, 3, 1)
    caller = [0.1, 0.2, 0.3, 0.4]
    shown = [caller[i] for i in order]
    assert to_caller(shown, order) == caller


# ------------------------------------------------------------------ prior and averaging


def test_divide_prior():
    assert divide_prior([0.5, 0.3, 0.2], [1 / 3] * 3) == pytest.approx([0.5, 0.3, 0.2])
    assert divide_prior([0.6, 0.3, 0.1], [0.6, 0.3, 0.1]) == pytest.approx([1 / 3] * 3)
    assert divide_prior([0.5, 0.5], [0.8, 0.2]) == pytest.approx([0.2, 0.8])
    floored = divide_prior([0.5, 0.5], [1.0, 0.0])
    assert math.isclose(sum(floored), 1.0) and floored[1] > 0.99


def test_rotation_weights_give_each_listing_one_share():
    assert rotation_weights([(0, 1), (1, 0)]) == [0.5, 0.5]
    assert rotation_weights([(1, 0), (0, 1), (0, 1), (1, 0)]) == [0.25] * 4
    assert rotation_weights([(0, 1, 2), (1, 2, 0), (2, 0, 1), (2, 0, 1)]) == pytest.approx([1 / 3, 1 / 3, 1 / 6, 1 / 6])


def test_combine_maps_back_and_averages_by_name():
    alone = estimate((0.7, 0.2, 0.1))
    assert combine([alone], [(0, 1, 2)]) is alone
    mapped = combine([alone], [(2, 0, 1)])  # shown: caller 2, caller 0, caller 1
    assert mapped.probs == pytest.approx((0.2, 0.1, 0.7)) and mapped.top == 2
    reads = [estimate((0.6, 0.4), slot=7, entropies=(0.1, 0.2)), estimate((0.8, 0.2), slot=9, entropies=(0.3,))]
    both = combine(reads, [(0, 1), (1, 0)])  # the second read lists caller 1 first
    assert both.probs == pytest.approx((0.4, 0.6)) and both.top == 1
    assert both.entropies == (0.1, 0.2, 0.3) and both.slot == 7
    assert both.agreement == 0.5  # the first read preferred option 0
    assert both.stderr == pytest.approx(math.sqrt(((0.4 - 0.6) ** 2 + (0.8 - 0.6) ** 2) / 1 / 2))


def test_the_prior_cache_is_a_bounded_lru():
    cache = PriorCache(entries=2)
    cache.put(("a",), ((0.5, 0.5),))
    cache.put(("b",), ((0.4, 0.6),))
    assert cache.get(("a",)) == ((0.5, 0.5),)  # a is now the most recent
    cache.put(("c",), ((0.1, 0.9),))
    assert cache.get(("b",)) is None and cache.get(("a",)) is not None and len(cache) == 2


# ------------------------------------------------------------------ the request key


def body(**extra) -> dict:
    return {"state": "x", "questions": {"t": {"type": "choice", "criteria": {"a": None, "b": None}}}, **extra}


@pytest.mark.parametrize("value", ["sorted", "Rotate", "prior+rotate", "canonical+rotate", ["rotate", "prior"], 1,
                                   True, {"mode": "rotate"}, ""])
def test_a_bad_debias_is_refused_naming_the_field(value):
    with pytest.raises(RequestError) as info:
        parse_decision(body(debias=value), LIMITS)
    error = info.value
    assert error.loc == ("debias",) and error.status == 422
    assert error.message.startswith('schema: debias must be one of "off", "canonical", "rotate", "prior"')


def test_debias_defaults_to_the_setting_and_null_is_the_default():
    assert parse_decision(body(), LIMITS).debias == debias.OFF
    rotating = dataclasses.replace(LIMITS, debias="rotate+prior")
    assert parse_decision(body(), rotating).debias == Debias("rotate", True)
    assert parse_decision(body(debias=None), rotating).debias == Debias("rotate", True)
    assert parse_decision(body(debias="off"), rotating).debias == debias.OFF
    assert parse_decision(body(debias="canonical"), LIMITS).debias == Debias("canonical", False)
