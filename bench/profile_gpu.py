"""Where an engine turn's GPU time goes, and how far it is from the floor the model's shapes set:
torch.profiler over flat turns of 1, 8 and 32 requests (--levels) of the ticket and of the walk, on
the full-size random-weight model, with the turn's forward captured as CUDA graphs and eager
(--modes).

The reader is the one `djev serve` builds (bench/models.py `load_random`: `hf_reader` over random
weights, the warm-up and the graphs captured before ready), with TORCH_COMPILE and FUSED_MOE as
--compile and --fused-moe say; the eager mode's reader is built with CUDA_GRAPHS off. One reader a
mode: it profiles every turn, then is dropped (gc, the CUDA cache emptied) before the next is built
(the full-size model is 47 GiB of an 80 GB card). The reads are the ones the Decider sends for each
decision: the README's ticket, each request a new state (bench/workload.py `ticket_request`); the
walk page's first stage, each request a new frame, preprocessed as the reader's image workers do
before queueing. One read job a decision, as the reader queues them, and one turn
(`FlatEngine.step`) over them is profiled: as many as TURN_TOKENS holds (each table's heading says
how many it took, and its prompt and canvas tokens). A turn of other states and frames at the same
level runs first, untimed, so nothing the profiled turn runs is built in it.

Each turn's table is its wall time (device synchronised) by op family: the device kernels, told apart
by name (FAMILIES: lower-cased, the first family one of whose words the name holds; with CUDA graphs
the kernels run inside replays and show under their own names), except the vision tower's and the
slot reads' (the label log-probabilities' unembedding and readback, `slot_reads_at`): the engine
marks neither stage, so for the profiled turn this script wraps the runner's `images.image_features`
and `slot_reads_at` in torch.profiler.record_function ranges (STAGES) and every kernel launched
inside one is that stage's. "host between kernels" is the wall time less the union of the kernels'
[start, end) on the device: the time the device waited on the host. Then the kernels that take the
most time, and the floor (`turn_floor`) for the turn's tokens, from the model's shapes:

    floor = max(the experts' weight read, the experts' math) + the other weights' math + attention's math

the weight read of only the experts the turn's T tokens touch (each layer's E experts, top k of them
a token: E (1 - (1 - k/E)^T) expected) at --bandwidth-tbs; the math at --tflops: 2 FLOP a weight a
token (top k experts; the attention projections, the dense MLP and the router: ~55e6 weights a layer
full-size), and attention's 4 x query width FLOP a query-key pair (a prompt token with its earlier
tokens, within the window on sliding layers; a canvas token with its prompt and its canvas). The
vision tower and the slot reads are not in the floor. "x the floor" is the kernels' union over it.

On the CPU (--tiny --device cpu, a smoke test of this script) the table is the aten ops' own CPU time
instead (host between ops: the wall less their union), and the floor is the tiny shapes' at the GPU's
numbers.

    python bench/profile_gpu.py [--compile] [--fused-moe] [--levels 1,8,32] [--modes captured,eager]  # GPU
    python bench/profile_gpu.py --tiny --device cpu --levels 1,2 --modes eager                        # CPU smoke
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import gc
import random
import sys
import weakref
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence, cast

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (  # noqa: E402
    at_least,
    device_sync,
    fmt,
    header,
    machine,
    markdown_table,
    numbers,
    settle_device_and_out,
    timed_call,
    write_json,
)
from bench.models import FULL_TEXT_CONFIG, load_random  # noqa: E402
from bench.workload import WALK_REQUEST, frames, ticket_request  # noqa: E402

# The stages the engine does not mark, as record_function ranges this script puts around the runner's
# methods (by their path from the runner) for the profiled turn (`stage_ranges`): a kernel (an op on the
# CPU) run inside one is named "<range>: <its name>", so FAMILIES' first two families take it whatever
# its name. The vision tower's is its passes (`image_features`: the images of the turn's new prompts
# through the tower together); an image's upload and the device's finishing of its pixels come before,
# as the turn prepares its prompts (`images.model_inputs`), and count by their kernels' names.
VISION_RANGE = "djev.vision_tower"
SLOT_RANGE = "djev.slot_reads"
STAGES: dict[str, str] = {VISION_RANGE: "images.image_features", SLOT_RANGE: "slot_reads_at"}

# Op families by the kernel's (or, on the CPU, the aten op's) name, lower-cased, with its stage range
# before it: the first family one of whose words the name holds. The stages first; then the router
# and the tokens' sort by expert (top-k, cub's radix sorts, the histogram of experts, the compiled
# router kernel, whose name holds `expert_rows` and the norm's mean and pow) before the experts
# (grouped_mm's grouped GEMMs, djev's Triton kernels); attention (djev's segment kernel is `_segments`;
# SDPA's flash and cuDNN kernels); the norms (an RMSNorm's square and mean: `pow` and `mean` kernels
# eagerly, a Triton kernel holding `rsqrt` or `mean_mul_pow` compiled; its scaling multiply shows under
# other) and the rotary embedding (its cos and sin; eagerly its rotate-half is a neg and a cat:
# copies and other); the dense projections (cuBLAS's nvjet and cutlass GEMMs); the copies.
FAMILIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("vision tower", (VISION_RANGE,)),
    ("slot reads", (SLOT_RANGE,)),
    ("router and sort", ("router", "expert_rows", "topk", "sort", "radix", "histc", "histogram", "bincount",
                         "block_pairs", "searchsorted")),
    ("experts", ("gate_up_kernel", "down_kernel", "group", "expert", "moe")),
    ("attention", ("_segments", "attention", "attn", "flash", "fmha", "sdpa", "fprop")),
    ("norms and rotary", ("norm", "rsqrt", "pow", "mean", "rotary", "rope", "_cos_", "_sin_", "cos_kernel",
                          "sin_kernel", "aten::cos", "aten::sin")),
    ("dense projections", ("gemm", "gemv", "matmul", "aten::mm", "aten::addmm", "aten::bmm", "aten::linear",
                           "cutlass", "cublas", "xmma", "nvjet", "sm90_", "sm80_", "ampere_")),
    ("copies", ("copy", "memcpy", "memset", "catarray", "aten::cat", "index", "scatter", "gather", "fill",
                "clone", "contiguous")),
)
OTHER = "other"
HOST = "host between kernels"
MODES = ("captured", "eager")
WORKLOADS = ("ticket", "walk")


def family(name: str) -> str:
    lowered = name.lower()
    for label, words in FAMILIES:
        if any(word in lowered for word in words):
            return label
    return OTHER


# ---------------------------------------------------------------------------------------- the floor

@dataclass(frozen=True)
class LayerCost:
    """What one text layer costs a token: its attention's kind and query width (query heads x head
    dim, the value width too), the weights every token multiplies (attention projections, dense MLP,
    router), and its experts (how many, the weights of one: gate-up and down, how many a token takes)."""

    sliding: bool
    query_width: int
    dense_params: int
    experts: int
    expert_params: int
    top_k: int


@dataclass(frozen=True)
class ModelShape:
    """The text layers' costs, the sliding window and the bytes of a weight."""

    layers: tuple[LayerCost, ...]
    window: int
    weight_bytes: int = 2


