"""Any engine through djev's HTTP API: the reference's three tables, per engine, in one run.

(1) One decision, sequential, median of --repeats: a new state every time vs the same state every
    time (its prompt cached), at steps 1, 2 and 3.
(2) Concurrency: 1, 8, 16, 32 closed-loop clients (--levels), each posting decisions with a unique
    state for --seconds per level: req/s, decisions/s (questions answered per second: 3 per request),
    p50 and p95 seconds.
(3) Long states, one decision each, cold (first time) then warm (the same request again).

Every request is the README's ticket (noul + choice + score, `samples: 1`). Give a server as
`--url NAME=URL` (repeatable), or `--engines hf,vllm` to start `djev serve --engine E` on the tiny
model (hf from .venv, vllm from .venv-vllm with vLLM's CPU environment) and measure them in one run.
On CPU the vLLM numbers are dominated by the Triton interpreter the CPU test venv runs vLLM's
kernels through; they compare code paths, not engines.

Usage: python bench/bench_http.py [--engines hf,vllm | --url NAME=URL ...] [--seconds 10]
       [--levels 1,8,16,32] [--repeats 15] [--long 2000,8000] [--json OUT]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (  # noqa: E402
    REPO,
    fmt,
    header,
    machine,
    markdown_table,
    numbers,
    percentile,
    tiny_checkpoint,
    vllm_cpu_env,
    write_json,
)
from bench.served_load import load_level  # noqa: E402
from bench.server import spawn, wait_ready  # noqa: E402
from bench.workload import TICKET_QUESTIONS, ticket  # noqa: E402

VLLM_ENV = vllm_cpu_env()  # vLLM's CPU build as the tests run it (scripts/vllm_cpu/cpu.env)
_unique = itertools.count()


def fresh_state() -> str:
    return f"Ticket {next(_unique)}: everything is down and we have a demo at noon."


async def post(client: httpx.AsyncClient, url: str, body: dict) -> float:
    started = time.perf_counter()
    response = await client.post(f"{url}/v1/systemone", json=body)
    if response.status_code != 200:
        raise RuntimeError(f"{url}: {response.status_code} {response.text[:200]}")
    return time.perf_counter() - started


async def one_decision(url: str, repeats: int) -> list[list]:
    rows = []
    async with httpx.AsyncClient(timeout=600) as client:
        for steps in (1, 2, 3):
            await post(client, url, ticket("warm-up", steps=steps, seed=1))
            new = [await post(client, url, ticket(fresh_state(), steps=steps, seed=1)) for _ in range(repeats)]
            same = [await post(client, url, ticket("the same state every time", steps=steps, seed=1)) for _ in range(repeats)]
            rows.append([f"steps {steps}", fmt(percentile(new, 50) * 1000), fmt(percentile(same, 50) * 1000)])
    return rows


def concurrency(url: str, levels: list[int], seconds: float) -> list[list]:
    rows = []
    for clients in levels:
        level = load_level(url, clients, seconds, f"c{clients}", lambda tag: ticket(fresh_state(), steps=1, seed=1),
                           timeout=600)
        if level["errors"]:
            raise RuntimeError(f"{url}: {clients} clients: {level['errors']}")
        latencies = level["latencies"]
        rate = len(latencies) / level["elapsed_s"]
        rows.append([clients, fmt(rate, 2), fmt(rate * len(TICKET_QUESTIONS), 1), fmt(percentile(latencies, 50), 2),
                     fmt(percentile(latencies, 95), 2)])
    return rows


async def long_states(url: str, sizes: list[int]) -> list[list]:
    rows = []
    async with httpx.AsyncClient(timeout=1800) as client:
        for words in sizes:
            body = ticket(f"Log {next(_unique)}. " + "The service is down again and the customer is angry. " * (words // 10),
                          steps=1, seed=1)
            cold = await post(client, url, body)
            response = await client.post(f"{url}/v1/systemone", json=body)
            tokens = response.json()["usage"]["input_tokens"]
            warm = await post(client, url, body)
            rows.append([f"{tokens:,}", fmt(cold, 2), fmt(warm, 2)])
    return rows


@contextmanager
def started_server(engine: str, checkpoint: Path, log_dir: Path) -> Iterator[str]:
    """`djev serve --engine ENGINE` on the tiny model in its own process; yields its base URL."""
    from app.server import free_port

    port = free_port()
    venv = ".venv-vllm" if engine == "vllm" else ".venv"
    python = REPO / venv / "bin" / "python"
    if not python.is_file():
        raise SystemExit(f"{python} is missing: run scripts/setup.sh{' --vllm' if engine == 'vllm' else ''}")
    argv = [str(python), "-m", "app", "serve", "--engine", engine, "--model", str(checkpoint), "--device", "cpu",
            "--host", "127.0.0.1", "--port", str(port), "--no-pages", "--log-level", "warning"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    if engine == "vllm":
        argv += ["--max-seqs", "32", "--max-model-len", "8192", "--kv-cache-gb", "2"]
        env.update(VLLM_ENV)
    server = spawn(argv, port, log_dir / f"bench-http-{engine}.log", env=env)
    try:
        try:
            wait_ready(server, 600)
        except RuntimeError as exc:
            raise SystemExit(f"{engine} server: {exc}\n(the whole log: {server.log_path})") from None
        yield server.url
    finally:
        server.stop()


def measure(name: str, url: str, args: argparse.Namespace, levels: list[int], sizes: list[int], results: dict) -> None:
    first = asyncio.run(one_decision(url, args.repeats))
    curve = concurrency(url, levels, args.seconds)
    long = asyncio.run(long_states(url, sizes))
    results["engines"][name] = {"url": url, "one_decision": first, "concurrency": curve, "long_states": long}
    print(f"\n### {name} ({url})\n")
    print(markdown_table(["one decision", "new state p50 ms", "same state p50 ms"], first))
    print()
    print(markdown_table(["clients", "req/s", "decisions/s", "p50 s", "p95 s"], curve))
    print()
    print(markdown_table(["state tokens", "cold s", "warm s"], long), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", action="append", default=[], help="NAME=URL of a running djev server (repeatable)")
    parser.add_argument("--engines", default="", help="start these engines on the tiny model, e.g. hf,vllm")
    parser.add_argument("--seconds", type=float, default=10.0, help="seconds per concurrency level")
    parser.add_argument("--levels", type=numbers(int), default="1,8,16,32")
    parser.add_argument("--repeats", type=int, default=15, help="decisions per cell of the first table")
    parser.add_argument("--long", type=numbers(int), default="2000,8000",
                        help="long-state sizes in words (about 1.3 tokens each)")
    parser.add_argument("--json", default="", help="also write the results as JSON here")
    args = parser.parse_args()
    levels, sizes = args.levels, args.long
    targets = [tuple(item.split("=", 1)) for item in args.url]
    if not targets and not args.engines:
        parser.error("give --url NAME=URL or --engines hf,vllm")
    results: dict = {"machine": machine(), "engines": {}}
    print(header("djev over HTTP: one decision, concurrency, long states", results["machine"]))
    for name, url in targets:
        measure(name, url, args, levels, sizes, results)
    if args.engines:
        # One engine's server at a time, so an idle one does not share the cores with the measured one.
        checkpoint = tiny_checkpoint()
        log_dir = Path(os.environ.get("TMPDIR", "/tmp"))
        for engine in args.engines.split(","):
            with started_server(engine, checkpoint, log_dir) as url:
                measure(engine, url, args, levels, sizes, results)
    if args.json:
        print(f"\nwrote {write_json(args.json, results)}")


if __name__ == "__main__":
    main()
