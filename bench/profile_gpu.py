"""Where one engine turn's GPU time goes: torch.profiler over one flat turn of the ticket (16 new
states) and one of walk frames, on the full-size random-weight model.

The reader is the one `djev serve` builds (bench/models.py `load_random`: `hf_reader` over random
weights, the warm-up and the graphs captured before ready), with TORCH_COMPILE and FUSED_MOE as
--compile and --fused-moe say and CUDA_GRAPHS off with --eager. The reads are the ones the Decider
sends for each decision (the README's ticket, each state its own; the walk page's first stage, each
frame new and preprocessed as the reader's image workers do before queueing), one read job per
decision as the reader queues them, and one turn (`FlatEngine.step`) over them all is profiled:
as much of them as TURN_TOKENS holds (the table's heading says how much the turn took). A turn of
other states and frames runs first, untimed, so nothing the profiled turn runs is built in it.

Each turn prints its wall time (device synchronised), its kernels' device time by op family (experts,
dense matmuls, attention, norms, copies, other: told apart by the kernels' names, see FAMILIES; with
CUDA graphs the kernels run inside replays and show under their own names) and the kernels that take
the most time. On the CPU (--tiny --device cpu, a smoke test of this script) the table is the aten
ops' own CPU time instead: there the experts' eager loop shows as matmuls and copies.

    python bench/profile_gpu.py [--compile] [--fused-moe] [--eager]   # on a GPU box
    python bench/profile_gpu.py --tiny --device cpu --states 4 --frames 2     # CPU smoke test
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import at_least, device_sync, fmt, header, machine, markdown_table, timed_call, write_json  # noqa: E402
from bench.models import load_random  # noqa: E402
from bench.workload import WALK_REQUEST, frames, ticket_request  # noqa: E402

# Op families by the kernel's (or, on the CPU, the aten op's) name, lower-cased: the first family one
# of whose words the name holds. Attention first (djev's segment kernel is `_segments`), then the
# experts (grouped_mm's grouped GEMMs, djev's Triton kernels, the router's top-k and the tokens'
# sort by expert), the norms (an RMSNorm's square and mean: `pow` and `mean` kernels eagerly, a Triton
# kernel holding `rsqrt` compiled; its scaling multiply shows under other), the dense matmuls, the
# copies.
FAMILIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("attention", ("_segments", "segment", "attention", "attn", "flash", "fmha", "sdpa")),
    ("experts", ("group", "expert", "moe", "gate_up_kernel", "down_kernel", "block_pairs", "topk", "sort",
                 "histc", "bincount")),
    ("norms", ("norm", "rsqrt", "pow", "mean")),
    ("dense matmuls", ("gemm", "gemv", "matmul", "aten::mm", "aten::addmm", "aten::bmm", "aten::linear", "cutlass",
                       "cublas", "xmma", "nvjet", "sm90_", "sm80_", "ampere_")),
    ("copies", ("copy", "memcpy", "memset", "catarray", "aten::cat", "index", "scatter", "gather", "fill",
                "clone", "contiguous")),
)
OTHER = "other"


def family(name: str) -> str:
    lowered = name.lower()
    for label, words in FAMILIES:
        if any(word in lowered for word in words):
            return label
    return OTHER


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
    decider = Decider(recorder, build.read_settings(Settings()))
    specs = []
    for index, body in enumerate(bodies):
        recorder.specs.clear()
        await decider.decide(parse_decision(body, build.limits(Settings()), images=images[index] if images else ()))
        specs.append(recorder.specs[0])
    return specs


def ticket_specs(reader: Any, count: int, rng: random.Random) -> tuple[list[Any], None]:
    return asyncio.run(first_reads(reader, [ticket_request(rng) for _ in range(count)])), None


def frame_specs(reader: Any, count: int) -> tuple[list[Any], dict[Any, Any]]:
    """Walk frames' first reads, each frame new, and their images preprocessed (as the reader's image
    workers do before a job is queued)."""
    from app.engine.base import ImageInput

    pictures = [(ImageInput(data, "image/jpeg", "frame"),) for data in frames(count)]
    specs = asyncio.run(first_reads(reader, [WALK_REQUEST] * count, pictures))
    images = reader.runner.images
    return specs, {spec.prompt.cache_key[1]: images.preprocess(spec.prompt) for spec in specs}


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


def profile_turn(runner: Any, specs: Sequence[Any], preprocessed: Any, warm: tuple[Sequence[Any], Any],
                 top: int) -> dict[str, Any]:
    """A warm-up turn over `warm`'s reads (finished untimed), then one profiled turn over `specs`:
    its wall time, what it took, its time by op family and its top kernels (ops on the CPU)."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    on_cuda = runner.device.type == "cuda"
    sync = device_sync(runner.device)
    finish(runner, entries(runner, *warm))
    queue = entries(runner, specs, preprocessed)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    with torch.no_grad(), profile(activities=activities) as prof:
        report, seconds = timed_call(lambda: runner.flat.step(queue), sync)
    finish(runner, queue)
    by_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for event in prof.events():
        if on_cuda and event.device_type == DeviceType.CUDA:
            spent = event.device_time_total
        elif not on_cuda and event.device_type == DeviceType.CPU:
            spent = event.self_cpu_time_total
        else:
            continue
        by_name[event.name][0] += spent / 1000
        by_name[event.name][1] += 1
    total = sum(ms for ms, _ in by_name.values())
    families: dict[str, dict[str, float]] = {label: {"ms": 0.0, "count": 0} for label, _ in (*FAMILIES, (OTHER, ()))}
    for name, (ms, count) in by_name.items():
        families[family(name)]["ms"] += ms
        families[family(name)]["count"] += count
    for entry in families.values():
        entry["ms"] = round(entry["ms"], 3)
        entry["share"] = round(entry["ms"] / total, 3) if total else 0.0
    kernels = sorted(by_name.items(), key=lambda item: -item[1][0])[:top]
    return {"wall_ms": round(seconds * 1000, 2), "timed": "device kernels" if on_cuda else "CPU ops (self time)",
            "total_ms": round(total, 3), "reads": len(report.ran), "of_reads": len(specs),
            "prompt_tokens": report.prompt_tokens, "canvas_tokens": report.canvas_tokens,
            "canvases": report.canvas_parts, "families": families,
            "top": [{"name": name, "family": family(name), "ms": round(ms, 3), "count": int(count)}
                    for name, (ms, count) in kernels]}


