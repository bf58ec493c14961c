"""A scripted Reader, the counterpart of the reference test's fake vLLM.

Every slot answers with the same shape of distribution: the picked label at probability
CONF·(1−LEAK), the other labels sharing (1−CONF)·(1−LEAK), the rest of the vocabulary holding LEAK.
Every call is recorded, so tests can assert on prompts, canvases and fan-out.
"""

from __future__ import annotations

import asyncio
import math
from typing import Callable, Sequence

from app.engine.base import (
    ChatTokenizer,
    GenerateResult,
    GenerateSpec,
    ReaderInfo,
    ReadResult,
    ReadSpec,
    SlotRead,
)

THOUGHT_TEXT = "The customer says everything is down, so this is urgent."
PROMPT_TOKENS = 321

# pick(spec, slot_index) -> the label index the fake favours at that slot
Pick = Callable[[ReadSpec, int], int]


class ScriptedReader:
    def __init__(self, tokenizer: ChatTokenizer, conf: float = 0.7, leak: float = 0.0,
                 pick: Pick | None = None, canvas_length: int = 128) -> None:
        self.tokenizer = tokenizer
        self.conf = conf
        self.leak = leak
        self.pick = pick or (lambda spec, slot: 0)
        self.info = ReaderInfo(model="dgemma", engine="fake", device="cpu", tiny=False, canvas_length=canvas_length)
        self.calls: list[tuple[str, object]] = []
        self.thought = tuple(tokenizer.encode(THOUGHT_TEXT))
        self.ready = True
        self.degraded: str | None = None

    async def start(self) -> None:
        self.ready = True

    async def stop(self) -> None:
        self.ready = False

    @property
    def reads(self) -> list[ReadSpec]:
        return [spec for kind, specs in self.calls if kind == "read" for spec in specs]  # type: ignore[union-attr]

    @property
    def generations(self) -> list[GenerateSpec]:
        return [spec for kind, spec in self.calls if kind == "generate"]  # type: ignore[misc]

    async def read(self, specs: Sequence[ReadSpec]) -> list[ReadResult]:
        self.calls.append(("read", list(specs)))
        out = []
        for spec in specs:
            canvases = []
            for _ in spec.canvases:
                slots = []
                for slot_index, label_ids in enumerate(spec.label_ids):
                    favoured = self.pick(spec, slot_index)
                    k = len(label_ids)
                    rest = (1 - self.conf) * (1 - self.leak) / (k - 1)
                    probs = [rest] * k
                    probs[favoured] = self.conf * (1 - self.leak)
                    best = max(range(k), key=lambda i: probs[i])
                    slots.append(SlotRead(label_logprobs=tuple(math.log(p) for p in probs), argmax_id=label_ids[best]))
                canvases.append(tuple(slots))
            out.append(ReadResult(slots=tuple(canvases), prompt_tokens=PROMPT_TOKENS))
        return out

    async def generate(self, spec: GenerateSpec) -> GenerateResult:
        self.calls.append(("generate", spec))
        closed = len(self.thought) < spec.max_tokens
        return GenerateResult(ids=self.thought[: spec.max_tokens], stopped=closed, prompt_tokens=PROMPT_TOKENS)


class BatchingReader(ScriptedReader):
    """A slow engine that batches: a pass takes `pass_s` seconds and answers the reads waiting when
    it began, at most `batch` of them; reads that arrive meanwhile wait for the next pass. Its
    capacity is `batch / pass_s` reads a second, whatever the machine."""

    def __init__(self, tokenizer: ChatTokenizer, batch: int, pass_s: float, report_busy: bool = False,
                 **options) -> None:
        super().__init__(tokenizer, **options)
        self.batch, self.pass_s = batch, pass_s
        self.report_busy = report_busy  # say how long the engine was busy, as the hf engine's `busy_ms`
        self.passes: list[int] = []  # reads answered by each pass
        self.waiting: list[tuple[Sequence[ReadSpec], asyncio.Future]] = []
        self.engine: asyncio.Task | None = None

    @property
    def stats(self) -> dict[str, float]:
        return {"busy_ms": 1000 * self.pass_s * len(self.passes)} if self.report_busy else {}

    async def read(self, specs: Sequence[ReadSpec]) -> list[ReadResult]:
        future: asyncio.Future = asyncio.get_running_loop().create_future()
        self.waiting.append((specs, future))
        if self.engine is None or self.engine.done():
            self.engine = asyncio.create_task(self.run())
        return await future

    async def run(self) -> None:
        while self.waiting:
            taken, self.waiting = self.waiting[: self.batch], self.waiting[self.batch:]
            await asyncio.sleep(self.pass_s)
            self.passes.append(len(taken))
            for specs, future in taken:
                if not future.done():  # a read whose decision was cancelled is dropped
                    future.set_result(await ScriptedReader.read(self, specs))
