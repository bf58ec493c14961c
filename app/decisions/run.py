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
import time
from typing import Sequence

from app.decisions.calibration import Calibration
from app.decisions.canvas import Canvas, build_canvas
from app.decisions.errors import RequestError
from app.decisions.estimate import Adjust
from app.decisions.group_prompt import Chain, Conditioning, GroupPrompts
from app.decisions.labels import LabelAlphabets
from app.decisions.outcome import GroupResult, Outcome, assemble
from app.decisions.plan import Plan, Skip, gate, groups, stages
from app.decisions.prompt import ChatPrompts
from app.decisions.questions import Question
from app.decisions.reading import Draws, Offload, ReadSettings, inline
from app.decisions.request import Decision
from app.decisions.template import JOIN, LINES, TemplateItem, Templates, answer_format, answer_text
from app.engine.base import Prompt, Reader, gather_or_cancel

# A decision within these bounds plans, templates and estimates in well under a millisecond each, less
# than a trip to a worker thread, so its synchronous pieces run inline (docs/reliability.md).
SMALL_STATE_CHARS = 8 * 1024
SMALL_OPTIONS = 64
SMALL_CANVASES = 16


class Decider:
    """Runs decisions for one reader. Holds the template and label caches for the reader's tokenizer.

    `offload(fn, *args)` runs synchronous work off the event loop (default: `asyncio.to_thread`;
    the server passes its own bounded pool). `calibration`, when given, changes every read before
    its answers are formed (a fitted calibration, `djev serve --calibration`)."""

    def __init__(self, reader: Reader, settings: ReadSettings, templates: Templates | None = None,
                 offload: Offload | None = None, calibration: Calibration | None = None) -> None:
        self.reader = reader
        self.settings = settings
        self.tokenizer = reader.tokenizer
        self.templates = templates or Templates(reader.tokenizer)
        self.alphabets = LabelAlphabets(reader.tokenizer)
        self.prompts = ChatPrompts(reader.tokenizer, settings.thought_in_prompt)
        self.offload: Offload = offload or asyncio.to_thread
        self.calibration = calibration

    async def decide(self, decision: Decision, plan: Plan | None = None, adjust: Adjust | None = None) -> Outcome:
        """Run a decision; `plan` is `self.plan(decision)` when the caller already made it (the
        server plans in its worker pool to price the decision before admitting it). `adjust`, when
        given, is every read's adjustment in place of the calibration (`djev calibrate` records the
        raw reads with one that changes nothing)."""
        if plan is None:
            plan = await self.offload(self.plan, decision)
        calibration = None if adjust is not None else self.calibration_for(decision)
        if calibration is not None:
            adjust = calibration.adjust
        return await _Run(self, decision, plan, adjust, calibration.identity() if calibration else None).run()

    def calibration_for(self, decision: Decision) -> Calibration | None:
        """The calibration that applies to this decision: the server's, when the decision is read
        in the option order it was fitted under (a request may ask for another debias mode)."""
        calibration = self.calibration
        if calibration is None:
            return None
        mode = getattr(decision, "debias", None)
        if mode is not None and str(mode) != calibration.fitted_for.debias:
            return None
        return calibration

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
        labels = self.alphabets.labels(question.kind.label_candidates(count), count, fmt)
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
    """One decision in flight: the flow over stages and groups, gating by `ask_if`, and what later
    stages read of earlier ones. Prompts come from `GroupPrompts`, reads from `Draws`."""

    def __init__(self, decider: Decider, decision: Decision, plan: Plan, adjust: Adjust | None = None,
                 calibration: dict | None = None) -> None:
        self.decider = decider
        self.d = decision
        self.plan = plan
        self.offload: Offload = inline if plan.small else decider.offload
        self.prompts = GroupPrompts(decision, plan, decider.prompts, decider.templates, decider.settings,
                                    decider.reader, self.offload)
        self.draws = Draws(decider.reader, self.offload, decision.seed, decision.steps, decider.tokenizer.vocab_size,
                           adjust)
        self.calibration = calibration  # what diagnostics say of the calibration applied: its file and hash
        self.answered: dict[str, str | None] = {}  # qid -> the chosen alternative's name; None = skipped
        self.skipped: dict[str, Skip] = {}
        self.stages_read: list[list[str]] = []
        self.done: list[GroupResult] = []
        self.conditioning = Conditioning()
        self.chain: Chain | None = None
        self.next_index = 0

    async def run(self) -> Outcome:
        started = time.monotonic()
        if self.plan.chained and not self.d.images:
            self.chain = await self.prompts.text_chain()
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
            self.decider.reader.info.engine, time.monotonic() - started, self.calibration,
        )

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
        prompt = await self.prompts.for_group(shown, self.conditioning, conditioned, chunked, self.chain)
        canvas = await self.offload(self.canvas, prompt.head, prompt.lead, shown)
        result = await self.draws.read(questions, canvas, Prompt(prompt.ids, self.d.images), self.d.samples)
        return dataclasses.replace(result, index=index, thought=prompt.thought, thought_tokens=prompt.thought_tokens)

    def canvas(self, head: tuple[int, ...], lead: str, questions: Sequence[Question]) -> Canvas:
        items = [TemplateItem(q.qid, q.model_id, self.plan.labels[q.qid]) for q in questions]
        template = self.decider.templates.resolve(head, lead, self.plan.fmt, items)
        tok, settings = self.decider.tokenizer, self.decider.settings
        return build_canvas(template, tok.turn_close_id, tok.pad_id, settings.canvas_length, settings.canvas_step)


__all__ = ["Decider"]
