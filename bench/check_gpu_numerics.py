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
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.models import build_model, full_config  # noqa: E402
from bench.workload import Specs, frames  # noqa: E402


def largest_difference(a, b) -> float:
    worst = 0.0
    for canvas_a, canvas_b in zip(a.slots, b.slots):
        for slot_a, slot_b in zip(canvas_a, canvas_b):
            worst = max(worst, max(abs(x - y) for x, y in zip(slot_a.label_logprobs, slot_b.label_logprobs)))
    return round(worst, 4)


def main() -> None:
    import torch

    from app.engine.hf.graphs.decoder import DecoderGraphs
    from app.engine.hf.graphs.encoder import EncoderGraphs
    from app.engine.hf.runner import DiffusionRunner

    device = torch.device("cuda")
    fused = "--fused-moe" in sys.argv[1:]
    split = "--split" in sys.argv[1:]
    flat = "--flat-turn" in sys.argv[1:]
    sizes = [arg for arg in sys.argv[1:] if arg not in ("--fused-moe", "--split", "--flat-turn")]
    for layers, dtype in [(int(n), getattr(torch, t)) for n, t in (c.split(":") for c in sizes)] or \
            ((6, torch.float32), (6, torch.bfloat16), (30, torch.bfloat16)):
        model = build_model(full_config(num_hidden_layers=layers), "cuda", dtype, "grouped_mm")
        specs = Specs(262144, 300)
        reads = [specs.read(), specs.read(canvases=4)] + [Specs(262144, n, seed=n).read() for n in (40, 700, 1500)]

        def runner(graphs: bool = False, static_decoder: bool = False, static_encoder: bool = False,
                   model=model) -> DiffusionRunner:
            made = DiffusionRunner(model, None, device=device, max_prompt_tokens=32768, kv_entries=64, max_rows=64,
                                   cuda_graphs=graphs)
            if static_decoder:
                made.graphs = DecoderGraphs(model, made.layer_types, device, pad_id=0, capture=False, policy=made.policy)
            if static_encoder:
                made.encoder_graphs = EncoderGraphs(model, made.layer_types, device, capture=False, policy=made.policy,
                                                    sliding_window=int(made.text_config.sliding_window))
            return made

        plain = runner()
        alone = [plain.read([spec])[0] for spec in reads]
        if fused:
            from app.engine.hf.moe.fused import use_fused_experts

            grouped_alone, reason = alone, use_fused_experts(model)
            if reason is not None:
                raise SystemExit(f"--fused-moe: {reason}")
            plain = runner()
            alone = [plain.read([spec])[0] for spec in reads]
            print(f"{layers} layers, {str(dtype).replace('torch.', '')}: experts as djev's Triton kernels")
            print("  kernels vs grouped_mm, alone    ", [largest_difference(a, b) for a, b in zip(grouped_alone, alone)])
        if split:
            from app.engine.hf.compiled import model_layers
            from app.engine.hf.layers import install

            library_alone = alone
            install(model_layers(model))
            plain = runner()
            alone = [plain.read([spec])[0] for spec in reads]
            print(f"{layers} layers, {str(dtype).replace('torch.', '')}: the split layer forward")
            print("  split vs library, alone         ", [largest_difference(a, b) for a, b in zip(library_alone, alone)])
        together = runner().read(reads)
        static_reads = [runner(static_decoder=True).read([spec])[0] for spec in reads]
        encoder_static = runner(static_encoder=True)
        encoder_reads = [encoder_static.read([spec])[0] for spec in reads]
        # Largest KV difference, and how many (layer, token) KV rows differ by more than 1e-2: a few rows
        # are random routers' expert flips; most rows would be a wrong mask, position or crop.
        token_diffs = [(a[0] - b[0]).abs().amax(dim=(0, 1, 3))
                       for spec in reads
                       for a, b in zip(plain.encode(spec.prompt).layers, encoder_static.encode(spec.prompt).layers)]
        kv = max(float(d.max()) for d in token_diffs)
        kv_rows = f"{sum(int((d > 1e-2).sum()) for d in token_diffs)} of {sum(d.numel() for d in token_diffs)}"
        both_static = runner(static_decoder=True, static_encoder=True)
        both_reads = [both_static.read([spec])[0] for spec in reads]
        graphed = runner(graphs=True)
        graph_reads = [graphed.read([spec])[0] for spec in reads]
        graph_batch = graphed.read(reads)
        static_batch = both_static.read(reads)
        print(f"{layers} layers, {str(dtype).replace('torch.', '')}:")
        print("  batched vs alone                 ", [largest_difference(a, b) for a, b in zip(alone, together)])
        print("  decoder static vs alone          ", [largest_difference(a, b) for a, b in zip(alone, static_reads)])
        print("  encoder static vs alone          ", [largest_difference(a, b) for a, b in zip(alone, encoder_reads)],
              f"(largest KV difference {kv:.2e}; KV rows off by > 1e-2: {kv_rows})")
        print("  batched, both static vs alone    ", [largest_difference(a, b) for a, b in zip(alone, static_batch)],
              f"(encoder passes unbucketed: {both_static.stats.get('encoder_unbucketed_passes', 0)})")
        print("  graph replay vs both static      ", [largest_difference(a, b) for a, b in zip(both_reads, graph_reads)])
        print("  batched graph replay vs static   ", [largest_difference(a, b) for a, b in zip(static_batch, graph_batch)],
              f"(decoder captured {graphed.graphs.captures}, failed: {dict(graphed.graphs.cache.failed)}; encoder "
              f"captured {graphed.encoder_graphs.captures}, failed: {dict(graphed.encoder_graphs.cache.failed)})", flush=True)
        check_prefix(runner)
        check_vision(model, device)
        if flat:
            check_flat(model, device, reads, alone)
        del model, plain, encoder_static, both_static, graphed
        torch.cuda.empty_cache()


