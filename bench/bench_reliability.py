"""Reliability under load, on the tiny model, for docs/reliability.md.

Four measurements, each against the real app (`create_app`) served on 127.0.0.1 with load generated
from other processes, so the numbers include the event loop, the planning threads and the engine:

  health     GET /health latency (p50/p99/max) polled every 20 ms while 64 closed-loop clients load
             the server and one 256-question x 255-option request (inside every documented limit)
             is planned;
  load       64 closed-loop clients for --seconds (a unique state each request, 2 questions):
             req/s, p50, p95, p95/p50, errors, and the process's memory before and after; run quiet
             and again with another process spinning on one of the cores (--busy);
  think      8 closed-loop clients of plain decisions for --seconds, alone and while one request
             with think 4096 runs: p95 with / p95 without;
  faults     readers that raise, hang past REQUEST_TIMEOUT, and return garbage: the statuses, then
             a normal decision, with the server's in-flight count, sessions and asyncio tasks after.

Run (nothing else running on the machine):
  .venv/bin/python bench/bench_reliability.py --json docs/results/cpu_reliability.json
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from typing import Any, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (  # noqa: E402
    command_line,
    fmt,
    latency_summary,
    live_server,
    machine,
    markdown_table,
    percentile,
    tiny_checkpoint,
    tiny_reader,
    write_json,
)
from bench.served_load import load_level  # noqa: E402
from bench.workload import ticket  # noqa: E402

HTTP_TIMEOUT_S = 300.0
# Two questions a decision: the load the reliability figures (docs/reliability.md) were measured under.
QUESTIONS = {"urgent": {"type": "noul", "instructions": "Reply within the hour?"},
             "team": {"type": "choice", "criteria": {"billing": None, "outage": None}}}


def request(tag: str) -> dict[str, Any]:
    """A two-question decision with a state of its own (`tag`)."""
    return ticket(f"Everything is down ({tag}); we have a demo at noon.", QUESTIONS)


def huge() -> dict[str, Any]:
    return {"state": "a long list", "questions": {
        f"q{i}": {"type": "choice", "criteria": {f"o{j}": None for j in range(255)}} for i in range(256)}}


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


# ---------------------------------------------------------------------------------------- load processes

def closed_loop(url: str, clients: int, seconds: float, tag: str) -> dict[str, Any]:
    """`clients` closed loops of two-question decisions, each with its own state (bench_cpu's loop)."""
    return load_level(url, clients, seconds, tag, request)


def poll_health(url: str, seconds: float, every: float = 0.02) -> list[float]:
    import httpx

    out = []
    with httpx.Client(base_url=url, timeout=HTTP_TIMEOUT_S) as client:
        deadline = time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            t0 = time.perf_counter()
            client.get("/health")
            out.append(time.perf_counter() - t0)
            time.sleep(every)
    return out


def post_once(url: str, body: dict[str, Any], delay: float = 0.0) -> tuple[int, float, str]:
    import httpx

    time.sleep(delay)
    t0 = time.perf_counter()
    response = httpx.post(url + "/v1/systemone", json=body, timeout=HTTP_TIMEOUT_S)
    message = ""
    if response.status_code != 200:
        message = response.json().get("error", {}).get("message", "")[:120]
    return response.status_code, time.perf_counter() - t0, message


def spin(seconds: float) -> None:
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        pass


def pool(workers: int) -> ProcessPoolExecutor:
    return ProcessPoolExecutor(max_workers=workers, mp_context=get_context("spawn"))


# ---------------------------------------------------------------------------------------- measurements

def health_under_load(url: str, seconds: float) -> dict[str, Any]:
    with pool(3) as workers:
        load = workers.submit(closed_loop, url, 64, seconds, "health")
        probe = workers.submit(poll_health, url, seconds)
        big = workers.submit(post_once, url, huge(), seconds / 4)
        health = probe.result()
        status, big_s, message = big.result()
        level = load.result()
    return {"health": latency_summary(health), "health_p99_ms": round(percentile([h * 1000 for h in health], 99), 2),
            "big_status": status, "big_s": round(big_s, 2), "big_message": message,
            "load_requests": len(level["latencies"]), "load_errors": level["errors"]}


def measure_load(url: str, seconds: float, busy: bool) -> dict[str, Any]:
    with pool(2) as workers:
        workers.submit(closed_loop, url, 64, min(2.0, seconds), "warm").result()
        spinner = workers.submit(spin, seconds + 2) if busy else None
        before = rss_mib()
        level = workers.submit(closed_loop, url, 64, seconds, "busy" if busy else "quiet").result()
        gc.collect()
        after = rss_mib()
        if spinner is not None:
            spinner.result()
    lat = latency_summary(level["latencies"])
    return {"busy": busy, **lat, "requests": lat["n"], "req_per_s": lat["n"] / level["elapsed_s"],
            "p95_over_p50": lat["p95_ms"] / lat["p50_ms"], "errors": level["errors"],
            "rss_before_mib": round(before, 1), "rss_after_mib": round(after, 1)}


def think_interference(url: str, seconds: float) -> dict[str, Any]:
    with pool(2) as workers:
        alone = workers.submit(closed_loop, url, 8, seconds, "alone").result()
        thinker = workers.submit(post_once, url, {**request("thinker"), "think": 4096}, 0.0)
        time.sleep(0.5)
        beside = workers.submit(closed_loop, url, 8, seconds, "beside").result()
        status, think_s, message = thinker.result()
    a, b = latency_summary(alone["latencies"]), latency_summary(beside["latencies"])
    return {"alone": a, "beside": b, "p95_ratio": b["p95_ms"] / a["p95_ms"], "think_status": status,
            "think_s": round(think_s, 2), "think_message": message,
            "errors": {**alone["errors"], **beside["errors"]}}


class _FaultyReader:
    """Wraps a real reader; `mode` says how its reads fail."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.mode = "ok"
        self.info = inner.info
        self.tokenizer = inner.tokenizer

    @property
    def ready(self) -> bool:
        return self.inner.ready

    @property
    def degraded(self):
        return self.inner.degraded

    @property
    def stats(self):
        return self.inner.stats

    async def start(self) -> None:
        await self.inner.start()

    async def stop(self) -> None:
        await self.inner.stop()

    async def read(self, specs):
        from app.engine.base import EngineError, ReadResult

        if self.mode == "raise":
            raise EngineError("injected failure")
        if self.mode == "hang":
            await asyncio.sleep(3600)
        if self.mode == "garbage":
            return [ReadResult(slots=(), prompt_tokens=-1) for _ in specs]
        return await self.inner.read(specs)

    async def generate(self, spec):
        return await self.inner.generate(spec)

    def stream(self, spec):
        return self.inner.stream(spec)


def faults(checkpoint: Path) -> dict[str, Any]:
    import httpx

    from app.config import Settings
    from app.server import create_app

    settings = Settings.of(host="127.0.0.1", pages=False, log_level="warning", request_timeout=2.0)
    reader = _FaultyReader(tiny_reader(checkpoint, settings))
    app = create_app(settings, reader)
    out: dict[str, Any] = {}
    with live_server(app) as url:
        with httpx.Client(base_url=url, timeout=HTTP_TIMEOUT_S) as client:
            for mode in ("raise", "hang", "garbage", "ok"):
                reader.mode = mode
                t0 = time.perf_counter()
                response = client.post("/v1/systemone", json=request(mode))
                out[mode] = {"status": response.status_code, "s": round(time.perf_counter() - t0, 2),
                             "message": response.json().get("error", {}).get("message", "")[:100]
                             if response.status_code != 200 else ""}
            health = client.get("/health").json()
        loops = [o for o in gc.get_objects() if isinstance(o, asyncio.AbstractEventLoop) and o.is_running()]
        tasks = sum(len(asyncio.all_tasks(loop)) for loop in loops)
    out["after"] = {"in_flight": health.get("in_flight"), "sessions": health.get("sessions"),
                    "asyncio_tasks": tasks}
    return out


# ---------------------------------------------------------------------------------------- report

def report(results: dict[str, Any]) -> str:
    lines = []
    if "health" in results:
        h = results["health"]
        lines.append(markdown_table(
            ["/health polls", "p50 ms", "p99 ms", "max ms", "256x255 request", "load requests", "load errors"],
            [[h["health"]["n"], fmt(h["health"]["p50_ms"], 2), fmt(h["health_p99_ms"], 2), fmt(h["health"]["max_ms"], 1),
              f"{h['big_status']} in {h['big_s']} s", h["load_requests"], h["load_errors"] or 0]]))
    if "load" in results:
        rows = [["busy core" if r["busy"] else "quiet", r["requests"], fmt(r["req_per_s"], 1), fmt(r["p50_ms"], 0),
                 fmt(r["p95_ms"], 0), fmt(r["p95_over_p50"], 2), r["errors"] or 0,
                 f"{r['rss_before_mib']} → {r['rss_after_mib']}"] for r in results["load"]]
        lines.append(markdown_table(["64 clients", "answers", "req/s", "p50 ms", "p95 ms", "p95/p50", "errors",
                                     "RSS MiB"], rows))
    if "think" in results:
        t = results["think"]
        lines.append(markdown_table(
            ["8 clients", "p50 ms", "p95 ms", "think 4096 request"],
            [["alone", fmt(t["alone"]["p50_ms"], 0), fmt(t["alone"]["p95_ms"], 0), "-"],
             ["beside think 4096", fmt(t["beside"]["p50_ms"], 0), fmt(t["beside"]["p95_ms"], 0),
              f"{t['think_status']} in {t['think_s']} s"],
             ["ratio", "", fmt(t["p95_ratio"], 2), ""]]))
    if "faults" in results:
        f = results["faults"]
        rows = [[mode, f[mode]["status"], f[mode]["s"], f[mode]["message"]] for mode in ("raise", "hang", "garbage", "ok")]
        lines.append(markdown_table(["reader", "status", "seconds", "message"], rows))
        lines.append(f"after: in_flight {f['after']['in_flight']}, sessions {f['after']['sessions']}, "
                     f"asyncio tasks {f['after']['asyncio_tasks']}")
    return "\n\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--only", default="health,load,think,faults")
    parser.add_argument("--json", default="")
    parser.add_argument("--gather-ms", type=float, default=None, help="BATCH_GATHER_MS for the server (default: Settings)")
    parser.add_argument("--load", default="quiet,busy", help="which load runs: quiet, busy or both")
    args = parser.parse_args(argv)
    wanted = set(args.only.split(","))
    from app.config import Settings
    from app.server import create_app

    checkpoint = tiny_checkpoint()
    results: dict[str, Any] = {"machine": machine(), "command": command_line(), "cpus": os.cpu_count()}
    if wanted & {"health", "load", "think"}:
        settings = Settings.of(host="127.0.0.1", pages=False, log_level="warning")
        if args.gather_ms is not None:
            settings = settings.replace(batch_gather_ms=args.gather_ms)
        results["batch_gather_ms"] = settings.hf.batch_gather_ms
        app = create_app(settings, tiny_reader(checkpoint, settings))
        with live_server(app) as url:
            if "health" in wanted:
                results["health"] = health_under_load(url, args.seconds)
                print(json.dumps(results["health"]), flush=True)
            if "load" in wanted:
                runs = [part == "busy" for part in args.load.split(",")]
                results["load"] = [measure_load(url, args.seconds, busy) for busy in runs]
                print(json.dumps(results["load"]), flush=True)
            if "think" in wanted:
                results["think"] = think_interference(url, args.seconds)
                print(json.dumps(results["think"]), flush=True)
    if "faults" in wanted:
        results["faults"] = faults(checkpoint)
    print(report(results))
    if args.json:
        write_json(args.json, results)


if __name__ == "__main__":
    multiprocessing.freeze_support()
    main()
