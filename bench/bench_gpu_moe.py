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

At the end, per format and token count (`summary`): the kernels' tiles as served and the fastest
tried, each against the layer's floor, max(the chosen experts' bytes at --bandwidth-tbs, their math
at --tflops; twice that for FP8's tensor cores), and whether the fastest is within WITHIN (1.3x) of
it; then the tiles by rows an expert that those fastest ones make (`proposed_tiles`), in the form of
the kernels' TILES and LARGE.

    python bench/bench_gpu_moe.py [--tokens 32,256,1024,4096,10240] [--weights bf16,fp8] [--sweep] [--json OUT]
    python bench/bench_gpu_moe.py --weights bf16,fp8 --tokens 16,128,512,1024,2048,4096 --sweep   # 1-256 rows
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


WITHIN = 1.3  # the kernels' target: a layer within this of its floor, at every row count (1 to 256 an expert)
BANDWIDTH_TBS, TFLOPS = 3.0, 650.0  # the floor's memory bandwidth and bf16 math (bench/profile_gpu.py's)


def floor_ms(weights: str, tokens: int, experts_chosen: int, bandwidth_tbs: float = BANDWIDTH_TBS,
             tflops: float = TFLOPS) -> float:
    """One layer's floor in ms: the chosen experts' bytes at `bandwidth_tbs` TB/s or the pairs' math
    at `tflops` TFLOP/s (twice that in FP8), whichever is longer."""
    read = experts_chosen * expert_bytes(weights) / (bandwidth_tbs * 1e12)
    math = 2 * tokens * TOP_K * 3 * HIDDEN * INTER / (tflops * 1e12 * (2 if weights == "fp8" else 1))
    return max(read, math) * 1000


def summary(rows: Sequence[dict[str, Any]], bandwidth_tbs: float = BANDWIDTH_TBS,
            tflops: float = TFLOPS) -> list[dict[str, Any]]:
    """Per format and token count, from the measured rows of djev's kernels (those with a "tile"):
    the served tiles' ms, the fastest tried (tile, down tile, ms), the floor and each one's ratio to it,
    and whether the fastest is within WITHIN. Pure."""
    found: dict[tuple[str, int], dict[str, Any]] = {}
    for row in rows:
        if row.get("tile") is None:
            continue
        key = (row["weights"], row["tokens"])
        entry = found.setdefault(key, {
            "weights": row["weights"], "tokens": row["tokens"], "rows_an_expert": row["tokens"] * TOP_K / EXPERTS,
            "floor_ms": round(floor_ms(row["weights"], row["tokens"], row["experts_chosen"], bandwidth_tbs, tflops), 4),
            "served_ms": None, "best": None})
        if row.get("served"):
            entry["served_ms"] = row["ms"]
        if entry["best"] is None or row["ms"] < entry["best"]["ms"]:
            entry["best"] = {"tile": row["tile"], "down_tile": row["down_tile"], "ms": row["ms"]}
    out = []
    for _, entry in sorted(found.items()):
        best, floor = entry.pop("best"), entry["floor_ms"]
        served = entry["served_ms"]
        out.append({**entry, "served_x_floor": round(served / floor, 2) if served else None,
                    "best_tile": best["tile"], "best_down_tile": best["down_tile"], "best_ms": best["ms"],
                    "best_x_floor": round(best["ms"] / floor, 2), "within": best["ms"] <= WITHIN * floor})
    return out


def proposed_tiles(entries: Sequence[dict[str, Any]], weights: str) -> tuple[list[tuple[float, Tile, Tile]], tuple[Tile, Tile]]:
    """From `summary`'s entries of one format: (TILES, LARGE) as the kernels take them, each limit the
    rows an expert at a measured token count with its fastest (tile, down tile), neighbours with the
    same tiles merged (the larger limit kept), and the largest count's as LARGE. Pure."""
    chosen = sorted((entry for entry in entries if entry["weights"] == weights), key=lambda entry: entry["tokens"])
    if not chosen:
        raise ValueError(f"no measured kernels for {weights}")
    buckets: list[tuple[float, Tile, Tile]] = []
    for entry in chosen[:-1]:
        tiles = (tuple(entry["best_tile"]), tuple(entry["best_down_tile"]))
        if buckets and buckets[-1][1:] == tiles:
            buckets.pop()
        buckets.append((entry["rows_an_expert"], *tiles))  # type: ignore[arg-type]
    large = (tuple(chosen[-1]["best_tile"]), tuple(chosen[-1]["best_down_tile"]))
    while buckets and buckets[-1][1:] == large:
        buckets.pop()
    return buckets, large  # type: ignore[return-value]


