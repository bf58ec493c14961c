"""Does the flat turn read the same whatever shares its turn, captured or eager, and as transformers
reads? (GPU)

For each model size and dtype, seven reads (text prompts of 40 to 1500 tokens, one of them with 4 noise
draws, an image read, a two-step read) through the hf engine's flat turn (`DiffusionRunner.read`):

  (1) shared turn vs alone: each read alone (a runner's reads one after another), against all of them
      in one shared turn (one `read` of them all, on a runner of its own: their prompts and canvases
      in one forward, the two-step read's second step in a turn after it);
  (2) pieces vs eager: the same, alone and shared, through the forward's pieces by token count
      (CUDA_GRAPHS=1: captured before the reads, as `djev serve` captures them; on the CPU the same
      static buffers, padding and pieces run eagerly), against the eager forward's (CUDA_GRAPHS=0);
  (3) with --fused-moe, every read above through djev's Triton experts (FUSED_MOE), and those reads
      alone against grouped_mm's;
  (4) transformers: each read as transformers' own `DiffusionGemmaForBlockDiffusion.forward` reads it
      (`reference_read`: the whole prompt and the canvas through the library's forward, no djev code in
      it; the engine's sampler step between two steps), against the eager reads alone;

and the vision tower's static (graph) path against the library's forward.

With --weights fp8 (FP8 weights, docs/design.md §4.7), instead: --reads text reads of one canvas
(three slots of 2-3 labels each) on the full-size model in bf16, read with transformers' grouped_mm
experts and with djev's Triton kernels; then the same model's text layers quantized to FP8 in place
(`quantize_model`, as QUANTIZE=fp8 does at load) and the reads again. Printed: the slots whose bf16
top-label margin (top probability less the second) is over MARGIN (at least MIN_CONFIDENT wanted),
the FP8 reads' top-label agreement with bf16 on those slots, and the label-probability deviation
(mean and largest |dp|) of FP8 from bf16 beside the same deviation between djev's kernels and
grouped_mm in bf16: random routers flip their expert choices on any rounding, so that pair is the
yardstick of how far two bf16 paths already differ. Then both pairs again with the routes pinned
(`Routes`): the first bf16 run's expert choices, call by call, imposed on every later run, so a pair
differs by its arithmetic alone (FP8's rounding, or another kernel's), as a trained model's decisive
routers would keep their choices. Random weights still carry a rounding through every layer's
attention and MLP (the tiny model in bf16 against float32: 94 % of confident top labels kept with
free routes, 98 % pinned), so neither pair judges a real checkpoint's agreement. Each check prints the
largest label log-probability difference of each read and how many slots' top label (the label of
the highest log-probability) agree. In float32 everything agrees to ~1e-4. In bfloat16 with RANDOM
weights the paths diverge: the random routers' near-uniform top-8 expert choices flip on any rounding
difference between kernels (a padded row count, another attention kernel), and the flip cascades;
that is a property of random weights, not of the turn (float32 shows the math is the same).

One runner at a time: each runner is built, its reads run, only their results kept (label
log-probabilities, on the host), and the runner dropped with its memory (`gc.collect`, and
`torch.cuda.empty_cache` on CUDA) before the next one is built: each one's KV store preallocates its
bytes on CUDA, beside the 30-layer model's 47 GiB of weights.

    python bench/check_gpu_numerics.py              # on a GPU box
    python bench/check_gpu_numerics.py 6:float32    # one model size and dtype (layers:dtype ...)
    python bench/check_gpu_numerics.py --fused-moe  # every read through the experts' Triton kernels
                                                    # (FUSED_MOE), and those reads against grouped_mm's
    python bench/check_gpu_numerics.py --weights fp8 [--reads 300]   # FP8 against bf16 (see above)
    python bench/check_gpu_numerics.py --tiny --device cpu   # the CPU smoke test: the tiny config
                                                    # (its own layers; LAYERS is ignored), the pieces
                                                    # run without capture
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence, TypeVar

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.models import build_model, full_config, image_processor, model_config, served_experts  # noqa: E402
from bench.workload import Specs, frames  # noqa: E402

if TYPE_CHECKING:

    from app.engine.base import ReadResult, ReadSpec
    from app.engine.hf.runner import DiffusionRunner

T = TypeVar("T")
DEFAULT_SIZES = ("6:float32", "6:bfloat16", "30:bfloat16")
PROMPT_TOKENS = (40, 700, 1500)  # the text reads' prompts beside the two of 300 tokens (one with 4 draws)
# Each runner's turn budget (all seven reads fit one turn), longest state and KV store: the reads need
# a few thousand tokens of KV, and the store is preallocated on CUDA.
TURN_TOKENS = 8192
MAX_PROMPT_TOKENS = 8192
STORE_BYTES = 4 * 2**30
# --weights fp8: the slots counted (bf16 top-label margin over MARGIN), and how many are wanted.
MARGIN = 0.1
MIN_CONFIDENT = 200
FP8_BATCH = 32  # reads a `read` takes at once (a store of STORE_BYTES holds ~2,800 blocks of 16 tokens)
FP8_PROMPT_TOKENS = (60, 200, 500)  # the FP8 check's text reads cycle through these prompt lengths


# ---------------------------------------------------------------------------------------- comparing reads

def largest_difference(a: ReadResult, b: ReadResult) -> float:
    """The largest difference between two reads' label log-probabilities."""
    worst = 0.0
    for canvas_a, canvas_b in zip(a.slots, b.slots, strict=True):
        for slot_a, slot_b in zip(canvas_a, canvas_b, strict=True):
            worst = max(worst, max(abs(x - y) for x, y in zip(slot_a.label_logprobs, slot_b.label_logprobs)))
    return worst