def full_shape(config: dict[str, Any] = FULL_TEXT_CONFIG, weight_bytes: int = 2) -> ModelShape:
    """The full-size model's shape from its config (bench/models.py FULL_TEXT_CONFIG), in bf16: the
    5:1 sliding:full pattern with the last layer full; full layers' K is their V (no V projection)."""
    hidden, experts, inter = config["hidden_size"], config["num_experts"], config["moe_intermediate_size"]
    dense_mlp, router = 3 * hidden * config["intermediate_size"], hidden * experts
    layers = []
    for index in range(config["num_hidden_layers"]):
        sliding = (index + 1) % 6 != 0
        head = config["head_dim"] if sliding else config["global_head_dim"]
        kv_heads = config["num_key_value_heads"] if sliding else config["num_global_key_value_heads"]
        query = config["num_attention_heads"] * head
        kv = kv_heads * head * (1 if not sliding and config["attention_k_eq_v"] else 2)
        layers.append(LayerCost(sliding, query, 2 * hidden * query + hidden * kv + dense_mlp + router, experts,
                                3 * inter * hidden, config["top_k_experts"]))
    return ModelShape(tuple(layers), config["sliding_window"], weight_bytes)


def model_shape(model: Any) -> ModelShape:
    """A built model's shape, from its encoder's layers (the decoder's are the same, tied)."""
    from app.engine.hf.parts import encoder_layers, layer_types, text_config

    config = text_config(model)
    built: list[Any] = list(encoder_layers(model))  # the modules' attributes as the model built them
    layers = []
    for layer, kind in zip(built, layer_types(model)):
        attention = layer.self_attn
        projections = [attention.q_proj, attention.k_proj, getattr(attention, "v_proj", None), attention.o_proj,
                       layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj, layer.router.proj]
        experts = layer.experts
        count = int(experts.gate_up_proj.shape[0])
        layers.append(LayerCost(kind == "sliding_attention", int(attention.q_proj.out_features),
                                sum(module.weight.numel() for module in projections if module is not None), count,
                                (experts.gate_up_proj.numel() + experts.down_proj.numel()) // count,
                                int(config.top_k_experts or 0)))
    return ModelShape(tuple(layers), int(config.sliding_window or 0), model.dtype.itemsize)