def summary_lines(entries: Sequence[dict[str, Any]]) -> list[str]:
    """`summary`'s table (markdown) and, per format, the tiles it proposes."""
    from bench.common import markdown_table

    table = markdown_table(
        ["weights", "tokens", "rows an expert", "floor ms", "served ms", "x floor", "fastest tile (down)", "ms",
         "x floor", f"within {WITHIN}x"],
        [[e["weights"], e["tokens"], f"{e['rows_an_expert']:g}", e["floor_ms"], e["served_ms"] or "-",
          e["served_x_floor"] or "-",
          f"{tuple(e['best_tile'])}" + (f" ({tuple(e['best_down_tile'])})" if e["best_down_tile"] != e["best_tile"] else ""),
          e["best_ms"], e["best_x_floor"], "yes" if e["within"] else "no"] for e in entries])
    lines = [table]
    for weights in dict.fromkeys(entry["weights"] for entry in entries):
        buckets, large = proposed_tiles(entries, weights)
        lines.append(f"{weights}: fastest tiles by rows an expert: "
                     + ", ".join(f"<= {limit:g}: {tile}" + (f" / down {down}" if down != tile else "")
                                 for limit, tile, down in buckets)
                     + f"; past that: {large[0]}" + (f" / down {large[1]}" if large[1] != large[0] else ""))
    return lines


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
    from app.engine.hf.moe.pairs import both_tiles

    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=numbers(int), default="32,256,1024,4096,10240")
    parser.add_argument("--weights", type=weights_list, default="bf16", help="bf16, fp8 or both (bf16,fp8)")
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--bandwidth-tbs", type=float, default=BANDWIDTH_TBS,
                        help=f"the floor's memory bandwidth (default {BANDWIDTH_TBS})")
    parser.add_argument("--tflops", type=float, default=TFLOPS, help=f"the floor's bf16 TFLOP/s (default {TFLOPS:g})")
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

        def measure(name: str, call: Callable[[], Any], kind: str, reference: Any, tiles: Any = None,
                    served: bool = False, **beside: Any) -> dict[str, Any]:
            """Time `call`; `tiles` (gate/up, down BlockConfigs) for djev's kernels, `served` for the
            tiles the engine picks at this count."""
            replay = graphed(call)
            ms = event_median_ms(replay, args.reps)
            out = replay().float()
            row = {"tokens": tokens, "path": name, "weights": kind, "ms": round(ms, 4), "experts_chosen": chosen,
                   "tile": list(vars(tiles[0]).values()) if tiles else None,
                   "down_tile": list(vars(tiles[1]).values()) if tiles else None, "served": served,
                   "GB_per_s": round(chosen * expert_bytes(kind) / ms / 1e6, 1), "TFLOP_per_s": round(flops / ms / 1e9, 1),
                   "max_diff": round((out - reference.float()).abs().max().item(), 5)}
            row.update({key: round((out - other.float()).abs().max().item(), 5) for key, other in beside.items()})
            rows.append(row)
            extra = "".join(f"  {key} {row[key]}" for key in beside)
            print(f"  tokens {tokens:6d}  {name:40s} {ms:8.3f} ms  {row['GB_per_s']:7.1f} GB/s  "
                  f"{row['TFLOP_per_s']:6.1f} TFLOP/s  max diff {row['max_diff']}{extra}", flush=True)
            return row

        def tried(label: str, call: Callable[[], Any], kind: str, reference: Any, tiles: Any, **beside: Any) -> None:
            try:
                measure(f"  {label}", call, kind, reference, tiles, **beside)
            except Exception as exc:  # noqa: BLE001 - e.g. out of shared memory: reported, not fatal
                print(f"  tokens {tokens:6d}  {label}: failed {type(exc).__name__}: {exc}"[:200], flush=True)

        base = measure("grouped_mm (compiled)", lambda: library(x, index, weights), "bf16", library_out)
        if "bf16" in args.weights:
            config = fused_moe.block_config(tokens * TOP_K, EXPERTS)
            fused = measure(f"djev kernels {tuple(vars(config).values())}", lambda: kernels(x, index, weights),
                            "bf16", library_out, both_tiles(config, None, fused_moe.DOWN_TILES), served=True)
            print(f"  tokens {tokens:6d}  kernels / grouped_mm: {fused['ms'] / base['ms']:.2f}x", flush=True)
            if args.sweep:
                for label, tiles, down_tiles in sweep_tries(config, fused_moe.LARGE, SWEEP, DOWN_SWEEP,
                                                            fused_moe.BlockConfig):
                    tried(label, lambda c=tiles, d=down_tiles: kernels(x, index, weights, c, d), "bf16", library_out,
                          both_tiles(tiles, down_tiles, fused_moe.DOWN_TILES))
        if "fp8" in args.weights:
            reference = summed(fp8_moe.reference_expert_rows(x, index, *banks), weights)
            config = fp8_moe.block_config(tokens * TOP_K, EXPERTS)
            quantized = measure(f"djev FP8 kernels {tuple(vars(config).values())}",
                                lambda: fp8_kernels(x, index, weights), "fp8", reference,
                                both_tiles(config, None, fp8_moe.DOWN_TILES), served=True, vs_grouped_mm=library_out)
            print(f"  tokens {tokens:6d}  FP8 kernels / grouped_mm: {quantized['ms'] / base['ms']:.2f}x", flush=True)
            if args.sweep:
                for label, tiles, down_tiles in sweep_tries(config, fp8_moe.LARGE, FP8_SWEEP, FP8_DOWN_SWEEP,
                                                            fused_moe.BlockConfig):
                    tried(f"fp8 {label}", lambda c=tiles, d=down_tiles: fp8_kernels(x, index, weights, c, d), "fp8",
                          reference, both_tiles(tiles, down_tiles, fp8_moe.DOWN_TILES), vs_grouped_mm=library_out)
    entries = summary(rows, args.bandwidth_tbs, args.tflops)
    if entries:
        print(f"\nthe kernels against one layer's floor (max of the chosen experts' bytes at {args.bandwidth_tbs} TB/s, "
              f"the math at {args.tflops:g} TFLOP/s, twice that in FP8):", flush=True)
        print("\n".join(summary_lines(entries)), flush=True)
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "summary": entries}, indent=1))


if __name__ == "__main__":
    main()