def top_labels(result: ReadResult) -> list[int]:
    """Each slot's top label (the index of its highest label log-probability), canvas by canvas."""
    return [max(range(len(slot.label_logprobs)), key=slot.label_logprobs.__getitem__)
            for canvas in result.slots for slot in canvas]


def compared(a: Sequence[ReadResult], b: Sequence[ReadResult]) -> str:
    """The largest label log-probability difference of each read, and the slots whose top label agrees."""
    agree = total = 0
    for x, y in zip(a, b, strict=True):
        for first, second in zip(top_labels(x), top_labels(y), strict=True):
            agree += first == second
            total += 1
    largest = ", ".join(f"{largest_difference(x, y):.1e}" for x, y in zip(a, b))
    return f"[{largest}]  top label {agree}/{total}"


def slot_probabilities(result: ReadResult) -> list[list[float]]:
    """Each slot's label probabilities, canvas by canvas: its labels' full-vocabulary log-probabilities
    renormalised over the labels (what a decision answers with)."""
    import math

    shares = []
    for canvas in result.slots:
        for slot in canvas:
            top = max(slot.label_logprobs)
            weights = [math.exp(value - top) for value in slot.label_logprobs]
            shares.append([weight / sum(weights) for weight in weights])
    return shares


@dataclasses.dataclass(frozen=True)
class Agreement:
    """Two sets of the same reads, slot by slot: the confident slots of the first (top-label margin
    over the margin asked), how many of those keep their top label in the second, and the label
    probabilities' deviation over every slot."""

    slots: int
    confident: int
    agree: int
    mean_deviation: float
    largest_deviation: float

    def line(self) -> str:
        share = f"{100 * self.agree / self.confident:.1f} %" if self.confident else "-"
        return (f"top label {self.agree}/{self.confident} confident slots ({share}); |dp| mean "
                f"{self.mean_deviation:.4f}, largest {self.largest_deviation:.4f} over {self.slots} slots")


def agreement(base: Sequence[ReadResult], other: Sequence[ReadResult], margin: float = MARGIN) -> Agreement:
    """How `other` keeps `base`'s answers (see Agreement). Pure."""
    slots = confident = agree = 0
    total = largest = 0.0
    labels = 0
    for x, y in zip(base, other, strict=True):
        for first, second in zip(slot_probabilities(x), slot_probabilities(y), strict=True):
            slots += 1
            ranked = sorted(first, reverse=True)
            top = max(range(len(first)), key=first.__getitem__)
            if len(ranked) > 1 and ranked[0] - ranked[1] > margin:
                confident += 1
                agree += top == max(range(len(second)), key=second.__getitem__)
            for p, q in zip(first, second, strict=True):
                total += abs(p - q)
                largest = max(largest, abs(p - q))
                labels += 1
    return Agreement(slots, confident, agree, total / max(1, labels), largest)


def fp8_reads(vocab: int, count: int) -> list[ReadSpec]:
    """The FP8 check's `count` text reads of one canvas, their prompts FP8_PROMPT_TOKENS long in turn."""
    return [Specs(vocab, FP8_PROMPT_TOKENS[n % len(FP8_PROMPT_TOKENS)], seed=1000 + n).read() for n in range(count)]


