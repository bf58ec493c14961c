"""Loading the hf engine: a local DiffusionGemma checkpoint (config, weights, tokenizer, image
processor) onto the device, with the fused experts and compiled layers the options ask for, warmed
up, the heap settled, and wrapped in an HFReader."""

from __future__ import annotations

import gc
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from app.engine.base import ReaderInfo, StartupProgress
from app.engine.hf.graphs.shapes import ShapePolicy
from app.engine.hf.memory import MemorySplit, plan_graphs, unique_bytes
from app.engine.hf.reader import HFOptions, HFReader, settle_heap

if TYPE_CHECKING:
    from transformers import DiffusionGemmaForBlockDiffusion

    from app.engine.hf.runner import DiffusionRunner

log = logging.getLogger("djev.engine")


def pick_device(requested: str) -> str:
    import torch

    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return requested


def load_hf_reader(checkpoint: str | Path, options: HFOptions, progress: StartupProgress | None = None) -> HFReader:
    """Load a local DiffusionGemma checkpoint directory (config, weights, tokenizer, processor) and
    make the reader (`hf_reader`). `progress` hears each start-up phase as it begins."""
    import torch
    from transformers import AutoImageProcessor, AutoTokenizer, DiffusionGemmaForBlockDiffusion

    report = progress or _silent
    path = Path(checkpoint)
    if options.torch_threads > 0:
        torch.set_num_threads(options.torch_threads)
    device_name = pick_device(options.device)
    on_cuda = torch.device(device_name).type == "cuda"
    kwargs: dict[str, Any] = {"dtype": torch.bfloat16 if on_cuda else torch.float32, "attn_implementation": "sdpa"}
    if on_cuda:
        # The eager loop over experts is 13x slower on an H200 (docs/design.md §4.2).
        kwargs["experts_implementation"] = "grouped_mm"
    report("loading weights", 0, 1)
    log.info("loading %s on %s (%s)", path, device_name, kwargs["dtype"])
    model = DiffusionGemmaForBlockDiffusion.from_pretrained(str(path), **kwargs)
    # PreTrainedModel.to is functools.wraps(nn.Module.to); typeshed's wraps result binds no self.
    model = model.to(device_name).eval()  # pyright: ignore[reportArgumentType]
    hf_tokenizer = AutoTokenizer.from_pretrained(str(path))
    try:
        image_processor = AutoImageProcessor.from_pretrained(str(path), backend="pil")
    except Exception as exc:  # noqa: BLE001 - a checkpoint without an image processor still reads text
        log.warning("no image processor in %s (%s): image states will be refused", path, exc)
        image_processor = None
    return hf_reader(model, hf_tokenizer, image_processor, options, checkpoint=str(path), progress=progress)


