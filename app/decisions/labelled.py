"""Labelled data for `djev calibrate` and `djev eval`, pure: the JSONL line format, the expected
answer of a question as an alternative's index, the held-out split, the permuted requests of the
order-robustness check, and an answer's distribution read back from Jev's answer shape.

A line is one JSON object: `{"request": <a Jev /v1/systemone body>, "expected": {<question id>:
<answer>, ...}}`. An answer is, for a noul, true/false or "yes"/"no"; for a choice, the option's
name; for a score, the 0-based level index or the level as sent (its text). Questions the line has
no answer for are asked and not scored; questions of a kind this server does not know are taken out
of the request and counted, not fatal.
"""

from __future__ import annotations

import copy
import hashlib
import json
import random
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from app.decisions.questions import QUESTION_TYPES, Question


@dataclass(frozen=True)
class Line:
    number: int  # 1-based, in the file
    request: dict  # the body, questions of unknown kinds taken out
    expected: dict[str, Any]  # question id -> the answer as given (ids the request asks)
    held_out: bool  # in the held-out share (a hash of the line's text)


@dataclass
class DataReport:
    """What reading the data found besides usable lines, each problem naming its line."""

    lines: int = 0
    malformed: list[str] = field(default_factory=list)  # "line 3: not JSON (...)"
    unknown_kinds: dict[str, int] = field(default_factory=dict)  # kind -> questions taken out
    problems: list[str] = field(default_factory=list)  # refused requests, unknown ids, bad answers

    def as_json(self) -> dict:
        return {"lines": self.lines, "malformed": self.malformed, "unknown_kinds": self.unknown_kinds,
                "problems": self.problems}


def held_out(text: str, share: float) -> bool:
    """Whether a line is held out: the first 8 bytes of its text's SHA-256 as a fraction below
    `share` (the same line is on the same side on every run and machine)."""
    value = int.from_bytes(hashlib.sha256(text.strip().encode()).digest()[:8], "big") / 2**64
    return value < share


def parse_lines(texts: Iterable[str], held_out_share: float, report: DataReport) -> list[Line]:
    """The usable lines of a JSONL text; blank lines are skipped, the rest that are not a line of
    the format go to `report.malformed` by number."""
    lines = []
    for number, text in enumerate(texts, 1):
        if not text.strip():
            continue
        report.lines += 1
        try:
            data = json.loads(text)
        except ValueError as exc:
            report.malformed.append(f"line {number}: not JSON ({exc})")
            continue
        problem = _shape_problem(data)
        if problem:
            report.malformed.append(f"line {number}: {problem}")
            continue
        request = copy.deepcopy(data["request"])
        questions = request["questions"]
        for qid in list(questions):
            kind = questions[qid].get("type") if isinstance(questions[qid], dict) else None
            if isinstance(kind, str) and kind not in QUESTION_TYPES:
                report.unknown_kinds[kind] = report.unknown_kinds.get(kind, 0) + 1
                del questions[qid]
        expected = {}
        for qid, answer in data["expected"].items():
            if qid in questions:
                expected[qid] = answer
            elif qid in data["request"]["questions"]:
                continue  # a question of an unknown kind, counted above
            else:
                report.problems.append(f"line {number}: expected names {qid!r}, which the request does not ask")
        if not questions:
            report.problems.append(f"line {number}: no question of a known kind")
            continue
        lines.append(Line(number, request, expected, held_out(text, held_out_share)))
    return lines


def _shape_problem(data: Any) -> str | None:
    if not isinstance(data, dict):
        return "a line must be an object {\"request\": ..., \"expected\": ...}"
    unknown = [key for key in data if key not in ("request", "expected")]
    if unknown:
        return f"unknown key {unknown[0]!r} (a line has request and expected)"
    request = data.get("request")
    if not isinstance(request, dict) or not isinstance(request.get("questions"), dict):
        return "request must be a Jev body with a questions object"
    if not isinstance(data.get("expected"), dict):
        return "expected must be an object of question id -> answer"
    return None


def label_index(question: Question, answer: Any) -> int:
    """The expected answer as the index of one of the question's alternatives (request order); a
    ValueError saying what is wrong with it."""
    kind = question.kind.name
    names = question.names
    if kind == "noul":
        if answer is True or answer == "yes":
            return names.index("yes")
        if answer is False or answer == "no":
            return names.index("no")
        raise ValueError(f"expected {answer!r} for a noul: true, false, \"yes\" or \"no\"")
    if kind == "choice":
        if isinstance(answer, str) and answer in names:
            return names.index(answer)
        raise ValueError(f"expected {answer!r} is not one of the options")
    if isinstance(answer, int) and not isinstance(answer, bool):
        if 0 <= answer < len(names):
            return answer
        raise ValueError(f"expected level {answer} is not one of the {len(names)} levels (0-based)")
    for index, alternative in enumerate(question.alternatives):
        if answer == alternative.legend or (isinstance(answer, str) and answer.strip() == alternative.name):
            return index
    raise ValueError(f"expected {answer!r} is neither a 0-based level index nor a level")


def shown_index(shown: Question, question: Question, label: int) -> int:
    """A label (index in request order) as its index in the order the question was shown in."""
    if shown.names == question.names:
        return label
    return shown.names.index(question.names[label])


def permuted(request: dict, seed: int, number: int) -> dict:
    """The request with every choice question's options in another order, shuffled with a fixed
    seed per line and question (moved by one where the shuffle left them as they were)."""
    out = copy.deepcopy(request)
    for qid, question in out["questions"].items():
        if not isinstance(question, dict) or question.get("type") != "choice":
            continue
        criteria = question.get("criteria")
        if not isinstance(criteria, dict) or len(criteria) < 2:
            continue
        names = list(criteria)
        order = names[:]
        random.Random(f"{seed}:{number}:{qid}").shuffle(order)
        if order == names:
            order = names[1:] + names[:1]
        question["criteria"] = {name: criteria[name] for name in order}
    return out


def answer_distribution(question: Question, answer: Any) -> list[float] | None:
    """A Jev answer's distribution over the question's alternatives in request order (None when
    the answer is not of the question's shape)."""
    if not isinstance(answer, dict):
        return None
    try:
        if question.kind.name == "noul":
            p = float(answer["noul"])
            return [p if name == "yes" else 1.0 - p for name in question.names]
        probabilities = answer["probabilities"]
        if question.kind.name == "choice":
            return [float(probabilities[name]) for name in question.names]
        return [float(probabilities[str(i)]) for i in range(len(question.alternatives))]
    except (KeyError, TypeError, ValueError):
        return None


def top_name(question: Question, answer: Any) -> str | None:
    """The chosen alternative's name of an answer (choice: `choice`; otherwise its most probable)."""
    if isinstance(answer, dict) and question.kind.name == "choice" and isinstance(answer.get("choice"), str):
        return answer["choice"]
    probs = answer_distribution(question, answer)
    if probs is None:
        return None
    return question.names[max(range(len(probs)), key=lambda k: (probs[k], -k))]


def split(lines: Sequence[Line]) -> tuple[list[Line], list[Line]]:
    """(training, held-out); with either side empty, both are every line (too little data to split)."""
    train = [line for line in lines if not line.held_out]
    test = [line for line in lines if line.held_out]
    if not train or not test:
        return list(lines), list(lines)
    return train, test
