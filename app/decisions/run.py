"""Executing a decision against a Reader: stages, groups, noise draws, `auto`, think, conditioning.

The decision is read stage by stage. Each stage's asked questions are packed into groups (one
canvas each); groups of a stage run concurrently and the reader batches their canvases into shared
decoder passes, unless `sequential` asks for one after another. Later stages are conditioned on the
earlier answers: a text state continues the same prompt with the answers prefilled (a prefix the
engine has cached), an image state is read afresh with the answers restated in its text.

Everything here that grows with the request (labels, question sheets, tokenizing, slot finding,
estimates) runs through `offload` (a worker thread), never on the event loop; the loop only awaits
the reader.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Sequence

from app.decisions.canvas import Canvas, build_canvas, content_seed, draw_seeds, noised
from app.decisions.errors import RequestError
from app.decisions.estimate import estimate, first_read_entropies
from app.decisions.outcome import GroupResult, Outcome, assemble
from app.decisions.plan import Plan, Skip, gate, groups, stages
from app.decisions.prompt import ChatPrompts, restated_state, system_text
from app.decisions.questions import Question
from app.decisions.reading import ReadSettings
from app.decisions.request import Decision
from app.decisions.template import (
    JOIN,
    LINES,
    TemplateItem,
    Templates,
    answer_format,
    answer_text,
)
from app.engine.base import (
    EngineError,
    EngineInputError,
    GenerateSpec,
    Prompt,
    Reader,
    ReadResult,
    ReadSpec,
    gather_or_cancel,
)

MIN_THOUGHT_ROWS = 8
# A decision within these bounds plans, templates and estimates in well under a millisecond each, less
# than a trip to a worker thread, so its synchronous pieces run inline (docs/reliability.md).
SMALL_STATE_CHARS = 8 * 1024
SMALL_OPTIONS = 64
SMALL_CANVASES = 16

Offload = Callable[..., Awaitable[Any]]


@dataclass(frozen=True)
class _Chain:
    """A chained text decision's common prefix: the full question sheet, the state, and the one
    thought written for the whole decision (if any)."""

    prefix: tuple[int, ...]
    thought: dict | None = None
    thought_tokens: int = 0


@dataclass
class _Conditioning:
    """What later stages read of the earlier ones."""

    prefill: list[str] = field(default_factory=list)  # answer texts in labels, continuing a text prompt
    restated: list[str] = field(default_factory=list)  # "q1: name" entries, restated in an image state


class Decider:
    """Runs decisions for one reader. Holds the template cache for the reader's tokenizer.

    `offload(fn, *args)` runs synchronous work off the event loop (default: `asyncio.to_thread`;
    the server passes its own bounded pool)."""

    def __init__(self, reader: Reader, settings: ReadSettings, templates: Templates | None = None,
                 offload: Offload | None = None) -> None:
        self.reader = reader
        self.settings = settings
        self.tokenizer = reader.tokenizer
        self.templates = templates or Templates(reader.tokenizer)
        self.prompts = ChatPrompts(reader.tokenizer, settings.thought_in_prompt)
        self.offload: Offload = offload or asyncio.to_thread

    async def decide(self, decision: Decision, plan: Plan | None = None) -> Outcome:
        """Run a decision; `plan` is `self.plan(decision)` when the caller already made it (the
        server plans in its worker pool to price the decision before admitting it)."""
        if plan is None:
            plan = await self.offload(self.plan, decision)
        return await _Run(self, decision, plan).run()

    # ------------------------------------------------------------------ planning (synchronous)

    def plan(self, decision: Decision) -> Plan:
        # With `isolate` every canvas reads one question as if it were asked alone, so the format
        # is the one-question format whatever the request's length.
        fmt = LINES if decision.isolate else answer_format(len(decision.questions))
        labels = {q.qid: self.labels_for(q, fmt) for q in decision.questions}
        layered = stages(decision.asked())
        chained = len(layered) > 1 or decision.sequential
        image_state = bool(decision.images)
        group_count = 0
        thinking_groups = 0
        for number, stage in enumerate(layered):
            conditioned = number > 0 or decision.sequential
            count = len(self.split(decision, fmt, labels, stage, conditioned, chained))
            group_count += count
            if decision.think and image_state and number == 0:
                thinking_groups += count  # later image stages are restated, without a thought
            elif decision.think and not image_state and not chained:
                thinking_groups += count
        if decision.think and chained and not image_state:
            thinking_groups = 1  # one thought for the whole chain
        thought_tokens = decision.think * thinking_groups
        if thought_tokens > self.settings.max_thought_tokens:
            raise RequestError(
                f"think: {decision.think} tokens for each of {thinking_groups} canvases is {thought_tokens} thought "
                f"tokens; this server writes at most {self.settings.max_thought_tokens} per request",
                ("think",), status=400,
            )
        canvases = group_count * decision.samples.count
        options = sum(len(q.alternatives) for q in decision.questions)
        small = (not decision.images and len(decision.state_text) <= SMALL_STATE_CHARS
                 and options <= SMALL_OPTIONS and canvases <= SMALL_CANVASES)
        return Plan(fmt, labels, layered, chained, canvases, thought_tokens, small)

    def labels_for(self, question: Question, fmt: str) -> tuple[str, ...]:
        count = len(question.alternatives)
        labels = self.templates.labels(question.kind.label_candidates(count), count, fmt)
        if len(labels) < count:
            raise RequestError(
                f"question '{question.qid}': this model's tokenizer has single-token labels for "
                f"{len(labels)} alternatives, not {count}",
                ("questions", question.qid, "criteria"),
            )
        return labels

    def split(self, decision: Decision, fmt: str, labels: dict[str, tuple[str, ...]], asked: Sequence[Question],
              conditioned: bool, chained: bool) -> list[list[Question]]:
        """A stage's asked questions in canvases (groups), in order."""
        continues = chained and not decision.images and (conditioned or decision.sequential)
        lead = JOIN[fmt] if continues else ""
        limit = min(decision.chunk_rows or self.settings.canvas_length, self.settings.canvas_length)

        def rows(questions: Sequence[Question]) -> int:
            items = [TemplateItem(q.qid, q.model_id, labels[q.qid]) for q in questions]
            return self.templates.rows(self.prompts.head_length, lead, fmt, items)

        return groups(asked, rows, limit, decision.isolate)


