"""Do batched, padded and CUDA-graph passes read the same as a read alone? (GPU)

For each model size and dtype: five reads (prompts of 40 to 1500 tokens, one with 4 noise draws) are
read one at a time, all together (left-padded KV, masks), through the graph paths' static buffers
without capture (decoder graphs; encoder graphs; both), and with both captured; then prompts that
share a 200-token sheet, encoded over its prefix the same ways (`check_prefix`). Prints the largest
label log-probability difference per read, and the largest key difference of the encoder graph's KV
against the eager encoder's. In float32 every path agrees to ~1e-4. In bfloat16 with RANDOM weights
the paths diverge: the random routers' near-uniform top-8 expert choices flip on any rounding
difference between kernels, and the flip cascades; that is a property of random weights, not of the
batching (float32 shows the math is the same), and graph replay is bit-identical to its own eager
static path.

One runner at a time: each path's runner is built, its reads run, only their results kept (label
log-probabilities and keys, on the host), and the runner dropped with its memory (`gc.collect`, and
`torch.cuda.empty_cache` on CUDA) before the next one is built. Holding them side by side (the row
path's, the prefix check's and the flat turn's, whose KV store takes 16 GiB up front) ran an 80 GB
card out of memory beside the 30-layer model's 47 GiB of weights.

    python bench/check_gpu_numerics.py              # on a GPU box; about a minute
    python bench/check_gpu_numerics.py 6:float32    # one model size and dtype (layers:dtype ...)
    python bench/check_gpu_numerics.py --fused-moe  # every path through the experts' Triton kernels
                                                    # (FUSED_MOE), and those reads against grouped_mm's
    python bench/check_gpu_numerics.py --split      # every path through the split layer forward that
                                                    # TORCH_COMPILE compiles (app/engine/hf/layers.py, run
                                                    # eagerly here), and those reads against the library's
    python bench/check_gpu_numerics.py --flat-turn  # the flat turn (FLAT_TURN=1) too: alone against the
                                                    # row path's reads alone, batched, and its graphs by
                                                    # token count against its eager forward
    python bench/check_gpu_numerics.py --tiny --device cpu --flat-turn   # the CPU smoke test: the tiny
                                                    # config (its own 6 layers; LAYERS is ignored), the
                                                    # static paths without capture
"""

from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path
from typing import Any, Callable, Sequence, TypeVar

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.models import build_model, full_config, image_processor, model_config, served_experts  # noqa: E402
from bench.workload import Specs, frames  # noqa: E402

T = TypeVar("T")
DEFAULT_SIZES = ("6:float32", "6:bfloat16", "30:bfloat16")
PROMPT_TOKENS = (40, 700, 1500)  # the prompts of the three reads beside the two over one 300-token prompt


def largest_difference(a, b) -> float:
    worst = 0.0
    for canvas_a, canvas_b in zip(a.slots, b.slots):
        for slot_a, slot_b in zip(canvas_a, canvas_b):
            worst = max(worst, max(abs(x - y) for x, y in zip(slot_a.label_logprobs, slot_b.label_logprobs)))
    return round(worst, 4)


def differences(a: Sequence[Any], b: Sequence[Any]) -> list[float]:
    return [largest_difference(x, y) for x, y in zip(a, b)]


def release(device: Any) -> None:
    """Give back the memory of what was just dropped: the runners hold cycles (the flat engine and
    its runner), so a collection first; then the allocator's cache, on CUDA."""
    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def one(make: Callable[[], Any], use: Callable[[Any], T], device: Any) -> T:
    """Build a runner (`make()`), run `use` on it and return what it returns (results on the host,
    nothing that holds the runner), then drop the runner and free its memory before anything else
    is built: one runner at a time."""
    runner = make()
    try:
        return use(runner)
    finally:
        del runner
        release(device)


def host_keys(encoded: Any) -> list[Any]:
    """An encoded prompt's keys, layer by layer, on the host (what the KV comparisons read)."""
    return [layer[0].detach().cpu() for layer in encoded.layers]


