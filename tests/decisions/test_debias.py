"""Order-free options (`debias`, docs/quality.md): the pure orders, shifts, mapping back, averaging
and prior division first; then, on the tiny model, what the modes do to real reads. The tiny model's
numbers are random: these tests prove the mechanics, not that any answer got better."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import math

import pytest

from app import build
from app.config import Settings
from app.decisions import debias
from app.decisions.debias import (
    Debias,
    PriorCache,
    canonical_order,
    combine,
    divide_prior,
    reversed_scales,
    rotated_order,
    rotation_count,
    rotation_weights,
    scale_direction,
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
from app.decisions.run import Decider
from tests.conftest import LIMITS, REPEAT_TOLERANCE, close
from tests.fakes import ScriptedReader


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
    assert canonical_order(score("low", "mid", "high")) == (2, 1, 0)  # high, mid, low: its names sort first so
    assert canonical_order(score("high", "mid", "low")) == (0, 1, 2)  # already that way: as sent


@pytest.mark.parametrize("levels, reversed_", [
    (["low", "mid", "high"], True),  # ["high", "mid", "low"] is the smaller list
    (["high", "mid", "low"], False),
    (["calm", "annoyed", "furious"], False),  # "calm" < "furious"
    (["furious", "annoyed", "calm"], True),
    ([str(n) for n in range(1, 11)], False),  # "1" < "10"
    ([str(n) for n in range(10, 0, -1)], True),
    (["never", "often", "rarely", "never"], False),  # the first names tie: the later ones decide
    (["never", "rarely", "often", "never"], True),
    (["a", "b", "a"], False),  # a palindrome: as sent
    (["Low", "high"], False),  # code points: "L" < "h"
    (["ok", "ok!"], False), (["ok!", "ok"], True),  # a prefix sorts first
])
def test_a_scale_is_listed_in_the_direction_its_names_sort_first(levels, reversed_):
    forwards = tuple(range(len(levels)))
    assert scale_direction(levels) == (forwards[::-1] if reversed_ else forwards)
    assert canonical_order(score(*levels)) == scale_direction(levels)
    shown = [levels[i] for i in scale_direction(levels)]
    assert shown == min(levels, levels[::-1])  # the smaller list of names, as Python compares them
    assert [levels[::-1][i] for i in scale_direction(levels[::-1])] == shown  # the reverse is shown alike
    assert reversed_scales([score(*levels)], {"s": scale_direction(levels)}) == (("s",) if reversed_ else ())


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
    assert [view["s"] for view in views] == [(1, 0), (0, 1), (0, 1), (1, 0)]  # "hi" < "lo": reversed first
    assert len({view["c"] for view in views}) == 4
    many = choice(*[f"o{i:02d}" for i in range(20)])
    assert rotation_count([many], 8) == 8 and rotation_count([many], 3) == 3
    assert shown_orders("off", questions, 8) == [{}]
    assert shown_orders("canonical", questions, 8) == [{"n": (1, 0), "c": (0, 1, 2, 3), "s": (1, 0)}]


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


# ------------------------------------------------------------------ on the tiny model (real reads)

FIVE = {"delta": "the fourth", "alpha": None, "charlie": "the third", "bravo": None, "echo": None}
TEAMS = {"billing": None, "outage": "service down", "feature": None, "sales": None}
TICKET = {"ticket": "Everything is down and we have a demo at noon."}
SMALL = build.read_settings(Settings.of(canvas=64))


def one_choice(criteria: dict, **extra) -> dict:
    return {"state": TICKET, "questions": {"team": {"type": "choice", "instructions": "Which team owns this?",
                                                   "criteria": criteria}}, "samples": 1, **extra}


def run_on(reader, bodies: list[dict], settings=SMALL) -> list:
    """Decide every body in order on one reader (started once, in one event loop) and one Decider:
    each outcome with the reader's counters as they stood after it."""

    async def go():
        await reader.start()
        try:
            decider = Decider(reader, settings)
            out = []
            for body in bodies:
                out.append((await decider.decide(parse_decision(body, LIMITS)), dict(reader.stats)))
            return out
        finally:
            await reader.stop()

    return asyncio.run(go())