def report_lines(name: str, turn: dict[str, Any]) -> list[str]:
    rows = [[label, fmt(entry["ms"], 2), fmt(entry["share"] * 100, 0) + " %", int(entry["count"])]
            for label, entry in turn["families"].items()]
    rows.append(["total", fmt(turn["total_ms"], 2), "100 %", sum(int(e["count"]) for e in turn["families"].values())])
    top = [[entry["name"][:90], entry["family"], fmt(entry["ms"], 2), entry["count"]] for entry in turn["top"]]
    return [f"### {name}: wall {turn['wall_ms']:.1f} ms; the turn took {turn['reads']} of {turn['of_reads']} reads: "
            f"{turn['prompt_tokens']} prompt and {turn['canvas_tokens']} canvas tokens, {turn['canvases']} canvases", "",
            markdown_table(["op family", f"ms ({turn['timed']})", "share", "calls"], rows), "",
            markdown_table(["kernel" if turn["timed"] == "device kernels" else "op", "family", "ms", "calls"], top), ""]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="the tiny config (a CPU smoke test of this script)")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    parser.add_argument("--compile", action="store_true", help="TORCH_COMPILE=1: the layer bodies compiled")
    parser.add_argument("--fused-moe", action="store_true", help="FUSED_MOE=1: the experts as djev's Triton kernels")
    parser.add_argument("--eager", action="store_true", help="CUDA_GRAPHS=0: the turn's forward without graphs")
    parser.add_argument("--turn-tokens", type=int, default=0, help="TURN_TOKENS (default: the server's, by device)")
    parser.add_argument("--states", type=at_least(1), default=16, help="ticket decisions in the turn (default 16)")
    parser.add_argument("--frames", type=at_least(1), default=8, help="walk frames in the turn (default 8)")
    parser.add_argument("--top", type=at_least(1), default=12, help="kernels listed a turn (default 12)")
    parser.add_argument("--out", default=None, help="JSON file (default: $OUT/profile_gpu.json when $OUT is set)")
    args = parser.parse_args(argv)
    import torch

    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if not args.tiny and not args.device.startswith("cuda"):
        parser.error("the full-size model needs a GPU; use --tiny to check the script on a CPU")
    if args.out is None and os.environ.get("OUT"):
        args.out = str(Path(os.environ["OUT"]) / "profile_gpu.json")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    from app.config import Settings

    args = parse_args(argv)
    info = machine()
    settings = Settings.of(device=args.device, torch_compile=args.compile, fused_moe=args.fused_moe,
                           cuda_graphs=not args.eager, turn_tokens=args.turn_tokens)
    print(f"building the {'tiny' if args.tiny else 'full-size'} model and its reader on {args.device} ...", flush=True)
    reader = load_random(args.tiny, args.device, settings)
    runner = reader.runner
    rng = random.Random(0)
    turns = {
        f"the ticket, {args.states} new states": profile_turn(
            runner, *ticket_specs(reader, args.states, rng), ticket_specs(reader, args.states, rng), args.top),
        f"walk frames, {args.frames} new": profile_turn(
            runner, *frame_specs(reader, args.frames), frame_specs(reader, args.frames), args.top),
    }
    graphs = runner.flat.forward.graphs
    mode = (f"turns of {runner.flat.budget} tokens, " + ("eager" if graphs is None else
            "CUDA graphs" if graphs.config.capture else "pieces uncaptured")
            + (", compiled" if args.compile else "") + (", fused experts" if args.fused_moe else ""))
    print(header(f"profile_gpu: one engine turn by op family ({mode})", info))
    print()
    for name, turn in turns.items():
        print("\n".join(report_lines(name, turn)), flush=True)
    if args.out:
        path = write_json(args.out, {"machine": info, "mode": mode, "turns": turns})
        print(f"results: {path}")


if __name__ == "__main__":
    main()