def hf_reader(model: DiffusionGemmaForBlockDiffusion, hf_tokenizer: Any, image_processor: Any, options: HFOptions, *,
              checkpoint: str = "", progress: StartupProgress | None = None) -> HFReader:
    """The reader over a model already on its device (loaded from a checkpoint, or random weights in
    a bench): the fused experts and compiled layers the options ask for, the warm-up, the settled
    heap. `serve` reaches this through `load_hf_reader`; a bench that builds random weights calls it
    directly, so what it serves is built exactly as `djev serve` builds it."""
    import torch

    from app.engine.hf.parts import text_config
    from app.engine.hf.runner import DiffusionRunner
    from app.engine.tokenizer import HFChatTokenizer

    report = progress or _silent
    device = next(model.parameters()).device
    on_cuda = device.type == "cuda"
    if options.fused_moe and on_cuda:
        from app.engine.hf.moe.fused import use_fused_experts

        reason = use_fused_experts(model)
        if reason is None:
            log.info("experts: djev's Triton kernels (FUSED_MOE)")
        else:
            log.warning("experts: grouped_mm, the Triton kernels cannot run this model: %s", reason)
    compiled = options.torch_compile and on_cuda
    if compiled:
        from app.engine.hf.compiled import compile_layers

        # The flat turn runs the text layers' pieces under its own graphs, eagerly: the vision layers alone.
        compile_layers(model, text=not options.flat_turn)
    else:  # the encoder's attention through `attend` eagerly: a long prompt's chunks need its chunk path
        from app.engine.hf.layers import install
        from app.engine.hf.parts import encoder_layers

        install(encoder_layers(model))
    image_token_id = model.config.image_token_id
    assert image_token_id is not None, "the checkpoint's config names no image token"
    tokenizer = HFChatTokenizer(
        hf_tokenizer, vocab_size=int(text_config(model).vocab_size), image_token_id=int(image_token_id)
    )
    weights = unique_bytes(model)
    plan = None
    if options.flat_turn:  # the KV store decides the longest state (`FlatEngine.plan`)
        max_prompt_tokens = options.max_prompt_tokens or (CUDA_PROMPT_TOKENS if on_cuda else CPU_PROMPT_TOKENS)
        kv_bytes = options.prompt_cache_bytes or (store_bytes(torch.cuda.mem_get_info(device)[0]) if on_cuda else 0)
    else:
        max_prompt_tokens = sized_prompt_limit(model, device, options.max_prompt_tokens)
        kv_bytes = options.prompt_cache_bytes
        if on_cuda:
            plan = plan_graphs(torch.cuda.mem_get_info(device)[0], token_kv_bytes(model),
                               decoder_slots=ShapePolicy.decoder_slots, encoder_slots=ShapePolicy.encoder_slots,
                               cache_bytes=options.prompt_cache_bytes, reserve=GRAPH_RESERVE_BYTES)
            kv_bytes = plan.prompt_cache_bytes
    runner = DiffusionRunner(
        model,
        image_processor,
        device=device,
        max_prompt_tokens=max_prompt_tokens,
        kv_entries=options.kv_cache_entries,
        max_rows=options.max_batch_rows,
        generation=_generation_settings(model),
        cuda_graphs=options.cuda_graphs,
        canvas=options.canvas_length,
        canvas_step=options.canvas_step,
        max_images=options.max_images,
        prefill_chunk=options.prefill_chunk,
        kv_bytes=kv_bytes,
        turn_tokens=flat_turn_tokens(options.turn_tokens, on_cuda) if options.flat_turn else 0,
        graph_slots=(plan.decoder_slots, plan.encoder_slots) if plan is not None else None,
    )
    if runner.flat is not None:
        from app.engine.hf.flat.engine import budget_problem

        problem = budget_problem(runner.flat.budget, options.canvas_length, largest_image(image_processor))
        if problem is not None:
            raise ValueError(problem)
    if compiled and runner.flat is not None:  # the flat forward's layer bodies, compiled by their first runs
        import functools

        runner.flat.forward.compile(functools.partial(torch.compile, dynamic=None))
    if options.fused_moe and on_cuda:
        from app.engine.hf.moe.fused import warm_up_experts

        report("compiling the expert kernels", 0, 1)
        log.info("every expert kernel tile compiled in %.1f s", warm_up_experts(model))
    if compiled or (runner.flat is not None and on_cuda):  # the flat turn's Triton kernels compile here too
        from app.engine.hf.compiled import warm_up

        report("compiling", 0, 1)
        log.info("compiling the model's layers and kernels before the first request ...")
        log.info("compiled and warmed up in %.1f s", warm_up(runner, options.canvas_length))
    graphs = runner.graphs is not None or runner.vision_graphs is not None
    graph_bytes = prepare_graphs(runner, report) if graphs else 0
    faults: list[str] = []
    if runner.flat is not None:
        report("capturing the flat turn's graphs", 0, 1)
        flat_graphs = runner.flat.prepare_graphs()  # logs its line: buckets x pieces, memory, seconds
        if flat_graphs is not None:
            graph_bytes += flat_graphs.memory_bytes + flat_graphs.buffer_bytes
            graphs_of = runner.flat.forward.graphs
            faults += capture_faults(graphs_of.cache.failed if graphs_of is not None else {})
    if runner.vision_graphs is not None and runner.vision_graphs.cache.failed:
        faults.append(f"{len(runner.vision_graphs.cache.failed)} vision graph capture(s) failed "
                      f"({next(iter(runner.vision_graphs.cache.failed.values()))}): images run eagerly (slower)")
    # torch.compile's stance stays "default": under "eager_on_recompile" the passes that run outside
    # the graphs (the counted fallbacks, the large encoder passes, the chunks of long prompts) ran
    # their pieces eagerly, 4x slower on the H200, while no recompile happened under "default" in
    # the same workloads (docs/benchmarks.md). A compile after ready is counted instead (HFReader).
    if on_cuda:
        split = memory_split(runner, weights, graph_bytes, options.max_prompt_tokens, plan.cuts if plan else ())
        log.info("%s", split.line())
        if runner.flat is None:  # the row path still reports what its card cut as degraded
            faults += [reason for reason in [split.forced()] if reason is not None]
    # `/health` says degraded for a fault alone (a capture that failed): a limit the card sets (the KV
    # store's size, the longest state) is the server's configuration, logged above and shown in /health.
    degraded = "; ".join(faults) or None
    if degraded is not None:
        log.warning("%s (/health says degraded)", degraded)
    settle_heap()  # at start-up, so the count's walk of the heap costs nothing under load
    log.info("%d objects set aside from the garbage collector's full passes", gc.get_freeze_count())
    device_label = torch.cuda.get_device_name(device) if on_cuda else "cpu"
    info = ReaderInfo(
        model=options.served_name or Path(checkpoint).name,
        engine="hf",
        device=device_label,
        tiny=options.tiny,
        canvas_length=options.canvas_length,
        checkpoint=checkpoint,
        max_prompt_tokens=runner.max_prompt_tokens,
    )
    return HFReader(runner, tokenizer, info, options, degraded=degraded)


