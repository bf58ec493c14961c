"""Engine `hf`: transformers' DiffusionGemmaForBlockDiffusion in this process, CPU or CUDA.

Reads and generations from every request go into one bounded FIFO queue; a single loop runs engine
turns on the one engine thread, each turn one forward over a flat batch of the queue's new tokens
(`FlatEngine.step`: prompt chunks, canvases, a generation's pass, within TURN_TOKENS, shared fairly
among callers), and hands results back as the work in them finishes. The loop keeps the scheduling
contract of `app/engine/base.py`.

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
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, AsyncIterator, Callable, Sequence, TypeVar

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
from app.engine.hf.scheduler import TurnFailed, after_turn
from app.engine.hf.watch import CollectorWatch, compile_counts, settle_heap

if TYPE_CHECKING:
    from app.engine.hf.engine import TurnReport
    from app.engine.hf.generations import GenerateProgram
    from app.engine.hf.images import Preprocessed, ProcessedImages
    from app.engine.hf.reads import ReadProgram
    from app.engine.hf.runner import DiffusionRunner


log = logging.getLogger("djev.engine")

# A turn of the engine thread longer than this is logged and counted (`slow_turns`): app/engine/base.py's
# scheduling contract keeps every turn short (TURN_TOKENS new tokens at most).
SLOW_TURN_S = 0.5
# The gather waits for as many canvases as the most of this many recent turns read. The last turn's
# alone sank under load: one small turn made the next gather end at once, and 64 closed-loop clients
# on the CPU were served in turns of 2.6 canvases, at 72 req/s where 32 clients got 183.
GATHER_TURNS = 16
# A job of more than 1 / LIGHT_SHARE of a turn's tokens is heavy (`HFReader._heavy`): light work goes
# first, so it must be small for a steady read to wait about one turn behind it.
LIGHT_SHARE = 4


@dataclass(frozen=True)
class HFOptions:
    """What the hf engine is told; built from Settings by `app.build.hf_options` (defaults live there)."""

    device: str  # "auto", "cpu", "cuda", "cuda:1", ...
    max_prompt_tokens: int  # the longest state asked for (0: by the device); the KV store may hold fewer
    kv_cache_entries: int  # image features kept (at most 16)
    max_batch_rows: int  # the most canvases a turn reads
    gather_ms: float  # the most a turn waits for more reads before it starts (0 = not at all)
    queue_limit: int
    served_name: str
    canvas_length: int
    tiny: bool
    torch_threads: int  # 0 = torch's default
    cuda_graphs: bool  # the turn's pieces and the vision tower as CUDA graphs (CUDA only)
    torch_compile: bool  # compile the layer bodies and the vision layers, CUDA only (app/engine/hf/compiled.py)
    fused_moe: bool  # the experts as Triton kernels, CUDA only (app/engine/hf/moe/fused.py)
    prefill_chunk: int = 2048  # a prompt's tokens one turn writes at most (longer prompts: in chunks)
    prompt_cache_bytes: int = 0  # the KV store's bytes (0: sized by the device, `loader.store_bytes`)
    gather_rows: int = 32  # the most canvases a gather waits for (0: the last turn's count)
    turn_tokens: int = 0  # a turn's token budget (0: by the device, `loader.turn_tokens`)
    quantize: str = ""  # "fp8": a bf16 checkpoint's text layers quantized to FP8 at load ("": the checkpoint's format)


# An engine turn (every kind of work at once): its count and milliseconds (`<kind>_turn_count`, `_ms`).
TURN_KINDS = ("flat",)
AFTER_READY = ("captures_after_ready", "recompiles_after_ready", "triton_compiles_after_ready")


Value = TypeVar("Value")


def _image_tokens(images: Preprocessed) -> list[int]:
    """The soft tokens of each image preprocessed for a job (a set that failed to decode has none)."""
    return [count for processed in images.values() if not isinstance(processed, Exception)
            for count in processed.counts]


def _cache_keys(prompts: Sequence[Prompt]) -> list[CacheKey]:
    return [prompt.cache_key for prompt in prompts]


class _ReadJob:
    """Reads of one caller, their images preprocessed, and their program (the engine's `Entry`). A
    `heavy` one (more than one turn of work by nature: a long prompt, a multi-step read, more canvases
    than a turn reads) goes behind newer work after each turn it runs in."""

    def __init__(self, specs: list[ReadSpec], future: asyncio.Future[list[ReadResult]], images: Preprocessed,
                 program: ReadProgram, heavy: bool) -> None:
        self.caller = current_caller.get()  # the decision it is for: turns are shared fairly among them
        self.specs = specs
        self.future = future
        self.rows = sum(len(spec.canvases) for spec in specs)
        self.images = images
        self.work = program
        self.heavy = heavy
        self.passed = 0  # turns it waited in the queue without running (`scheduler.after_turn`)

    @property
    def dropped(self) -> bool:
        return self.future.done()  # cancelled by its caller (deadline, disconnect) or already failed


class _GenerateJob:
    """A generation (the engine's `Entry`): its prompt's chunks, then a denoise pass a turn."""

    heavy = True

    def __init__(self, spec: GenerateSpec, images: Preprocessed, program: GenerateProgram) -> None:
        self.passed = 0  # turns it waited in the queue without running (`scheduler.after_turn`)
        self.caller = current_caller.get()
        self.spec = spec
        self.images = images
        self.work = program
        self.chunks: asyncio.Queue[GenerateChunk | BaseException] = asyncio.Queue()
        self.cancelled = False
        self.failed = False  # its caller was sent an exception: nothing more runs

    @property
    def dropped(self) -> bool:
        return self.cancelled or self.failed


_Job = _ReadJob | _GenerateJob


class HFReader:
    """The scheduling front of the hf engine: one FIFO queue, one loop, one engine thread.

    Each turn the loop hands the queue, in its fair order, to the engine (`FlatEngine.step`), which
    takes what fits TURN_TOKENS: every job's next chunk or canvas step, one caller at most half the
    turn while others wait, light and heavy work each at most half while the other waits. After the
    turn light work goes first and heavy work behind it (`_loop`), so a read waits at most about one
    turn behind any number of heavy requests. Work whose caller went away (its awaiting task cancelled) is dropped at the next
    turn, its blocks released, and a running generation stops there.

    Images the engine thread would have to decode are preprocessed in `image_workers` threads before
    the job is queued. At most `image_budget` preprocessed images (a few MiB each) wait in the queue;
    past that, a job goes without and the engine thread decodes its images as it always could.
    """

    # Levels, not counts (for /metrics): the KV store's blocks, after each turn.
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
        self._busy = False  # the last turn served several jobs, or more arrived meanwhile
        self._last_rows = 0  # the most canvases of the last GATHER_TURNS turns: the callers likely back under load
        self._recent_rows: deque[int] = deque(maxlen=GATHER_TURNS)
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
        if longest > flat.max_prompt_tokens:  # refused at once, not after a turn (images only add tokens)
            raise self.runner.too_long(longest)
        images = await self._preprocess([spec.prompt for spec in specs], reuse=True)
        try:
            flat.refuse_wider([len(canvas) for spec in specs for canvas in spec.canvases], _image_tokens(images))
        except EngineInputError:
            self._release_images(images)
            raise
        from app.engine.hf.reads import ReadProgram

        job = _ReadJob(list(specs), asyncio.get_running_loop().create_future(), images,
                       ReadProgram(self.runner, specs, images), self._heavy(specs))
        self._submit(job)
        return await job.future

    async def generate(self, spec: GenerateSpec) -> GenerateResult:
        return await collect(self.stream(spec))

    async def stream(self, spec: GenerateSpec) -> AsyncIterator[GenerateChunk]:
        from app.engine.hf.generations import GenerateProgram

        self._admit()
        images = await self._preprocess([spec.prompt], reuse=False)
        try:
            self.runner.flat.refuse_wider([self.info.canvas_length], _image_tokens(images))
            job = _GenerateJob(spec, images, GenerateProgram(self.runner, spec, self.info.canvas_length, images))
        except EngineInputError:
            self._release_images(images)
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
        """Whether these reads are heavy: more than one engine turn's work by nature (more canvases than
        a turn reads, MAX_BATCH_ROWS; a multi-step read; a prompt longer than a turn writes,
        PREFILL_CHUNK), or more than 1 / LIGHT_SHARE of a turn's tokens. Light work goes first, so a
        light job must be small: a 200-question decision's five reads of ~1,600 tokens each, counted
        light, kept a steady ticket of ~270 waiting 2.7 s behind them on an H100."""
        rows = sum(len(spec.canvases) for spec in specs)
        tokens = sum(len(spec.prompt.ids) + sum(len(canvas) for canvas in spec.canvases) for spec in specs)
        return (rows > self.options.max_batch_rows or any(spec.steps > 1 for spec in specs)
                or any(len(spec.prompt.ids) > self.runner.prefill_chunk for spec in specs)
                or tokens * LIGHT_SHARE > self.runner.flat.budget)

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
            if digests in wanted or len(digests) > room or (reuse and self.runner.images.cached(key)):
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
            return self.runner.images.preprocess(prompt)
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
        """Each turn, one forward over the queue's work (`FlatEngine.step`): every job's program asked in
        queue order for what it runs within the token budget, shared fairly among callers. After the
        turn the queue is ordered by `scheduler.after_turn`: light work first (a light read the budget
        split before the reads that came since), then heavy work (what waited, what arrived, what ran),
        a heavy job that waited STARVED_TURNS turns ahead of the other heavy work. With the turn's shares
        (each kind at most half while the other waits) a steady client's read waits about one turn
        behind any number of heavy requests, and light work never keeps heavy work out."""
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
                    dropped.append(job.work)
                else:
                    jobs.append(job)
            snapshot = len(self._queue)
            for job in jobs:
                self._release(job)  # (the program holds its images; their room goes back now)
            released, dropped = dropped, []
            ok, report = await self._engine_turn(loop, jobs, "flat", f"a turn of {len(jobs)} job(s)",
                                                 self._step, jobs, released)
            arrived = list(self._queue)[snapshot:]
            if not ok or report is None:  # the jobs in the failed turn are answered; the others wait on
                self._queue = deque([*(job for job in jobs if not job.dropped), *arrived])
                continue
            ran = {id(entry) for entry in report.ran}  # (the jobs themselves)
            self._busy = len(jobs) > 1 or bool(arrived)
            self._recent_rows.append(report.canvas_parts)
            self._last_rows = max(self._recent_rows)
            unfinished = [job for job in jobs if not self._settle_turn(job)]
            self._queue = deque(after_turn(unfinished, arrived, ran))

    def _step(self, jobs: list[_Job], dropped: list[ReadProgram | GenerateProgram]) -> TurnReport:
        """On the engine thread: the dropped jobs' programs released, then one turn over `jobs`."""
        flat = self.runner.flat
        for program in dropped:
            flat.release(program)
        return flat.step(jobs)

    def _settle_turn(self, job: _Job) -> bool:
        """What the turn gave `job`'s caller (a read's results once all are in, a generation's chunk);
        True when the job is finished."""
        if isinstance(job, _ReadJob):
            program = job.work
            if not program.done:
                return False
            self.runner.stats["reads"] += len(job.specs)
            self._settle(job, program.outcomes())
            return True
        program = job.work
        for chunk in program.chunks:
            job.chunks.put_nowait(chunk)
        program.chunks = []
        if program.error is not None:
            job.chunks.put_nowait(program.error)
            return True
        return program.done

    async def _gather(self, first: _ReadJob) -> None:
        """Wait up to `gather_ms` for more reads to join `first`'s turn, ending as soon as the queue
        holds as many canvases as the recent turns read at most (GATHER_TURNS: the callers they served,
        back with their next read), BATCH_GATHER_ROWS or MAX_BATCH_ROWS: the wait costs nothing once
        they are all in, and a caller a little late still rides this turn rather than the next."""
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
        """Canvases of the light reads queued (what a turn formed now would take from). Counting only
        those ahead of the first heavy job made every gather beside heavy work wait its whole window."""
        return sum(job.rows for job in self._queue if isinstance(job, _ReadJob) and not job.heavy and not job.dropped)

    def _settle_if_built(self, seconds: float = 0.0) -> None:
        """After a turn: count what it captured or compiled since `ready` (none should: every graph and
        kernel is built before), with the turn's `seconds`; and if it built
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
