"""The question sheet (system prompt) and the state as the model reads them.

Wording follows the reference server, since its prompts are what the reads were tuned on; the
caller's ids are replaced by positional ids (q1, q2, ...).
"""

from __future__ import annotations

from typing import Sequence

from app.decisions.questions import Question
from app.decisions.template import REPLY_INSTRUCTION

HEADER = (
    "Answer a fixed set of questions about the state the user provides. Each question lists its "
    "allowed answers; reply with exactly one label per question."
)
CHUNKED_SENTENCE = " A reply may cover only some of the questions; answer every line that is present."
ANSWERS_SO_FAR = "\n\nAnswers so far:\n"


def question_block(question: Question, labels: Sequence[str]) -> str:
    lines = [f"Question {question.model_id}: {question.instructions}"]
    lines.extend(question.kind.prompt_line(label, alt) for label, alt in zip(labels, question.alternatives))
    return "\n".join(lines)


def system_text(
    questions: Sequence[Question],
    labels: dict[str, tuple[str, ...]],
    fmt: str,
    instructions: str | None,
    chunked: bool,
) -> str:
    """The question sheet. `instructions` go ahead of the questions, so requests that share them
    share a prompt prefix; `chunked` tells the model a reply may cover only part of the list."""
    parts = [HEADER]
    if instructions:
        parts.append(instructions)
    parts.extend(question_block(q, labels[q.qid]) for q in questions)
    parts.append(REPLY_INSTRUCTION[fmt] + (CHUNKED_SENTENCE if chunked else ""))
    return "\n\n".join(parts)


def restated_state(state_text: str, earlier: Sequence[str]) -> str:
    """An image state's text with the earlier stages' answers restated (image prompts cannot be
    continued token by token, so later stages read afresh with the answers in the state)."""
    return state_text + ANSWERS_SO_FAR + "\n".join(earlier)
