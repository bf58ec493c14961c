"""What routes need, built once per app: settings, the reader, the decider, admission, the open
camera sessions and their pacer, and the small worker pool that keeps request-sized work off the event loop.

Routes reach it through `services(request)`; app/server.py builds it. app/web never imports
app/server.py, so the wiring reads one way: server → web.

While the model starts, `reader` is a `StartingReader` (app/engine/starting.py) that has no
tokenizer yet, so the decider (which holds the tokenizer's templates and labels) is built when it is
first needed, and asking for it meanwhile raises the reader's EngineUnavailable (a 503 naming the
phase). Once loaded, `use(reader)` puts the real reader in its place.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, TypeVar

import anyio
from starlette.requests import HTTPConnection

from app.build import check_calibration, limits, load_calibration, read_settings
from app.config import UNSAID_MAX_SESSIONS, Settings
from app.decisions.calibration import Calibration
from app.decisions.limits import Limits
from app.decisions.plan import Plan
from app.decisions.request import Decision
from app.decisions.run import Decider
from app.engine.base import EngineUnavailable, Reader
from app.web.admission import Admission
from app.web.metrics import Metrics
from app.web.pacing import Pacer, PacingRules

log = logging.getLogger("djev.stream")

T = TypeVar("T")

# Threads for parsing, validation and image header checks. They hold the GIL for most of their
# work, so more threads than this buys nothing on a small machine; the bound is what keeps a burst
# of 32 MiB bodies from taking every core from the engine thread.
WORKER_THREADS = 4
# A body up to this size (uncompressed, not multipart) is parsed, validated and planned on the event
# loop: the work is bounded (about a millisecond, measured in docs/reliability.md) and shorter than the
# two thread hops it would otherwise take. Larger bodies, compressed ones and forms go to the pool.
INLINE_BODY_BYTES = 8 * 1024


@dataclass
class Services:
    settings: Settings
    limits: Limits  # the decision core's request limits, from settings
    reader: Reader
    admission: Admission
    pacer: Pacer  # camera sessions: the capacity estimate, admission by load, each session's pace
    workers: anyio.CapacityLimiter  # the pool the decider offloads to as well (build)
    calibration: Calibration | None = None  # CALIBRATION's fit, applied to every read
    started: float = field(default_factory=time.time)
    sessions: dict[str, Any] = field(default_factory=dict)  # open /v1/stream sessions by id
    metrics: Metrics = field(default_factory=Metrics)  # this app's own registry (/metrics)
    _decider: Decider | None = field(default=None, repr=False)
    _decider_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        self.metrics.paced(self.pacer.capacity, self.pacer.pace, self.pacer.next_frame_ms())

    @classmethod
    def build(cls, settings: Settings, reader: Reader, calibration: Calibration | None = None) -> "Services":
        """`calibration`: CALIBRATION's, already read (`djev serve` reads it before the load); else
        read here. One fitted for another model than the reader's is a CalibrationError."""
        if calibration is None:
            calibration = load_calibration(settings)
        built = cls(
            settings=settings,
            limits=limits(settings),
            reader=reader,
            admission=Admission(settings.limits.max_inflight, settings.limits.max_inflight_cost),
            pacer=Pacer(pacing_rules(settings)),
            workers=anyio.CapacityLimiter(WORKER_THREADS),
            calibration=calibration,
        )
        try:
            built._decider = built._new_decider(reader)
        except EngineUnavailable:
            pass  # the model is starting: the decider is built over it once it is loaded (`use`)
        built._start_pacer(reader)
        return built

    @property
    def decider(self) -> Decider:
        """The decider over the reader's tokenizer; while the model starts, the reader's
        EngineUnavailable (built on first use in case a reader gets its tokenizer on its own)."""
        decider = self._decider
        if decider is None:
            with self._decider_lock:
                if self._decider is None:
                    self._decider = self._new_decider(self.reader)
                decider = self._decider
        return decider

    def use(self, reader: Reader) -> None:
        """Serve `reader` from now on: the model a StartingReader loaded, so that routes reach the
        engine itself (its capabilities, such as ChatRelay, included); the decider is built over it."""
        decider = self._new_decider(reader)
        with self._decider_lock:
            self.reader, self._decider = reader, decider
        self._start_pacer(reader)

    @property
    def max_sessions(self) -> int:
        """The camera sessions open at once: MAX_SESSIONS, or with 0 what the engine holds
        (`ReaderInfo.max_sessions`), or UNSAID_MAX_SESSIONS where it does not say."""
        return self.settings.limits.max_sessions or self.reader.info.max_sessions or UNSAID_MAX_SESSIONS

    def _start_pacer(self, reader: Reader) -> None:
        """Camera admission from the frame rate the engine measured at start-up, where it measured one
        above SESSION_CAPACITY_START."""
        rate = reader.info.frame_rate
        if self.pacer.start_from(rate):
            log.info("camera capacity: %.1f frames/s, as the engine measured it at start-up (admits %d sessions "
                     "at MIN_SESSION_FPS; at most %d open)", rate, self.pacer.admissible(), self.max_sessions)
            self.metrics.paced(self.pacer.capacity, self.pacer.pace, self.pacer.next_frame_ms())

    def _new_decider(self, reader: Reader) -> Decider:
        # The decider plans in the same bounded pool as parsing and validation.
        check_calibration(self.calibration, self.settings, reader.info, reader.tokenizer)
        return Decider(reader, read_settings(self.settings, reader.info),
                       offload=functools.partial(_offload_in, self.workers), calibration=self.calibration)

    async def prepare(self, fn: Callable[..., T], body_bytes: int, *args: Any) -> T:
        """`fn(*args)` for a request body of `body_bytes`: inline for a small plain body (its work is
        bounded and shorter than a trip to the pool), in the worker pool otherwise."""
        if body_bytes <= INLINE_BODY_BYTES:
            return fn(*args)
        return await self.offload(fn, *args)

    async def offload(self, fn: Callable[..., T], *args: Any) -> T:
        """Run blocking `fn(*args)` in the worker pool."""
        return await _offload_in(self.workers, fn, *args)

    def plan(self, decision: Decision) -> Plan:
        """What a decision will read and cost (blocking: bounded by the limits; `prepare` decides where)."""
        return self.decider.plan(decision)


def pacing_rules(settings: Settings) -> PacingRules:
    """The camera pacer's rules, from Settings' stream section."""
    stream = settings.stream
    return PacingRules(min_session_fps=stream.min_session_fps, max_session_fps=stream.max_session_fps,
                       capacity_start=stream.session_capacity_start, headroom=stream.session_headroom,
                       window_s=stream.session_window)


async def _offload_in(workers: anyio.CapacityLimiter, fn: Callable[..., T], *args: Any) -> T:
    """Run blocking `fn(*args)` in a thread of `workers`: `Services.offload`, and the decider's
    offload, made before the Services that holds the pool. Cancelling the caller waits for the
    thread to finish its (bounded) work and drops the result."""
    return await anyio.to_thread.run_sync(fn, *args, limiter=workers)


def services(conn: HTTPConnection) -> Services:
    return conn.app.state.services
