"""Whole decisions on the full-size DiffusionGemma 26B-A4B architecture (random bf16 weights), through
the code `djev serve` runs minus HTTP: parse_decision -> Decider -> HFReader's batching loop ->
DiffusionRunner, with the naive transformers baseline (bench/naive.py) measured first on the same
model in the same process, and every engine figure printed beside its naive figure as a ratio.

The reader is the one `djev serve` builds (`app.engine.hf.loader.hf_reader`: the experts fused, the
layers compiled, the warm-ups, the graphs captured, the heap settled), made over the model only after
the naive baseline has run on it, with this script's flags as Settings (--compile TORCH_COMPILE,
--fused-moe FUSED_MOE, --eager CUDA_GRAPHS=0, --flat-turn/--no-flat-turn FLAT_TURN, --device). Right
after ready it prints what the start-up built (`compile_counts`), and at the end the reader's
after-ready counters, which must be 0 (a WARNING line names any that is not; both in the JSON).

The tokenizer is the tiny model's (the real one needs the checkpoint); the full config's image ids are
set to that tokenizer's, and prompts come out a little longer than Gemma's tokenizer would make them.
HTTP adds a few ms a request on top (bench_cpu.py measures that layer).

Cases:
  (A) one decision, the README's ticket (noul, 3-way choice, 3-level score), samples 1: a new state
      every time (prompt encoded) and the same state every time (prompt KV cached);
  (B) closed-loop clients (--levels, default 1, 8, 16, 32, 64), each deciding unique-state tickets
      back to back for --seconds: req/s, p50, p95, canvases per decoder pass;
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
import os
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
    device_sync,
    fmt,
    header,
    latency_summary,
    machine,
    markdown_table,
    named_compile_counts,
    numbers,
    timed_call,
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
    FUSED_MOE (--fused-moe), CUDA_GRAPHS (off with --eager), FLAT_TURN (--flat-turn / --no-flat-turn;
    neither: the server's default); the rest are the server's defaults."""
    from app.config import Settings

    values: dict[str, Any] = {"device": args.device, "torch_compile": args.compile, "fused_moe": args.fused_moe,
                              "cuda_graphs": not args.eager}
    if args.flat_turn is not None:
        values["flat_turn"] = args.flat_turn
    return Settings.of(**values)


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


def batch_timeline(batches: list[tuple[float, float, int]], elapsed: float) -> dict[str, float]:
    """Where a closed loop's time went, from each read batch's (start, end, rows): the share of the
    time a batch was running, batch time and rows, and the idle gap between one batch's end and the
    next one's start (clients turning round, the gather window)."""
    if not batches:
        return {}
    gaps = [nxt[0] - prev[1] for prev, nxt in zip(batches, batches[1:])]
    return {"batches": len(batches), "busy_share": round(sum(end - start for start, end, _ in batches) / elapsed, 3),
            "batch_ms": round(statistics.median(end - start for start, end, _ in batches) * 1000, 1),
            "gap_ms": round(statistics.median(gaps) * 1000, 1) if gaps else 0.0,
            "rows_min": min(rows for *_, rows in batches), "rows_max": max(rows for *_, rows in batches)}


async def closed_loop(decider: Any, reader: Any, clients: int, duration: float, seed: int) -> dict[str, Any]:
    from app import build
    from app.config import Settings
    from app.decisions.request import parse_decision

    latencies: list[float] = []
    deadline = time.perf_counter() + duration
    before = dict(reader.stats)
    batches: list[tuple[float, float, int]] = []
    read_batch = reader._read_batch

    async def timed_batch(loop: Any, batch: list) -> None:
        started = time.perf_counter()
        try:
            await read_batch(loop, batch)
        finally:
            batches.append((started, time.perf_counter(), sum(job.rows for job in batch)))

    async def client(number: int) -> None:
        rng = random.Random(seed * 1000 + number)
        while time.perf_counter() < deadline:
            started = time.perf_counter()
            await decider.decide(parse_decision(ticket_request(rng), build.limits(Settings())))
            latencies.append(time.perf_counter() - started)

    started = time.perf_counter()
    reader._read_batch = timed_batch  # the engine loop looks it up on every batch
    try:
        with CollectorPauses() as pauses:
            await asyncio.gather(*(client(n) for n in range(clients)))
    finally:
        del reader._read_batch
    elapsed = time.perf_counter() - started
    delta = {key: value - before.get(key, 0) for key, value in reader.stats.items()}
    requests = len(latencies)
    passes = max(delta.get("decoder_passes", 0), 1)
    return {"clients": clients, "requests": requests, "req_per_s": requests / elapsed,
            "decisions_per_s": 3 * requests / elapsed, **latency_summary(latencies),
            "canvases_per_pass": delta.get("decoder_rows", 0) / passes,
            "encoder_passes_per_request": delta.get("encoder_passes", 0) / max(requests, 1),
            "over_a_prefix_share": delta.get("prefix_hits", 0) / max(delta.get("kv_misses", 0), 1),
            "timeline": {**batch_timeline(batches, elapsed), **pauses.summary()}}