def capture_faults(failed: Mapping[int, str]) -> list[str]:
    """`/health`'s words for the flat turn's captures that failed (`GraphCache.failed`: bucket -> why;
    none: an empty list): the buckets, the first error, and what runs eagerly instead."""
    if not failed:
        return []
    buckets = ", ".join(map(str, sorted(failed)))
    return [f"the flat turn's CUDA graph capture failed at {len(failed)} token bucket(s) ({buckets}: "
            f"{next(iter(failed.values()))}): turns of those sizes, and of every bucket left uncaptured after it, "
            "run eagerly (slower)"]


def largest_image(image_processor: Any) -> int:
    """The most soft tokens one image takes (the processor's `max_soft_tokens`; 0 without images)."""
    return int(getattr(image_processor, "max_soft_tokens", 0) or 0) if image_processor is not None else 0


def memory_split(runner: DiffusionRunner, weights: int, graph_bytes: int, requested_prompt_tokens: int,
                 cuts: tuple[str, ...] = ()) -> MemorySplit:
    """How the CUDA device's memory went at start (`MemorySplit`), after the graphs."""
    import torch

    free, total = torch.cuda.mem_get_info(runner.device)
    wanted = requested_prompt_tokens or CUDA_PROMPT_TOKENS
    return MemorySplit(total=total, free=free, weights=weights, graphs=graph_bytes,
                       prompt_tokens=runner.max_prompt_tokens, prompt_wanted=wanted,
                       prompt_forced=not requested_prompt_tokens and runner.max_prompt_tokens < CUDA_PROMPT_TOKENS,
                       held=runner.graphs_held(), left_out=runner.graphs_left_out, cuts=cuts)


# MAX_PROMPT_TOKENS=0: this many on CUDA where the free memory allows, else the CPU's.
CUDA_PROMPT_TOKENS = 131072
CPU_PROMPT_TOKENS = 32768
# A long prompt's encoding holds its KV twice at the end (the cache and the reader's copy), plus
# a chunk's activations: it needs this much more than its KV.
LONG_PROMPT_MARGIN = 2.5


def prompt_kv_bytes(model: DiffusionGemmaForBlockDiffusion, tokens: int) -> int:
    """The bytes one prompt of `tokens` tokens holds as KV: every full-attention layer all of it,
    every sliding-window layer its window."""
    from app.engine.hf.parts import encoder_layers, layer_types, text_config

    window = int(getattr(text_config(model), "sliding_window", None) or tokens)
    element = next(model.parameters()).element_size()
    total = 0
    for layer, kind in zip(encoder_layers(model), layer_types(model)):
        attention = layer.self_attn
        per_token = 2 * attention.k_proj.out_features * element  # keys and values: heads x head dim
        total += per_token * (min(tokens, window - 1) if kind == "sliding_attention" else tokens)
    return total


# TURN_TOKENS=0: a flat turn's budget by the device. On the CPU a turn of the tiny model costs about
# 0.3 ms a token, so 2048 keeps a steady client's wait near half a second. A steady client waits up
# to two turns: beside the served burst on an H100, turns of up to 8192 tokens gave it a p99 of
# 911 ms (docs/benchmarks.md), and past ~4000 tokens a turn's time grows with its tokens, so 4096
# halves that wait for little throughput (the ticket's turns at 32 clients hold ~3,900 tokens).
CUDA_TURN_TOKENS = 4096
CPU_TURN_TOKENS = 2048


def flat_turn_tokens(requested: int, on_cuda: bool) -> int:
    """The flat turn's token budget: TURN_TOKENS where set, else by the device."""
    return requested or (CUDA_TURN_TOKENS if on_cuda else CPU_TURN_TOKENS)


def token_kv_bytes(model: DiffusionGemmaForBlockDiffusion) -> int:
    """The bytes one token's keys and values take in every layer (what a graph's static KV buffer holds
    a token)."""
    from app.engine.hf.parts import encoder_layers

    element = next(model.parameters()).element_size()
    return sum(2 * layer.self_attn.k_proj.out_features * element for layer in encoder_layers(model))


