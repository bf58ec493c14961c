"""A Jev `/v1/systemone` body (plus the reference's extensions) in, a validated `Decision` out.

Validation runs in a fixed order and the first failure wins: the body's shape, each question, the
dependencies between questions, the extension keys, then the state and images. Every error names
the field it is about (`RequestError.loc`).
"""

from __future__ import annotations

import base64
import binascii
import math
import re
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from app.decisions.errors import RequestError
from app.decisions.plan import stages
from app.decisions.questions import (
    CONFIDENCE_MODES,
    QUESTION_TYPES,
    Alternative,
    Question,
    render_content,
)
from app.engine.base import ImageInput

MIN_CHUNK_ROWS = 8
MAX_SEED = 2**63 - 1

TOP_LEVEL_KEYS = frozenset({
    "state", "questions", "model", "seed", "images", "assets",
    "samples", "auto_max", "auto_threshold", "steps", "think", "instructions", "ask",
    "chunk_rows", "chunk_prompt", "sequential", "isolate", "confidence",
})
QUESTION_KEYS = frozenset({"type", "instructions", "criteria", "depends_on", "ask_if", "alone"})


@dataclass(frozen=True)
class Limits:
    """What one request may ask for, and the defaults of what it leaves out. Built by
    `app.config.Settings.limits`, the one place their values are defined."""

    max_questions: int
    max_samples: int
    max_think: int
    max_steps: int
    max_id_length: int
    max_images: int
    max_image_bytes: int
    max_total_image_bytes: int
    confidence: str
    isolate: bool
    default_seed: int
    auto_max: int
    auto_threshold: float


@dataclass(frozen=True)
class Samples:
    mode: str  # "fixed" or "auto"
    count: int  # fixed: the reads; auto: the most reads
    threshold: float = 0.0

    def as_json(self) -> dict:
        if self.mode == "fixed":
            return {"mode": "fixed", "n": self.count}
        return {"mode": "auto", "max": self.count, "threshold": self.threshold}


@dataclass(frozen=True)
class Decision:
    questions: tuple[Question, ...]
    state_text: str
    seed: int
    samples: Samples
    images: tuple[ImageInput, ...] = ()
    steps: int = 1
    think: int = 0
    instructions: str | None = None
    ask: tuple[str, ...] | None = None
    chunk_rows: int | None = None
    chunk_prompt: str = "own"
    sequential: bool = False
    isolate: bool = False
    confidence: str = "djev"
    model: str | None = None

    def asked(self) -> tuple[Question, ...]:
        if self.ask is None:
            return self.questions
        wanted = set(self.ask)
        return tuple(q for q in self.questions if q.qid in wanted)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int_field(body: dict, key: str, message: str, low: int | None = None, high: int | None = None) -> int | None:
    """An optional integer field; a float with an integral value counts (42.0 is 42)."""
    if key not in body or body[key] is None:
        return None
    value = body[key]
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        value = int(value)
    if not _is_int(value) or (low is not None and value < low) or (high is not None and value > high):
        raise RequestError(message, (key,))
    return value


def parse_decision(
    body: Any,
    limits: Limits,
    images: Sequence[ImageInput] = (),
    assets: Mapping[str, ImageInput] | None = None,
) -> Decision:
    """Validate a request body. `images` are the multipart image parts, which come first; `assets`
    are the official client's asset-N parts, which the body's `assets` map names."""
    if not isinstance(body, dict):
        raise RequestError("body: must be a JSON object with state and questions", ())
    unknown = [key for key in body if key not in TOP_LEVEL_KEYS]
    if unknown:
        raise RequestError(f"unknown field '{unknown[0]}'", (unknown[0],), kind="extra_forbidden")
    asset_images, body = _resolve_assets(body, assets or {}, first_number=len(images) + 1)
    images = tuple(images) + asset_images

    questions = _parse_questions(body.get("questions"), limits)
    options = _parse_options(body, questions, limits)

    if "model" in body and body["model"] is not None and not isinstance(body["model"], str):
        raise RequestError("model: must be a string such as \"jev-latest\"", ("model",))
    if body.get("state") is None:
        raise RequestError("state: required", ("state",), kind="missing")
    state = body["state"]
    state_text = state if isinstance(state, str) else render_content(state)

    all_images = tuple(images) + _parse_json_images(body.get("images"), limits, already=len(images))
    _check_image_totals(all_images, limits)
    return Decision(questions=questions, state_text=state_text, images=all_images, model=body.get("model"), **options)