def test_canonical_gives_the_same_probabilities_for_every_order(tiny_reader):
    orders = list(itertools.permutations(FIVE))  # all 120, the caller's reverse among them
    bodies = [one_choice({name: FIVE[name] for name in order}, debias="canonical") for order in orders]
    nouls = [{"state": TICKET, "questions": {"u": {"type": "noul", "instructions": "Urgent?", "criteria": criteria}},
              "samples": 1, "debias": "canonical"}
             for criteria in ({"true": "now", "false": "later"}, {"false": "later", "true": "now"})]
    outcomes = [outcome for outcome, _ in run_on(tiny_reader, bodies + nouls)]
    first = outcomes[0].answers["team"]["probabilities"]
    for order, outcome in zip(orders, outcomes):
        answer = outcome.answers["team"]
        assert list(answer["probabilities"]) == list(order)  # the caller's names, in the caller's order
        for name in FIVE:
            assert answer["probabilities"][name] == pytest.approx(first[name], abs=1e-6)
        assert answer["choice"] == outcomes[0].answers["team"]["choice"]
    assert outcomes[-1].answers["u"]["noul"] == pytest.approx(outcomes[-2].answers["u"]["noul"], abs=1e-6)
    assert outcomes[0].diagnostics["debias"]["prompts"] == 1
    # one sheet: the first decision encoded it, every other order read the same prompt again
    assert tiny_reader.stats["kv_misses"] == 2  # the choice's sheet and the noul's


def test_canonical_lists_noul_no_first(scripted, tokenizer):
    decide_scripted(scripted, {"u": {"type": "noul", "instructions": "Urgent?"}}, debias="canonical")
    sheet = tokenizer.decode(scripted.reads[0].prompt.ids)
    assert sheet.index("  no") < sheet.index("  yes")
    assert tokenizer.decode(scripted.reads[0].canvases[0]).startswith("q1:")


def shifted_criteria(criteria: dict, j: int, k: int) -> dict:
    """The criteria listed as rotation j of K shows them."""
    question = parse_decision(one_choice(criteria), LIMITS).questions[0]
    names = [question.names[i] for i in rotated_order(question, j, k)]
    return {name: criteria[name] for name in names}


def test_rotate_is_the_mean_of_the_shifted_listings_read_alone(tiny_reader):
    k = len(TEAMS)
    bodies = [one_choice(TEAMS, debias="rotate")]
    bodies += [one_choice(shifted_criteria(TEAMS, j, k)) for j in range(k)]
    bodies += [one_choice(TEAMS, samples=k)]
    (rotated, counters), *alone, (sampled, _) = run_on(tiny_reader, bodies)
    assert counters["kv_misses"] == k and counters["reads"] == k  # K distinct prompts, one read each
    cost = rotated.diagnostics["debias"]
    assert cost == {"mode": "rotate", "rotations": [k], "prompts": k, "reads": k, "canvases": k,
                    "prior": {"read": 0, "cached": 0}, "reversed_scales": []}
    assert rotated.reads == k and rotated.diagnostics["samples"]["n"] == k

    mean = {name: sum(o.answers["team"]["probabilities"][name] for o, _ in alone) / k for name in TEAMS}
    answer = rotated.answers["team"]
    assert list(answer["probabilities"]) == list(TEAMS)
    for name in TEAMS:  # equal up to the float noise of batching the K prompts into one pass
        assert answer["probabilities"][name] == pytest.approx(mean[name], abs=1e-4)
    assert answer["choice"] == max(mean, key=lambda name: mean[name])
    # K plain draws of the caller's listing are another thing: noise, not order
    gap = max(abs(sampled.answers["team"]["probabilities"][name] - mean[name]) for name in TEAMS)
    assert gap > 1e-2


def test_the_prior_is_read_once_per_sheet(tiny_reader):
    states = [TICKET, {"ticket": "Please add a dark mode."}, "I was charged twice."]
    bodies = [{**one_choice(TEAMS, debias="prior"), "state": state} for state in states] + [one_choice(TEAMS)]
    *debiased, (raw, _) = run_on(tiny_reader, bodies)
    assert [o.diagnostics["debias"]["prior"] for o, _ in debiased] == [
        {"read": 1, "cached": 0}, {"read": 0, "cached": 1}, {"read": 0, "cached": 1}]
    # the content-free read, then one read per state; no new prior for another state of the sheet
    assert [counters["reads"] for _, counters in debiased] == [2, 3, 4]
    assert [counters["kv_misses"] for _, counters in debiased] == [2, 3, 4]
    assert debiased[0][0].diagnostics["debias"]["canvases"] == 1 + debias.PRIOR_DRAWS
    assert debiased[1][0].diagnostics["debias"]["canvases"] == 1
    # the same read as the raw decision's, divided by the prior
    assert debiased[0][0].answers["team"]["probabilities"] != raw.answers["team"]["probabilities"]
    assert debiased[0][0].estimates["team"].entropies != raw.estimates["team"].entropies


