"""djev replicas behind HAProxy (docs/deploy.md, "Replicas behind HAProxy"), for real: three
`djev serve` replicas on the tiny model (and a fourth whose load waits for the test), HAProxy on the
configuration `djev haproxy-config` writes, all on 127.0.0.1, driven by the tests' own clients.

- REST spreads over the replicas (leastconn), each answer naming its replica.
- Twelve cameras spread four a replica (MAX_SESSIONS 4); a thirteenth is refused by a full replica
  with its own 1013, and its reconnect lands on the replica where a camera closed.
- A replica that is starting gets nothing until it is ready, then gets its share.
- A replica killed mid-run: its cameras reconnect to the others, REST clients see no error beyond
  the requests in flight on it, nothing hangs.
- HTTPS ends at HAProxy: djev's one local authority verifies every replica's answers (and wss).

Skipped only where `haproxy` is missing (scripts/setup.sh --test installs Debian's)."""

from __future__ import annotations

import io
import json
import ssl
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest
from PIL import Image
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import ClientConnection, connect

from app import tls
from app.web.errors import CLOSE_TRY_LATER
from app.web.frontdoor import REPLICA_HEADER
from tests.deploy.replicas import (
    HAPROXY_MISSING,
    Haproxy,
    Replica,
    haproxy_executable,
    landed,
    start_haproxy,
    start_replica,
    tail,
    wait_for,
)

pytestmark = pytest.mark.skipif(haproxy_executable() is None, reason=HAPROXY_MISSING)

MAX_SESSIONS = 4
TICKET = {
    "model": "jev-latest",
    "state": {"ticket": "Everything is down and we have a demo at noon."},
    "questions": {"urgent": {"type": "noul", "instructions": "Does the customer need a reply within the hour?"}},
}
CAMERA = {
    "model": "jev-latest",
    "state": {"note": "one frame from a phone's back camera"},
    "questions": {"clear": {"type": "noul", "instructions": "Is the way ahead clear?"}},
}


def jpeg() -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (96, 72), (90, 90, 90)).save(out, "JPEG")
    return out.getvalue()


FRAME = jpeg()


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("replicas")


@pytest.fixture(scope="module")
def certs(work: Path) -> Path:
    """The replicas' CERT_DIR: djev's local authority, which serves /djev-ca.crt through the balancer."""
    return work / "certs"


@pytest.fixture(scope="module")
def fleet(tiny_dir: Path, work: Path, certs: Path):
    """r1, r2, r3 ready, and `late`, whose load waits for its gate: all started together (the four
    loads share the machine's cores), stopped at the end of the module whatever happened."""
    flags = dict(max_sessions=MAX_SESSIONS, session_capacity_start=1000, cert_dir=certs)
    started: list[Replica] = []
    try:
        for replica_id in ("r1", "r2", "r3"):
            started.append(start_replica(replica_id, tiny_dir, work, **flags))
        started.append(start_replica("late", tiny_dir, work, gated=True, **flags))
        for replica in started[:3]:
            wait_for(f"{replica.id} to be ready", replica.ready, 90, every=0.2, log=lambda r=replica: tail(r.log))
        late = started[3]
        wait_for("late to listen", late.health, 60, every=0.2, log=lambda: tail(late.log))
        yield {replica.id: replica for replica in started}
    finally:
        for replica in started:
            replica.stop()


@pytest.fixture
def balancer(work):
    """Start HAProxy over replicas (`balancer(replicas, up=True, **options)`), by default waiting until
    it counts every one up; each is stopped after the test."""
    running: list[Haproxy] = []

    def start(replicas: list[Replica], up: bool = True, **options) -> Haproxy:
        proxy = start_haproxy(replicas, work, max_sessions=MAX_SESSIONS, **options)
        running.append(proxy)
        for replica in replicas if up else ():
            proxy.wait_state(replica.id, "UP")
        return proxy

    yield start
    for proxy in running:
        proxy.stop()


def no_cameras(replicas: list[Replica]) -> None:
    """Wait until the replicas hold no camera session (an earlier test's closes have landed)."""
    for replica in replicas:
        wait_for(f"{replica.id} to hold no camera", lambda r=replica: r.sessions() == 0, 10)


