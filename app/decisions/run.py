"""Executing a decision against a Reader: stages, groups, noise draws, `auto`, think, conditioning.

The decision is read stage by stage. Each stage's asked questions are packed into groups (one
canvas each); groups of a stage run concurrently and the reader batches their canvases into shared
decoder passes, unless `sequential` asks for one after another. Later stages are conditioned on the
earlier answers: a text state continues the same prompt with the answers prefilled (a prefix the
engine has cached), an image state is read afresh with the answers restated in its text.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from dataclasses import dataclass, field
from typing import Sequence

from app.decisions.errors import RequestError
from app.decisions.plan import Skip, gate, groups, stages
from app.decisions.prompt import restated_state, system_text
from app.decisions.questions import Question, entropy, softmax, top_index
from app.decisions.request import Decision
from app.decisions.template import JOIN, Template, TemplateItem, Templates, answer_format, answer_text
from app.engine.base import GenerateSpec, Prompt, Reader, ReadResult, ReadSpec

# Seed strides of the reference: draw j of a group reads with seed s + 7919·j, group k of a
# decision with base + 104729·k. Both are primes, so draws never collide across groups.
SAMPLE_SEED_STRIDE = 7919
GROUP_SEED_STRIDE = 104729
MIN_THOUGHT_ROWS = 8


@dataclass(frozen=True)
class ReadSettings:
    """How decisions are read; built by `app.config.Settings.read_settings` (the defaults live there)."""

    canvas_length: int  # the widest canvas a read may use
    canvas_step: int  # canvas widths are rounded up to a multiple of this
    thought_in_prompt: bool  # the empty thought block ends the prompt instead of opening the canvas
    max_prompt_tokens: int  # a prompt past this is refused before any template work
    max_thought_tokens: int  # think x the groups that think, per request


@dataclass(frozen=True)
class Outcome:
    answers: dict[str, dict | None]  # the asked questions, request order; None = skipped by ask_if
    internal_answers: dict[str, dict | None]  # the same in the reference's own shape (the chat form)
    input_tokens: int
    output_tokens: int
    diagnostics: dict
    summary: str  # one log line


@dataclass
class _Group:
    questions: list[Question]
    index: int
    chunked: bool  # its stage has several groups (a shared prompt then says a reply may be partial)
    probs: dict[str, list[float]] = field(default_factory=dict)
    top: dict[str, int] = field(default_factory=dict)
    rows: int = 0
    reads: int = 0
    thought: dict | None = None
    thought_tokens: int = 0
    samples: dict = field(default_factory=dict)
    prompt_tokens: int | None = None
    question_diagnostics: dict = field(default_factory=dict)


def noised(canvas: Sequence[int], slots: Sequence[int], seed: int, vocab_size: int) -> tuple[int, ...]:
    """The canvas with each slot replaced by a uniformly drawn id (seeded, question order)."""
    rng = random.Random(seed)
    out = list(canvas)
    for slot in slots:
        out[slot] = rng.randrange(vocab_size)
    return tuple(out)


class Decider:
    """Runs decisions for one reader. Holds the template cache for the reader's tokenizer."""

    def __init__(self, reader: Reader, settings: ReadSettings, templates: Templates | None = None):
        self.reader = reader
        self.settings = settings
        self.tokenizer = reader.tokenizer
        self.templates = templates or Templates(reader.tokenizer)
        tok = self.tokenizer
        self.scaffold = tuple(tok.thought_open) + tuple(tok.thought_close)

    async def decide(self, decision: Decision) -> Outcome:
        return await _Run(self, decision).run()

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


