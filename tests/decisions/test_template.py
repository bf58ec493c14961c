"""Answer templates and slots on a real tokenizer (the tiny model's byte-level BPE)."""

from __future__ import annotations

import pytest

from app.decisions.errors import RequestError
from app.decisions.labels import LabelAlphabets
from app.decisions.questions import DIGIT_LABELS, LETTER_LABELS
from app.decisions.template import INDEXED, LINES, TemplateItem, Templates, answer_format, answer_text


@pytest.fixture(scope="module")
def templates(tokenizer):
    return Templates(tokenizer)


@pytest.fixture(scope="module")
def alphabets(tokenizer):
    return LabelAlphabets(tokenizer)


def test_format_switches_to_indexed_past_ten_questions():
    assert answer_format(10) == LINES and answer_format(11) == INDEXED
    assert answer_text([("q1", "yes"), ("q2", "A")], LINES) == "q1: yes\nq2: A"
    assert answer_text([("q1", "yes"), ("q2", "A")], INDEXED) == "q1yes q2A"


@pytest.mark.parametrize("fmt", [LINES, INDEXED])
def test_slots_change_exactly_one_token_per_label(templates, tokenizer, fmt):
    items = [
        TemplateItem("urgent", "q1", ("yes", "no")),
        TemplateItem("bucket", "q2", ("A", "B", "C")),
        TemplateItem("tone", "q3", ("1", "2", "3")),
    ]
    template = templates.resolve((), "", fmt, items)
    assert list(template.ids) == tokenizer.encode(answer_text([("q1", "yes"), ("q2", "A"), ("q3", "1")], fmt))
    for item, slot, family in zip(items, template.slots, template.label_ids):
        assert len(family) == len(item.labels) == len(set(family))
        for label, token in zip(item.labels, family):
            changed = [(i.model_id, label if i is item else i.labels[0]) for i in items]
            ids = tokenizer.encode(answer_text(changed, fmt))
            assert ids[slot] == token
            assert [t for i, t in enumerate(ids) if i != slot] == [t for i, t in enumerate(template.ids) if i != slot]


def test_head_and_lead_shift_the_slots(templates):
    items = [TemplateItem("a", "q1", ("yes", "no"))]
    plain = templates.resolve((), "", LINES, items)
    shifted = templates.resolve((7, 8, 9), "\n", LINES, items)
    assert shifted.ids[:3] == (7, 8, 9)
    assert shifted.slots[0] > plain.slots[0] + 2
    assert shifted.rows == len(shifted.ids) + 1


def test_alphabets_reach_jevs_limits(alphabets):
    for fmt in (LINES, INDEXED):
        letters = alphabets.labels(LETTER_LABELS, 255, fmt)
        assert len(letters) == 255 and letters[:26] == LETTER_LABELS[:26]
        assert alphabets.labels(DIGIT_LABELS, 9, fmt) == DIGIT_LABELS


def test_255_options_resolve_to_distinct_single_tokens(templates, alphabets):
    labels = alphabets.labels(LETTER_LABELS, 255, LINES)
    template = templates.resolve((), "", LINES, [TemplateItem("big", "q1", labels)])
    assert len(set(template.label_ids[0])) == 255


def test_a_multi_token_label_is_refused_naming_the_question(templates):
    with pytest.raises(RequestError) as info:
        templates.resolve((), "", LINES, [TemplateItem("odd", "q1", ("yes", "maybe not"))])
    assert "question 'odd'" in info.value.message and "not a single token" in info.value.message


def test_rows_counts_head_answer_and_end_token(templates, tokenizer):
    items = [TemplateItem("a", "q1", ("yes", "no"))]
    assert templates.rows(4, "", LINES, items) == 4 + len(tokenizer.encode("q1: yes")) + 1
