"""`GET /metrics`: the server's Prometheus metrics (text exposition format), open like `/health`.

Three sources, so that call sites stay few:

- `RequestMetrics`, a pure ASGI middleware, counts every HTTP request by route template, method
  and status and times it. The route label is the matched route's path template (`/v1/systemone`,
  `/static`), never the raw URL, and an unknown URL is `unmatched`: the label set stays bounded
  whatever clients send.
- `LiveCollector` reads the live state at scrape time: admission (decisions in flight and their
  cost), camera sessions open, whether the reader is ready, and the reader's own `stats`, exported
  under the engine's name (`djev_hf_decoder_passes_total`).
- `Metrics.decided()`, `Metrics.frame_decided()` / `frame_dropped()` and `session_opened()` /
  `paced()` count what cannot be read afterwards: decisions with their latency, canvases and tokens,
  camera frames, camera sessions admitted or refused, and the camera pacer's estimate and pace.

Each app has its own `CollectorRegistry` (never the process-wide default): tests build many apps
in one process, and two servers in one process must not share counts. Every name, type and label
is listed in docs/wire.md §11.2.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from typing import Any, Collection, Iterable, Mapping, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.engine.base import ReaderInfo

log = logging.getLogger("djev.metrics")

# Seconds: a cached tiny-model read takes milliseconds, a big decision on a CPU tens of seconds,
# and REQUEST_TIMEOUT (120 s by default) ends the rest.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
# Seconds, around the walk page's 1.5 s guard on the age of the answer it shows.
FRESHNESS_BUCKETS = (0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 3.0, 5.0, 10.0)
# How a camera session's opening ended (djev_stream_sessions_opened_total's `result`).
SESSION_RESULTS = ("admitted", "refused_load", "refused_max_sessions")

UNMATCHED = "unmatched"  # the route label of a URL no route matches (404s to arbitrary paths)
CLIENT_LEFT = 499  # the status label of a request whose client went away before any answer

# Reader stats are counters (`djev_<engine>_<name>_total`) unless they are levels: a stat the reader
# lists in its optional `stat_gauges`, or whose name ends in one of these, is a gauge.
GAUGE_SUFFIXES = ("_depth", "_entries", "_bytes", "_in_flight", "_open", "_ready")
# ... but for counts of what happened after ready (`captures_after_ready`): counters.
COUNTED_SUFFIXES = ("_after_ready",)
# The engine's queue depth is part of the engine-neutral core (`djev_queue_depth`).
QUEUE_DEPTH_STAT = "queue_depth"

_NOT_A_NAME_CHAR = re.compile(r"[^a-zA-Z0-9_]")


def metric_name_part(text: str) -> str:
    """`text` as a piece of a Prometheus metric name: [a-zA-Z0-9_], never empty."""
    cleaned = _NOT_A_NAME_CHAR.sub("_", text.strip()).strip("_")
    return cleaned or "unnamed"


class _Admission(Protocol):
    @property
    def in_flight(self) -> int: ...

    @property
    def cost(self) -> int: ...

    @property
    def max_requests(self) -> int: ...

    @property
    def max_cost(self) -> int: ...


class _Reader(Protocol):
    @property
    def info(self) -> ReaderInfo: ...

    @property
    def ready(self) -> bool: ...

    @property
    def stats(self) -> Mapping[str, float]: ...

    # Optional: `stat_gauges`, the names in `stats` that are levels rather than counts.


class LiveServices(Protocol):
    """What the collector reads from the app's services at scrape time (read-only)."""

    @property
    def reader(self) -> _Reader: ...

    @property
    def admission(self) -> _Admission: ...

    @property
    def sessions(self) -> Mapping[str, Any]: ...


class DecisionCounts(Protocol):
    """What `Metrics.decided` counts of a decision's Outcome."""

    @property
    def reads(self) -> int: ...  # canvases read in all (every noise draw of every group)

    @property
    def input_tokens(self) -> int: ...

    @property
    def output_tokens(self) -> int: ...


