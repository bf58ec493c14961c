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
from dataclasses import dataclass, field
from typing import Sequence

from app.decisions.calibration import Calibration
from app.decisions.canvas import Canvas, build_canvas
from app.decisions.debias import (
    PRIOR_DRAWS,
    PRIOR_SEED,
    Cost,
    Order,
    PriorCache,
    combine,
    mean_prior,
    prior_adjust,
    reversed_scales,
    rotation_count,
    shown_labels,
    shown_orders,
    shown_question,
)
from app.decisions.errors import RequestError
from app.decisions.estimate import Adjust
from app.decisions.group_prompt import Chain, Conditioning, GroupPrompt, GroupPrompts
from app.decisions.labels import LabelAlphabets
from app.decisions.outcome import GroupResult, Outcome, assemble
from app.decisions.plan import Plan, Skip, gate, groups, stages
from app.decisions.prompt import ChatPrompts
from app.decisions.questions import Question, softmax
from app.decisions.reading import Draws, Offload, ReadSettings, inline
from app.decisions.request import Decision
from app.decisions.template import JOIN, LINES, TemplateItem, Templates, answer_format, answer_text
from app.engine.base import Prompt, Reader, gather_or_cancel

# A decision within these bounds plans, templates and estimates in well under a millisecond each, less
# than a trip to a worker thread, so its synchronous pieces run inline (docs/reliability.md). Images
# do not count: the pieces read only how many there are (each is one placeholder id; the engine
# decodes and hashes them off the loop), and a walk frame's five hops to the worker pool cost the
# server 0.9 ms of CPU more than the pieces themselves (docs/benchmarks.md, bench_overhead).
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
        self.priors = PriorCache()  # `debias` with `prior`: each sheet's content-free read
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
        if decision.debias.mode != calibration.fitted_for.debias:
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
        group_count = 0  # prompts of the state: each group once, or once per rotation under `rotate`
        thinking_groups = 0
        for number, stage in enumerate(layered):
            conditioned = number > 0 or decision.sequential
            count = sum(self.rotations(decision, group, chained)
                        for group in self.split(decision, fmt, labels, stage, conditioned, chained))
            group_count += count
            if decision.think and image_state and number == 0:
                thinking_groups += count  # later image stages are restated, without a thought
            elif decision.think and not image_state and not chained:
                thinking_groups += count
        if decision.think and chained and not image_state:
            # one thought for the whole chain (one per rotation: each lists the options its own way)
            thinking_groups = self.rotations(decision, decision.questions, chained)
        thought_tokens = decision.think * thinking_groups
        if thought_tokens > self.settings.max_thought_tokens:
            raise RequestError(
                f"think: {decision.think} tokens for each of {thinking_groups} canvases is {thought_tokens} thought "
                f"tokens; this server writes at most {self.settings.max_thought_tokens} per request",
                ("think",), status=400,
            )
        # each prompt of the state reads its draws; with `prior`, each may read its sheet's prior once
        canvases = group_count * (decision.samples.count + PRIOR_DRAWS * decision.debias.prior)
        options = sum(len(q.alternatives) for q in decision.questions)
        small = len(decision.state_text) <= SMALL_STATE_CHARS and options <= SMALL_OPTIONS and canvases <= SMALL_CANVASES
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

    def rotations(self, decision: Decision, questions: Sequence[Question], chained: bool) -> int:
        """Prompts a group of `questions` is read in: K under `rotate` (over the questions its sheet
        lists: the whole request's when chained or shared), else 1."""
        if decision.debias.order != "rotate":
            return 1
        listed = decision.questions if chained or decision.chunk_prompt == "shared" else questions
        return rotation_count(listed, self.settings.debias_rotations)

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


@dataclass
class _View:
    """One listing of the decision's options (docs/quality.md): each listed question's shown order,
    the labels as shown, the prompts built over them, and, in a chained decision, its own chain and
    the earlier answers written as this listing labels them. `off` has one view, the caller's order."""

    orders: dict[str, Order]  # qid -> shown order; a question absent is shown in the caller's order
    labels: dict[str, tuple[str, ...]]  # every question's labels as this listing shows them
    prompts: GroupPrompts
    conditioning: Conditioning = field(default_factory=Conditioning)
    chain: Chain | None = None

    def shown(self, question: Question) -> Question:
        return shown_question(question, self.orders.get(question.qid))


@dataclass(frozen=True)
class _ViewRead:
    """One view's read of a group: its estimates in shown order, the prompt, whether a prior was read."""

    result: GroupResult
    prompt: GroupPrompt
    prior_fresh: bool | None  # None: no prior; True: read now; False: found in the cache