def causal_pairs(length: float, window: int | None) -> float:
    """Query-key pairs of a prompt of `length` tokens, each token with itself and its earlier ones,
    at most `window` keys (None: all)."""
    if window is None or length <= window:
        return length * (length + 1) / 2
    return window * (window + 1) / 2 + (length - window) * window


def turn_floor(prompt_tokens: int, canvas_tokens: int, *, prompts: int = 1, canvases: int = 1,
               shape: ModelShape | None = None, bandwidth_tbs: float = 3.0, tflops: float = 650.0) -> dict[str, float]:
    """The least time a turn of `prompt_tokens` prompt and `canvas_tokens` canvas tokens can take on a
    device of `bandwidth_tbs` TB/s and `tflops` TFLOP/s, in ms, by its terms: the experts'
    weight read (each layer's expected distinct experts of the turn's tokens) or their math, whichever is
    longer, plus the other weights' math and attention's. The prompt tokens are `prompts` prompts of
    equal length, the canvas tokens `canvases` canvases of equal width, each canvas over one such prompt.
    `shape`: the model's (default: the full-size one, bf16)."""
    shape = shape or full_shape()
    tokens = prompt_tokens + canvas_tokens
    flops, bandwidth = tflops * 1e12, bandwidth_tbs * 1e12
    prompt = prompt_tokens / prompts if prompts else 0.0
    width = canvas_tokens / canvases if canvases else 0.0
    touched = expert_bytes = expert_flops = other_flops = attention_flops = 0.0
    for layer in shape.layers:
        distinct = layer.experts * (1 - (1 - layer.top_k / layer.experts) ** tokens) if tokens else 0.0
        touched += distinct / len(shape.layers)
        expert_bytes += distinct * layer.expert_params * shape.weight_bytes
        expert_flops += 2 * tokens * layer.top_k * layer.expert_params
        other_flops += 2 * tokens * layer.dense_params
        window = shape.window if layer.sliding and shape.window else None
        keys = prompt + width if window is None else min(prompt + width, window)
        pairs = (prompts * causal_pairs(prompt, window) if prompts else 0.0) + canvas_tokens * keys
        attention_flops += 4 * layer.query_width * pairs
    terms = {"expert_bytes_ms": expert_bytes / bandwidth * 1000, "expert_math_ms": expert_flops / flops * 1000,
             "other_math_ms": other_flops / flops * 1000, "attention_math_ms": attention_flops / flops * 1000}
    floor = max(terms["expert_bytes_ms"], terms["expert_math_ms"]) + terms["other_math_ms"] + terms["attention_math_ms"]
    return {"tokens": tokens, "prompt_tokens": prompt_tokens, "canvas_tokens": canvas_tokens,
            "experts_touched_a_layer": touched, "expert_gib": expert_bytes / 2**30, **terms, "floor_ms": floor,
            "bandwidth_tbs": bandwidth_tbs, "tflops": tflops}


# ---------------------------------------------------------------------------------------- the reads

class SpecRecorder:
    """A reader with no model: records the ReadSpecs the Decider sends, answering each slot's first
    label (so a gated stage is not asked: the walk page's first stage is its read)."""

    def __init__(self, reader: Any) -> None:
        self.tokenizer = reader.tokenizer
        self.info = reader.info
        self.specs: list[Any] = []

    async def read(self, specs: Sequence[Any]) -> list[Any]:
        from app.engine.base import ReadResult, SlotRead

        self.specs.extend(specs)
        return [ReadResult(slots=tuple(tuple(SlotRead(tuple(0.0 for _ in ids), ids[0]) for ids in spec.label_ids)
                                       for _ in spec.canvases), prompt_tokens=len(spec.prompt.ids)) for spec in specs]

    async def generate(self, spec: Any) -> Any:
        raise NotImplementedError("these decisions write no thought")