def test_off_is_todays_decision(tiny_reader):
    (plain, _), (explicit, _) = run_on(tiny_reader, [one_choice(TEAMS, samples=2, **extra)
                                                     for extra in ({}, {"debias": "off"})])
    assert close(plain.answers, explicit.answers) and "debias" not in plain.diagnostics
    assert close({k: v for k, v in plain.diagnostics.items() if k != "timing"},
                 {k: v for k, v in explicit.diagnostics.items() if k != "timing"})


# ------------------------------------------------------------------ composition (scripted reader)

SCHEMA = {
    "urgent": {"type": "noul", "instructions": "Urgent?"},
    "team": {"type": "choice", "instructions": "Which team?", "criteria": {"billing": None, "outage": None, "feature": None}},
    "tone": {"type": "score", "instructions": "How angry?", "criteria": ["calm", "annoyed", "furious"]},
}


def decide_scripted(reader, questions=SCHEMA, images=(), settings=SMALL, **extra):
    body = {"state": TICKET, "questions": questions, "samples": 1, **extra}
    return asyncio.run(Decider(reader, settings).decide(parse_decision(body, LIMITS, images=images)))


def plan_cost(reader, **extra) -> int:
    body = {"state": TICKET, "questions": SCHEMA, **extra}
    return Decider(reader, SMALL).plan(parse_decision(body, LIMITS)).canvases


def test_admission_prices_every_rotation_and_prior(scripted):
    assert plan_cost(scripted, samples=2) == 2
    assert plan_cost(scripted, samples=2, debias="canonical") == 2
    assert plan_cost(scripted, samples=2, debias="rotate") == 3 * 2  # K = 3, the choice's
    assert plan_cost(scripted, samples=2, debias="rotate+prior") == 3 * (2 + debias.PRIOR_DRAWS)
    assert plan_cost(scripted, samples=2, debias="prior") == 2 + debias.PRIOR_DRAWS
    assert plan_cost(scripted, samples=1, debias="rotate", isolate=True) == 2 + 3 + 2  # each question its own K
    think = Decider(scripted, SMALL).plan(parse_decision(
        {"state": TICKET, "questions": SCHEMA, "think": 10, "debias": "rotate"}, LIMITS))
    assert think.thought_tokens == 30  # a thought for each rotation's prompt


def test_rotate_reads_each_shift_as_its_own_prompt(scripted, tokenizer):
    outcome = decide_scripted(scripted, debias="rotate")
    assert len(scripted.reads) == 3 and len({spec.prompt.ids for spec in scripted.reads}) == 3
    sheets = [tokenizer.decode(spec.prompt.ids) for spec in scripted.reads]
    assert "A: billing\n  B: feature\n  C: outage" in sheets[0]  # the canonical order
    assert "A: feature\n  B: outage\n  C: billing" in sheets[1]
    assert "1: furious" in sheets[1] and "3: calm" in sheets[1]  # the scale reversed, labelled by position
    # the fake favours each slot's first label: averaged over the listings, no option is favoured twice
    probs = outcome.answers["team"]["probabilities"]
    assert list(probs) == ["billing", "outage", "feature"]
    assert all(p == pytest.approx(1 / 3) for p in probs.values())
    assert outcome.diagnostics["questions"]["team"]["agreement"] == pytest.approx(1 / 3)
    assert outcome.answers["urgent"]["noul"] == pytest.approx(0.5)  # no, yes, no: each listing one share
    assert outcome.output_tokens == sum(list(s.canvases[0]).index(tokenizer.turn_close_id) + 1 for s in scripted.reads)


def test_rotate_with_auto_gives_each_shift_its_draws(tokenizer):
    unsure = ScriptedReader(tokenizer, conf=0.7)
    outcome = decide_scripted(unsure, questions={"team": SCHEMA["team"]}, samples="auto", debias="rotate")
    assert len(unsure.reads) == 6 and outcome.diagnostics["samples"]["n"] == 3 * 4
    assert outcome.diagnostics["samples"]["policy"]["extended"] == [True, True, True]
    assert outcome.diagnostics["debias"]["reads"] == 6 and outcome.diagnostics["debias"]["canvases"] == 12
    fixed = ScriptedReader(tokenizer)
    outcome = decide_scripted(fixed, questions={"team": SCHEMA["team"]}, samples=2, debias="rotate")
    assert [len(spec.canvases) for spec in fixed.reads] == [2, 2, 2]


