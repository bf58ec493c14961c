"""Engine `hf`: transformers' DiffusionGemmaForBlockDiffusion in this process, CPU or CUDA.

Reads and generations from every request go into one bounded FIFO queue; a single loop takes what
is waiting (reads up to a row budget, or one pass of a generation), runs it on the one engine
thread, and hands results back. Reads that arrive together share one decoder pass (see
app/engine/hf/runner.py), so N concurrent decisions cost far fewer model calls than N. The loop
keeps the scheduling contract of `app/engine/base.py`.

Images are decoded and run through the image processor before their read or generation is queued, in
a small pool of image workers (tens of ms a camera frame that would otherwise hold the engine thread,
and every reader behind it); the result rides with the job, so the engine thread only uploads pixels
(on CUDA also rescales, patches and pads them there: app/engine/hf/pixels.py) and runs the vision tower,
and nothing outlives the job.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import sys
import time
from collections import Counter, deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, AsyncIterator, Callable, Generator, Sequence, TypeVar

from app.engine.base import (
    CacheKey,
    ChatTokenizer,
    EngineError,
    EngineInputError,
    EngineUnavailable,
    GenerateChunk,
    GenerateResult,
    GenerateSpec,
    Prompt,
    ReaderInfo,
    ReadResult,
    ReadSpec,
    collect,
    current_caller,
    describe,
)
from app.engine.hf.flat.scheduler import TurnFailed

if TYPE_CHECKING:
    from app.engine.hf.flat.engine import TurnReport
    from app.engine.hf.flat.generate import GenerateProgram
    from app.engine.hf.flat.reads import ReadProgram
    from app.engine.hf.generation_state import Generation
    from app.engine.hf.prompts import Preprocessed, ProcessedImages
    from app.engine.hf.runner import DiffusionRunner


log = logging.getLogger("djev.engine")

# A turn of the engine thread longer than this is logged and counted (`slow_turns`): app/engine/base.py's
# scheduling contract keeps every turn short (a chunk of a long prompt, one pass of a read).
SLOW_TURN_S = 0.5
SLOW_GC_S = 0.1


@dataclass(frozen=True)
class HFOptions:
    """What the hf engine is told; built from Settings by `app.build.hf_options` (defaults live there)."""

    device: str  # "auto", "cpu", "cuda", "cuda:1", ...
    max_prompt_tokens: int  # 0: sized at start (`app.engine.hf.loader.sized_prompt_limit`)
    kv_cache_entries: int
    max_batch_rows: int
    gather_ms: float  # the most a read batch waits for more reads before it starts (0 = not at all)
    queue_limit: int
    served_name: str
    canvas_length: int
    tiny: bool
    torch_threads: int  # 0 = torch's default
    cuda_graphs: bool  # replay decoder passes as CUDA graphs (CUDA only)
    torch_compile: bool  # compile the split layers and the vision layers, CUDA only (app/engine/hf/compiled.py)
    fused_moe: bool  # the experts as Triton kernels, CUDA only (app/engine/hf/moe/fused.py)
    canvas_step: int = 16  # canvas widths are multiples of it (the decoder graphs' width buckets)
    max_images: int = 8  # images a request may hold
    prefill_chunk: int = 2048  # prompt tokens encoded in one engine turn (longer prompts: in chunks)
    prompt_cache_bytes: int = 0  # the bytes the prompt LRU may hold (0: bounded by entries only)
    gather_rows: int = 32  # the most canvases a gather waits for (0: the last batch's count)
    flat_turn: bool = False  # each turn one forward over a flat batch (app/engine/hf/flat/)
    turn_tokens: int = 0  # the flat turn's token budget (0: by the device, `flat_turn_tokens`)


def settle_heap() -> None:
    """Set every object alive now (the model, the libraries, the compiled code) aside from the
    garbage collector's passes, which otherwise walk them all in every full pass: several hundred
    thousand objects, ~170 ms a pass on this project's CPU box, and a 32-prompt read on an H200
    that now and then took 500 ms more than its median (docs/benchmarks.md). Called once the model
    is loaded and warmed up (they stay alive for good, so cyclic garbage of the start-up stays too:
    a few objects, once). Cheap; counting what it set aside (`gc.get_freeze_count`) walks them all."""
    gc.freeze()


class CollectorWatch:
    """Times the garbage collector's full passes into `stats` (`gc_full_passes`, `gc_full_ms`) and
    logs one past SLOW_GC_S: a full pass stops every thread, the engine's included, so a stall that
    no engine turn explains shows here. Registered while the reader runs."""

    def __init__(self, stats: Counter[str]) -> None:
        self.stats = stats
        self.started = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if info.get("generation") != 2:
            return
        if phase == "start":
            self.started = time.perf_counter()
            return
        seconds = time.perf_counter() - self.started
        self.stats["gc_full_passes"] += 1
        self.stats["gc_full_ms"] += round(seconds * 1000)
        if seconds > SLOW_GC_S:
            log.warning("a full pass of the garbage collector took %.0f ms (%s objects collected)",
                        seconds * 1000, info.get("collected"))


def compile_counts(runner: DiffusionRunner) -> tuple[int, int, int]:
    """(CUDA graphs captured, graphs torch.compile has built, Triton kernels compiled) so far: after
    `ready` none of them should grow (`HFReader` counts any that does, and the seconds of its pass).
    The first two leave long-lived objects behind (hundreds of thousands for a compile), which
    `settle_heap` should set aside again, or every full pass of the collector walks them (150-200 ms
    pauses measured on the H200 after the levels of a load compiled new shapes: docs/benchmarks.md)."""
    captures = sum(getattr(getattr(runner, name, None), "captures", 0)
                   for name in ("graphs", "encoder_graphs", "vision_graphs"))
    flat = getattr(runner, "flat", None)
    if flat is not None and flat.forward.graphs is not None:
        captures += flat.forward.graphs.captures
    dynamo = sys.modules.get("torch._dynamo.utils")
    compiled = int(dynamo.counters["stats"].get("unique_graphs", 0)) if dynamo is not None else 0
    triton = 0
    if "triton" in sys.modules:
        from app.engine.hf.moe.fused import compiled_kernels

        triton = compiled_kernels()
        for name in ("app.engine.hf.attention_kernel", "app.engine.hf.flat.kernel"):
            kernel = sys.modules.get(name)
            if kernel is not None:
                triton += kernel.compiled_kernels()
    return captures, compiled, triton


# A read batch, a heavy read's step, a generation's pass; a flat turn (FLAT_TURN: all of them at once).
TURN_KINDS = ("read", "heavy", "generation", "flat")
AFTER_READY = ("captures_after_ready", "recompiles_after_ready", "triton_compiles_after_ready")


Result = TypeVar("Result")
Value = TypeVar("Value")


def advance(steps: Generator[None, None, Result]) -> tuple[bool, Result | None]:
    """One step of a stepwise engine generator (on the engine thread): (True, its result) when it
    ended with that step, else (False, None)."""
    try:
        next(steps)
    except StopIteration as stop:
        return True, stop.value
    return False, None


Outcomes = list[ReadResult | Exception]  # a batch's reads: each its result or its exception


def advance_read(program: Generator[None, None, Outcomes]) -> tuple[bool, Outcomes | None]:
    """`advance` for a heavy read's program (`DiffusionRunner.read_steps`)."""
    return advance(program)


