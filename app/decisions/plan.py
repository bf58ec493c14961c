"""Which questions are read together: stages by dependency, gating by `ask_if`, groups by canvas.

A stage is every still-pending question whose dependencies are answered, in declaration order.
Within a stage, questions are packed into groups (one canvas each) until a group would pass the row
limit; an `alone` question gets a group of its own; `isolate` makes every question alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

from app.decisions.questions import Question


def stages(questions: Sequence[Question]) -> list[list[Question]]:
    """Layer the questions by dependency. A dependency outside `questions` counts as answered.

    The questions are a validated decision's (or some of them): `parse_decision` refuses a cycle
    (app/decisions/models.py), and a part of an acyclic graph is acyclic, so every pass layers at
    least one question."""
    present = {q.qid for q in questions}
    done: set[str] = set()
    pending = list(questions)
    layers: list[list[Question]] = []
    while pending:
        layer = [q for q in pending if all(dep in done or dep not in present for dep in q.depends_on)]
        if not layer:  # unreachable for validated questions; never loop forever on others
            raise RuntimeError("a dependency cycle: questions must come from parse_decision, which refuses them")
        layers.append(layer)
        done.update(q.qid for q in layer)
        pending = [q for q in pending if q.qid not in done]
    return layers


@dataclass(frozen=True)
class Skip:
    """Why an `ask_if` question was not asked."""

    because: str  # the dependency's id
    was: str | None  # the dependency's answer name; None when it was skipped itself
    wanted: tuple[str, ...]

    def as_json(self) -> dict:
        return {"because": self.because, "was": self.was, "wanted": list(self.wanted)}


def gate(question: Question, answer_names: Mapping[str, str | None]) -> Skip | None:
    """The first `ask_if` entry whose dependency's answer is not among the wanted ones skips the
    question. A skipped dependency skips everything gated on it."""
    for dependency, wanted in question.ask_if:
        was = answer_names.get(dependency)
        if was is None or was not in wanted:
            return Skip(dependency, was, wanted)
    return None


def groups(
    questions: Sequence[Question],
    rows: Callable[[Sequence[Question]], int],
    limit: int,
    isolate: bool = False,
) -> list[list[Question]]:
    """Split a stage into canvases, in order. A single question is always accepted into an empty
    group; whether it fits the canvas is the template's business."""
    out: list[list[Question]] = []
    current: list[Question] = []
    for question in questions:
        if isolate or question.alone:
            if current:
                out.append(current)
            out.append([question])
            current = []
            continue
        if current and rows(current + [question]) > limit:
            out.append(current)
            current = []
        current.append(question)
    if current:
        out.append(current)
    return out


@dataclass(frozen=True)
class Plan:
    """What a decision will read, known before anything is read: its answer format and labels, its
    stages, and what it may cost at most (admission counts this)."""

    fmt: str
    labels: dict[str, tuple[str, ...]]
    stages: list[list[Question]]
    chained: bool  # later reads continue earlier answers (dependencies or `sequential`)
    canvases: int  # canvases read at most (every group of every stage, every draw)
    thought_tokens: int  # thought tokens written at most
    small: bool = False  # its synchronous pieces are bounded and cheap: run them inline

    @property
    def cost(self) -> int:
        return self.canvases + self.thought_tokens