class LiveCollector(Collector):
    """Reads the live state of one app's services each time /metrics is scraped."""

    def __init__(self, services: LiveServices) -> None:
        self.services = services

    def collect(self) -> Iterable[Metric]:
        svc = self.services
        info = svc.reader.info
        engine = metric_name_part(str(info.engine))
        yield _gauge("djev_info", "the model and engine that answer (always 1)", 1.0,
                     {"model": str(info.model), "engine": str(info.engine), "device": str(info.device),
                      "tiny": "true" if info.tiny else "false"})
        yield _gauge("djev_ready", "1 while the reader accepts work", 1.0 if svc.reader.ready else 0.0)
        admission = svc.admission
        yield _gauge("djev_in_flight", "decisions and generations admitted and not yet answered", admission.in_flight)
        yield _gauge("djev_in_flight_limit", "MAX_INFLIGHT", admission.max_requests)
        yield _gauge("djev_in_flight_cost", "cost of the work in flight: canvases plus thought tokens", admission.cost)
        yield _gauge("djev_in_flight_cost_limit", "MAX_INFLIGHT_COST", admission.max_cost)
        yield _gauge("djev_stream_sessions", "camera sessions (/v1/stream) open", len(svc.sessions))
        try:
            stats = dict(svc.reader.stats)
        except Exception:  # noqa: BLE001 - a broken stats property must not take the core metrics down
            log.warning("the %s reader's stats could not be read", engine, exc_info=True)
            return
        if QUEUE_DEPTH_STAT in stats:
            yield _gauge("djev_queue_depth", "reads and generations waiting in the engine's queue",
                         stats.pop(QUEUE_DEPTH_STAT))
        gauges = frozenset(getattr(svc.reader, "stat_gauges", ()))
        yield from engine_metrics(engine, stats, gauges)


def engine_metrics(engine: str, stats: Mapping[str, float], gauges: Collection[str] = ()) -> Iterable[Metric]:
    """A reader's stats as `djev_<engine>_<name>`: counters (`_total`) unless `gauges` lists the
    stat or its name ends in one of GAUGE_SUFFIXES (and not in COUNTED_SUFFIXES)."""
    for key in sorted(stats):
        name = f"djev_{engine}_{metric_name_part(key)}"
        value = float(stats[key])
        doc = f"the {engine} engine's {key}"
        if key in gauges or (name.endswith(GAUGE_SUFFIXES) and not name.endswith(COUNTED_SUFFIXES)):
            yield _gauge(name, doc, value)
        else:
            yield CounterMetricFamily(name.removesuffix("_total"), doc, value=value)


def _gauge(name: str, doc: str, value: float, labels: dict[str, str] | None = None) -> GaugeMetricFamily:
    if not labels:
        return GaugeMetricFamily(name, doc, value=float(value))
    family = GaugeMetricFamily(name, doc, labels=list(labels))
    family.add_metric(list(labels.values()), float(value))
    return family