async def first_reads(reader: Any, bodies: Sequence[dict[str, Any]], images: Sequence[tuple[Any, ...]] = ()) -> list[Any]:
    """The first read the Decider sends for each decision (`bodies`, with `images` where given)."""
    from app import build
    from app.config import Settings
    from app.decisions.request import parse_decision
    from app.decisions.run import Decider

    recorder = SpecRecorder(reader)
    decider = Decider(cast(Any, recorder), build.read_settings(Settings()))  # the reader calls it makes, no more
    specs = []
    for index, body in enumerate(bodies):
        recorder.specs.clear()
        await decider.decide(parse_decision(body, build.limits(Settings()), images=images[index] if images else ()))
        specs.append(recorder.specs[0])
    return specs


def ticket_specs(reader: Any, count: int, rng: random.Random) -> tuple[list[Any], None]:
    """The ticket's first reads, each decision a new state."""
    return asyncio.run(first_reads(reader, [ticket_request(rng) for _ in range(count)])), None


def frame_specs(reader: Any, count: int) -> tuple[list[Any], dict[Any, Any]]:
    """Walk frames' first reads, each frame new, and their images preprocessed (as the reader's image
    workers do before a job is queued)."""
    from app.engine.base import ImageInput

    pictures = [(ImageInput(data, "image/jpeg", "frame"),) for data in frames(count)]
    specs = asyncio.run(first_reads(reader, [WALK_REQUEST] * count, pictures))
    images = reader.runner.images
    return specs, {spec.prompt.cache_key[1]: images.preprocess(spec.prompt) for spec in specs}


def workload_specs(reader: Any, workload: str, count: int, rng: random.Random) -> tuple[list[Any], Any]:
    return ticket_specs(reader, count, rng) if workload == "ticket" else frame_specs(reader, count)


def entries(runner: Any, specs: Sequence[Any], preprocessed: Any) -> list[Any]:
    """One read job a decision, as the reader queues them (each its own caller)."""
    from app.engine.hf.engine import Solo
    from app.engine.hf.reads import ReadProgram

    return [Solo(ReadProgram(runner, [spec], preprocessed), caller=number) for number, spec in enumerate(specs)]


def finish(runner: Any, queue: Sequence[Any]) -> None:
    """The queue's programs stepped to their end, untimed, and released."""
    import torch

    with torch.no_grad():
        while any(not entry.work.done for entry in queue):
            runner.flat.step(queue)
    for entry in queue:
        runner.flat.release(entry.work)


# ---------------------------------------------------------------------------------------- the profile

@contextmanager
def stage_ranges(runner: Any) -> Iterator[None]:
    """STAGES' record_function ranges around the runner's methods while the block runs (set on the
    instances, so the engine's calls find them; removed after)."""
    from torch.profiler import record_function

    def ranged(method: Callable[..., Any], label: str) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            with record_function(label):
                return method(*args, **kwargs)

        return call

    owners = []
    for path in STAGES.values():
        *parents, attribute = path.split(".")
        owners.append((functools.reduce(getattr, parents, runner), attribute))
    for (owner, attribute), label in zip(owners, STAGES):
        setattr(owner, attribute, ranged(getattr(owner, attribute), label))
    try:
        yield
    finally:
        for owner, attribute in owners:
            delattr(owner, attribute)


