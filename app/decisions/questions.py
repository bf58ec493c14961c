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
from typing import Annotated, Any, Container, NamedTuple, Sequence

from annotated_types import Len
from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, FailFast, model_validator
from pydantic_core import PydanticCustomError

# Jev's documented limits, with its exact 400 messages.
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


def _description(value: Any) -> str | None:
    """A description as the prompt shows it; none for null or blank text."""
    if value is None:
        return None
    return render_content(value) or None


def at_most_entries(value: Any, limit: int) -> Any:
    """Refuse a map or list of more than `limit` entries before any entry is read (pydantic reads
    every entry of a dict before its length), so a count past a limit is always the error."""
    if isinstance(value, (dict, list)) and len(value) > limit:
        raise PydanticCustomError(
            "too_long", "at most {max_length} entries, got {actual_length}",
            {"max_length": limit, "actual_length": len(value)},
        )
    return value


def count_first(limit: int) -> BeforeValidator:
    return BeforeValidator(lambda value: at_most_entries(value, limit))


def refuse_unknown_keys(value: Any, known: Container[str]) -> None:
    """Refuse the first key `known` lacks, and only it: pydantic would report every unknown key, and
    a body may hold a million of them. The key goes into the error's loc (ctx `at`)."""
    if isinstance(value, dict):
        for key in value:
            if key not in known:
                raise PydanticCustomError("extra_forbidden", "Extra inputs are not permitted", {"at": (key,)})


def _option_names(value: Any) -> Any:
    # The first blank name only, for the same reason.
    if isinstance(value, dict):
        for name in value:
            if isinstance(name, str) and not name.strip():
                raise PydanticCustomError("value_error", "option names must not be empty", {"at": (name,)})
    return value


def _level(value: Any) -> Any:
    if value is None or (isinstance(value, str) and not value.strip()):
        raise PydanticCustomError("value_error", "a level must not be empty")
    return value


class NoulCriteria(BaseModel):
    """A noul question's optional descriptions of its two answers (any JSON content)."""

    model_config = ConfigDict(extra="forbid")
    true: Any = None
    false: Any = None

    @model_validator(mode="before")
    @classmethod
    def _known_keys(cls, value: Any) -> Any:
        refuse_unknown_keys(value, cls.model_fields)
        return value


# Option names are kept byte for byte; a name of nothing but whitespace is refused.
ChoiceCriteria = Annotated[
    # (pydantic runs the last before-validator first: the count comes before the names)
    dict[str, Any], BeforeValidator(_option_names), count_first(MAX_CHOICE_OPTIONS), Len(min_length=1)
]
# Levels lowest first: any JSON content but null or a blank string.
ScoreCriteria = Annotated[list[Annotated[Any, AfterValidator(_level)]], FailFast(), count_first(MAX_SCORE_LEVELS)]


class Alternative(NamedTuple):
    """One answer a question allows. A named tuple: a 255-option question builds 255 of them, and a
    frozen dataclass costs several times more to build."""

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

    def alternatives(self, criteria: Any) -> tuple[Alternative, ...]:
        """The alternatives of criteria already validated by this type's criteria model."""
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

    def alternatives(self, criteria: NoulCriteria | None) -> tuple[Alternative, ...]:
        criteria = criteria or NoulCriteria()
        return (Alternative("yes", _description(criteria.true)), Alternative("no", _description(criteria.false)))

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

    def alternatives(self, criteria: dict[str, Any]) -> tuple[Alternative, ...]:
        # The hot loop of a big request (256 x 255 options): tuple.__new__ builds each named tuple
        # without the Python-level __new__ NamedTuple generates, about a third cheaper.
        new = tuple.__new__
        return tuple([new(Alternative, (name, _description(text), None)) for name, text in criteria.items()])

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

    def alternatives(self, criteria: list[Any]) -> tuple[Alternative, ...]:
        return tuple(Alternative(render_content(level), None, legend=level) for level in criteria)

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
