"""Whole decisions on the full-size DiffusionGemma 26B-A4B architecture (random bf16 weights), through
the code `djev serve` runs minus HTTP: parse_decision -> Decider -> HFReader's batching loop ->
DiffusionRunner, with the naive transformers baseline (bench/naive.py) measured first on the same
model in the same process, and every engine figure printed beside its naive figure as a ratio.

The reader is the one `djev serve` builds (`app.engine.hf.loader.hf_reader`: the experts fused, the
layers compiled, the warm-ups, the graphs captured, the heap settled), made over the model only after
the naive baseline has run on it, with this script's flags as Settings (--compile TORCH_COMPILE,
--fused-moe FUSED_MOE, --eager CUDA_GRAPHS=0, --device). Right
after ready it prints what the start-up built (`compile_counts`), and at the end the reader's
after-ready counters, which must be 0 (a WARNING line names any that is not; both in the JSON).

The tokenizer is the tiny model's (the real one needs the checkpoint); the full config's image ids are
set to that tokenizer's, and prompts come out a little longer than Gemma's tokenizer would make them.
HTTP adds a few ms a request on top (bench_cpu.py measures that layer).

Cases:
  (A) one decision, the README's ticket (noul, 3-way choice, 3-level score), samples 1: a new state
      every time (prompt encoded) and the same state every time (prompt KV cached);
  (B) closed-loop clients (--levels, default 1, 8, 16, 32, 64), each deciding unique-state tickets
      back to back for --seconds: req/s, p50, p95, canvases per engine turn, and the turns' timeline;
  (C) the walk page's frame (512x384 JPEG, ahead question): clear (one image read), blocked (two);
  (D) think: the ticket with `think` 16 and 64 (random weights never stop a block early: every block
      takes all its denoise passes), with the passes taken and the cost of one pass;
  (E) how cost grows (--grids, on by default): 1 / 10 / 50 / 256 questions; prompts of 300 / 2k / 8k /
      32k tokens, cold (new state) and warm (same state); 1 / 4 / 8 images.

    python bench/bench_gpu_decisions.py                 # full size on CUDA; JSON to $OUT/bench_gpu_decisions.json
    python bench/bench_gpu_decisions.py --tiny --device cpu --seconds 1 --reps 2 --no-grids   # smoke test
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (  # noqa: E402
    CollectorPauses,
    after_ready,
    after_ready_lines,
    compile_counts_line,
    fmt,
    header,
    latency_summary,
    machine,
    markdown_table,
    named_compile_counts,
    numbers,
    settle_device_and_out,
    write_json,
)
from bench.models import VISION_KERNELS, choose_vision_attention, random_model, served_name  # noqa: E402
from bench.naive import measure_naive, ratio  # noqa: E402
from bench.workload import frames, noul_questions, state_of, ticket, ticket_request  # noqa: E402

AHEAD = {"type": "choice", "instructions": (
    "You are the eyes of a person walking forward. Judge only the center of the image, a window about 30 "
    "degrees wide directly ahead. If nothing is within 2 meters there, say all clear."), "criteria": {
    "all clear ahead": "the path straight ahead is free for at least 2 meters",
    "danger: stairs": "stairs, steps or a curb ahead, up or down",
    "danger: wall ahead": "a wall, fence or closed barrier ahead",
    "danger: object ahead": "furniture, a pole, a parked bike, a box or another object in the path",
    "danger: pet ahead": "a dog, cat or other animal in the path",
    "door ahead": "a door directly ahead, open or closed"}}
SIDE = {"type": "choice", "instructions": "There is an obstacle ahead. Where is the nearest obstacle in the frame?",
        "criteria": {"left half": None, "right half": None}, "depends_on": ["ahead"]}
WALK_STATE = {"note": "one frame from a phone's back camera, pointed the way the person is walking"}


def random_weights(args: argparse.Namespace) -> tuple[Any, Any, Any]:
    """(model, tokenizer, image processor) over random weights, as the server would load them, with
    the vision tower's attention kernel order --vision-attention asks. Nothing fused or compiled yet:
    the naive baseline runs on this model first."""
    choose_vision_attention(args.vision_attention)
    return random_model(args.tiny, args.device)


def reader_settings(args: argparse.Namespace) -> Any:
    """The Settings this script's flags make (no environment): the device, TORCH_COMPILE (--compile),
    FUSED_MOE (--fused-moe), CUDA_GRAPHS (off with --eager); the rest are the server's defaults."""
    from app.config import Settings

    return Settings.of(device=args.device, torch_compile=args.compile, fused_moe=args.fused_moe,
                       cuda_graphs=not args.eager)