def token_rows(a: Sequence[Any], b: Sequence[Any]) -> list[Any]:
    """Per layer, the largest key difference of each token row between two prompts' keys."""
    return [(x - y).abs().amax(dim=(0, 1, 3)) for x, y in zip(a, b)]


def graph_note(runner: Any) -> dict[str, Any]:
    """The row path's graphs a runner captured, and those that failed (None: no graphs, as on the CPU)."""
    graphs, encoder = runner.graphs, runner.encoder_graphs
    if graphs is None or encoder is None:
        return {"captured": None}
    return {"decoder": graphs.captures, "decoder_failed": dict(graphs.cache.failed), "encoder": encoder.captures,
            "encoder_failed": dict(encoder.cache.failed), "encoder_held": sorted(encoder.cache)}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("sizes", nargs="*", metavar="LAYERS:DTYPE",
                        help=f"model sizes and dtypes (default {' '.join(DEFAULT_SIZES)}; with --tiny float32)")
    parser.add_argument("--fused-moe", action="store_true", help="the experts as djev's Triton kernels (CUDA)")
    parser.add_argument("--split", action="store_true", help="the split layer forward TORCH_COMPILE compiles, eagerly")
    parser.add_argument("--flat-turn", action="store_true", help="the flat turn (FLAT_TURN=1) too")
    parser.add_argument("--tiny", action="store_true", help="the tiny config (LAYERS ignored): a CPU smoke test")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda)")
    args = parser.parse_intermixed_args(argv)  # sizes and flags in any order, as before
    import torch

    args.device = torch.device(args.device or "cuda")
    if not args.tiny and args.device.type != "cuda":
        parser.error("the full-size model needs a GPU; use --tiny to check the script on a CPU")
    if args.fused_moe and args.device.type != "cuda":
        parser.error("--fused-moe: the Triton kernels need CUDA")
    sizes = []
    for text in args.sizes or (("0:float32",) if args.tiny else DEFAULT_SIZES):
        layers, _, dtype = text.partition(":")
        if not layers.isdigit() or not isinstance(getattr(torch, dtype, None), torch.dtype):
            parser.error(f"{text!r}: LAYERS:DTYPE, e.g. 6:float32")
        sizes.append((int(layers), getattr(torch, dtype)))
    args.sizes = sizes
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    for layers, dtype in args.sizes:
        check_size(args, layers, dtype)
        release(args.device)  # the model and everything of this size gone before the next is built


