"""Deadlines, disconnects and cost admission, with a slow fake reader: REQUEST_TIMEOUT is a 504 and
the reader sees its work cancelled; a client that leaves has its decision cancelled; admission
counts cost; request-sized work runs in worker threads, not on the event loop."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time

import httpx
import pytest
from starlette.testclient import TestClient

from app.config import Settings
from app.server import create_app
from tests.conftest import live_server
from tests.fakes import ScriptedReader

TICKET = {"state": "x", "samples": 1, "questions": {"urgent": {"type": "noul"}}}


class SlowReader(ScriptedReader):
    """Every read takes `delay` seconds; counts reads begun, cancelled and finished."""

    def __init__(self, tokenizer, delay: float) -> None:
        super().__init__(tokenizer)
        self.delay = delay
        self.begun = self.cancelled = self.finished = 0

    async def read(self, specs):
        self.begun += 1
        try:
            await asyncio.sleep(self.delay)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        self.finished += 1
        return await super().read(specs)


def wait_for(condition, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


def test_a_decision_past_request_timeout_is_504_and_its_read_is_cancelled(tokenizer):
    reader = SlowReader(tokenizer, delay=30)
    app = create_app(Settings.of(request_timeout=0.3), reader)
    with TestClient(app) as client:
        started = time.monotonic()
        response = client.post("/v1/systemone", json=TICKET)
        assert time.monotonic() - started < 5
        assert response.status_code == 504, response.text
        assert response.json()["error"]["type"] == "timeout_error"
        assert "REQUEST_TIMEOUT" in response.json()["error"]["message"]
        assert reader.begun == 1 and reader.cancelled == 1 and reader.finished == 0
        health = client.get("/health").json()
        assert health["in_flight"] == 0 and health["in_flight_cost"] == 0
        reader.delay = 0
        assert client.post("/v1/systemone", json=TICKET).status_code == 200


def test_a_client_that_leaves_has_its_decision_cancelled(tokenizer):
    reader = SlowReader(tokenizer, delay=30)
    app = create_app(Settings(), reader)
    with live_server(app) as url:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url + "/v1/systemone", json=TICKET, timeout=httpx.Timeout(10, read=0.5))
        assert wait_for(lambda: reader.cancelled == 1), (reader.begun, reader.cancelled)
        assert reader.finished == 0
        assert wait_for(lambda: httpx.get(url + "/health").json()["in_flight"] == 0)
        reader.delay = 0
        assert httpx.post(url + "/v1/systemone", json=TICKET, timeout=30).status_code == 200


@pytest.fixture
def priced(tokenizer, monkeypatch):
    """An app whose decider prices a decision as samples x questions + think."""
    app = create_app(Settings.of(max_inflight_cost=100), ScriptedReader(tokenizer))
    decider = app.state.services.decider
    real_plan = decider.plan

    def plan(decision):
        return dataclasses.replace(real_plan(decision), canvases=decision.samples.count * len(decision.questions),
                                   thought_tokens=decision.think)

    monkeypatch.setattr(decider, "plan", plan)
    with TestClient(app) as client:
        yield client, app


@pytest.mark.parametrize("body, field", [
    ({**TICKET, "think": 200}, "think"),
    ({**TICKET, "samples": 32, "questions": {f"q{i}": {"type": "noul"} for i in range(4)}}, "samples"),
    ({**TICKET, "questions": {f"q{i}": {"type": "noul"} for i in range(101)}}, "questions"),
])
def test_a_decision_costing_more_than_the_whole_budget_is_400_naming_the_field(priced, body, field):
    client, _ = priced
    response = client.post("/v1/systemone", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == field and "MAX_INFLIGHT_COST=100" in error["message"]


def test_admission_counts_cost_and_health_reports_it(priced):
    client, app = priced
    admission = app.state.services.admission
    admission.cost = 95  # decisions worth 95 are in flight
    response = client.post("/v1/systemone", json={**TICKET, "samples": 8})  # costs 8
    assert response.status_code == 529 and response.headers["retry-after"] == "1"
    assert "95 of 100" in response.json()["error"]["message"]
    assert client.get("/health").json()["in_flight_cost"] == 95
    assert client.post("/v1/systemone", json={**TICKET, "samples": 5}).status_code == 200  # fits exactly
    admission.cost = 0
    assert client.get("/health").json()["in_flight_cost"] == 0


def test_health_shows_the_cost_while_a_decision_runs(tokenizer):
    reader = SlowReader(tokenizer, delay=1.0)
    app = create_app(Settings(), reader)
    with live_server(app) as url:
        thread = threading.Thread(target=lambda: httpx.post(url + "/v1/systemone", json=TICKET, timeout=30))
        thread.start()
        assert wait_for(lambda: reader.begun == 1)
        health = httpx.get(url + "/health").json()
        assert health["in_flight"] == 1 and health["in_flight_cost"] >= 1
        thread.join()
        assert httpx.get(url + "/health").json()["in_flight_cost"] == 0


@pytest.mark.parametrize("state_bytes, in_worker", [(16 * 1024, True), (10, False)])
def test_parsing_and_validation_run_in_a_worker_thread(tokenizer, monkeypatch, state_bytes, in_worker):
    """A body past INLINE_BODY_BYTES is parsed and validated in the worker pool; a small plain one,
    whose work is bounded, on the loop (cheaper than the hop)."""
    import app.web.body as body_module
    import app.web.work as work_module

    threads: dict[str, str] = {}
    real_parse_json, real_parse_decision = body_module.parse_json, work_module.parse_decision

    def parse_json(*args, **kwargs):
        threads["json"] = threading.current_thread().name
        return real_parse_json(*args, **kwargs)

    def parse_decision(*args, **kwargs):
        threads["decision"] = threading.current_thread().name
        return real_parse_decision(*args, **kwargs)

    async def loop_thread(request):
        from starlette.responses import JSONResponse

        return JSONResponse({"thread": threading.current_thread().name})

    from starlette.routing import Route

    monkeypatch.setattr(body_module, "parse_json", parse_json)
    monkeypatch.setattr(work_module, "parse_decision", parse_decision)
    app = create_app(Settings(), ScriptedReader(tokenizer), extra_routes=[Route("/debug/thread", loop_thread)])
    with TestClient(app) as client:
        loop = client.get("/debug/thread").json()["thread"]
        body = {**TICKET, "state": "x" * state_bytes}
        assert client.post("/v1/systemone", json=body).status_code == 200
    assert set(threads) == {"json", "decision"}
    if in_worker:
        assert loop not in threads.values(), (loop, threads)
    else:
        assert set(threads.values()) == {loop}, (loop, threads)


def test_a_debiased_decision_is_priced_by_its_rotations_and_named(tokenizer):
    """Admission prices `rotate` as K prompts (plus `prior`'s content-free reads): a decision that
    only debiasing makes too costly is a 400 naming debias."""
    options = {f"option {i}": None for i in range(16)}
    body = {**TICKET, "questions": {"pick": {"type": "choice", "criteria": options}}, "samples": 1}
    with TestClient(create_app(Settings.of(max_inflight_cost=20), ScriptedReader(tokenizer))) as client:
        assert client.post("/v1/systemone", json={**body, "debias": "rotate"}).status_code == 200  # K = 8
        response = client.post("/v1/systemone", json={**body, "debias": "rotate+prior"})  # 8 x (1 + 4)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == "debias" and "costs 40" in error["message"]
        answered = client.post("/v1/systemone", json={**body, "debias": "rotate"}).json()
        assert answered["diagnostics"]["debias"]["rotations"] == [8]
        assert list(answered["answers"]["pick"]["probabilities"]) == list(options)
