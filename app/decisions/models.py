"""The `/v1/systemone` body as pydantic v2 models: Jev's fields, the reference's extensions, and the
rules each field obeys. `app.decisions.refusals` turns their errors into the messages this server
answers; `app.decisions.request` turns a validated body into a `Decision`.

Pydantic validates fields in the order they are declared and reports every error; the first one is
refused. So the declaration order is the order of the checks: the questions (each question, then
the dependencies between them), the extension keys, then `model`, the state and the images.

A `null` member, at the top or inside a question, is the member left out. Server-wide defaults
(seed, the auto policy, isolate, confidence, debias) stay `None` here and come from `Limits`, which
validation's context carries with the other limits that are settings.
"""

from __future__ import annotations

import base64
import binascii
import math
import re
from typing import Annotated, Any, Literal, LiteralString, Union

from annotated_types import Len
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    FailFast,
    Field,
    JsonValue,
    PrivateAttr,
    Strict,
    StrictBool,
    StrictStr,
    StringConstraints,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from app.decisions.debias import MODES as DEBIAS_MODES
from app.decisions.questions import (
    CONFIDENCE_MODES,
    QUESTION_TYPES,
    Alternative,
    ChoiceCriteria,
    NoulCriteria,
    Question,
    ScoreCriteria,
    at_most_entries,
    refuse_unknown_keys,
    render_content,
)

MIN_CHUNK_ROWS = 8
MAX_SEED = 2**63 - 1
EXTENSION: dict[str, JsonValue] = {"extension": True}  # marks the reference's keys beside Jev's (the chat form passes them on)


def refuse(message: str, *at: str | int, kind: LiteralString = "value_error") -> PydanticCustomError:
    """An error whose message is complete, for rules whose message names more than the field
    (another question, the allowed answers). `at` extends the field's loc."""
    return PydanticCustomError(kind, "{refusal}", {"refusal": message, "at": at})


def _drop_nulls(value: Any) -> Any:
    """A `null` member is the member left out."""
    if isinstance(value, dict):
        return {key: item for key, item in value.items() if item is not None}
    return value


def _context(info: ValidationInfo) -> dict[str, Any]:
    """The context `parse_decision` validates with: the limits and the images that come before."""
    if info.context is None:
        raise RuntimeError("DecisionBody is validated with a context: use parse_decision")
    return info.context


def _limit(info: ValidationInfo, name: str) -> int:
    return getattr(_context(info)["limits"], name)


def _at_most(limit_name: str) -> AfterValidator:
    """A bound that is a server setting (`Limits`), hence read from the context."""

    def check(value: int, info: ValidationInfo) -> int:
        bound = _limit(info, limit_name)
        if value > bound:
            raise PydanticCustomError("less_than_equal", "Input should be less than or equal to {le}", {"le": bound})
        return value

    return AfterValidator(check)


def _integral(value: Any) -> Any:
    # JSON does not tell 42.0 from 42; anything else goes to the strict integer check.
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    return value


# An integer: true, "42" and 2.5 are refused, 42.0 is 42.
Integer = Annotated[int, Strict(), BeforeValidator(_integral)]


# ----------------------------------------------------------------------------- questions


def _id_length(qid: str, info: ValidationInfo) -> str:
    limit = _limit(info, "max_id_length")
    if len(qid) > limit:
        raise PydanticCustomError("string_too_long", "String should have at most {max_length} characters",
                                  {"max_length": limit})
    return qid


def _ask_if_size(value: Any, info: ValidationInfo) -> Any:
    # Its keys are question ids: more than a request may hold is refused before any entry is read.
    return at_most_entries(value, _limit(info, "max_questions"))


QuestionId = Annotated[str, AfterValidator(_id_length)]
# Lists stop at their first bad entry (FailFast): a million bad entries are one error, not a million.
Ids = Annotated[tuple[StrictStr, ...], FailFast()]
Strings = Annotated[tuple[StrictStr, ...], FailFast(), Len(min_length=1)]  # a non-empty list of strings