def _image_tokens(images: Preprocessed) -> list[int]:
    """The soft tokens of each image preprocessed for a job (a set that failed to decode has none)."""
    return [count for processed in images.values() if not isinstance(processed, Exception)
            for count in processed.counts]


def _cache_keys(prompts: Sequence[Prompt]) -> list[CacheKey]:
    return [prompt.cache_key for prompt in prompts]


class _ReadJob:
    """Reads of one caller, waiting for a batch, with their images preprocessed. A `heavy` one (more
    than one engine turn of work: a long prompt, a multi-step read, more canvases than a pass holds)
    runs alone, one step a turn (`program`, the runner's `read_steps`), back in line after each."""

    def __init__(self, specs: list[ReadSpec], future: asyncio.Future[list[ReadResult]], images: Preprocessed,
                 heavy: bool = False, long_tokens: int = 0) -> None:
        self.caller = current_caller.get()  # the decision it is for: batches are shared fairly among them
        self.specs = specs
        self.future = future
        self.rows = sum(len(spec.canvases) for spec in specs)
        self.images = images
        self.heavy = heavy
        self.long_tokens = long_tokens  # its long prompts' tokens to encode (`DiffusionRunner.long_encoding`)
        self.program: Generator[None, None, list[ReadResult | Exception]] | None = None
        self.turns = 0  # the steps of `program` run so far
        self.flat: ReadProgram | None = None  # its program on the flat turn (FLAT_TURN)

    @property
    def dropped(self) -> bool:
        return self.future.done()  # cancelled by its caller (deadline, disconnect) or already failed

    @property
    def work(self) -> ReadProgram:
        """Its program on the flat turn (the flat engine's `Entry`)."""
        assert self.flat is not None
        return self.flat