def breakdown(runner: Any, tokenizer: Any, args: argparse.Namespace) -> dict[str, float]:
    """Where a new walk frame's read and a think denoise pass spend their time: each stage timed
    alone (CUDA synchronized), medians over fresh frames. Runs while the reader is idle."""
    import statistics

    import torch

    from app.engine.base import GenerateSpec, ImageInput, Prompt
    from app.engine.hf.prompts import EncodedPrompt

    sync = device_sync(args.device)
    stages: dict[str, list[float]] = {}

    def timed(name: str, call: Any) -> Any:
        out, seconds = timed_call(call, sync)
        stages.setdefault(name, []).append(seconds * 1000)
        return out

    ids = tuple(tokenizer.render_chat("Answer.", "What is ahead?", 1, False))
    canvas = list(tokenizer.encode("ahead: all clear")) + [tokenizer.turn_close_id]
    canvas += [tokenizer.pad_id] * (32 - len(canvas))
    with torch.no_grad():
        for data in frames(args.reps + 2):
            prompt = Prompt(ids, (ImageInput(data, "image/jpeg", "frame"),))
            inputs = timed("frame: image decode + processor (CPU) + upload", lambda: runner.model_inputs(prompt))
            embeds = timed("frame: vision tower + embeddings (graph where one is held)", lambda: runner.input_embeds(inputs))
            layers = timed("frame: encoder pass (graph) + KV copy-out", lambda: runner._encode_embeds([embeds]))
            encoded = EncodedPrompt(layers[0], int(embeds.shape[0]))
            timed("frame: decoder pass (graph) + slot logits",
                  lambda: runner.logits(runner.decoder_hidden([(encoded, canvas)])[0, :4]).cpu())
        text = Prompt(tuple(tokenizer.render_chat("Think.", "a ticket", 0, True)))
        gen = runner.start_generation(GenerateSpec(text, 64, (), seed=1), 64)
        conditioning = None
        for _ in range(min(args.reps + 2, 40)):
            block = gen.block
            if block is not None and block.conditioning is not None:
                conditioning = block.conditioning
                context = EncodedPrompt([(layer.keys, layer.values) for layer in gen.cache.layers], gen.length)
                row = [(context, block.canvas[0].tolist())]
                timed("think pass: decoder graph replay alone (width 64, self-conditioned)",
                      lambda: (runner.graphs.hidden(row, conditioning) if runner.graphs
                               else runner.decoder_hidden(row, conditioning)))
            timed("think pass: whole step_generation (width 64)", lambda: runner.step_generation(gen))
    return {name: round(statistics.median(values[2:] or values), 1) for name, values in stages.items()}


def stat_delta(reader: Any, before: dict, name: str) -> float:
    return reader.stats.get(name, 0) - before.get(name, 0)


async def level(decider: Any, reader: Any, args: argparse.Namespace, clients: int, seeds: tuple[int, int],
                label: str = "", warmup_s: float = 2.0) -> dict[str, Any]:
    """One closed-loop level: a warm-up of up to `warmup_s` (the first seed), then `--seconds`
    measured (the second); its point, printed after `label`."""
    await closed_loop(decider, reader, clients, min(warmup_s, args.seconds), seed=seeds[0])
    point = await closed_loop(decider, reader, clients, args.seconds, seed=seeds[1])
    print(f"  {label}{clients} clients: {point['req_per_s']:.2f} req/s, p50 {point['p50_ms']:.0f} ms, "
          f"p95 {point['p95_ms']:.0f} ms, {point['canvases_per_pass']:.1f} canvases a pass; "
          f"batches {point['timeline']}", flush=True)
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


