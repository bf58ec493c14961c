"""A Jev `/v1/systemone` body (plus the reference's extensions) in, a validated `Decision` out.

The rules are the pydantic models of `app.decisions.models`, checked in their declaration order (the
first failure wins: the official client's assets, the questions and the dependencies between them,
the extension keys, then `model`, the state and the images); `app.decisions.refusals` translates the
failure into a `RequestError` that names the field (`RequestError.loc`). Unknown top-level keys are
ignored, as Jev ignores them, and listed in `Decision.ignored`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal, Mapping, Sequence

from pydantic import BaseModel, StrictStr, ValidationError

from app.decisions.debias import Debias
from app.decisions.errors import RequestError
from app.decisions.limits import Limits
from app.decisions.models import DecisionBody, decoded
from app.decisions.questions import Question, render_content
from app.decisions.refusals import refusal
from app.engine.base import ImageInput


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
    """A validated request. Every field is set by `parse_decision`: the request's defaults live on
    `DecisionBody`, the server's in `Settings` (through `Limits`), none here."""

    questions: tuple[Question, ...]
    state_text: str
    seed: int
    samples: Samples
    images: tuple[ImageInput, ...]
    steps: int
    think: int
    instructions: str | None
    ask: tuple[str, ...] | None
    chunk_rows: int | None
    chunk_prompt: str
    sequential: bool
    isolate: bool
    confidence: str
    debias: Debias  # the options' order and the label prior (docs/quality.md)
    model: str | None
    ignored: tuple[str, ...]  # unknown top-level keys, in body order (Jev ignores them too)

    def asked(self) -> tuple[Question, ...]:
        if self.ask is None:
            return self.questions
        wanted = set(self.ask)
        return tuple(q for q in self.questions if q.qid in wanted)


def parse_decision(
    body: Any,
    limits: Limits,
    images: Sequence[ImageInput] = (),
    assets: Mapping[str, ImageInput] | None = None,
) -> Decision:
    """Validate a request body. `images` are the multipart image parts, which come first; `assets`
    are the official client's asset-N parts, which the body's `assets` map names."""
    asset_images: tuple[ImageInput, ...] = ()
    if isinstance(body, dict):  # anything else is refused by the model below
        asset_images, body = _resolve_assets(body, assets or {}, limits, first_number=len(images) + 1)
    images = tuple(images) + asset_images
    try:
        parsed = DecisionBody.model_validate(body, context={"limits": limits, "images_before": len(images)})
    except ValidationError as exc:
        raise refusal(exc, limits) from None

    json_images = tuple(
        ImageInput(data=data, content_type=content_type, source=f"images[{index}]")
        for index, (content_type, data) in enumerate(decoded(entry) for entry in parsed.images)
    )
    all_images = images + json_images
    _check_image_totals(all_images, limits)
    if parsed.samples == "auto":
        # More reads than the cap are clamped, as in the reference (`--max-samples`).
        threshold = limits.auto_threshold if parsed.auto_threshold is None else parsed.auto_threshold
        samples = Samples("auto", min(parsed.auto_max or limits.auto_max, limits.max_samples), float(threshold))
    else:
        samples = Samples("fixed", min(parsed.samples, limits.max_samples))
    return Decision(
        questions=tuple(spec.question(qid, position) for position, (qid, spec) in enumerate(parsed.questions.items(), 1)),
        state_text=parsed.state if isinstance(parsed.state, str) else render_content(parsed.state),
        seed=limits.default_seed if parsed.seed is None else parsed.seed,
        samples=samples,
        images=all_images,
        steps=parsed.steps,
        think=parsed.think,
        instructions=None if parsed.instructions is None else render_content(parsed.instructions) or None,
        ask=tuple(dict.fromkeys(parsed.ask)) if parsed.ask else None,
        chunk_rows=parsed.chunk_rows,
        chunk_prompt=parsed.chunk_prompt,
        sequential=parsed.sequential,
        isolate=limits.isolate if parsed.isolate is None else parsed.isolate,
        confidence=limits.confidence if parsed.confidence is None else parsed.confidence,
        debias=Debias.parse(limits.debias if parsed.debias is None else parsed.debias),
        model=parsed.model,
        ignored=tuple(key for key in body if key not in DecisionBody.model_fields),
    )


class _AssetRef(BaseModel):
    type: Literal["image"]
    part: StrictStr


class _Assets(BaseModel):
    """The official client's `assets` map: `<image:32 hex>` reference -> the multipart part holding it."""

    assets: dict[str, _AssetRef] | None = None

# The official client's image references: `<image:32 hex>` in any text of the body.
_REFERENCE = re.compile(r"<image:[0-9a-f]{32}>")


def _resolve_assets(
    body: dict, parts: Mapping[str, ImageInput], limits: Limits, first_number: int
) -> tuple[tuple[ImageInput, ...], dict]:
    """The images of the body's `assets` map, in map order, and the body with each `<image:...>`
    reference in its text replaced by "[image N]" (images sit ahead of the state in the prompt)."""
    try:
        refs = _Assets.model_validate({"assets": body.get("assets")}).assets
    except ValidationError as exc:
        raise refusal(exc, limits) from None
    if refs is None:
        if parts:
            raise RequestError(f"part '{next(iter(parts))}': an asset part, but the request has no assets map", ("assets",))
        return (), body
    images: list[ImageInput] = []
    numbers: dict[str, str] = {}
    for key, ref in refs.items():
        if ref.part not in parts:
            raise RequestError(f"assets['{key}']: the request has no part '{ref.part}'", ("assets", key))
        images.append(parts[ref.part])
        numbers[key] = f"[image {first_number + len(images) - 1}]"
    named = {ref.part for ref in refs.values()}
    unused = [name for name in parts if name not in named]
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