class Metrics:
    """One app's metrics: its registry, the counters call sites move, and the /metrics endpoint."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("djev_http_requests", "HTTP requests answered, by route template, method and status",
                                ["route", "method", "status"], registry=r)
        self.request_seconds = Histogram("djev_http_request_duration_seconds",
                                         "time from a request's arrival to the end of its answer, by route template",
                                         ["route"], buckets=LATENCY_BUCKETS, registry=r)
        self.decisions = Counter("djev_decisions", "decisions answered, by route", ["route"], registry=r)
        self.decision_seconds = Histogram("djev_decision_duration_seconds",
                                          "time to run one decision (admission to outcome), by route",
                                          ["route"], buckets=LATENCY_BUCKETS, registry=r)
        self.canvases = Counter("djev_decision_canvases",
                                "canvases read by decisions (every noise draw of every group), by route", ["route"], registry=r)
        self.tokens = Counter("djev_decision_tokens", "tokens of decisions as their usage reports them, by route and kind",
                              ["route", "kind"], registry=r)
        self.frames = Counter("djev_stream_frames", "camera frames, by result: decided, or dropped for a newer one",
                              ["result"], registry=r)
        for result in ("decided", "dropped"):
            self.frames.labels(result=result)  # both series exist (at 0) before the first frame
        # How old a camera answer is when it leaves: from its frame's arrival to its result. The
        # client adds its own capture and network time; the walk page drops answers past 1.5 s.
        self.answer_age = Histogram("djev_stream_answer_age_seconds",
                                    "camera frames: seconds from a frame's arrival to its result being sent",
                                    buckets=LATENCY_BUCKETS, registry=r)
        # The answer's age plus the next_frame_ms sent with it: how old the answer on a page is by the
        # time the session's next frame is due (pacing keeps it under the walk page's 1.5 s).
        self.age_before_next = Histogram("djev_stream_age_before_next_seconds",
                                         "camera frames: the answer's age plus the next_frame_ms sent with it",
                                         buckets=FRESHNESS_BUCKETS, registry=r)
        self.sessions_opened = Counter("djev_stream_sessions_opened",
                                       "camera sessions asking to open, by result: admitted, or refused with 1013 "
                                       "for load or past MAX_SESSIONS", ["result"], registry=r)
        for result in SESSION_RESULTS:
            self.sessions_opened.labels(result=result)
        self.capacity = Gauge("djev_stream_capacity_fps",
                              "camera frames/s the engine has been seen to answer (what admission promises from)",
                              registry=r)
        self.pace = Gauge("djev_stream_pace_fps", "camera frames/s the sessions are paced to, in all", registry=r)
        self.next_frame_ms = Gauge("djev_stream_next_frame_ms", "the interval camera sessions are asked to send at",
                                   registry=r)

    def watch(self, services: LiveServices) -> None:
        """Export `services`' live state (admission, sessions, reader stats) at every scrape."""
        self.registry.register(LiveCollector(services))

    # ------------------------------------------------------------------ what call sites count

    def decided(self, route: str, outcome: DecisionCounts, seconds: float) -> None:
        """One decision answered: its latency, the canvases it read and its tokens."""
        self.decisions.labels(route=route).inc()
        self.decision_seconds.labels(route=route).observe(seconds)
        self.canvases.labels(route=route).inc(max(int(outcome.reads), 0))
        self.tokens.labels(route=route, kind="input").inc(max(int(outcome.input_tokens), 0))
        self.tokens.labels(route=route, kind="output").inc(max(int(outcome.output_tokens), 0))

    def frame_decided(self, age_seconds: float) -> None:
        """A camera frame answered, `age_seconds` after it arrived."""
        self.frames.labels(result="decided").inc()
        self.answer_age.observe(max(age_seconds, 0.0))

    def frame_dropped(self) -> None:
        self.frames.labels(result="dropped").inc()

    def frame_paced(self, age_seconds: float, next_frame_ms: float) -> None:
        """A camera answer sent with `next_frame_ms`, `age_seconds` after its frame arrived."""
        self.age_before_next.observe(max(age_seconds, 0.0) + max(next_frame_ms, 0.0) / 1000)

    def session_opened(self, result: str) -> None:
        """A camera session asked to open: one of SESSION_RESULTS."""
        self.sessions_opened.labels(result=result).inc()

    def paced(self, capacity_fps: float, pace_fps: float, next_frame_ms: float) -> None:
        """The camera pacer's state after a change."""
        self.capacity.set(capacity_fps)
        self.pace.set(pace_fps)
        self.next_frame_ms.set(next_frame_ms)

    def request(self, route: str, method: str, status: int, seconds: float) -> None:
        self.requests.labels(route=route, method=method, status=str(status)).inc()
        self.request_seconds.labels(route=route).observe(seconds)

    # ------------------------------------------------------------------ exposition

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

    async def endpoint(self, request: Request) -> Response:
        """`GET /metrics`: Prometheus text format 0.0.4, which every scraper reads, or what the
        scraper's Accept header asks for (OpenMetrics, text 1.0.0)."""
        encode, content_type = choose_encoder(request.headers.get("accept", ""))
        return Response(encode(self.registry), headers={"content-type": content_type, "cache-control": "no-store"})


def route_template(scope: Scope) -> str:
    """The path template of the route that matches `scope` (`/v1/systemone`, `/static` for a Mount),
    or UNMATCHED: a bounded label, whatever URL was asked."""
    app = scope.get("app")
    for route in getattr(app, "routes", ()):
        match, _ = route.matches(scope)
        if match is not Match.NONE:  # FULL, or PARTIAL: the path matches but not the method (a 405)
            return str(getattr(route, "path", UNMATCHED)) or "/"
    return UNMATCHED


def _route_of(scope: Scope) -> str:
    """The route Starlette's router chose for this request (it records it in the scope), or, for an
    answer given before routing (the front door's 401) or no route at all, the one that matches."""
    route = scope.get("route")
    if route is None:
        return route_template(scope)
    return str(getattr(route, "path", UNMATCHED)) or "/"


class RequestMetrics:
    """Pure ASGI middleware: counts and times every HTTP request (websockets are counted as sessions).

    Add it outermost (after the other middleware) so that answers given by middleware, such as a
    401 from the bearer check, are counted too."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status: int | None = None

        async def send_and_note(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        except asyncio.CancelledError:
            status = status or CLIENT_LEFT
            raise
        except Exception:
            status = status or 500  # what Starlette's outermost error handler then answers
            raise
        finally:
            self.metrics.request(_route_of(scope), scope["method"], status or 500, time.perf_counter() - started)