def test_a_debiased_stage_gates_later_ones_by_name(tokenizer):
    questions = {
        "team": SCHEMA["team"],
        "refund": {"type": "noul", "instructions": "Refund?", "ask_if": {"team": ["feature"]}},
        "credit": {"type": "noul", "instructions": "Credit?", "ask_if": {"team": ["billing"]}},
    }
    # the fake favours the option listed at C, whatever the listing: feature, then outage, then billing
    reader = ScriptedReader(tokenizer, conf=0.9, pick=lambda spec, slot: 2 if len(spec.label_ids[slot]) == 3 else 0)
    outcome = decide_scripted(reader, questions=questions, debias="canonical")
    assert outcome.answers["team"]["choice"] == "outage"  # canonical: billing, feature, outage
    assert outcome.answers["refund"] is None and outcome.answers["credit"] is None
    reader = ScriptedReader(tokenizer, conf=0.9, pick=lambda spec, slot: 1 if len(spec.label_ids[slot]) == 3 else 0)
    outcome = decide_scripted(reader, questions=questions, debias="canonical")
    assert outcome.answers["team"]["choice"] == "feature" and outcome.answers["refund"]["type"] == "noul"
    assert outcome.diagnostics["stages"] == [["team"], ["refund"]]
    second = tokenizer.decode(reader.reads[-1].prompt.ids)
    assert second.endswith("q1: B")  # the answer prefilled as the canonical listing labels it
    assert "A: billing\n  B: feature\n  C: outage" in second


def test_rotate_in_a_chained_decision_continues_each_listing_in_its_own_labels(tokenizer):
    questions = {"team": SCHEMA["team"], "refund": {"type": "noul", "instructions": "Refund?", "depends_on": ["team"]}}
    reader = ScriptedReader(tokenizer, conf=0.4, pick=lambda spec, slot: 0)
    outcome = decide_scripted(reader, questions=questions, debias="rotate")
    assert outcome.answers["team"]["choice"] == "billing"  # a three-way tie goes to the caller's first
    first, second = reader.reads[:3], reader.reads[3:]
    assert len(first) == len(second) == 3
    for stage_one, stage_two in zip(first, second):
        assert stage_two.prompt.ids[: len(stage_one.prompt.ids)] == stage_one.prompt.ids
    endings = sorted(tokenizer.decode(spec.prompt.ids)[-5:] for spec in second)
    assert endings == ["q1: A", "q1: B", "q1: C"]  # billing under each listing's own label


def test_debias_with_isolate_and_images(scripted, tokenizer):
    from app.engine.base import ImageInput

    image = (ImageInput(data=b"png", content_type="image/png", source="part 'photo'"),)
    outcome = decide_scripted(scripted, images=image, isolate=True, debias="rotate+prior")
    assert outcome.diagnostics["chunks"] == [["urgent"], ["team"], ["tone"]]
    state_reads = [spec for spec in scripted.reads if spec.prompt.images]
    prior_reads = [spec for spec in scripted.reads if not spec.prompt.images]
    assert len(state_reads) == 2 + 3 + 2 and len(prior_reads) == 2 + 3 + 2
    for spec in prior_reads:
        text = tokenizer.decode(spec.prompt.ids)
        assert "N/A" in text and "Everything is down" not in text and len(spec.canvases) == debias.PRIOR_DRAWS
        assert tokenizer.image_placeholder_id not in spec.prompt.ids
    assert all(tokenizer.decode(spec.canvases[0]).startswith("q1:") for spec in scripted.reads)
    assert outcome.diagnostics["debias"]["rotations"] == [2, 3, 2]


class BiasedReader(ScriptedReader):
    """Every read carries the same pull toward the first labels (weights 8, 4, 2, 1, ...), times the
    state's own signal: "case k" favours label k mod n twofold; a content-free state favours none."""

    async def read(self, specs):
        from app.engine.base import ReadResult, SlotRead

        self.calls.append(("read", list(specs)))
        out = []
        for spec in specs:
            text = self.tokenizer.decode(spec.prompt.ids)
            case = int(text.split("case ")[1].split()[0]) if "case " in text else None
            slots = []
            for label_ids in spec.label_ids:
                n = len(label_ids)
                weights = [2.0 ** (n - i) * (2.0 if case is not None and case % n == i else 1.0) for i in range(n)]
                total = sum(weights)
                slots.append(SlotRead(tuple(math.log(w / total) for w in weights), label_ids[0]))
            out.append(ReadResult(tuple(tuple(slots) for _ in spec.canvases), 10))
        return out


