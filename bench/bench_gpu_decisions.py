"""Whole decisions on the full-size DiffusionGemma 26B-A4B architecture (random bf16 weights), through
the code `djev serve` runs minus HTTP: parse_decision -> Decider -> HFReader's batching loop ->
DiffusionRunner. This is the number to set beside the reference system's table (its "structured
server, samples=1" and its concurrency curve), and the walk page's per-frame cost with a real-size
vision tower.

The tokenizer is the tiny model's (the real one needs the checkpoint); the full config's image ids are
set to that tokenizer's, and prompts come out a little longer than Gemma's tokenizer would make them.
HTTP adds about 6-8 ms a request on top (bench_cpu.py measures that layer).

Cases:
  (A) one decision, the README's ticket (noul, 3-way choice, 3-level score), samples 1: a new state
      every time (prompt encoded) and the same state every time (prompt KV cached);
  (B) closed-loop clients (1, 8, 32), each deciding unique-state tickets back to back for --seconds:
      req/s, decisions/s (3 per request), p50, p95, and how many canvases shared each decoder pass;
  (C) the walk page's frame (512x384 JPEG, ahead question): a clear frame (one image read) and a
      blocked frame (ahead, then side restated: two image reads).

    python bench/bench_gpu_decisions.py                 # full size on CUDA; JSON to $OUT/bench_gpu_decisions.json
    python bench/bench_gpu_decisions.py --tiny --device cpu --seconds 2   # smoke test of the script
"""

from __future__ import annotations

import argparse
import asyncio
import io
import os
import random
import sys
import time
from pathlib import Path
from typing import Any, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.bench_gpu import FULL_TEXT_CONFIG, build_model  # noqa: E402
from bench.common import fmt, header, latency_summary, machine, markdown_table, write_json  # noqa: E402

TICKET_QUESTIONS = {
    "urgent": {"type": "noul", "instructions": "Does the customer need a reply within the hour?"},
    "team": {"type": "choice", "instructions": "Which team owns this?",
             "criteria": {"billing": None, "outage": "service down", "feature": None}},
    "tone": {"type": "score", "instructions": "How angry is the customer?", "criteria": ["calm", "annoyed", "furious"]},
}
WORDS = ("server", "invoice", "login", "refund", "outage", "demo", "password", "crash", "slow", "billing",
         "upgrade", "cancel", "error", "timeout", "urgent", "manager", "contract", "export", "report", "api")
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


def ticket(rng: random.Random) -> dict:
    words = " ".join(rng.choice(WORDS) for _ in range(20))
    return {"state": {"ticket": f"{words} #{rng.randrange(10**9)}"}, "questions": TICKET_QUESTIONS, "samples": 1}


def frames(count: int) -> list[bytes]:
    from PIL import Image, ImageDraw

    out = []
    for index in range(count):
        image = Image.new("RGB", (512, 384), (150, 150, 150))
        draw = ImageDraw.Draw(image)
        draw.rectangle((0, 192, 512, 384), fill=(100, 100, 100))
        x = (index * 53) % 400
        draw.rectangle((x, 120, x + 110, 300), fill=(40 + index % 50, 40, 40))
        buffer = io.BytesIO()
        image.save(buffer, "JPEG", quality=70)
        out.append(buffer.getvalue())
    return out


