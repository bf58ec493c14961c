"""The question sheet (system prompt) and the state as the model reads them.

Wording follows the reference server, since its prompts are what the reads were tuned on; the
caller's ids are replaced by positional ids (q1, q2, ...).
"""

from __future__ import annotations

from typing import Sequence

from app.decisions.questions import Question
from app.decisions.template import REPLY_INSTRUCTION
from app.engine.base import ChatTokenizer

# The version of what a read's label distributions depend on besides the model: the question sheet's
# wording, the answer formats and the labels (docs/design.md §3.1-§3.3). A fitted calibration records
# it, and a server refuses a calibration of another version: bump it when any of them changes.
TEMPLATE_VERSION = "1"

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


class ChatPrompts:
    """Prompt token ids for reads and thoughts, over the checkpoint's chat template.

    A read with no thought ends its prompt with the empty thought block (`<|channel>thought\\n
    <channel|>`, the "scaffold") or, with `thought_in_prompt` off, opens its canvas with it, as the
    reference did. A thinking prompt ends with an open thought channel."""

    def __init__(self, tokenizer: ChatTokenizer, thought_in_prompt: bool) -> None:
        self.tokenizer = tokenizer
        self.thought_in_prompt = thought_in_prompt
        self.opening = tuple(tokenizer.thought_open)
        self.closing = tuple(tokenizer.thought_close)
        self.scaffold = self.opening + self.closing

    @property
    def head_length(self) -> int:
        """Canvas rows the scaffold takes when it opens the canvas."""
        return 0 if self.thought_in_prompt else len(self.scaffold)

    def with_scaffold(self, system: str, user: str, images: int) -> tuple[int, ...]:
        """The chat prompt ending with the empty thought block."""
        ids = tuple(self.tokenizer.render_chat(system, user, images, thinking=False))
        return ids if ids[-len(self.scaffold):] == self.scaffold else ids + self.scaffold

    def plain(self, system: str, user: str, images: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(prompt ids, canvas head) for a read with no thought."""
        ids = self.with_scaffold(system, user, images)
        if self.thought_in_prompt:
            return ids, ()
        return ids[: -len(self.scaffold)], self.scaffold

    def thinking(self, system: str, user: str, images: int) -> tuple[int, ...]:
        """The prompt with thinking on, ending with an open thought channel."""
        ids = tuple(self.tokenizer.render_chat(system, user, images, thinking=True))
        return ids if ids[-len(self.opening):] == self.opening else ids + self.opening

    def thinking_open(self, system: str, user: str, images: int) -> tuple[int, ...]:
        """The thinking prompt as the template renders it (an image read seeds its thought into the
        canvas, so the prompt stops where the model's turn starts)."""
        return tuple(self.tokenizer.render_chat(system, user, images, thinking=True))

    def stop_ids(self) -> tuple[int, ...]:
        """Where a thought ends: the thought channel closes, or the turn does."""
        return self.closing + (self.tokenizer.turn_close_id,)