def check_size(args: argparse.Namespace, layers: int, dtype: Any) -> None:
    """Every check on one model size and dtype, one runner at a time."""
    from app.engine.hf.graphs.decoder import DecoderGraphs
    from app.engine.hf.graphs.encoder import EncoderGraphs
    from app.engine.hf.runner import DiffusionRunner

    device = args.device
    config = model_config(True) if args.tiny else full_config(num_hidden_layers=layers)
    model = build_model(config, str(device), dtype, served_experts(str(device)))
    vocab = int(model.config.text_config.vocab_size)
    specs = Specs(vocab, 300)
    reads = [specs.read(), specs.read(canvases=4)] + [Specs(vocab, n, seed=n).read() for n in PROMPT_TOKENS]
    name = f"{'tiny' if args.tiny else layers} layers, {str(dtype).replace('torch.', '')}"

    def runner(graphs: bool = False, static_decoder: bool = False, static_encoder: bool = False) -> DiffusionRunner:
        made = DiffusionRunner(model, None, device=device, max_prompt_tokens=32768, kv_entries=64, max_rows=64,
                               cuda_graphs=graphs)
        if static_decoder:
            made.graphs = DecoderGraphs(model, made.layer_types, device, pad_id=0, capture=False, policy=made.policy)
        if static_encoder:
            made.encoder_graphs = EncoderGraphs(model, made.layer_types, device, capture=False, policy=made.policy,
                                                sliding_window=int(made.text_config.sliding_window))
        return made

    def held(use: Callable[[DiffusionRunner], T], **kind: bool) -> T:
        return one(lambda: runner(**kind), use, device)

    def each_alone(made: DiffusionRunner) -> list[Any]:
        return [made.read([spec])[0] for spec in reads]

    def alone_and_keys(made: DiffusionRunner) -> tuple[list[Any], list[list[Any]]]:
        return each_alone(made), [host_keys(made.encode(spec.prompt)) for spec in reads]

    alone, plain_keys = held(alone_and_keys)
    if args.fused_moe:
        from app.engine.hf.moe.fused import use_fused_experts

        grouped_alone, reason = alone, use_fused_experts(model)
        if reason is not None:
            raise SystemExit(f"--fused-moe: {reason}")
        alone, plain_keys = held(alone_and_keys)
        print(f"{name}: experts as djev's Triton kernels")
        print("  kernels vs grouped_mm, alone    ", differences(grouped_alone, alone))
    if args.split:
        from app.engine.hf.compiled import model_layers
        from app.engine.hf.layers import install

        library_alone = alone
        install(model_layers(model))
        alone, plain_keys = held(alone_and_keys)
        print(f"{name}: the split layer forward")
        print("  split vs library, alone         ", differences(library_alone, alone))
    together = held(lambda made: made.read(reads))
    static_reads = held(each_alone, static_decoder=True)
    encoder_reads, encoder_keys = held(alone_and_keys, static_encoder=True)
    # Largest KV difference, and how many (layer, token) KV rows differ by more than 1e-2: a few rows
    # are random routers' expert flips; most rows would be a wrong mask, position or crop.
    token_diffs = [rows for a, b in zip(plain_keys, encoder_keys) for rows in token_rows(a, b)]
    kv = max(float(d.max()) for d in token_diffs)
    kv_rows = f"{sum(int((d > 1e-2).sum()) for d in token_diffs)} of {sum(d.numel() for d in token_diffs)}"

    def alone_then_batched(made: DiffusionRunner) -> tuple[list[Any], list[Any], int, dict[str, Any]]:
        each = each_alone(made)  # first, as before: the batch reads over the KV these reads left cached
        return each, made.read(reads), made.stats.get("encoder_unbucketed_passes", 0), graph_note(made)

    both_reads, static_batch, unbucketed, _ = held(alone_then_batched, static_decoder=True, static_encoder=True)
    graph_reads, graph_batch, _, captured = held(alone_then_batched, graphs=True)
    print(f"{name}:")
    print("  batched vs alone                 ", differences(alone, together))
    print("  decoder static vs alone          ", differences(alone, static_reads))
    print("  encoder static vs alone          ", differences(alone, encoder_reads),
          f"(largest KV difference {kv:.2e}; KV rows off by > 1e-2: {kv_rows})")
    print("  batched, both static vs alone    ", differences(alone, static_batch),
          f"(encoder passes unbucketed: {unbucketed})")
    print("  graph replay vs both static      ", differences(both_reads, graph_reads))
    graphs = ("no graphs on the " + device.type if captured.get("captured", True) is None else
              f"decoder captured {captured['decoder']}, failed: {captured['decoder_failed']}; encoder captured "
              f"{captured['encoder']}, failed: {captured['encoder_failed']}")
    print("  batched graph replay vs static   ", differences(static_batch, graph_batch), f"({graphs})", flush=True)
    check_prefix(runner, vocab, device)
    check_vision(model, device, args.tiny)
    if args.flat_turn:
        check_flat(model, device, reads, alone)


