"""Where a served batch's time goes, in process, with torch.compile's stance as built and reset.

Builds the reader exactly as bench_gpu_served.py's server does (random weights, `hf_reader`: fused
experts, compiled layers, the shape policy's graphs captured before ready), then runs closed loops
of the served bench's own generators (every request its own question sheet; the ticket) through
the Decider, and times the engine's parts around each batch (prompt encoding, decoder passes, slot
reads; synchronised, so the parts add up), with the engine counters each loop moved. Each loop runs
twice: under the stance the loader left (default), and under `eager_on_recompile`.

    python bench/probe_gpu_stance.py                              # on CUDA (about 4 minutes)
    python bench/probe_gpu_stance.py --tiny --device cpu --seconds 0.5   # the CPU smoke test
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.bench_gpu_served import load_random, server_settings  # noqa: E402
from bench.served_load import sheet_request, ticket_request  # noqa: E402


def timed(timing: Counter[str], name: str, call: Callable[..., Any], synchronize: Callable[[], None]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        synchronize()
        started = time.perf_counter()
        try:
            return call(*args, **kwargs)
        finally:
            synchronize()
            timing[name + "_s"] += time.perf_counter() - started
            timing[name + "_calls"] += 1
    return wrapper


async def closed_loop(services: Any, make: Callable[[random.Random, str], dict], clients: int, seconds: float,
                      seed: int) -> tuple[float, float]:
    """(requests a second, p50 seconds) of `clients` deciding `make`'s requests back to back."""
    from app.decisions.request import parse_decision

    latencies: list[float] = []
    end = time.perf_counter() + seconds

    async def client(number: int) -> None:
        rng = random.Random(seed * 1000 + number)
        count = 0
        while time.perf_counter() < end:
            count += 1
            started = time.perf_counter()
            await services.decider.decide(parse_decision(make(rng, f"{seed}-{number}-{count}"), services.limits))
            latencies.append(time.perf_counter() - started)

    started = time.perf_counter()
    await asyncio.gather(*(client(n) for n in range(clients)))
    latencies.sort()
    return len(latencies) / (time.perf_counter() - started), latencies[len(latencies) // 2] if latencies else 0.0


async def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    import torch

    from app.web.services import Services

    settings = server_settings(args)
    started = time.perf_counter()
    reader = load_random(args, settings, lambda phase, done, total: None)
    print(f"built in {time.perf_counter() - started:.1f} s", flush=True)
    runner = reader.runner
    synchronize = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    timing: Counter[str] = Counter()
    for name in ("encode_many", "decoder_hidden", "_slot_reads"):
        setattr(runner, name, timed(timing, name.strip("_"), getattr(runner, name), synchronize))
    services = Services.build(settings, reader)
    await reader.start()
    rows = []
    try:
        for stance in ("default", "eager_on_recompile"):
            torch.compiler.set_stance(stance)
            for workload, make in (("own sheet", sheet_request), ("ticket", ticket_request)):
                for clients in args.clients:
                    timing.clear()
                    before = Counter(runner.stats)
                    rate, p50 = await closed_loop(services, make, clients, args.seconds, len(rows))
                    moved = {key: value - before.get(key, 0) for key, value in runner.stats.items()
                             if value != before.get(key, 0)}
                    row = {"stance": stance, "workload": workload, "clients": clients, "req_per_s": round(rate, 1),
                           "p50_ms": round(p50 * 1000, 1), "timing": {k: round(v, 3) for k, v in timing.items()},
                           "stats": moved}
                    print(json.dumps(row), flush=True)
                    rows.append(row)
    finally:
        torch.compiler.set_stance("default")
        await reader.stop()
    return rows


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="the tiny config on the CPU (a smoke test)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--seconds", type=float, default=6.0, help="seconds a loop")
    parser.add_argument("--clients", default="32,1", help="closed-loop clients, comma-separated")
    parser.add_argument("--out", help="write the rows as JSON here")
    args = parser.parse_args(argv)
    args.clients = [int(part) for part in args.clients.split(",") if part.strip()]
    on_cuda = args.device.startswith("cuda")
    args.compile = args.fused_moe = args.cuda_graphs = on_cuda
    args.port = 0
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    rows = asyncio.run(measure(args))
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
