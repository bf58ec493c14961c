"""The prompt each group (canvas) of a decision reads: its question sheet, the state, any thought the
model writes first, and, in a later stage, the earlier answers it continues. The synchronous pieces
(rendering, tokenizing) go through `offload`; thoughts are written through the reader."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Sequence

from app.decisions.canvas import content_seed
from app.decisions.debias import CONTENT_FREE_STATE
from app.decisions.errors import RequestError
from app.decisions.plan import Plan
from app.decisions.prompt import ChatPrompts, restated_state, system_text
from app.decisions.questions import Question
from app.decisions.reading import Offload, ReadSettings
from app.decisions.request import Decision
from app.decisions.template import JOIN, TemplateItem, Templates
from app.engine.base import EngineInputError, GenerateSpec, Prompt, Reader

MIN_THOUGHT_ROWS = 8


@dataclass(frozen=True)
class Chain:
    """A chained text decision's common prefix: the full question sheet, the state, and the one
    thought written for the whole decision (if any)."""

    prefix: tuple[int, ...]
    thought: dict | None = None
    thought_tokens: int = 0


@dataclass
class Conditioning:
    """What later stages read of the earlier ones."""

    prefill: list[str] = field(default_factory=list)  # answer texts in labels, continuing a text prompt
    restated: list[str] = field(default_factory=list)  # "q1: name" entries, restated in an image state


@dataclass(frozen=True)
class GroupPrompt:
    """A group's prompt ids, the canvas head and lead its template follows, and its thought."""

    ids: tuple[int, ...]
    head: tuple[int, ...] = ()  # seeded at the canvas's start (the thought scaffold, an image thought)
    lead: str = ""  # text ahead of the first answer (the join of a continued answer list)
    thought: dict | None = None
    thought_tokens: int = 0


class GroupPrompts:
    """Builds the prompts of one decision's groups."""

    def __init__(self, decision: Decision, plan: Plan, prompts: ChatPrompts, templates: Templates,
                 settings: ReadSettings, reader: Reader, offload: Offload) -> None:
        self.d = decision
        self.plan = plan
        self.prompts = prompts
        self.templates = templates
        self.settings = settings
        self.reader = reader
        self.tok = reader.tokenizer
        self.offload = offload
        self.image_state = bool(decision.images)

    # ------------------------------------------------------------------ synchronous pieces

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
        limit = self.settings.max_prompt_tokens
        if len(prompt_ids) > limit:
            raise EngineInputError(
                f"the prompt is {len(prompt_ids)} tokens; this server reads at most {limit}",
                status=400, param="state", error_type="max_tokens_exceeded",
            )

    # ------------------------------------------------------------------ prompts

    async def text_chain(self) -> Chain:
        """A chained text decision continues one prompt: the full question sheet, then (with
        `think`) one thought written for the whole decision, then the answers so far."""
        if self.d.think > 0:
            prompt = await self.offload(self.prompts.thinking, self.full_system(), self.d.state_text, 0)
            self.check_length(prompt)
            thought, info = await self.write_thought(prompt, self.d.think)
            return Chain(prompt + thought + self.prompts.closing, info, len(thought))
        prefix = await self.offload(lambda: self.prompts.with_scaffold(self.full_system(), self.d.state_text, 0))
        return Chain(prefix)

    async def for_group(self, shown: Sequence[Question], conditioning: Conditioning, conditioned: bool,
                        chunked: bool, chain: Chain | None) -> GroupPrompt:
        """The prompt of a group showing `shown`: a chained text decision continues its chain; an
        unchained text group has its own sheet (and thought); an image state is read afresh, with
        the earlier answers restated when `conditioned`."""
        d, offload = self.d, self.offload
        if not self.image_state and chain is not None:
            if conditioned:
                lead = JOIN[self.plan.fmt]
                joined = lead.join(conditioning.prefill)
                prompt = GroupPrompt(chain.prefix + tuple(await offload(self.tok.encode, joined)), lead=lead)
            elif chain.thought is not None:
                prompt = GroupPrompt(chain.prefix)
            else:
                prompt = GroupPrompt(*await offload(lambda: self.prompts.plain(self.full_system(), d.state_text, 0)))
        elif not self.image_state:
            system = await offload(self.group_system, shown, chunked)
            if d.think > 0:
                opening = await offload(self.prompts.thinking, system, d.state_text, 0)
                self.check_length(opening)
                ids, thought = await self.write_thought(opening, d.think)
                prompt = GroupPrompt(opening + ids + self.prompts.closing, thought=thought, thought_tokens=len(ids))
            else:
                prompt = GroupPrompt(*await offload(self.prompts.plain, system, d.state_text, 0))
        else:
            user = restated_state(d.state_text, conditioning.restated) if conditioned else d.state_text
            system = await offload(self.full_system) if self.plan.chained else await offload(
                self.group_system, shown, chunked)
            if d.think > 0 and not conditioned:
                prompt = await self.image_thought(shown, system, user)
            else:
                prompt = GroupPrompt(*await offload(self.prompts.plain, system, user, len(d.images)))
        self.check_length(prompt.ids)
        return prompt

    def content_free(self, shown: Sequence[Question], conditioning: Conditioning, conditioned: bool,
                     chunked: bool) -> GroupPrompt:
        """The group's prompt with a content-free state (`debias` with `prior`, docs/quality.md): the
        same sheet, any earlier answers as `for_group` continues or restates them, the state text
        "N/A", no images and no thought. Synchronous (run it through `offload`)."""
        state = CONTENT_FREE_STATE
        if not self.image_state and self.plan.chained:
            if conditioned:
                lead = JOIN[self.plan.fmt]
                prefix = self.prompts.with_scaffold(self.full_system(), state, 0)
                return GroupPrompt(prefix + tuple(self.tok.encode(lead.join(conditioning.prefill))), lead=lead)
            return GroupPrompt(*self.prompts.plain(self.full_system(), state, 0))
        if not self.image_state:
            return GroupPrompt(*self.prompts.plain(self.group_system(shown, chunked), state, 0))
        user = restated_state(state, conditioning.restated) if conditioned else state
        system = self.full_system() if self.plan.chained else self.group_system(shown, chunked)
        return GroupPrompt(*self.prompts.plain(system, user, 0))

    # ------------------------------------------------------------------ thoughts

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

    async def image_thought(self, questions: Sequence[Question], system: str, user: str) -> GroupPrompt:
        """With an image in the prompt the thought is written with the image in view, then seeded
        into the read's canvas ahead of the answer, so the canvas bounds its length."""
        items = [TemplateItem(q.qid, q.model_id, self.plan.labels[q.qid]) for q in questions]
        answer_rows = await self.offload(self.templates.rows, 0, "", self.plan.fmt, items) - 1
        opening, closing = self.prompts.opening, self.prompts.closing
        fits = self.settings.canvas_length - 1 - len(opening) - len(closing) - answer_rows
        if fits < MIN_THOUGHT_ROWS:
            raise RequestError(f"think: the canvas leaves {max(fits, 0)} rows for a thought beside this template", ("think",))
        budget = min(self.d.think, fits)
        images = len(self.d.images)
        thought_ids, info = await self.write_thought(
            await self.offload(self.prompts.thinking, system, user, images), budget)
        info["budget"] = budget
        prompt = await self.offload(self.prompts.thinking_open, system, user, images)
        return GroupPrompt(prompt, opening + thought_ids + closing, thought=info, thought_tokens=len(thought_ids))
