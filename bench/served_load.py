"""The served bench's load (bench/bench_gpu_served.py): request generators, the client processes that
drive `djev serve` over HTTP and websockets, and the in-process twin that runs the same generators
against the server's own Decider through a bench-only route.

Every state and every frame is unique: states carry a per-request id, frames a per-frame stamp drawn
into the pixels (so neither the prompt KV cache nor the image caches can serve one). Frames are JPEGs
encoded before the clock starts, per process.

A client process gets a row's spec, prepares (encodes its frames), says so, waits for the common
start time (time.monotonic is system-wide on Linux), runs its share of the clients and sends back a
tally: latencies, errors by status and counts, never anything that needs the server to interpret.
Every client call has a timeout, so a dead server ends a row with errors, never a hang.

Only the standard library is imported at module level (and bench/workload.py, which holds the
requests and the frames); httpx, websockets, Pillow and the app are imported where used.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from bench.workload import WALK_REQUEST, WORDS, FrameMaker, noul_questions, ticket_request, words

CLIENT_TIMEOUT_S = 60.0  # every HTTP call and websocket receive
GRACE_S = 5.0  # after a row's end: how long in-flight requests may still finish before they are cancelled
FPS_BUDGET = 30  # frames encoded ahead per closed-loop camera client and second (more are encoded late, counted)
CAMERA_FPS = 2.0
# A camera refused at open asks again as the walk page does (app/static/js/walk.js busyWait), while a
# session of at least MIN_SESSION_S is still left in the row.
BUSY_FIRST_S, BUSY_MAX_S, MIN_SESSION_S = 2.0, 30.0, 2.0
FRESH_S = 1.5  # the walk page shows no answer older than this (app/static/js/walk.js STALE_MS)
now = time.monotonic


# ---------------------------------------------------------------------------------------- requests

def sheet_request(rng: random.Random, uid: str) -> dict[str, Any]:
    """A question sheet of its own: 1-6 questions, random instructions, 2-8 options (or levels) each."""
    questions: dict[str, Any] = {}
    for number in range(rng.randint(1, 6)):
        instructions = f"{words(rng, rng.randint(6, 16))} ({uid}.{number})?"
        kind = rng.choice(("noul", "choice", "choice", "score"))
        if kind == "noul":
            questions[f"q{number}"] = {"type": "noul", "instructions": instructions}
            continue
        count = rng.randint(2, 8)
        names = [f"{rng.choice(WORDS)} {option}" for option in range(count)]
        if kind == "choice":
            criteria: Any = {name: (words(rng, 4) if rng.random() < 0.5 else None) for name in names}
        else:
            criteria = names
        questions[f"q{number}"] = {"type": kind, "instructions": instructions, "criteria": criteria}
    return {"state": {"ticket": f"{words(rng, rng.randint(10, 40))} #{uid}"}, "questions": questions, "samples": 1}


HEAVY_KINDS = ("long state", "255 options x 8 questions", "200 questions", "think", "steps 8 x samples 32")


def heavy_request(kind: str, rng: random.Random, uid: str, state_tokens: int, think: int) -> dict[str, Any]:
    """One heavy request of the steady-client row (HEAVY_KINDS), built anew per request."""
    ticket = ticket_request(rng, uid)
    if kind == "long state":  # about 3.8 tokens a word with the bench's tokenizer (the tiny model's)
        return {**ticket, "state": {"ticket": f"{words(rng, max(1, int(state_tokens / 3.8)))} #{uid}"}}
    if kind == "255 options x 8 questions":
        return {**ticket, "questions": {
            f"q{n}": {"type": "choice", "instructions": f"Which item does the ticket name? ({uid}.{n})",
                      "criteria": {f"item {n}-{k}": None for k in range(255)}} for n in range(8)}}
    if kind == "200 questions":
        return {**ticket, "questions": noul_questions(200, uid)}
    if kind == "think":
        return {**ticket, "think": think}
    return {**ticket, "steps": 8, "samples": 32}


REQUESTS: dict[str, Callable[[random.Random, str], dict[str, Any]]] = {
    "sheets": sheet_request, "ticket": ticket_request, "walk": lambda rng, uid: WALK_REQUEST,
}


class Frames:
    """A client's frames, encoded before the clock; past the budget more are encoded as needed
    (counted in `late`, so a row that ran short of pre-encoded frames says so)."""

    def __init__(self, maker: FrameMaker, count: int) -> None:
        self.maker = maker
        self.ready = maker.make(count)
        self.late = 0

    def next(self) -> bytes:
        if not self.ready:
            self.ready = self.maker.make(8)
            self.late += 8
        return self.ready.pop()


# ---------------------------------------------------------------------------------------- tallies

@dataclass
class Tally:
    """What a row's clients saw: latencies (s), answer ages (s), each camera answer's age plus the
    next_frame_ms sent with it (s: how old the answer on the walk page gets before the next can
    replace it, which its 1.5 s guard bounds), errors by status or exception, counts."""

    latencies: list[float] = field(default_factory=list)
    ages: list[float] = field(default_factory=list)
    guards: list[float] = field(default_factory=list)
    errors: dict[str, int] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)
    elapsed: float = 0.0

    def error(self, key: str) -> None:
        self.errors[key] = self.errors.get(key, 0) + 1

    def count(self, key: str, by: int = 1) -> None:
        self.counts[key] = self.counts.get(key, 0) + by

    def as_dict(self) -> dict[str, Any]:
        return {"latencies": self.latencies, "ages": self.ages, "guards": self.guards, "errors": self.errors,
                "counts": self.counts, "elapsed": self.elapsed}


def shares(total: int, parts: int) -> list[int]:
    """`total` clients split over `parts` processes, as evenly as they go (the first take the rest)."""
    return [total // parts + (1 if index < total % parts else 0) for index in range(parts)]


def merge(tallies: list[dict[str, Any]]) -> dict[str, Any]:
    """Tallies of several processes as one (lists joined, counts summed, the longest elapsed)."""
    out = Tally()
    for tally in tallies:
        out.latencies += tally["latencies"]
        out.ages += tally["ages"]
        out.guards += tally.get("guards", [])
        for key, value in tally["errors"].items():
            out.errors[key] = out.errors.get(key, 0) + value
        for key, value in tally["counts"].items():
            out.count(key, value)
        out.elapsed = max(out.elapsed, tally["elapsed"])
    return out.as_dict()


def error_key(exc: BaseException) -> str:
    import httpx

    if isinstance(exc, (httpx.TimeoutException, asyncio.TimeoutError)):
        return "timeout"
    return type(exc).__name__


async def until(moment: float) -> None:
    await asyncio.sleep(max(0.0, moment - now()))


async def finish(tasks: dict[asyncio.Task, Tally], end: float, grace: float = GRACE_S) -> None:
    """Wait for the clients until `end` + `grace`; any still running then is cancelled, counted in its
    own tally, as is a client that failed."""
    if not tasks:
        return
    _, pending = await asyncio.wait(list(tasks), timeout=max(0.0, end + grace - now()))
    for task in pending:
        task.cancel()
        tasks[task].count("cancelled at the end")
    if pending:
        await asyncio.wait(pending, timeout=5)
    for task, tally in tasks.items():
        if task.done() and not task.cancelled() and task.exception() is not None:
            tally.error(f"client failed: {error_key(task.exception())}")  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------- HTTP clients

def auth_headers(api_key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {api_key}"} if api_key else {}


async def post_decision(client: Any, body: dict[str, Any], frame: bytes | None, timeout: float) -> Any:
    if frame is None:
        return await client.post("/v1/systemone", json=body, timeout=timeout)
    return await client.post("/v1/systemone", data={"request": json.dumps(body)},
                             files={"frame": ("frame.jpg", frame, "image/jpeg")}, timeout=timeout)


async def backoff(response: Any, end: float) -> None:
    """After a 529/503: wait what the server asks (retry-after-ms), at most until the row's end."""
    try:
        wait = float(response.headers.get("retry-after-ms", "1000")) / 1000
    except ValueError:
        wait = 1.0
    await asyncio.sleep(max(0.0, min(wait, end - now())))


