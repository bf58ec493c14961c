"""/metrics: the collector against fake services, the request middleware on a small app, the
counters, per-app registries, and a live tiny-model server scraped after a decision and a camera
frame (parsed with prometheus_client's own parser)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Mount, Route
from starlette.testclient import TestClient

from app.engine.base import ReaderInfo
from app.web.metrics import (
    CLIENT_LEFT,
    UNMATCHED,
    Metrics,
    RequestMetrics,
    metric_name_part,
)

Samples = dict[tuple[str, frozenset], float]


def parse(text: str) -> Samples:
    """Every sample of an exposition, keyed by (sample name, labels)."""
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


def scrape(metrics: Metrics) -> Samples:
    return parse(metrics.exposition().decode())


# ---------------------------------------------------------------------------- the live collector


@dataclass
class FakeReader:
    stats: dict[str, float] = field(default_factory=dict)
    ready: bool = True
    info: ReaderInfo = ReaderInfo(model="dgemma", engine="fake-engine", device="cpu", tiny=False, canvas_length=128)


@dataclass
class FakeServices:
    reader: Any
    admission: Any = field(default_factory=lambda: SimpleNamespace(in_flight=3, cost=96, max_requests=16, max_cost=4096))
    sessions: dict = field(default_factory=lambda: {"ws_a": object(), "ws_b": object()})


def watched(services: FakeServices) -> Metrics:
    metrics = Metrics()
    metrics.watch(services)
    return metrics


def test_the_collector_reads_live_state_at_scrape_time():
    services = FakeServices(FakeReader())
    metrics = watched(services)
    samples = scrape(metrics)
    assert value(samples, "djev_in_flight") == 3
    assert value(samples, "djev_in_flight_limit") == 16
    assert value(samples, "djev_in_flight_cost") == 96
    assert value(samples, "djev_in_flight_cost_limit") == 4096
    assert value(samples, "djev_stream_sessions") == 2
    assert value(samples, "djev_ready") == 1
    assert value(samples, "djev_info", model="dgemma", engine="fake-engine", device="cpu", tiny="false") == 1
    # Read again at the next scrape, not cached.
    services.admission.in_flight, services.admission.cost = 0, 0
    services.sessions.clear()
    services.reader.ready = False
    samples = scrape(metrics)
    assert value(samples, "djev_in_flight") == 0
    assert value(samples, "djev_in_flight_cost") == 0
    assert value(samples, "djev_stream_sessions") == 0
    assert value(samples, "djev_ready") == 0


def test_engine_stats_are_exported_under_the_engines_own_names():
    reader = FakeReader(stats={"decoder_passes": 7, "kv_hits": 2, "queue_depth": 5, "kv_cache_entries": 9,
                               "weird-name.x": 1, "reads_total": 4})
    samples = scrape(watched(FakeServices(reader)))
    assert value(samples, "djev_fake_engine_decoder_passes_total") == 7  # the engine name made a metric name
    assert value(samples, "djev_fake_engine_kv_hits_total") == 2
    assert value(samples, "djev_fake_engine_weird_name_x_total") == 1
    assert value(samples, "djev_fake_engine_reads_total") == 4  # no doubled _total
    assert value(samples, "djev_fake_engine_kv_cache_entries") == 9  # a level: a gauge
    assert value(samples, "djev_queue_depth") == 5  # the engine-neutral core, not djev_fake_engine_queue_depth
    assert not [key for key in samples if key[0].startswith("djev_fake_engine_queue")]
    families = {f.name: f.type for f in text_string_to_metric_families(watched(FakeServices(reader)).exposition().decode())}
    assert families["djev_fake_engine_decoder_passes"] == "counter"
    assert families["djev_fake_engine_kv_cache_entries"] == "gauge"
    # Stats appear as the engine counts them: a new key shows up at the next scrape.
    reader.stats["graph_replays"] = 3
    assert value(scrape(watched(FakeServices(reader))), "djev_fake_engine_graph_replays_total") == 3


def test_a_reader_names_its_gauges_in_stat_gauges():
    reader = FakeReader(stats={"outstanding": 2, "upstreams_healthy": 1, "requests": 9})
    reader.stat_gauges = ("outstanding", "upstreams_healthy")  # type: ignore[attr-defined]
    text = watched(FakeServices(reader)).exposition().decode()
    types = {f.name: f.type for f in text_string_to_metric_families(text)}
    assert types["djev_fake_engine_outstanding"] == "gauge"
    assert types["djev_fake_engine_upstreams_healthy"] == "gauge"
    assert types["djev_fake_engine_requests"] == "counter"
    assert value(parse(text), "djev_fake_engine_outstanding") == 2


def test_what_was_built_after_ready_is_counted_and_the_kv_stores_blocks_are_levels(tiny_reader):
    reader = FakeReader(stats={"captures_after_ready": 1, "recompiles_after_ready": 0, "kv_blocks_used": 12,
                               "engine_ready": 1})
    reader.stat_gauges = type(tiny_reader).stat_gauges  # type: ignore[attr-defined]  # the hf reader's own list
    types = {f.name: f.type for f in text_string_to_metric_families(watched(FakeServices(reader)).exposition().decode())}
    assert types["djev_fake_engine_captures_after_ready"] == "counter"  # a count, though it ends in _ready
    assert types["djev_fake_engine_recompiles_after_ready"] == "counter"
    assert types["djev_fake_engine_engine_ready"] == "gauge"  # a level named *_ready stays a gauge
    assert types["djev_fake_engine_kv_blocks_used"] == "gauge"


def test_a_reader_without_a_queue_depth_exports_no_made_up_one():
    samples = scrape(watched(FakeServices(FakeReader(stats={"reads": 1}))))
    assert not [key for key in samples if key[0] == "djev_queue_depth"]


def test_broken_reader_stats_leave_the_core_metrics_standing(caplog):
    class Broken:
        info = FakeReader().info
        ready = True

        @property
        def stats(self):
            raise RuntimeError("stats exploded")

    samples = scrape(watched(FakeServices(Broken())))
    assert value(samples, "djev_in_flight") == 3
    assert "stats could not be read" in caplog.text


@pytest.mark.parametrize("text, expected", [
    ("decoder_passes", "decoder_passes"), ("kv-hits", "kv_hits"), ("a.b c", "a_b_c"), ("__", "unnamed"), ("vLLM", "vLLM"),
])
def test_metric_name_part(text, expected):
    assert metric_name_part(text) == expected


# ---------------------------------------------------------------------------- counters


def outcome(canvases: int = 4, input_tokens: int = 120, output_tokens: int = 30) -> Any:
    return SimpleNamespace(reads=canvases, input_tokens=input_tokens, output_tokens=output_tokens)


def test_decided_counts_decisions_latency_canvases_and_tokens():
    metrics = Metrics()
    metrics.decided("systemone", outcome(canvases=4), 0.03)
    metrics.decided("systemone", outcome(canvases=2, input_tokens=80, output_tokens=10), 0.7)
    metrics.decided("stream", outcome(canvases=1), 0.002)
    samples = scrape(metrics)
    assert value(samples, "djev_decisions_total", route="systemone") == 2
    assert value(samples, "djev_decisions_total", route="stream") == 1
    assert value(samples, "djev_decision_canvases_total", route="systemone") == 6
    assert value(samples, "djev_decision_tokens_total", route="systemone", kind="input") == 200
    assert value(samples, "djev_decision_tokens_total", route="systemone", kind="output") == 40
    assert value(samples, "djev_decision_duration_seconds_count", route="systemone") == 2
    assert value(samples, "djev_decision_duration_seconds_sum", route="systemone") == pytest.approx(0.73)
    assert value(samples, "djev_decision_duration_seconds_bucket", route="systemone", le="0.05") == 1
    assert value(samples, "djev_decision_duration_seconds_bucket", route="systemone", le="1.0") == 2


def test_camera_pacing_metrics_start_at_zero_and_follow_the_pacer():
    metrics = Metrics()
    samples = scrape(metrics)
    for result in ("admitted", "refused_load", "refused_max_sessions"):
        assert value(samples, "djev_stream_sessions_opened_total", result=result) == 0
    metrics.session_opened("admitted")
    metrics.session_opened("refused_load")
    metrics.paced(12.5, 15.0, 320)
    metrics.frame_paced(0.4, 320)
    samples = scrape(metrics)
    assert value(samples, "djev_stream_sessions_opened_total", result="admitted") == 1
    assert value(samples, "djev_stream_sessions_opened_total", result="refused_load") == 1
    assert value(samples, "djev_stream_capacity_fps") == 12.5 and value(samples, "djev_stream_pace_fps") == 15
    assert value(samples, "djev_stream_next_frame_ms") == 320
    assert value(samples, "djev_stream_age_before_next_seconds_sum") == pytest.approx(0.72)
    assert value(samples, "djev_stream_age_before_next_seconds_bucket", le="0.5") == 0
    assert value(samples, "djev_stream_age_before_next_seconds_bucket", le="0.75") == 1


def test_frame_counters_start_at_zero_and_count():
    metrics = Metrics()
    samples = scrape(metrics)
    assert value(samples, "djev_stream_frames_total", result="decided") == 0
    assert value(samples, "djev_stream_frames_total", result="dropped") == 0
    assert value(samples, "djev_stream_answer_age_seconds_count") == 0
    metrics.frame_decided(0.4)
    metrics.frame_dropped()
    metrics.frame_dropped()
    samples = scrape(metrics)
    assert value(samples, "djev_stream_frames_total", result="decided") == 1
    assert value(samples, "djev_stream_frames_total", result="dropped") == 2
    assert value(samples, "djev_stream_answer_age_seconds_count") == 1
    assert value(samples, "djev_stream_answer_age_seconds_sum") == pytest.approx(0.4)
    assert value(samples, "djev_stream_answer_age_seconds_bucket", le="0.25") == 0
    assert value(samples, "djev_stream_answer_age_seconds_bucket", le="0.5") == 1


def test_each_app_has_its_own_registry_and_the_global_one_is_untouched():
    first, second = Metrics(), Metrics()
    first.frame_decided(0.1)
    assert value(scrape(first), "djev_stream_frames_total", result="decided") == 1
    assert value(scrape(second), "djev_stream_frames_total", result="decided") == 0
    assert not [m for m in REGISTRY.collect() if m.name.startswith("djev")]


# ---------------------------------------------------------------------------- the request middleware


def small_app(metrics: Metrics) -> Starlette:
    async def item(request):
        return PlainTextResponse("item")

    async def boom(request):
        raise RuntimeError("boom")

    async def teapot(scope, receive, send):
        await PlainTextResponse("static", status_code=200)(scope, receive, send)

    app = Starlette(routes=[
        Route("/items/{item_id}", item, methods=["GET"]),
        Route("/boom", boom),
        Route("/metrics", metrics.endpoint, methods=["GET"]),
        Mount("/static", app=teapot),
    ])
    app.add_middleware(RequestMetrics, metrics=metrics)
    return app


def test_requests_are_counted_by_route_template_method_and_status():
    metrics = Metrics()
    with TestClient(small_app(metrics), raise_server_exceptions=False) as client:
        for n in range(3):
            assert client.get(f"/items/{n}").status_code == 200
        assert client.post("/items/9").status_code == 405
        assert client.get("/static/js/a.js").status_code == 200
        for n in range(4):
            assert client.get(f"/no/such/path/{n}").status_code == 404
        assert client.get("/boom").status_code == 500
        response = client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    samples = parse(response.text)
    assert value(samples, "djev_http_requests_total", route="/items/{item_id}", method="GET", status="200") == 3
    assert value(samples, "djev_http_requests_total", route="/items/{item_id}", method="POST", status="405") == 1
    assert value(samples, "djev_http_requests_total", route="/static", method="GET", status="200") == 1
    assert value(samples, "djev_http_requests_total", route=UNMATCHED, method="GET", status="404") == 4
    assert value(samples, "djev_http_requests_total", route="/boom", method="GET", status="500") == 1
    assert value(samples, "djev_http_request_duration_seconds_count", route="/items/{item_id}") == 4
    # Raw URLs never become labels: the label set stays bounded whatever clients ask.
    routes = {dict(key[1]).get("route") for key in samples if key[0] == "djev_http_requests_total"}
    assert routes == {"/items/{item_id}", "/static", UNMATCHED, "/boom"}


async def client_leaves() -> None:
    metrics = Metrics()
    started = asyncio.Event()

    async def slow(request):
        started.set()
        await asyncio.sleep(30)

    app = Starlette(routes=[Route("/slow", slow)])
    middleware = RequestMetrics(app, metrics)
    scope = {"type": "http", "method": "GET", "path": "/slow", "raw_path": b"/slow", "root_path": "",
             "query_string": b"", "headers": [], "app": app}

    async def receive():
        await asyncio.sleep(60)

    async def send(message):
        pass

    task = asyncio.create_task(middleware(scope, receive, send))
    await asyncio.wait_for(started.wait(), 10)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert value(scrape(metrics), "djev_http_requests_total", route="/slow", method="GET", status=str(CLIENT_LEFT)) == 1


def test_a_request_whose_client_leaves_is_counted_as_499():
    asyncio.run(client_leaves())


# ---------------------------------------------------------------------------- a live tiny-model server

KEY = "sk-metrics-test-key"
DECISION = {"model": "jev-latest", "samples": 1, "state": {"ticket": "The site is down for everyone."}, "questions": {
    "urgent": {"type": "noul", "instructions": "Is this urgent?"}}}


def test_a_live_server_counts_a_decision_and_camera_frames(tiny_dir):
    from websockets.sync.client import connect

    from app.config import Settings
    from app.server import create_app
    from tests.conftest import live_server, make_tiny_reader
    from tests.web.test_stream import GREY, RED, WALK, configure, receive, ws_url

    app = create_app(Settings.of(api_key=KEY), make_tiny_reader(tiny_dir))
    with live_server(app) as url, httpx.Client(base_url=url, timeout=120) as client:
        first = client.get("/metrics")  # open like /health: no key
        assert first.status_code == 200
        assert first.headers["content-type"].startswith("text/plain; version=0.0.4")
        openmetrics = client.get("/metrics", headers={"accept": "application/openmetrics-text; version=1.0.0"})
        assert openmetrics.headers["content-type"].startswith("application/openmetrics-text")
        assert openmetrics.text.rstrip().endswith("# EOF")
        before = parse(first.text)
        assert value(before, "djev_info", model="djev-tiny-random", engine="hf", device="cpu", tiny="true") == 1
        assert value(before, "djev_queue_depth") == 0

        answer = client.post("/v1/systemone", json=DECISION, headers={"authorization": f"Bearer {KEY}"})
        assert answer.status_code == 200, answer.text
        refused = client.post("/v1/systemone", json=DECISION).status_code  # no key: the front door answers
        assert refused in (401, 403)
        assert client.get("/v1/no-such-route/123").status_code == 404

        with connect(ws_url(url), subprotocols=["djev", f"bearer.{KEY}"]) as ws:
            configure(ws, WALK)
            for frame in (RED, GREY, RED):  # back to back: the latest frame wins, earlier ones may drop
                ws.send(frame)
            results = [receive(ws, "result")]
            while results[-1]["frame"] != 3:
                results.append(receive(ws, "result"))
            during = parse(client.get("/metrics").text)
            assert value(during, "djev_stream_sessions") == 1
        after = parse(client.get("/metrics").text)

    decided, dropped = len(results), results[-1]["dropped_total"]
    assert decided + dropped == 3
    assert value(after, "djev_stream_frames_total", result="decided") == decided
    assert value(after, "djev_stream_frames_total", result="dropped") == dropped
    # each answered frame's age, as the server measured it (the results' timing.total_ms)
    assert value(after, "djev_stream_answer_age_seconds_count") == decided
    total_s = sum(result["timing"]["total_ms"] for result in results) / 1000
    assert value(after, "djev_stream_answer_age_seconds_sum") == pytest.approx(total_s, abs=0.001 * decided)
    assert value(after, "djev_stream_sessions") == 0
    requests = "djev_http_requests_total"
    assert value(after, requests, route="/v1/systemone", method="POST", status="200") == 1
    assert value(after, requests, route="/v1/systemone", method="POST", status=str(refused)) == 1
    assert value(after, requests, route="unmatched", method="GET", status="404") == 1
    # The three scrapes before the last one (a request is counted once it has been answered).
    assert value(after, requests, route="/metrics", method="GET", status="200") == 3
    assert value(after, "djev_http_request_duration_seconds_count", route="/v1/systemone") == 2
    assert value(after, "djev_decisions_total", route="systemone") == 1
    assert value(after, "djev_decisions_total", route="stream") == decided
    assert value(after, "djev_decision_duration_seconds_count", route="systemone") == 1
    assert value(after, "djev_decision_canvases_total", route="systemone") == 1  # one question, samples 1
    assert value(after, "djev_decision_tokens_total", route="systemone", kind="input") == answer.json()["usage"]["input_tokens"]
    assert value(after, "djev_decision_tokens_total", route="systemone", kind="output") == answer.json()["usage"]["output_tokens"]
    assert value(after, "djev_in_flight") == 0 and value(after, "djev_in_flight_cost") == 0
    # The hf engine's own counters, read from reader.stats at scrape time.
    for name in ("djev_hf_decoder_passes_total", "djev_hf_encoder_passes_total"):
        assert value(after, name) > before.get((name, frozenset()), 0), name
