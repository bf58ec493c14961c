"""Run by tests/engine/hf/moe/test_fused.py in the CPU vLLM venv (.venv-vllm has Triton; the main venv
does not need it) with TRITON_INTERPRET=1: Triton's interpreter runs the experts' kernels on CPU
tensors. Prints one JSON object of measurements; the test asserts on them.

    python tests/engine/hf/moe/fused_checks.py TINY_CHECKPOINT_DIR
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[4]))

import torch  # noqa: E402
import torch._dynamo.utils  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from app.engine.hf.moe import fused as fused_moe  # noqa: E402
from bench.models import Experts  # noqa: E402 - grouped_mm's view of an experts module


def exact(x, index, weights, gate_up, down):
    """The experts in float64, from the same (rounded) inputs: the yardstick for both paths."""
    x, gate_up, down = x.double(), gate_up.double(), down.double()
    out = torch.zeros_like(x)
    for token in range(x.shape[0]):
        for slot in range(index.shape[1]):
            expert = int(index[token, slot])
            gate, up = F.linear(x[token], gate_up[expert]).chunk(2)
            out[token] += weights[token, slot].double() * F.linear(F.gelu(gate, approximate="tanh") * up, down[expert])
    return out


def kernel_cases() -> list[dict]:
    """Each tile configuration, in float32 and bfloat16, against float64 and against transformers'
    grouped_mm experts on the same inputs (an expert no token chose included)."""
    from transformers.integrations.moe import grouped_mm_experts_forward

    results = []
    generator = torch.Generator().manual_seed(0)
    shapes = {  # tokens, hidden, inter, experts, top_k: pairs per expert picks each config
        "16": (6, 64, 48, 8, 2),
        "32": (40, 96, 48, 4, 3),
        "64": (100, 64, 160, 4, 2),
        "128": (300, 64, 32, 2, 2),
    }
    for name, (tokens, hidden, inter, experts, top_k) in shapes.items():
        config = fused_moe.block_config(tokens * top_k, experts)
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(tokens, hidden, generator=generator).to(dtype)
            gate_up = (torch.randn(experts, 2 * inter, hidden, generator=generator) / hidden ** 0.5).to(dtype)
            down = (torch.randn(experts, hidden, inter, generator=generator) / inter ** 0.5).to(dtype)
            choices = experts - 1 if experts > top_k else experts  # the last expert left out when possible
            index = torch.stack([torch.randperm(choices, generator=generator)[:top_k] for _ in range(tokens)])
            weights = torch.rand(tokens, top_k, generator=generator)
            want = exact(x, index, weights, gate_up, down)
            module = Experts(gate_up, down)
            got = fused_moe.experts_forward(module, x, index, weights)
            library = grouped_mm_experts_forward(module, x, index, weights)
            results.append({
                "case": name, "dtype": str(dtype).removeprefix("torch."), "block_m": config.block_m,
                "shape": list(got.shape), "out_dtype": str(got.dtype).removeprefix("torch."),
                "fused_error": (got.double() - want).abs().max().item(),
                "library_error": (library.double() - want).abs().max().item(),
                "vs_library": (got.double() - library.double()).abs().max().item(),
                "scale": want.abs().max().item(),
            })
    return results


def flat_canvases(model, compile=None):
    """The flat turn's forward over the tiny model (app/engine/hf/forward.py, its layer bodies through
    `compile` where given: TORCH_COMPILE): the prompt 100..139 written in a turn of its own, then
    `hidden(rows)`, the hidden states [rows, 16, hidden] of `rows` canvases 200..215 over it read in
    one turn (a decoder pass of `rows` canvases)."""
    from app.engine.hf.attention import ReferenceAttention
    from app.engine.hf.blocks import KVStore, LayerShape
    from app.engine.hf.forward import FlatForward
    from app.engine.hf.layout import Kind
    from app.engine.hf.parts import encoder_layers, layer_types, text_config
    from app.engine.hf.turn import FlatTurn, Part

    shapes = [LayerShape(kind == "sliding_attention", layer.self_attn.k_proj.out_features // layer.self_attn.head_dim,
                         layer.self_attn.head_dim) for layer, kind in zip(encoder_layers(model), layer_types(model))]
    window = int(text_config(model).sliding_window)
    store = KVStore(shapes, window, 64 << 20, "cpu", model.dtype)
    forward = FlatForward(model, store, ReferenceAttention(store, window))
    if compile is not None:
        forward.compile(compile)
    turn = FlatTurn(forward, store, torch.device("cpu"))
    prompt = list(range(100, 140))
    sequence = store.open(prompt)
    store.reserve(sequence, prompt)
    turn.run([Part(Kind.PROMPT, sequence, 0, prompt)])

    @torch.no_grad()
    def hidden(rows: int = 1) -> torch.Tensor:
        parts = [Part(Kind.CANVAS, sequence, len(prompt), list(range(200, 216)), logits=tuple(range(16)))
                 for _ in range(rows)]
        turn.run(parts)
        return torch.stack([part.hidden for part in parts])

    return hidden


def model_case(checkpoint: str) -> dict:
    """The tiny model's decoder hidden states with transformers' experts and with the kernels (its own
    forward), and the flat turn's with the kernels, eager and with its layer bodies under torch.compile
    (aot_eager: the custom op is opaque to the compiler, as it is to inductor on the GPU)."""
    import functools

    from transformers import DiffusionGemmaForBlockDiffusion
    from transformers.cache_utils import DynamicCache

    model = DiffusionGemmaForBlockDiffusion.from_pretrained(checkpoint, dtype=torch.float32,
                                                            attn_implementation="sdpa").eval()
    ids = torch.arange(100, 140).unsqueeze(0)
    canvas = torch.arange(200, 216).unsqueeze(0)

    @torch.no_grad()
    def hidden(rows: int = 1):
        cache = DynamicCache()
        model.model.encoder(input_ids=ids.expand(rows, -1), past_key_values=cache, use_cache=True)
        return model.model(past_key_values=cache, decoder_input_ids=canvas.expand(rows, -1),
                           decoder_position_ids=torch.arange(40, 56).expand(rows, -1)).last_hidden_state

    before = model.get_experts_implementation()[""]
    library = hidden()
    reason = fused_moe.use_fused_experts(model)
    fused = hidden()
    eager = flat_canvases(model)()
    compiled_turns = flat_canvases(model, functools.partial(torch.compile, backend="aot_eager", dynamic=None))
    torch._dynamo.utils.counters.clear()
    compiled = compiled_turns()
    _ = compiled_turns(rows=2)  # a second shape: the bodies compile once more, as dynamic
    after_two = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    experts = model.config.text_config.num_experts
    top_k = model.config.text_config.top_k_experts
    ranges = set()
    for rows in (3, 5, 9, 17):  # turns of 16-token canvases: every tile range of the tiny model
        _ = compiled_turns(rows=rows)
        ranges.add(fused_moe.block_config(rows * 16 * top_k, experts).block_m)
    return {
        "before": before, "after": model.get_experts_implementation()[""], "reason": reason,
        "fused_vs_library": (fused - library).abs().max().item(),
        "flat_vs_fused": (eager[0] - fused[0]).abs().max().item(),
        "compiled_vs_fused": (compiled - eager).abs().max().item(),
        "scale": library.abs().max().item(),
        "graphs_after_two_sizes": after_two,
        "graphs_after_more_sizes": torch._dynamo.utils.counters["stats"]["unique_graphs"],
        "tile_ranges_read": sorted(ranges),
    }


if __name__ == "__main__":
    os.environ["TRITON_INTERPRET"] = "1"  # read when the kernels' module is first imported, in a call
    print(json.dumps({"kernels": kernel_cases(), "model": model_case(sys.argv[1])}))
