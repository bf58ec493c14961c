"""How long each engine turn of a long read takes on CUDA, with each chunk's turn waiting for its
device work (`finish_turn`, as built) and without (the turn ends once its kernels are queued), in one
process: the reader as `djev serve` builds it over random full-size weights, eager by default (no
compile, no graphs: this probe is about where the time of the turns falls, and loads in seconds).

For each mode, one cold decision on a state of --tokens tokens (never seen), with the wall time of
every turn of its heavy read: the chunks' turns, then the turn after the last chunk (the read's
decoder pass). Without the wait the chunks' turns look short and the later turn pays for all the
device work still queued.

    python bench/probe_gpu_turns.py --tokens 35000          # on CUDA
    python bench/probe_gpu_turns.py --tiny --device cpu --tokens 900 --prefill-chunk 256   # smoke
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.bench_gpu_long import body_of, state_of  # noqa: E402
from bench.bench_gpu_served import load_random  # noqa: E402


async def probe(args: argparse.Namespace) -> dict[str, Any]:
    from app.config import Settings
    from app.decisions.request import parse_decision
    from app.engine.hf import reader as reader_module
    from app.engine.tiny import build_tokenizer
    from app.web.services import Services

    settings = Settings.from_env(device=args.device, max_prompt_tokens=max(32768, args.tokens + 4096),
                                 prefill_chunk=args.prefill_chunk, torch_compile=args.compile,
                                 fused_moe=args.fused_moe, cuda_graphs=args.cuda_graphs)
    rng = random.Random(5)
    tokenizer = build_tokenizer()
    started = time.perf_counter()
    reader = load_random(args, settings, lambda phase, done, total: None)
    load_s = time.perf_counter() - started
    services = Services.build(settings, reader)
    turns: list[float] = []
    timed_advance = reader_module.advance_read

    def advance(program: Any) -> Any:
        begun = time.perf_counter()
        try:
            return timed_advance(program)
        finally:
            turns.append(time.perf_counter() - begun)

    reader_module.advance_read = advance  # pyright: ignore[reportAttributeAccessIssue]
    await reader.start()
    out: dict[str, Any] = {"load_s": round(load_s, 1), "tokens": args.tokens, "prefill_chunk": args.prefill_chunk}
    try:
        prime = state_of(tokenizer, 2 * args.prefill_chunk + 300, rng)
        await services.decider.decide(parse_decision(body_of(prime), services.limits))
        built = reader.runner.finish_turn
        for mode in ("waits (as built)", "queued (no wait)"):
            reader.runner.finish_turn = built if mode.startswith("waits") else (lambda: None)
            turns.clear()
            state = state_of(tokenizer, args.tokens, rng)
            begun = time.perf_counter()
            await services.decider.decide(parse_decision(body_of(state), services.limits))
            total = time.perf_counter() - begun
            ms = [round(t * 1000, 1) for t in turns]
            out[mode] = {"decision_s": round(total, 3), "turns": len(ms), "chunk_turns_max_ms": max(ms[:-1], default=0),
                         "chunk_turns_median_ms": sorted(ms[:-1])[len(ms[:-1]) // 2] if len(ms) > 1 else 0,
                         "last_turn_ms": ms[-1] if ms else 0, "turns_ms": ms}
            print(mode, {k: v for k, v in out[mode].items() if k != "turns_ms"}, flush=True)
        reader.runner.finish_turn = built
    finally:
        await reader.stop()
    return out


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tokens", type=int, default=35000)
    parser.add_argument("--prefill-chunk", type=int, default=2048)
    for name in ("compile", "fused-moe", "cuda-graphs"):
        parser.add_argument(f"--{name}", action=argparse.BooleanOptionalAction, default=False)
    parser.add_argument("--out-dir", default=os.environ.get("OUT") or ".")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    result = asyncio.run(probe(args))
    Path(args.out_dir).mkdir(parents=True, exist_ok=True)
    (Path(args.out_dir) / "probe_gpu_turns.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