class _GenerateJob:
    """A generation that takes one model pass per turn, then goes back to the end of the queue."""

    def __init__(self, spec: GenerateSpec, images: Preprocessed) -> None:
        self.caller = current_caller.get()
        self.spec = spec
        self.images = images  # for its first pass (the prompt's encoding)
        self.chunks: asyncio.Queue[GenerateChunk | BaseException] = asyncio.Queue()
        self.starting: Generator[None, None, Generation] | None = None  # its prompt's encoding, stepwise
        self.state: Generation | None = None  # the runner's Generation, once its prompt is encoded
        self.flat: GenerateProgram | None = None  # its program on the flat turn (FLAT_TURN)
        self.cancelled = False
        self.failed = False  # its caller was sent an exception: nothing more runs

    @property
    def dropped(self) -> bool:
        return self.cancelled or self.failed

    @property
    def work(self) -> GenerateProgram:
        """Its program on the flat turn (the flat engine's `Entry`)."""
        assert self.flat is not None
        return self.flat


_Job = _ReadJob | _GenerateJob


class HFReader:
    """The scheduling front of the hf engine: one FIFO queue, one loop, one engine thread.

    Each turn the loop takes the head of the queue. Reads at the head are batched together, in
    arrival order, up to MAX_BATCH_ROWS canvases: a read never waits behind a later one, so it waits
    at most for the batch running when it arrived plus the batches of the reads ahead of it. A
    generation runs ONE model pass per turn and is then queued again at the end, so a read waits at
    most one pass behind any generation. Work whose caller went away (its awaiting task cancelled)
    is dropped when its turn comes, and a running generation stops at its next pass.

    Images the engine thread would have to decode are preprocessed in `image_workers` threads before
    the job is queued. At most `image_budget` preprocessed images (a few MiB each) wait in the queue;
    past that, a job goes without and the engine thread decodes its images as it always could.
    """

    # Levels, not counts (for /metrics): the flat turn's KV store, after each turn.
    stat_gauges = ("kv_blocks_used", "kv_blocks_cached", "kv_blocks_allocated")
    image_workers = min(4, os.cpu_count() or 1)
    image_budget = 64

    def __init__(self, runner: DiffusionRunner, tokenizer: ChatTokenizer, info: ReaderInfo, options: HFOptions, *,
                 degraded: str | None = None) -> None:
        self.runner = runner
        self.tokenizer = tokenizer
        self.info = info
        self.options = options
        self._queue: deque[_Job] = deque()
        self._wakeup: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._collector: CollectorWatch | None = None
        self._event_loop: asyncio.AbstractEventLoop | None = None
        self._busy = False  # the last read batch served several callers, or more were waiting
        self._last_rows = 0  # canvases in the last read batch: the callers likely to come back under load
        self._stepped = False  # the last turn was a heavy read's step or a generation's pass
        self._compiled = compile_counts(runner)  # as of `start` (ready), then of the last pass
        self._allocations = runner.allocator_counts()  # the allocator's (device allocations, retries) after the last turn
        self._image_executor: ThreadPoolExecutor | None = None
        self._images_held = 0  # preprocessed images reserved or riding with queued jobs
        self._degraded = degraded  # why the engine serves less than its defaults (`degraded`): the card's memory

    @property
    def stats(self) -> dict[str, float]:
        return {**self.runner.stats, "queue_depth": len(self._queue)}

    @property
    def images_held(self) -> int:
        """Preprocessed images reserved for jobs or riding with queued ones (at most `image_budget`);
        0 whenever nothing is queued or being preprocessed."""
        return self._images_held

    @property
    def ready(self) -> bool:
        return self._task is not None and not self._task.done()

    @property
    def degraded(self) -> str | None:
        return self._degraded

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        if self._task is not None:
            if self._event_loop is not loop:
                raise RuntimeError("this reader already runs in another event loop; give each app its own reader")
            return
        self._event_loop = loop
        self._collector = CollectorWatch(self.runner.stats)
        gc.callbacks.append(self._collector)
        self._compiled = compile_counts(self.runner)
        self._allocations = self.runner.allocator_counts()
        for name in (*AFTER_READY, *(f"{kind}_turn_{unit}" for kind in TURN_KINDS for unit in ("count", "ms"))):
            self.runner.stats[name] += 0  # exported from the first scrape on, at 0
        self._wakeup = asyncio.Event()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="djev-engine",
                                            initializer=self._setup_engine_thread)
        self._image_executor = ThreadPoolExecutor(max_workers=self.image_workers, thread_name_prefix="djev-images")
        self._task = asyncio.create_task(self._loop(), name="djev-batching-loop")

    def _setup_engine_thread(self) -> None:
        if self.options.torch_compile and self.runner.device.type == "cuda":  # torch.compile's limits are per thread
            from app.engine.hf.compiled import configure_thread

            configure_thread()

    async def stop(self) -> None:
        task, self._task = self._task, None
        self._event_loop = None
        if self._collector is not None and self._collector in gc.callbacks:
            gc.callbacks.remove(self._collector)
        if task is not None:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
        while self._queue:
            job = self._queue.popleft()
            self._release(job)
            self._fail(job, EngineUnavailable("the engine stopped"))
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        images, self._image_executor = self._image_executor, None
        if images is not None:
            images.shutdown(wait=False)  # a frame still decoding finishes; its caller then gets EngineUnavailable

    # ------------------------------------------------------------------ callers

    async def read(self, specs: Sequence[ReadSpec]) -> list[ReadResult]:
        if not specs:
            return []
        self._admit()
        flat = self.runner.flat
        longest = max(len(spec.prompt.ids) for spec in specs)
        if flat is not None and longest > flat.max_prompt_tokens:  # at once, not after a turn (images add tokens)
            raise self.runner.too_long(longest)
        images = await self._preprocess([spec.prompt for spec in specs], reuse=True)
        if flat is not None:
            try:
                flat.refuse_wider([len(canvas) for spec in specs for canvas in spec.canvases],
                                              _image_tokens(images))
            except EngineInputError:
                self._release_images(images)
                raise
        heavy = self._heavy(specs)
        long_tokens = 0 if heavy else sum(self.runner.long_encoding(prompt) for prompt in {spec.prompt for spec in specs})
        job = _ReadJob(list(specs), asyncio.get_running_loop().create_future(), images, heavy, long_tokens)
        if self.runner.flat is not None:
            from app.engine.hf.flat.reads import ReadProgram

            job.flat = ReadProgram(self.runner, specs, images)
        self._submit(job)
        return await job.future

    async def generate(self, spec: GenerateSpec) -> GenerateResult:
        return await collect(self.stream(spec))

    async def stream(self, spec: GenerateSpec) -> AsyncIterator[GenerateChunk]:
        self._admit()
        job = _GenerateJob(spec, await self._preprocess([spec.prompt], reuse=False))
        if self.runner.flat is not None:
            from app.engine.hf.flat.generate import GenerateProgram

            try:
                self.runner.flat.refuse_wider([self.info.canvas_length], _image_tokens(job.images))
                job.flat = GenerateProgram(self.runner, spec, self.info.canvas_length, job.images)
            except EngineInputError:
                self._release(job)
                raise
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

    def _heavy(self, specs: Sequence[ReadSpec]) -> bool:
        """Whether these reads need more than one engine turn: more canvases than MAX_BATCH_ROWS, a
        multi-step read, or a prompt to encode in chunks (`DiffusionRunner.needs_chunks`)."""
        rows = sum(len(spec.canvases) for spec in specs)
        return (rows > self.options.max_batch_rows or any(spec.steps > 1 for spec in specs)
                or any(self.runner.needs_chunks(spec.prompt) for spec in specs))

    def _admit(self) -> None:
        if self._wakeup is None or not self.ready:
            raise EngineUnavailable("the engine is not running")
        if len(self._queue) >= self.options.queue_limit:
            raise EngineUnavailable("the engine queue is full")

    def _submit(self, job: _Job) -> None:
        try:
            self._admit()  # again: the engine may have stopped, or the queue filled, while images decoded
        except EngineUnavailable:
            self._release(job)
            raise
        assert self._wakeup is not None
        self._queue.append(job)
        self._wakeup.set()

    # ------------------------------------------------------------------ images

    async def _preprocess(self, prompts: Sequence[Prompt], *, reuse: bool) -> Preprocessed:
        """The images of `prompts` that the engine thread would otherwise decode (not already known
        to its LRUs when the job may `reuse` them), decoded and processed in the image workers, once
        per distinct set, within `image_budget`. A set that cannot be read maps to its
        EngineInputError, raised on the engine thread where inline decoding would raise it, so a
        bad image fails exactly the reads it failed before."""
        with_images = [prompt for prompt in prompts if prompt.images]
        executor = self._image_executor
        if not with_images or executor is None:
            return {}
        loop = asyncio.get_running_loop()
        # The cache keys hash every image's bytes (up to MAX_TOTAL_IMAGE_BYTES): here, in a worker, once per
        # prompt (`Prompt.cache_key` keeps them), so neither the event loop nor the engine thread hashes.
        keys = await loop.run_in_executor(executor, _cache_keys, with_images)
        wanted: dict[tuple, Prompt] = {}
        room = self.image_budget - self._images_held
        for prompt, key in zip(with_images, keys):
            digests = key[1]
            if digests in wanted or len(digests) > room or (reuse and self.runner.images_cached(key)):
                continue
            wanted[digests] = prompt
            room -= len(digests)
        if not wanted:
            return {}
        reserved = sum(len(digests) for digests in wanted)
        self._images_held += reserved
        try:
            outcomes = await asyncio.gather(
                *(loop.run_in_executor(executor, self._preprocess_one, prompt) for prompt in wanted.values()))
        except BaseException as exc:
            self._images_held -= reserved
            if isinstance(exc, Exception):
                log.exception("image preprocessing failure")
                raise EngineError(f"engine failure: {describe(exc)}") from exc
            raise  # cancelled: the caller went away; the workers' results are dropped
        self.runner.stats["images_preprocessed"] += len(wanted)
        return dict(zip(wanted, outcomes))

    def _preprocess_one(self, prompt: Prompt) -> "ProcessedImages | EngineInputError":
        """In an image worker: the prompt's images ready for upload, or why they cannot be read."""
        try:
            return self.runner.preprocess(prompt)
        except EngineInputError as exc:
            return exc

    def _release(self, job: _Job) -> Preprocessed:
        """Take the job's preprocessed images (once) and give their room back to the budget."""
        images, job.images = job.images, {}
        self._release_images(images)
        return images

    def _release_images(self, images: Preprocessed) -> None:
        """Preprocessed images no job will hold: their room back to the budget."""
        self._images_held -= sum(len(digests) for digests in images)

    # ------------------------------------------------------------------ the loop

    async def _loop(self) -> None:
        assert self._wakeup is not None
        if self.runner.flat is not None:
            await self._flat_loop()
            return
        loop = asyncio.get_running_loop()
        while True:
            while not self._queue:
                self._wakeup.clear()
                await self._wakeup.wait()
            job = self._next_job()
            if job.dropped:
                self._release(job)
                continue
            if isinstance(job, _GenerateJob):
                self._stepped = True
                await self._generation_turn(loop, job)
                continue
            if job.heavy:
                self._stepped = True
                await self._heavy_turn(loop, job)
                continue
            self._stepped = False
            if self.options.gather_ms > 0 and self._busy and job.rows < self.options.max_batch_rows:
                # Under load, closed-loop clients otherwise split into two half-batches that take
                # turns; a short wait lets the reads being planned right now join this batch. A lone
                # caller (the last batch served one job) never waits.
                try:
                    await self._gather(job)
                except asyncio.CancelledError:  # the engine stops: back in the queue, which stop() fails
                    self._queue.appendleft(job)
                    raise
            await self._read_batch(loop, self._take_batch(job))

    # ------------------------------------------------------------------ the flat turn (FLAT_TURN)

    async def _flat_loop(self) -> None:
        """Each turn, one forward over the queue's work (`FlatEngine.step`): every job's program asked in
        queue order for what it runs within the token budget, shared fairly among callers. After the
        turn, the jobs that waited keep their place, and so do light reads the turn's budget split
        (their prompt's tail or their canvas left for the next turn: they finish first, not behind
        every read that arrived since); the jobs that arrived meanwhile follow; heavy work that ran
        (a long prompt's chunk, a multi-step read's step, a generation's pass) goes behind them: a
        steady client's read rides the very turn a heavy request's chunk runs in, or the next."""
        assert self._wakeup is not None
        loop = asyncio.get_running_loop()
        dropped: list[ReadProgram | GenerateProgram] = []
        while True:
            while not self._queue:
                self._wakeup.clear()
                await self._wakeup.wait()
            head = self._queue[0]
            if (self.options.gather_ms > 0 and self._busy and isinstance(head, _ReadJob)
                    and head.rows < self.options.max_batch_rows):
                await self._gather(head)
            jobs: list[_Job] = []
            for job in self._queue:
                if job.dropped:
                    self._release(job)
                    if job.flat is not None:
                        dropped.append(job.flat)
                else:
                    jobs.append(job)
            snapshot = len(self._queue)
            for job in jobs:
                self._release(job)  # (the program holds its images; their room goes back now)
            released, dropped = dropped, []
            ok, report = await self._engine_turn(loop, jobs, "flat", f"a flat turn of {len(jobs)} job(s)",
                                                 self._flat_step, jobs, released)
            arrived = list(self._queue)[snapshot:]
            if not ok or report is None:  # the jobs in the failed turn are answered; the others wait on
                self._queue = deque([*(job for job in jobs if not job.dropped), *arrived])
                continue
            ran = {id(entry) for entry in report.ran}  # (the jobs themselves)
            self._busy = len(jobs) > 1 or bool(arrived)
            self._last_rows = report.canvas_parts
            waiting, again = [], []
            for job in jobs:
                if self._flat_settle(job):
                    continue
                multi_turn = isinstance(job, _GenerateJob) or job.heavy
                (again if id(job) in ran and multi_turn else waiting).append(job)
            self._queue = deque([*waiting, *arrived, *again])

    def _flat_step(self, jobs: list[_Job], dropped: list[ReadProgram | GenerateProgram]) -> TurnReport:
        """On the engine thread: the dropped jobs' programs released, then one turn over `jobs`."""
        flat = self.runner.flat
        assert flat is not None
        for program in dropped:
            flat.release(program)
        return flat.step(jobs)

    def _flat_settle(self, job: _Job) -> bool:
        """What the turn gave `job`'s caller (a read's results once all are in, a generation's chunk);
        True when the job is finished."""
        if isinstance(job, _ReadJob):
            program = job.flat
            assert program is not None
            if not program.done:
                return False
            self.runner.stats["reads"] += len(job.specs)
            self._settle(job, program.outcomes())
            return True
        program = job.flat
        assert program is not None
        for chunk in program.chunks:
            job.chunks.put_nowait(chunk)
        program.chunks = []
        if program.error is not None:
            job.chunks.put_nowait(program.error)
            return True
        return program.done

    def _next_job(self) -> _Job:
        """The queue's head; but after a heavy read's step or a generation's pass, the first light
        read waiting, if any: steps and passes take turns with the light reads, so a steady client
        waits at most one step of one heavy request (not one of each queued ahead of it), and the
        heavy requests still take a step after every light batch."""
        if self._stepped:
            for index, job in enumerate(self._queue):
                if isinstance(job, _ReadJob) and not job.heavy and not job.dropped:
                    del self._queue[index]
                    return job
        return self._queue.popleft()

    def _take_batch(self, first: _ReadJob) -> list[_ReadJob]:
        """`first` and the queued light reads that join its batch, up to MAX_BATCH_ROWS canvases, in
        arrival order, shared fairly among callers (decisions: `current_caller`): while reads of
        other callers wait, one caller's reads take at most half the batch in the first pass, so a
        decision of 200 questions cannot keep a steady client's read out of batch after batch; the
        room left is then filled in arrival order. A read that does not fit ends each pass (nothing
        jumps a read that waits for room), and a read at the head of the queue always goes next.
        Long prompts to encode (`_ReadJob.long_tokens`) fill at most `prefill_chunk` tokens of a
        batch besides `first`'s: a read past that waits for a later batch while shorter reads go on,
        so a decision of many long prompts takes several short turns, not one that every read in it
        waits out (the steady client beside the served bench's 200-question decision)."""
        limit = self.options.max_batch_rows
        budget = max(self.options.prefill_chunk, first.long_tokens)
        queue = list(self._queue)
        light = [job for job in queue if isinstance(job, _ReadJob) and not job.heavy]
        for job in light:
            if job.dropped:
                self._release(job)
        light = [job for job in light if not job.dropped]
        fair = any(job.caller != first.caller for job in light)
        share = max(first.rows, limit // 2)
        taken: Counter[int] = Counter({first.caller: first.rows})
        chosen: dict[int, _ReadJob] = {}
        rows, tokens = first.rows, first.long_tokens
        for capped in ((True, False) if fair else (False,)):
            for job in light:
                if id(job) in chosen:
                    continue
                if rows + job.rows > limit:
                    break
                if capped and taken[job.caller] + job.rows > share:
                    continue
                if job.long_tokens and tokens + job.long_tokens > budget:
                    continue
                chosen[id(job)] = job
                taken[job.caller] += job.rows
                rows += job.rows
                tokens += job.long_tokens
        self._queue = deque(job for job in queue if id(job) not in chosen and not job.dropped)
        return [first, *(job for job in light if id(job) in chosen)]

    async def _gather(self, first: _ReadJob) -> None:
        """Wait up to `gather_ms` for more reads to join `first`'s batch, ending as soon as the queue
        holds as many canvases as the last batch had (the callers it served, back with their next
        read) or a full batch: the wait costs nothing once they are all in, and a caller a little
        late still rides this batch rather than the next (measured: docs/benchmarks.md)."""
        assert self._wakeup is not None
        deadline = asyncio.get_running_loop().time() + self.options.gather_ms / 1000
        wanted = min(max(self._last_rows, 2), self.options.max_batch_rows)
        if self.options.gather_rows:  # BATCH_GATHER_ROWS: two cohorts rather than one lock-step batch
            wanted = min(wanted, self.options.gather_rows)
        started = time.perf_counter()
        try:
            async with asyncio.timeout_at(deadline):
                while first.rows + self._queued_read_rows() < wanted:
                    self._wakeup.clear()  # _submit sets it for every job it queues
                    await self._wakeup.wait()
        except TimeoutError:
            pass
        if log.isEnabledFor(logging.DEBUG):
            log.debug("batch gather: %.1f ms for %d of %d wanted row(s)", (time.perf_counter() - started) * 1000,
                      first.rows + self._queued_read_rows(), wanted)

    def _queue_summary(self) -> str:
        """What waits in the queue, by kind (the debug trace's view of it)."""
        light = [job for job in self._queue if isinstance(job, _ReadJob) and not job.heavy]
        heavy = sum(1 for job in self._queue if isinstance(job, _ReadJob) and job.heavy)
        generations = len(self._queue) - len(light) - heavy
        return (f"{len(light)} light read(s) of {sum(job.rows for job in light)} row(s), {heavy} heavy, "
                f"{generations} generation(s)")

    def _queued_read_rows(self) -> int:
        """Canvases of the light reads queued (what a batch formed now would take from: `_take_batch`
        takes light reads from anywhere in the queue). Counting only those ahead of the first step
        or generation made every gather beside heavy work wait its whole window."""
        return sum(job.rows for job in self._queue if isinstance(job, _ReadJob) and not job.heavy and not job.dropped)

    def _settle_if_built(self, seconds: float = 0.0) -> None:
        """After a pass: count what it captured or compiled since `ready` (none should: the shape
        policy's set is captured and compiled before), with the pass's `seconds`; and if it built
        anything, set the heap aside again."""
        self.runner.stats["busy_ms"] += round(seconds * 1000)  # the engine thread's work (camera pacing)
        counts = compile_counts(self.runner)
        if counts == self._compiled:
            return
        for name, now, before in zip(AFTER_READY, counts, self._compiled):
            if now > before:
                self.runner.stats[name] += now - before
                self.runner.stats[name + "_ms"] += round(seconds * 1000)
        log.warning("a pass captured or compiled after ready (%s -> %s, %.2f s)", self._compiled, counts, seconds)
        if counts[:2] != self._compiled[:2]:  # new graphs or compiled code: long-lived objects
            settle_heap()
            log.info("new graphs built: the heap set aside from the collector's passes again")
        self._compiled = counts

    async def _read_batch(self, loop: asyncio.AbstractEventLoop, batch: list[_ReadJob]) -> None:
        self._busy = len(batch) > 1 or bool(self._queue)
        self._last_rows = sum(job.rows for job in batch)
        specs = [spec for job in batch for spec in job.specs]
        images: dict[tuple[str, ...], ProcessedImages | EngineInputError] = {}
        for job in batch:
            images.update(self._release(job))
        ok, results = await self._engine_turn(loop, batch, "read", "a read batch", self.runner.read, specs, images)
        if not ok:
            return
        assert results is not None
        self.runner.stats["batches"] += 1
        offset = 0
        for job in batch:
            self._settle(job, results[offset:offset + len(job.specs)])
            offset += len(job.specs)

    async def _heavy_turn(self, loop: asyncio.AbstractEventLoop, job: _ReadJob) -> None:
        """One step of a heavy read (a chunk of a long prompt's encoding, or one decoder pass), then
        back in line; its results once the last step is done."""
        if job.program is None:
            job.program = self.runner.read_steps(job.specs, self._release(job))
        job.turns += 1
        ok, step = await self._engine_turn(loop, [job], "heavy", f"step {job.turns} of a heavy read", advance_read,
                                           job.program)
        if not ok or step is None:
            job.program = None
            return
        done, results = step
        self.runner.stats["heavy_turns"] += 1
        if not done:
            if job.dropped:
                job.program.close()  # its caller went away: the rest of its steps never run
            else:
                self._queue.append(job)
            return
        assert results is not None
        self._settle(job, results)

    async def _generation_turn(self, loop: asyncio.AbstractEventLoop, job: _GenerateJob) -> None:
        """One model pass of a generation (its prompt encoding is the first), then back in line."""
        ok, chunk = await self._engine_turn(loop, [job], "generation", "a generation", self._generation_pass, job,
                                            self._release(job))
        if not ok:
            return
        if chunk is not None:
            job.chunks.put_nowait(chunk)
            if chunk.done:
                return
        if not job.cancelled:
            self._queue.append(job)

    def _generation_pass(self, job: _GenerateJob, images: Preprocessed) -> GenerateChunk | None:
        if job.state is None:  # its prompt's encoding first: a long one a chunk a turn, like a read's
            if job.starting is None:
                job.starting = self.runner.start_steps(job.spec, self.info.canvas_length, images)
            done, job.state = advance(job.starting)
            if done:
                job.starting = None
            return None
        return self.runner.step_generation(job.state)

    async def _engine_turn(self, loop: asyncio.AbstractEventLoop, jobs: Sequence[_Job], kind: str, work: str,
                           call: Callable[..., Value], *args: object) -> tuple[bool, Value | None]:
        """`call(*args)` on the engine thread, one turn of `work`: (True, its value), or (False,
        None) once every job of `jobs` has been failed as the failure says (the engine stopping, the
        input, the model: `_engine_failure`). Counts what the turn built and its busy time, and the
        turn under its `kind` (TURN_KINDS: `<kind>_turn_count`, `<kind>_turn_ms`), so a scrape says
        how long each kind of turn takes on average, the bound a waiting read's latency depends on."""
        started = time.perf_counter()
        self.runner.step_note = ""  # (turns never overlap: the engine thread is idle here)
        try:
            value = await loop.run_in_executor(self._executor, call, *args)
        except asyncio.CancelledError:
            for job in jobs:
                self._fail(job, EngineUnavailable("the engine stopped"))
            raise
        except Exception as exc:  # noqa: BLE001 - a model failure must reach every request it fails
            failed: Sequence[object] = jobs
            if isinstance(exc, TurnFailed):  # a flat turn fails the work in it alone, the rest stays queued
                failed, exc = exc.entries, exc.cause
            failure = exc if isinstance(exc, EngineInputError) else self._engine_failure(exc, work)
            for job in failed:
                assert isinstance(job, (_ReadJob, _GenerateJob))
                self._fail(job, failure)
            return False, None
        seconds = time.perf_counter() - started
        self._settle_if_built(seconds)
        self.runner.stats[f"{kind}_turn_count"] += 1
        self.runner.stats[f"{kind}_turn_ms"] += round(seconds * 1000)
        allocations, before = self.runner.allocator_counts(), self._allocations
        self._allocations = allocations  # one read a turn: the engine thread alone allocates, and only in turns
        device_allocs, retries = allocations[0] - before[0], allocations[1] - before[1]
        self.runner.stats["allocator_retries"] += retries
        if log.isEnabledFor(logging.DEBUG):  # LOG_LEVEL=debug: the turn-by-turn trace of the scheduler
            log.debug("engine turn: %s, %.1f ms, %d job(s), %d row(s); its last step: %s; queued after it: %s", work,
                      seconds * 1000, len(jobs), sum(getattr(job, "rows", 0) for job in jobs),
                      self.runner.step_note or "-", self._queue_summary())
        if seconds > SLOW_TURN_S:  # the scheduling contract bounds a turn: say which work broke it
            self.runner.stats["slow_turns"] += 1
            log.warning("an engine turn took %.0f ms: %s for %d request(s); its last step: %s; the allocator asked the "
                        "device for memory %d time(s), %d after freeing its cache", seconds * 1000, work, len(jobs),
                        self.runner.step_note or "-", device_allocs, retries)
        return True, value

    @staticmethod
    def _settle(job: _ReadJob, results: Sequence[ReadResult | Exception]) -> None:
        """A read job's results, or the first exception among them, to its caller (if still there)."""
        if job.future.done():
            return
        failure = next((r for r in results if isinstance(r, Exception)), None)
        if failure is not None:
            job.future.set_exception(failure)
        else:
            job.future.set_result([r for r in results if not isinstance(r, Exception)])  # all of them

    def _engine_failure(self, exc: Exception, work: str) -> EngineError:
        """What the callers of failed work are told. Out of GPU memory fails only that work, as a
        503 (the server is not broken, the request was too large for the memory free now); the
        allocator's cache is emptied and nothing is turned off for anyone. Anything else is a 502."""
        if type(exc).__name__ == "OutOfMemoryError":  # torch.OutOfMemoryError, without importing torch here
            import torch

            self.runner.stats["out_of_memory"] += 1
            log.warning("out of GPU memory during %s: it fails alone (%s)", work, describe(exc))
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            return EngineUnavailable("the engine ran out of GPU memory for this request; try again, or send a "
                                     "smaller one")
        log.error("engine failure during %s", work, exc_info=(type(exc), exc, exc.__traceback__))
        return EngineError(f"engine failure: {describe(exc)}")

    @staticmethod
    def _fail(job: _Job, exc: BaseException) -> None:
        if isinstance(job, _ReadJob):
            if not job.future.done():
                job.future.set_exception(exc)
        elif not job.dropped:
            job.failed = True
            job.chunks.put_nowait(exc)
