"""The segment kernel's tiles, timed on the card (GPU): one layer's attention over three turn shapes.

- `long`: a chunk of a long prompt (`--rows` query rows at `--position`, every earlier key stored), a
  full-attention layer of the full-size model (16 query heads of 512, 2 KV heads);
- `window`: the same chunk on a sliding layer (16 x 256 query heads, 8 KV heads, a window of 1024);
- `ticket`: 16 new states of ~115 tokens and their 16-token canvases (the served ticket's turn), on a
  full-attention layer.

For each shape and each tile (BLOCK_M rows, BLOCK_N keys a step, warps, pipeline stages, parts of the
head size) the kernel's median time over `--reps` launches (CUDA events), its rate in TFLOP/s (the
attention's multiply-adds, QK and PV, of the keys each row sees: a part's recomputed QK not counted),
and the largest difference from the first tile's output. The full-size model has 5 full-attention and
25 sliding layers: a long chunk's attention costs about 5 x `long` + 25 x `window`.

    python bench/bench_gpu_segments.py                      # on a GPU box
    python bench/bench_gpu_segments.py --position 50000 --rows 2048
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import event_median_ms, fmt, header, machine, markdown_table, write_json  # noqa: E402

BLOCK_TOKENS = 16
# (BLOCK_M, BLOCK_N, warps, stages, parts)
FULL_TILES = [(64, 64, 8, 1, 2), (64, 64, 8, 2, 2), (64, 32, 8, 2, 2), (64, 32, 4, 2, 2), (64, 64, 8, 1, 4),
              (64, 32, 8, 3, 4), (64, 64, 4, 2, 4), (128, 32, 8, 1, 4), (128, 32, 8, 2, 4), (128, 64, 8, 1, 4),
              (128, 32, 8, 2, 2), (32, 64, 4, 2, 1), (32, 32, 4, 2, 1), (32, 64, 8, 2, 1), (16, 64, 4, 2, 1),
              (64, 32, 8, 2, 1), (128, 64, 8, 2, 8), (128, 32, 4, 2, 4), (64, 32, 16, 2, 1), (64, 64, 16, 1, 1),
              (128, 32, 16, 2, 2), (128, 64, 16, 2, 2)]
SLIDING_TILES = [(64, 64, 4, 1, 1), (64, 64, 4, 2, 1), (64, 64, 8, 2, 1), (128, 64, 8, 2, 1), (128, 32, 8, 2, 1),
                 (128, 64, 8, 3, 2), (64, 32, 4, 3, 1), (128, 128, 8, 2, 2), (64, 128, 8, 2, 1)]


def build(kind: str, position: int, rows: int, device: str) -> dict[str, Any]:
    """The tensors and metadata of one layer's turn of `kind`."""
    import torch

    from app.engine.hf.segment_kernel import SEGMENT_FIELDS

    full = kind != "window"
    heads, kv_heads, dim = (16, 2, 512) if full else (16, 8, 256)
    window = 0 if full else 1024
    segments: list[list[int]] = []
    table: list[int] = []
    if kind == "ticket":
        state, canvas, count = 115, 16, 16
        q_row = 0
        for n in range(count):  # a prompt segment, then its canvas over it (own rows after the stored)
            first = len(table)
            blocks = -(-state // BLOCK_TOKENS)
            table += list(range(first, first + blocks))
            segments.append([q_row, q_row + state, 0, 0, state, 0, 0, window, first, 0])
            q_row += state
            segments.append([q_row, q_row + canvas, state, 0, state, q_row, q_row + canvas, 0, first, 0])
            q_row += canvas
        total_rows, pool_blocks = q_row, len(table)
        seen = count * (state * (state + 1) // 2 + canvas * (state + canvas))
    else:
        end = position + rows
        pool_blocks = -(-end // BLOCK_TOKENS)
        table = list(range(pool_blocks))
        start = max(0, position - window + 1) if window else 0
        segments.append([0, rows, position, start // BLOCK_TOKENS * BLOCK_TOKENS if window else 0, end, 0, 0,
                         window, 0, 0])
        total_rows = rows
        seen = sum(min(position + r + 1, window) if window else position + r + 1 for r in range(rows))
    generator = torch.Generator(device=device).manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator, device=device, dtype=torch.bfloat16)

    return {
        "queries": rand(heads, total_rows, dim), "keys": rand(kv_heads, total_rows, dim),
        "values": rand(kv_heads, total_rows, dim),
        "key_pool": rand(pool_blocks, BLOCK_TOKENS, kv_heads, dim), "value_pool": rand(pool_blocks, BLOCK_TOKENS, kv_heads, dim),
        "segments": torch.tensor(segments, dtype=torch.int32, device=device).view(-1, SEGMENT_FIELDS),
        "table": torch.tensor(table, dtype=torch.int32, device=device),
        "flops": 4.0 * heads * dim * seen, "heads": heads, "dim": dim, "rows": total_rows,
    }


def items_for(segments: Any, block_m: int) -> Any:
    import torch

    items = [[n, first] for n, row in enumerate(segments.tolist()) for first in range(row[0], row[1], block_m)]
    return torch.tensor(items, dtype=torch.int32, device=segments.device).view(-1, 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--position", type=int, default=100_000, help="the long chunk's first position")
    parser.add_argument("--rows", type=int, default=1024, help="the long chunk's query rows")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--out", default=None, help="a JSON file for the results")
    args = parser.parse_args()

    import torch

    from app.engine.hf.segment_kernel import segment_attention

    device = "cuda"
    info = machine()
    results: list[dict[str, Any]] = []
    for kind, tiles in (("long", FULL_TILES), ("window", SLIDING_TILES), ("ticket", FULL_TILES)):
        case = build(kind, args.position, args.rows, device)
        first: Any = None
        for tile in tiles:
            items = items_for(case["segments"], tile[0])
            out = torch.zeros(case["rows"], case["heads"], case["dim"], device=device, dtype=torch.bfloat16)

            def call(items: Any = items, out: Any = out, tile: tuple[int, ...] = tile, case: dict[str, Any] = case) -> Any:
                return segment_attention(case["queries"], case["keys"], case["values"], case["key_pool"],
                                         case["value_pool"], out, case["segments"], items, case["table"],
                                         case["dim"] ** -0.5, block_tokens=BLOCK_TOKENS, tile=tile)  # type: ignore[arg-type]

            row: dict[str, Any] = {"shape": kind, "tile": list(tile)}
            try:
                call()
                torch.cuda.synchronize()
                ms = event_median_ms(call, args.reps)
            except Exception as exc:  # a tile the card cannot hold (shared memory, registers)
                row["error"] = f"{type(exc).__name__}: {str(exc)[:120]}"
                results.append(row)
                print(kind, tile, row["error"], flush=True)
                continue
            if first is None:
                first = out.clone()
            row.update(ms=ms, tflops=case["flops"] / ms / 1e9, diff=float((out.float() - first.float()).abs().max()))
            results.append(row)
            print(kind, tile, f"{ms:.3f} ms, {row['tflops']:.0f} TFLOP/s, diff {row['diff']:.2e}", flush=True)
        case.clear()
        torch.cuda.empty_cache()

    print()
    print(header("bench_gpu_segments: the segment kernel's tiles, one layer", info))
    print(f"\nlong: {args.rows} query rows at position {args.position}; window: the same on a sliding layer; "
          "ticket: 16 states of 115 tokens and their 16-token canvases\n")
    print(markdown_table(["shape", "tile (M, N, warps, stages, parts)", "ms", "TFLOP/s", "largest difference"],
                         [[row["shape"], tuple(row["tile"]), fmt(row["ms"], 3) if "ms" in row else row["error"],
                           fmt(row.get("tflops", 0), 0), f"{row['diff']:.1e}" if "diff" in row else "-"]
                          for row in results]))
    if args.out:
        write_json(args.out, {"info": info, "args": vars(args), "results": results})


if __name__ == "__main__":
    main()