def _parse_questions(raw: Any, limits: Limits) -> tuple[Question, ...]:
    if not isinstance(raw, dict) or not raw:
        raise RequestError("questions: needs a non-empty map of id -> question", ("questions",))
    if len(raw) > limits.max_questions:
        raise RequestError(
            f"questions: at most {limits.max_questions} questions per request, got {len(raw)}",
            ("questions",), status=400,
        )
    parsed: list[Question] = []
    for position, (qid, spec) in enumerate(raw.items(), start=1):
        parsed.append(_parse_question(qid, spec, position, limits))
    by_id = {q.qid: q for q in parsed}
    for question in parsed:
        loc = ("questions", question.qid)
        for dep in question.depends_on:
            if dep not in by_id or dep == question.qid:
                raise RequestError(f"question '{question.qid}': depends on unknown question '{dep}'", loc + ("depends_on",))
        for dep, wanted in question.ask_if:
            names = by_id[dep].names
            bad = [value for value in wanted if value not in names]
            if bad:
                listed = ", ".join(repr(name) for name in names)
                raise RequestError(
                    f"question '{question.qid}': ask_if values for '{dep}' must be among [{listed}]",
                    loc + ("ask_if", dep),
                )
    stages(parsed)  # raises on a dependency cycle
    return tuple(parsed)


def _parse_question(qid: str, spec: Any, position: int, limits: Limits) -> Question:
    loc = ("questions", qid)
    if len(qid) > limits.max_id_length:
        raise RequestError(
            f"question id '{qid[:40]}...' is longer than {limits.max_id_length} characters", loc, status=400
        )
    if not isinstance(spec, dict):
        raise RequestError(f"question '{qid}': must be an object", loc)
    unknown = [key for key in spec if key not in QUESTION_KEYS]
    if unknown:
        raise RequestError(f"question '{qid}': unknown field '{unknown[0]}'", loc + (unknown[0],), kind="extra_forbidden")
    type_name = spec.get("type")
    kind = QUESTION_TYPES.get(type_name) if isinstance(type_name, str) else None
    if kind is None:
        raise RequestError(f"question '{qid}': unknown type '{type_name}'", loc + ("type",))
    instructions = spec.get("instructions")
    text = "" if instructions is None else render_content(instructions)
    alternatives: tuple[Alternative, ...] = kind.alternatives(spec.get("criteria"), loc)
    if len(alternatives) < 2:
        raise RequestError(f"question '{qid}': needs at least two alternatives", loc + ("criteria",))

    depends_on = spec.get("depends_on")
    if depends_on is None:
        depends_on = []
    if not isinstance(depends_on, list) or not all(isinstance(dep, str) for dep in depends_on):
        raise RequestError(f"question '{qid}': depends_on must be a list of question ids", loc + ("depends_on",))
    ask_if = spec.get("ask_if")
    if ask_if is None:
        ask_if = {}
    if not isinstance(ask_if, dict) or not all(
        isinstance(values, list) and values and all(isinstance(v, str) for v in values) for values in ask_if.values()
    ):
        raise RequestError(
            f"question '{qid}': ask_if must map a question id to a non-empty list of its answers", loc + ("ask_if",)
        )
    alone = spec.get("alone", False)
    if alone is None:
        alone = False
    if not isinstance(alone, bool):
        raise RequestError(f"question '{qid}': alone must be true or false", loc + ("alone",))
    deps = tuple(dict.fromkeys([*depends_on, *ask_if.keys()]))
    return Question(
        qid=qid,
        position=position,
        kind=kind,
        instructions=text,
        alternatives=alternatives,
        depends_on=deps,
        ask_if=tuple((dep, tuple(values)) for dep, values in ask_if.items()),
        alone=alone,
    )


