"""Engine `hf`: transformers' DiffusionGemmaForBlockDiffusion in this process, CPU or CUDA.

Reads and generations from every request go into one bounded FIFO queue; a single loop takes what
is waiting (reads up to a row budget, or one pass of a generation), runs it on the one engine
thread, and hands results back. Reads that arrive together share one decoder pass (see
`diffusion.py`), so N concurrent decisions cost far fewer model calls than N. The loop keeps the
scheduling contract of `app/engine/base.py`.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator, Sequence

from app.engine.base import (
    EngineError,
    EngineInputError,
    EngineUnavailable,
    GenerateChunk,
    GenerateResult,
    GenerateSpec,
    ReaderInfo,
    ReadResult,
    ReadSpec,
    collect,
)

log = logging.getLogger("djev.engine")


@dataclass(frozen=True)
class HFOptions:
    """What the hf engine is told; built from Settings by `app.cli.hf_options` (defaults live there)."""

    device: str  # "auto", "cpu", "cuda", "cuda:1", ...
    max_prompt_tokens: int
    kv_cache_entries: int
    max_batch_rows: int
    gather_ms: float  # how long a read batch waits for more reads before it starts (0 = not at all)
    queue_limit: int
    served_name: str
    canvas_length: int
    tiny: bool
    torch_threads: int  # 0 = torch's default
    cuda_graphs: bool  # replay decoder passes as CUDA graphs (CUDA only)


def pick_device(requested: str) -> str:
    import torch

    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return requested


def load_hf_reader(checkpoint: str | Path, options: HFOptions) -> "HFReader":
    """Load a local DiffusionGemma checkpoint directory (config, weights, tokenizer, processor)."""
    import torch
    from transformers import AutoImageProcessor, AutoTokenizer, DiffusionGemmaForBlockDiffusion

    from app.engine.diffusion import DiffusionRunner
    from app.engine.tokenizer import HFChatTokenizer

    path = Path(checkpoint)
    if options.torch_threads > 0:
        torch.set_num_threads(options.torch_threads)
    device_name = pick_device(options.device)
    device = torch.device(device_name)
    on_cuda = device.type == "cuda"
    kwargs: dict[str, Any] = {"dtype": torch.bfloat16 if on_cuda else torch.float32, "attn_implementation": "sdpa"}
    if on_cuda:
        # The eager loop over experts is 13x slower on an H200 (docs/design.md §4.2).
        kwargs["experts_implementation"] = "grouped_mm"
    log.info("loading %s on %s (%s)", path, device_name, kwargs["dtype"])
    model = DiffusionGemmaForBlockDiffusion.from_pretrained(str(path), **kwargs).to(device).eval()
    hf_tokenizer = AutoTokenizer.from_pretrained(str(path))
    try:
        image_processor = AutoImageProcessor.from_pretrained(str(path), backend="pil")
    except Exception as exc:  # noqa: BLE001 - a checkpoint without an image processor still reads text
        log.warning("no image processor in %s (%s): image states will be refused", path, exc)
        image_processor = None
    tokenizer = HFChatTokenizer(
        hf_tokenizer, vocab_size=int(model.config.text_config.vocab_size), image_token_id=int(model.config.image_token_id)
    )
    runner = DiffusionRunner(
        model,
        image_processor,
        device=device,
        max_prompt_tokens=options.max_prompt_tokens,
        kv_entries=options.kv_cache_entries,
        max_rows=options.max_batch_rows,
        generation=_generation_settings(model),
        cuda_graphs=options.cuda_graphs,
    )
    device_label = torch.cuda.get_device_name(device) if on_cuda else "cpu"
    info = ReaderInfo(
        model=options.served_name or path.name,
        engine="hf",
        device=device_label,
        tiny=options.tiny,
        canvas_length=options.canvas_length,
        checkpoint=str(path),
    )
    return HFReader(runner, tokenizer, info, options)


def _generation_settings(model: Any) -> dict:
    config = getattr(model, "generation_config", None)
    settings: dict = {}
    for name in ("max_denoising_steps", "t_min", "t_max", "stability_threshold", "confidence_threshold"):
        value = getattr(config, name, None)
        if value is not None:
            settings[name] = value
    sampler = getattr(config, "sampler_config", None)
    bound = getattr(sampler, "entropy_bound", None) if sampler is not None else None
    if bound is not None:
        settings["entropy_bound"] = bound
    return settings


class _ReadJob:
    """Reads of one caller, waiting for a batch."""

    def __init__(self, specs: list[ReadSpec], future: asyncio.Future) -> None:
        self.specs = specs
        self.future = future
        self.rows = sum(len(spec.canvases) for spec in specs)

    @property
    def dropped(self) -> bool:
        return self.future.done()  # cancelled by its caller (deadline, disconnect) or already failed


class _GenerateJob:
    """A generation that takes one model pass per turn, then goes back to the end of the queue."""

    def __init__(self, spec: GenerateSpec) -> None:
        self.spec = spec
        self.chunks: asyncio.Queue[GenerateChunk | BaseException] = asyncio.Queue()
        self.state: Any = None  # the runner's Generation, once its prompt is encoded
        self.cancelled = False

    @property
    def dropped(self) -> bool:
        return self.cancelled


_Job = _ReadJob | _GenerateJob


class HFReader:
    """The scheduling front of the hf engine: one FIFO queue, one loop, one engine thread.

    Each turn the loop takes the head of the queue. Reads at the head are batched together, in
    arrival order, up to MAX_BATCH_ROWS canvases: a read never waits behind a later one, so it waits
    at most for the batch running when it arrived plus the batches of the reads ahead of it. A
    generation runs ONE model pass per turn and is then queued again at the end, so a read waits at
    most one pass behind any generation. Work whose caller went away (its awaiting task cancelled)
    is dropped when its turn comes, and a running generation stops at its next pass.
    """

    def __init__(self, runner: Any, tokenizer: Any, info: ReaderInfo, options: HFOptions) -> None:
        self.runner = runner
        self.tokenizer = tokenizer
        self.info = info
        self.options = options
        self._queue: deque[_Job] = deque()
        self._wakeup: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._event_loop: asyncio.AbstractEventLoop | None = None
        self._busy = False  # the last read batch served several callers, or more were waiting

    @property
    def stats(self) -> dict[str, float]:
        return {**self.runner.stats, "queue_depth": len(self._queue)}

    @property
    def ready(self) -> bool:
        return self._task is not None and not self._task.done()

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        if self._task is not None:
            if self._event_loop is not loop:
                raise RuntimeError("this reader already runs in another event loop; give each app its own reader")
            return
        self._event_loop = loop
        self._wakeup = asyncio.Event()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="djev-engine")
        self._task = asyncio.create_task(self._loop(), name="djev-batching-loop")

    async def stop(self) -> None:
        task, self._task = self._task, None
        self._event_loop = None
        if task is not None:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
        while self._queue:
            self._fail(self._queue.popleft(), EngineUnavailable("the engine stopped"))
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None

    # ------------------------------------------------------------------ callers

    async def read(self, specs: Sequence[ReadSpec]) -> list[ReadResult]:
        if not specs:
            return []
        job = _ReadJob(list(specs), asyncio.get_running_loop().create_future())
        self._submit(job)
        return await job.future

    async def generate(self, spec: GenerateSpec) -> GenerateResult:
        return await collect(self.stream(spec))

    async def stream(self, spec: GenerateSpec) -> AsyncIterator[GenerateChunk]:
        job = _GenerateJob(spec)
        self._submit(job)
        try:
            while True:
                item = await job.chunks.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.done:
                    return
        finally:
            job.cancelled = True  # the caller stopped listening: the loop drops it at its next turn

    def _submit(self, job: _Job) -> None:
        if self._wakeup is None or not self.ready:
            raise EngineUnavailable("the engine is not running")
        if len(self._queue) >= self.options.queue_limit:
            raise EngineUnavailable("the engine queue is full")
        self._queue.append(job)
        self._wakeup.set()

    # ------------------------------------------------------------------ the loop

    async def _loop(self) -> None:
        assert self._wakeup is not None
        loop = asyncio.get_running_loop()
        while True:
            while not self._queue:
                self._wakeup.clear()
                await self._wakeup.wait()
            job = self._queue.popleft()
            if job.dropped:
                continue
            if isinstance(job, _GenerateJob):
                await self._generation_turn(loop, job)
                continue
            if self.options.gather_ms > 0 and self._busy and job.rows < self.options.max_batch_rows:
                # Under load, closed-loop clients otherwise split into two half-batches that take
                # turns; a short wait lets the reads being planned right now join this batch. A lone
                # caller (the last batch served one job) never waits.
                await asyncio.sleep(self.options.gather_ms / 1000)
            batch = [job]
            rows = job.rows
            while self._queue and isinstance(self._queue[0], _ReadJob):
                nxt = self._queue[0]
                if nxt.dropped:
                    self._queue.popleft()
                    continue
                if rows + nxt.rows > self.options.max_batch_rows:
                    break
                batch.append(self._queue.popleft())
                rows += nxt.rows
            await self._read_batch(loop, batch)

    async def _read_batch(self, loop: asyncio.AbstractEventLoop, batch: list[_ReadJob]) -> None:
        self._busy = len(batch) > 1 or bool(self._queue)
        specs = [spec for job in batch for spec in job.specs]
        try:
            results = await loop.run_in_executor(self._executor, self.runner.read, specs)
        except asyncio.CancelledError:
            for job in batch:
                self._fail(job, EngineUnavailable("the engine stopped"))
            raise
        except EngineInputError as exc:
            for job in batch:
                self._fail(job, exc)
            return
        except Exception as exc:  # noqa: BLE001 - a model failure must reach every waiting request
            log.exception("engine failure")
            for job in batch:
                self._fail(job, EngineError(f"engine failure: {type(exc).__name__}: {exc}"))
            return
        self.runner.stats["batches"] += 1
        offset = 0
        for job in batch:
            mine = results[offset:offset + len(job.specs)]
            offset += len(job.specs)
            if job.future.done():
                continue
            failure = next((r for r in mine if isinstance(r, Exception)), None)
            if failure is not None:
                job.future.set_exception(failure)
            else:
                job.future.set_result(mine)

    async def _generation_turn(self, loop: asyncio.AbstractEventLoop, job: _GenerateJob) -> None:
        """One model pass of a generation (its prompt encoding is the first), then back in line."""
        try:
            chunk = await loop.run_in_executor(self._executor, self._generation_pass, job)
        except asyncio.CancelledError:
            self._fail(job, EngineUnavailable("the engine stopped"))
            raise
        except EngineInputError as exc:
            self._fail(job, exc)
            return
        except Exception as exc:  # noqa: BLE001
            log.exception("engine failure during generation")
            self._fail(job, EngineError(f"engine failure: {type(exc).__name__}: {exc}"))
            return
        if chunk is not None:
            job.chunks.put_nowait(chunk)
            if chunk.done:
                return
        if not job.cancelled:
            self._queue.append(job)

    def _generation_pass(self, job: _GenerateJob) -> GenerateChunk | None:
        if job.state is None:
            job.state = self.runner.start_generation(job.spec, self.info.canvas_length)
            return None
        return self.runner.step_generation(job.state)

    @staticmethod
    def _fail(job: _Job, exc: BaseException) -> None:
        if isinstance(job, _ReadJob):
            if not job.future.done():
                job.future.set_exception(exc)
        elif not job.cancelled:
            job.chunks.put_nowait(exc)
