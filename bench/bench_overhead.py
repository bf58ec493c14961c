"""The server's own cost per request, the engine left out (CPU box or any machine).

`djev serve`'s app (create_app, the front door, the metrics, the request logs at INFO, the switch
interval) over an instant reader that answers every read at once with fixed log-probabilities, so
all that is measured is what the event loop does for a request: parse, plan, prompt, admission,
the deadline and disconnect watch, the answer, the log line. Clients in other processes send the
README's ticket, each with a state of its own, closed loop.

The figure is the event loop's CPU time per answered request (`time.thread_time` on the server's
loop thread over the timed window, divided by the requests it logged), beside the whole server
process's (`time.process_time`: the loop, and the worker threads that parse multipart bodies).
`--workload walk` posts the walk page's request with a JPEG frame each time, as multipart, and
`--workload camera` sends the frames over /v1/stream sessions configured with it, closed loop; the
frames are encoded before the clock (the instant engine decodes no image: what is measured is the
front door's part of a frame). It is what bounds a
lock-step batch on the GPU: 32 clients' next requests are parsed and planned one after another
while the engine waits for them (docs/design.md §5.2). It depends far less on what else runs on
the machine than requests a second do, since the clients share its cores.

    python bench/bench_overhead.py                      # 32 clients, 8 s
    python bench/bench_overhead.py --clients 1,32 --seconds 10 --json "$OUT/overhead.json"
    python bench/bench_overhead.py --workload walk --clients 16
    python bench/bench_overhead.py --workload camera --clients 16
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import multiprocessing
import os
import random
import sys
import time
from pathlib import Path
from typing import Any, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (  # noqa: E402
    header,
    latency_summary,
    machine,
    markdown_table,
    tiny_checkpoint,
    tiny_reader,
    write_json,
)

LABEL_LOGPROB = -0.5  # every label's log-probability before renormalising (all equal: the first wins)


class InstantReader:
    """A Reader whose reads cost nothing: every label of every slot gets the same log-probability."""

    def __init__(self, tokenizer: Any) -> None:
        from app.engine.base import ReaderInfo

        self._tokenizer = tokenizer
        self._info = ReaderInfo(model="instant", engine="instant", device="cpu", tiny=True, canvas_length=128)
        self.reads = 0

    @property
    def info(self):
        return self._info

    @property
    def tokenizer(self):
        return self._tokenizer

    @property
    def ready(self) -> bool:
        return True

    @property
    def degraded(self) -> None:
        return None

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None

    async def read(self, specs: Sequence[Any]) -> list[Any]:
        from app.engine.base import ReadResult, SlotRead

        self.reads += len(specs)
        out = []
        for spec in specs:
            slots = tuple((SlotRead((LABEL_LOGPROB,) * len(ids), ids[0]),) for ids in spec.label_ids)
            canvases = tuple(tuple(slot[0] for slot in slots) for _ in spec.canvases)
            out.append(ReadResult(slots=canvases, prompt_tokens=len(spec.prompt.ids)))
        return out

    async def generate(self, spec: Any) -> Any:
        from app.engine.base import GenerateResult

        return GenerateResult(ids=(), stopped=True, prompt_tokens=len(spec.prompt.ids))


class LogCounter:
    """A logging handler that counts the decisions' summary lines (one per answered request)."""

    def __init__(self) -> None:
        import logging

        class Handler(logging.Handler):
            count = 0

            def emit(self, record: logging.LogRecord) -> None:
                Handler.count += 1

        self.handler = Handler()
        logging.getLogger("djev.decisions").addHandler(self.handler)

    @property
    def count(self) -> int:
        return type(self.handler).count


WORKLOADS = ("ticket", "walk", "camera")
CLIENTS_AFTER_S = 1.0  # the clients run this much past the window (which starts 0.5 s after theirs)
FRAMES_PER_CLIENT = 200  # walk frames encoded ahead per client (used in turn: nothing caches them)
# A camera sends at most this many frames a second, under the stream's flood limit (60 messages a
# second, app/web/stream.py): the instant engine would answer faster than any camera sends.
CAMERA_MAX_FPS = 50