class _Run:
    """One decision in flight (per-decision state lives here, nowhere else)."""

    def __init__(self, decider: Decider, decision: Decision) -> None:
        self.decider = decider
        self.d = decision
        self.reader = decider.reader
        self.tok = decider.tokenizer
        self.settings = decider.settings
        self.fmt = answer_format(len(decision.questions))
        self.labels = {q.qid: decider.labels_for(q, self.fmt) for q in decision.questions}
        self.image_state = bool(decision.images)
        self.asked = decision.asked()
        self.stage_list = stages(self.asked)
        self.chained = len(self.stage_list) > 1 or decision.sequential
        self.answer_names: dict[str, str | None] = {}
        self.results: dict[str, _Group] = {}
        self.skipped: dict[str, Skip] = {}
        self.stages_read: list[list[str]] = []
        self.chunks: list[list[str]] = []
        self.groups_done: list[_Group] = []
        self.lines: list[str] = []  # absorbed answer texts (labels), for prefill
        self.earlier: list[str] = []  # absorbed "q1: name" entries, for restatement
        self.next_group = 0
        self.base_prefix: tuple[int, ...] | None = None
        self.decision_thought: dict | None = None
        self.decision_thought_tokens = 0

    # ------------------------------------------------------------------ prompts

    def system(self, questions: Sequence[Question], chunked: bool) -> str:
        return system_text(questions, self.labels, self.fmt, self.d.instructions, chunked)

    def full_system(self) -> str:
        # Every question of the request, even those left out by `ask` (the sheet stays one prefix).
        return self.system(self.d.questions, chunked=self.image_state and self.chained)

    def plain_prompt(self, system: str, user: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(prompt ids, canvas head) for a read with no thought: the empty thought block ends the
        prompt, or opens the canvas, as the server is set."""
        ids = tuple(self.tok.render_chat(system, user, len(self.d.images), thinking=False))
        scaffold = self.decider.scaffold
        ends_with_scaffold = ids[-len(scaffold):] == scaffold
        if self.settings.thought_in_prompt:
            return (ids if ends_with_scaffold else ids + scaffold), ()
        return (ids[: -len(scaffold)] if ends_with_scaffold else ids), scaffold

    def thinking_prompt(self, system: str, user: str) -> tuple[int, ...]:
        """The prompt with thinking on, ending with an open thought channel."""
        ids = tuple(self.tok.render_chat(system, user, len(self.d.images), thinking=True))
        opening = tuple(self.tok.thought_open)
        return ids if ids[-len(opening):] == opening else ids + opening

    async def write_thought(self, prompt_ids: tuple[int, ...], budget: int, seed: int) -> tuple[tuple[int, ...], dict]:
        started = time.monotonic()
        stops = tuple(self.tok.thought_close) + (self.tok.turn_close_id,)
        result = await self.reader.generate(
            GenerateSpec(prompt=Prompt(prompt_ids, self.d.images), max_tokens=budget, stop_ids=stops, seed=seed)
        )
        info = {
            "tokens": len(result.ids),
            "closed": result.stopped,
            "ms": round((time.monotonic() - started) * 1000, 1),
            "text": self.tok.decode(result.ids),
        }
        return result.ids, info

    # ------------------------------------------------------------------ the decision

    async def run(self) -> Outcome:
        started = time.monotonic()
        if self.chained and not self.image_state:
            await self.prepare_text_chain()
        for stage in self.stage_list:
            asked: list[Question] = []
            for question in stage:
                skip = gate(question, self.answer_names)
                if skip is None:
                    asked.append(question)
                else:
                    self.skipped[question.qid] = skip
                    self.answer_names[question.qid] = None
            if not asked:
                continue
            self.stages_read.append([q.qid for q in asked])
            await self.run_stage(asked)
        return self.outcome(started)

    async def prepare_text_chain(self) -> None:
        """A chained text decision continues one prompt: the full question sheet, then (with
        `think`) one thought written for the whole decision, then the answers so far."""
        system = self.full_system()
        if self.d.think > 0:
            prompt = self.thinking_prompt(system, self.d.state_text)
            thought, info = await self.write_thought(prompt, self.d.think, self.d.seed)
            self.base_prefix = prompt + thought + tuple(self.tok.thought_close)
            self.decision_thought = info
            self.decision_thought_tokens = len(thought)
        else:
            ids = tuple(self.tok.render_chat(system, self.d.state_text, 0, thinking=False))
            scaffold = self.decider.scaffold
            self.base_prefix = ids if ids[-len(scaffold):] == scaffold else ids + scaffold

    async def run_stage(self, asked: list[Question]) -> None:
        conditioned = bool(self.lines)
        lead = JOIN[self.fmt] if (self.chained and not self.image_state and (conditioned or self.d.sequential)) else ""
        head_length = 0 if self.settings.thought_in_prompt else len(self.decider.scaffold)
        limit = min(self.d.chunk_rows or self.settings.canvas_length, self.settings.canvas_length)

        def rows(questions: Sequence[Question]) -> int:
            return self.decider.templates.rows(head_length, lead, self.fmt, self.items(questions))

        stage_groups = groups(asked, rows, limit, self.d.isolate)
        chunked = len(stage_groups) > 1
        if self.d.sequential or len(stage_groups) == 1:
            for questions in stage_groups:
                group = self.new_group(questions, chunked)
                await self.run_group(group, conditioned or (self.d.sequential and bool(self.lines)))
                self.absorb(group)
        else:
            batch = [self.new_group(questions, chunked) for questions in stage_groups]
            await asyncio.gather(*(self.run_group(group, conditioned) for group in batch))
            for group in batch:
                self.absorb(group)

    def new_group(self, questions: list[Question], chunked: bool) -> _Group:
        group = _Group(questions=questions, index=self.next_group, chunked=chunked)
        self.next_group += 1
        return group

    def items(self, questions: Sequence[Question]) -> list[TemplateItem]:
        return [TemplateItem(q.qid, q.model_id, self.labels[q.qid]) for q in questions]

    def absorb(self, group: _Group) -> None:
        self.groups_done.append(group)
        self.chunks.append([q.qid for q in group.questions])
        items = []
        for question in group.questions:
            top = group.top[question.qid]
            self.results[question.qid] = group
            self.answer_names[question.qid] = question.alternatives[top].name
            items.append((question.model_id, self.labels[question.qid][top]))
            self.earlier.append(f"{question.model_id}: {question.alternatives[top].name}")
        self.lines.append(answer_text(items, self.fmt))

    # ------------------------------------------------------------------ one group

    async def run_group(self, group: _Group, conditioned: bool) -> None:
        seed = self.d.seed + GROUP_SEED_STRIDE * group.index
        items = self.items(group.questions)
        templates = self.decider.templates
        head: tuple[int, ...] = ()
        lead = ""
        if not self.image_state:
            if self.chained:
                assert self.base_prefix is not None
                if conditioned:
                    lead = JOIN[self.fmt]
                    prompt_ids = self.base_prefix + tuple(self.tok.encode(JOIN[self.fmt].join(self.lines)))
                elif self.decision_thought is not None:
                    prompt_ids = self.base_prefix
                else:
                    prompt_ids, head = self.plain_prompt(self.full_system(), self.d.state_text)
            else:
                system = self.group_system(group)
                if self.d.think > 0:
                    prompt = self.thinking_prompt(system, self.d.state_text)
                    thought, group.thought = await self.write_thought(prompt, self.d.think, seed)
                    group.thought_tokens = len(thought)
                    prompt_ids = prompt + thought + tuple(self.tok.thought_close)
                else:
                    prompt_ids, head = self.plain_prompt(system, self.d.state_text)
        else:
            user = restated_state(self.d.state_text, self.earlier) if conditioned else self.d.state_text
            system = self.full_system() if self.chained else self.group_system(group)
            if self.d.think > 0 and not conditioned:
                prompt_ids, head = await self.image_thought(group, system, user, items, seed)
            else:
                prompt_ids, head = self.plain_prompt(system, user)
        template = templates.resolve(head, lead, self.fmt, items)
        await self.read(group, template, Prompt(prompt_ids, self.d.images), seed)

    def group_system(self, group: _Group) -> str:
        """An unchained group lists only its own questions, unless `chunk_prompt` is shared."""
        if self.d.chunk_prompt == "shared":
            return self.system(self.d.questions, chunked=group.chunked)
        return self.system(group.questions, chunked=False)

    async def image_thought(
        self, group: _Group, system: str, user: str, items: list[TemplateItem], seed: int
    ) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """With an image in the prompt the thought is written with the image in view, then seeded
        into the read's canvas ahead of the answer, so the canvas bounds its length."""
        opening, closing = tuple(self.tok.thought_open), tuple(self.tok.thought_close)
        answer_rows = self.decider.templates.rows(0, "", self.fmt, items) - 1
        fits = self.settings.canvas_length - 1 - len(opening) - len(closing) - answer_rows
        if fits < MIN_THOUGHT_ROWS:
            raise RequestError(f"think: the canvas leaves {max(fits, 0)} rows for a thought beside this template", ("think",))
        budget = min(self.d.think, fits)
        thought, info = await self.write_thought(self.thinking_prompt(system, user), budget, seed)
        info["budget"] = budget
        group.thought = info
        group.thought_tokens = len(thought)
        prompt = tuple(self.tok.render_chat(system, user, len(self.d.images), thinking=True))
        return prompt, opening + thought + closing

    async def read(self, group: _Group, template: Template, prompt: Prompt, seed: int) -> None:
        rows = template.rows
        canvas_length = self.settings.canvas_length
        if rows > canvas_length:
            raise RequestError(
                f"answer template is {len(template.ids)} tokens; the canvas holds {canvas_length - 1}", ("questions",)
            )
        step = self.settings.canvas_step
        width = min(canvas_length, step * math.ceil(rows / step))
        base = template.ids + (self.tok.turn_close_id,) + (self.tok.pad_id,) * (width - rows)
        vocab = self.tok.vocab_size

        def spec(seeds: Sequence[int]) -> ReadSpec:
            canvases = tuple(noised(base, template.slots, s, vocab) for s in seeds)
            return ReadSpec(prompt, canvases, template.slots, template.label_ids, self.d.steps, seeds[0])

        policy = self.d.samples
        per_read: list[list[list[float]]] = []  # [read][question] -> renormalised probs
        results: list[ReadResult] = []
        extended: bool | None = None
        first_entropy: dict[str, float] | None = None
        if policy.mode == "fixed":
            results = await self.reader.read([spec([seed + SAMPLE_SEED_STRIDE * j for j in range(policy.count)])])
        else:
            results = await self.reader.read([spec([seed])])
            first = [softmax(slot.label_logprobs) for slot in results[0].slots[0]]
            first_entropy = {q.qid: entropy(p) for q, p in zip(group.questions, first)}
            extended = max(first_entropy.values()) > policy.threshold and policy.count > 1
            if extended:
                more = [seed + 1 + SAMPLE_SEED_STRIDE * j for j in range(policy.count - 1)]
                results += await self.reader.read([spec(more)])
        for result in results:
            for canvas in result.slots:
                per_read.append([softmax(slot.label_logprobs) for slot in canvas])
        first_slots = results[0].slots[0]
        n = len(per_read)
        group.reads = n
        group.rows = rows
        group.prompt_tokens = max(result.prompt_tokens for result in results)
        tops: list[dict] = [{} for _ in range(n)]
        for qi, question in enumerate(group.questions):
            draws = [read[qi] for read in per_read]
            mean = [sum(values) / n for values in zip(*draws)]
            top = top_index(mean)
            group.probs[question.qid] = mean
            group.top[question.qid] = top
            entropies = [entropy(p) for p in draws]
            for r, probs in enumerate(draws):
                best = top_index(probs)
                tops[r][question.qid] = [question.alternatives[best].name, probs[best], entropies[r]]
            diag = {
                "pos": template.slots[qi],
                "entropy": entropies,
                "label_mass": sum(math.exp(lp) for lp in first_slots[qi].label_logprobs),
                "argmax_is_label": first_slots[qi].argmax_id in template.label_ids[qi],
            }
            if n > 1:
                chosen = [p[top] for p in draws]
                variance = sum((c - mean[top]) ** 2 for c in chosen) / (n - 1)
                diag["stderr"] = math.sqrt(variance / n)
                diag["agreement"] = sum(1 for p in draws if top_index(p) == top) / n
            group.question_diagnostics[question.qid] = diag
        group.samples = {
            "n": n,
            "tops": tops,
            "policy": {**policy.as_json(), "extended": extended, "first_read_entropy": first_entropy},
        }

    # ------------------------------------------------------------------ assembly

    def outcome(self, started: float) -> Outcome:
        d = self.d
        answers: dict[str, dict | None] = {}
        internal: dict[str, dict | None] = {}
        for question in self.asked:
            group = self.results.get(question.qid)
            if group is None:
                answers[question.qid] = internal[question.qid] = None
                continue
            probs = group.probs[question.qid]
            answers[question.qid] = question.kind.answer(question, probs, d.confidence)
            label = self.labels[question.qid][group.top[question.qid]]
            internal[question.qid] = question.kind.internal_answer(question, label, probs, d.confidence)
            spread = group.question_diagnostics[question.qid]
            if "stderr" in spread:
                internal[question.qid].update(stderr=spread["stderr"], agreement=spread["agreement"])
        done = self.groups_done
        prompt_tokens = [g.prompt_tokens for g in done if g.prompt_tokens is not None]
        output_tokens = sum(g.rows + g.thought_tokens for g in done) + self.decision_thought_tokens
        thoughts = [g.thought for g in done if g.thought is not None]
        if self.decision_thought is not None:
            thought: dict | list | None = self.decision_thought
        elif len(done) == 1:
            thought = done[0].thought
        else:
            thought = thoughts or None
        if len(done) == 1 and not self.skipped:
            samples = done[0].samples
        else:
            samples = {
                "n": [g.samples["n"] for g in done],
                "tops": [g.samples["tops"] for g in done],
                "policy": [g.samples["policy"] for g in done],
            }
        questions_diag: dict = {}
        for group in done:
            questions_diag.update(group.question_diagnostics)
        total_ms = round((time.monotonic() - started) * 1000, 1)
        reads = sum(g.reads for g in done)
        diagnostics = {
            "steps": d.steps,
            "stages": self.stages_read,
            "skipped": {qid: skip.as_json() for qid, skip in self.skipped.items()},
            "chunks": self.chunks,
            "chunk_prompt": "full" if self.chained else d.chunk_prompt,
            "sequential": d.sequential,
            "conditioning": None if not self.chained else ("restated" if self.image_state else "prefill"),
            "thought": thought,
            "samples": samples,
            "timing": {"total_ms": total_ms, "reads": reads},
            "prompt_tokens": max(prompt_tokens) if prompt_tokens else None,
            "questions": questions_diag,
            "format": self.fmt,
            "engine": self.reader.info.engine,
        }
        if d.ask is not None:
            diagnostics["not_asked"] = [q.qid for q in d.questions if q.qid not in set(d.ask)]
        parts = []
        for question in self.asked:
            name = self.answer_names.get(question.qid)
            parts.append(f"{question.qid}={'skipped' if name is None else name}")
        summary = f"{' '.join(parts)} reads={reads} {total_ms:.0f}ms"
        return Outcome(
            answers=answers,
            internal_answers=internal,
            input_tokens=max(prompt_tokens) if prompt_tokens else 0,
            output_tokens=output_tokens,
            diagnostics=diagnostics,
            summary=summary,
        )