def build_reader(args: argparse.Namespace, model: Any, hf_tokenizer: Any, processor: Any) -> tuple[Any, Any]:
    """The reader `djev serve` builds over `model` (`hf_reader`: the experts fused, the layers compiled,
    the warm-ups run, the graphs captured and the heap settled, as the settings ask), with
    `reader_settings(args)`. Call it after the naive baseline: it changes the model. Returns (reader,
    settings)."""
    from app.build import hf_options
    from app.engine.hf.loader import hf_reader

    settings = reader_settings(args)
    options = hf_options(settings, served_name(args.tiny), tiny=args.tiny)
    return hf_reader(model, hf_tokenizer, processor, options), settings


def experts_of(model: Any) -> tuple[str | None, bool]:
    """The experts implementation the model runs, and whether it is djev's Triton kernels (FUSED_MOE)."""
    experts = getattr(model.config, "_experts_implementation", None)
    return experts, experts == "djev_fused"  # app.engine.hf.moe.fused.IMPLEMENTATION


def ready_report(reader: Any, results: dict[str, Any]) -> None:
    """Right after ready: what the start-up built (`compile_counts`), printed and in `results`."""
    from app.engine.hf.reader import compile_counts

    results["compile_counts_at_ready"] = named_compile_counts(compile_counts(reader.runner))
    print(f"  {compile_counts_line(results['compile_counts_at_ready'], 'at ready')}", flush=True)


def end_report(reader: Any, results: dict[str, Any]) -> None:
    """At the end: the reader's after-ready counters (each must be 0), printed (a WARNING line names
    any that is not) and in `results`."""
    results["after_ready"] = after_ready(reader.stats)
    for line in after_ready_lines(results["after_ready"], "at the end"):
        print(f"  {line}", flush=True)


async def timed_decisions(decider: Any, bodies: Sequence[dict], images: Sequence[Sequence[Any]] = ()) -> list[float]:
    from app import build
    from app.config import Settings
    from app.decisions.request import parse_decision

    seconds = []
    for index, body in enumerate(bodies):
        started = time.perf_counter()
        await decider.decide(parse_decision(body, build.limits(Settings()), images=images[index] if images else ()))
        seconds.append(time.perf_counter() - started)
    return seconds


def turn_timeline(turns: list[tuple[float, float, int]], elapsed: float) -> dict[str, float]:
    """Where a closed loop's time went, from each engine turn's (start, end, canvases): the share of
    the time a turn was running, turn time and canvases, and the idle gap between one turn's end and
    the next one's start (clients turning round, the gather window)."""
    if not turns:
        return {}
    gaps = [nxt[0] - prev[1] for prev, nxt in zip(turns, turns[1:])]
    return {"turns": len(turns), "busy_share": round(sum(end - start for start, end, _ in turns) / elapsed, 3),
            "turn_ms": round(statistics.median(end - start for start, end, _ in turns) * 1000, 1),
            "gap_ms": round(statistics.median(gaps) * 1000, 1) if gaps else 0.0,
            "rows_min": min(rows for *_, rows in turns), "rows_max": max(rows for *_, rows in turns)}