def union_ms(intervals: Sequence[tuple[float, float]]) -> float:
    """The length of the union of [start, end) intervals (in us), in ms."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end <= reach:
            continue
        total += end - max(start, reach)
        reach = end
    return total / 1000


def within(ranges: Sequence[tuple[str, float, float]], start: float, end: float) -> str:
    """The name of the range of `ranges` that holds [start, end] ("" for none)."""
    for name, first, last in ranges:
        if first <= start and end <= last:
            return name
    return ""


def timed_events(events: Sequence[Any], on_cuda: bool) -> list[tuple[str, float, float, float]]:
    """(name, ms, start, end) of each device kernel (CUDA) or aten op (CPU: its own time), its name
    prefixed by the STAGES range it ran in. A kernel is in a range when the op that launched it began
    inside the range on the host, or (where the profiler links no op) when it ran inside the range's
    span on the device."""
    from torch.profiler import DeviceType

    def annotation(event: Any) -> bool:
        return bool(getattr(event, "is_user_annotation", False)) or event.name in STAGES

    host = [(e.name, e.time_range.start, e.time_range.end) for e in events
            if e.device_type == DeviceType.CPU and e.name in STAGES]
    device = [(e.name, e.time_range.start, e.time_range.end) for e in events
              if e.device_type == DeviceType.CUDA and e.name in STAGES]
    launchers = {e.id: e for e in events if e.device_type == DeviceType.CPU
                 and not getattr(e, "linked_correlation_id", 0)}
    timed = []
    for event in events:
        start, end = event.time_range.start, event.time_range.end
        if on_cuda and event.device_type == DeviceType.CUDA and not annotation(event):
            launcher = launchers.get(getattr(event, "linked_correlation_id", 0) or -1)
            stage = (within(host, launcher.time_range.start, launcher.time_range.start) if launcher is not None
                     else within(device, start, end))
            ms = (end - start) / 1000
        elif not on_cuda and event.device_type == DeviceType.CPU and not annotation(event):
            stage, ms = within(host, start, end), event.self_cpu_time_total / 1000
        else:
            continue
        timed.append((f"{stage}: {event.name}" if stage else event.name, ms, start, end))
    return timed


def turn_table(timed: Sequence[tuple[str, float, float, float]], wall_ms: float, top: int) -> dict[str, Any]:
    """The turn's time by family (and the host's between kernels), its kernels' union and top kernels."""
    by_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for name, ms, _, _ in timed:
        by_name[name][0] += ms
        by_name[name][1] += 1
    busy = union_ms([(start, end) for _, _, start, end in timed])
    families: dict[str, dict[str, float]] = {label: {"ms": 0.0, "count": 0} for label, _ in (*FAMILIES, (OTHER, ()))}
    for name, (ms, count) in by_name.items():
        families[family(name)]["ms"] += ms
        families[family(name)]["count"] += count
    kernels = sum(entry["ms"] for entry in families.values())
    families[HOST] = {"ms": max(0.0, wall_ms - busy), "count": 0}
    for entry in families.values():
        entry["share"] = round(entry["ms"] / wall_ms, 3) if wall_ms else 0.0
        entry["ms"] = round(entry["ms"], 3)
    ranked = sorted(by_name.items(), key=lambda item: -item[1][0])[:top]
    return {"kernels_ms": round(kernels, 3), "busy_ms": round(busy, 3), "host_ms": families[HOST]["ms"],
            "families": families,
            "top": [{"name": name, "family": family(name), "ms": round(ms, 3), "count": int(count)}
                    for name, (ms, count) in ranked]}


