"""The hf engine's read cost on the full-size DiffusionGemma 26B-A4B architecture (random bf16 weights).

No checkpoint is needed: the model is built from the published config (google/diffusiongemma-26B-A4B-it: 30
layers, hidden 2816, 16 heads, 128 experts top-8, ...) with random weights, in bf16 on CUDA with
`experts_implementation="grouped_mm"`, and read through the reader `djev serve` builds over it
(`app.engine.hf.loader.hf_reader`: the experts fused, the layers compiled, the warm-up and the graphs
captured, as each mode's settings ask), its runner's `read` stepping the reads through the engine's
turns alone: the code `djev serve` runs, minus the asyncio queue in front of it. Random weights cost
the same FLOPs and bytes as trained ones, so the timings hold for the real model.

Cases (prompt: --prompt-tokens random ids, default 300; canvas: 32 wide with 3 answer slots):
  (a) one read, a new prompt every call: its prompt and canvas in one engine turn;
  (b) one read, prompt KV cached: the same read every call (its prompt's KV stays in the KV store, so
      a turn runs the canvas alone: a repeated state, or a later stage);
  (c) batched reads: 1, 8, 32 new prompts in ONE runner.read call -- their prompts and canvases in
      the turns of TURN_TOKENS that hold them -- reported as reads/s;
  (d) one decision with samples 4: one new prompt, 4 canvases in one turn.
Each case: --warmup untimed calls (default 3), then the median (and p95) of --reps timed calls
(default 15), with torch.cuda.synchronize() before and after each, and the engine turns a call took.
Modes: eager (CUDA_GRAPHS=0), graphs (each turn's forward as its token-count bucket's CUDA graphs,
CUDA_GRAPHS=1), compiled (graphs over torch.compile'd layer bodies, TORCH_COMPILE=1), fused (compiled,
the experts as djev's Triton kernels, FUSED_MOE=1); each mode's reader is built over the same model
(compiled and fused change it in place, so they run last) once the previous one is gone. On CUDA the
naive transformers baseline (bench/naive.py) runs first on the same model, and every case is printed
beside its naive counterpart as a ratio (engine / naive).

Runs standalone on a GPU box with torch and transformers >= 5.17 (no Starlette, no uvicorn):
    python bench/bench_gpu.py                      # full size, CUDA; JSON to $OUT/bench_gpu.json
    python bench/bench_gpu.py --tiny --device cpu  # the tiny model's config: checks the script itself
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import CollectorPauses, at_least, fmt, header, latency_summary, machine, markdown_table, write_json  # noqa: E402
from bench.models import build_model, model_config  # noqa: E402
from bench.naive import measure_naive, ratio  # noqa: E402
from bench.workload import CANVAS_WIDTH, SLOTS, Specs  # noqa: E402

BATCHES = (1, 8, 32)
SAMPLES = 4


def read_all(runner: Any, specs: list[Any]) -> None:
    """runner.read, failing loudly: the runner returns a failed read's exception in its place, and a
    benchmark of failures would look fast."""
    failures = [result for result in runner.read(specs) if isinstance(result, Exception)]
    if failures:
        raise RuntimeError(f"{len(failures)} of {len(specs)} reads failed: {failures[0]}")


def timed(call: Callable[[], Any], warmup: int, reps: int, runner: Any, sync: Callable[[], None]) -> dict[str, Any]:
    warm_started = time.perf_counter()
    for _ in range(warmup):
        call()
    sync()
    warmup_s = time.perf_counter() - warm_started
    from app.engine.hf.reader import settle_heap

    settle_heap()  # as the server does once loaded and warmed up
    before = dict(runner.stats)
    from bench.common import time_calls

    with CollectorPauses() as pauses:
        seconds = time_calls(call, reps, sync)
    delta = {key: value - before.get(key, 0) for key, value in runner.stats.items()}
    return {**latency_summary(seconds), **pauses.summary(), "warmup_s": round(warmup_s, 1),
            "turns_per_call": delta.get("flat_turns", 0) / reps,
            "prompt_tokens_per_call": delta.get("flat_prompt_tokens", 0) / reps}


# Each mode's settings (the rest are the server's defaults): its reader is built as `djev serve` builds it.
MODES: dict[str, dict[str, bool]] = {
    "eager": {"cuda_graphs": False, "torch_compile": False, "fused_moe": False},
    "graphs": {"cuda_graphs": True, "torch_compile": False, "fused_moe": False},
    "compiled": {"cuda_graphs": True, "torch_compile": True, "fused_moe": False},
    "fused": {"cuda_graphs": True, "torch_compile": True, "fused_moe": True},
}


def mode_reader(model: Any, tokenizer: Any, processor: Any, args: argparse.Namespace, mode: str) -> Any:
    """The reader `djev serve` builds over `model` with `mode`'s settings (`hf_reader`)."""
    from app.build import hf_options
    from app.config import Settings
    from app.engine.hf.loader import hf_reader
    from bench.models import served_name

    settings = Settings.of(device=args.device, **MODES[mode])
    return hf_reader(model, tokenizer, processor, hf_options(settings, served_name(args.tiny), tiny=args.tiny))


