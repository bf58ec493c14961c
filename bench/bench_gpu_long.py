"""Long states: the reference's long-state probe (one decision per state, cold then warm) on the hf
engine, in process and through `djev serve`, beside naive transformers at the sizes it can run.

For each size (default 8,700 / 35,000 / 110,000 prompt tokens, the reference's 8,678 / 35,133 /
110,707): a state of about that many tokens, a one-question decision on it (a noul, samples 1), read
cold (the state never seen: its prompt written in chunks of PREFILL_CHUNK tokens, one an engine turn,
at most TURN_TOKENS each) and then warm (the same decision again: the prompt's KV from the engine's KV
store). In process the reader is built as the server builds it (bench/models.py's `load_random`:
random weights through `hf_reader`, the graphs captured before ready) with MAX_PROMPT_TOKENS raised to
hold the largest size (within what the KV store holds: `max_prompt_tokens` in the JSON; a larger state
is refused); each size's peak GPU memory above the resting memory is recorded. Through the server (`--served`, the served bench's
server subprocess, bench/server.py, with the same settings): the same cold and warm reads over
HTTP, and a steady ticket client's latencies while the largest cold read runs (chunks take turns
with other reads).
The naive figure is transformers' plain full read (`bench/naive.py`) at the sizes up to
`--naive-max` tokens.

Both runs report what was built after ready, which must be nothing: right after ready the start-up's
compile counts (in process `compile_counts`; served, the server's, through bench/server.py
`compile_report`), and at the end the after-ready counters (the reader's `stats`; served, /metrics),
printed, with a WARNING line naming any that is not 0, and in the JSON (`compile_counts_at_ready`,
`after_ready`).

    python bench/bench_gpu_long.py                        # on CUDA
    python bench/bench_gpu_long.py --tiny --device cpu    # the CPU smoke test (sizes 300,1200,3000)

Output: a markdown table (printed, and $OUT/bench_gpu_long.md) and $OUT/bench_gpu_long.json.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import threading
import time
from pathlib import Path
from typing import Any, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (  # noqa: E402
    AFTER_READY,
    after_ready,
    after_ready_lines,
    after_ready_metrics,
    compile_counts_line,
    header,
    latency_summary,
    machine,
    markdown_table,
    named_compile_counts,
    numbers,
    percentile,
    write_json,
)
from bench.models import load_random, random_weights  # noqa: E402
from bench.server import (  # noqa: E402
    RandomServe,
    compile_report,
    compile_report_lines,
    read_metrics,
    spawn_random,
    wait_ready,
)
from bench.workload import state_of, ticket_request  # noqa: E402

QUESTION = {"q": {"type": "noul", "instructions": "Does the document ask for a refund?"}}


def body_of(state: str) -> dict[str, Any]:
    return {"state": {"document": state}, "questions": QUESTION, "samples": 1}


async def in_process(args: argparse.Namespace, settings: Any, states: list[str], prime: str,
                     sweep_states: list[str]) -> dict[str, Any]:
    import torch

    from app.decisions.request import parse_decision
    from app.engine.hf.reader import compile_counts
    from app.web.services import Services

    started = time.perf_counter()
    # hf_reader: warm-ups, graphs, the heap settled
    reader = load_random(args.tiny, args.device, settings, weights=random_weights(settings))
    load_s = round(time.perf_counter() - started, 1)
    services = Services.build(settings, reader)
    await reader.start()
    at_ready = named_compile_counts(compile_counts(reader.runner))
    print(f"  {compile_counts_line(at_ready, 'in process at ready')}", flush=True)
    on_cuda = args.device.startswith("cuda")
    rows = []
    counters = ("encoder_chunks", *AFTER_READY)  # by size: the chunks, and anything built after ready
    built: dict[str, float | None] = {}
    try:
        # A prime: one chunked read of another state first, so the first size's cold read is not also
        # the first chunked pass the process runs (its figure is reported on its own).
        started = time.perf_counter()
        await services.decider.decide(parse_decision(body_of(prime), services.limits))
        prime_s = round(time.perf_counter() - started, 3)
        print(f"  in process prime ({len(prime.split())} words): {prime_s} s", flush=True)
        sweep = []
        for chunk, state in zip(args.chunk_sweep, sweep_states):  # the chunk size, by measurement
            reader.runner.prefill_chunk = chunk
            started = time.perf_counter()
            outcome = await services.decider.decide(parse_decision(body_of(state), services.limits))
            sweep.append({"prefill_chunk": chunk, "prompt_tokens": outcome.input_tokens,
                          "cold_s": round(time.perf_counter() - started, 3)})
            print(f"  chunk sweep: {sweep[-1]}", flush=True)
        reader.runner.prefill_chunk = args.prefill_chunk
        for size, state in zip(args.sizes, states):
            before = dict(reader.stats)
            resting = torch.cuda.memory_allocated() if on_cuda else 0
            if on_cuda:
                torch.cuda.reset_peak_memory_stats()
            times, peaks = [], []
            for _ in range(1 + args.warm_reps):  # cold, then warm
                started = time.perf_counter()
                outcome = await services.decider.decide(parse_decision(body_of(state), services.limits))
                times.append(time.perf_counter() - started)
                if on_cuda:
                    peaks.append(round((torch.cuda.max_memory_allocated() - resting) / 2**30, 2))
                    torch.cuda.reset_peak_memory_stats()
            peak = max(peaks, default=0.0)
            delta = {name: reader.stats.get(name, 0) - before.get(name, 0) for name in counters}
            warm = sorted(times[1:])
            rows.append({"size": size, "prompt_tokens": outcome.input_tokens, "cold_s": round(times[0], 3),
                         "warm_s": round(warm[len(warm) // 2], 3), "warm_max_s": round(warm[-1], 3),
                         "warm_reads": len(warm), "peak_over_resting_gib": round(peak, 2),
                         "peak_cold_warm_gib": peaks[:2],
                         "chunks": delta.pop("encoder_chunks"), **delta})
            print(f"  in process {size}: {rows[-1]}", flush=True)
        naive = {}
        if on_cuda:
            from bench.naive import measure_naive

            for size in args.sizes:
                if size <= args.naive_max:
                    got = measure_naive(reader.runner.model, batches=(1,), prompt_tokens=size, static_batches=(),
                                        warmup=1, reps=3)
                    naive[size] = got["full_read_eager"].get(1)
    finally:
        built = after_ready(reader.stats)  # at the end (the naive reads go around the reader: they count nothing)
        for line in after_ready_lines(built, "in process at the end"):
            print(f"  {line}", flush=True)
        await reader.stop()
    return {"load_s": load_s, "max_prompt_tokens": reader.runner.max_prompt_tokens, "prime_s": prime_s,
            "chunk_sweep": sweep, "rows": rows,
            "naive_full_read_eager_ms": naive, "compile_counts_at_ready": at_ready, "after_ready": built}


def served(args: argparse.Namespace, states: list[str], out_dir: Path) -> dict[str, Any]:
    import httpx

    os.environ["MAX_PROMPT_TOKENS"] = str(args.max_prompt_tokens)  # the server child reads it, as serve does
    os.environ["PREFILL_CHUNK"] = str(args.prefill_chunk)
    on_cuda = args.device.startswith("cuda")  # the server's defaults on CUDA, as in process
    server = spawn_random(RandomServe(args.tiny, args.device, on_cuda, on_cuda, on_cuda),
                          out_dir / "bench_gpu_served.server.log")
    rows: list[dict[str, Any]] = []
    steady: dict[str, Any] = {}
    built: dict[str, Any] = {}
    ended: dict[str, float | None] = {}
    try:
        startup = wait_ready(server, args.startup_timeout)
        built = compile_report(server.url, os.environ.get("API_KEY", ""))
        for line in compile_report_lines(built, "served at ready"):
            print(f"  {line}", flush=True)
        with httpx.Client(base_url=server.url, timeout=args.request_timeout) as client:
            for index, (size, state) in enumerate(zip(args.sizes, states)):
                state = f"{state} (served)"  # not the in-process run's prompt: cold here too
                latencies: list[float] = []
                stop = threading.Event()
                steady_thread = None
                if index == len(states) - 1:  # beside the largest cold read: a steady client
                    steady_thread = threading.Thread(target=steady_client, args=(server.url, stop, latencies),
                                                     daemon=True)
                    steady_thread.start()
                    time.sleep(1.0)
                times, statuses = [], []
                for _ in range(2):
                    started = time.perf_counter()
                    response = client.post("/v1/systemone", json=body_of(state))
                    times.append(time.perf_counter() - started)
                    statuses.append(response.status_code)
                    stop.set()  # the steady client's window is the cold read
                if steady_thread is not None:
                    steady_thread.join(timeout=30)
                    steady = {"requests": len(latencies), **latency_summary(latencies),
                              "p99_ms": round(percentile([t * 1000 for t in latencies], 99), 1)} if latencies else {}
                rows.append({"size": size, "cold_s": round(times[0], 3), "warm_s": round(times[1], 3),
                             "statuses": statuses})
                print(f"  served {size}: {rows[-1]}", flush=True)
        ended = after_ready_metrics(read_metrics(server.url))
        for line in after_ready_lines(ended, "served at the end"):
            print(f"  {line}", flush=True)
    finally:
        server.stop()
    return {"startup": startup, "rows": rows, "steady_beside_largest_cold": steady, "compile_counts_at_ready": built,
            "after_ready": ended}


def steady_client(url: str, stop: threading.Event, latencies: list[float]) -> None:
    import httpx

    rng = random.Random(7)
    with httpx.Client(base_url=url, timeout=60) as client:
        number = 0
        while not stop.is_set():
            number += 1
            started = time.perf_counter()
            response = client.post("/v1/systemone", json=ticket_request(rng, f"steady-{number}"))
            if response.status_code == 200:
                latencies.append(time.perf_counter() - started)


def report(results: dict[str, Any], args: argparse.Namespace) -> str:
    naive = results["in_process"]["naive_full_read_eager_ms"]
    served_rows = {row["size"]: row for row in results.get("served", {}).get("rows", [])}
    table = []
    for row in results["in_process"]["rows"]:
        other = served_rows.get(row["size"], {})
        base = naive.get(row["size"])
        warm = f"{row['warm_s']} (max {row['warm_max_s']})" if row.get("warm_reads", 1) > 1 else row["warm_s"]
        table.append([row["size"], row["prompt_tokens"], row["chunks"], row["cold_s"], warm,
                      row["peak_over_resting_gib"], other.get("cold_s", "-"), other.get("warm_s", "-"),
                      f"{base / 1000:.3f}" if base else "-"])
    text = header("bench_gpu_long: long states, cold then warm", machine())
    text += "\n" + markdown_table(["state tokens", "prompt tokens", "chunks", "cold s",
                                   f"warm s (median of {args.warm_reps})" if args.warm_reps > 1 else "warm s",
                                   "peak GiB over resting", "served cold s", "served warm s",
                                   "naive full read s"], table)
    how = ("after the server: a restart with its compile caches" if results.get("served")
           else "a cold start unless CACHE_DIR held compile caches already")
    text += (f"\nin process: the reader loaded in {results['in_process']['load_s']} s ({how}); a prime chunked "
             f"read first, {results['in_process']['prime_s']} s\n")
    sweep = results["in_process"].get("chunk_sweep")
    if sweep:
        text += "\nPREFILL_CHUNK sweep (one cold read each, in process):\n\n" + markdown_table(
            ["PREFILL_CHUNK", "prompt tokens", "cold s"],
            [[row["prefill_chunk"], row["prompt_tokens"], row["cold_s"]] for row in sweep]) + "\n"
    startup = results.get("served", {}).get("startup")
    if startup:
        text += (f"\nserved start-up (a cold start: the compile caches empty): first answer "
                 f"{startup.get('first_answer_s')} s, ready {startup.get('ready_s')} s\n")
    text += "\n" + "\n".join(after_ready_lines(results["in_process"]["after_ready"], "in process at the end")) + "\n"
    if results.get("served", {}).get("after_ready"):
        text += "\n".join(after_ready_lines(results["served"]["after_ready"], "served at the end")) + "\n"
    steady = results.get("served", {}).get("steady_beside_largest_cold")
    if steady:
        text += (f"\nsteady ticket client beside the largest cold read: {steady['requests']} answers, p50 "
                 f"{steady['p50_ms']:.0f} ms, p99 {steady['p99_ms']:.0f} ms, max {steady['max_ms']:.0f} ms\n")
    return text


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="the tiny config on the CPU (a smoke test)")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    parser.add_argument("--sizes", type=numbers(int), default=None,
                        help="state tokens, comma-separated (default 8700,35000,110000; --tiny 300,1200,3000)")
    parser.add_argument("--prefill-chunk", type=int, default=None, help="PREFILL_CHUNK for both runs "
                        "(default: the server's)")
    parser.add_argument("--chunk-sweep", type=numbers(int), default="", help="PREFILL_CHUNK values to time one cold read of "
                        "--sweep-size tokens at, in process, before the sizes (e.g. 1024,2048,4096; a turn writes at most "
                        "TURN_TOKENS of a prompt, whatever the chunk)")
    parser.add_argument("--sweep-size", type=int, default=35000)
    parser.add_argument("--warm-reps", type=int, default=5, help="warm reads after each cold one, in process "
                        "(the median reported, the slowest beside it)")
    parser.add_argument("--naive-max", type=int, default=8700, help="naive full reads up to this many tokens")
    parser.add_argument("--served", action=argparse.BooleanOptionalAction, default=True,
                        help="also through the server (default on)")
    parser.add_argument("--startup-timeout", type=float, default=600.0)
    parser.add_argument("--request-timeout", type=float, default=300.0)
    parser.add_argument("--out-dir", default=os.environ.get("OUT") or ".")
    args = parser.parse_args(argv)
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    args.sizes = args.sizes or numbers(int)("300,1200,3000" if args.tiny else "8700,35000,110000")
    args.max_prompt_tokens = max(32768, -(-(max(args.sizes) + 2048) // 1024) * 1024)
    if args.prefill_chunk is None:
        from app.config import Settings

        args.prefill_chunk = Settings.of().hf.prefill_chunk
    return args


def main(argv: Sequence[str] | None = None) -> None:
    from app.build import use_cache_dir
    from app.config import Settings

    use_cache_dir(Settings.from_env())  # before torch; the server child (started first) fills the same caches

    from app.engine.tiny import build_tokenizer

    args = parse_args(argv)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()  # the one load_random serves with
    rng = random.Random(11)
    states = [state_of(tokenizer, size, rng) for size in args.sizes]
    prime = state_of(tokenizer, 2 * args.prefill_chunk + 300, rng)
    on_cuda = args.device.startswith("cuda")  # compiled, fused experts, graphs: the server's defaults on CUDA
    settings = Settings.from_env(device=args.device, max_prompt_tokens=args.max_prompt_tokens,
                                 prefill_chunk=args.prefill_chunk, torch_compile=on_cuda,
                                 fused_moe=on_cuda, cuda_graphs=on_cuda)
    results: dict[str, Any] = {"args": {k: v for k, v in vars(args).items()}}
    sweep_states = [state_of(tokenizer, args.sweep_size, rng) for _ in args.chunk_sweep]
    if args.served:  # first: the server child's GPU memory is all back when it exits (a cold start)
        results["served"] = served(args, states, out_dir)
    # then in process, its load a restart with the compile caches the server left in CACHE_DIR
    results["in_process"] = asyncio.run(in_process(args, settings, states, prime, sweep_states))
    text = report(results, args)
    print(text, flush=True)
    (out_dir / "bench_gpu_long.md").write_text(text)
    write_json(out_dir / "bench_gpu_long.json", results)


if __name__ == "__main__":
    main()