class QuestionFields(BaseModel):
    """What every question type has. `type` and `criteria` are each type's own; the rest pass through
    the chat form unchanged."""

    model_config = ConfigDict(extra="forbid")

    type: str
    instructions: Any = None
    criteria: Any  # each type's own; required but for noul
    depends_on: Ids = ()
    ask_if: Annotated[dict[str, Strings], BeforeValidator(_ask_if_size)] = Field(default_factory=dict)
    alone: StrictBool = False
    _alternatives: tuple[Alternative, ...] = PrivateAttr(default=())

    @model_validator(mode="before")
    @classmethod
    def _known_keys_without_nulls(cls, value: Any) -> Any:
        # Unknown keys first, as this server always checked them (pydantic checks them last).
        refuse_unknown_keys(value, cls.model_fields)
        return _drop_nulls(value)

    @model_validator(mode="after")
    def _two_alternatives(self) -> "QuestionFields":
        self._alternatives = QUESTION_TYPES[self.type].alternatives(self.criteria)
        if len(self._alternatives) < 2:
            raise PydanticCustomError("too_short", "needs at least two alternatives")
        return self

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(alternative.name for alternative in self._alternatives)

    @property
    def dependencies(self) -> tuple[str, ...]:
        """depends_on plus the ask_if keys, de-duplicated, in order."""
        return tuple(dict.fromkeys([*self.depends_on, *self.ask_if]))

    def question(self, qid: str, position: int) -> Question:
        return Question(
            qid=qid,
            position=position,
            kind=QUESTION_TYPES[self.type],
            instructions="" if self.instructions is None else render_content(self.instructions),
            alternatives=self._alternatives,
            depends_on=self.dependencies,
            ask_if=tuple((dep, tuple(values)) for dep, values in self.ask_if.items()),
            alone=self.alone,
        )


class NoulQuestion(QuestionFields):
    type: Literal["noul"]
    criteria: NoulCriteria | None = None


class ChoiceQuestion(QuestionFields):
    type: Literal["choice"]
    criteria: ChoiceCriteria


class ScoreQuestion(QuestionFields):
    type: Literal["score"]
    criteria: ScoreCriteria


QuestionSpec = Annotated[Union[NoulQuestion, ChoiceQuestion, ScoreQuestion], Discriminator("type")]


def _question_count(value: Any, info: ValidationInfo) -> Any:
    return at_most_entries(value, _limit(info, "max_questions"))


def _check_references(questions: dict[str, QuestionFields]) -> dict[str, QuestionFields]:
    """Dependencies name other questions, `ask_if` values are answers of the named question, and
    there is no cycle (Kahn's algorithm: linear in questions plus dependencies)."""
    answers: dict[str, frozenset[str]] = {}  # each named question's answers, built once
    for qid, spec in questions.items():
        for dep in spec.dependencies:
            if dep not in questions or dep == qid:
                raise refuse(f"question '{qid}': depends on unknown question '{dep}'", qid, "depends_on")
        for dep, wanted in spec.ask_if.items():
            if dep not in answers:
                answers[dep] = frozenset(questions[dep].names)
            if not answers[dep].issuperset(wanted):
                listed = ", ".join(repr(name) for name in questions[dep].names)
                raise refuse(f"question '{qid}': ask_if values for '{dep}' must be among [{listed}]", qid, "ask_if", dep)
    waiting = {qid: len(spec.dependencies) for qid, spec in questions.items()}
    dependents: dict[str, list[str]] = {}
    for qid, spec in questions.items():
        for dep in spec.dependencies:
            dependents.setdefault(dep, []).append(qid)
    ready = [qid for qid, count in waiting.items() if count == 0]
    while ready:
        for qid in dependents.get(ready.pop(), ()):
            waiting[qid] -= 1
            if waiting[qid] == 0:
                ready.append(qid)
    stuck = [qid for qid, count in waiting.items() if count > 0]
    if stuck:
        raise refuse(f"schema: dependency cycle among {', '.join(stuck)}")
    return questions


Questions = Annotated[
    dict[QuestionId, QuestionSpec],
    BeforeValidator(_question_count),
    Len(min_length=1),
    AfterValidator(_check_references),
]


# ----------------------------------------------------------------------------- images

_DATA_URL = re.compile(r"^data:(image/[A-Za-z0-9.+-]+)(?:;[^,;]*)*;base64,", re.IGNORECASE)


def _data_url(value: str) -> tuple[str, str]:
    match = _DATA_URL.match(value)
    if not match:
        raise PydanticCustomError("url_parsing", "a data:image/... URL")
    return match.group(1).lower(), value[match.end():]


class ImageObject(BaseModel):
    content_type: Annotated[StrictStr, StringConstraints(pattern=r"(?i)^image/")]
    data: StrictStr = Field(alias="base64")


def _decode(entry: tuple[str, str] | ImageObject, info: ValidationInfo) -> tuple[str, bytes]:
    """(content type, bytes). The size is checked on the encoded text, before anything is decoded."""
    content_type, payload = entry if isinstance(entry, tuple) else (entry.content_type.lower(), entry.data)
    limit = _limit(info, "max_image_bytes")
    if len(payload) * 3 // 4 > limit:
        raise PydanticCustomError("too_large", "at most {limit} bytes", {"limit": limit})
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise PydanticCustomError("base64_decode", "the base64 data does not decode") from None
    if not data:
        raise PydanticCustomError("empty", "the image is empty")
    return content_type, data


