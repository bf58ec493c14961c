"""Pydantic's validation errors, translated once into the `RequestError` this server answers.

Every refusal is a row of `REFUSALS`: where in the body (a loc pattern, "*" for any id, index or key;
a question's loc carries its type as pydantic reports it), which pydantic error type (None: any),
and the message, status and loc it becomes. The longest pattern that matches the error's loc wins,
a row for its error type before a row for any. Messages are `str.format` templates over `qid`, `key`
(the loc's last matched part), `tag` (an unknown question type), `limits` and the error's context.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from app.decisions.debias import MODES as DEBIAS_MODES
from app.decisions.errors import RequestError
from app.decisions.limits import Limits
from app.decisions.models import MAX_SEED, MIN_CHUNK_ROWS
from app.decisions.questions import QUESTION_TYPES, TOO_MANY_CHOICES, TOO_MANY_LEVELS

ANY = "*"


@dataclass(frozen=True)
class Refusal:
    message: str
    status: int = 422  # 422 for validation, 400 for Jev's documented limits, 413 for sizes
    at: tuple[str, ...] = ()  # appended to the loc: an unknown type is about the question's "type"
    jev_detail: bool = False  # Jev answers with the message as a plain-string detail


Q = ("questions", ANY)  # one question; its type follows in the loc of its fields
BOOL = "must be true or false"
IMAGE = "images[{key}]: a data:image/... URL or an object with content_type and base64"
ASSET = '{{"type": "image", "part": "asset-N"}}'

REFUSALS: dict[tuple[tuple[Any, ...], str | None], Refusal] = {
    ((), None): Refusal("body: must be a JSON object with state and questions"),
    (("questions",), None): Refusal("questions: needs a non-empty map of id -> question"),
    (("questions",), "too_long"): Refusal(
        "questions: at most {limits.max_questions} questions per request, got {actual_length}", 400),
    ((*Q, "[key]"), "string_too_long"): Refusal(
        "question id '{qid:.40}...' is longer than {limits.max_id_length} characters", 400),
    ((*Q, "[key]"), None): Refusal("questions: ids must be strings"),
    (Q, None): Refusal("question '{qid}': must be an object"),
    (Q, "union_tag_invalid"): Refusal("question '{qid}': unknown type '{tag}'", at=("type",)),
    (Q, "union_tag_not_found"): Refusal("question '{qid}': unknown type '{tag}'", at=("type",)),
    ((*Q, ANY), "too_short"): Refusal("question '{qid}': needs at least two alternatives", at=("criteria",)),
    ((*Q, ANY, ANY), "extra_forbidden"): Refusal("question '{qid}': unknown field '{key}'"),
    ((*Q, "noul", "criteria"), None): Refusal("question '{qid}': noul criteria must be an object with true and false"),
    ((*Q, "noul", "criteria", ANY), "extra_forbidden"): Refusal(
        "question '{qid}': noul criteria take only true and false, not '{key}'"),
    ((*Q, "choice", "criteria"), None): Refusal("question '{qid}': choice criteria must map option names to descriptions"),
    ((*Q, "choice", "criteria"), "too_long"): Refusal(TOO_MANY_CHOICES, 400, jev_detail=True),
    ((*Q, "choice", "criteria", ANY), None): Refusal("question '{qid}': option names must not be empty"),
    ((*Q, "score", "criteria"), None): Refusal("question '{qid}': score criteria must be an ordered list of levels"),
    ((*Q, "score", "criteria"), "too_long"): Refusal(TOO_MANY_LEVELS, 400, jev_detail=True),
    ((*Q, "score", "criteria", ANY), None): Refusal("question '{qid}': level {key} must not be empty"),
    ((*Q, ANY, "depends_on"), None): Refusal("question '{qid}': depends_on must be a list of question ids"),
    ((*Q, ANY, "ask_if"), None): Refusal(
        "question '{qid}': ask_if must map a question id to a non-empty list of its answers"),
    ((*Q, ANY, "alone"), None): Refusal(f"question '{{qid}}': alone {BOOL}"),
    (("auto_max",), None): Refusal("schema: auto_max must be an integer of at least 1"),
    (("auto_threshold",), None): Refusal("schema: auto_threshold must be a number of at least 0"),
    (("samples",), None): Refusal('schema: samples must be a positive count or "auto"'),
    (("steps",), None): Refusal("schema: steps must be an integer from 1 to {limits.max_steps}"),
    (("think",), None): Refusal("schema: think must be a thought budget in tokens, 0 to {limits.max_think}"),
    (("seed",), None): Refusal(f"seed: must be an integer from {-MAX_SEED} to {MAX_SEED}"),
    (("ask",), None): Refusal("schema: ask must list question ids from this schema"),
    (("chunk_rows",), None): Refusal(f"schema: chunk_rows must be an integer of at least {MIN_CHUNK_ROWS}"),
    (("chunk_prompt",), None): Refusal('schema: chunk_prompt must be "shared" or "own"'),
    (("sequential",), None): Refusal(f"schema: sequential {BOOL}"),
    (("isolate",), None): Refusal(f"schema: isolate {BOOL}"),
    (("confidence",), None): Refusal('schema: confidence must be "djev" (probability of the answer) or "jev"'),
    (("debias",), None): Refusal("schema: debias must be one of " + ", ".join(f'"{m}"' for m in DEBIAS_MODES)),
    (("model",), None): Refusal('model: must be a string such as "jev-latest"'),
    (("state",), None): Refusal("state: required"),
    (("images",), None): Refusal("images: must be a list of data:image/... URLs or {{content_type, base64}} objects"),
    (("images",), "too_long"): Refusal("images: at most {limits.max_images} images per request, got {actual_length}", 400),
    (("images", ANY), None): Refusal(IMAGE),
    (("images", ANY), "too_large"): Refusal("images[{key}]: an image may be at most {limits.max_image_bytes} bytes", 413),
    (("images", ANY), "base64_decode"): Refusal("images[{key}]: the base64 data does not decode"),
    (("images", ANY), "empty"): Refusal("images[{key}]: the image is empty"),
    (("assets",), None): Refusal(f"assets: must map a reference to {ASSET}"),
    (("assets", ANY), None): Refusal(f"assets['{{key}}']: must be {ASSET}"),
}
LONGEST = max(len(pattern) for pattern, _ in REFUSALS)


def refusal(exc: ValidationError, limits: Limits) -> RequestError:
    """The RequestError for the first of pydantic's errors: the first check that failed. (The rules
    keep their errors few: a list stops at its first bad entry, a count past a limit is refused before
    the entries, an unknown key is reported alone.)"""
    error = exc.errors(include_url=False)[0]
    kind, ctx = error["type"], error.get("ctx") or {}
    loc = tuple(error["loc"]) + tuple(ctx.get("at", ()))  # a rule may name a part below its own loc
    if "refusal" in ctx:  # a rule that wrote its own message (`app.decisions.models.refuse`)
        return RequestError(ctx["refusal"], _clean(loc), kind=kind)
    for length in range(min(len(loc), LONGEST), -1, -1):
        prefix = loc[:length]
        row = matching_row(prefix, kind)
        if row is not None:
            found = REFUSALS[row]
            fields = {"tag": None, **ctx, "key": prefix[-1] if prefix else None, "limits": limits,
                      "qid": loc[1] if loc[:1] == ("questions",) and len(loc) > 1 else None}
            message = found.message.format(**fields)
            return RequestError(message, _clean(prefix) + found.at, status=found.status, kind=kind,
                                jev_detail=message if found.jev_detail else None)
    return RequestError(f"{'.'.join(map(str, loc)) or 'body'}: {error['msg']}", _clean(loc), kind=kind)


def matching_row(prefix: tuple[Any, ...], kind: str) -> tuple[tuple[Any, ...], str | None] | None:
    """The key of the REFUSALS row for a pydantic error of type `kind` at loc `prefix`, among the
    rows whose pattern is exactly as long: a row for this error type before a row for any, then the
    row with fewer wildcards; None where no row matches. `refusal` tries it on ever shorter prefixes
    of the error's loc."""
    matches = [
        (pattern, error_type) for pattern, error_type in REFUSALS
        if len(pattern) == len(prefix) and error_type in (kind, None)
        and all(part == ANY or part == value for part, value in zip(pattern, prefix))
    ]
    if not matches:
        return None
    return min(matches, key=lambda row: (row[1] is None, row[0].count(ANY)))


def _clean(loc: tuple[Any, ...]) -> tuple[Any, ...]:
    """The loc as the caller wrote the body: without a question's type and pydantic's "[key]"."""
    parts = list(loc)
    if parts[:1] == ["questions"] and len(parts) > 2 and parts[2] in QUESTION_TYPES:
        del parts[2]
    if parts[-1:] == ["[key]"]:
        del parts[-1]
    return tuple(parts)
