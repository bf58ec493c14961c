"""How few warm runs the start-up's graph capture needs: the reader built as `djev serve` builds it
(bench_gpu_served.py's `load_random`: random weights, `hf_reader`), with the capture's warm-run rule
as the app has it or coarser.

A capture records a pass; a pass whose compiled pieces would compile something new fails the
capture (and, on the H200, every capture after it). The app runs a pass before recording once per
shape the pieces see (`--warm shape`: ShapePolicy `decoder_pieces` / `encoder_pieces`). If the only
first-use cost is a new compiled variant (one row or several, self-conditioned, over a prefix,
under the sliding window's mask), once per variant would do (`--warm variant`): the start-up
first makes each variant once through the runner's own reads, then records every key without a
warm run. The probe reports the start-up's seconds, the capture's phases, the graphs held per
kind, the failed captures, and what torch.compile built while capturing (docs/design.md §4.8).

    python bench/probe_gpu_capture.py --warm variant --out $OUT/probe_gpu_capture.json   # on CUDA
    python bench/probe_gpu_capture.py --tiny --device cpu   # the CPU smoke test (no graphs)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.bench_gpu_served import load_random, server_settings  # noqa: E402

VARIANT_ROWS = (1, 2)  # a compiled piece specialises one row apart from several


def variant_pieces(sliding_window: int) -> tuple[Callable[[tuple], tuple], Callable[[tuple], tuple]]:
    """(decoder, encoder) keys to pieces at the variant level: one row or several, and for the
    decoder self-conditioned or not, for the encoder over a prefix or under the sliding mask."""

    def decoder(key: tuple) -> tuple:
        rows, _, _, _, conditioned = key
        return min(rows, 2), 0, conditioned

    def encoder(key: tuple) -> tuple:
        rows, length, slots = key
        return min(rows, 2), int(length > sliding_window), slots > 0

    return decoder, encoder


def variant_reads(runner: Any) -> int:
    """Reads that make every variant once, at one and at two rows, before the capture: plain
    prompts, prompts past the sliding window, prompts over a shared prefix, and a two-step read
    (the self-conditioned pass). Returns how many reads ran."""
    from app.engine.base import Prompt, ReadSpec

    base = min(1000, runner.vocab_size // 4)
    window = runner.policy.sliding_window

    def spec(ids: Sequence[int], steps: int = 1) -> ReadSpec:
        return ReadSpec(Prompt(tuple(ids)), ((0,) * 16,), (1,), ((base, base + 1),), steps=steps)

    def text(offset: int, length: int) -> list[int]:
        return [base + (offset + i) % 997 for i in range(length)]

    # Every prompt but the sheet's own begins apart from the sheet (offset 0), so only the reads
    # meant to go over its prefix do.
    sheet = text(0, 256)
    batches = [[spec(sheet + text(300, 40))]]  # encoded whole: the prefix the later reads go over
    for rows in VARIANT_ROWS:
        batches += [[spec(text(107 + 100 * row, 64 + row)) for row in range(rows)],
                    [spec(text(313 + 50 * row, window + 100 + row)) for row in range(rows)],
                    [spec(sheet + text(500 + 50 * row, 40 + row)) for row in range(rows)],
                    [spec(text(900 + 10 * row, 80 + row), steps=2) for row in range(rows)]]
    for batch in batches:
        failed = [result for result in runner.read(batch) if isinstance(result, Exception)]
        if failed:
            raise RuntimeError(f"a variant read failed: {failed[0]}")
    runner.clear_caches()
    return sum(len(batch) for batch in batches)


def probe(args: argparse.Namespace) -> dict[str, Any]:
    import app.engine.hf.graphs.decoder as decoder_module
    import app.engine.hf.graphs.encoder as encoder_module
    import app.engine.hf.loader as loader_module
    from app.engine.hf.graphs.cache import CAPTURE_PHASES
    from app.engine.hf.reader import compile_counts

    seen: dict[str, Any] = {}
    original = loader_module.prepare_graphs

    def prepare(runner: Any, progress: Any) -> None:
        if args.warm == "variant":
            started = time.perf_counter()
            decoder_module.decoder_pieces, encoder_module.encoder_pieces = variant_pieces(runner.policy.sliding_window)
            seen["variant_reads"] = variant_reads(runner)
            seen["variant_reads_s"] = round(time.perf_counter() - started, 1)
        seen["before_capture"] = compile_counts(runner)
        started = time.perf_counter()
        original(runner, progress)
        seen["capture_s"] = round(time.perf_counter() - started, 1)
        seen["after_capture"] = compile_counts(runner)
        seen["held"] = runner.graphs_held()
        seen["phases_s"] = {name: runner.stats[name] / 1000 for name in CAPTURE_PHASES}
        seen["failures"] = {graphs.cache.name: dict(graphs.cache.failed)
                            for graphs in (runner.graphs, runner.encoder_graphs, runner.vision_graphs)
                            if graphs is not None and graphs.cache.failed}

    loader_module.prepare_graphs = prepare
    started = time.perf_counter()
    try:
        reader = load_random(args, server_settings(args), lambda phase, done, total: None)
    finally:
        loader_module.prepare_graphs = original
    seen["start_up_s"] = round(time.perf_counter() - started, 1)
    if "capture_s" not in seen:  # no graphs (the CPU): the reads still run, so the smoke test checks them
        seen["graphs"] = False
        if args.warm == "variant":
            seen["variant_reads"] = variant_reads(reader.runner)
    return {"warm": args.warm, "device": args.device, **seen}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="the tiny config on the CPU (a smoke test: no graphs)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--warm", choices=("shape", "variant"), default="variant",
                        help="shape: the app's rule; variant: once per compiled variant, after reads that make each")
    parser.add_argument("--out", help="write the report as JSON here")
    args = parser.parse_args(argv)
    args.compile = args.fused_moe = args.cuda_graphs = None  # the server's defaults
    report = probe(args)
    text = json.dumps(report, indent=2, default=str)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
