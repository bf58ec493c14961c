"""Question types: their alternatives, how the prompt lists them, which labels the model writes,
and the Jev answer built from a label distribution.

The caller's question ids never reach the model: a question is `q<position>` in the prompt and on
the canvas (Jev documents that ids are keys only; renaming one must not change any answer).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from string import ascii_lowercase, ascii_uppercase
from typing import Any, Sequence

from app.decisions.errors import RequestError

# Jev's documented limits (spec/jev-contract.md §1.3), with its exact 400 messages.
MAX_CHOICE_OPTIONS = 255
MAX_SCORE_LEVELS = 10
TOO_MANY_CHOICES = "Too many choices. Must have at most 255 choices."
TOO_MANY_LEVELS = "Too many score levels. Must have at most 10 levels."

CONFIDENCE_MODES = ("djev", "jev")


def render_content(value: Any) -> str:
    """Jev content (a string, object or array) as the model reads it: strings trimmed, the rest as
    JSON text with non-ASCII kept."""
    if isinstance(value, str):
        return value.strip()
    return json.dumps(value, ensure_ascii=False)


@dataclass(frozen=True)
class Alternative:
    name: str  # what answers, probabilities and ask_if use
    description: str | None  # shown beside the label in the prompt
    legend: Any = None  # score levels: the level exactly as sent, echoed in `legend`


@dataclass(frozen=True)
class Question:
    qid: str  # the caller's key: answers come back under it, the model never sees it
    position: int  # 1-based order in the request
    kind: "QuestionType"
    instructions: str
    alternatives: tuple[Alternative, ...]
    depends_on: tuple[str, ...] = ()  # depends_on plus the ask_if keys, de-duplicated, in order
    ask_if: tuple[tuple[str, tuple[str, ...]], ...] = ()
    alone: bool = False

    @property
    def model_id(self) -> str:
        return f"q{self.position}"

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(alt.name for alt in self.alternatives)


class QuestionType:
    """One kind of question. Subclasses say how criteria become alternatives and how a
    distribution over them becomes a Jev answer."""

    name: str = ""

    def alternatives(self, criteria: Any, loc: tuple) -> tuple[Alternative, ...]:
        raise NotImplementedError

    def label_candidates(self, count: int) -> tuple[str, ...]:
        """The strings the model may write in the slot, most preferred first."""
        raise NotImplementedError

    def prompt_line(self, label: str, alternative: Alternative) -> str:
        if alternative.description:
            return f"  {label}: {alternative.name} ({alternative.description})"
        return f"  {label}: {alternative.name}"

    def answer(self, question: Question, probs: Sequence[float], confidence: str) -> dict:
        raise NotImplementedError

    def internal_answer(self, question: Question, label: str, probs: Sequence[float], confidence: str) -> dict:
        """The reference's own answer shape (the chat form's reply): the label the model wrote, the
        confidence, probabilities by name, and the type's own field."""
        top = top_index(probs)
        out = {
            "type": self.name,
            "label": label,
            "confidence": choice_confidence(probs, confidence) if self.name != "score" else score_confidence(probs, confidence),
            "probabilities": {alt.name: p for alt, p in zip(question.alternatives, probs)},
        }
        if self.name == "noul":
            out["noul"] = probs[0]
        elif self.name == "choice":
            out["choice"] = question.alternatives[top].name
        else:
            out["score"] = sum((i + 1) * p for i, p in enumerate(probs))  # 1-based, as the reference's
            out["level"] = question.alternatives[top].name
        return out


def _letters() -> tuple[str, ...]:
    upper = tuple(ascii_uppercase)
    pairs = tuple(a + b for a in ascii_uppercase for b in ascii_uppercase)
    return upper + tuple(ascii_lowercase) + pairs


LETTER_LABELS = _letters()
DIGIT_LABELS = tuple(str(d) for d in range(1, 10))


def top_index(probs: Sequence[float]) -> int:
    """The most probable alternative; ties go to the earliest."""
    best = 0
    for index, p in enumerate(probs):
        if p > probs[best]:
            best = index
    return best


def choice_confidence(probs: Sequence[float], mode: str) -> float:
    """djev: the chosen option's probability. jev: Jev's concentration, (n·p_max − 1)/(n − 1)."""
    p_max = max(probs)
    if mode != "jev":
        return p_max
    n = len(probs)
    if n == 1:
        return 1.0
    return min(1.0, max(0.0, (n * p_max - 1.0) / (n - 1.0)))