def results(outcomes: Sequence[ReadResult | Exception]) -> list[ReadResult]:
    """A runner's reads, every one read (an exception raised)."""
    for outcome in outcomes:
        if isinstance(outcome, Exception):
            raise outcome
    return list(outcomes)  # type: ignore[arg-type]  # (every one a ReadResult, checked above)


# ---------------------------------------------------------------------------------------- pinned routes

class Routes:
    """Every router call's top-k experts, router by router in call order: recorded from one run, then
    imposed on another run of the same reads in the same turns (the same rows at each call), so the two
    runs differ by their arithmetic only, never by an expert one of them flips to. An imposed call
    keeps its own router's probabilities: its top-k weights are its probabilities at the imposed
    experts, normalised to sum to 1 and scaled per expert, as the library's router weighs its own
    top k. A run of other turns than the recorded one (another row count at a call, more calls) stops
    with a ValueError that says which router and call."""

    def __init__(self, model: Any) -> None:
        from transformers.models.diffusion_gemma.modeling_diffusion_gemma import DiffusionGemmaTextRouter

        self.routers = [module for module in model.modules() if isinstance(module, DiffusionGemmaTextRouter)]
        if not self.routers:
            raise ValueError("the model has no DiffusionGemma text routers to pin")
        self.recorded: dict[int, list[Any]] = {}  # router index -> its calls' top-k experts (on the host)

    def record(self) -> Any:
        """A context: every router call's experts kept (what was recorded before is dropped)."""
        self.recorded = {n: [] for n in range(len(self.routers))}

        def hook(n: int) -> Callable[..., None]:
            def keep(module: Any, args: Any, output: Any) -> None:
                self.recorded[n].append(output[2].detach().to("cpu"))
            return keep

        return self._hooked(hook)

    def impose(self) -> Any:
        """A context: the n-th call of each router takes the experts recorded at its n-th call."""
        if not any(self.recorded.values()):
            raise ValueError("no routes recorded: record a run before imposing its routes")
        calls = dict.fromkeys(self.recorded, 0)

        def hook(n: int) -> Callable[..., Any]:
            def pinned(module: Any, args: Any, output: Any) -> Any:
                probabilities, _, own = output
                call, recorded = calls[n], self.recorded[n]
                if call >= len(recorded) or tuple(recorded[call].shape) != tuple(own.shape):
                    seen = tuple(recorded[call].shape) if call < len(recorded) else "no call"
                    raise ValueError(f"router {n}, call {call}: the run routes {tuple(own.shape)} where the "
                                     f"recorded run routed {seen}: pin only the same reads in the same turns")
                calls[n] = call + 1
                index = recorded[call].to(own.device)
                weights = probabilities.gather(-1, index)
                weights = weights / weights.sum(dim=-1, keepdim=True)
                return probabilities, weights * module.per_expert_scale[index], index
            return pinned

        return self._hooked(hook)

    @contextlib.contextmanager
    def _hooked(self, hook: Callable[[int], Callable[..., Any]]) -> Iterator[Routes]:
        """A context in which router n runs `hook(n)` after its forward."""
        handles = [router.register_forward_hook(hook(n)) for n, router in enumerate(self.routers)]
        try:
            yield self
        finally:
            for handle in handles:
                handle.remove()


# ---------------------------------------------------------------------------------------- transformers' reads

def reference_read(model: Any, spec: ReadSpec, runner: DiffusionRunner) -> ReadResult:
    """`spec` as transformers' own forward reads it (tests/engine/hf/reference.py: the whole prompt
    and the canvas through the library's forward, the engine's sampler between steps); read before
    the experts are swapped where --fused-moe asks."""
    from tests.engine.hf.reference import reference_read as read

    return read(model, spec, runner=runner)


# ---------------------------------------------------------------------------------------- one runner at a time

def release(device: Any) -> None:
    """Give back the memory of what was just dropped: the runners hold cycles (the flat engine and
    its runner), so a collection first; then the allocator's cache, on CUDA."""
    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def one(make: Callable[[], Any], use: Callable[[Any], T], device: Any) -> T:
    """Build a runner (`make()`), run `use` on it and return what it returns (results on the host,
    nothing that holds the runner), then drop the runner and free its memory before anything else
    is built: one runner at a time."""
    runner = make()
    try:
        return use(runner)
    finally:
        del runner
        release(device)