async def rest_client(client: Any, make: Callable[[], tuple[dict[str, Any], bytes | None]], end: float,
                      tally: Tally) -> None:
    """Closed loop: the next request when the answer comes, until `end`."""
    while now() < end:
        body, frame = make()
        response = await timed_post(client, body, frame, tally)
        if response is not None and response.status_code in (503, 529):
            await backoff(response, end)


async def timed_post(client: Any, body: dict[str, Any], frame: bytes | None, tally: Tally) -> Any:
    """One decision posted and tallied (its latency when it is a 200, else its status or error);
    the response, or None when the request failed (after a short pause: a dead server must not spin)."""
    started = now()
    try:
        response = await post_decision(client, body, frame, CLIENT_TIMEOUT_S)
    except Exception as exc:  # noqa: BLE001 - every failure is tallied
        tally.error(error_key(exc))
        await asyncio.sleep(0.05)
        return None
    if response.status_code == 200:
        tally.latencies.append(now() - started)
    else:
        tally.error(str(response.status_code))
    return response


def load_level(url: str, clients: int, seconds: float, tag: str, body: Callable[[str], dict[str, Any]],
               timeout: float = CLIENT_TIMEOUT_S) -> dict[str, Any]:
    """One level of a concurrency curve, in the load-generator process: `clients` closed loops for
    `seconds`, each request `body(unique tag)` posted as JSON; {latencies (s), errors by kind,
    elapsed_s}.

    A client sends its next request as soon as the last one returns, whatever the status (no
    backoff: what a loaded server answers is what is measured); requests still in flight at the
    deadline finish and count."""
    return asyncio.run(_load_level(url, clients, seconds, tag, body, timeout))