def check_flat(model, device, reads, alone) -> None:
    """The flat turn: each read alone against the row path's read alone, all of them in one turn
    against alone, and the same through the graphs by token count against the eager forward."""
    from app.engine.hf.runner import DiffusionRunner

    def flat_runner(graphs: bool):
        made = DiffusionRunner(model, None, device=device, max_prompt_tokens=32768, kv_entries=64, max_rows=64,
                               cuda_graphs=graphs, turn_tokens=8192)
        assert made.flat is not None
        made.flat.prepare_graphs()  # (nothing without graphs)
        return made

    eager = flat_runner(graphs=False)
    flat_alone = [eager.read([spec])[0] for spec in reads]
    together = eager.read(reads)
    graphed = flat_runner(graphs=True)
    graph_alone = [graphed.read([spec])[0] for spec in reads]
    graph_together = graphed.read(reads)
    print("  flat turn alone vs row path alone ", [largest_difference(a, b) for a, b in zip(alone, flat_alone)])
    print("  flat turn batched vs alone        ", [largest_difference(a, b) for a, b in zip(flat_alone, together)])
    print("  flat graphs vs flat eager, alone  ", [largest_difference(a, b) for a, b in zip(flat_alone, graph_alone)])
    print("  flat graphs batched vs eager      ", [largest_difference(a, b) for a, b in zip(together, graph_together)],
          f"(graph fallbacks {graphed.stats.get('flat_graph_fallbacks', 0)})", flush=True)