def profile_turn(runner: Any, specs: Sequence[Any], preprocessed: Any, warm: tuple[Sequence[Any], Any],
                 top: int) -> tuple[Any, float, list[tuple[str, float, float, float]]]:
    """A warm-up turn over `warm`'s reads (finished untimed), then one profiled turn over `specs`, its
    stages ranged: its report, wall seconds and `timed_events`."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    on_cuda = runner.device.type == "cuda"
    sync = device_sync(runner.device)
    finish(runner, entries(runner, *warm))
    queue = entries(runner, specs, preprocessed)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    with torch.no_grad(), stage_ranges(runner), profile(activities=activities) as prof:
        report, seconds = timed_call(lambda: runner.flat.step(queue), sync)
    finish(runner, queue)
    events = prof.events()
    assert events is not None  # the profile has ended
    return report, seconds, timed_events(events, on_cuda)


def turn_result(report: Any, seconds: float, timed: Sequence[tuple[str, float, float, float]], of_reads: int,
                shape: ModelShape, args: argparse.Namespace, on_cuda: bool) -> dict[str, Any]:
    """One profiled turn for the JSON: what it took, its table and its floor."""
    wall_ms = seconds * 1000
    table = turn_table(timed, wall_ms, args.top)
    floor = turn_floor(report.prompt_tokens, report.canvas_tokens, prompts=len(report.ran),
                       canvases=report.canvas_parts, shape=shape, bandwidth_tbs=args.bandwidth_tbs, tflops=args.tflops)
    over = round(table["busy_ms"] / floor["floor_ms"], 2) if floor["floor_ms"] else None
    return {"wall_ms": round(wall_ms, 2), "timed": "device kernels" if on_cuda else "CPU ops (self time)",
            "reads": len(report.ran), "of_reads": of_reads, "prompt_tokens": report.prompt_tokens,
            "canvas_tokens": report.canvas_tokens, "canvases": report.canvas_parts, **table, "floor": floor,
            "over_floor": over}


def profile_mode(reader: Any, mode: str, args: argparse.Namespace, rng: random.Random) -> list[dict[str, Any]]:
    """Every workload's turn at every level on this mode's reader."""
    runner = reader.runner
    shape = model_shape(runner.model)
    on_cuda = runner.device.type == "cuda"
    turns = []
    for workload in args.workloads:
        for level in args.levels:
            specs, preprocessed = workload_specs(reader, workload, level, rng)
            warm = workload_specs(reader, workload, level, rng)
            report, seconds, timed = profile_turn(runner, specs, preprocessed, warm, args.top)
            noun = ("state" if workload == "ticket" else "frame") + ("s" if level > 1 else "")
            turn = {"mode": mode, "workload": workload, "level": level,
                    "name": f"{mode}: the {workload}, {level} new {noun}",
                    **turn_result(report, seconds, timed, len(specs), shape, args, on_cuda)}
            print("\n".join(report_lines(turn)), flush=True)
            turns.append(turn)
    return turns


# ---------------------------------------------------------------------------------------- reporting

def times(over: float | None) -> str:
    return "-" if over is None else fmt(over, 1)


def short(ms: float) -> str:
    """A floor's term: two decimals, or three significant digits below 1 ms (the tiny model's)."""
    return f"{ms:.2f}" if ms >= 1 else f"{ms:.3g}"


def report_lines(turn: dict[str, Any]) -> list[str]:
    rows = [[label, fmt(entry["ms"], 2), fmt(entry["share"] * 100, 0) + " %", "-" if label == HOST else int(entry["count"])]
            for label, entry in turn["families"].items()]
    rows.append(["wall", fmt(turn["wall_ms"], 2), "100 %", sum(int(e["count"]) for e in turn["families"].values())])
    top = [[entry["name"][:90], entry["family"], fmt(entry["ms"], 2), entry["count"]] for entry in turn["top"]]
    floor = turn["floor"]
    kernel = "kernel" if turn["timed"] == "device kernels" else "op"
    return [f"### {turn['name']}: wall {turn['wall_ms']:.1f} ms; the turn took {turn['reads']} of {turn['of_reads']} "
            f"reads: {turn['prompt_tokens']} prompt and {turn['canvas_tokens']} canvas tokens, {turn['canvases']} "
            f"canvas{'' if turn['canvases'] == 1 else 'es'}", "",
            markdown_table(["op family", f"ms ({turn['timed']})", "share of wall", "calls"], rows), "",
            f"floor {short(floor['floor_ms'])} ms for {floor['tokens']} tokens; the turn's {kernel}s are "
            f"{times(turn['over_floor'])} x the floor ({kernel}s' union {turn['busy_ms']:.2f} ms; the floor: the "
            f"experts' weights {short(floor['expert_bytes_ms'])} ms for {floor['experts_touched_a_layer']:.1f} "
            f"experts a layer at {floor['bandwidth_tbs']:g} TB/s, their math {short(floor['expert_math_ms'])}; the "
            f"other weights' math {short(floor['other_math_ms'])}; attention's {short(floor['attention_math_ms'])}; "
            f"at {floor['tflops']:g} TFLOP/s)", "",
            markdown_table([kernel, "family", "ms", "calls"], top), ""]


def summary_lines(turns: Sequence[dict[str, Any]]) -> list[str]:
    rows = [[turn["mode"], turn["workload"], f"{turn['reads']} of {turn['level']}",
             turn["prompt_tokens"] + turn["canvas_tokens"], fmt(turn["wall_ms"], 1), fmt(turn["busy_ms"], 1),
             fmt(turn["host_ms"], 1), short(turn["floor"]["floor_ms"]), times(turn["over_floor"])] for turn in turns]
    return ["### every turn", "", markdown_table(
        ["mode", "workload", "requests", "tokens", "wall ms", "kernels ms", "host ms", "floor ms", "x floor"], rows), ""]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="the tiny config (a CPU smoke test of this script)")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    parser.add_argument("--compile", action="store_true", help="TORCH_COMPILE=1: the layer bodies compiled")
    parser.add_argument("--fused-moe", action="store_true", help="FUSED_MOE=1: the experts as djev's Triton kernels")
    parser.add_argument("--modes", type=numbers(str), default=list(MODES),
                        help="captured (CUDA graphs) and/or eager (CUDA_GRAPHS=0), a reader each (default both)")
    parser.add_argument("--workloads", type=numbers(str), default=list(WORKLOADS),
                        help="ticket and/or walk (default both)")
    parser.add_argument("--levels", type=numbers(at_least(1)), default=[1, 8, 32],
                        help="requests in a profiled turn, comma-separated (default 1,8,32)")
    parser.add_argument("--turn-tokens", type=int, default=0, help="TURN_TOKENS (default: the server's, by device)")
    parser.add_argument("--bandwidth-tbs", type=float, default=3.0, help="the floor's memory bandwidth (default 3.0)")
    parser.add_argument("--tflops", type=float, default=650.0, help="the floor's bf16 TFLOP/s (default 650)")
    parser.add_argument("--top", type=at_least(1), default=12, help="kernels listed a turn (default 12)")
    parser.add_argument("--out", default=None, help="JSON file (default: $OUT/profile_gpu.json when $OUT is set)")
    args = parser.parse_args(argv)
    for name, allowed in (("modes", MODES), ("workloads", WORKLOADS)):
        given = getattr(args, name)
        if not given or any(value not in allowed for value in given):
            parser.error(f"--{name}: one or more of {','.join(allowed)}, not {','.join(given) or 'none'}")
    if not args.levels:
        parser.error("--levels: at least one")
    settle_device_and_out(parser, args, "profile_gpu.json")
    return args


def mode_label(runner: Any, args: argparse.Namespace) -> str:
    graphs = runner.flat.forward.graphs
    return (f"turns of {runner.flat.budget} tokens, " + ("eager" if graphs is None else
            "CUDA graphs" if graphs.config.capture else "pieces uncaptured")
            + (", compiled" if args.compile else "") + (", fused experts" if args.fused_moe else ""))


def give_memory_back(args: argparse.Namespace) -> str:
    """After a mode's reader is dropped: its memory given back (the compiled code forgotten, the
    garbage collected, the CUDA cache emptied); what is still allocated, for the log ("" off CUDA).
    The reader's start-up set every object then alive aside from the collector (`settle_heap`:
    gc.freeze), its runner's reference cycles too: they are given back to it first, or the model
    stays alive."""
    import torch
    import torch._dynamo

    if args.compile:
        torch._dynamo.reset()  # the compiled layer bodies hold the model's modules
    gc.unfreeze()
    gc.collect()
    if torch.device(args.device).type != "cuda":
        return ""
    torch.cuda.empty_cache()
    return f"{torch.cuda.memory_allocated() / 2**30:.2f} GiB allocated, {torch.cuda.memory_reserved() / 2**30:.2f} reserved"


def main(argv: Sequence[str] | None = None) -> None:
    from app.config import Settings

    args = parse_args(argv)
    info = machine()
    print(header(f"profile_gpu: engine turns by op family, and their floor ({'tiny' if args.tiny else 'full-size'} "
                 f"model, {', '.join(args.modes)})", info))
    print()
    rng = random.Random(0)
    turns: list[dict[str, Any]] = []
    modes: dict[str, str] = {}
    for mode in args.modes:
        settings = Settings.of(device=args.device, torch_compile=args.compile, fused_moe=args.fused_moe,
                               cuda_graphs=mode == "captured", turn_tokens=args.turn_tokens)
        print(f"building the {'tiny' if args.tiny else 'full-size'} model and its {mode} reader on {args.device} ...",
              flush=True)
        reader = load_random(args.tiny, args.device, settings)
        model = weakref.ref(reader.runner.model)
        modes[mode] = mode_label(reader.runner, args)
        print(f"## {mode}: {modes[mode]}\n", flush=True)
        turns.extend(profile_mode(reader, mode, args, rng))
        del reader
        left = give_memory_back(args)
        if model() is not None:
            print(f"WARNING: the {mode} reader's model is still referenced after it was dropped: its memory is not "
                  "given back", flush=True)
        if left:
            print(f"the {mode} reader dropped: {left}\n", flush=True)
    print("\n".join(summary_lines(turns)), flush=True)
    if args.out:
        path = write_json(args.out, {"machine": info, "modes": modes, "bandwidth_tbs": args.bandwidth_tbs,
                                     "tflops": args.tflops, "turns": turns})
        print(f"results: {path}")


if __name__ == "__main__":
    main()