async def closed_loop(decider: Any, reader: Any, clients: int, duration: float, seed: int) -> dict[str, Any]:
    from app import build
    from app.config import Settings
    from app.decisions.request import parse_decision

    latencies: list[float] = []
    deadline = time.perf_counter() + duration
    before = dict(reader.stats)
    turns: list[tuple[float, float, int]] = []
    step = reader._step
    own = reader.__dict__.get("_step")  # a step of its own (`--turnaround`'s), put back after

    def timed_step(jobs: list, dropped: list) -> Any:
        """The reader's engine turn (`HFReader._step`, on the engine thread), timed: its canvases."""
        started = time.perf_counter()
        report = step(jobs, dropped)
        turns.append((started, time.perf_counter(), report.canvas_parts))
        return report

    async def client(number: int) -> None:
        rng = random.Random(seed * 1000 + number)
        while time.perf_counter() < deadline:
            started = time.perf_counter()
            await decider.decide(parse_decision(ticket_request(rng), build.limits(Settings())))
            latencies.append(time.perf_counter() - started)

    started = time.perf_counter()
    reader._step = timed_step  # the engine loop looks it up on every turn
    try:
        with CollectorPauses() as pauses:
            await asyncio.gather(*(client(n) for n in range(clients)))
    finally:
        if own is None:
            del reader._step
        else:
            reader._step = own
    elapsed = time.perf_counter() - started
    delta = {key: value - before.get(key, 0) for key, value in reader.stats.items()}
    requests = len(latencies)
    passes = max(delta.get("decoder_passes", 0), 1)
    return {"clients": clients, "requests": requests, "req_per_s": requests / elapsed,
            "decisions_per_s": 3 * requests / elapsed, **latency_summary(latencies),
            "canvases_per_pass": delta.get("decoder_rows", 0) / passes,
            "encoder_passes_per_request": delta.get("encoder_passes", 0) / max(requests, 1),
            # What the KV store's shared blocks left to write: the prompt tokens the turns wrote a request.
            "prompt_tokens_per_request": delta.get("flat_prompt_tokens", 0) / max(requests, 1),
            "timeline": {**turn_timeline(turns, elapsed), **pauses.summary()}}


def stat_delta(reader: Any, before: dict, name: str) -> float:
    return reader.stats.get(name, 0) - before.get(name, 0)


async def level(decider: Any, reader: Any, args: argparse.Namespace, clients: int, seeds: tuple[int, int],
                label: str = "", warmup_s: float = 2.0) -> dict[str, Any]:
    """One closed-loop level: a warm-up of up to `warmup_s` (the first seed), then `--seconds`
    measured (the second); its point, printed after `label`."""
    await closed_loop(decider, reader, clients, min(warmup_s, args.seconds), seed=seeds[0])
    point = await closed_loop(decider, reader, clients, args.seconds, seed=seeds[1])
    print(f"  {label}{clients} clients: {point['req_per_s']:.2f} req/s, p50 {point['p50_ms']:.0f} ms, "
          f"p95 {point['p95_ms']:.0f} ms, {point['canvases_per_pass']:.1f} canvases a turn; "
          f"turns {point['timeline']}", flush=True)
    return point


async def sweep(decider: Any, reader: Any, args: argparse.Namespace, owner: Any, field: str, name: str,
                values: Sequence[Any], levels: Sequence[int], label: str, seed: int) -> list[dict[str, Any]]:
    """A closed-loop level at each of `levels` clients for each of `values`, each value set as the
    field `name` of the settings dataclass `owner.<field>` (the level's label: `label` formatted with
    the value); each point carries its value under `name`. The settings are put back after."""
    import dataclasses

    configured = getattr(owner, field)
    points: list[dict[str, Any]] = []
    try:
        for value in values:
            setattr(owner, field, dataclasses.replace(configured, **{name: value}))
            for clients in levels:
                point = await level(decider, reader, args, clients, (clients + seed, clients + seed + 1000),
                                    label.format(value))
                points.append({name: value, **point})
    finally:
        setattr(owner, field, configured)
    return points