def release(device: Any) -> None:
    """The last mode's reader gone with its memory (its KV store, its graphs) before the next is built:
    the heap `settle_heap` set aside from the collector (the reader in it) is given back to it first."""
    import gc

    import torch

    gc.unfreeze()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def measure(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from app.engine.tiny import build_tokenizer
    from bench.common import device_sync
    from bench.models import image_processor

    device = torch.device(args.device)
    on_cuda = device.type == "cuda"
    dtype = torch.bfloat16 if on_cuda else torch.float32
    experts = args.experts if args.experts != "default" else None
    sync = device_sync(device)

    started = time.perf_counter()
    tokenizer = build_tokenizer()
    model = build_model(model_config(args.tiny, tokenizer), args.device, dtype, experts)
    processor = image_processor(args.tiny)
    sync()
    build_s = time.perf_counter() - started
    parameters = sum(p.numel() for p in model.parameters())

    naive = measure_naive(model, batches=BATCHES, prompt_tokens=args.prompt_tokens, reps=args.reps) \
        if on_cuda and args.naive else {}

    cases: list[dict[str, Any]] = []
    graphs: dict[str, Any] = {}
    built: dict[str, Any] = {}
    for mode in args.modes:
        started = time.perf_counter()
        reader = mode_reader(model, tokenizer, processor, args, mode)
        print(f"  [{mode}] the reader (hf_reader) built in {time.perf_counter() - started:.1f} s", flush=True)
        cases += measure_mode(reader.runner, args, mode, naive, sync, graphs, built)
        built[mode]["reader_s"] = round(time.perf_counter() - started, 1)
        del reader
        release(device)

    return {
        "model": "tiny random-weight config (app/engine/tiny.py)" if args.tiny else
                 "DiffusionGemma 26B-A4B architecture, random weights (the published config)",
        "parameters": parameters,
        "dtype": str(dtype).replace("torch.", ""),
        # the last mode's; each case has its own
        "experts_implementation": model.get_experts_implementation(),
        "build_s": round(build_s, 1),
        "peak_memory_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 1) if on_cuda else None,
        "prompt_tokens": args.prompt_tokens,
        "canvas_width": CANVAS_WIDTH,
        "slots": len(SLOTS),
        "warmup": args.warmup,
        "reps": args.reps,
        "cases": cases,
        "naive": naive,
        "graphs": graphs,
        "readers": built,
    }


def measure_mode(runner: Any, args: argparse.Namespace, mode: str, naive: dict[str, Any], sync: Callable[[], None],
                 graphs: dict[str, Any], built: dict[str, Any]) -> list[dict[str, Any]]:
    """Every case on one mode's runner: its cases, and (into `graphs` and `built`) its graphs and what
    it had built at ready and at the end (`compile_counts`: the cases must build nothing)."""
    from app.engine.hf.reader import compile_counts
    from bench.common import named_compile_counts

    specs = Specs(runner.vocab_size, args.prompt_tokens)
    calls = args.warmup + args.reps

    def fresh(count: int, canvases: int = 1) -> Callable[[], list[Any]]:
        """A new set of `count` reads (new prompts) at every call, drawn before the clock starts."""
        sets = iter([[specs.read(canvases=canvases) for _ in range(count)] for _ in range(calls)])
        return lambda: next(sets)

    at_ready = named_compile_counts(compile_counts(runner))
    print(f"  [{mode}] turns of {runner.flat.budget} tokens", flush=True)
    cases: list[dict[str, Any]] = []

    def case(name: str, reads: int, canvases: int, call: Callable[[], Any],
             naive_ms: tuple[float | None, ...] = ()) -> None:
        result = timed(call, args.warmup, args.reps, runner, sync)
        result.update(case=f"{name} [{mode}]", reads=reads, canvases=canvases,
                      experts=getattr(runner.model.config, "_experts_implementation", None),
                      reads_per_s=reads / (result["p50_ms"] / 1000), naive_ms=list(naive_ms))
        cases.append(result)
        print(f"  {name} [{mode}]: median {result['p50_ms']:.1f} ms, max {result['max_ms']:.1f}, "
              f"{result['turns_per_call']:g} turns a call (warm-up {result['warmup_s']} s; collector: "
              f"{result['gc_passes']} passes, {result['gc_full_passes']} full, longest {result['gc_longest_ms']} ms)",
              flush=True)

    eager_ms = naive.get("full_read_eager", {})
    static_ms = naive.get("full_read_static_graph", {})
    decoder_ms = naive.get("decoder_pass_graph", {})
    one = fresh(1)
    case("(a) one read, new prompt", 1, 1, lambda: read_all(runner, one()), (eager_ms.get(1), static_ms.get(1)))
    same = specs.read()
    case("(b) one read, prompt KV cached", 1, 1, lambda: read_all(runner, [same]),
         (naive.get("decoder_pass_eager", {}).get(1), decoder_ms.get(1)))
    for size in BATCHES:
        batch = fresh(size)
        case(f"(c) batch of {size}, one call", size, size, lambda batch=batch: read_all(runner, batch()),
             (eager_ms.get(size), static_ms.get(size)))
    samples = fresh(1, SAMPLES)
    case(f"(d) one decision, samples {SAMPLES}", 1, SAMPLES, lambda: read_all(runner, samples()),
         (eager_ms.get(1), static_ms.get(1)))
    built[mode] = {"at_ready": at_ready, "at_end": named_compile_counts(compile_counts(runner))}
    if built[mode]["at_end"] != at_ready:
        print(f"  WARNING [{mode}]: the cases built more after ready: {at_ready} -> {built[mode]['at_end']}",
              flush=True)
    pieces = runner.flat.forward.graphs
    if pieces is not None:
        report = pieces.report()
        graphs[mode] = {"buckets": len(report.buckets), "graphs": report.graphs,
                        "memory_gib": round(report.memory_bytes / 2**30, 2),
                        "buffers_gib": round(report.buffer_bytes / 2**30, 2), "failed": list(report.failed),
                        "fallbacks": runner.stats.get("flat_graph_fallbacks", 0)}
    return cases


def parameter_count(count: int) -> str:
    return f"{count / 1e9:.2f} B" if count >= 1e9 else f"{count / 1e6:.2f} M"


def report(results: dict[str, Any]) -> str:
    rows = [[c["case"], results["prompt_tokens"], c["reads"], c["canvases"], fmt(c["p50_ms"], 1), fmt(c["p95_ms"], 1),
             fmt(c["reads_per_s"], 1), fmt(c["turns_per_call"], 1), fmt(c["prompt_tokens_per_call"], 0),
             *[ratio(c["p50_ms"], n) for n in (c["naive_ms"] + [None, None])[:2]]]
            for c in results["cases"]]
    naive = results.get("naive") or {}
    naive_rows = [[name, *[fmt(values.get(b, float("nan")), 1) for b in BATCHES]] for name, values in naive.items()]
    memory = f", peak GPU memory {results['peak_memory_gib']} GiB" if results["peak_memory_gib"] is not None else ""
    return "\n".join([
        f"Model: {results['model']}, {parameter_count(results['parameters'])} parameters, {results['dtype']}, "
        f"experts {results['experts_implementation']}; built in {results['build_s']} s{memory}. "
        f"Canvas {results['canvas_width']} wide, {results['slots']} slots. "
        f"Median and p95 of {results['reps']} after {results['warmup']} warm-ups.",
        "",
        markdown_table(["case", "prompt tokens", "reads", "canvases", "median ms", "p95 ms", "reads/s",
                        "turns", "prompt tokens written", "/ naive eager (full read; (b): decoder pass)",
                        "/ naive CUDA graph (StaticCache full read; (b): decoder pass)"], rows),
        "",
        "naive transformers on the same model, same process (median ms):" if naive else "(naive baseline not run)",
        "",
        markdown_table(["call", *[f"batch {b}" for b in BATCHES]], naive_rows) if naive else "",
        "",
        f"graphs: {results.get('graphs')}",
        f"readers (hf_reader, by mode): {results.get('readers')}",
    ])


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="the tiny model's config instead of the full size")
    parser.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: cuda when available)")
    parser.add_argument("--experts", default=None,
                        help="experts implementation: grouped_mm (default on CUDA), eager, or 'default' for "
                             "transformers' own choice (default on CPU)")
    parser.add_argument("--prompt-tokens", type=at_least(1), default=300, help="prompt length in tokens (default 300)")
    parser.add_argument("--warmup", type=at_least(0), default=3, help="untimed calls per case (default 3)")
    parser.add_argument("--reps", type=at_least(1), default=15, help="timed calls per case (default 15)")
    parser.add_argument("--torch-threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--modes", default=None,
                        help="eager (CUDA_GRAPHS=0), graphs (CUDA graph replay), compiled (graphs over "
                             "torch.compile'd layer bodies; compiles the model in place, so it runs last), fused "
                             "(compiled, with the experts as djev's Triton kernels, FUSED_MOE), comma-separated "
                             "(default: eager,graphs on CUDA, eager on CPU)")
    parser.add_argument("--out", default=None, help="JSON results file (default: $OUT/bench_gpu.json when $OUT is set)")
    parser.add_argument("--no-naive", dest="naive", action="store_false", help="skip the naive baseline")
    args = parser.parse_args(argv)
    import torch

    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.experts is None:
        args.experts = "grouped_mm" if args.device.startswith("cuda") else "default"
    if args.modes is None:
        args.modes = "eager,graphs" if args.device.startswith("cuda") else "eager"
    order = ("eager", "graphs", "compiled", "fused")
    args.modes = [mode.strip() for mode in args.modes.split(",")]
    if any(mode not in order for mode in args.modes):
        parser.error("--modes takes eager, graphs, compiled and/or fused")
    args.modes.sort(key=order.index)
    if not args.tiny and not args.device.startswith("cuda"):
        parser.error("the full-size model needs a GPU (about 50 GiB in bf16); use --tiny to check the script on a CPU")
    if args.out is None and os.environ.get("OUT"):
        args.out = str(Path(os.environ["OUT"]) / "bench_gpu.json")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    started = time.perf_counter()
    if args.torch_threads:
        import torch

        torch.set_num_threads(args.torch_threads)
    info = machine()
    print(f"building the {'tiny' if args.tiny else 'full-size'} model on {args.device} ...", flush=True)
    results = measure(args)
    results["total_s"] = round(time.perf_counter() - started, 1)
    print()
    title = "tiny config" if args.tiny else "full-size random weights"
    print(header(f"bench_gpu: reads through the engine's turns, {title}", info))
    print()
    print(report(results))
    print(f"\ntotal {results['total_s']} s")
    if args.out:
        path = write_json(args.out, {"machine": info, **results})
        print(f"results: {path}")


if __name__ == "__main__":
    main()
