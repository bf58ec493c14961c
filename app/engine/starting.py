"""A reader that answers before its model is loaded: `djev serve` listens at once and loads behind it.

`StartingReader(info, load)` fills the Reader protocol from the first moment. `start()` runs
`load(progress)` (the blocking build of the real reader: minutes for a full model on a GPU) in a
daemon thread, then starts the reader it returned; until then it is not `ready`, its `info` is the
provisional one it was given (the served name, the engine, device "loading"), and its tokenizer,
reads and generations raise `EngineUnavailable("the model is starting: <phase>")`, which every
route answers as a 503. Once started it delegates everything to the real reader.

`status` is what `/health` shows: the state (starting, ready, failed), the latest phase the load
reported with its progress, the seconds since the start, and the reason of a failed load. Each
phase is logged once as it begins, and "ready in N s" at the end.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass
from typing import AsyncIterator, Callable, Literal, Mapping, Sequence

from app.engine.base import (
    ChatTokenizer,
    EngineUnavailable,
    GenerateChunk,
    GenerateResult,
    GenerateSpec,
    Reader,
    ReaderInfo,
    ReadResult,
    ReadSpec,
    StartupProgress,
    describe,
)

log = logging.getLogger("djev.engine")

StartupState = Literal["starting", "ready", "failed", "stopped"]
FIRST_PHASE = "loading"  # until the load reports its own first phase
STARTING_ENGINE = "starting the engine"  # the real reader's `start()`, after the load


@dataclass(frozen=True)
class StartupStatus:
    """Where the start-up stands: the phase the load reported last, with its progress."""

    state: StartupState
    phase: str
    done: int
    total: int
    elapsed_s: float  # since `start()` began; frozen at the end once ready or failed
    reason: str | None = None  # why the load failed (state "failed")


class StartingReader:
    """The Reader `djev serve` serves while `load` builds the real one in a thread (see the module)."""

    def __init__(self, info: ReaderInfo, load: Callable[[StartupProgress], Reader]) -> None:
        self._provisional = info
        self._load = load
        self._lock = threading.Lock()
        self._state: StartupState = "starting"
        self._phase, self._done, self._total = FIRST_PHASE, 0, 0
        self._phases_seen: set[str] = set()
        self._began: float | None = None
        self._ended: float | None = None
        self._reason: str | None = None
        self._failure: BaseException | None = None
        self._reader: Reader | None = None  # the real reader, once started

    # ------------------------------------------------------------------ the start-up

    def progress(self, phase: str, done: int, total: int) -> None:
        """The load's StartupProgress (called from its thread): the latest phase is the one shown,
        and a phase is logged once, as it begins."""
        with self._lock:
            self._phase, self._done, self._total = phase, done, total
            first = phase not in self._phases_seen
            self._phases_seen.add(phase)
        if first:
            log.info("starting: %s", phase)

    @property
    def status(self) -> StartupStatus:
        with self._lock:
            now = self._ended if self._ended is not None else time.monotonic()
            elapsed = 0.0 if self._began is None else now - self._began
            return StartupStatus(self._state, self._phase, self._done, self._total, round(elapsed, 1), self._reason)

    @property
    def failure(self) -> BaseException | None:
        """The exception that ended a failed start-up (None otherwise)."""
        return self._failure

    @property
    def loaded(self) -> Reader | None:
        """The real reader once it is started; None while starting, after a failure or a stop."""
        return self._reader if self._state == "ready" else None

    def unavailable(self) -> EngineUnavailable:
        """What a request is told while this reader cannot serve: the phase, or why the load failed."""
        status = self.status
        if status.state == "failed":
            return EngineUnavailable(f"the model failed to load: {status.reason}")
        if status.state == "stopped":
            return EngineUnavailable("the engine stopped")
        return EngineUnavailable(f"the model is starting: {status.phase}")

    async def start(self) -> None:
        """Load in a daemon thread (a shutdown never waits for it), then start the real reader. A
        failure is logged with its reason, kept in `status`, and raised."""
        if self._began is not None:
            return
        self._began = time.monotonic()
        self.progress(FIRST_PHASE, 0, 0)
        try:
            reader = await self._load_in_thread()
            self.progress(STARTING_ENGINE, 0, 1)
            await reader.start()
        except asyncio.CancelledError:
            self._end("stopped")
            raise
        except Exception as exc:
            self._end("failed", exc)
            log.error("start-up failed while %s: %s", self.status.phase, describe(exc),
                      exc_info=(type(exc), exc, exc.__traceback__))
            raise
        if self._state == "stopped":  # stopped while the reader started: it stops too
            await reader.stop()
            return
        self._reader = reader
        self._end("ready")
        log.info("ready in %.0f s", self.status.elapsed_s)

    async def _load_in_thread(self) -> Reader:
        loop = asyncio.get_running_loop()
        outcome: asyncio.Future[Reader] = loop.create_future()

        def settle(reader: Reader | None, error: BaseException | None) -> None:
            if outcome.done():  # cancelled: nobody waits for this reader
                return
            if error is not None:
                outcome.set_exception(error)
            else:
                outcome.set_result(reader)  # type: ignore[arg-type]

        def run() -> None:
            reader: Reader | None = None
            error: BaseException | None = None
            try:
                reader = self._load(self.progress)
            except Exception as exc:  # noqa: BLE001 - every failure goes back to the loop
                error = exc
            except BaseException as exc:  # noqa: BLE001 - SystemExit and the like: a failed load all the same
                error = RuntimeError(f"the load stopped: {describe(exc)}")
            try:
                loop.call_soon_threadsafe(settle, reader, error)
            except RuntimeError:
                pass  # the loop is closed: the server stopped while the model loaded

        threading.Thread(target=run, name="djev-load", daemon=True).start()
        return await outcome

    def _end(self, state: StartupState, failure: BaseException | None = None) -> None:
        with self._lock:
            self._state = state
            self._ended = time.monotonic()
            if failure is not None:
                self._failure = failure
                self._reason = describe(failure)

    async def stop(self) -> None:
        reader, self._reader = self._reader, None
        if self._state in ("starting", "ready"):
            self._end("stopped")
        if reader is not None:
            await reader.stop()

    # ------------------------------------------------------------------ the Reader, delegated

    def _serving(self) -> Reader:
        reader = self.loaded
        if reader is None:
            raise self.unavailable()
        return reader

    @property
    def info(self) -> ReaderInfo:
        reader = self.loaded
        return self._provisional if reader is None else reader.info

    @property
    def tokenizer(self) -> ChatTokenizer:
        return self._serving().tokenizer

    @property
    def ready(self) -> bool:
        reader = self.loaded
        return reader is not None and reader.ready

    @property
    def degraded(self) -> str | None:
        reader = self.loaded
        return None if reader is None else reader.degraded

    @property
    def stats(self) -> Mapping[str, float]:
        reader = self.loaded
        return {} if reader is None else reader.stats

    async def read(self, specs: Sequence[ReadSpec]) -> list[ReadResult]:
        return await self._serving().read(specs)

    async def generate(self, spec: GenerateSpec) -> GenerateResult:
        return await self._serving().generate(spec)

    def stream(self, spec: GenerateSpec) -> AsyncIterator[GenerateChunk]:
        return self._serving().stream(spec)
