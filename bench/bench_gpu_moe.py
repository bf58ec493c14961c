"""One layer's experts on the GPU: transformers' grouped_mm (compiled, as TORCH_COMPILE runs it) vs
djev's Triton kernels (app/engine/hf/moe/fused.py), each replayed as a CUDA graph, at the token counts
the engine sees: one canvas (32 tokens), 8 and 32 canvases, one prompt, 32 prompts.

The full model's experts (128 x top-8, hidden 2816, expert FFN 704, bf16) with a uniform random
router, as random weights route. For each count: median ms of each path, the bytes of the experts
that were chosen at least once over that time (GB/s: the memory-bound floor), TFLOP/s, and the
largest difference of the kernels' output from grouped_mm's (bf16: a rounding step or so). With
--sweep, every tile configuration of SWEEP is timed too, so block_config's choices come from a
measurement.

    python bench/bench_gpu_moe.py [--tokens 32,256,1024,4096,10240] [--sweep] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import event_median_ms, numbers  # noqa: E402
from bench.models import Experts  # noqa: E402

EXPERTS, TOP_K, HIDDEN, INTER = 128, 8, 2816, 704
SWEEP = [  # block_m, block_n, block_k, warps, stages
    (16, 64, 128, 4, 3), (16, 64, 128, 4, 4), (16, 128, 128, 4, 3), (16, 64, 256, 4, 3), (16, 32, 128, 4, 4),
    (32, 64, 128, 4, 3), (32, 128, 64, 4, 4),
    (64, 128, 64, 8, 3), (64, 128, 64, 4, 4), (64, 64, 64, 4, 4),
    (128, 128, 64, 8, 3), (128, 128, 64, 8, 4), (128, 64, 64, 4, 4), (128, 256, 64, 8, 3),
]
DOWN_SWEEP = [  # the down kernel's own tiles under the LARGE block_m (its K is the expert FFN, 704)
    (128, 128, 64, 8, 4), (128, 256, 64, 8, 3), (128, 128, 128, 8, 3), (128, 64, 128, 4, 3), (128, 128, 32, 4, 5),
    (128, 256, 32, 8, 4), (128, 128, 64, 4, 4),
]


def graphed(call: Callable[[], Any]) -> Callable[[], Any]:
    """`call` captured as a CUDA graph (bench.naive.captured); returns the replay."""
    from bench.naive import captured

    graph, output = captured(call)
    return lambda: (graph.replay(), output)[1]


def main() -> None:
    import torch
    from transformers.integrations.moe import grouped_mm_experts_forward

    from app.engine.hf.moe import fused as fused_moe

    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=numbers(int), default="32,256,1024,4096,10240")
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.manual_seed(0)
    device = torch.device("cuda")
    gate_up = torch.randn(EXPERTS, 2 * INTER, HIDDEN, device=device, dtype=torch.bfloat16) * HIDDEN ** -0.5
    down = torch.randn(EXPERTS, HIDDEN, INTER, device=device, dtype=torch.bfloat16) * INTER ** -0.5
    module = Experts(gate_up, down)
    expert_bytes = (gate_up[0].numel() + down[0].numel()) * 2
    library = torch.compile(lambda x, i, w: grouped_mm_experts_forward(module, x, i, w), dynamic=False)
    summed = torch.compile(fused_moe.weighted_sum, dynamic=False)  # compiled, as in the server's layers

    def kernels(x: Any, index: Any, weights: Any, config: Any = None, down_config: Any = None) -> Any:
        return summed(fused_moe.expert_rows(x, index, gate_up, down, config, down_config), weights)

    rows: list[dict[str, Any]] = []
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; experts {EXPERTS} x top-{TOP_K}, "
          f"hidden {HIDDEN}, expert FFN {INTER}, bf16; CUDA-graph replays, median of {args.reps}", flush=True)
    for tokens in args.tokens:
        x = torch.randn(tokens, HIDDEN, device=device, dtype=torch.bfloat16)
        scores = torch.rand(tokens, EXPERTS, device=device)
        weights, index = torch.topk(torch.softmax(scores, -1), TOP_K, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        chosen = int(torch.unique(index).numel())
        moved = chosen * expert_bytes
        flops = 2 * tokens * TOP_K * 3 * HIDDEN * INTER
        reference = library(x, index, weights)

        def measure(name: str, call: Callable[[], Any]) -> dict[str, Any]:
            replay = graphed(call)
            ms = event_median_ms(replay, args.reps)
            out = replay()
            row = {"tokens": tokens, "path": name, "ms": round(ms, 4), "experts_chosen": chosen,
                   "GB_per_s": round(moved / ms / 1e6, 1), "TFLOP_per_s": round(flops / ms / 1e9, 1),
                   "max_diff": round((out.float() - reference.float()).abs().max().item(), 5)}
            rows.append(row)
            print(f"  tokens {tokens:6d}  {name:34s} {ms:8.3f} ms  {row['GB_per_s']:7.1f} GB/s  "
                  f"{row['TFLOP_per_s']:6.1f} TFLOP/s  max diff {row['max_diff']}", flush=True)
            return row

        base = measure("grouped_mm (compiled)", lambda: library(x, index, weights))
        chosen_config = fused_moe.block_config(tokens * TOP_K, EXPERTS)
        fused = measure(f"djev kernels {tuple(vars(chosen_config).values())}",
                        lambda: kernels(x, index, weights))
        print(f"  tokens {tokens:6d}  kernels / grouped_mm: {fused['ms'] / base['ms']:.2f}x", flush=True)
        if args.sweep:
            tries = [(f"sweep {values}", fused_moe.BlockConfig(*values), None) for values in SWEEP
                     if fused_moe.BlockConfig(*values) != chosen_config]
            if chosen_config == fused_moe.LARGE:
                tries += [(f"down {values}", chosen_config, fused_moe.BlockConfig(*values)) for values in DOWN_SWEEP]
            for label, config, down in tries:
                try:
                    measure(f"  {label}", lambda c=config, d=down: kernels(x, index, weights, c, d))
                except Exception as exc:  # noqa: BLE001 - e.g. out of shared memory: reported, not fatal
                    print(f"  tokens {tokens:6d}  {label}: failed {type(exc).__name__}: {exc}"[:200], flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