def server_main(port: int, ready: Any, go: Any, results: Any, seconds: float) -> None:
    """The server process: the app as `djev serve` configures it, timed over one window."""
    from app.cli import use_switch_interval
    from app.config import Settings
    from app.logs import configure_logging
    from app.server import create_app, serve_app

    # Admission is not under test: the instant engine's capacity is assumed, not learnt (the default
    # start admits 4 sessions until answers have been measured).
    settings = Settings.of(port=port, host="127.0.0.1", session_capacity_start=1000.0 * CAMERA_MAX_FPS,
                           max_session_fps=float(CAMERA_MAX_FPS))
    log = sys.stderr if os.environ.get("OVERHEAD_LOG") else open(os.devnull, "w")
    configure_logging(settings, log)  # INFO: a line a request, formatted, as served
    use_switch_interval(settings)
    app = create_app(settings, InstantReader(tiny_reader(tiny_checkpoint()).tokenizer))
    counter = LogCounter()

    async def main() -> None:
        serving = asyncio.create_task(serve_app(app, settings))
        while not serving.done():
            try:
                _, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.close()
                break
            except OSError:
                await asyncio.sleep(0.05)
        ready.set()
        while not go.is_set():
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.5)  # the clients' connections are up
        first, cpu, process, wall = counter.count, time.thread_time(), time.process_time(), time.perf_counter()
        await asyncio.sleep(seconds)
        cpu, process = time.thread_time() - cpu, time.process_time() - process
        wall, answered = time.perf_counter() - wall, counter.count - first
        results.put({"answered": answered, "loop_cpu_s": cpu, "process_cpu_s": process, "wall_s": wall})
        await asyncio.sleep(CLIENTS_AFTER_S + 1.0)  # the clients stop before the server does: no request cut off
        serving.cancel()

    try:
        asyncio.run(main())
    except (asyncio.CancelledError, KeyboardInterrupt):
        pass


def client_main(url: str, clients: int, seconds: float, seed: int, workload: str, armed: Any, go: Any,
                out: Any) -> None:
    """A client process: `clients` closed-loop clients of `workload` for `seconds` (plus the server's
    lead), from `go` on (set once every process has said it is `armed`: its frames encoded)."""
    import httpx
    from websockets.exceptions import ConnectionClosed

    from bench.served_load import Refused, open_camera, post_decision
    from bench.workload import WALK_REQUEST, FrameMaker, ticket_request

    maker = FrameMaker(f"overhead-{seed}")
    frames = [maker.make(FRAMES_PER_CLIENT) for _ in range(clients)] if workload != "ticket" else []
    armed.put(seed)
    go.wait()

    async def camera(index: int) -> list[float]:
        latencies: list[float] = []
        end = time.monotonic() + seconds
        try:
            ws = await open_camera(url.replace("http", "ws", 1) + "/v1/stream", "", WALK_REQUEST)
        except Refused:
            raise SystemExit("a camera session was refused at open (1013): admission should not cap this bench") from None
        try:
            while time.monotonic() < end:
                started = time.perf_counter()
                await ws.send(frames[index][len(latencies) % FRAMES_PER_CLIENT])
                while True:
                    message = json.loads(await ws.recv())
                    if message.get("type") in ("result", "error"):
                        break
                if message["type"] != "result":
                    raise SystemExit(f"frame error: {message}")
                latencies.append(time.perf_counter() - started)
                await asyncio.sleep(max(0.0, started + 1 / CAMERA_MAX_FPS - time.perf_counter()))
        except ConnectionClosed:
            pass  # the server stopped at the end of its window
        finally:
            await ws.close()
        return latencies

    async def one(index: int) -> list[float]:
        if workload == "camera":
            return await camera(index)
        rng = random.Random(seed * 1000 + index)
        latencies: list[float] = []
        end = time.monotonic() + seconds
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            while time.monotonic() < end:
                if workload == "walk":
                    body, frame = WALK_REQUEST, frames[index][len(latencies) % FRAMES_PER_CLIENT]
                else:
                    body, frame = ticket_request(rng, f"{seed}.{index}.{len(latencies)}"), None
                started = time.perf_counter()
                try:
                    response = await post_decision(client, body, frame, 30)
                except httpx.HTTPError:
                    break
                if response.status_code != 200:
                    raise SystemExit(f"HTTP {response.status_code}: {response.text[:300]}")
                latencies.append(time.perf_counter() - started)
        return latencies

    async def main() -> list[float]:
        return [x for latencies in await asyncio.gather(*(one(i) for i in range(clients))) for x in latencies]

    out.put(asyncio.run(main()))