def _parse_options(body: dict, questions: tuple[Question, ...], limits: Limits) -> dict[str, Any]:
    options: dict[str, Any] = {}

    samples = body.get("samples", "auto")
    auto_max = _int_field(body, "auto_max", "schema: auto_max must be an integer of at least 1", low=1)
    threshold = body.get("auto_threshold", limits.auto_threshold)
    if threshold is None:
        threshold = limits.auto_threshold
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not math.isfinite(threshold) or threshold < 0:
        raise RequestError("schema: auto_threshold must be a number of at least 0", ("auto_threshold",))
    if samples is None or samples == "auto":
        # More reads than the cap are clamped, as in the reference (`--max-samples`).
        options["samples"] = Samples("auto", min(auto_max or limits.auto_max, limits.max_samples), float(threshold))
    else:
        count = _int_field(body, "samples", 'schema: samples must be a positive count or "auto"', low=1)
        options["samples"] = Samples("fixed", min(count, limits.max_samples))

    steps = _int_field(body, "steps", f"schema: steps must be an integer from 1 to {limits.max_steps}", 1, limits.max_steps)
    options["steps"] = steps or 1
    think = _int_field(
        body, "think", f"schema: think must be a thought budget in tokens, 0 to {limits.max_think}", 0, limits.max_think
    )
    options["think"] = think or 0
    seed = _int_field(body, "seed", f"seed: must be an integer from {-MAX_SEED} to {MAX_SEED}", -MAX_SEED, MAX_SEED)
    options["seed"] = limits.default_seed if seed is None else seed

    instructions = body.get("instructions")
    if instructions is not None:
        text = render_content(instructions)
        options["instructions"] = text or None

    ask = body.get("ask")
    if ask is not None:
        ids = {q.qid for q in questions}
        if not isinstance(ask, list) or not ask or not all(isinstance(a, str) and a in ids for a in ask):
            raise RequestError("schema: ask must list question ids from this schema", ("ask",))
        asked = set(ask)
        for question in questions:
            if question.qid in asked and not all(dep in asked for dep in question.depends_on):
                raise RequestError(f"schema: ask names '{question.qid}' but not everything it depends on", ("ask",))
        options["ask"] = tuple(dict.fromkeys(ask))

    chunk_rows = _int_field(body, "chunk_rows", f"schema: chunk_rows must be an integer of at least {MIN_CHUNK_ROWS}", MIN_CHUNK_ROWS)
    options["chunk_rows"] = chunk_rows
    chunk_prompt = body.get("chunk_prompt", "own")
    if chunk_prompt is None:
        chunk_prompt = "own"
    if chunk_prompt not in ("own", "shared"):
        raise RequestError('schema: chunk_prompt must be "shared" or "own"', ("chunk_prompt",))
    options["chunk_prompt"] = chunk_prompt

    for key, default in (("sequential", False), ("isolate", limits.isolate)):
        value = body.get(key, default)
        if value is None:
            value = default
        if not isinstance(value, bool):
            raise RequestError(f"schema: {key} must be true or false", (key,))
        options[key] = value

    confidence = body.get("confidence", limits.confidence)
    if confidence is None:
        confidence = limits.confidence
    if confidence not in CONFIDENCE_MODES:
        raise RequestError('schema: confidence must be "djev" (probability of the answer) or "jev"', ("confidence",))
    options["confidence"] = confidence
    return options


# The official client's image references: `<image:32 hex>` in any text of the body.
_REFERENCE = re.compile(r"<image:[0-9a-f]{32}>")