async def eager_tokens_sweep(decider: Any, reader: Any, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Where the encoder's large passes stop being graphed (EAGER_TOKENS in app/engine/hf/graphs/shapes.py)
    chosen by measurement: the closed loop at `--eager-levels` clients for each threshold of
    `--eager-tokens` (the encoder graphs' shape policy)."""
    graphs = reader.runner.encoder_graphs
    if graphs is None:
        return []
    return await sweep(decider, reader, args, graphs, "policy", "eager_tokens", args.eager_tokens, args.eager_levels,
                       "encoder graphs below {} tokens, ", 6000)


async def unshared(decider: Any, reader: Any, args: argparse.Namespace, rng: random.Random) -> dict[str, Any]:
    """The same decisions with every prompt encoded whole (no shared prefix: the prefix LRU off), for
    the ratio: one new-state decision and the closed loop at `--unshared-levels`."""
    from app.engine.hf.prompts import PromptCache

    if not args.unshared_levels:
        return {}
    runner = reader.runner
    prefixes = runner.prefixes
    runner.prefixes = PromptCache(0)
    try:
        await timed_decisions(decider, [ticket_request(rng) for _ in range(2)])
        result: dict[str, Any] = {"unique": latency_summary(await timed_decisions(
            decider, [ticket_request(rng) for _ in range(args.reps)])), "curve": []}
        print(f"  no shared prefixes: one decision {result['unique']['p50_ms']:.1f} ms new state", flush=True)
        for clients in args.unshared_levels:
            result["curve"].append(await level(decider, reader, args, clients, (clients + 4000, clients + 5000),
                                               "no shared prefixes, "))
    finally:
        runner.prefixes = prefixes
    return result


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
    results["flat_turn"] = reader.runner.flat is not None
    results["experts"], results["fused_moe"] = experts_of(model)
    results["settings"] = {"flat_turn": settings.hf.flat_turn, "torch_compile": settings.hf.torch_compile,
                           "fused_moe": settings.hf.fused_moe, "cuda_graphs": settings.hf.cuda_graphs}
    print(f"  reader built in {results['reader_s']} s; experts: {results['experts'] or 'transformers default'}"
          f"{' (djev Triton kernels)' if results['fused_moe'] else ''}; "
          f"{'the flat turn' if results['flat_turn'] else 'the row path'}", flush=True)
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
        results["unshared"] = await unshared(decider, reader, args, rng)
        results["eager_tokens"] = await eager_tokens_sweep(decider, reader, args)

        pictures = [(ImageInput(data, "image/jpeg", f"frame {i}"),) for i, data in enumerate(frames(args.reps + 2))]
        clear = {"state": WALK_STATE, "samples": 1, "questions": {"ahead": AHEAD}}
        blocked = {"state": WALK_STATE, "samples": 1, "questions": {"ahead": AHEAD, "side": SIDE}}
        await timed_decisions(decider, [clear, blocked], pictures[:2])
        results["clear_frame"] = latency_summary(await timed_decisions(decider, [clear] * args.reps, pictures[2:]))
        fresh = [(ImageInput(data, "image/jpeg", f"frame {i}"),) for i, data in enumerate(frames(args.reps))]
        results["blocked_frame"] = latency_summary(await timed_decisions(decider, [blocked] * args.reps, fresh))
        if reader.runner.flat is None:  # the row path's passes one by one (the flat turn has one forward)
            results["breakdown"] = breakdown(reader.runner, reader.tokenizer, args)
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
        graphs, encoder_graphs = runner.graphs, runner.encoder_graphs
        results["cuda_graphs"] = None if graphs is None else {
            "decoder_captured": graphs.captures, "decoder_failed": len(graphs.cache.failed),
            "decoder_held": len(graphs.cache), "decoder_memory_gib": round(graphs.memory_bytes / 2**30, 2),
            "encoder_captured": encoder_graphs.captures, "encoder_failed": len(encoder_graphs.cache.failed),
            "encoder_held": len(encoder_graphs.cache),
            "encoder_memory_gib": round(encoder_graphs.memory_bytes / 2**30, 2),
            "vision_captured": getattr(runner.vision_graphs, "captures", None)}
        flat_graphs = runner.flat.forward.graphs if runner.flat is not None else None
        if flat_graphs is not None:  # the flat turn's graphs by token count
            results["cuda_graphs"] = {"flat_captured": flat_graphs.captures, "flat_failed": len(flat_graphs.cache.failed),
                                      "flat_held": len(flat_graphs.cache),
                                      "vision_captured": getattr(runner.vision_graphs, "captures", None)}
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
            cold["eager_encoder_passes"] = (stat_delta(reader, before, "encoder_passes")
                                            - stat_delta(reader, before, "encoder_graph_replays")) / reps
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
    if results.get("breakdown"):
        lines += ["where the time goes (medians, each stage alone, CUDA synchronized):", "",
                  markdown_table(["stage", "ms"], [[name, fmt(ms, 1)] for name, ms in results["breakdown"].items()]), ""]
    lines += [
        markdown_table(["one decision (samples 1)", "p50 ms", "p95 ms", "/ naive full read eager b1",
                        "/ naive StaticCache graph b1 (same state: / naive decoder graph b1)"], single),
        "",
        markdown_table(["clients", "requests", "req/s", "p50 ms", "p95 ms", "canvases per decoder pass",
                        "naive reads/s (one eager batch of min(clients, 32))", "engine / naive"], curve),
        "",
        "read batches at each level (busy: share of the time a batch ran; gap: median idle time between "
        "batches; medians):",
        "",
        markdown_table(["clients", "batches", "busy", "batch ms", "gap ms", "rows min-max"],
                       [[p["clients"], t.get("batches"), t.get("busy_share"), t.get("batch_ms"), t.get("gap_ms"),
                         f"{t.get('rows_min')}-{t.get('rows_max')}"]
                        for p in results["curve"] for t in [p.get("timeline") or {}]]),
    ]
    if results.get("unshared"):
        by_clients = {p["clients"]: p for p in results["curve"]}
        rows = [["one decision, new state (p50 ms)", fmt(results["unshared"]["unique"]["p50_ms"], 1),
                 fmt(results["unique"]["p50_ms"], 1),
                 ratio(results["unique"]["p50_ms"], results["unshared"]["unique"]["p50_ms"])]]
        for p in results["unshared"]["curve"]:
            shared = by_clients.get(p["clients"])
            rows.append([f"{p['clients']} clients (req/s; p95 ms)",
                         f"{fmt(p['req_per_s'], 2)}; {fmt(p['p95_ms'], 0)}",
                         "-" if shared is None else f"{fmt(shared['req_per_s'], 2)}; {fmt(shared['p95_ms'], 0)}",
                         "-" if shared is None else f"{shared['req_per_s'] / p['req_per_s']:.2f}x req/s"])
        lines += ["", "prompts encoded whole vs over their question sheet's shared prefix (the prefix LRU on, the "
                  "server's default; the tickets share a sheet):", "",
                  markdown_table(["figure", "every prompt whole", "over the shared prefix", "ratio"], rows)]
    if results.get("eager_tokens"):
        lines += ["", markdown_table(["encoder graphs below (tokens)", "clients", "req/s", "p50 ms", "p95 ms",
                                      "batch ms", "gap ms"],
                                     [[p["eager_tokens"], p["clients"], fmt(p["req_per_s"], 2), fmt(p["p50_ms"], 0),
                                       fmt(p["p95_ms"], 0), t.get("batch_ms"), t.get("gap_ms")]
                                      for p in results["eager_tokens"] for t in [p.get("timeline") or {}]])]
    if results.get("gather"):
        lines += ["", markdown_table(["gather ms (BATCH_GATHER_MS)", "clients", "req/s", "p50 ms", "p95 ms",
                                      "canvases per decoder pass"],
                                     [[fmt(p["gather_ms"], 0), p["clients"], fmt(p["req_per_s"], 2), fmt(p["p50_ms"], 0),
                                       fmt(p["p95_ms"], 0), fmt(p["canvases_per_pass"], 1)] for p in results["gather"]])]
    grid = results.get("grids")
    if grid:
        naive_prompts = {300: eager.get(1), **(results.get("naive_prompts") or {})}
        lines += ["", markdown_table(["questions", "p50 ms", "p95 ms", "canvases per decision"],
                                     [[q["questions"], fmt(q["p50_ms"], 1), fmt(q["p95_ms"], 1), fmt(q["canvases"], 1)]
                                      for q in grid["questions"]]),
                  "", markdown_table(["prompt tokens", "cold p50 ms", "warm p50 ms", "eager encoder passes (cold)",
                                      "naive full read eager b1 ms", "cold / naive"],
                                     [[p["tokens"], fmt(p["cold"]["p50_ms"], 1), fmt(p["warm"]["p50_ms"], 1),
                                       fmt(p["cold"]["eager_encoder_passes"], 1),
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
    parser.add_argument("--eager", action="store_true", help="decoder passes without CUDA graphs (CUDA_GRAPHS=0)")
    parser.add_argument("--gather-ms", type=numbers(float), default="",
                        help="gather windows to sweep, ms, e.g. 0,2,5,10,20 (default: none)")
    parser.add_argument("--gather-levels", type=numbers(int), default="8,32",
                        help="client counts of the gather sweep (default 8,32)")
    parser.add_argument("--unshared-levels", type=numbers(int), default="",
                        help="client counts to run again with every prompt encoded whole, no shared prefix "
                             "(e.g. 32; default: none)")
    parser.add_argument("--eager-tokens", type=numbers(int), default="",
                        help="encoder graph thresholds (rows x length) to sweep, e.g. 4096,8192 (default: none)")
    parser.add_argument("--eager-levels", type=numbers(int), default="32",
                        help="client counts of the threshold sweep (default 32)")
    parser.add_argument("--compile", action="store_true", help="compile the layer bodies (TORCH_COMPILE=1)")
    parser.add_argument("--flat-turn", action=argparse.BooleanOptionalAction, default=None,
                        help="the hf engine's flat turn (FLAT_TURN=1): one forward a turn, its graphs by token count; "
                             "--no-flat-turn the row path (FLAT_TURN=0); neither: the server's default")
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
    import torch

    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if not args.tiny and not args.device.startswith("cuda"):
        parser.error("the full-size model needs a GPU; use --tiny to check the script on a CPU")
    if args.out is None and os.environ.get("OUT"):
        args.out = str(Path(os.environ["OUT"]) / "bench_gpu_decisions.json")
    return args


class InstantRunner:
    """A runner that answers every read at once (each slot's labels at fixed logprobs): a closed loop
    over it measures only the decisions' own work around the engine (`--turnaround`)."""

    def __init__(self, real: Any) -> None:
        self.real = real

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)

    def read(self, specs: Sequence[Any], preprocessed: Any = None) -> list[Any]:
        from app.engine.base import ReadResult, SlotRead

        return [ReadResult(slots=tuple(tuple(SlotRead(tuple(-1.0 - 0.1 * i for i in range(len(labels))), labels[0])
                                             for labels in spec.label_ids) for _ in spec.canvases),
                           prompt_tokens=len(spec.prompt.ids)) for spec in specs]


async def turnaround(args: argparse.Namespace) -> dict[str, Any]:
    """The closed loop at each level over InstantRunner: decisions a second, and the time one
    decision's own work takes on the event loop (what a read batch waits for between cycles)."""
    from app import build
    from app.decisions.run import Decider

    reader, settings = build_reader(args, *random_weights(args))
    reader.runner = InstantRunner(reader.runner)
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
    mode = ("eager decoder passes" if args.eager else "CUDA-graph decoder passes") + \
        f", vision attention {args.vision_attention} first" + (", the flat turn" if results.get("flat_turn") else "")
    print(header(f"bench_gpu_decisions: whole decisions through Decider + HFReader ({mode})", info))
    print()
    print(report(results, args))
    if args.out:
        data = {"machine": info, "vision_attention": args.vision_attention, **results}
        print(f"results: {write_json(args.out, data)}")


if __name__ == "__main__":
    main()
