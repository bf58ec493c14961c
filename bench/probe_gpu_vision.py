"""Which attention kernel the engine's vision pass runs, and what the pass costs with each.

SDPA timed alone at the vision tower's shape (a layer of 8 frames: cuDNN 0.749 ms, the
memory-efficient kernel 1.955 on the H200) is why the tower's attention takes cuDNN first
(app/engine/hf/layers.py `VISION_ATTENTION`). The served walk turn's vision stage did not
move (22.4 ms against 23.0 before, docs/benchmarks.md). This probe times the pass the engine runs
(app/engine/hf/graphs/vision.py `VisionGraphs`: the model's own modules, a real walk frame's patch
layout, the tower's padding mask) at 1, 4 and 8 frames, for each kernel order, with the layers
eager and then compiled as the server compiles them (app/engine/hf/compiled.py `compile_vision`), as
CUDA graphs on CUDA; and lists the attention operators and kernels the profiler saw in one 8-frame pass, so a
kernel that the compiled trace chose differently from the context's order shows by name.

    python bench/probe_gpu_vision.py --out "$OUT/probe_vision.json"      # on CUDA (random bf16 weights)
    python bench/probe_gpu_vision.py --tiny --device cpu                  # the smoke test: tiny config
"""

from __future__ import annotations

import argparse
import io
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import device_sync, header, machine, markdown_table, median_ms, write_json  # noqa: E402
from bench.models import choose_vision_attention, random_model  # noqa: E402
from bench.workload import frames  # noqa: E402

FRAME_COUNTS = (1, 4, 8)
# The kernel each row's vision attention tries first (bench_gpu_decisions' --vision-attention names):
# the engine's order, then the memory-efficient kernel first.
KERNELS_FIRST = ("cudnn", "efficient")
# Operator and kernel names that belong to attention (the profiler's keys, lowercased).
ATTENTION_WORDS = ("attention", "attn", "fmha", "cudnn", "flash", "sdpa", "efficient")


def frame_inputs(model: Any, processor: Any, device: str, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`count` walk-page frames (512 x 384 JPEG) through the image processor, on the device."""
    from PIL import Image

    images = [Image.open(io.BytesIO(data)).convert("RGB") for data in frames(count)]
    processed = processor(images, return_tensors="pt")
    return (processed["pixel_values"].to(device=device, dtype=model.dtype),
            processed["image_position_ids"].to(device))


def attention_seen(call: Callable[[], object], device: torch.device) -> dict[str, float]:
    """The attention operators and kernels one call ran, by name, with their time (ms; the device's
    on CUDA, 0 for the CPU's operators)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        call()
        device_sync(device)()
    seen: dict[str, float] = {}
    for event in prof.key_averages():
        if any(word in event.key.lower() for word in ATTENTION_WORDS):
            seen[event.key[:100]] = round(float(getattr(event, "device_time_total", 0.0)) / 1000, 3)
    return seen


def probe(model: Any, inputs: tuple[torch.Tensor, torch.Tensor], device: torch.device, label: str,
          order_name: str, graphed: bool, repeats: int) -> dict[str, Any]:
    from app.engine.hf.graphs.vision import VisionGraphs

    choose_vision_attention(order_name)  # (app.engine.hf.layers.VISION_ATTENTION, reordered)
    pixels, positions = inputs
    graphs = VisionGraphs(model, device, capture=graphed, buckets=FRAME_COUNTS)
    row: dict[str, Any] = {"layers": label, "kernel_first": order_name, "graphed": graphed}
    with torch.no_grad():
        started = time.perf_counter()
        graphs.prepare(pixels, positions)
        row["prepare_s"] = round(time.perf_counter() - started, 2)
        for count in FRAME_COUNTS:
            row[f"ms_{count}"] = round(median_ms(lambda count=count: graphs.features(pixels[:count], positions[:count]),
                                                 repeats, device_sync(device), warmup=2), 3)
        row["attention_seen"] = attention_seen(lambda: graphs.features(pixels, positions), device)
    return row  # (its graphs go with `graphs`; the caller empties the allocator's cache)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tiny", action="store_true", help="the tiny model's config (with --device cpu: the smoke test)")
    parser.add_argument("--repeats", type=int, default=15, help="timed passes a cell (the median)")
    parser.add_argument("--no-compile", dest="compile", action="store_false", help="skip the compiled layers' rows")
    parser.add_argument("--out", help="write the rows as JSON here")
    args = parser.parse_args()
    device = torch.device(args.device)
    graphed = device.type == "cuda"  # CUDA graphs need CUDA; on the CPU the same path runs eagerly
    model, _, processor = random_model(args.tiny, args.device)  # random weights, as the server would run them
    inputs = frame_inputs(model, processor, args.device, max(FRAME_COUNTS))
    real = int((inputs[1][0] != -1).all(dim=-1).sum())
    rows = []
    for order in KERNELS_FIRST:
        rows.append(probe(model, inputs, device, "eager", order, graphed, args.repeats))
        if graphed:
            torch.cuda.empty_cache()
    if args.compile:
        import torch._dynamo as dynamo

        from app.engine.hf.compiled import compile_vision

        compile_vision(model)  # the vision layers as TORCH_COMPILE compiles them
        for order in KERNELS_FIRST:
            dynamo.reset()  # each order traced afresh: a trace keeps the kernel it chose
            rows.append(probe(model, inputs, device, "compiled", order, graphed, args.repeats))
            if graphed:
                torch.cuda.empty_cache()
    info = machine()
    print(header("probe_gpu_vision: the engine's vision pass, by attention kernel order", info))
    print(f"\nframes: 512 x 384 JPEG, {tuple(inputs[0].shape[1:])} pixel patches a frame, {real} real; "
          f"{'CUDA graphs' if graphed else 'eager (no CUDA)'}; median of {args.repeats}\n")
    columns = ["layers", "kernel first", *(f"{count} frame(s) ms" for count in FRAME_COUNTS), "attention seen (8 frames)"]
    table = [[row["layers"], row["kernel_first"], *(row[f"ms_{count}"] for count in FRAME_COUNTS),
              "; ".join(f"{name} {ms:g}" for name, ms in row["attention_seen"].items()) or "-"] for row in rows]
    print(markdown_table(columns, table))
    if args.out:
        write_json(args.out, {"machine": info, "patches": list(inputs[0].shape[1:]), "real_patches": real,
                              "graphed": graphed, "repeats": args.repeats, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
