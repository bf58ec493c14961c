"""Run by tests/engine/hf/test_segment_kernel.py in the CPU vLLM venv (it has Triton) with TRITON_INTERPRET=1:
app/engine/hf/segment_kernel.py's segment kernel (through attention.SegmentAttention) against the CPU
reference (attention.ReferenceAttention) over one KV store and one turn of every kind of segment.
Prints one JSON object of the largest difference per case; the tests assert on them.

    TRITON_INTERPRET=1 python tests/engine/hf/segment_kernel_checks.py
    python tests/engine/hf/segment_kernel_checks.py --device cuda   # compiled, plus a served turn's shapes, timed
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import torch  # noqa: E402

from app.engine.hf.attention import ReferenceAttention, SegmentAttention  # noqa: E402
from app.engine.hf.blocks import KVStore, LayerShape  # noqa: E402
from app.engine.hf.layout import Kind, Segment, TurnLayout  # noqa: E402
from app.engine.hf.segment_kernel import LONG_ROWS, tile_for  # noqa: E402

WINDOW = 24  # the sliding window: shorter than the long prompts, so their early sliding blocks are released
HEADS = 4


def store_for(layers: list[LayerShape], dtype: torch.dtype, device: str, window: int = WINDOW) -> KVStore:
    return KVStore(layers, window, 1 << 31, device, dtype)


def fill(store: KVStore, sequence, start: int, end: int, generator: torch.Generator) -> None:
    """Random keys and values for positions [start, end) of every layer."""
    for layer, shape in enumerate(store.layers):
        full, sliding = store.slots(sequence, start, end)
        slots = sliding if shape.sliding else full
        size = (end - start, shape.kv_heads, shape.head_dim)
        keys = torch.randn(size, generator=generator).to(store.device, store.pool_tensors(layer)[0].dtype)
        store.write(layer, slots, keys, (keys * 0.5 + 0.1).to(keys.dtype))


def turn(layers: list[LayerShape], dtype: torch.dtype, generator: torch.Generator, device: str):
    """A store, a turn of every kind of segment and its sequences."""
    store = store_for(layers, dtype, device)
    # Sequence 0: 70 positions written earlier (its early sliding blocks released), 37 more in this turn
    # (a prompt segment crossing the window and several work items), then a canvas of 20 over it.
    # Sequence 1: a fresh prompt of 9 written in this turn and a canvas of 16 over it.
    # Sequence 2: 45 written earlier; two canvases of 12 and 33 over it (one past a tile's rows).
    # Sequence 3: a 16-token prompt written earlier (one whole block), a 1-token tail now.
    sequences = []
    for earlier, later in ((70, 37), (0, 9), (45, 0), (16, 1)):
        sequence = store.open([("x", len(sequences), i) for i in range(0)])
        store.reserve(sequence, [(len(sequences), i) for i in range(earlier + later)])
        if earlier:
            fill(store, sequence, 0, earlier, generator)
            store.mark_written(sequence, earlier)
        if later:
            fill(store, sequence, earlier, earlier + later, generator)  # the forward writes before attention
        sequences.append(sequence)
    segments = [
        Segment(Kind.PROMPT, 0, 37, 70),
        Segment(Kind.CANVAS, 2, 12, 45),
        Segment(Kind.PROMPT, 1, 9, 0),
        Segment(Kind.CANVAS, 0, 20, 107),
        Segment(Kind.CANVAS, 1, 16, 9),
        Segment(Kind.PROMPT, 3, 1, 16),
        Segment(Kind.CANVAS, 2, 33, 45),
    ]
    return store, TurnLayout.of(segments), sequences


def long_turn(layers: list[LayerShape], dtype: torch.dtype, generator: torch.Generator, device: str, rows: int):
    """A long prompt's chunk of `rows` query rows (LONG_ROWS or more: the turn takes the long tiles)
    after 300 positions written earlier, beside a canvas of 16 over a prompt of 40 written earlier."""
    store = store_for(layers, dtype, device, window=128)
    sequences = []
    for earlier, later in ((300, rows), (40, 0)):
        sequence = store.open([])
        store.reserve(sequence, [(len(sequences), i) for i in range(earlier + later)])
        fill(store, sequence, 0, earlier + later, generator)  # the chunk's own: the forward writes them first
        store.mark_written(sequence, earlier)
        sequences.append(sequence)
    return store, TurnLayout.of([Segment(Kind.PROMPT, 0, rows, 300), Segment(Kind.CANVAS, 1, 16, 40)]), sequences


def served_turn(layers: list[LayerShape], dtype: torch.dtype, generator: torch.Generator, device: str,
                canvases: int, prompt: int, chunk: int):
    """The full size's window (1024) and a served turn's shapes: `canvases` canvases of 32, each over
    its own prompt of `prompt` tokens written earlier, beside a long prompt's chunk of `chunk` tokens
    after 3000 written earlier."""
    store = store_for(layers, dtype, device, window=1024)
    sequences, segments = [], []
    for number in range(canvases + 1):
        earlier, later = (3000, chunk) if number == canvases else (prompt, 0)
        sequence = store.open([])
        store.reserve(sequence, [(number, i) for i in range(earlier + later)])
        fill(store, sequence, 0, earlier + later, generator)
        store.mark_written(sequence, earlier)
        sequences.append(sequence)
        segments.append(Segment(Kind.PROMPT, number, chunk, earlier) if later else Segment(Kind.CANVAS, number, 32, prompt))
    return store, TurnLayout.of(segments), sequences


def compare(layers: list[LayerShape], dtype: torch.dtype, generator: torch.Generator, device: str = "cpu",
            padding: int = 0, heads: int = HEADS, served: tuple[int, int, int] | None = None,
            long_rows: int = 0) -> dict:
    """The kernel against the reference on every layer: the largest difference, whether rows past the
    turn's are left alone, the tiles the plan took, and on CUDA each one's milliseconds a layer."""
    if long_rows:
        store, layout, sequences = long_turn(layers, dtype, generator, device, long_rows)
    elif served is None:
        store, layout, sequences = turn(layers, dtype, generator, device)
    else:
        store, layout, sequences = served_turn(layers, dtype, generator, device, *served)
    reference = ReferenceAttention(store, store.window)
    kernel = SegmentAttention(store, store.window)
    want_plan = reference.plan(layout, sequences, device)
    got_plan = kernel.plan(layout, sequences, device)
    largest = 0.0
    untouched = True
    timings: dict[str, float] = {}
    for layer, shape in enumerate(layers):
        tokens = layout.tokens + padding
        queries = torch.randn(heads, tokens, shape.head_dim, generator=generator).to(device, dtype)
        # the new keys and values as the forward gives them: views of [1, heads, T, dim] tensors
        keys = torch.randn(1, shape.kv_heads, tokens, shape.head_dim, generator=generator).to(device, dtype)[0]
        values = torch.randn(1, shape.kv_heads, tokens, shape.head_dim, generator=generator).to(device, dtype)[0]
        want = reference.attend(layer, shape.sliding, 0.3, queries, keys, values, want_plan).float()
        out = torch.full((tokens, heads, shape.head_dim), 7.0, dtype=dtype, device=device)
        got = kernel.attend(layer, shape.sliding, 0.3, queries, keys, values, got_plan, out=out)
        largest = max(largest, (got[:layout.tokens].float() - want[:layout.tokens]).abs().max().item())
        untouched = untouched and bool((got[layout.tokens:] == 7.0).all()) and got.data_ptr() == out.data_ptr()
        if device == "cuda":
            kind = "sliding" if shape.sliding else "full"
            timings[f"{kind}_kernel_ms"] = timed(lambda: kernel.attend(layer, shape.sliding, 0.3, queries, keys, values,
                                                                       got_plan, out=out))
            timings[f"{kind}_reference_ms"] = timed(lambda: reference.attend(layer, shape.sliding, 0.3, queries, keys,
                                                                             values, want_plan))
    if device == "cuda":
        started = time.perf_counter()
        kernel.plan(layout, sequences, device)
        torch.cuda.synchronize()
        timings["plan_ms"] = (time.perf_counter() - started) * 1000
    # Every part of the metadata starts on 16 bytes: Triton specialises on it, and a part off it would
    # compile the kernel again mid-serving.
    aligned = all(part.data_ptr() % 16 == 0 for parts in got_plan.by_kind.values() for part in parts)
    return {"diff": largest, "padding_untouched": untouched, "aligned": aligned, "tokens": layout.tokens,
            "tiles": {"sliding" if sliding else "full": list(tile) for sliding, tile in got_plan.tiles.items()},
            **timings}


def timed(call, reps: int = 20) -> float:
    """Milliseconds a call, on CUDA, after one untimed call."""
    call()
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(reps):
        call()
    torch.cuda.synchronize()
    return (time.perf_counter() - started) * 1000 / reps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    device = parser.parse_args().device
    generator = torch.Generator().manual_seed(0)
    small = [LayerShape(False, 2, 64), LayerShape(True, 2, 32)]
    results = {
        "float32": compare(small, torch.float32, generator, device),
        "bfloat16": compare(small, torch.bfloat16, generator, device),
        "padded": compare(small, torch.float32, generator, device, padding=11),
        # the full size's head sizes: 512 (the accumulator split in two) and 256, one KV head
        "full_size_heads": compare([LayerShape(False, 1, 512), LayerShape(True, 2, 256)], torch.float32, generator,
                                   device),
        # a long prompt's chunk: the turn takes the long tiles (128 rows a program in bf16, 64 in float32)
        "long_chunk": compare([LayerShape(False, 1, 512), LayerShape(True, 2, 256)], torch.float32, generator,
                              device, long_rows=LONG_ROWS + 40),
    }
    results["long_chunk"]["long_tiles"] = {kind: list(tile_for(dim, torch.float32, long=True))
                                           for kind, dim in (("full", 512), ("sliding", 256))}
    if device == "cuda":  # the full size's layers (16 query heads) at a served turn's shapes, bf16
        full_size = [LayerShape(False, 2, 512), LayerShape(True, 8, 256)]
        for canvases, prompt, chunk in ((1, 300, 16), (32, 300, 16), (32, 2000, 2048), (64, 600, 16)):
            results[f"served:{canvases}x32 over {prompt}, chunk {chunk}"] = compare(
                full_size, torch.bfloat16, generator, device, heads=16, served=(canvases, prompt, chunk))
    print(json.dumps(results, indent=None if device == "cpu" else 1))


if __name__ == "__main__":
    main()
