"""How a group's canvas is read: the read settings, the noise draws of `samples` (a fixed count, or
`auto`: one read, more only when a question is unsure), and the check that the engine's answer has
the read's shape."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Protocol, Sequence, TypeVar

from app.decisions.canvas import Canvas, draw_seeds, noised
from app.decisions.estimate import Adjust, chain, estimate, first_read_entropies
from app.decisions.outcome import GroupResult
from app.decisions.questions import Question
from app.decisions.request import Samples
from app.engine.base import EngineError, Prompt, Reader, ReadResult, ReadSpec

T = TypeVar("T")


class Offload(Protocol):
    """Runs synchronous `fn(*args)` somewhere that is not the event loop (or, `inline`, on the spot)."""

    def __call__(self, fn: Callable[..., T], /, *args: Any) -> Awaitable[T]: ...


@dataclass(frozen=True)
class ReadSettings:
    """How decisions are read; built from `Settings` by `app.build.read_settings` (the defaults live in `app.config`)."""

    canvas_length: int  # the widest canvas a read may use
    canvas_step: int  # canvas widths are rounded up to a multiple of this
    thought_in_prompt: bool  # the empty thought block ends the prompt instead of opening the canvas
    max_prompt_tokens: int  # a prompt past this is refused before any template work
    max_thought_tokens: int  # think x the groups that think, per request
    debias_rotations: int  # `rotate` reads at most this many shifts of a question's options


async def inline(fn: Callable[..., T], /, *args: Any) -> T:
    """An `Offload` that runs the work on the spot (for decisions whose pieces are small)."""
    return fn(*args)


@dataclass(frozen=True)
class Draws:
    """A decision's noise draws over one canvas at a time: the seeds, the read specs, the reads."""

    reader: Reader
    offload: Offload
    seed: int  # the request's seed
    steps: int  # denoise steps per read
    vocab_size: int
    adjust: Adjust | None = None  # every read's adjustment (a fitted calibration), after the group's own

    def spec(self, prompt: Prompt, canvas: Canvas, draws: range) -> ReadSpec:
        seeds = draw_seeds(self.seed, canvas, draws)
        canvases = tuple(noised(canvas, s, self.vocab_size) for s in seeds)
        return ReadSpec(prompt, canvases, canvas.slots, canvas.label_ids, self.steps, seeds[0])

    async def checked_read(self, spec: ReadSpec) -> list[ReadResult]:
        results = await self.reader.read([spec])
        check_result(spec, results)
        return results

    async def read(self, questions: list[Question], canvas: Canvas, prompt: Prompt, policy: Samples,
                   adjust: Adjust | None = None) -> GroupResult:
        """The group's draws: `samples` fixed, or `auto`: one read, and the rest only when a
        question's renormalised label distribution is unsure (entropy above the threshold). `adjust`
        is the group's own change to each read (a label prior), applied before `self.adjust`."""
        extended: bool | None = None
        first_entropy: dict[str, float] | None = None
        if policy.mode == "fixed":
            spec = await self.offload(self.spec, prompt, canvas, range(policy.count))
            results: list[ReadResult] = await self.checked_read(spec)
        else:
            results = await self.checked_read(await self.offload(self.spec, prompt, canvas, range(1)))
            first_entropy = first_read_entropies(questions, results[0])
            extended = max(first_entropy.values()) > policy.threshold and policy.count > 1
            if extended:
                more = await self.offload(self.spec, prompt, canvas, range(1, policy.count))
                results += await self.checked_read(more)
        estimates, tops = await self.offload(estimate, questions, results, canvas.slots, canvas.label_ids,
                                             chain(adjust, self.adjust))
        return GroupResult(
            questions=tuple(questions),
            index=0,
            estimates=estimates,
            tops=tops,
            policy={**policy.as_json(), "extended": extended, "first_read_entropy": first_entropy},
            draws=len(tops),
            rows=canvas.rows,
            prompt_tokens=max(result.prompt_tokens for result in results),
        )


def check_result(spec: ReadSpec, results: Sequence[ReadResult]) -> None:
    """A reader's answer must have the read's shape and finite log-probabilities, or it is the
    engine's failure (a 502), never a crash of the decision."""
    problem = None
    if len(results) != 1 or len(results[0].slots) != len(spec.canvases):
        problem = f"{len(results)} results for one read of {len(spec.canvases)} canvases"
    else:
        for canvas in results[0].slots:
            if len(canvas) != len(spec.slots):
                problem = f"{len(canvas)} slots for {len(spec.slots)}"
                break
            for slot, label_ids in zip(canvas, spec.label_ids):
                values = slot.label_logprobs
                well_formed = all(v == v and v <= 1e-4 for v in values) and any(math.isfinite(v) for v in values)
                if len(values) != len(label_ids) or not well_formed:
                    problem = f"log-probabilities {list(values)[:4]} for {len(label_ids)} labels"
                    break
            if problem:
                break
    if problem:
        raise EngineError(f"the engine returned a malformed read: {problem}")