def sized_prompt_limit(model: DiffusionGemmaForBlockDiffusion, device: Any, requested: int,
                 free_bytes: int | None = None) -> int:
    """The longest prompt this engine reads. `requested` (MAX_PROMPT_TOKENS) where set, with a
    warning on CUDA when the free memory cannot hold its encoding; 0: CUDA_PROMPT_TOKENS on CUDA,
    halved (with a warning) until its encoding fits the free memory, never below CPU_PROMPT_TOKENS,
    and CPU_PROMPT_TOKENS on the CPU. `free_bytes` stands in for the device's (tests)."""
    import torch

    on_cuda = getattr(device, "type", str(device)) == "cuda"
    if not on_cuda and free_bytes is None:
        return requested or CPU_PROMPT_TOKENS
    free = free_bytes if free_bytes is not None else torch.cuda.mem_get_info(device)[0]

    def fits(tokens: int) -> bool:
        return LONG_PROMPT_MARGIN * prompt_kv_bytes(model, tokens) + GRAPH_RESERVE_BYTES <= free

    if requested:
        if not fits(requested):
            log.warning("MAX_PROMPT_TOKENS %d: a prompt that long needs about %.1f GiB and %.1f GiB are free; "
                        "such a read may fail with a 503", requested,
                        LONG_PROMPT_MARGIN * prompt_kv_bytes(model, requested) / 2**30, free / 2**30)
        return requested
    limit = CUDA_PROMPT_TOKENS
    while limit > CPU_PROMPT_TOKENS and not fits(limit):
        limit //= 2
    if limit < CUDA_PROMPT_TOKENS:
        log.warning("prompts up to %d tokens, not %d: the free GPU memory (%.1f GiB) cannot hold a longer one's "
                    "encoding (set MAX_PROMPT_TOKENS to choose)", limit, CUDA_PROMPT_TOKENS, free / 2**30)
    return limit


# The flat turn's KV store on CUDA with PROMPT_CACHE_GB=0: the memory free after the weights less this,
# which the turn's work takes beside it: the graphs by token count and their buffers (about 1 GiB at a
# budget of 4096 on an H100), the vision tower's graphs, a multi-step read's self-conditioning logits
# (a canvas of 128 tokens holds 64 MiB of them, every step), the slot reads' unembedding (0.5 GiB), the
# compiled kernels' workspaces, and the allocator's fragmentation.
FLAT_RESERVE_BYTES = 8 * 2**30
MIN_STORE_BYTES = 2**30


def store_bytes(free_bytes: int) -> int:
    """The KV store's bytes on a card with `free_bytes` free after the weights (PROMPT_CACHE_GB=0)."""
    return max(MIN_STORE_BYTES, free_bytes - FLAT_RESERVE_BYTES)


# GPU memory the graph capture leaves free for requests (eager passes, the prompt LRUs, a long
# state's encoding): a shape that would take it is left out and runs eagerly, counted.
GRAPH_RESERVE_BYTES = 12 * 2**30


def prepare_graphs(runner: DiffusionRunner, progress: StartupProgress) -> int:
    """Capture the shape policy's whole set (app/engine/hf/graphs/shapes.py) before `ready`, then
    freeze it: nothing is captured while serving. Returns the device memory the graphs keep (their
    pools and static buffers: what the allocator holds more than before, its cache emptied)."""
    import time

    import torch

    from app.engine.hf.compiled import sample_image_prompt
    from app.engine.hf.graphs.cache import CAPTURE_PHASES

    started = time.perf_counter()
    torch.cuda.empty_cache()
    reserved = torch.cuda.memory_reserved(runner.device)
    sample = sample_image_prompt(runner) if runner.image_processor is not None else None
    held = runner.prepare_graphs(progress, reserve_bytes=GRAPH_RESERVE_BYTES, sample_image=sample)
    runner.clear_caches()
    if runner.device.type == "cuda":
        torch.cuda.empty_cache()  # the warm runs' memory, once (capture frees nothing between graphs)
    phases = ", ".join(f"{name.removeprefix('graph_').removesuffix('_ms')} {runner.stats[name] / 1000:.1f} s"
                       for name in CAPTURE_PHASES)
    kinds = ", ".join(f"{kind} {runner.stats[f'{kind}_graph_build_ms'] / 1000:.1f} s" for kind in held)
    log.info("CUDA graphs captured in %.1f s (%s; by kind: %s): %s (%.2f GiB)", time.perf_counter() - started, phases,
             kinds, held, runner.graph_memory_bytes() / 2**30)
    return max(runner.graph_memory_bytes(), torch.cuda.memory_reserved(runner.device) - reserved)


def _silent(phase: str, done: int, total: int) -> None:
    return None


def _generation_settings(model: DiffusionGemmaForBlockDiffusion) -> dict[str, float]:
    config = getattr(model, "generation_config", None)
    settings: dict[str, float] = {}
    for name in ("max_denoising_steps", "t_min", "t_max", "stability_threshold", "confidence_threshold"):
        value = getattr(config, name, None)
        if value is not None:
            settings[name] = value
    sampler = getattr(config, "sampler_config", None)
    bound = getattr(sampler, "entropy_bound", None) if sampler is not None else None
    if bound is not None:
        settings["entropy_bound"] = bound
    return settings