def score_confidence(probs: Sequence[float], mode: str) -> float:
    """djev: the most probable level's probability. jev: 1 − D/U_n, where D is the expected
    distance from the top level and U_n = ⌊n²/4⌋/n is D for a uniform distribution."""
    top = top_index(probs)
    if mode != "jev":
        return probs[top]
    n = len(probs)
    uniform_distance = (n * n // 4) / n
    if uniform_distance == 0:
        return 1.0
    distance = sum(p * abs(i - top) for i, p in enumerate(probs))
    return max(0.0, 1.0 - distance / uniform_distance)


class Noul(QuestionType):
    """Yes or no. `noul` is P(yes); Jev's noul answer carries nothing else."""

    name = "noul"

    def alternatives(self, criteria: Any, loc: tuple) -> tuple[Alternative, ...]:
        if criteria is None:
            return (Alternative("yes", None), Alternative("no", None))
        qid = loc[1] if len(loc) > 1 else ""
        if not isinstance(criteria, dict):
            raise RequestError(
                f"question '{qid}': noul criteria must be an object with true and false", loc + ("criteria",)
            )
        extra = [key for key in criteria if key not in ("true", "false")]
        if extra:
            raise RequestError(
                f"question '{qid}': noul criteria take only true and false, not '{extra[0]}'",
                loc + ("criteria", extra[0]),
            )
        return tuple(
            Alternative(name, None if criteria.get(key) is None else render_content(criteria[key]) or None)
            for name, key in (("yes", "true"), ("no", "false"))
        )

    def label_candidates(self, count: int) -> tuple[str, ...]:
        return ("yes", "no")

    def prompt_line(self, label: str, alternative: Alternative) -> str:
        if alternative.description:
            return f"  {label}: {alternative.description}"
        return f"  {label}"

    def answer(self, question: Question, probs: Sequence[float], confidence: str) -> dict:
        return {"type": "noul", "noul": probs[0]}


class Choice(QuestionType):
    """One of several named options; option order is kept."""

    name = "choice"

    def alternatives(self, criteria: Any, loc: tuple) -> tuple[Alternative, ...]:
        qid = loc[1] if len(loc) > 1 else ""
        if not isinstance(criteria, dict) or not criteria:
            raise RequestError(
                f"question '{qid}': choice criteria must map option names to descriptions", loc + ("criteria",)
            )
        if len(criteria) > MAX_CHOICE_OPTIONS:
            raise RequestError(TOO_MANY_CHOICES, loc + ("criteria",), status=400, jev_detail=TOO_MANY_CHOICES)
        options = []
        for name, description in criteria.items():
            if not name.strip():
                raise RequestError(f"question '{qid}': option names must not be empty", loc + ("criteria", name))
            text = None if description is None else render_content(description) or None
            options.append(Alternative(name, text))
        return tuple(options)

    def label_candidates(self, count: int) -> tuple[str, ...]:
        return LETTER_LABELS

    def answer(self, question: Question, probs: Sequence[float], confidence: str) -> dict:
        top = top_index(probs)
        return {
            "type": "choice",
            "choice": question.alternatives[top].name,
            "probabilities": {alt.name: p for alt, p in zip(question.alternatives, probs)},
            "confidence": choice_confidence(probs, confidence),
        }


class Score(QuestionType):
    """A level on an ordered scale, lowest first. `score` is the expected 0-based level."""

    name = "score"

    def alternatives(self, criteria: Any, loc: tuple) -> tuple[Alternative, ...]:
        qid = loc[1] if len(loc) > 1 else ""
        if not isinstance(criteria, list):
            raise RequestError(
                f"question '{qid}': score criteria must be an ordered list of levels", loc + ("criteria",)
            )
        if len(criteria) > MAX_SCORE_LEVELS:
            raise RequestError(TOO_MANY_LEVELS, loc + ("criteria",), status=400, jev_detail=TOO_MANY_LEVELS)
        levels = []
        for index, level in enumerate(criteria):
            if level is None or (isinstance(level, str) and not level.strip()):
                raise RequestError(f"question '{qid}': level {index} must not be empty", loc + ("criteria", index))
            levels.append(Alternative(render_content(level), None, legend=level))
        return tuple(levels)

    def label_candidates(self, count: int) -> tuple[str, ...]:
        # Digits read as an ordered scale; past nine levels, letters (the reference's choice).
        return DIGIT_LABELS if count <= len(DIGIT_LABELS) else LETTER_LABELS

    def answer(self, question: Question, probs: Sequence[float], confidence: str) -> dict:
        return {
            "type": "score",
            "score": sum(i * p for i, p in enumerate(probs)),
            "legend": {str(i): alt.legend for i, alt in enumerate(question.alternatives)},
            "probabilities": {str(i): p for i, p in enumerate(probs)},
            "confidence": score_confidence(probs, confidence),
        }


NOUL, CHOICE, SCORE = Noul(), Choice(), Score()
QUESTION_TYPES: dict[str, QuestionType] = {"noul": NOUL, "choice": CHOICE, "score": SCORE}


def softmax(logprobs: Sequence[float]) -> list[float]:
    """Renormalise label log-probabilities over the labels only."""
    peak = max(logprobs)
    weights = [math.exp(lp - peak) for lp in logprobs]
    total = sum(weights)
    return [w / total for w in weights]


def entropy(probs: Sequence[float]) -> float:
    """Entropy in nats of a distribution (the renormalised label distribution for `auto`)."""
    return -sum(p * math.log(p) for p in probs if p > 0.0)