def make_runner(model: Any, processor: Any, device: Any, pieces: bool) -> DiffusionRunner:
    """A runner over `model`: the eager forward, or (`pieces`) the forward's pieces by token count,
    captured as CUDA graphs on CUDA (the vision tower's too) and run eagerly over the same static
    buffers elsewhere; every bucket built before the reads, then frozen, as `djev serve` does."""
    from app.engine.hf.forward import PiecewiseForward
    from app.engine.hf.graphs.pieces import PiecewiseConfig
    from app.engine.hf.runner import DiffusionRunner

    made = DiffusionRunner(model, processor, device=device, max_prompt_tokens=MAX_PROMPT_TOKENS, max_rows=64,
                           turn_tokens=TURN_TOKENS, cuda_graphs=pieces, kv_bytes=STORE_BYTES)
    if pieces and not made.cuda_graphs:  # the CPU: the same pieces and buffers, nothing captured
        forward = made.flat.forward
        forward.graphs = PiecewiseForward(forward, model, PiecewiseConfig.for_budget(TURN_TOKENS, capture=False),
                                          made.stats)
        made.use_vision_graphs(capture=False)
    made.flat.prepare_graphs()
    return made


def pieces_note(runner: DiffusionRunner) -> str:
    """What a runner's pieces ran: turns replayed as graphs or run as uncaptured pieces, fallbacks to
    the eager forward, captures and the buckets that failed."""
    stats, graphs = runner.stats, runner.flat.forward.graphs
    if graphs is None:
        return "no pieces"
    failed = f", failed buckets {sorted(graphs.cache.failed)}" if graphs.cache.failed else ""
    return (f"{stats['flat_graph_replays']} turns replayed, {stats['flat_piecewise_turns']} as uncaptured pieces, "
            f"{stats['flat_graph_fallbacks']} eager fallbacks; {graphs.captures} graphs captured{failed}")


# ---------------------------------------------------------------------------------------- the reads

def make_reads(vocab: int, image_token: int, frame: bytes) -> tuple[list[ReadSpec], list[str]]:
    """The seven reads, and their names: text prompts of 300 tokens (one with 4 noise draws) and of
    PROMPT_TOKENS tokens, a frame's read, a two-step read of two canvases."""
    from app.engine.base import ImageInput, Prompt

    image = Specs(vocab, 60, seed=5).read()
    image = dataclasses.replace(image, prompt=Prompt((*image.prompt.ids, image_token),
                                                     (ImageInput(frame, "image/jpeg", "frame"),)))
    two_steps = dataclasses.replace(Specs(vocab, 200, seed=9).read(canvases=2), steps=2, seed=3)
    reads = [Specs(vocab, 300).read(), Specs(vocab, 300, seed=1).read(canvases=4),
             *(Specs(vocab, n, seed=n).read() for n in PROMPT_TOKENS), image, two_steps]
    names = ["300", "300 x4 draws", *map(str, PROMPT_TOKENS), "image", "200, 2 steps"]
    return reads, names


# ---------------------------------------------------------------------------------------- the checks

def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("sizes", nargs="*", metavar="LAYERS:DTYPE",
                        help=f"model sizes and dtypes (default {' '.join(DEFAULT_SIZES)}; with --tiny float32)")
    parser.add_argument("--fused-moe", action="store_true", help="the experts as djev's Triton kernels (CUDA)")
    parser.add_argument("--tiny", action="store_true", help="the tiny config (LAYERS ignored): a CPU smoke test")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda)")
    parser.add_argument("--weights", choices=("bf16", "fp8"), default="bf16",
                        help="fp8: FP8 reads against bf16 on the same random weights (default size 30:bfloat16)")
    parser.add_argument("--reads", type=int, default=300, help=f"--weights fp8: text reads (3 slots each; at least "
                        f"{MIN_CONFIDENT} slots with a bf16 margin over {MARGIN} are wanted)")
    args = parser.parse_intermixed_args(argv)  # sizes and flags in any order
    import torch

    args.device = torch.device(args.device or "cuda")
    if not args.tiny and args.device.type != "cuda":
        parser.error("the full-size model needs a GPU; use --tiny to check the script on a CPU")
    if args.fused_moe and args.device.type != "cuda":
        parser.error("--fused-moe: the Triton kernels need CUDA")
    if args.reads < 1:
        parser.error("--reads must be at least 1")
    if args.weights == "fp8" and args.fused_moe:
        parser.error("--weights fp8 reads with grouped_mm and djev's kernels both; --fused-moe adds nothing")
    defaults = ("30:bfloat16",) if args.weights == "fp8" else DEFAULT_SIZES
    sizes = []
    for text in args.sizes or (("0:float32",) if args.tiny else defaults):
        layers, _, dtype = text.partition(":")
        if not layers.isdigit() or not isinstance(getattr(torch, dtype, None), torch.dtype):
            parser.error(f"{text!r}: LAYERS:DTYPE, e.g. 6:float32")
        sizes.append((int(layers), getattr(torch, dtype)))
    args.sizes = sizes
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    frame = frames(1)[0]  # one frame for every size and runner
    for layers, dtype in args.sizes:
        if args.weights == "fp8":
            check_fp8(args, layers, dtype)
        else:
            check_size(args, layers, dtype, frame)
        release(args.device)  # the model and everything of this size gone before the next is built