async def _load_level(url: str, clients: int, seconds: float, tag: str, body: Callable[[str], dict[str, Any]],
                      timeout: float) -> dict[str, Any]:
    latencies: list[float] = []
    errors: dict[str, int] = {}
    started = time.perf_counter()
    deadline = started + seconds

    async def closed_loop(client_no: int) -> None:
        connection = PostConnection(url)
        sent = 0
        try:
            while time.perf_counter() < deadline:
                request = json.dumps(body(f"{tag}-{client_no}-{sent}")).encode()
                sent += 1
                t0 = time.perf_counter()
                try:
                    status = await asyncio.wait_for(connection.post("/v1/systemone", request), timeout)
                    problem = None if status == 200 else f"HTTP {status}"
                except (OSError, asyncio.TimeoutError, ValueError) as exc:
                    problem = type(exc).__name__
                    connection.close()  # a broken or timed-out connection is not reused
                    connection = PostConnection(url)
                if problem is None:
                    latencies.append(time.perf_counter() - t0)
                else:
                    errors[problem] = errors.get(problem, 0) + 1
        finally:
            connection.close()

    await asyncio.gather(*(closed_loop(n) for n in range(clients)))
    return {"latencies": latencies, "errors": errors, "elapsed_s": time.perf_counter() - started}


