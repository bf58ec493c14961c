"""One layer's experts on the GPU: transformers' grouped_mm (compiled, as TORCH_COMPILE runs it) vs
djev's Triton kernels (app/engine/hf/moe/fused.py) and, with --weights fp8, the FP8 kernels
(app/engine/hf/moe/fp8.py), each replayed as a CUDA graph, at the token counts the engine sees: one
canvas (32 tokens), 8 and 32 canvases, one prompt, 32 prompts.

The full model's experts (128 x top-8, hidden 2816, expert FFN 704, bf16 activations) with a uniform
random router, as random weights route; the FP8 banks are those weights quantized per output channel
(app/engine/hf/fp8.py). For each count: median ms of each path, the bytes of the experts that were
chosen at least once over that time (GB/s: the memory-bound floor; an FP8 expert is half a bf16 one,
plus its scales), TFLOP/s, and the largest difference from the path's reference: grouped_mm for the
bf16 kernels (a rounding step or so), `reference_expert_rows` for the FP8 ones (their own arithmetic
in torch), with the FP8 kernels' difference from grouped_mm beside it (what FP8 costs). With
--sweep, every tile configuration of SWEEP (FP8_SWEEP for fp8) is timed too, so the tile choices
come from a measurement.

    python bench/bench_gpu_moe.py [--tokens 32,256,1024,4096,10240] [--weights bf16,fp8] [--sweep] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import event_median_ms, numbers  # noqa: E402
from bench.models import Experts  # noqa: E402

EXPERTS, TOP_K, HIDDEN, INTER = 128, 8, 2816, 704
WEIGHTS = ("bf16", "fp8")
Tile = tuple[int, int, int, int, int]  # block_m, block_n, block_k, warps, stages
SWEEP: list[Tile] = [
    (16, 64, 128, 4, 3), (16, 64, 128, 4, 4), (16, 128, 128, 4, 3), (16, 64, 256, 4, 3), (16, 32, 128, 4, 4),
    (32, 64, 128, 4, 3), (32, 128, 64, 4, 4),
    (64, 128, 64, 8, 3), (64, 128, 64, 4, 4), (64, 64, 64, 4, 4),
    (128, 128, 64, 8, 3), (128, 128, 64, 8, 4), (128, 64, 64, 4, 4), (128, 256, 64, 8, 3),
]
DOWN_SWEEP: list[Tile] = [  # the down kernel's own tiles under the LARGE block_m (its K is the expert FFN, 704)
    (128, 128, 64, 8, 4), (128, 256, 64, 8, 3), (128, 128, 128, 8, 3), (128, 64, 128, 4, 3), (128, 128, 32, 4, 5),
    (128, 256, 32, 8, 4), (128, 128, 64, 4, 4),
]
FP8_SWEEP: list[Tile] = [  # e4m3 tiles: half the bytes a row of K, so longer K blocks
    (16, 64, 128, 4, 3), (16, 64, 128, 4, 4), (16, 128, 128, 4, 4), (16, 64, 256, 4, 3), (16, 32, 256, 4, 4),
    (32, 64, 128, 4, 4), (32, 128, 128, 4, 3), (32, 64, 256, 4, 3),
    (64, 64, 128, 4, 4), (64, 128, 128, 8, 3), (64, 128, 64, 4, 4),
    (128, 128, 128, 8, 3), (128, 128, 64, 8, 4), (128, 256, 128, 8, 3), (128, 128, 128, 4, 4),
]
FP8_DOWN_SWEEP: list[Tile] = [  # the FP8 down kernel's own tiles under its LARGE block_m (64)
    (64, 256, 64, 4, 3), (64, 256, 64, 8, 3), (64, 128, 128, 4, 3), (64, 64, 64, 4, 4), (64, 128, 64, 8, 4),
]


def weights_list(text: str) -> list[str]:
    """An argparse type: comma-separated weight formats out of WEIGHTS."""
    chosen = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [part for part in chosen if part not in WEIGHTS]
    if unknown or not chosen:
        raise argparse.ArgumentTypeError(f"{text!r}: a comma-separated list of {', '.join(WEIGHTS)}")
    return chosen


def expert_bytes(weights: str, hidden: int = HIDDEN, inter: int = INTER) -> int:
    """One expert's bytes as the kernels read them: its gate/up and down banks, 2 bytes a weight in
    bf16; 1 in fp8, plus a float32 scale per output channel."""
    count = 2 * inter * hidden + hidden * inter
    return 2 * count if weights == "bf16" else count + 4 * (2 * inter + hidden)


def sweep_tries(chosen: Any, large: Any, sweep: Sequence[Tile], down_sweep: Sequence[Tile],
                config: Callable[..., Any]) -> list[tuple[str, Any, Any]]:
    """(label, tiles, down tiles or None) for each tile configuration of `sweep` other than the
    chosen one, and where the chosen one is `large`, each of `down_sweep` as its down kernel's."""
    tries = [(f"sweep {values}", config(*values), None) for values in sweep if config(*values) != chosen]
    if chosen == large:
        tries += [(f"down {values}", chosen, config(*values)) for values in down_sweep]
    return tries


def graphed(call: Callable[[], Any]) -> Callable[[], Any]:
    """`call` captured as a CUDA graph (bench.naive.captured); returns the replay."""
    from bench.naive import captured

    graph, output = captured(call)
    return lambda: (graph.replay(), output)[1]