def check_flat(model, device, reads, alone) -> None:
    """The flat turn: each read alone against the row path's read alone, all of them in one turn
    against alone, and the same through the graphs by token count against the eager forward; one
    flat runner at a time (each one's KV store preallocates its bytes on CUDA)."""
    from app.engine.hf.runner import DiffusionRunner

    def flat_runner(graphs: bool):
        made = DiffusionRunner(model, None, device=device, max_prompt_tokens=32768, kv_entries=64, max_rows=64,
                               cuda_graphs=graphs, turn_tokens=8192)
        assert made.flat is not None
        made.flat.prepare_graphs()  # (nothing without graphs)
        return made

    def alone_then_together(made) -> tuple[list[Any], list[Any], int]:
        return ([made.read([spec])[0] for spec in reads], made.read(reads), made.stats.get("flat_graph_fallbacks", 0))

    flat_alone, together, _ = one(lambda: flat_runner(graphs=False), alone_then_together, device)
    graph_alone, graph_together, fallbacks = one(lambda: flat_runner(graphs=True), alone_then_together, device)
    print("  flat turn alone vs row path alone ", differences(alone, flat_alone))
    print("  flat turn batched vs alone        ", differences(flat_alone, together))
    print("  flat graphs vs flat eager, alone  ", differences(flat_alone, graph_alone))
    print("  flat graphs batched vs eager      ", differences(together, graph_together),
          f"(graph fallbacks {fallbacks})", flush=True)


def check_prefix(runner, vocab: int, device) -> None:
    """Prompts encoded over a shared prefix: two sheets (200 and 170 tokens, so prefixes of 192 and
    160 tokens, both in 192 slots, the second right-aligned after 32 stale ones) ahead of 100-token
    states. After each sheet's first prompt, the others read over the prefix sliced from its KV:
    on the encoder's static path (no capture), batched, and captured, where the 160-token prefix
    replays the graph the 192-token one captured; each against the read of the whole prompt alone.
    Each runner goes through both sheets in turn (the second sheet's prefix over the first's slots),
    one runner at a time."""
    import dataclasses

    from app.engine.base import Prompt
    from app.engine.hf.prompts import PromptCache

    def sheet_reads(tokens: int, seed: int) -> list:
        sheet = Specs(vocab, tokens, seed=seed).ids(tokens)
        return [dataclasses.replace(spec, prompt=Prompt(sheet + spec.prompt.ids))
                for spec in (Specs(vocab, 100, seed=seed + 1 + n).read() for n in range(4))]

    sheets = [sheet_reads(tokens, seed) for tokens, seed in ((200, 7), (170, 70))]

    def prefix_counters(made) -> dict[str, Any]:
        return {key: value for key, value in made.stats.items() if "prefix" in key}

    def over_the_prefix(made) -> tuple[list[tuple[list[Any], tuple[int, ...] | None, list[Any]]], dict[str, Any]]:
        """The static path: each sheet's first prompt, then the others over its prefix, and the
        prefix's ids and keys (sliced from the first prompt's KV; None where no prefix was cached:
        the shape policy took none, as on the tiny model)."""
        out: list[tuple[list[Any], tuple[int, ...] | None, list[Any]]] = []
        for reads in sheets:
            made.read(reads[:1])
            over = [made.read([spec])[0] for spec in reads[1:]]
            found = [(ids, kv) for ids, kv in made.prefixes.values() if ids == reads[1].prompt.ids[:len(ids)]]
            out.append((over, found[0][0], host_keys(found[0][1])) if found else (over, None, []))
        return out, prefix_counters(made)

    static, static_counters = one(lambda: runner(static_encoder=True), over_the_prefix, device)

    def plain_reads(made) -> list[tuple[list[Any], list[Any]]]:
        """Eagerly: each prompt alone, whole; and each sheet's prefix encoded alone (its keys)."""
        out = []
        for reads, (_, prefix_ids, _) in zip(sheets, static):
            alone = [made.read([spec])[0] for spec in reads[1:]]
            out.append((alone, host_keys(made.encode(Prompt(prefix_ids))) if prefix_ids is not None else []))
        return out

    def after_the_first(use: Callable[[Any, list[Any]], T]) -> Callable[[Any], list[T]]:
        """Each sheet: its first prompt read, then `use(runner, the others)`."""
        def run(made) -> list[T]:
            out = []
            for reads in sheets:
                made.read(reads[:1])
                out.append(use(made, reads[1:]))
            return out
        return run

    def whole_reads(made) -> list[list[Any]]:
        made.prefixes = PromptCache(0)  # the same static path with every prompt encoded whole
        return [[made.read([spec])[0] for spec in reads[1:]] for reads in sheets]

    def replays(made, rest: list[Any]) -> tuple[list[Any], dict[str, Any]]:
        return [made.read([spec])[0] for spec in rest], graph_note(made)

    plain = one(lambda: runner(), plain_reads, device)
    batched = one(lambda: runner(static_decoder=True, static_encoder=True),
                  after_the_first(lambda made, rest: made.read(rest)), device)
    one_by_one = one(lambda: runner(static_decoder=True, static_encoder=True),
                     after_the_first(lambda made, rest: [made.read([spec])[0] for spec in rest]), device)
    whole = one(lambda: runner(static_encoder=True), whole_reads, device)
    graphed = one(lambda: runner(graphs=True), lambda made: (after_the_first(replays)(made), prefix_counters(made)),
                  device)
    for index, (over, prefix_ids, prefix_keys) in enumerate(static):
        alone, eager_keys = plain[index]
        replayed, captured = graphed[0][index]
        # The prefix's KV (sliced from the sheet's first prompt, encoded whole on the static path)
        # against the eager encoder's: token rows off by > 1e-2 are the random routers' flips.
        if prefix_ids is None:
            label = f"  sheet {index + 1}, no prefix cached,"
            print(label, "prefix KV vs eager  ", "- (the shape policy took no pass over a prefix: every prompt whole)")
        else:
            label = f"  over a {len(prefix_ids)}-token prefix,"
            rows = token_rows(eager_keys, prefix_keys)
            print(label, "prefix KV vs eager  ", f"largest {max(float(r.max()) for r in rows):.2e}; token rows off by "
                  f"> 1e-2: {sum(int((r > 1e-2).sum()) for r in rows)} of {sum(r.numel() for r in rows)}")
        print(label, "static vs whole     ", differences(whole[index], over),
              "(the same static path, the prompt encoded whole)")
        print(label, "static vs alone     ", differences(alone, over))
        print(label, "batched vs alone    ", differences(alone, batched[index]))
        print(label, "replay vs static    ", differences(one_by_one[index], replayed),
              f"(graphs held {captured.get('encoder_held', 'none')})", flush=True)
    print(f"  prefix counters: static {static_counters}, graphed {graphed[1]}", flush=True)