class PostConnection:
    """One keep-alive HTTP/1.1 connection that POSTs JSON and reads the status and the whole body:
    the closed-loop clients' transport. A general client (httpx) costs the load generator about 2 ms
    of CPU a request at 32 connections and about 6 ms at 64 (its pool's bookkeeping grows with the
    connections), and on a 2-core machine that CPU is the server's: the load generator, not the
    server, set the tail. This costs a few tens of microseconds."""

    def __init__(self, url: str) -> None:
        from urllib.parse import urlsplit

        parts = urlsplit(url)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def post(self, path: str, payload: bytes) -> int:
        """POST `payload` (JSON) to `path`; the response's status, its body read and dropped."""
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        assert self.reader is not None
        self.writer.write(f"POST {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\nContent-Type: application/json\r\n"
                          f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
        head = (await self.reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
        status = int(head[0].split(" ", 2)[1])
        headers = {name.strip().lower(): value.strip() for name, _, value in
                   (line.partition(":") for line in head[1:] if line)}
        if "content-length" in headers:
            await self.reader.readexactly(int(headers["content-length"]))
        elif headers.get("transfer-encoding", "").lower() == "chunked":
            while size := int((await self.reader.readuntil(b"\r\n")).split(b";")[0], 16):
                await self.reader.readexactly(size + 2)
            await self.reader.readuntil(b"\r\n")
        else:
            raise ValueError("a response with neither Content-Length nor chunked encoding")
        if headers.get("connection", "").lower() == "close":
            self.close()
        return status

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None


# ---------------------------------------------------------------------------------------- camera clients

class Refused(Exception):
    """The server closed the session at open (1013: MAX_SESSIONS are open)."""


async def open_camera(url: str, api_key: str, request: dict[str, Any]) -> Any:
    """A /v1/stream session, configured with `request`; Refused on a 1013 close at open."""
    from websockets.asyncio.client import connect
    from websockets.exceptions import ConnectionClosed

    protocols: Any = ["djev", f"bearer.{api_key}"] if api_key else None
    ws = await connect(url, max_size=None, open_timeout=CLIENT_TIMEOUT_S, close_timeout=2,
                       subprotocols=protocols, ping_interval=None)
    try:
        ready = json.loads(await asyncio.wait_for(ws.recv(), CLIENT_TIMEOUT_S))
        if ready.get("type") != "ready":
            raise RuntimeError(f"first message {ready.get('type')!r}, not ready")
        await ws.send(json.dumps({"type": "config", "request": request}))
        while True:
            message = json.loads(await asyncio.wait_for(ws.recv(), CLIENT_TIMEOUT_S))
            if message.get("type") == "configured":
                return ws
            if message.get("type") == "error":
                raise RuntimeError(f"config refused: {message.get('status')}")
    except ConnectionClosed as exc:
        await ws.close()
        if exc.rcvd is not None and exc.rcvd.code == 1013:
            raise Refused() from None
        raise
    except BaseException:
        await ws.close()
        raise


def hint_s(message: dict[str, Any], tally: Tally) -> float:
    """The server's `next_frame_ms` (when present): how long to wait before the next frame."""
    hint = message.get("next_frame_ms")
    if isinstance(hint, (int, float)) and hint >= 0:
        tally.count("next_frame_ms seen")
        return float(hint) / 1000
    return 0.0


async def admitted_camera(url: str, api_key: str, tally: Tally) -> Any:
    """A walk-page session opened and counted as admitted, or None (counted) when the server refused
    it at open with 1013."""
    try:
        ws = await open_camera(url, api_key, WALK_REQUEST)
    except Refused:
        tally.count("refused (1013)")
        return None
    tally.count("admitted")
    return ws


async def closed_camera(url: str, api_key: str, frames: Frames, end: float, tally: Tally) -> None:
    """The walk page: the next frame when the answer comes (after `next_frame_ms` if the server asks)."""
    ws = await admitted_camera(url, api_key, tally)
    if ws is None:
        return
    try:
        sent = 0
        while now() < end:
            sent += 1
            started = now()
            await ws.send(frames.next())
            tally.count("frames sent")
            while True:
                message = json.loads(await asyncio.wait_for(ws.recv(), CLIENT_TIMEOUT_S))
                if message.get("type") in ("result", "error") and message.get("frame") == sent:
                    break
            if message["type"] == "result":
                tally.latencies.append(now() - started)
                tally.count("answers")
                # As the page: the next frame no sooner than next_frame_ms after this one was sent.
                await asyncio.sleep(min(max(0.0, started + hint_s(message, tally) - now()), max(0.0, end - now())))
            else:
                tally.error(str(message.get("status")))
    finally:
        tally.count("late frames", frames.late)
        await ws.close()


async def open_camera_client(url: str, api_key: str, frames: Frames, start: float, end: float, tally: Tally) -> None:
    """A camera at CAMERA_FPS whatever comes back (open loop; later if the server's `next_frame_ms`
    asks): each answer's age is its receipt time minus its frame's send time."""
    from websockets.exceptions import ConnectionClosed

    ws = await admitted_camera(url, api_key, tally)
    refusals = 0
    while ws is None:  # as the walk page: ask again after 2 s, 4 s, ... 30 s, each jittered to 50-150 %
        wait = min(BUSY_MAX_S, BUSY_FIRST_S * 2 ** refusals) * (0.5 + random.random())
        refusals += 1
        if now() + wait > end - MIN_SESSION_S:
            return
        await asyncio.sleep(wait)
        tally.count("retries")
        ws = await admitted_camera(url, api_key, tally)
    opened = now()
    start = max(start, opened)
    sent_at: dict[int, float] = {}
    settled: set[int] = set()  # answered, dropped or failed
    not_before = [0.0]

    async def receive() -> None:
        while True:
            message = json.loads(await ws.recv())
            kind = message.get("type")
            if kind == "result":
                frame = int(message["frame"])
                age = now() - sent_at[frame]
                tally.ages.append(age)
                tally.count("answers")
                settled.add(frame)
                settled.update(int(number) for number in message.get("dropped") or ())
                tally.count("dropped", len(message.get("dropped") or ()))
                hint = hint_s(message, tally)
                tally.guards.append(age + hint)
                if hint:  # as the page: the next frame no sooner than next_frame_ms after this one's send
                    not_before[0] = max(not_before[0], sent_at[frame] + hint)
            elif kind == "error":
                tally.error(str(message.get("status")))
                if isinstance(message.get("frame"), int):
                    settled.add(message["frame"])

    receiver = asyncio.create_task(receive())
    try:
        moment = start + random.random() / CAMERA_FPS  # cameras are not in step
        number = 0
        while True:
            moment = max(moment, not_before[0])
            if moment >= end or receiver.done():
                break
            await until(moment)
            number += 1
            sent_at[number] = now()
            await ws.send(frames.next())
            tally.count("frames sent")
            moment += 1 / CAMERA_FPS
        wait_until = now() + 2.0  # the last answers still on their way
        while not receiver.done() and len(settled) < number and now() < wait_until:
            await asyncio.sleep(0.02)
        if receiver.done() and receiver.exception() is not None and not isinstance(receiver.exception(), ConnectionClosed):
            tally.error(f"receiver: {error_key(receiver.exception())}")  # type: ignore[arg-type]
    finally:
        receiver.cancel()
        tally.count("late frames", frames.late)
        tally.count("session ms", round(1000 * (min(now(), end) - opened)))
        await ws.close()


# ---------------------------------------------------------------------------------------- the steady row

async def steady_client(client: Any, start: float, alone_until: float, end: float, tallies: dict[str, Tally],
                        uid: str, burst_on: Callable[[], bool] = lambda: False, last: float = 0.0) -> None:
    """One ticket client, closed loop: alone first, then beside the heavy clients until `end`, and on
    while `burst_on()` (a heavy request of the row is still waiting for its answer), until `last`."""
    rng = random.Random(uid)
    sequence = 0
    while now() < end or (burst_on() and now() < last):
        sequence += 1
        tally = tallies["steady alone" if now() < alone_until else "steady beside the heavy clients"]
        await timed_post(client, ticket_request(rng, f"{uid}-{sequence}"), None, tally)


async def heavy_client(client: Any, kind: str, params: dict[str, Any], alone_until: float, end: float,
                       timeout: float, tally: Tally, uid: str, done: Callable[[], None] = lambda: None) -> None:
    """One heavy request after another, from `alone_until` to `end`, each waited for up to `timeout`
    (past `end` too: the row waits for its answer); a 4xx stops this client (recorded, not fatal),
    except a prompt over the limit, which shrinks the state and tries again. `done()` when it stops."""
    rng = random.Random(uid)
    tokens = int(params["state_tokens"])
    try:
        await until(alone_until)
        sequence = 0
        while now() < end:
            sequence += 1
            body = heavy_request(kind, rng, f"{uid}-{sequence}", tokens, int(params["think"]))
            started = now()
            tally.count("sent")
            try:
                response = await post_decision(client, body, None, timeout)
            except Exception as exc:  # noqa: BLE001
                tally.error(error_key(exc))
                continue
            if response.status_code == 200:
                tally.latencies.append(now() - started)
                continue
            tally.error(str(response.status_code))
            if response.status_code in (503, 529):
                await backoff(response, end)
            elif "max_tokens_exceeded" in response.text and tokens > 1000:
                tokens = int(tokens * 0.8)
                tally.count(f"state shrunk to ~{tokens} tokens")
            elif 400 <= response.status_code < 500:
                return
    finally:
        done()


# ---------------------------------------------------------------------------------------- a client process

async def run_row(spec: dict[str, Any], prepared: dict[str, Any], start: float,
                  heavy_left: Any = None) -> dict[str, Any]:
    """This process's share of one row, from `start`; returns its tallies by name. `heavy_left` (a
    shared multiprocessing Value, or None): the steady row's heavy clients still running, in every
    client process (the parent sets it before the row; each heavy client takes one off when it stops)."""
    import httpx

    kind = spec["kind"]
    seconds = float(spec["seconds"])
    end = start + seconds
    base, key = spec["base_url"], spec.get("api_key", "")
    tallies: dict[str, Tally] = {"main": Tally()}
    clients = int(spec.get("clients", 0))
    limits = httpx.Limits(max_connections=clients + 16, max_keepalive_connections=clients + 16)
    async with httpx.AsyncClient(base_url=base, headers=auth_headers(key), limits=limits,
                                 timeout=CLIENT_TIMEOUT_S) as client:
        await until(start)
        tasks: dict[asyncio.Task, Tally] = {}
        ws_url = base.replace("http://", "ws://") + "/v1/stream"
        if kind == "rest":
            make_body = REQUESTS[spec["request"]]
            for number in range(clients):
                rng = random.Random(f"{spec['tag']}-{number}")
                frames: Frames | None = prepared["frames"][number] if prepared["frames"] else None
                counter = iter(range(10**9))

                def make(rng: random.Random = rng, frames: Frames | None = frames, number: int = number,
                         counter: Any = counter) -> tuple[dict[str, Any], bytes | None]:
                    body = make_body(rng, f"{spec['tag']}-{number}-{next(counter)}")
                    return body, (frames.next() if frames is not None else None)

                tasks[asyncio.create_task(rest_client(client, make, end, tallies["main"]))] = tallies["main"]
        elif kind == "camera_closed":
            tasks = {asyncio.create_task(closed_camera(ws_url, key, frames, end, tallies["main"])): tallies["main"]
                     for frames in prepared["frames"]}
        elif kind == "camera_open":
            tasks = {asyncio.create_task(open_camera_client(ws_url, key, frames, start, end, tallies["main"])):
                     tallies["main"] for frames in prepared["frames"]}
        elif kind == "steady":
            alone_until = start + float(spec["alone_s"])
            wait = float(spec["heavy_timeout_s"])  # a heavy request sent at `end` is answered or timed out by end + wait

            def burst_on() -> bool:
                return heavy_left is not None and heavy_left.value > 0

            def done() -> None:
                if heavy_left is not None:
                    with heavy_left.get_lock():
                        heavy_left.value -= 1

            tallies = {}
            if spec.get("steady"):
                tallies = {"steady alone": Tally(), "steady beside the heavy clients": Tally()}
                steady = steady_client(client, start, alone_until, end, tallies, f"{spec['tag']}-steady", burst_on,
                                       end + wait + 1.0)
                tasks[asyncio.create_task(steady)] = tallies["steady beside the heavy clients"]
            for number, heavy in enumerate(spec.get("heavy", ())):
                tally = tallies.setdefault(f"heavy: {heavy}", Tally())  # a kind's copies in one process: one tally
                task = heavy_client(client, heavy, spec["params"], alone_until, end, wait, tally,
                                    f"{spec['tag']}-h{number}", done)
                tasks[asyncio.create_task(task)] = tally
        await finish(tasks, end, grace=float(spec["heavy_timeout_s"]) + 3.0 if kind == "steady" else GRACE_S)
        for tally in tallies.values():
            tally.elapsed = now() - start
    return {name: tally.as_dict() for name, tally in tallies.items()}


def prepare(spec: dict[str, Any], maker: FrameMaker) -> dict[str, Any]:
    """Frames for this process's clients, encoded before the clock."""
    seconds = float(spec["seconds"])
    clients = int(spec.get("clients", 0))
    frames: list[Frames] = []
    if spec["kind"] == "rest" and spec["request"] == "walk" or spec["kind"] == "camera_closed":
        frames = [Frames(maker, math.ceil(seconds * FPS_BUDGET)) for _ in range(clients)]
    elif spec["kind"] == "camera_open":
        frames = [Frames(maker, math.ceil(seconds * CAMERA_FPS) + 2) for _ in range(clients)]
    return {"frames": frames}


def worker_main(conn: Any, index: int, tag: str, heavy_left: Any = None) -> None:
    """A client process: rows until the parent sends None or goes away (EOF). `tag` marks its frames
    (unique across the run's processes); `heavy_left`: run_row's shared count of heavy clients."""
    import httpx  # noqa: F401 - imported (and the frame maker made) before the first row's clock
    import websockets.asyncio.client  # noqa: F401

    maker = FrameMaker(tag)
    while True:
        try:
            spec = conn.recv()
            if spec is None:
                return
            prepared = prepare(spec, maker)
            conn.send(("prepared", index))
            go = conn.recv()
            if go is None:
                return
            result = asyncio.run(run_row(spec, prepared, float(go), heavy_left))
            conn.send(("done", result))
        except (EOFError, OSError, KeyboardInterrupt):
            return
        except Exception:  # noqa: BLE001 - reported to the parent, which records the row as failed
            try:
                conn.send(("failed", traceback.format_exc()[-2000:]))
            except OSError:
                return


# ---------------------------------------------------------------------------------------- in-process twin

async def run_inprocess(services: Any, spec: dict[str, Any]) -> dict[str, Any]:
    """The same generator against the server's Decider, in the server process (no HTTP, no admission,
    no session): `clients` asyncio clients for `seconds` (frames: `frames_per_client` encoded ahead,
    more encoded late and counted). Workloads: sheets, ticket, walk (closed
    loops), cameras_open (each camera a frame every 500 ms, one decision in flight, the latest frame
    waiting replaced, as a session does)."""
    from app.decisions.request import parse_decision
    from app.engine.base import ImageInput

    workload, clients, seconds = spec["workload"], int(spec["clients"]), float(spec["seconds"])
    tag = f"inprocess-{spec.get('tag', 0)}"
    frame_count = int(spec.get("frames_per_client") or math.ceil(seconds * FPS_BUDGET)) + 2
    if workload == "cameras_open":
        frame_count = math.ceil(seconds * CAMERA_FPS) + 2
    frames: list[Frames] = []
    if workload in ("walk", "cameras_open"):  # encoded before the clock, off the event loop
        maker = await asyncio.to_thread(FrameMaker, tag)
        frames = await asyncio.to_thread(lambda: [Frames(maker, frame_count) for _ in range(clients)])
    tally = Tally()

    async def decide(body: dict[str, Any], frame: bytes | None) -> None:
        images = (ImageInput(frame, "image/jpeg", "frame"),) if frame is not None else ()
        await services.decider.decide(parse_decision(body, services.limits, images=images))

    start = now() + 0.05
    end = start + seconds

    async def closed(number: int) -> None:
        rng = random.Random(f"{tag}-{number}")
        sequence = 0
        while now() < end:
            sequence += 1
            body = REQUESTS[workload](rng, f"{tag}-{number}-{sequence}")
            started = now()
            try:
                await decide(body, frames[number].next() if frames else None)
            except Exception as exc:  # noqa: BLE001
                tally.error(type(exc).__name__)
                continue
            tally.latencies.append(now() - started)

    async def camera(number: int) -> None:
        pending: list[tuple[bytes, float]] = []
        wake = asyncio.Event()

        async def decider_side() -> None:
            while True:
                await wake.wait()
                wake.clear()
                while pending:
                    frame, sent = pending.pop()
                    try:
                        await decide(WALK_REQUEST, frame)
                    except Exception as exc:  # noqa: BLE001
                        tally.error(type(exc).__name__)
                        continue
                    tally.ages.append(now() - sent)
                    tally.count("answers")

        side = asyncio.create_task(decider_side())
        try:
            moment = start + random.random() / CAMERA_FPS
            while moment < end:
                await until(moment)
                if pending:
                    pending.clear()
                    tally.count("dropped")
                pending.append((frames[number].next(), now()))
                tally.count("frames sent")
                wake.set()
                moment += 1 / CAMERA_FPS
            wait_until = now() + 2.0
            while pending and now() < wait_until:
                await asyncio.sleep(0.02)
        finally:
            side.cancel()

    runner: Callable[[int], Awaitable[None]] = camera if workload == "cameras_open" else closed
    tasks = {asyncio.create_task(runner(number)): tally for number in range(clients)}
    await finish(tasks, end + (2.5 if workload == "cameras_open" else 0.0))
    tally.elapsed = now() - start
    tally.count("late frames", sum(f.late for f in frames))
    return tally.as_dict()


# The hf runner's stages the stage timer times (each call's wall time between two device syncs), by
# the path of each timed method from the runner: an engine turn's step; in it, the vision tower over
# the turn's new images, the one forward, its attention by segment; then the slot reads.
STAGES = ("flat.step", "images.image_features", "flat.turn.forward", "flat.attention.attend", "slot_reads_at")


class StageTimer:
    """Times the hf runner's stages while it is installed: each wrapped method synchronises the device
    before and after, so a stage's milliseconds are its device time (and the wrapped run is slower by
    the syncs: the stage shares are what it is for, not the rate). The stages nest: `flat.step` (an
    engine turn) holds the others."""

    def __init__(self, runner: Any) -> None:
        from bench.common import device_sync

        self.runner = runner
        self.sync = device_sync(runner.device)
        self.names = STAGES
        self.ms: dict[str, float] = {name: 0.0 for name in self.names}
        self.calls: dict[str, int] = {name: 0 for name in self.names}
        self.rows: dict[str, int] = {name: 0 for name in self.names}

    def _owner(self, name: str) -> tuple[Any, str]:
        """The object that holds a stage's method, and the method's name on it."""
        *path, attribute = name.split(".")
        owner = self.runner
        for part in path:
            owner = getattr(owner, part)
        return owner, attribute

    def __enter__(self) -> "StageTimer":
        self.saved: list[tuple[Any, str, Any]] = []  # (owner, attribute, what its own __dict__ held, or None)
        for name in self.names:
            owner, attribute = self._owner(name)
            self.saved.append((owner, attribute, owner.__dict__.get(attribute)))
            setattr(owner, attribute, self._timed(name, getattr(owner, attribute)))
        return self

    def __exit__(self, *exc: object) -> None:
        # A method of the class comes back by dropping the wrapper; an attribute of the object (the
        # flat turn's forward) by putting it back.
        for owner, attribute, own in reversed(self.saved):
            if own is None:
                owner.__dict__.pop(attribute, None)
            else:
                setattr(owner, attribute, own)

    def _timed(self, name: str, method: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            self.sync()
            started = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.sync()
                self.ms[name] += (time.perf_counter() - started) * 1000
                self.calls[name] += 1
                self.rows[name] += len(args[0]) if args and hasattr(args[0], "__len__") else 0

        return timed

    def summary(self, seconds: float) -> dict[str, Any]:
        return {name: {"calls": self.calls[name], "ms": round(self.ms[name], 1),
                       "ms_a_call": round(self.ms[name] / self.calls[name], 2) if self.calls[name] else None,
                       "rows_a_call": round(self.rows[name] / self.calls[name], 1) if self.calls[name] else None,
                       "share": round(self.ms[name] / 1000 / seconds, 3)} for name in self.names}


def bench_routes() -> list[Any]:
    """`POST /bench/inprocess` {workload, clients, seconds, tag}: the in-process twin's tally, as JSON.
    `POST /bench/stages` (the same body): the twin run with the hf runner's stages timed (`StageTimer`),
    its tally and the stages' times. `POST /bench/switch-interval` {ms}: the server process's switch
    interval from now on (`sys.setswitchinterval`). `POST /bench/gather-rows` {rows}: the hf reader's
    BATCH_GATHER_ROWS from now on (400 for a reader without it). `POST /bench/session-headroom`
    {headroom}: the camera pacer's SESSION_HEADROOM from now on (its estimates kept). `GET
    /bench/compile-counts`: the hf reader's `compile_counts` (captures, torch.compile graphs, Triton
    kernels; /metrics carries only the captures) and its after-ready counters (400 without an hf runner)."""
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    async def inprocess(request: Request) -> JSONResponse:
        spec = await request.json()
        return JSONResponse(await run_inprocess(request.app.state.services, spec))

    async def stages(request: Request) -> JSONResponse:
        spec = await request.json()
        services = request.app.state.services
        runner = getattr(services.reader, "runner", None)
        if runner is None:
            return JSONResponse({"error": "the reader has no hf runner"}, status_code=400)
        with StageTimer(runner) as timer:
            tally = await run_inprocess(services, spec)
        return JSONResponse({"tally": tally, "stages": timer.summary(float(spec["seconds"]))})

    async def switch_interval(request: Request) -> JSONResponse:
        before = sys.getswitchinterval()
        sys.setswitchinterval(float((await request.json())["ms"]) / 1000)
        return JSONResponse({"before_ms": before * 1000, "ms": sys.getswitchinterval() * 1000})

    async def gather_rows(request: Request) -> JSONResponse:
        import dataclasses

        reader = request.app.state.services.reader
        reader = getattr(reader, "loaded", None) or reader  # the hf reader behind the start-up wrapper
        options = getattr(reader, "options", None)
        if options is None or not hasattr(options, "gather_rows"):
            return JSONResponse({"error": "the reader has no gather"}, status_code=400)
        rows = int((await request.json())["rows"])
        if rows < 0:
            return JSONResponse({"error": "rows must be at least 0"}, status_code=400)
        reader.options = dataclasses.replace(options, gather_rows=rows)
        return JSONResponse({"before": options.gather_rows, "rows": rows})

    async def compile_counts(request: Request) -> JSONResponse:
        from app.engine.hf.reader import compile_counts as counted
        from bench.common import after_ready, named_compile_counts

        reader = request.app.state.services.reader
        reader = getattr(reader, "loaded", None) or reader  # the hf reader behind the start-up wrapper
        runner = getattr(reader, "runner", None)
        if runner is None:
            return JSONResponse({"error": "the reader has no hf runner"}, status_code=400)
        return JSONResponse({"counts": named_compile_counts(counted(runner)), "after_ready": after_ready(reader.stats)})

    async def session_headroom(request: Request) -> JSONResponse:
        import dataclasses

        pacer = request.app.state.services.pacer
        share = float((await request.json())["headroom"])
        if not 0 < share <= 1:
            return JSONResponse({"error": "headroom must be more than 0 and at most 1"}, status_code=400)
        before = pacer.rules.headroom
        pacer.rules = dataclasses.replace(pacer.rules, headroom=share)
        return JSONResponse({"before": before, "headroom": share})

    return [Route("/bench/inprocess", inprocess, methods=["POST"]), Route("/bench/stages", stages, methods=["POST"]),
            Route("/bench/switch-interval", switch_interval, methods=["POST"]),
            Route("/bench/gather-rows", gather_rows, methods=["POST"]),
            Route("/bench/session-headroom", session_headroom, methods=["POST"]),
            Route("/bench/compile-counts", compile_counts, methods=["GET"])]
