"""Stages, ask_if gating and grouping (docs/design.md §3.8)."""

from __future__ import annotations

from app.decisions.plan import gate, groups, stages
from app.decisions.request import parse_decision
from tests.conftest import LIMITS

DEPS = {
    "urgent": {"type": "noul"},
    "bucket": {"type": "choice", "criteria": {"billing": None, "outage": None, "feature": None}},
    "escalate": {"type": "noul", "depends_on": ["urgent", "bucket"]},
    "refund": {"type": "noul", "ask_if": {"bucket": ["billing"]}},
    "outage_note": {"type": "noul", "ask_if": {"bucket": ["outage"]}, "depends_on": ["urgent"]},
}


def parsed(questions):
    return parse_decision({"state": "x", "questions": questions}, LIMITS).questions


def ids(layers):
    return [[q.qid for q in layer] for layer in layers]


def test_stages_layer_by_dependency_in_declaration_order():
    assert ids(stages(parsed(DEPS))) == [["urgent", "bucket"], ["escalate", "refund", "outage_note"]]


def test_a_question_waits_for_all_its_dependencies():
    layers = stages(parsed({
        "a": {"type": "noul"},
        "b": {"type": "noul", "depends_on": ["a"]},
        "c": {"type": "noul", "depends_on": ["a", "b"]},
        "d": {"type": "noul"},
    }))
    assert ids(layers) == [["a", "d"], ["b"], ["c"]]


def test_dependencies_outside_the_asked_set_count_as_answered():
    qs = parsed(DEPS)
    asked = [q for q in qs if q.qid in ("escalate",)]
    assert ids(stages(asked)) == [["escalate"]]


def test_gate_skips_on_the_first_unmet_entry_and_cascades():
    qs = {q.qid: q for q in parsed(DEPS)}
    assert gate(qs["refund"], {"bucket": "billing"}) is None
    skip = gate(qs["outage_note"], {"urgent": "yes", "bucket": "billing"})
    assert skip.as_json() == {"because": "bucket", "was": "billing", "wanted": ["outage"]}
    cascade = gate(qs["refund"], {"bucket": None})
    assert cascade.was is None and cascade.because == "bucket"


def rows_by_count(questions):
    return 3 * len(questions) + 1


def test_groups_pack_until_the_limit_and_alone_closes_a_group():
    qs = parsed({f"w{i}": {"type": "noul"} for i in range(7)})
    assert ids(groups(qs, rows_by_count, limit=10)) == [["w0", "w1", "w2"], ["w3", "w4", "w5"], ["w6"]]
    alone = parsed({
        "urgent": {"type": "noul"},
        "bucket": {"type": "noul", "alone": True},
        "tone": {"type": "noul"},
        "more": {"type": "noul"},
    })
    assert ids(groups(alone, rows_by_count, limit=100)) == [["urgent"], ["bucket"], ["tone", "more"]]
    assert ids(groups(alone, rows_by_count, limit=100, isolate=True)) == [["urgent"], ["bucket"], ["tone"], ["more"]]


def test_a_single_oversized_question_is_still_a_group():
    qs = parsed({"a": {"type": "noul"}})
    assert ids(groups(qs, lambda q: 1000, limit=10)) == [["a"]]