def _resolve_assets(
    body: dict, parts: Mapping[str, ImageInput], first_number: int
) -> tuple[tuple[ImageInput, ...], dict]:
    """The images of the body's `assets` map, in map order, and the body with each `<image:...>`
    reference in its text replaced by "[image N]" (images sit ahead of the state in the prompt)."""
    raw = body.get("assets")
    if raw is None:
        if parts:
            raise RequestError(f"part '{next(iter(parts))}': an asset part, but the request has no assets map", ("assets",))
        return (), body
    if not isinstance(raw, dict):
        raise RequestError("assets: must map a reference to {\"type\": \"image\", \"part\": \"asset-N\"}", ("assets",))
    images: list[ImageInput] = []
    numbers: dict[str, str] = {}
    used: set[str] = set()
    for key, entry in raw.items():
        if not isinstance(entry, dict) or entry.get("type") != "image" or not isinstance(entry.get("part"), str):
            raise RequestError(f"assets['{key}']: must be {{\"type\": \"image\", \"part\": \"asset-N\"}}", ("assets", key))
        part = entry["part"]
        if part not in parts:
            raise RequestError(f"assets['{key}']: the request has no part '{part}'", ("assets", key))
        used.add(part)
        images.append(parts[part])
        numbers[key] = f"[image {first_number + len(images) - 1}]"
    unused = [name for name in parts if name not in used]
    if unused:
        raise RequestError(f"part '{unused[0]}': not named in the assets map", ("assets",))

    def replace(value: Any) -> Any:
        if isinstance(value, str):
            return _REFERENCE.sub(lambda m: numbers.get(m.group(0), m.group(0)), value)
        if isinstance(value, list):
            return [replace(v) for v in value]
        if isinstance(value, dict):
            return {k: replace(v) for k, v in value.items()}
        return value

    rewritten = {key: (value if key in ("assets", "images") else replace(value)) for key, value in body.items()}
    return tuple(images), rewritten


_DATA_URL = re.compile(r"^data:(image/[A-Za-z0-9.+-]+)(?:;[^,;]*)*;base64,", re.IGNORECASE)


def _parse_json_images(raw: Any, limits: Limits, already: int) -> tuple[ImageInput, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise RequestError("images: must be a list of data:image/... URLs or {content_type, base64} objects", ("images",))
    if already + len(raw) > limits.max_images:
        raise RequestError(
            f"images: at most {limits.max_images} images per request, got {already + len(raw)}", ("images",), status=400
        )
    out = []
    for index, entry in enumerate(raw):
        where = f"images[{index}]"
        bad = RequestError(f"{where}: a data:image/... URL or an object with content_type and base64", ("images", index))
        if isinstance(entry, str):
            match = _DATA_URL.match(entry)
            if not match:
                raise bad
            content_type, payload = match.group(1).lower(), entry[match.end():]
        elif isinstance(entry, dict) and isinstance(entry.get("content_type"), str) and isinstance(entry.get("base64"), str):
            content_type, payload = entry["content_type"].lower(), entry["base64"]
            if not content_type.startswith("image/"):
                raise bad
        else:
            raise bad
        # The byte limit is checked on the encoded size, before anything is decoded.
        if len(payload) * 3 // 4 > limits.max_image_bytes:
            raise RequestError(
                f"{where}: an image may be at most {limits.max_image_bytes} bytes", ("images", index), status=413
            )
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise RequestError(f"{where}: the base64 data does not decode", ("images", index)) from None
        if not data:
            raise RequestError(f"{where}: the image is empty", ("images", index))
        out.append(ImageInput(data=data, content_type=content_type, source=where))
    return tuple(out)


def _check_image_totals(images: tuple[ImageInput, ...], limits: Limits) -> None:
    if len(images) > limits.max_images:
        raise RequestError(f"images: at most {limits.max_images} images per request, got {len(images)}", ("images",), status=400)
    for image in images:
        if len(image.data) > limits.max_image_bytes:
            raise RequestError(
                f"{image.source}: an image may be at most {limits.max_image_bytes} bytes", (image.source,), status=413
            )
    total = sum(len(image.data) for image in images)
    if total > limits.max_total_image_bytes:
        raise RequestError(
            f"images: at most {limits.max_total_image_bytes} bytes of images per request, got {total}",
            ("images",), status=413,
        )