def receive(ws: ClientConnection, kind: str, timeout: float) -> dict:
    """The next message of type `kind` (others skipped), within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        message = json.loads(ws.recv(timeout=max(0.1, deadline - time.monotonic())))
        if message["type"] == kind:
            return message


def decide(client: httpx.Client) -> httpx.Response:
    response = client.post("/v1/systemone", json=TICKET)
    assert response.status_code == 200, response.text
    assert response.headers["x-typesafe-request-id"].startswith("req_")
    return response


def open_camera(url: str, **options) -> tuple[ClientConnection, str, dict]:
    """A camera session through the balancer: (socket, the replica its handshake named, `ready`)."""
    ws = connect(url.replace("http", "ws", 1) + "/v1/stream", open_timeout=10, **options)
    replica = ws.response.headers[REPLICA_HEADER]
    try:
        ready = receive(ws, "ready", timeout=10)
    except BaseException:
        ws.close()
        raise
    assert ready["replica"] == replica  # a browser cannot read the header: `ready` says it too
    return ws, replica, ready


def refused(url: str) -> tuple[str, int, str]:
    """A camera the balancer routes to a full replica: (the replica, close code, reason)."""
    ws = connect(url.replace("http", "ws", 1) + "/v1/stream", open_timeout=10)
    replica = ws.response.headers[REPLICA_HEADER]
    with pytest.raises(ConnectionClosed) as info:
        ws.recv(timeout=10)
    ws.close()
    assert info.value.rcvd is not None
    return replica, info.value.rcvd.code, info.value.rcvd.reason


def one_frame(ws: ClientConnection) -> dict:
    ws.send(json.dumps({"type": "config", "request": CAMERA}))
    receive(ws, "configured", timeout=10)
    ws.send(FRAME)
    return receive(ws, "result", timeout=20)


def test_rest_spreads_over_the_replicas_each_answer_naming_its_own(fleet, balancer):
    replicas = [fleet["r1"], fleet["r2"], fleet["r3"]]
    proxy = balancer(replicas)
    with httpx.Client(base_url=proxy.url, timeout=20) as client:
        spread = Counter(landed(decide(client)) for _ in range(30))
        health = client.get("/health")
    assert set(spread) == {"r1", "r2", "r3"}, spread
    assert min(spread.values()) >= 5, spread  # leastconn takes turns among replicas equally idle
    assert health.status_code == 200 and landed(health) in spread


def test_twelve_cameras_spread_four_a_replica_and_a_refused_thirteenth_lands_where_one_closed(fleet, balancer):
    replicas = [fleet["r1"], fleet["r2"], fleet["r3"]]
    proxy = balancer(replicas)
    no_cameras(replicas)
    cameras: list[tuple[ClientConnection, str]] = []
    try:
        for _ in range(3 * MAX_SESSIONS):
            ws, replica, _ = open_camera(proxy.url)
            cameras.append((ws, replica))
        assert Counter(replica for _, replica in cameras) == {"r1": 4, "r2": 4, "r3": 4}

        # Every replica is full: the thirteenth reaches one (maxconn is MAX_SESSIONS + 1), which
        # refuses it itself, with the 1013 and reason the walk page backs off from.
        full, code, reason = refused(proxy.url)
        assert code == CLOSE_TRY_LATER and "too many camera sessions" in reason, (code, reason)

        # A camera on another replica closes; the reconnect goes to the replica with the fewest.
        index = next(i for i, (_, replica) in enumerate(cameras) if replica != full)
        closing, freed = cameras.pop(index)
        closing.close()
        wait_for(f"HAProxy to count {freed}'s camera gone", lambda: proxy.cameras(freed) == MAX_SESSIONS - 1, 10)
        ws, replica, _ = open_camera(proxy.url)
        cameras.append((ws, replica))
        assert replica == freed != full
        assert one_frame(ws)["frame"] == 1  # and it is a working session through the balancer
    finally:
        for ws, _ in cameras:
            ws.close()


def test_a_starting_replica_gets_nothing_until_it_is_ready(fleet, balancer):
    late = fleet["late"]
    assert late.gate is not None and not late.gate.exists(), "runs before the kill test opens the gate"
    assert late.health()["status"] == "starting"
    replicas = [fleet["r1"], fleet["r2"], late]
    proxy = balancer(replicas, up=False)
    with httpx.Client(base_url=proxy.url, timeout=20) as client:
        # From HAProxy's first instant: HAProxy counts a server up until its first check (the third
        # server's comes 2/3 of CHECK_INTERVAL_MS in), and a request that meets the starting
        # replica's 503 meanwhile is sent again to a ready one.
        first = Counter(landed(decide(client)) for _ in range(10))
        assert set(first) == {"r1", "r2"}, first
        assert late.requests_to("/v1/systemone") >= 1  # it was asked, answered 503, and nobody saw it
        proxy.wait_state("late", "DOWN")
        assert proxy.stats()[("api", "late")]["check_status"] == "L7STS"  # its /health said 503
        before = late.requests_to("/v1/systemone")
        then = Counter(landed(decide(client)) for _ in range(20))
        no_cameras(replicas)
        cameras = [open_camera(proxy.url) for _ in range(4)]
        for ws, _, _ in cameras:
            ws.close()
        assert set(then) == {"r1", "r2"} and {replica for _, replica, _ in cameras} == {"r1", "r2"}
        assert late.requests_to("/v1/systemone") == before  # not one request reached it
        assert late.health()["status"] == "starting"

        late.open_gate()
        wait_for("late to be ready", late.ready, 60, every=0.2, log=lambda: tail(late.log))
        proxy.wait_state("late", "UP")
        after = Counter(landed(decide(client)) for _ in range(30))
    assert set(after) == {"r1", "r2", "late"}, after


def test_through_https_at_the_balancer_one_authority_verifies_every_replica(fleet, certs, balancer):
    bundle = tls.ensure_bundle(certs)  # `djev cert`: the balancer's certificate, chain and key
    replicas = [fleet["r1"], fleet["r2"], fleet["r3"]]
    proxy = balancer(replicas, crt=bundle)
    authority = certs / tls.CA_CERT_NAME
    context = ssl.create_default_context(cafile=str(authority))  # the authority alone, as a phone has it
    with httpx.Client(base_url=proxy.https_url, timeout=20, verify=context) as client:
        spread = Counter(landed(decide(client)) for _ in range(15))
        served = client.get("/djev-ca.crt")  # the phone's one trust step, through the balancer
    assert set(spread) == {"r1", "r2", "r3"}, spread
    assert served.status_code == 200 and served.content == authority.read_bytes()
    with pytest.raises(httpx.ConnectError):
        httpx.get(proxy.https_url + "/health")  # the default trust store does not know djev's authority
    no_cameras(replicas)
    ws, replica, _ = open_camera(proxy.https_url, ssl=context)
    with ws:
        assert replica in {"r1", "r2", "r3"} and one_frame(ws)["frame"] == 1


def test_a_replica_killed_mid_run_moves_its_cameras_and_costs_rest_clients_nothing_more(fleet, balancer):
    late = fleet["late"]
    if late.gate is not None:
        late.open_gate()  # when this test runs alone
    wait_for("late to be ready", late.ready, 60, every=0.2, log=lambda: tail(late.log))
    replicas = [fleet["r1"], fleet["r2"], late]
    proxy = balancer(replicas)
    no_cameras(replicas)

    stopping = threading.Event()
    outcomes: list[tuple[float, str]] = []  # (when, the replica that answered or the error)

    def rest_client() -> None:
        with httpx.Client(base_url=proxy.url, timeout=15) as client:
            while not stopping.is_set():
                try:
                    response = client.post("/v1/systemone", json=TICKET)
                    outcomes.append((time.monotonic(), landed(response) if response.status_code == 200
                                     else f"error {response.status_code}"))
                except httpx.HTTPError as exc:
                    outcomes.append((time.monotonic(), f"error {type(exc).__name__}"))

    cameras = [open_camera(proxy.url) for _ in range(6)]
    moved: list[tuple[ClientConnection, str]] = []
    killed_at = float("inf")
    clients = [threading.Thread(target=rest_client, name=f"rest-{i}", daemon=True) for i in range(3)]
    try:
        assert Counter(replica for _, replica, _ in cameras) == {"r1": 2, "r2": 2, "late": 2}
        for thread in clients:
            thread.start()
        wait_for("REST answers from every replica", lambda: {r for _, r in outcomes} >= {"r1", "r2", "late"}, 20)

        killed_at = time.monotonic()
        late.kill()
        for ws, replica, _ in cameras:
            if replica != "late":
                ws.send(json.dumps({"type": "ping", "t": 1}))
                assert receive(ws, "pong", timeout=10)["t"] == 1  # the other replicas' cameras go on
                continue
            with pytest.raises(ConnectionClosed):
                receive(ws, "result", timeout=10)  # its socket ends (no frame is pending: it closes)
            again, landed_on, _ = open_camera(proxy.url)  # the page reconnects; no back-off here
            moved.append((again, landed_on))
        assert sorted(replica for _, replica in moved) == ["r1", "r2"]  # leastconn: one each
        for ws, _ in moved:
            assert one_frame(ws)["frame"] == 1
        proxy.wait_state("late", "DOWN", timeout=10)
        wait_for("REST answers after the kill", lambda: sum(t > killed_at + 1 for t, _ in outcomes) >= 10, 30)
    finally:
        stopping.set()
        for thread in clients:
            thread.join(timeout=20)
        for ws, _, _ in cameras:
            ws.close()
        for ws, _ in moved:
            ws.close()
    assert not any(thread.is_alive() for thread in clients), "a REST client hung"
    errors = [(t - killed_at, what) for t, what in outcomes if what.startswith("error")]
    # At most the requests in flight on the killed replica (one per client) fail, right at the kill.
    assert len(errors) <= len(clients) and all(0 <= t < 2 for t, _ in errors), errors
    assert {what for t, what in outcomes if t > killed_at + 1} == {"r1", "r2"}