def level(clients: int, processes: int, seconds: float, workload: str = "ticket") -> dict[str, Any]:
    from app.server import free_port
    from bench.served_load import shares

    context = multiprocessing.get_context("spawn")
    port = free_port()
    ready, go, results, latencies = context.Event(), context.Event(), context.Queue(), context.Queue()
    armed = context.Queue()
    server = context.Process(target=server_main, args=(port, ready, go, results, seconds), daemon=True)
    server.start()
    if not ready.wait(120):
        server.kill()
        raise SystemExit("the server did not come up")
    url = f"http://127.0.0.1:{port}"
    workers = [context.Process(target=client_main, daemon=True,
                               args=(url, share, seconds + CLIENTS_AFTER_S, i, workload, armed, go, latencies))
               for i, share in enumerate(shares(clients, processes)) if share]
    for worker in workers:
        worker.start()
    for _ in workers:
        armed.get(timeout=120)
    go.set()
    window = results.get(timeout=seconds + 60)
    samples = [x for _ in workers for x in latencies.get(timeout=60)]
    for worker in workers:
        worker.join(timeout=30)
    server.join(timeout=30)
    if server.is_alive():
        server.kill()
    answered = window["answered"]
    return {
        "workload": workload,
        "clients": clients,
        "answered": answered,
        "per_s": answered / window["wall_s"],
        "loop_ms_per_request": 1000 * window["loop_cpu_s"] / answered if answered else math.nan,
        "process_ms_per_request": 1000 * window["process_cpu_s"] / answered if answered else math.nan,
        "loop_busy": window["loop_cpu_s"] / window["wall_s"],
        "latency": latency_summary(samples),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", choices=WORKLOADS, default="ticket",
                        help="the README's ticket (JSON); the walk page's request with a frame (multipart); or "
                             "walk-page camera sessions on /v1/stream, the next frame when the answer comes")
    parser.add_argument("--clients", default="32", help="closed-loop clients per level, e.g. 1,32")
    parser.add_argument("--processes", type=int, default=2, help="client processes")
    parser.add_argument("--seconds", type=float, default=8.0, help="the timed window of a level")
    parser.add_argument("--json", default="", help="also write the results as JSON here")
    args = parser.parse_args(argv)
    rows = [level(int(n), args.processes, args.seconds, args.workload) for n in args.clients.split(",") if n.strip()]
    info = machine()
    print(header("bench_overhead: the server's own cost per request (instant engine)", info))
    print(markdown_table(
        ["workload", "clients", "answered /s", "event loop CPU / request (ms)", "process CPU / request (ms)",
         "loop busy", "p50 (ms)", "p95 (ms)"],
        [[r["workload"], r["clients"], f"{r['per_s']:.0f}", f"{r['loop_ms_per_request']:.3f}",
          f"{r['process_ms_per_request']:.3f}", f"{100 * r['loop_busy']:.0f} %",
          f"{r['latency']['p50_ms']:.1f}", f"{r['latency']['p95_ms']:.1f}"] for r in rows]))
    if args.json:
        write_json(args.json, {"machine": info, "args": vars(args), "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