def build_reader(args: argparse.Namespace) -> Any:
    import torch
    from transformers import DiffusionGemmaConfig
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    from app.cli import hf_options
    from app.config import Settings
    from app.engine.base import ReaderInfo
    from app.engine.diffusion import DiffusionRunner
    from app.engine.hf import HFReader
    from app.engine.tiny import build_config as tiny_config
    from app.engine.tiny import build_tokenizer
    from app.engine.tokenizer import HFChatTokenizer

    hf_tokenizer = build_tokenizer()
    ids = hf_tokenizer.convert_tokens_to_ids
    if args.tiny:
        config = tiny_config(hf_tokenizer)
        image_processor = Gemma4ImageProcessorPil(patch_size=config.vision_config.patch_size,
                                                  pooling_kernel_size=3, max_soft_tokens=70)
    else:
        config = DiffusionGemmaConfig(
            text_config=dict(FULL_TEXT_CONFIG), vision_config={"model_type": "gemma4_vision"}, canvas_length=256,
            boi_token_id=ids("<|image>"), eoi_token_id=ids("<image|>"), image_token_id=ids("<|image|>"))
        image_processor = Gemma4ImageProcessorPil()  # Gemma 4's defaults: 16 px patches, 280 soft tokens
    device = torch.device(args.device)
    on_cuda = device.type == "cuda"
    experts = "grouped_mm" if on_cuda else None
    model = build_model(config, args.device, torch.bfloat16 if on_cuda else torch.float32, experts)
    settings = Settings(device=args.device)
    options = hf_options(settings, "random-26B-A4B" if not args.tiny else "tiny", tiny=args.tiny)
    runner = DiffusionRunner(model, image_processor, device=device, max_prompt_tokens=settings.max_prompt_tokens,
                             kv_entries=settings.kv_cache_entries, max_rows=settings.max_batch_rows,
                             cuda_graphs=not args.eager)
    tokenizer = HFChatTokenizer(hf_tokenizer, vocab_size=int(config.text_config.vocab_size),
                                image_token_id=int(config.image_token_id))
    info = ReaderInfo(model=options.served_name, engine="hf", device=args.device, tiny=args.tiny,
                      canvas_length=settings.canvas)
    return HFReader(runner, tokenizer, info, options), settings, sum(p.numel() for p in model.parameters())


async def timed_decisions(decider: Any, bodies: Sequence[dict], images: Sequence[Sequence[Any]] = ()) -> list[float]:
    from app.decisions.request import parse_decision

    seconds = []
    for index, body in enumerate(bodies):
        started = time.perf_counter()
        await decider.decide(parse_decision(body, Settings().limits, images=images[index] if images else ()))
        seconds.append(time.perf_counter() - started)
    return seconds


async def closed_loop(decider: Any, reader: Any, clients: int, duration: float, seed: int) -> dict[str, Any]:
    from app.decisions.request import parse_decision

    latencies: list[float] = []
    deadline = time.perf_counter() + duration
    before = dict(reader.stats)

    async def client(number: int) -> None:
        rng = random.Random(seed * 1000 + number)
        while time.perf_counter() < deadline:
            started = time.perf_counter()
            await decider.decide(parse_decision(ticket(rng), Settings().limits))
            latencies.append(time.perf_counter() - started)

    started = time.perf_counter()
    await asyncio.gather(*(client(n) for n in range(clients)))
    elapsed = time.perf_counter() - started
    delta = {key: value - before.get(key, 0) for key, value in reader.stats.items()}
    requests = len(latencies)
    passes = max(delta.get("decoder_passes", 0), 1)
    return {"clients": clients, "requests": requests, "req_per_s": requests / elapsed,
            "decisions_per_s": 3 * requests / elapsed, **latency_summary(latencies),
            "canvases_per_pass": delta.get("decoder_rows", 0) / passes,
            "encoder_passes_per_request": delta.get("encoder_passes", 0) / max(requests, 1)}


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    from app.decisions.run import Decider
    from app.engine.base import ImageInput

    started = time.perf_counter()
    reader, settings, parameters = build_reader(args)
    build_s = time.perf_counter() - started
    await reader.start()
    decider = Decider(reader, settings.read_settings)
    rng = random.Random(0)
    results: dict[str, Any] = {"parameters": parameters, "build_s": round(build_s, 1)}
    try:
        await timed_decisions(decider, [ticket(rng) for _ in range(args.warmup)])
        results["unique"] = latency_summary(await timed_decisions(decider, [ticket(rng) for _ in range(args.reps)]))
        same = ticket(rng)
        await timed_decisions(decider, [same])
        results["cached"] = latency_summary(await timed_decisions(decider, [same] * args.reps))
        print(f"  one decision: {results['unique']['p50_ms']:.1f} ms new state, "
              f"{results['cached']['p50_ms']:.1f} ms same state", flush=True)

        results["curve"] = []
        for clients in args.levels:
            await closed_loop(decider, reader, clients, min(2.0, args.seconds), seed=clients + 1000)  # warm-up
            point = await closed_loop(decider, reader, clients, args.seconds, seed=clients)
            results["curve"].append(point)
            print(f"  {clients} clients: {point['req_per_s']:.2f} req/s, p50 {point['p50_ms']:.0f} ms", flush=True)

        pictures = [(ImageInput(data, "image/jpeg", f"frame {i}"),) for i, data in enumerate(frames(args.reps + 2))]
        clear = {"state": WALK_STATE, "samples": 1, "questions": {"ahead": AHEAD}}
        blocked = {"state": WALK_STATE, "samples": 1, "questions": {"ahead": AHEAD, "side": SIDE}}
        await timed_decisions(decider, [clear, blocked], pictures[:2])
        results["clear_frame"] = latency_summary(await timed_decisions(decider, [clear] * args.reps, pictures[2:]))
        results["blocked_frame"] = latency_summary(await timed_decisions(decider, [blocked] * args.reps, pictures[2:]))
        results["image_prompt_tokens"] = reader.runner.prompts.get(
            next(iter(reader.runner.prompts._items))).length if len(reader.runner.prompts) else None
        print(f"  walk frame: clear {results['clear_frame']['p50_ms']:.1f} ms, "
              f"blocked {results['blocked_frame']['p50_ms']:.1f} ms", flush=True)
        graphs = reader.runner.graphs
        results["cuda_graphs"] = None if graphs is None else {
            "captured": graphs.captures, "disabled": graphs.disabled, "replays": reader.runner.stats["graph_replays"]}
        print(f"  cuda graphs: {results['cuda_graphs']}", flush=True)
    finally:
        await reader.stop()
    return results


