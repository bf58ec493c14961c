"""Where a read's and a generation pass's GPU time goes (full-size random-weight model, CUDA graphs on).

torch.profiler around: one new-state read (batch 1), one batch of 32 new-state reads, one batch of 8
cached-prompt reads, and one generation denoise pass; prints, per case, wall time, the CPU and CUDA
totals and the CUDA kernels that take the most time. With graphs the kernels run inside replays, so
the table names what the graph replays (graph replays show as their kernels under CUDA time).

    python bench/profile_gpu.py [--compile] [--fused-moe]   # on a GPU box; about a minute
                                   # (--compile: TORCH_COMPILE's parts; --fused-moe: FUSED_MOE's kernels)
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import timed_call  # noqa: E402
from bench.models import build_model, model_config  # noqa: E402
from bench.workload import Specs  # noqa: E402


def main() -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from app.engine.base import GenerateSpec
    from app.engine.hf.runner import DiffusionRunner

    device = torch.device("cuda")
    model = build_model(model_config(False), "cuda", torch.bfloat16, "grouped_mm")
    if "--fused-moe" in sys.argv[1:]:
        from app.engine.hf.moe.fused import use_fused_experts

        print("experts:", use_fused_experts(model) or "djev Triton kernels", flush=True)
    if "--compile" in sys.argv[1:]:
        from app.engine.hf.compiled import compile_layers

        compile_layers(model)
    runner = DiffusionRunner(model, None, device=device, max_prompt_tokens=32768, kv_entries=64, max_rows=64,
                             cuda_graphs=True)
    specs = Specs(262144, 300)
    cached_reads = [specs.read() for _ in range(8)]
    runner.read(cached_reads)
    gen = runner.start_generation(GenerateSpec(cached_reads[0].prompt, 64, (), seed=1), 64)
    for _ in range(3):
        runner.step_generation(gen)

    cases = {
        "new state, batch 1": lambda: runner.read([specs.read()]),
        "new states, batch 32": lambda: runner.read([specs.read() for _ in range(32)]),
        "cached prompt, batch 1 (same state)": lambda: runner.read(cached_reads[:1]),
        "cached prompts, batch 8": lambda: runner.read(cached_reads),
        "generation denoise pass (width 64)": lambda: runner.step_generation(gen),
    }
    for name, call in cases.items():
        for _ in range(2):  # capture every bucket first
            call()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            _, seconds = timed_call(call, torch.cuda.synchronize)
        wall = seconds * 1000
        events = prof.key_averages()
        cuda_total = sum(e.self_device_time_total for e in events) / 1000
        print(f"\n### {name}: wall {wall:.1f} ms, CUDA kernels {cuda_total:.1f} ms", flush=True)
        print(events.table(sort_by="self_device_time_total", row_limit=20, max_name_column_width=60), flush=True)

    # 32 new states in stages, without the profiler: the encoder pass alone, then the decoder pass
    # and slot reads alone (the same prompts, now cached), then both in one read.
    for _ in range(2):
        batch = [specs.read() for _ in range(32)]
        encode = timed_call(lambda: runner.encode_many([spec.prompt for spec in batch]), torch.cuda.synchronize)[1] * 1000
        decode = timed_call(lambda: runner.read(batch), torch.cuda.synchronize)[1] * 1000
        fresh = [specs.read() for _ in range(32)]
        whole = timed_call(lambda: runner.read(fresh), torch.cuda.synchronize)[1] * 1000
    print(f"\n### 32 new states in stages (wall, no profiler): encoder pass + KV copy-out {encode:.1f} ms, "
          f"decoder pass + slot reads (prompts cached) {decode:.1f} ms, whole read {whole:.1f} ms", flush=True)


if __name__ == "__main__":
    main()