def test_the_prior_divides_out_a_bias_every_read_shares(tokenizer):
    """The mechanics: a pull shared by every read of a sheet, the content-free one included, is
    divided out, so the mean over states whose signals balance becomes uniform."""
    reader = BiasedReader(tokenizer)
    decider = Decider(reader, SMALL)
    question = {"team": SCHEMA["team"]}

    def mean_over_states(mode: str) -> list[float]:
        async def go():
            outcomes = [await decider.decide(parse_decision(
                {"state": f"case {k} of the queue", "questions": question, "samples": 1, "debias": mode}, LIMITS))
                for k in range(9)]
            return [list(o.estimates["team"].probs) for o in outcomes]

        rows = asyncio.run(go())
        return [sum(column) / len(rows) for column in zip(*rows)]

    def distance(probs: list[float]) -> float:
        return sum(abs(p - 1 / len(probs)) for p in probs)

    before, after = mean_over_states("off"), mean_over_states("prior")
    assert distance(after) < distance(before) and before[0] > 0.5
    assert after == pytest.approx([1 / 3] * 3)
    content_free = [spec for spec in reader.reads if "case " not in tokenizer.decode(spec.prompt.ids)]
    assert len(content_free) == 1  # one sheet, one prior read


# ------------------------------------------------------------------ a reversed scale under canonical

RISING = ["low", "medium", "high"]  # its reverse, ["high", "medium", "low"], is the smaller list


def one_score(levels: list[str], **extra) -> dict:
    return {"state": TICKET, "questions": {"s": {"type": "score", "instructions": "How urgent?", "criteria": levels}},
            "samples": 1, **extra}


def mirrored(first: dict, second: dict, n: int, tolerance: float = 1e-6) -> None:
    """Two score answers over a scale and its reverse say the same of every level."""
    for i in range(n):
        assert first["probabilities"][str(i)] == pytest.approx(second["probabilities"][str(n - 1 - i)], abs=tolerance)
    assert first["score"] + second["score"] == pytest.approx(n - 1, abs=tolerance)
    assert first["confidence"] == pytest.approx(second["confidence"], abs=tolerance)


def test_canonical_reads_a_reversed_scale_alike_and_maps_it_back(tokenizer):
    """The fake pulls toward the first listed labels (8, 4, 2): as sent, each direction favours its own
    first level; under canonical both are listed high, medium, low and the answers mirror each other."""
    answers = {}
    for mode in ("off", "canonical"):
        for levels in (RISING, RISING[::-1]):
            reader = BiasedReader(tokenizer)
            outcome = asyncio.run(Decider(reader, SMALL).decide(parse_decision(one_score(levels, debias=mode), LIMITS)))
            answers[mode, levels[0]] = (outcome, tokenizer.decode(reader.reads[0].prompt.ids))
    (rising, rising_sheet), (falling, falling_sheet) = answers["canonical", "low"], answers["canonical", "high"]
    assert rising_sheet == falling_sheet and "1: high\n  2: medium\n  3: low" in rising_sheet  # level 1 = the top
    up, down = rising.answers["s"], falling.answers["s"]
    mirrored(up, down, 3)
    assert up["probabilities"]["2"] > up["probabilities"]["0"]  # "high", listed first, got the pull
    assert up["legend"] == {"0": "low", "1": "medium", "2": "high"}  # the levels as sent
    assert down["legend"] == {"0": "high", "1": "medium", "2": "low"}
    assert rising.diagnostics["debias"]["reversed_scales"] == ["s"]
    assert falling.diagnostics["debias"]["reversed_scales"] == []  # its names already sort first: as sent
    assert rising.internal_answers["s"]["label"] == "3"  # the chat form's label: the caller's order's
    # as sent, each direction favours its own first level: the answers do not mirror
    off_up, off_down = answers["off", "low"][0].answers["s"], answers["off", "high"][0].answers["s"]
    assert off_up["probabilities"]["0"] == pytest.approx(off_down["probabilities"]["0"])
    assert off_up["probabilities"]["0"] != pytest.approx(off_down["probabilities"]["2"], abs=1e-3)


def test_canonical_mirrors_a_reversed_scale_on_the_tiny_model(tiny_reader):
    levels = ["mild", "annoyed", "angry", "furious"]  # ["furious", "angry", "annoyed", "mild"] sorts first
    (sent, _), (reversed_, _) = run_on(tiny_reader, [one_score(levels, debias="canonical"),
                                                     one_score(levels[::-1], debias="canonical")])
    # Both read one sheet, the second from the KV store, in a turn of another shape (REPEAT_TOLERANCE).
    mirrored(sent.answers["s"], reversed_.answers["s"], 4, REPEAT_TOLERANCE)
    assert sent.diagnostics["debias"]["reversed_scales"] == ["s"]
    assert reversed_.diagnostics["debias"]["reversed_scales"] == []
    assert tiny_reader.stats["kv_misses"] == 1  # one sheet: both read the same prompt