def check_prefix(runner) -> None:
    """Prompts encoded over a shared prefix: two sheets (200 and 170 tokens, so prefixes of 192 and
    160 tokens, both in 192 slots, the second right-aligned after 32 stale ones) ahead of 100-token
    states. After each sheet's first prompt, the others read over the prefix sliced from its KV:
    on the encoder's static path (no capture), batched, and captured, where the 160-token prefix
    replays the graph the 192-token one captured; each against the read of the whole prompt alone."""
    import dataclasses

    from app.engine.base import Prompt
    from app.engine.hf.prompts import PromptCache

    def sheet_reads(tokens: int, seed: int) -> list:
        sheet = Specs(262144, tokens, seed=seed).ids(tokens)
        return [dataclasses.replace(spec, prompt=Prompt(sheet + spec.prompt.ids))
                for spec in (Specs(262144, 100, seed=seed + 1 + n).read() for n in range(4))]

    plain = runner()
    static = runner(static_encoder=True)
    batching = runner(static_decoder=True, static_encoder=True)
    both = runner(static_decoder=True, static_encoder=True)
    graphed = runner(graphs=True)
    whole = runner(static_encoder=True)  # the same static path with every prompt encoded whole
    whole.prefixes = PromptCache(0)
    for tokens, seed in ((200, 7), (170, 70)):
        reads = sheet_reads(tokens, seed)
        alone = [plain.read([spec])[0] for spec in reads[1:]]
        for made in (static, batching, both, graphed):
            made.read(reads[:1])
        over = [static.read([spec])[0] for spec in reads[1:]]
        batched = batching.read(reads[1:])
        one_by_one = [both.read([spec])[0] for spec in reads[1:]]
        whole_static = [whole.read([spec])[0] for spec in reads[1:]]
        replayed = [graphed.read([spec])[0] for spec in reads[1:]]
        # The prefix's KV (sliced from the sheet's first prompt, encoded whole on the static path)
        # against the eager encoder's: token rows off by > 1e-2 are the random routers' flips.
        (prefix_ids, prefix_kv), = [(ids, kv) for ids, kv in static.prefixes.values()
                                    if ids == reads[1].prompt.ids[:len(ids)]]
        label = f"  over a {len(prefix_ids)}-token prefix,"
        rows = [(a[0] - b[0]).abs().amax(dim=(0, 1, 3))
                for a, b in zip(plain.encode(Prompt(prefix_ids)).layers, prefix_kv.layers)]
        print(label, "prefix KV vs eager  ", f"largest {max(float(r.max()) for r in rows):.2e}; token rows off by "
              f"> 1e-2: {sum(int((r > 1e-2).sum()) for r in rows)} of {sum(r.numel() for r in rows)}")
        print(label, "static vs whole     ", [largest_difference(a, b) for a, b in zip(whole_static, over)],
              "(the same static path, the prompt encoded whole)")
        print(label, "static vs alone     ", [largest_difference(a, b) for a, b in zip(alone, over)])
        print(label, "batched vs alone    ", [largest_difference(a, b) for a, b in zip(alone, batched)])
        print(label, "replay vs static    ", [largest_difference(a, b) for a, b in zip(one_by_one, replayed)],
              f"(graphs held {sorted(graphed.encoder_graphs.cache)})", flush=True)
    print(f"  prefix counters: static {dict((k, v) for k, v in static.stats.items() if 'prefix' in k)}, "
          f"graphed {dict((k, v) for k, v in graphed.stats.items() if 'prefix' in k)}", flush=True)


def check_vision(model, device) -> None:
    """The vision graph path (app/engine/hf/graphs/vision.py) against the library's forward, eager
    (static) and replayed, on three new 512x384 frames at once (a 4-image bucket with padding)."""
    import io

    import torch
    from PIL import Image
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    from app.engine.hf.graphs.vision import VisionGraphs

    pictures = [Image.open(io.BytesIO(data)).convert("RGB") for data in frames(3)]
    processed = Gemma4ImageProcessorPil()(pictures, return_tensors="pt")
    pixels = processed["pixel_values"].to(device, model.dtype)
    positions = processed["image_position_ids"].to(device)
    with torch.no_grad():
        library = model.model.encoder.get_image_features(pixels, positions, return_dict=True).pooler_output
        library = library.reshape(-1, library.shape[-1])
        static = VisionGraphs(model, device, capture=False).features(pixels, positions)
        graphed = VisionGraphs(model, device, capture=True)
        replayed = graphed.features(pixels, positions)
    if replayed is None:
        print(f"  vision graph: capture failed, eager as designed: {dict(graphed.cache.failed)}", flush=True)
        return
    scale = float(library.abs().max())
    print(f"  vision static vs library: largest difference {float((static - library).abs().max()):.3g} "
          f"(largest value {scale:.3g}); graph replay vs static: {float((replayed - static).abs().max()):.3g} "
          f"(captured {graphed.captures})", flush=True)


if __name__ == "__main__":
    main()