def _image_count(value: Any, info: ValidationInfo) -> Any:
    # The multipart and asset images come first and count toward the same limit.
    if isinstance(value, list):
        limit, before = _limit(info, "max_images"), _context(info)["images_before"]
        if before + len(value) > limit:
            raise PydanticCustomError("too_long", "at most {max_length} images", {
                "max_length": limit, "actual_length": before + len(value)})
    return value


def decoded(entry: object) -> tuple[str, bytes]:
    """An `images` entry once validated: `_decode` turned it into (content type, bytes)."""
    if isinstance(entry, tuple) and len(entry) == 2 and isinstance(entry[0], str) and isinstance(entry[1], bytes):
        return entry[0], entry[1]
    raise TypeError(f"an image entry that was not decoded: {type(entry).__name__}")


ImageEntry = Annotated[
    Union[Annotated[StrictStr, AfterValidator(_data_url)], ImageObject],
    AfterValidator(_decode),
]


# ----------------------------------------------------------------------------- the body


class DecisionBody(BaseModel):
    """A decision request. Unknown top-level keys are ignored, as Jev does (the caller lists them in
    `diagnostics.ignored`); unknown keys inside a question are refused."""

    model_config = ConfigDict(extra="ignore")

    questions: Questions
    auto_max: Annotated[Integer, Field(ge=1)] | None = Field(None, json_schema_extra=EXTENSION)
    auto_threshold: Annotated[float, Strict(), Field(ge=0, allow_inf_nan=False)] | None = Field(
        None, json_schema_extra=EXTENSION)
    samples: Literal["auto"] | Annotated[Integer, Field(ge=1)] = Field("auto", json_schema_extra=EXTENSION)
    steps: Annotated[Integer, Field(ge=1), _at_most("max_steps")] = Field(1, json_schema_extra=EXTENSION)
    think: Annotated[Integer, Field(ge=0), _at_most("max_think")] = Field(0, json_schema_extra=EXTENSION)
    seed: Annotated[Integer, Field(ge=-MAX_SEED, le=MAX_SEED)] | None = None
    instructions: Any = Field(None, json_schema_extra=EXTENSION)
    ask: Strings = Field((), json_schema_extra=EXTENSION)  # () when left out: every question
    chunk_rows: Annotated[Integer, Field(ge=MIN_CHUNK_ROWS)] | None = Field(None, json_schema_extra=EXTENSION)
    chunk_prompt: Literal["own", "shared"] = Field("own", json_schema_extra=EXTENSION)
    sequential: StrictBool = Field(False, json_schema_extra=EXTENSION)
    isolate: StrictBool | None = Field(None, json_schema_extra=EXTENSION)
    confidence: Literal[CONFIDENCE_MODES] | None = Field(None, json_schema_extra=EXTENSION)  # type: ignore[valid-type]
    debias: Literal[DEBIAS_MODES] | None = Field(None, json_schema_extra=EXTENSION)  # type: ignore[valid-type]
    model: StrictStr | None = None
    state: Any
    images: Annotated[tuple[ImageEntry, ...], BeforeValidator(_image_count)] = ()
    assets: Any = None  # the official client's asset map, resolved (and checked) before the body

    @model_validator(mode="before")
    @classmethod
    def _nulls_are_absent(cls, value: Any) -> Any:
        return _drop_nulls(value)

    @field_validator("ask")
    @classmethod
    def _asked_with_dependencies(cls, ask: tuple[str, ...], info: ValidationInfo) -> tuple[str, ...]:
        questions: dict[str, QuestionFields] | None = info.data.get("questions")
        if questions is None:  # no questions: their own error comes first
            return ask
        if not all(qid in questions for qid in ask):
            raise PydanticCustomError("value_error", "ask must list question ids from this schema")
        asked = set(ask)
        for qid, spec in questions.items():
            if qid in asked and not asked.issuperset(spec.dependencies):
                raise refuse(f"schema: ask names '{qid}' but not everything it depends on")
        return ask


def extension_keys() -> tuple[str, ...]:
    """The reference's request keys beside Jev's, in declaration order."""
    return tuple(
        name for name, field in DecisionBody.model_fields.items()
        if isinstance(field.json_schema_extra, dict) and field.json_schema_extra.get("extension")
    )


def question_pass_through_keys() -> tuple[str, ...]:
    """The question keys every type shares: the chat form passes them on as they are."""
    return tuple(name for name in QuestionFields.model_fields if name not in ("type", "criteria"))