def check_fp8(args: argparse.Namespace, layers: int, dtype: Any) -> None:
    """--weights fp8: the reads in `dtype` with grouped_mm and with djev's kernels (CUDA), then with
    the text layers quantized to FP8 in place (see the module), each with its own routes and again
    with the first run's routes pinned; one eager runner at a time."""
    from app.engine.hf.moe.fp8 import use_fp8_experts
    from app.engine.hf.quantize import quantize_model

    device = args.device
    config = model_config(True) if args.tiny else full_config(num_hidden_layers=layers)
    model = build_model(config, str(device), dtype, served_experts(str(device)))
    processor = image_processor(args.tiny)
    reads = fp8_reads(int(model.config.text_config.vocab_size), args.reads)
    name = f"{'tiny' if args.tiny else layers} layers, {str(dtype).replace('torch.', '')}"

    def read_all(made: DiffusionRunner) -> list[ReadResult]:
        """The reads FP8_BATCH at a time: the runner's KV store holds that many prompts at once."""
        return [result for start in range(0, len(reads), FP8_BATCH)
                for result in results(made.read(reads[start:start + FP8_BATCH]))]

    def runner() -> DiffusionRunner:
        return make_runner(model, processor, device, pieces=False)

    routes = Routes(model)

    def recorded(made: DiffusionRunner) -> list[ReadResult]:
        with routes.record():
            return read_all(made)

    def pinned(made: DiffusionRunner) -> list[ReadResult]:
        with routes.impose():
            return read_all(made)

    wide = one(runner, recorded, device)  # transformers' experts (grouped_mm on CUDA); their routes kept
    kernels = kernels_pinned = None
    if device.type == "cuda":
        from app.engine.hf.moe.fused import use_fused_experts

        reason = use_fused_experts(model)
        if reason is not None:
            raise SystemExit(f"--weights fp8: djev's kernels cannot run: {reason}")
        kernels = one(runner, read_all, device)
        kernels_pinned = one(runner, pinned, device)
    counts = quantize_model(model)
    release(device)
    use_fp8_experts(model)
    quantized = one(runner, read_all, device)
    quantized_pinned = one(runner, pinned, device)
    wide_name = str(dtype).replace("torch.", "")
    served_name = f"{wide_name} ({'djev kernels' if kernels else 'default experts'})"
    print(f"{name}: {len(reads)} reads; FP8: {counts.projections} projections and {counts.experts} layers' experts")
    lines = [(f"FP8 vs {served_name}", agreement(kernels or wide, quantized))]
    if kernels is not None:
        lines.append((f"{wide_name} djev kernels vs grouped_mm", agreement(wide, kernels)))
    # Routes pinned: every run takes the first run's experts, so only the arithmetic differs.
    lines.append((f"FP8 vs {served_name}, routes pinned", agreement(kernels_pinned or wide, quantized_pinned)))
    if kernels_pinned is not None:
        lines.append((f"{wide_name} djev kernels vs grouped_mm, routes pinned", agreement(wide, kernels_pinned)))
    width = max(len(label) for label, _ in lines)
    for label, found in lines:
        print(f"  {label:<{width}}  {found.line()}")
    fewest = min(found.confident for _, found in lines)
    if fewest < MIN_CONFIDENT:
        print(f"  WARNING: {fewest} confident slots, fewer than {MIN_CONFIDENT}: give more --reads", flush=True)


