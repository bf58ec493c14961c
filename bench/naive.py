"""The naive baseline the GPU benchmarks print their ratios against: plain transformers calls on the
very model the engine reads with, in the same process, so every engine figure has its naive figure
measured minutes apart on the same card.

Three calls, each at the given batch sizes (every row its own random prompt, canvas 32, logits at 3
slots, as a read needs them):
  - full read, eager: `model(input_ids, decoder_input_ids, past_key_values=DynamicCache)`, the
    library's plain path (it cannot be captured: its cache copies from the host while building);
  - full read through `StaticCache`, captured as ONE CUDA graph (reset + encode + decoder pass): the
    library's own fastest path for a new state;
  - a decoder pass over a cached prompt, eager and captured.
Medians of `reps` after `warmup`, CUDA synchronized around each call.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from bench.common import median_ms
from bench.workload import CANVAS_WIDTH, SLOTS, id_range


def _median_ms(call: Callable[[], Any], warmup: int, reps: int) -> float:
    import torch

    return round(median_ms(call, reps, torch.cuda.synchronize, warmup), 2)


def captured(call: Callable[[], Any]) -> tuple[Any, Any]:
    """`call` captured as a CUDA graph after two warm-up runs on a side stream: (graph, the output
    tensor(s) the replays write)."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        output = call()
    return graph, output


def measure_naive(model: Any, batches: Sequence[int] = (1, 8, 32), prompt_tokens: int = 300,
                  static_batches: Sequence[int] = (1, 8), warmup: int = 3, reps: int = 10) -> dict[str, dict[int, float]]:
    """{call: {batch: median ms}}; a call that fails at a batch size is left out of it (and printed)."""
    import torch
    from transformers import DynamicCache, StaticCache

    text_config = model.config.text_config
    low, high = id_range(int(text_config.vocab_size))
    generator = torch.Generator(device="cuda").manual_seed(1)
    slots = torch.tensor(SLOTS, device="cuda")
    out: dict[str, dict[int, float]] = {"full_read_eager": {}, "full_read_static_graph": {},
                                        "decoder_pass_eager": {}, "decoder_pass_graph": {}}
    for batch in batches:
        ids = torch.randint(low, high, (batch, prompt_tokens), device="cuda", generator=generator)
        canvas = torch.randint(low, high, (batch, CANVAS_WIDTH), device="cuda", generator=generator)
        with torch.no_grad():
            def full() -> Any:
                return model(input_ids=ids, decoder_input_ids=canvas, logits_to_keep=slots,
                             past_key_values=DynamicCache(config=text_config)).logits

            out["full_read_eager"][batch] = _median_ms(full, warmup, reps)
            cached = model(input_ids=ids, decoder_input_ids=canvas, logits_to_keep=slots,
                           past_key_values=DynamicCache(config=text_config)).past_key_values

            def decode() -> Any:
                return model(decoder_input_ids=canvas, past_key_values=cached, logits_to_keep=slots).logits

            out["decoder_pass_eager"][batch] = _median_ms(decode, warmup, reps)
            try:
                graph, _ = captured(decode)
                out["decoder_pass_graph"][batch] = _median_ms(graph.replay, warmup, reps)
                del graph
            except Exception as exc:  # noqa: BLE001 - a baseline that cannot be captured is reported, not fatal
                print(f"  naive decoder pass batch {batch}: capture failed: {exc!r}"[:300], flush=True)
            cached = None  # drop this batch's KV before the next
            if batch in static_batches:
                try:
                    static = StaticCache(config=text_config, max_cache_len=prompt_tokens)

                    def static_full() -> Any:
                        static.reset()
                        return model(input_ids=ids, decoder_input_ids=canvas, logits_to_keep=slots,
                                     past_key_values=static).logits

                    graph, _ = captured(static_full)
                    out["full_read_static_graph"][batch] = _median_ms(graph.replay, warmup, reps)
                    del graph, static
                except Exception as exc:  # noqa: BLE001
                    print(f"  naive StaticCache graph batch {batch}: failed: {exc!r}"[:300], flush=True)
        torch.cuda.empty_cache()
        print(f"  naive batch {batch}: " + ", ".join(f"{name} {values[batch]:.1f} ms" for name, values in out.items()
                                                    if batch in values), flush=True)
    return out


def ratio(engine_ms: float, naive_ms: float | None) -> str:
    """engine / naive as a table cell ("0.42x"), a dash when there is no naive figure."""
    if naive_ms is None or naive_ms != naive_ms or naive_ms <= 0:
        return "-"
    return f"{engine_ms / naive_ms:.2f}x"
