"""The text layers' dense projections on the GPU: bf16 against FP8 (`Fp8Linear`'s `torch._scaled_mm`,
row-wise scales), at the token counts a turn holds.

For each token count, one sliding and one full layer of the full-size model (bench/models.py's
FULL_TEXT_CONFIG: attention q/k/v/o and the dense MLP's gate/up/down), each projection timed as:
  bf16        `F.linear` on bf16 weights (what the bf16 model runs);
  fp8 gemm    `torch._scaled_mm` on activations already in e4m3 (the GEMM alone: the floor);
  fp8 eager   the per-token quantization as separate torch ops, then the GEMM (`scaled_mm_linear`);
  fp8 fused   the same compiled with torch.compile (the quantization fused into one kernel, as in
              the compiled layer bodies).
Printed per count: each way's ms for a turn's 30 layers (25 sliding, 5 full), its ratio to bf16, and
the weights' bytes read over the GEMM's time (GB/s). Each way's layer is one CUDA graph of its
projections, replayed (median of CUDA-event timings): without the graph, the GPU waits on the host
between small GEMMs and the figure is the launches'.

    python bench/bench_gpu_dense.py [--tokens 16,128,512,2048,4096] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import event_median_ms, numbers  # noqa: E402
from bench.models import FULL_TEXT_CONFIG  # noqa: E402

WAYS = ("bf16", "fp8 gemm", "fp8 eager", "fp8 fused")
SLIDING_LAYERS, FULL_LAYERS = 25, 5  # the full-size model's 5:1 pattern over 30 layers


def layer_shapes(config: dict[str, Any], sliding: bool) -> list[tuple[str, int, int]]:
    """(name, in_features, out_features) of one text layer's dense projections. Pure."""
    hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
    if sliding:
        head, kv_heads, values = int(config["head_dim"]), int(config["num_key_value_heads"]), True
    else:
        head, kv_heads = int(config["global_head_dim"]), int(config["num_global_key_value_heads"])
        values = not config.get("attention_k_eq_v", False)
    inter = int(config["intermediate_size"])
    shapes = [("q", hidden, heads * head), ("k", hidden, kv_heads * head)]
    shapes += [("v", hidden, kv_heads * head)] if values else []
    shapes += [("o", heads * head, hidden), ("gate", hidden, inter), ("up", hidden, inter), ("down", inter, hidden)]
    return shapes


def turn_bytes(config: dict[str, Any], element: int) -> int:
    """The dense projections' weight bytes for a turn's 30 layers at `element` bytes a weight. Pure."""
    per = {kind: sum(n * m for _, n, m in layer_shapes(config, kind)) for kind in (True, False)}
    return (SLIDING_LAYERS * per[True] + FULL_LAYERS * per[False]) * element


def time_layer(tokens: int, shapes: list[tuple[str, int, int]], reps: int) -> dict[str, float]:
    """Each way's ms for one layer's projections at `tokens` tokens: all of them captured in one CUDA
    graph per way (as the captured turn runs them, no launch gaps between them) and replayed."""
    import torch
    import torch.nn.functional as F

    from app.engine.hf import fp8
    from app.engine.hf.quantize import scaled_mm_linear
    from bench.naive import captured

    fused = torch.compile(scaled_mm_linear, dynamic=False)
    calls: dict[str, list[Callable[[], Any]]] = {way: [] for way in WAYS}
    for _, inputs, outputs in shapes:
        x = torch.randn(tokens, inputs, device="cuda", dtype=torch.bfloat16)
        weight = torch.randn(outputs, inputs, device="cuda", dtype=torch.bfloat16) * 0.02
        q, scale = fp8.quantize_weight(weight)
        xq, x_scale = fp8.quantize_tokens(x)
        calls["bf16"].append(lambda x=x, weight=weight: F.linear(x, weight))
        calls["fp8 gemm"].append(lambda xq=xq, q=q, x_scale=x_scale, scale=scale: torch._scaled_mm(  # pyright: ignore[reportPrivateImportUsage]
            xq, q.t(), scale_a=x_scale.unsqueeze(1), scale_b=scale.unsqueeze(0), out_dtype=torch.bfloat16))
        calls["fp8 eager"].append(lambda x=x, q=q, scale=scale: scaled_mm_linear(x, q, scale))
        calls["fp8 fused"].append(lambda x=x, q=q, scale=scale: fused(x, q, scale))
    times = {}
    for way, layer in calls.items():
        for call in layer:  # compile (fp8 fused) and warm up outside the capture
            call()
        graph, _ = captured(lambda layer=layer: [call() for call in layer])
        times[way] = event_median_ms(graph.replay, reps)
    return times


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--tokens", type=numbers(int), default="16,128,512,2048,4096")
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--json", type=Path, default=None, help="write the rows here")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    import torch

    args = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_gpu_dense needs a GPU")
    # One compiled function over every shape and token count: one graph each (dynamic=False).
    torch._dynamo.config.recompile_limit = 256
    print(f"{torch.cuda.get_device_name()}: a turn's dense projections (30 layers), ms; bf16 weights "
          f"{turn_bytes(FULL_TEXT_CONFIG, 2) / 2**30:.2f} GiB, FP8 {turn_bytes(FULL_TEXT_CONFIG, 1) / 2**30:.2f} GiB")
    print(f"{'tokens':>7} " + " ".join(f"{way:>16}" for way in WAYS) + f" {'fp8 gemm GB/s':>14}")
    rows = []
    with torch.no_grad():
        for tokens in args.tokens:
            sliding = time_layer(tokens, layer_shapes(FULL_TEXT_CONFIG, True), args.reps)
            full = time_layer(tokens, layer_shapes(FULL_TEXT_CONFIG, False), args.reps)
            turn = {way: SLIDING_LAYERS * sliding[way] + FULL_LAYERS * full[way] for way in WAYS}
            rate = turn_bytes(FULL_TEXT_CONFIG, 1) / (turn["fp8 gemm"] / 1000) / 1e9
            cells = " ".join(f"{turn[way]:8.2f} ({turn[way] / turn['bf16']:4.2f}x)" for way in WAYS)
            print(f"{tokens:>7} {cells} {rate:>14.0f}", flush=True)
            rows.append({"tokens": tokens, "turn_ms": turn, "fp8_gemm_gb_s": rate})
    if args.json:
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