def check_size(args: argparse.Namespace, layers: int, dtype: Any, frame: bytes) -> None:
    """Every check on one model size and dtype, one runner at a time."""
    device = args.device
    config = model_config(True) if args.tiny else full_config(num_hidden_layers=layers)
    model = build_model(config, str(device), dtype, served_experts(str(device)))
    processor = image_processor(args.tiny)
    vocab = int(model.config.text_config.vocab_size)
    reads, names = make_reads(vocab, int(model.config.image_token_id), frame)
    name = f"{'tiny' if args.tiny else layers} layers, {str(dtype).replace('torch.', '')}"

    def runner(pieces: bool = False) -> Callable[[], DiffusionRunner]:
        return lambda: make_runner(model, processor, device, pieces)

    def alone(made: DiffusionRunner) -> tuple[list[ReadResult], int, str]:
        """Each read alone, one after another; the turns they took, and what the pieces ran."""
        got = [results(made.read([spec]))[0] for spec in reads]
        return got, made.stats["flat_turns"], pieces_note(made)

    def shared(made: DiffusionRunner) -> tuple[list[ReadResult], int, str]:
        """Every read in one `read`: one shared turn (the two-step read's second step in the next)."""
        return results(made.read(reads)), made.stats["flat_turns"], pieces_note(made)

    def alone_and_transformers(made: DiffusionRunner) -> tuple[tuple[list[ReadResult], int, str], list[ReadResult]]:
        return alone(made), [reference_read(model, spec, made) for spec in reads]

    (eager_alone, alone_turns, _), transformers = one(runner(), alone_and_transformers, device)
    grouped_alone = eager_alone
    if args.fused_moe:
        from app.engine.hf.moe.fused import use_fused_experts

        reason = use_fused_experts(model)
        if reason is not None:
            raise SystemExit(f"--fused-moe: {reason}")
        eager_alone, alone_turns, _ = one(runner(), alone, device)
    eager_shared, shared_turns, _ = one(runner(), shared, device)
    pieces_alone, _, alone_note = one(runner(pieces=True), alone, device)
    pieces_shared, _, shared_note = one(runner(pieces=True), shared, device)
    experts = "djev's Triton kernels" if args.fused_moe else "grouped_mm" if device.type == "cuda" else "the default"
    print(f"{name} (experts: {experts}); reads: {', '.join(names)}")
    print(f"  (1) shared turn vs alone, eager      {compared(eager_alone, eager_shared)}  "
          f"({shared_turns} turns shared, {alone_turns} alone)")
    print(f"  (2) pieces vs eager, alone           {compared(eager_alone, pieces_alone)}  ({alone_note})")
    print(f"  (2) pieces vs eager, shared turn     {compared(eager_shared, pieces_shared)}  ({shared_note})")
    if args.fused_moe:
        print(f"  (3) fused kernels vs grouped_mm, alone {compared(grouped_alone, eager_alone)}")
    print(f"  (4) transformers vs alone, eager     {compared(transformers, grouped_alone)}"
          + ("  (grouped_mm)" if args.fused_moe else ""), flush=True)
    if args.fused_moe:
        print(f"  (4) transformers vs alone, fused     {compared(transformers, eager_alone)}", flush=True)
    check_vision(model, device, args.tiny)


def check_vision(model: Any, device: Any, tiny: bool = False) -> None:
    """The vision graph path (app/engine/hf/graphs/vision.py) against the library's forward, eager
    (static) and replayed, on three new 512x384 frames at once (a 4-image bucket with padding); the
    static path's buffers dropped before the captured one is built. No capture on the CPU."""
    import io

    import torch
    from PIL import Image

    from app.engine.hf.graphs.vision import VisionGraphs

    pictures = [Image.open(io.BytesIO(data)).convert("RGB") for data in frames(3)]
    processed = image_processor(tiny)(pictures, return_tensors="pt")
    pixels = processed["pixel_values"].to(device, model.dtype)
    positions = processed["image_position_ids"].to(device)
    with torch.no_grad():
        library = model.model.encoder.get_image_features(pixels, positions, return_dict=True).pooler_output
        library = library.reshape(-1, library.shape[-1])
        static = VisionGraphs(model, device, capture=False).features(pixels, positions)
        assert static is not None, "the static path holds a bucket for 3 images"
        release(device)
        scale = float(library.abs().max())
        said = (f"  vision static vs library: largest difference {float((static - library).abs().max()):.3g} "
                f"(largest value {scale:.3g})")
        if device.type != "cuda":
            print(f"{said}; no graph replay on {device.type}", flush=True)
            return
        graphed = VisionGraphs(model, device, capture=True)
        replayed = graphed.features(pixels, positions)
    if replayed is None:
        print(f"{said}; vision graph: capture failed, eager as designed: {dict(graphed.cache.failed)}", flush=True)
        return
    print(f"{said}; graph replay vs static: {float((replayed - static).abs().max()):.3g} "
          f"(captured {graphed.captures})", flush=True)


if __name__ == "__main__":
    main()