def report(results: dict[str, Any], args: argparse.Namespace) -> str:
    single = [["new state each time (prompt encoded)", fmt(results["unique"]["p50_ms"], 1), fmt(results["unique"]["p95_ms"], 1)],
              ["same state each time (prompt KV cached)", fmt(results["cached"]["p50_ms"], 1), fmt(results["cached"]["p95_ms"], 1)],
              ["walk frame, clear (1 image read)", fmt(results["clear_frame"]["p50_ms"], 1), fmt(results["clear_frame"]["p95_ms"], 1)],
              ["walk frame, blocked (2 image reads)", fmt(results["blocked_frame"]["p50_ms"], 1), fmt(results["blocked_frame"]["p95_ms"], 1)]]
    curve = [[p["clients"], p["requests"], fmt(p["req_per_s"], 2), fmt(p["decisions_per_s"], 1), fmt(p["p50_ms"], 0),
              fmt(p["p95_ms"], 0), fmt(p["canvases_per_pass"], 1)] for p in results["curve"]]
    return "\n".join([
        f"{results['parameters'] / 1e9:.2f} B parameters, built in {results['build_s']} s; "
        f"medians of {args.reps} after {args.warmup} warm-ups; {args.seconds:g} s per concurrency level.",
        "",
        markdown_table(["one decision (samples 1)", "p50 ms", "p95 ms"], single),
        "",
        markdown_table(["clients", "requests", "req/s", "decisions/s", "p50 ms", "p95 ms", "canvases per decoder pass"], curve),
    ])


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="the tiny config (a CPU smoke test of this script)")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    parser.add_argument("--seconds", type=float, default=12.0, help="seconds per concurrency level (default 12)")
    parser.add_argument("--levels", default="1,8,32", help="client counts (default 1,8,32)")
    parser.add_argument("--eager", action="store_true", help="decoder passes without CUDA graphs (CUDA_GRAPHS=0)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--out", default=None, help="JSON file (default: $OUT/bench_gpu_decisions.json when $OUT is set)")
    args = parser.parse_args(argv)
    import torch

    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    args.levels = [int(level) for level in args.levels.split(",")]
    if not args.tiny and not args.device.startswith("cuda"):
        parser.error("the full-size model needs a GPU; use --tiny to check the script on a CPU")
    if args.out is None and os.environ.get("OUT"):
        args.out = str(Path(os.environ["OUT"]) / "bench_gpu_decisions.json")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    info = machine()
    print(f"building the {'tiny' if args.tiny else 'full-size'} model on {args.device} ...", flush=True)
    results = asyncio.run(measure(args))
    print()
    mode = "eager decoder passes" if args.eager else "CUDA-graph decoder passes"
    print(header(f"bench_gpu_decisions: whole decisions through Decider + HFReader ({mode})", info))
    print()
    print(report(results, args))
    if args.out:
        print(f"results: {write_json(args.out, {'machine': info, **results})}")


if __name__ == "__main__":
    main()