def check_vision(model, device, tiny: bool = False) -> None:
    """The vision graph path (app/engine/hf/graphs/vision.py) against the library's forward, eager
    (static) and replayed, on three new 512x384 frames at once (a 4-image bucket with padding); the
    static path's buffers dropped before the captured one is built. No capture on the CPU."""
    import io

    import torch
    from PIL import Image

    from app.engine.hf.graphs.vision import VisionGraphs

    pictures = [Image.open(io.BytesIO(data)).convert("RGB") for data in frames(3)]
    processed = image_processor(tiny)(pictures, return_tensors="pt")
    pixels = processed["pixel_values"].to(device, model.dtype)
    positions = processed["image_position_ids"].to(device)
    with torch.no_grad():
        library = model.model.encoder.get_image_features(pixels, positions, return_dict=True).pooler_output
        library = library.reshape(-1, library.shape[-1])
        static = VisionGraphs(model, device, capture=False).features(pixels, positions)
        release(device)
        scale = float(library.abs().max())
        said = (f"  vision static vs library: largest difference {float((static - library).abs().max()):.3g} "
                f"(largest value {scale:.3g})")
        if device.type != "cuda":
            print(f"{said}; no graph replay on {device.type}", flush=True)
            return
        graphed = VisionGraphs(model, device, capture=True)
        replayed = graphed.features(pixels, positions)
    if replayed is None:
        print(f"{said}; vision graph: capture failed, eager as designed: {dict(graphed.cache.failed)}", flush=True)
        return
    print(f"{said}; graph replay vs static: {float((replayed - static).abs().max()):.3g} "
          f"(captured {graphed.captures})", flush=True)


if __name__ == "__main__":
    main()
