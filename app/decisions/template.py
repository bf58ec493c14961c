"""Answer templates: the answer text with every question at a label, tokenized, and the one token
position (the slot) where each question's label goes.

Two formats (the reference's): `lines` ("q1: yes" per line) up to ten questions, and the compact
`indexed` ("q1yes q2B ...", about 3 tokens a question) past ten. A label must be exactly one token
at its slot; every alternative of a question must change that one position and nothing else.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

from app.decisions.errors import RequestError
from app.engine.base import ChatTokenizer

LINES = "lines"
INDEXED = "indexed"
JOIN = {LINES: "\n", INDEXED: " "}
LINES_MAX_QUESTIONS = 10

REPLY_INSTRUCTION = {
    LINES: 'Reply with one line per question, in this order, formatted as "id: label".',
    INDEXED: (
        "Reply on one line with each question's id immediately followed by its label, "
        "separated by single spaces."
    ),
}


def answer_format(question_count: int) -> str:
    return LINES if question_count <= LINES_MAX_QUESTIONS else INDEXED


def answer_item(model_id: str, label: str, fmt: str) -> str:
    return f"{model_id}: {label}" if fmt == LINES else f"{model_id}{label}"


def answer_text(items: Sequence[tuple[str, str]], fmt: str) -> str:
    return JOIN[fmt].join(answer_item(model_id, label, fmt) for model_id, label in items)


@dataclass(frozen=True)
class TemplateItem:
    qid: str
    model_id: str
    labels: tuple[str, ...]


@dataclass(frozen=True)
class Template:
    """Head plus answer tokens. The canvas is these, then `<turn|>`, then padding."""

    ids: tuple[int, ...]
    slots: tuple[int, ...]  # canvas positions, in item order
    label_ids: tuple[tuple[int, ...], ...]

    @property
    def rows(self) -> int:
        return len(self.ids) + 1


@dataclass(frozen=True)
class _Body:
    ids: tuple[int, ...]
    slots: tuple[int, ...]
    label_ids: tuple[tuple[int, ...], ...]


class Templates:
    """Templates for one tokenizer: slots found once per answer text, in a bounded cache. Safe to use
    from several worker threads at once (the cache is guarded; tokenizing is the tokenizer's business)."""

    def __init__(self, tokenizer: ChatTokenizer, cache_size: int = 4096) -> None:
        self.tokenizer = tokenizer
        self.cache_size = cache_size
        self._bodies: OrderedDict[tuple, _Body] = OrderedDict()
        self._lock = threading.Lock()

    def rows(self, head_length: int, lead: str, fmt: str, items: Sequence[TemplateItem]) -> int:
        """Canvas rows a group needs (head + answer + end token), without resolving slots."""
        text = lead + answer_text([(item.model_id, item.labels[0]) for item in items], fmt)
        return head_length + len(self.tokenizer.encode(text)) + 1

    def resolve(self, head: Sequence[int], lead: str, fmt: str, items: Sequence[TemplateItem]) -> Template:
        body = self._body(lead, fmt, tuple(items))
        offset = len(head)
        return Template(
            ids=tuple(head) + body.ids,
            slots=tuple(slot + offset for slot in body.slots),
            label_ids=body.label_ids,
        )

    def _body(self, lead: str, fmt: str, items: tuple[TemplateItem, ...]) -> _Body:
        key = (lead, fmt, items)
        with self._lock:
            cached = self._bodies.get(key)
            if cached is not None:
                self._bodies.move_to_end(key)
                return cached
        body = self._find_slots_together(lead, fmt, items) or self._find_slots(lead, fmt, items)
        with self._lock:
            self._bodies[key] = body
            while len(self._bodies) > self.cache_size:
                self._bodies.popitem(last=False)
        return body

    def _find_slots_together(self, lead: str, fmt: str, items: tuple[TemplateItem, ...]) -> _Body | None:
        """Every question's slot and label ids from one encoding per label rank: the k-th encoding
        puts every question that has a k-th label at it, the rest at their first. Each must differ
        from the base exactly at those questions' slots, one token each. So a 255-option question
        costs 255 encodings of the template, not 255 per question. None when anything does not line
        up; `_find_slots` then checks question by question and names the one at fault."""
        encode = self.tokenizer.encode
        firsts = [(item.model_id, item.labels[0]) for item in items]
        base = tuple(encode(lead + answer_text(firsts, fmt)))
        slots: list[int | None] = [None] * len(items)
        families: list[list[int]] = [[] for _ in items]
        deepest = max(len(item.labels) for item in items)
        for rank in range(1, deepest):
            moved = [index for index, item in enumerate(items) if len(item.labels) > rank]
            changed = list(firsts)
            for index in moved:
                changed[index] = (items[index].model_id, items[index].labels[rank])
            ids = encode(lead + answer_text(changed, fmt))
            if len(ids) != len(base):
                return None
            diffs = [i for i, (a, b) in enumerate(zip(ids, base)) if a != b]
            if len(diffs) != len(moved):
                return None
            for index, position in zip(moved, diffs):  # both in text order
                if slots[index] is None:
                    slots[index] = position
                elif slots[index] != position:
                    return None
                families[index].append(ids[position])
        label_ids = []
        for index, slot in enumerate(slots):
            if slot is None:
                return None
            family = (base[slot], *families[index])
            if len(set(family)) != len(family):
                return None
            label_ids.append(family)
        return _Body(ids=base, slots=tuple(s for s in slots if s is not None), label_ids=tuple(label_ids))

    def _find_slots(self, lead: str, fmt: str, items: tuple[TemplateItem, ...]) -> _Body:
        """Question by question: each label of each question in an otherwise first-label template.
        Slower; its errors name the question whose labels do not fit."""
        encode = self.tokenizer.encode
        firsts = [(item.model_id, item.labels[0]) for item in items]
        base = tuple(encode(lead + answer_text(firsts, fmt)))
        slots: list[int] = []
        label_ids: list[tuple[int, ...]] = []
        for index, item in enumerate(items):
            slot: int | None = None
            ids_for_labels: list[int] = []
            for label in item.labels[1:]:
                changed = list(firsts)
                changed[index] = (item.model_id, label)
                ids = encode(lead + answer_text(changed, fmt))
                if len(ids) != len(base):
                    raise RequestError(
                        f"question '{item.qid}': label '{label}' is not a single token", ("questions", item.qid)
                    )
                diffs = [i for i, (a, b) in enumerate(zip(ids, base)) if a != b]
                if len(diffs) != 1 or (slot is not None and diffs[0] != slot):
                    raise RequestError(
                        f"question '{item.qid}': labels do not share one template slot", ("questions", item.qid)
                    )
                slot = diffs[0]
                ids_for_labels.append(ids[slot])
            if slot is None:  # a single-label question cannot be located; validation prevents it
                raise RequestError(f"question '{item.qid}': needs at least two alternatives", ("questions", item.qid))
            family = (base[slot], *ids_for_labels)
            if len(set(family)) != len(family):
                raise RequestError(
                    f"question '{item.qid}': two labels tokenize to the same id", ("questions", item.qid)
                )
            slots.append(slot)
            label_ids.append(family)
        return _Body(ids=base, slots=tuple(slots), label_ids=tuple(label_ids))