class _Run:
    """One decision in flight: the async flow over stages and groups. The synchronous pieces
    (prompts, templates, canvases, estimates) are plain methods handed to `offload`."""

    def __init__(self, decider: Decider, decision: Decision, plan: Plan) -> None:
        self.decider = decider
        self.d = decision
        self.plan = plan
        self.reader = decider.reader
        self.tok = decider.tokenizer
        self.prompts = decider.prompts
        self.offload: Offload = _inline if plan.small else decider.offload
        self.image_state = bool(decision.images)
        self.answered: dict[str, str | None] = {}  # qid -> the chosen alternative's name; None = skipped
        self.skipped: dict[str, Skip] = {}
        self.stages_read: list[list[str]] = []
        self.done: list[GroupResult] = []
        self.conditioning = _Conditioning()
        self.chain: _Chain | None = None
        self.next_index = 0

    async def run(self) -> Outcome:
        started = time.monotonic()
        if self.plan.chained and not self.image_state:
            self.chain = await self.text_chain()
        for stage in self.plan.stages:
            asked: list[Question] = []
            for question in stage:
                skip = gate(question, self.answered)
                if skip is None:
                    asked.append(question)
                else:
                    self.skipped[question.qid] = skip
                    self.answered[question.qid] = None
            if asked:
                self.stages_read.append([q.qid for q in asked])
                await self.run_stage(asked)
        return await self.offload(
            assemble, self.d, self.plan, self.done, self.skipped, self.stages_read,
            self.chain.thought if self.chain else None, self.chain.thought_tokens if self.chain else 0,
            self.reader.info.engine, time.monotonic() - started,
        )

    # ------------------------------------------------------------------ prompts (synchronous)

    def full_system(self) -> str:
        """Every question of the request, even those left out by `ask` (the sheet stays one prefix)."""
        chunked = self.image_state and self.plan.chained
        return system_text(self.d.questions, self.plan.labels, self.plan.fmt, self.d.instructions, chunked)

    def group_system(self, questions: Sequence[Question], chunked: bool) -> str:
        """An unchained group lists only its own questions, unless `chunk_prompt` is shared."""
        if self.d.chunk_prompt == "shared":
            return system_text(self.d.questions, self.plan.labels, self.plan.fmt, self.d.instructions, chunked)
        return system_text(questions, self.plan.labels, self.plan.fmt, self.d.instructions, False)

    def check_length(self, prompt_ids: Sequence[int]) -> None:
        """A prompt past the limit is refused before any template work (images are measured by the
        engine, which checks again)."""
        limit = self.decider.settings.max_prompt_tokens
        if len(prompt_ids) > limit:
            raise EngineInputError(
                f"the prompt is {len(prompt_ids)} tokens; this server reads at most {limit}",
                status=400, param="state", error_type="max_tokens_exceeded",
            )

    def canvas(self, head: tuple[int, ...], lead: str, questions: Sequence[Question]) -> Canvas:
        items = [TemplateItem(q.qid, q.model_id, self.plan.labels[q.qid]) for q in questions]
        template = self.decider.templates.resolve(head, lead, self.plan.fmt, items)
        settings = self.decider.settings
        return build_canvas(template, self.tok.turn_close_id, self.tok.pad_id, settings.canvas_length,
                            settings.canvas_step)

    def spec(self, prompt: Prompt, canvas: Canvas, draws: range) -> ReadSpec:
        seeds = draw_seeds(self.d.seed, canvas, draws)
        canvases = tuple(noised(canvas, s, self.tok.vocab_size) for s in seeds)
        return ReadSpec(prompt, canvases, canvas.slots, canvas.label_ids, self.d.steps, seeds[0])

    # ------------------------------------------------------------------ the flow

    async def text_chain(self) -> _Chain:
        """A chained text decision continues one prompt: the full question sheet, then (with
        `think`) one thought written for the whole decision, then the answers so far."""
        if self.d.think > 0:
            prompt = await self.offload(self.prompts.thinking, self.full_system(), self.d.state_text, 0)
            self.check_length(prompt)
            thought, info = await self.write_thought(prompt, self.d.think)
            return _Chain(prompt + thought + self.prompts.closing, info, len(thought))
        prefix = await self.offload(lambda: self.prompts.with_scaffold(self.full_system(), self.d.state_text, 0))
        return _Chain(prefix)

    async def write_thought(self, prompt_ids: tuple[int, ...], budget: int) -> tuple[tuple[int, ...], dict]:
        started = time.monotonic()
        spec = GenerateSpec(prompt=Prompt(prompt_ids, self.d.images), max_tokens=budget,
                            stop_ids=self.prompts.stop_ids(), seed=content_seed(self.d.seed, prompt_ids))
        result = await self.reader.generate(spec)
        info = {
            "tokens": len(result.ids),
            "closed": result.stopped,
            "ms": round((time.monotonic() - started) * 1000, 1),
            "text": self.tok.decode(result.ids),
        }
        return result.ids, info

    async def run_stage(self, asked: list[Question]) -> None:
        conditioned = bool(self.conditioning.prefill)
        split = await self.offload(self.decider.split, self.d, self.plan.fmt, self.plan.labels, asked,
                                   conditioned, self.plan.chained)
        chunked = len(split) > 1
        if self.d.sequential or len(split) == 1:
            for questions in split:
                group_conditioned = conditioned or (self.d.sequential and bool(self.conditioning.prefill))
                self.absorb(await self.run_group(questions, self.take_index(), group_conditioned, chunked))
            return
        indexed = [(questions, self.take_index()) for questions in split]
        results = await gather_or_cancel([self.run_group(q, index, conditioned, chunked) for q, index in indexed])
        for result in results:
            self.absorb(result)

    def take_index(self) -> int:
        self.next_index += 1
        return self.next_index - 1

    def absorb(self, group: GroupResult) -> None:
        self.done.append(group)
        items = []
        for question in group.questions:
            top = group.estimates[question.qid].top
            self.answered[question.qid] = question.alternatives[top].name
            items.append((question.model_id, self.plan.labels[question.qid][top]))
            self.conditioning.restated.append(f"{question.model_id}: {question.alternatives[top].name}")
        self.conditioning.prefill.append(answer_text(items, self.plan.fmt))

    async def run_group(self, questions: list[Question], index: int, conditioned: bool, chunked: bool) -> GroupResult:
        # With `isolate`, an unchained canvas with its own question sheet reads its question as if it
        # were asked alone (q1). A shared sheet lists every question under its own number, so the
        # canvas keeps that number too.
        alone = self.d.isolate and not self.plan.chained and self.d.chunk_prompt == "own"
        shown = [dataclasses.replace(q, position=1) for q in questions] if alone else questions
        thought: dict | None = None
        thought_tokens = 0
        head: tuple[int, ...] = ()
        lead = ""
        images = len(self.d.images)
        if not self.image_state and self.chain is not None:
            if conditioned:
                lead = JOIN[self.plan.fmt]
                joined = lead.join(self.conditioning.prefill)
                prompt_ids = self.chain.prefix + tuple(await self.offload(self.tok.encode, joined))
            elif self.chain.thought is not None:
                prompt_ids = self.chain.prefix
            else:
                prompt_ids, head = await self.offload(lambda: self.prompts.plain(self.full_system(), self.d.state_text, 0))
        elif not self.image_state:
            system = await self.offload(self.group_system, shown, chunked)
            if self.d.think > 0:
                prompt = await self.offload(self.prompts.thinking, system, self.d.state_text, 0)
                self.check_length(prompt)
                ids, thought = await self.write_thought(prompt, self.d.think)
                thought_tokens = len(ids)
                prompt_ids = prompt + ids + self.prompts.closing
            else:
                prompt_ids, head = await self.offload(self.prompts.plain, system, self.d.state_text, 0)
        else:
            user = restated_state(self.d.state_text, self.conditioning.restated) if conditioned else self.d.state_text
            system = await self.offload(self.full_system) if self.plan.chained else await self.offload(
                self.group_system, shown, chunked)
            if self.d.think > 0 and not conditioned:
                prompt_ids, head, thought, thought_tokens = await self.image_thought(shown, system, user)
            else:
                prompt_ids, head = await self.offload(self.prompts.plain, system, user, images)
        self.check_length(prompt_ids)
        canvas = await self.offload(self.canvas, head, lead, shown)
        result = await self.read(questions, canvas, Prompt(prompt_ids, self.d.images))
        return dataclasses.replace(result, index=index, thought=thought, thought_tokens=thought_tokens)

    async def image_thought(
        self, questions: Sequence[Question], system: str, user: str
    ) -> tuple[tuple[int, ...], tuple[int, ...], dict, int]:
        """With an image in the prompt the thought is written with the image in view, then seeded
        into the read's canvas ahead of the answer, so the canvas bounds its length."""
        items = [TemplateItem(q.qid, q.model_id, self.plan.labels[q.qid]) for q in questions]
        answer_rows = await self.offload(self.decider.templates.rows, 0, "", self.plan.fmt, items) - 1
        opening, closing = self.prompts.opening, self.prompts.closing
        fits = self.decider.settings.canvas_length - 1 - len(opening) - len(closing) - answer_rows
        if fits < MIN_THOUGHT_ROWS:
            raise RequestError(f"think: the canvas leaves {max(fits, 0)} rows for a thought beside this template", ("think",))
        budget = min(self.d.think, fits)
        images = len(self.d.images)
        thought_ids, info = await self.write_thought(
            await self.offload(self.prompts.thinking, system, user, images), budget)
        info["budget"] = budget
        prompt = await self.offload(self.prompts.thinking_open, system, user, images)
        return prompt, opening + thought_ids + closing, info, len(thought_ids)

    async def checked_read(self, spec: ReadSpec) -> list[ReadResult]:
        results = await self.reader.read([spec])
        check_result(spec, results)
        return results

    async def read(self, questions: list[Question], canvas: Canvas, prompt: Prompt) -> GroupResult:
        """The group's draws: `samples` fixed, or `auto`: one read, and the rest only when a
        question's renormalised label distribution is unsure (entropy above the threshold)."""
        policy = self.d.samples
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
        estimates, tops = await self.offload(estimate, questions, results, canvas.slots, canvas.label_ids)
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


async def _inline(fn: Callable[..., Any], *args: Any) -> Any:
    return fn(*args)


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


__all__ = ["Decider"]