async def gather_sweep(decider: Any, reader: Any, args: argparse.Namespace) -> list[dict[str, Any]]:
    """The batching loop's gather window (BATCH_GATHER_MS) chosen by measurement: the closed loop at
    `--gather-levels` clients for each window of `--gather-ms` (the reader's options)."""
    return await sweep(decider, reader, args, reader, "options", "gather_ms", args.gather_ms, args.gather_levels,
                       "gather {:g} ms, ", 2000)


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from app import build
    from app.decisions.run import Decider
    from app.engine.base import ImageInput
    from app.engine.hf.reader import settle_heap

    started = time.perf_counter()
    model, hf_tokenizer, processor = random_weights(args)
    build_s = time.perf_counter() - started
    results: dict[str, Any] = {"parameters": sum(p.numel() for p in model.parameters()), "build_s": round(build_s, 1)}
    on_cuda = args.device.startswith("cuda")
    if args.naive and on_cuda:
        print("naive transformers baseline (same model, same process) ...", flush=True)
        results["naive"] = measure_naive(model, batches=(1, 8, 32), prompt_tokens=300, reps=args.reps)
        if args.grids:
            results["naive_prompts"] = {}
            for n in [n for n in args.grid_prompts if n != 300]:
                try:
                    results["naive_prompts"][n] = measure_naive(model, batches=(1,), prompt_tokens=n, static_batches=(),
                                                                warmup=1, reps=3)["full_read_eager"].get(1)
                except Exception as exc:  # noqa: BLE001 - e.g. out of memory at 32k: reported, not fatal
                    print(f"  naive prompt {n}: failed: {exc!r}"[:300], flush=True)
                    torch.cuda.empty_cache()
    # After the naive baseline (the library's plain path): the reader `djev serve` builds, which fuses
    # the experts, compiles the layers, warms up and captures its graphs on this model. The baseline's
    # memory goes back to the device first: the reader sizes its KV store and graphs by the free memory.
    if on_cuda:
        import gc

        gc.collect()
        torch.cuda.empty_cache()
    print("building the reader as djev serve does (hf_reader) ...", flush=True)
    started = time.perf_counter()
    reader, settings = build_reader(args, model, hf_tokenizer, processor)
    results["reader_s"] = round(time.perf_counter() - started, 1)
    results["experts"], results["fused_moe"] = experts_of(model)
    results["settings"] = {"torch_compile": settings.hf.torch_compile, "fused_moe": settings.hf.fused_moe,
                           "cuda_graphs": settings.hf.cuda_graphs, "turn_tokens": reader.runner.flat.budget}
    print(f"  reader built in {results['reader_s']} s; experts: {results['experts'] or 'transformers default'}"
          f"{' (djev Triton kernels)' if results['fused_moe'] else ''}; turns of {results['settings']['turn_tokens']} "
          "tokens", flush=True)
    await reader.start()
    ready_report(reader, results)
    decider = Decider(reader, build.read_settings(settings))
    rng = random.Random(0)
    try:
        await timed_decisions(decider, [ticket_request(rng) for _ in range(args.warmup)])
        settle_heap()  # as load_hf_reader does once the model is loaded and warmed up
        results["unique"] = latency_summary(await timed_decisions(decider, [ticket_request(rng) for _ in range(args.reps)]))
        same = ticket_request(rng)
        await timed_decisions(decider, [same])
        results["cached"] = latency_summary(await timed_decisions(decider, [same] * args.reps))
        print(f"  one decision: {results['unique']['p50_ms']:.1f} ms new state, "
              f"{results['cached']['p50_ms']:.1f} ms same state", flush=True)

        results["curve"] = []
        for clients in args.levels:
            results["curve"].append(await level(decider, reader, args, clients, (clients + 1000, clients)))

        results["gather"] = await gather_sweep(decider, reader, args)

        pictures = [(ImageInput(data, "image/jpeg", f"frame {i}"),) for i, data in enumerate(frames(args.reps + 2))]
        clear = {"state": WALK_STATE, "samples": 1, "questions": {"ahead": AHEAD}}
        blocked = {"state": WALK_STATE, "samples": 1, "questions": {"ahead": AHEAD, "side": SIDE}}
        await timed_decisions(decider, [clear, blocked], pictures[:2])
        results["clear_frame"] = latency_summary(await timed_decisions(decider, [clear] * args.reps, pictures[2:]))
        fresh = [(ImageInput(data, "image/jpeg", f"frame {i}"),) for i, data in enumerate(frames(args.reps))]
        results["blocked_frame"] = latency_summary(await timed_decisions(decider, [blocked] * args.reps, fresh))
        print(f"  walk frame: clear {results['clear_frame']['p50_ms']:.1f} ms, "
              f"blocked {results['blocked_frame']['p50_ms']:.1f} ms", flush=True)

        results["think"] = []
        for think in args.think:
            await timed_decisions(decider, [{**ticket_request(rng), "think": think}])
            before = dict(reader.stats)
            seconds = await timed_decisions(decider, [{**ticket_request(rng), "think": think} for _ in range(args.think_reps)])
            passes = stat_delta(reader, before, "generation_passes") / args.think_reps
            summary = latency_summary(seconds)
            per_pass = (summary["p50_ms"] - results["unique"]["p50_ms"]) / passes if passes else float("nan")
            results["think"].append({"think": think, **summary, "passes": passes, "ms_per_pass": per_pass})
            print(f"  think {think}: {summary['p50_ms']:.0f} ms, {passes:.0f} passes, {per_pass:.1f} ms a pass",
                  flush=True)

        if args.grids:
            results["grids"] = await grids(decider, reader, args, rng)
        runner = reader.runner
        flat_graphs = runner.flat.forward.graphs
        results["cuda_graphs"] = None if flat_graphs is None else {  # the flat turn's pieces by token count
            "flat_captured": flat_graphs.captures, "flat_failed": len(flat_graphs.cache.failed),
            "flat_held": len(flat_graphs.cache), "flat_memory_gib": round(flat_graphs.memory / 2**30, 2),
            "vision_captured": getattr(runner.images.graphs, "captures", None)}
        print(f"  cuda graphs: {results['cuda_graphs']}", flush=True)
        results["stats"] = dict(reader.stats)
        if on_cuda:
            results["peak_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 1)
    finally:
        end_report(reader, results)
        await reader.stop()
    return results


async def grids(decider: Any, reader: Any, args: argparse.Namespace, rng: random.Random) -> dict:
    """How a decision's cost grows with questions, prompt length and images (new states unless warm)."""
    from app.engine.base import ImageInput

    reps = max(2, args.reps // 5)
    out: dict[str, list] = {"questions": [], "prompts": [], "images": []}
    for count in (1, 10, 50, 256):
        def make(count: int = count) -> dict:
            return ticket(f"ticket #{rng.randrange(10**9)}", noul_questions(count))

        await timed_decisions(decider, [make()])
        before = dict(reader.stats)
        summary = latency_summary(await timed_decisions(decider, [make() for _ in range(reps)]))
        out["questions"].append({"questions": count, **summary,
                                 "canvases": stat_delta(reader, before, "decoder_rows") / reps})
        print(f"  {count} questions: {summary['p50_ms']:.0f} ms", flush=True)
    for tokens in args.grid_prompts:
        def body(tokens: int = tokens) -> dict:
            return ticket(state_of(reader.tokenizer, tokens - 150, rng))

        try:
            await timed_decisions(decider, [body()])
            before = dict(reader.stats)
            cold = latency_summary(await timed_decisions(decider, [body() for _ in range(reps)]))
            cold["turns"] = stat_delta(reader, before, "flat_turns") / reps
            cold["eager_turns"] = stat_delta(reader, before, "flat_graph_fallbacks") / reps  # no bucket held
            same = body()
            await timed_decisions(decider, [same])
            warm = latency_summary(await timed_decisions(decider, [same] * reps))
        except Exception as exc:  # noqa: BLE001 - one size that fails (memory) is reported, the rest still run
            print(f"  prompt {tokens}: failed: {exc!r}"[:300], flush=True)
            continue
        out["prompts"].append({"tokens": tokens, "cold": cold, "warm": warm})
        print(f"  prompt {tokens}: cold {cold['p50_ms']:.0f} ms, warm {warm['p50_ms']:.0f} ms", flush=True)
    for count in (1, 4, 8):
        shots = frames(count * (reps + 1))
        sets = [tuple(ImageInput(data, "image/jpeg", f"image {i}") for i, data in enumerate(shots[n * count:(n + 1) * count]))
                for n in range(reps + 1)]
        walk = {"state": WALK_STATE, "samples": 1, "questions": {"ahead": AHEAD}}
        await timed_decisions(decider, [walk], sets[:1])
        summary = latency_summary(await timed_decisions(decider, [walk] * reps, sets[1:]))
        out["images"].append({"images": count, **summary})
        print(f"  {count} images: {summary['p50_ms']:.0f} ms", flush=True)
    return out


def report(results: dict[str, Any], args: argparse.Namespace) -> str:
    naive = results.get("naive") or {}
    eager = naive.get("full_read_eager", {})
    static = naive.get("full_read_static_graph", {})
    decoder = naive.get("decoder_pass_graph", {})
    nan = float("nan")

    def row(name: str, summary: dict, first: float | None, second: float | None) -> list:
        return [name, fmt(summary["p50_ms"], 1), fmt(summary["p95_ms"], 1), ratio(summary["p50_ms"], first),
                ratio(summary["p50_ms"], second)]

    single = [row("new state each time (prompt encoded)", results["unique"], eager.get(1), static.get(1)),
              row("same state each time (prompt KV cached)", results["cached"], eager.get(1), decoder.get(1)),
              row("walk frame, clear (1 image read)", results["clear_frame"], eager.get(1), static.get(1)),
              row("walk frame, blocked (2 image reads)", results["blocked_frame"], eager.get(1), static.get(1))]
    single += [row(f"think {t['think']}: {t['passes']:.0f} passes, {t['ms_per_pass']:.1f} ms a pass "
                   f"({ratio(t['ms_per_pass'], decoder.get(1))} a naive graphed decoder pass)", t, eager.get(1),
                   static.get(1)) for t in results["think"]]
    curve = []
    for p in results["curve"]:
        batch = min(p["clients"], 32)
        naive_rate = batch / eager[batch] * 1000 if batch in eager else nan
        curve.append([p["clients"], p["requests"], fmt(p["req_per_s"], 2), fmt(p["p50_ms"], 0), fmt(p["p95_ms"], 0),
                      fmt(p["canvases_per_pass"], 1), fmt(naive_rate, 1),
                      "-" if naive_rate != naive_rate else f"{p['req_per_s'] / naive_rate:.2f}x"])
    lines = [
        f"{results['parameters'] / 1e9:.2f} B parameters, built in {results['build_s']} s, the reader (hf_reader) in "
        f"{results.get('reader_s')} s; medians of {args.reps} after {args.warmup} warm-ups; {args.seconds:g} s per "
        f"concurrency level; peak GPU memory {results.get('peak_memory_gib')} GiB; graphs: {results.get('cuda_graphs')}.",
        "",
    ]
    if results.get("compile_counts_at_ready"):
        lines += [compile_counts_line(results["compile_counts_at_ready"], "at ready"), ""]
    if results.get("after_ready"):
        lines += after_ready_lines(results["after_ready"], "at the end") + [""]
    if naive:
        lines += ["naive transformers, same model, same process (median ms; prompt 300, canvas 32, every row its own prompt):",
                  "", markdown_table(
                      ["batch", "full read eager", "full read StaticCache + 1 CUDA graph", "decoder pass eager",
                       "decoder pass CUDA graph"],
                      [[b, fmt(eager.get(b, nan), 1), fmt(static.get(b, nan), 1),
                        fmt(naive.get("decoder_pass_eager", {}).get(b, nan), 1), fmt(decoder.get(b, nan), 1)]
                       for b in (1, 8, 32)]), ""]
    lines += [
        markdown_table(["one decision (samples 1)", "p50 ms", "p95 ms", "/ naive full read eager b1",
                        "/ naive StaticCache graph b1 (same state: / naive decoder graph b1)"], single),
        "",
        markdown_table(["clients", "requests", "req/s", "p50 ms", "p95 ms", "canvases per turn",
                        "naive reads/s (one eager batch of min(clients, 32))", "engine / naive"], curve),
        "",
        "engine turns at each level (busy: share of the time a turn ran; gap: median idle time between "
        "turns; medians; prompt tokens: what the turns wrote a request, the shared blocks aside):",
        "",
        markdown_table(["clients", "turns", "busy", "turn ms", "gap ms", "canvases min-max", "prompt tokens/request"],
                       [[p["clients"], t.get("turns"), t.get("busy_share"), t.get("turn_ms"), t.get("gap_ms"),
                         f"{t.get('rows_min')}-{t.get('rows_max')}", fmt(p["prompt_tokens_per_request"], 0)]
                        for p in results["curve"] for t in [p.get("timeline") or {}]]),
    ]
    if results.get("gather"):
        lines += ["", markdown_table(["gather ms (BATCH_GATHER_MS)", "clients", "req/s", "p50 ms", "p95 ms",
                                      "canvases per turn"],
                                     [[fmt(p["gather_ms"], 0), p["clients"], fmt(p["req_per_s"], 2), fmt(p["p50_ms"], 0),
                                       fmt(p["p95_ms"], 0), fmt(p["canvases_per_pass"], 1)] for p in results["gather"]])]
    grid = results.get("grids")
    if grid:
        naive_prompts = {300: eager.get(1), **(results.get("naive_prompts") or {})}
        lines += ["", markdown_table(["questions", "p50 ms", "p95 ms", "canvases per decision"],
                                     [[q["questions"], fmt(q["p50_ms"], 1), fmt(q["p95_ms"], 1), fmt(q["canvases"], 1)]
                                      for q in grid["questions"]]),
                  "", markdown_table(["prompt tokens", "cold p50 ms", "warm p50 ms", "turns (cold)",
                                      "eager turns (cold)", "naive full read eager b1 ms", "cold / naive"],
                                     [[p["tokens"], fmt(p["cold"]["p50_ms"], 1), fmt(p["warm"]["p50_ms"], 1),
                                       fmt(p["cold"]["turns"], 1), fmt(p["cold"]["eager_turns"], 1),
                                       fmt(naive_prompts.get(p["tokens"]) or nan, 1),
                                       ratio(p["cold"]["p50_ms"], naive_prompts.get(p["tokens"]))]
                                      for p in grid["prompts"]]),
                  "", markdown_table(["images", "p50 ms", "p95 ms"],
                                     [[i["images"], fmt(i["p50_ms"], 1), fmt(i["p95_ms"], 1)] for i in grid["images"]])]
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="the tiny config (a CPU smoke test of this script)")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    parser.add_argument("--seconds", type=float, default=12.0, help="seconds per concurrency level (default 12)")
    parser.add_argument("--levels", type=numbers(int), default="1,8,16,32,64", help="client counts (default 1,8,16,32,64)")
    parser.add_argument("--think", type=numbers(int), default="16,64", help="think budgets to time (default 16,64; empty: none)")
    parser.add_argument("--think-reps", type=int, default=3)
    parser.add_argument("--no-naive", dest="naive", action="store_false", help="skip the naive baseline")
    parser.add_argument("--no-grids", dest="grids", action="store_false", help="skip the cost-growth grids (E)")
    parser.add_argument("--grid-prompts", type=numbers(int), default="300,2000,8000,32000",
                        help="prompt sizes of grid (E), in tokens")
    parser.add_argument("--eager", action="store_true", help="turns without CUDA graphs (CUDA_GRAPHS=0)")
    parser.add_argument("--gather-ms", type=numbers(float), default="",
                        help="gather windows to sweep, ms, e.g. 0,2,5,10,20 (default: none)")
    parser.add_argument("--gather-levels", type=numbers(int), default="8,32",
                        help="client counts of the gather sweep (default 8,32)")
    parser.add_argument("--compile", action="store_true", help="compile the layer bodies (TORCH_COMPILE=1)")
    parser.add_argument("--fused-moe", action="store_true", help="the experts as djev's Triton kernels (FUSED_MOE=1)")
    parser.add_argument("--turnaround", action="store_true",
                        help="only the closed loop at --levels over an engine that answers at once: the decisions' "
                             "own work per decision (use with --tiny on a CPU)")
    parser.add_argument("--vision-attention", choices=sorted(VISION_KERNELS), default="cudnn",
                        help="the vision tower's first attention kernel (default cudnn, as served)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--out", default=None, help="JSON file (default: $OUT/bench_gpu_decisions.json when $OUT is set)")
    args = parser.parse_args(argv)
    settle_device_and_out(parser, args, "bench_gpu_decisions.json")
    return args


def instant_step(jobs: Sequence[Any], dropped: Sequence[Any]) -> Any:
    """An engine turn that answers every read at once (each slot's labels at fixed logprobs), in
    `HFReader._step`'s place: a closed loop over it measures only the decisions' own work around the
    engine (`--turnaround`). Its reads are the ticket's: no generation reaches it."""
    from app.engine.base import ReadResult, SlotRead
    from app.engine.hf.engine import TurnReport
    from app.engine.hf.reads import ReadProgram

    for job in jobs:
        program = job.work
        assert isinstance(program, ReadProgram), "--turnaround decides tickets: reads only"
        program.results = [
            ReadResult(slots=tuple(tuple(SlotRead(tuple(-1.0 - 0.1 * i for i in range(len(labels))), labels[0])
                                         for labels in spec.label_ids) for _ in spec.canvases),
                       prompt_tokens=len(spec.prompt.ids)) for spec in program.specs]
    return TurnReport(list(jobs), 0, 0, sum(job.rows for job in jobs))


async def turnaround(args: argparse.Namespace) -> dict[str, Any]:
    """The closed loop at each level over `instant_step`: decisions a second, and the time one
    decision's own work takes on the event loop (what an engine turn waits for between cycles)."""
    from app import build
    from app.decisions.run import Decider

    reader, settings = build_reader(args, *random_weights(args))
    reader._step = instant_step  # the engine loop looks it up on every turn
    await reader.start()
    points = []
    try:
        decider = Decider(reader, build.read_settings(settings))
        for clients in args.levels:
            point = await level(decider, reader, args, clients, (clients + 1000, clients), "instant engine, ",
                                warmup_s=1.0)
            point["ms_a_decision"] = 1000 / point["req_per_s"]
            points.append(point)
            print(f"    {point['ms_a_decision']:.3f} ms of the decision's own work each (Decider.decide calls)",
                  flush=True)
    finally:
        await reader.stop()
    return {"turnaround": points}


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    info = machine()
    if args.turnaround:
        print(header("bench_gpu_decisions --turnaround: the decisions' own work, over an engine that answers at once",
                      info))
        results = asyncio.run(turnaround(args))
        if args.out:
            print(f"results: {write_json(args.out, {'machine': info, **results})}")
        return
    print(f"building the {'tiny' if args.tiny else 'full-size'} model on {args.device} ...", flush=True)
    results = asyncio.run(measure(args))
    print()
    mode = ("eager turns" if args.eager else "turns as CUDA graphs") + f", vision attention {args.vision_attention} first"
    print(header(f"bench_gpu_decisions: whole decisions through Decider + HFReader ({mode})", info))
    print()
    print(report(results, args))
    if args.out:
        data = {"machine": info, "vision_attention": args.vision_attention, **results}
        print(f"results: {write_json(args.out, data)}")


if __name__ == "__main__":
    main()