def main() -> None:
    import torch
    from transformers.integrations.moe import grouped_mm_experts_forward

    from app.engine.hf import fp8
    from app.engine.hf.moe import fp8 as fp8_moe
    from app.engine.hf.moe import fused as fused_moe

    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=numbers(int), default="32,256,1024,4096,10240")
    parser.add_argument("--weights", type=weights_list, default="bf16", help="bf16, fp8 or both (bf16,fp8)")
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.manual_seed(0)
    device = torch.device("cuda")
    gate_up = torch.randn(EXPERTS, 2 * INTER, HIDDEN, device=device, dtype=torch.bfloat16) * HIDDEN ** -0.5
    down = torch.randn(EXPERTS, HIDDEN, INTER, device=device, dtype=torch.bfloat16) * INTER ** -0.5
    banks = fp8_moe.Banks(*fp8.quantize_weight(gate_up), *fp8.quantize_weight(down))
    module = Experts(gate_up, down)
    library = torch.compile(lambda x, i, w: grouped_mm_experts_forward(module, x, i, w), dynamic=False)
    summed = torch.compile(fused_moe.weighted_sum, dynamic=False)  # compiled, as in the server's layers

    def kernels(x: Any, index: Any, weights: Any, config: Any = None, down_config: Any = None) -> Any:
        return summed(fused_moe.expert_rows(x, index, gate_up, down, config, down_config), weights)

    def fp8_kernels(x: Any, index: Any, weights: Any, config: Any = None, down_config: Any = None) -> Any:
        return summed(fp8_moe.fp8_expert_rows(x, index, *banks, config, down_config), weights)

    rows: list[dict[str, Any]] = []
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; experts {EXPERTS} x top-{TOP_K}, "
          f"hidden {HIDDEN}, expert FFN {INTER}, bf16 activations, weights {'+'.join(args.weights)}; "
          f"CUDA-graph replays, median of {args.reps}", flush=True)
    for tokens in args.tokens:
        x = torch.randn(tokens, HIDDEN, device=device, dtype=torch.bfloat16)
        scores = torch.rand(tokens, EXPERTS, device=device)
        weights, index = torch.topk(torch.softmax(scores, -1), TOP_K, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        chosen = int(torch.unique(index).numel())
        flops = 2 * tokens * TOP_K * 3 * HIDDEN * INTER
        library_out = library(x, index, weights)

        def measure(name: str, call: Callable[[], Any], kind: str, reference: Any, **beside: Any) -> dict[str, Any]:
            replay = graphed(call)
            ms = event_median_ms(replay, args.reps)
            out = replay().float()
            row = {"tokens": tokens, "path": name, "weights": kind, "ms": round(ms, 4), "experts_chosen": chosen,
                   "GB_per_s": round(chosen * expert_bytes(kind) / ms / 1e6, 1), "TFLOP_per_s": round(flops / ms / 1e9, 1),
                   "max_diff": round((out - reference.float()).abs().max().item(), 5)}
            row.update({key: round((out - other.float()).abs().max().item(), 5) for key, other in beside.items()})
            rows.append(row)
            extra = "".join(f"  {key} {row[key]}" for key in beside)
            print(f"  tokens {tokens:6d}  {name:40s} {ms:8.3f} ms  {row['GB_per_s']:7.1f} GB/s  "
                  f"{row['TFLOP_per_s']:6.1f} TFLOP/s  max diff {row['max_diff']}{extra}", flush=True)
            return row

        def tried(label: str, call: Callable[[], Any], kind: str, reference: Any, **beside: Any) -> None:
            try:
                measure(f"  {label}", call, kind, reference, **beside)
            except Exception as exc:  # noqa: BLE001 - e.g. out of shared memory: reported, not fatal
                print(f"  tokens {tokens:6d}  {label}: failed {type(exc).__name__}: {exc}"[:200], flush=True)

        base = measure("grouped_mm (compiled)", lambda: library(x, index, weights), "bf16", library_out)
        if "bf16" in args.weights:
            config = fused_moe.block_config(tokens * TOP_K, EXPERTS)
            fused = measure(f"djev kernels {tuple(vars(config).values())}", lambda: kernels(x, index, weights),
                            "bf16", library_out)
            print(f"  tokens {tokens:6d}  kernels / grouped_mm: {fused['ms'] / base['ms']:.2f}x", flush=True)
            if args.sweep:
                for label, tiles, down_tiles in sweep_tries(config, fused_moe.LARGE, SWEEP, DOWN_SWEEP,
                                                            fused_moe.BlockConfig):
                    tried(label, lambda c=tiles, d=down_tiles: kernels(x, index, weights, c, d), "bf16", library_out)
        if "fp8" in args.weights:
            reference = summed(fp8_moe.reference_expert_rows(x, index, *banks), weights)
            config = fp8_moe.block_config(tokens * TOP_K, EXPERTS)
            quantized = measure(f"djev FP8 kernels {tuple(vars(config).values())}",
                                lambda: fp8_kernels(x, index, weights), "fp8", reference, vs_grouped_mm=library_out)
            print(f"  tokens {tokens:6d}  FP8 kernels / grouped_mm: {quantized['ms'] / base['ms']:.2f}x", flush=True)
            if args.sweep:
                for label, tiles, down_tiles in sweep_tries(config, fp8_moe.LARGE, FP8_SWEEP, FP8_DOWN_SWEEP,
                                                            fused_moe.BlockConfig):
                    tried(f"fp8 {label}", lambda c=tiles, d=down_tiles: fp8_kernels(x, index, weights, c, d), "fp8",
                          reference, vs_grouped_mm=library_out)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
