"""A decision's outcome: each asked question's answer, usage, and the diagnostics, assembled from the
groups it read. The Jev and chat-form bodies are built from it at the web edge (app/web/answers.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from app.decisions.debias import PRIOR_DRAWS, Cost, cost_json
from app.decisions.estimate import QuestionEstimate
from app.decisions.plan import Plan, Skip
from app.decisions.questions import Question
from app.decisions.request import Decision


@dataclass(frozen=True)
class GroupResult:
    """One canvas's reads: its questions' estimates and what diagnostics report of it."""

    questions: tuple[Question, ...]
    index: int  # order of scheduling over the whole decision
    estimates: dict[str, QuestionEstimate]
    tops: list[dict]  # per draw: {qid: [name, p, entropy]}
    policy: dict  # the samples policy as applied
    draws: int
    rows: int  # canvas rows read (template + `<turn|>`)
    prompt_tokens: int
    thought: dict | list | None = None  # under `rotate`, one per rotation
    thought_tokens: int = 0
    cost: Cost | None = None  # with `debias`: the group's reads of the state and its prior reads

    def samples(self) -> dict:
        return {"n": self.draws, "tops": self.tops, "policy": self.policy}


@dataclass(frozen=True)
class Outcome:
    answers: dict[str, dict | None]  # the asked questions, request order; None = skipped by ask_if
    internal_answers: dict[str, dict | None]  # the same in the reference's own shape (the chat form)
    estimates: dict[str, QuestionEstimate | None]
    input_tokens: int
    output_tokens: int
    diagnostics: dict
    summary: str  # one log line
    reads: int  # canvases read in all (every draw of every group)


def assemble(
    decision: Decision,
    plan: Plan,
    groups: Sequence[GroupResult],
    skipped: dict[str, Skip],
    stages_read: list[list[str]],
    chain_thought: dict | list | None,
    chain_thought_tokens: int,
    engine: str,
    seconds: float,
    calibration: dict | None = None,
    engine_seconds: float = 0.0,
) -> Outcome:
    by_question = {q.qid: g for g in groups for q in g.questions}
    asked = decision.asked()
    answers: dict[str, dict | None] = {}
    internal: dict[str, dict | None] = {}
    estimates: dict[str, QuestionEstimate | None] = {}
    for question in asked:
        group = by_question.get(question.qid)
        if group is None:
            answers[question.qid] = internal[question.qid] = estimates[question.qid] = None
            continue
        found = group.estimates[question.qid]
        estimates[question.qid] = found
        answers[question.qid] = question.kind.answer(question, found.probs, decision.confidence)
        label = plan.labels[question.qid][found.top]
        internal_answer = question.kind.internal_answer(question, label, found.probs, decision.confidence)
        if found.stderr is not None:
            internal_answer.update(stderr=found.stderr, agreement=found.agreement)
        internal[question.qid] = internal_answer

    prompt_tokens = [g.prompt_tokens for g in groups]
    output_tokens = sum(g.rows + g.thought_tokens for g in groups) + chain_thought_tokens
    thoughts = [g.thought for g in groups if g.thought is not None]
    if chain_thought is not None:
        thought: dict | list | None = chain_thought
    elif len(groups) == 1:
        thought = groups[0].thought
    else:
        thought = thoughts or None
    if len(groups) == 1 and not skipped:
        samples = groups[0].samples()
    else:
        samples = {
            "n": [g.draws for g in groups],
            "tops": [g.tops for g in groups],
            "policy": [g.policy for g in groups],
        }
    total_ms = round(seconds * 1000, 1)
    reads = sum(g.draws for g in groups) + PRIOR_DRAWS * sum(g.cost.prior_reads for g in groups if g.cost is not None)
    diagnostics = {
        "steps": decision.steps,
        "stages": stages_read,
        "skipped": {qid: skip.as_json() for qid, skip in skipped.items()},
        "chunks": [[q.qid for q in g.questions] for g in groups],
        "chunk_prompt": "full" if plan.chained else decision.chunk_prompt,
        "sequential": decision.sequential,
        "conditioning": None if not plan.chained else ("restated" if decision.images else "prefill"),
        "thought": thought,
        "samples": samples,
        "timing": {"total_ms": total_ms, "reads": reads},
        "prompt_tokens": max(prompt_tokens) if prompt_tokens else None,
        "questions": {qid: e.diagnostics() for g in groups for qid, e in g.estimates.items()},
        "format": plan.fmt,
        "engine": engine,
        "calibration": calibration,
    }
    if not decision.debias.off:
        diagnostics["debias"] = cost_json(decision.debias.mode, [g.cost for g in groups if g.cost is not None])
    if decision.ask is not None:
        diagnostics["not_asked"] = [q.qid for q in decision.questions if q.qid not in set(decision.ask)]
    if decision.ignored:
        diagnostics["ignored"] = list(decision.ignored)
    parts = [f"{q.qid}={'skipped' if by_question.get(q.qid) is None else _name(q, by_question)}" for q in asked]
    return Outcome(
        answers=answers,
        internal_answers=internal,
        estimates=estimates,
        input_tokens=max(prompt_tokens) if prompt_tokens else 0,
        output_tokens=output_tokens,
        diagnostics=diagnostics,
        # the log line's time, and the longest a group waited for its reads: a decision slow outside
        # the engine (planning, templates, the event loop) shows as the gap between the two
        summary=f"{' '.join(parts)} reads={reads} {total_ms:.0f}ms (reads {engine_seconds * 1000:.0f}ms)",
        reads=reads,
    )


def _name(question: Question, by_question: dict[str, GroupResult]) -> str:
    return question.alternatives[by_question[question.qid].estimates[question.qid].top].name