class _Run:
    """One decision in flight: the flow over stages and groups, gating by `ask_if`, and what later
    stages read of earlier ones. Prompts come from `GroupPrompts`, reads from `Draws`. Under
    `debias` each group is read in every view (listing) of its sheet and mapped back (`combined`)."""

    def __init__(self, decider: Decider, decision: Decision, plan: Plan, adjust: Adjust | None = None,
                 calibration: dict | None = None) -> None:
        self.decider = decider
        self.d = decision
        self.plan = plan
        self.offload: Offload = inline if plan.small else decider.offload
        self.by_id = {q.qid: q for q in decision.questions}
        self.draws = Draws(decider.reader, self.offload, decision.seed, decision.steps, decider.tokenizer.vocab_size,
                           adjust)
        # the label prior comes from the content-free read's raw log-probabilities (mean_prior), never
        # through an adjustment: the calibration acts on a read after the prior is divided out
        self.prior_draws = dataclasses.replace(self.draws, seed=PRIOR_SEED)
        self.calibration = calibration  # what diagnostics say of the calibration applied: its file and hash
        self.engine_s = 0.0  # the longest a group waited for its reads (the engine's queue and turns), seconds
        self.answered: dict[str, str | None] = {}  # qid -> the chosen alternative's name; None = skipped
        self.skipped: dict[str, Skip] = {}
        self.stages_read: list[list[str]] = []
        self.done: list[GroupResult] = []
        self.chained_views: list[_View] = []  # a chained decision's views, over the whole sheet
        self.shared_views: list[_View] | None = None  # unchained with a shared sheet
        self.next_index = 0

    def orders(self, listed: Sequence[Question]) -> list[dict[str, Order]]:
        return shown_orders(self.d.debias.order, listed, self.decider.settings.debias_rotations)

    def view(self, orders: dict[str, Order], whole_sheet: bool) -> _View:
        """A view's prompts: the decision as this listing shows it (every question when the sheet
        lists the whole request, else only the labels of the group's own questions change)."""
        decision, plan = self.d, self.plan
        if orders:
            labels = dict(plan.labels)
            for qid, order in orders.items():
                labels[qid] = shown_labels(self.by_id[qid], labels[qid], order)
            plan = dataclasses.replace(plan, labels=labels)
            if whole_sheet:
                decision = dataclasses.replace(
                    decision, questions=tuple(shown_question(q, orders.get(q.qid)) for q in decision.questions))
        prompts = GroupPrompts(decision, plan, self.decider.prompts, self.decider.templates, self.decider.settings,
                               self.decider.reader, self.offload)
        return _View(orders, plan.labels, prompts)

    def views_for(self, questions: Sequence[Question]) -> list[_View]:
        if self.plan.chained:
            return self.chained_views
        if self.d.chunk_prompt == "shared":
            if self.shared_views is None:
                self.shared_views = [self.view(orders, True) for orders in self.orders(self.d.questions)]
            return self.shared_views
        return [self.view(orders, False) for orders in self.orders(questions)]

    async def run(self) -> Outcome:
        started = time.monotonic()
        if self.plan.chained:
            self.chained_views = [self.view(orders, True) for orders in self.orders(self.d.questions)]
            if not self.d.images:
                chains = await gather_or_cancel([view.prompts.text_chain() for view in self.chained_views])
                for view, chain in zip(self.chained_views, chains):
                    view.chain = chain
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
        thought, thought_tokens = self.chain_thought()
        return await self.offload(
            assemble, self.d, self.plan, self.done, self.skipped, self.stages_read, thought, thought_tokens,
            self.decider.reader.info.engine, time.monotonic() - started, self.calibration, self.engine_s,
        )

    def chain_thought(self) -> tuple[dict | list | None, int]:
        """A chained text decision's thought: its one chain's, or (`rotate`) every view's."""
        chains = [view.chain for view in self.chained_views if view.chain is not None]
        if len(chains) <= 1:
            return (chains[0].thought, chains[0].thought_tokens) if chains else (None, 0)
        thoughts = [chain.thought for chain in chains]
        return (thoughts if any(t is not None for t in thoughts) else None), sum(c.thought_tokens for c in chains)

    async def run_stage(self, asked: list[Question]) -> None:
        conditioned = bool(self.done)  # earlier groups' answers exist
        split = await self.offload(self.decider.split, self.d, self.plan.fmt, self.plan.labels, asked,
                                   conditioned, self.plan.chained)
        chunked = len(split) > 1
        if self.d.sequential or len(split) == 1:
            for questions in split:
                group_conditioned = conditioned or (self.d.sequential and bool(self.done))
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
        """Record a group's answers; a chained decision's views continue them, each in its own labels."""
        self.done.append(group)
        items: list[list[tuple[str, str]]] = [[] for _ in self.chained_views]
        for question in group.questions:
            top = group.estimates[question.qid].top
            name = question.alternatives[top].name
            self.answered[question.qid] = name
            for view, entries in zip(self.chained_views, items):
                order = view.orders.get(question.qid)
                shown_top = top if order is None else order.index(top)
                entries.append((question.model_id, view.labels[question.qid][shown_top]))
                view.conditioning.restated.append(f"{question.model_id}: {name}")
        for view, entries in zip(self.chained_views, items):
            view.conditioning.prefill.append(answer_text(entries, self.plan.fmt))

    async def run_group(self, questions: list[Question], index: int, conditioned: bool, chunked: bool) -> GroupResult:
        # With `isolate`, an unchained canvas with its own question sheet reads its question as if it
        # were asked alone (q1). A shared sheet lists every question under its own number, so the
        # canvas keeps that number too.
        alone = self.d.isolate and not self.plan.chained and self.d.chunk_prompt == "own"
        views = self.views_for(questions)
        if len(views) == 1:
            reads = [await self.read_view(views[0], questions, alone, conditioned, chunked)]
        else:  # every rotation's prompt at once: the reader batches them into shared passes
            reads = await gather_or_cancel([self.read_view(view, questions, alone, conditioned, chunked)
                                            for view in views])
        if self.d.debias.off:
            result, prompt = reads[0].result, reads[0].prompt
            return dataclasses.replace(result, questions=tuple(questions), index=index, thought=prompt.thought,
                                       thought_tokens=prompt.thought_tokens)
        return await self.offload(self.combined, questions, index, views, reads)

    async def read_view(self, view: _View, questions: list[Question], alone: bool, conditioned: bool,
                        chunked: bool) -> _ViewRead:
        shown = [view.shown(q) for q in questions]
        if alone:
            shown = [dataclasses.replace(q, position=1) for q in shown]
        prompt = await view.prompts.for_group(shown, view.conditioning, conditioned, chunked, view.chain)
        canvas = await self.offload(self.canvas, prompt.head, prompt.lead, shown, view.labels)
        adjust: Adjust | None = None
        fresh: bool | None = None
        if self.d.debias.prior:
            adjust, fresh = await self.prior(view, shown, conditioned, chunked)
        begun = time.monotonic()
        result = await self.draws.read(shown, canvas, Prompt(prompt.ids, self.d.images), self.d.samples, adjust)
        self.engine_s = max(self.engine_s, time.monotonic() - begun)
        return _ViewRead(result, prompt, fresh)

    async def prior(self, view: _View, shown: list[Question], conditioned: bool, chunked: bool) -> tuple[Adjust, bool]:
        """The sheet's label prior, divided out of every read of it: one read of the group's prompt
        with a content-free state, kept in the Decider's LRU by that prompt and canvas."""
        free = await self.offload(view.prompts.content_free, shown, view.conditioning, conditioned, chunked)
        canvas = await self.offload(self.canvas, free.head, free.lead, shown, view.labels)
        key = (free.ids, canvas.ids, self.d.steps)
        found = self.decider.priors.get(key)
        fresh = found is None
        if found is None:
            spec = await self.offload(self.prior_draws.spec, Prompt(free.ids), canvas, range(PRIOR_DRAWS))
            (result,) = await self.prior_draws.checked_read(spec)
            found = mean_prior([[softmax(slot.label_logprobs) for slot in draw] for draw in result.slots])
            self.decider.priors.put(key, found)
        return prior_adjust({q.qid: prior for q, prior in zip(shown, found)}), fresh

    def combined(self, questions: list[Question], index: int, views: list[_View], reads: list[_ViewRead]) -> GroupResult:
        """A group's views mapped back to the caller's order and averaged by option name."""
        estimates = {}
        for question in questions:
            identity = tuple(range(len(question.alternatives)))
            orders = [view.orders.get(question.qid, identity) for view in views]
            estimates[question.qid] = combine([read.result.estimates[question.qid] for read in reads], orders)
        results = [read.result for read in reads]
        prompts = [read.prompt for read in reads]
        policy = results[0].policy
        if len(results) > 1:  # per rotation
            policy = {**policy, "extended": [r.policy["extended"] for r in results],
                      "first_read_entropy": [r.policy["first_read_entropy"] for r in results]}
        thoughts = [prompt.thought for prompt in prompts]
        thought: dict | list | None = thoughts[0] if len(thoughts) == 1 else (
            thoughts if any(t is not None for t in thoughts) else None)
        cost = Cost(
            rotations=len(views),
            reads=sum(2 if r.policy.get("extended") else 1 for r in results),
            canvases=sum(r.draws for r in results),
            prior_reads=sum(1 for read in reads if read.prior_fresh),
            prior_cached=sum(1 for read in reads if read.prior_fresh is False),
            reversed_scales=reversed_scales(questions, views[0].orders),  # the canonical listing's
        )
        return GroupResult(
            questions=tuple(questions), index=index, estimates=estimates,
            tops=[top for r in results for top in r.tops], policy=policy,
            draws=sum(r.draws for r in results), rows=sum(r.rows for r in results),
            prompt_tokens=max(r.prompt_tokens for r in results), thought=thought,
            thought_tokens=sum(prompt.thought_tokens for prompt in prompts), cost=cost,
        )

    def canvas(self, head: tuple[int, ...], lead: str, questions: Sequence[Question],
               labels: dict[str, tuple[str, ...]]) -> Canvas:
        items = [TemplateItem(q.qid, q.model_id, labels[q.qid]) for q in questions]
        template = self.decider.templates.resolve(head, lead, self.plan.fmt, items)
        tok, settings = self.decider.tokenizer, self.decider.settings
        return build_canvas(template, tok.turn_close_id, tok.pad_id, settings.canvas_length, settings.canvas_step)


__all__ = ["Decider"]
