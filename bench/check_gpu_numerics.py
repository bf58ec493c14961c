"""Do batched, padded and CUDA-graph decoder passes read the same as a read alone? (GPU)

For each model size and dtype: five reads (prompts of 40 to 1500 tokens, one with 4 noise draws) are
read one at a time, all together (left-padded KV, masks), through the CUDA-graph static buffers
without capture, and with capture. Prints the largest label log-probability difference per read.
In float32 every path agrees to ~1e-4. In bfloat16 with RANDOM weights the paths diverge: the random
routers' near-uniform top-8 expert choices flip on any rounding difference between kernels, and the
flip cascades; that is a property of random weights, not of the batching (float32 shows the math is
the same), and graph replay is bit-identical to its own eager static path.

    python bench/check_gpu_numerics.py      # on a GPU box; about a minute
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.bench_gpu import FULL_TEXT_CONFIG, Specs, build_model  # noqa: E402


def largest_difference(a, b) -> float:
    worst = 0.0
    for canvas_a, canvas_b in zip(a.slots, b.slots):
        for slot_a, slot_b in zip(canvas_a, canvas_b):
            worst = max(worst, max(abs(x - y) for x, y in zip(slot_a.label_logprobs, slot_b.label_logprobs)))
    return round(worst, 4)


def main() -> None:
    import torch
    from transformers import DiffusionGemmaConfig

    from app.engine.diffusion import DiffusionRunner
    from app.engine.graphs import DecoderGraphs

    device = torch.device("cuda")
    for layers, dtype in ((6, torch.float32), (6, torch.bfloat16), (30, torch.bfloat16)):
        config = DiffusionGemmaConfig(text_config=dict(FULL_TEXT_CONFIG, num_hidden_layers=layers),
                                      vision_config={"model_type": "gemma4_vision"}, canvas_length=256)
        model = build_model(config, "cuda", dtype, "grouped_mm")
        specs = Specs(262144, 300)
        reads = [specs.read(), specs.read(canvases=4)] + [Specs(262144, n, seed=n).read() for n in (40, 700, 1500)]

        def runner(graphs: bool = False, model=model) -> DiffusionRunner:
            return DiffusionRunner(model, None, device=device, max_prompt_tokens=32768, kv_entries=64, max_rows=64,
                                   cuda_graphs=graphs)

        alone = [runner().read([spec])[0] for spec in reads]
        together = runner().read(reads)
        static = runner()
        static.graphs = DecoderGraphs(model, static.layer_types, device, pad_id=0, capture=False)
        static_reads = [static.read([spec])[0] for spec in reads]
        graphed = runner(graphs=True)
        graph_reads = [graphed.read([spec])[0] for spec in reads]
        print(f"{layers} layers, {str(dtype).replace('torch.', '')}:")
        print("  batched vs alone         ", [largest_difference(a, b) for a, b in zip(alone, together)])
        print("  padded static vs alone   ", [largest_difference(a, b) for a, b in zip(alone, static_reads)])
        print("  graph replay vs static   ", [largest_difference(a, b) for a, b in zip(static_reads, graph_reads)],
              f"(captured {graphed.graphs.captures}, disabled: {graphed.graphs.disabled})", flush=True)
        del model, static, graphed
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
