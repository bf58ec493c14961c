"""The served bench's knobs (bench/served_load.py `bench_routes`): what each sets on the server, and
the values each refuses, on a bare app that holds only what the route reaches."""

from __future__ import annotations

from types import SimpleNamespace

from starlette.applications import Starlette
from starlette.testclient import TestClient

from app.web.pacing import Pacer, PacingRules
from bench.served_load import bench_routes


def knob_app(**services: object) -> TestClient:
    app = Starlette(routes=bench_routes())
    app.state.services = SimpleNamespace(**services)
    return TestClient(app)


def test_the_headroom_knob_sets_the_pacers_admission_share_and_keeps_its_estimate():
    pacer = Pacer(PacingRules(min_session_fps=1.5, max_session_fps=4, capacity_start=8, headroom=0.8, window_s=2))
    pacer.capacity = 39.0  # the 64-camera row's answers/s in the served bench on the H200
    client = knob_app(pacer=pacer)
    for _ in range(20):
        assert pacer.admit(f"camera {len(pacer.sessions)}").admitted
    assert not pacer.admit("one more").admitted  # 21 x 1.5 > 39 x 0.8
    response = client.post("/bench/session-headroom", json={"headroom": 0.95})
    assert response.status_code == 200 and response.json() == {"before": 0.8, "headroom": 0.95}
    assert pacer.rules.headroom == 0.95 and pacer.capacity == 39.0 and pacer.rules.min_session_fps == 1.5
    admitted = sum(pacer.admit(f"camera {n}").admitted for n in range(20, 30))
    assert len(pacer.sessions) == 24 and admitted == 4  # 24 x 1.5 <= 39 x 0.95 < 25 x 1.5


def test_the_headroom_knob_refuses_shares_outside_0_to_1():
    pacer = Pacer(PacingRules(min_session_fps=1.5, max_session_fps=4, capacity_start=8, headroom=0.8, window_s=2))
    client = knob_app(pacer=pacer)
    for share in (0, -0.5, 1.01):
        response = client.post("/bench/session-headroom", json={"headroom": share})
        assert response.status_code == 400 and "headroom" in response.json()["error"]
    assert pacer.rules.headroom == 0.8


def test_the_gather_knob_refuses_a_negative_cap_and_a_reader_without_one():
    client = knob_app(reader=SimpleNamespace(options=SimpleNamespace(gather_rows=32)))
    response = client.post("/bench/gather-rows", json={"rows": -1})
    assert response.status_code == 400 and "rows" in response.json()["error"]
    assert knob_app(reader=SimpleNamespace()).post("/bench/gather-rows", json={"rows": 8}).status_code == 400


def test_the_vision_attention_knob_puts_one_kernel_first_and_keeps_the_rest(monkeypatch):
    from torch.nn.attention import SDPBackend

    from app.engine.hf import layers
    from bench.models import choose_vision_attention

    served = layers.VISION_ATTENTION
    assert served[0] == SDPBackend.CUDNN_ATTENTION and served[-1] == SDPBackend.MATH
    monkeypatch.setattr(layers, "VISION_ATTENTION", served)
    choose_vision_attention("efficient")
    assert layers.VISION_ATTENTION[0] == SDPBackend.EFFICIENT_ATTENTION
    assert set(layers.VISION_ATTENTION) == set(served) and len(layers.VISION_ATTENTION) == len(served)
