"""Loading the hf engine: a local DiffusionGemma checkpoint (config, weights, tokenizer, image
processor) onto the device, its weights in the format the checkpoint has (bf16, or compressed-tensors
FP8) or FP8 where QUANTIZE asks, with the fused experts and compiled layers the options ask for,
warmed up, the heap settled, and wrapped in an HFReader."""

from __future__ import annotations

import gc
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from app.engine.base import ReaderInfo, StartupProgress
from app.engine.hf.memory import MemorySplit, unique_bytes
from app.engine.hf.reader import HFOptions, HFReader, settle_heap

if TYPE_CHECKING:
    import torch
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
    from transformers import AutoImageProcessor, AutoTokenizer

    report = progress or _silent
    path = Path(checkpoint)
    if options.torch_threads > 0:
        torch.set_num_threads(options.torch_threads)
    model = load_model(path, torch.device(pick_device(options.device)), options.quantize, report)
    hf_tokenizer = AutoTokenizer.from_pretrained(str(path))
    try:
        image_processor = AutoImageProcessor.from_pretrained(str(path), backend="pil")
    except Exception as exc:  # noqa: BLE001 - a checkpoint without an image processor still reads text
        log.warning("no image processor in %s (%s): image states will be refused", path, exc)
        image_processor = None
    return hf_reader(model, hf_tokenizer, image_processor, options, checkpoint=str(path), progress=progress)


def load_model(path: Path, device: torch.device, quantize: str, progress: StartupProgress) -> DiffusionGemmaForBlockDiffusion:
    """The checkpoint's model on `device`, its weights as the checkpoint's format says (as vLLM
    decides): a compressed-tensors FP8 checkpoint loads FP8 straight onto the device
    (app/engine/hf/checkpoint_fp8.py); an unquantized one loads in bf16 on CUDA (float32 on the CPU),
    its text layers quantized to FP8 a layer at a time onto the device where QUANTIZE is fp8
    (app/engine/hf/quantize.py). A checkpoint quantized any other way is refused, naming its method."""
    import torch
    from transformers import DiffusionGemmaForBlockDiffusion

    from app.engine.hf.checkpoint_fp8 import (
        CheckpointFormatError,
        is_fp8_checkpoint,
        load_fp8_checkpoint,
        quantization_config,
    )

    on_cuda = device.type == "cuda"
    dtype = torch.bfloat16 if on_cuda else torch.float32
    quantization = quantization_config(path)
    if quantization is not None and not is_fp8_checkpoint(quantization):
        raise CheckpointFormatError(f"{path}: quantization_config.quant_method is {quantization.get('quant_method')!r}: "
                                    "djev loads compressed-tensors FP8 checkpoints and unquantized ones")
    progress("loading weights", 0, 1)
    if quantization is not None:
        log.info("loading %s on %s (FP8 as stored, the rest %s)", path, device, dtype)
        model = load_fp8_checkpoint(path, device, dtype, progress)
        log.info("weights: fp8 (checkpoint)%s", "; QUANTIZE=fp8 has nothing to do" if quantize == "fp8" else "")
        return model
    kwargs: dict[str, Any] = {"dtype": dtype, "attn_implementation": "sdpa"}
    if on_cuda:
        # The eager loop over experts is 13x slower on an H200 (docs/design.md §4.2).
        kwargs["experts_implementation"] = "grouped_mm"
    log.info("loading %s on %s (%s)", path, device, dtype)
    model = DiffusionGemmaForBlockDiffusion.from_pretrained(str(path), **kwargs)
    if quantize == "fp8":  # onto the device a layer at a time: the wide weights never all there at once
        from app.engine.hf.quantize import quantize_model

        counts = quantize_model(model, progress, device=device)
        log.info("weights: fp8 (quantized at load: %d projections, %d layers' experts)", counts.projections,
                 counts.experts)
    else:
        log.info("weights: %s", "bf16" if on_cuda else "fp32")
    # PreTrainedModel.to is functools.wraps(nn.Module.to); typeshed's wraps result binds no self.
    return model.to(device).eval()  # pyright: ignore[reportArgumentType]


def hf_reader(model: DiffusionGemmaForBlockDiffusion, hf_tokenizer: Any, image_processor: Any, options: HFOptions, *,
              checkpoint: str = "", progress: StartupProgress | None = None) -> HFReader:
    """The reader over a model already on its device (loaded from a checkpoint, or random weights in
    a bench): the fused experts and compiled layers the options ask for (djev's FP8 experts where its
    experts are FP8, whatever FUSED_MOE says), the KV store sized, the
    warm-up, the graphs captured, the settled heap. `serve` reaches this through `load_hf_reader`; a
    bench that builds random weights calls it directly, so what it serves is built exactly as
    `djev serve` builds it."""
    import torch

    from app.engine.hf.compiled import reads_images
    from app.engine.hf.engine import budget_problem
    from app.engine.hf.parts import text_config
    from app.engine.hf.quantize import is_fp8_model
    from app.engine.hf.runner import DiffusionRunner
    from app.engine.tokenizer import HFChatTokenizer

    report = progress or _silent
    device = next(model.parameters()).device
    on_cuda = device.type == "cuda"
    fp8_weights = is_fp8_model(model)
    if fp8_weights:  # whatever FUSED_MOE says: only these read the FP8 banks
        from app.engine.hf.moe.fp8 import use_fp8_experts

        use_fp8_experts(model)  # a RuntimeError where they cannot run here (no Triton, no FP8 tensor cores)
        log.info("experts: djev's FP8 experts (%s)", "Triton kernels" if on_cuda else "the torch reference, slow")
    elif options.fused_moe and on_cuda:
        from app.engine.hf.moe.fused import use_fused_experts

        reason = use_fused_experts(model)
        if reason is None:
            log.info("experts: djev's Triton kernels (FUSED_MOE)")
        else:
            log.warning("experts: grouped_mm, the Triton kernels cannot run this model: %s", reason)
    compiled = options.torch_compile and on_cuda
    if compiled:
        from app.engine.hf.compiled import compile_vision

        compile_vision(model)
    image_token_id = model.config.image_token_id
    assert image_token_id is not None, "the checkpoint's config names no image token"
    tokenizer = HFChatTokenizer(
        hf_tokenizer, vocab_size=int(text_config(model).vocab_size), image_token_id=int(image_token_id)
    )
    weights = unique_bytes(model)
    budget = turn_tokens(options.turn_tokens, on_cuda)
    problem = budget_problem(budget, options.canvas_length, largest_image(image_processor))
    if problem is not None:
        raise ValueError(problem)
    runner = DiffusionRunner(
        model,
        image_processor,
        device=device,
        max_prompt_tokens=options.max_prompt_tokens or (CUDA_PROMPT_TOKENS if on_cuda else CPU_PROMPT_TOKENS),
        max_rows=options.max_batch_rows,
        turn_tokens=budget,
        generation=_generation_settings(model),
        cuda_graphs=options.cuda_graphs,
        image_entries=options.kv_cache_entries,
        prefill_chunk=options.prefill_chunk,
        kv_bytes=options.prompt_cache_bytes or (store_bytes(torch.cuda.mem_get_info(device)[0]) if on_cuda else 0),
    )
    if compiled:  # the flat forward's layer bodies, compiled by their first runs (the warm-up, the captures)
        import functools

        runner.flat.forward.compile(functools.partial(torch.compile, dynamic=None))
    if on_cuda and (options.fused_moe or fp8_weights):  # FP8 banks: the FP8 kernels' tiles
        from app.engine.hf.moe.fused import warm_up_experts

        report("compiling the expert kernels", 0, 1)
        log.info("every expert kernel tile compiled in %.1f s", warm_up_experts(model))
    if on_cuda:  # the compiled bodies and the turn's Triton kernels compile here, before ready
        from app.engine.hf.compiled import warm_up

        report("compiling", 0, 1)
        log.info("compiling the model's layers and kernels before the first request ...")
        log.info("compiled and warmed up in %.1f s", warm_up(runner, options.canvas_length))
    graph_bytes, faults = capture_graphs(runner, report) if runner.cuda_graphs else (0, [])
    frame_rate, max_sessions = 0.0, 0
    if on_cuda and reads_images(runner):  # what camera admission starts from (app/web/pacing.py)
        from app.engine.hf.compiled import FRAME_PROBE, FRAME_PROMPT_TOKENS, measure_frames
        from app.engine.hf.sizing import CAMERA_STORE_SHARE, camera_sessions

        report("measuring the camera frame rate", 0, 1)
        frame_rate = measure_frames(runner, options.canvas_length)
        frame_tokens = FRAME_PROMPT_TOKENS + largest_image(image_processor)
        max_sessions = camera_sessions(runner.flat.plan.short_tokens, frame_tokens)
        log.info("camera frames: %.1f a second, %d read at once; the KV store holds %d sessions' frames of %d tokens "
                 "in %.0f %% of it", frame_rate, FRAME_PROBE, max_sessions, frame_tokens, 100 * CAMERA_STORE_SHARE)
    # torch.compile's stance stays "default": under "eager_on_recompile" the passes that run outside
    # the graphs (the counted fallbacks) ran their pieces eagerly, 4x slower on the H200, while no
    # recompile happened under "default" in the same workloads (docs/benchmarks.md). A compile after
    # ready is counted instead (HFReader).
    if on_cuda:
        free, total = torch.cuda.mem_get_info(device)
        split = MemorySplit(total=total, free=free, weights=weights, graphs=graph_bytes,
                            store=runner.flat.store.stats["bytes"], prompt_tokens=runner.max_prompt_tokens)
        log.info("%s", split.line())
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
        frame_rate=frame_rate,
        max_sessions=max_sessions,
    )
    return HFReader(runner, tokenizer, info, options, degraded=degraded)


def capture_graphs(runner: DiffusionRunner, progress: StartupProgress) -> tuple[int, list[str]]:
    """Capture the vision tower's graphs (for a camera frame's patch layout) and the flat turn's
    pieces for every token-count bucket before `ready`, then freeze them: nothing is captured while
    serving. Returns the device memory they keep (their pools and static buffers) and the faults of
    captures that failed (for `/health`)."""
    import torch

    from app.engine.hf.compiled import sample_image_prompt

    faults: list[str] = []
    torch.cuda.empty_cache()
    reserved = torch.cuda.memory_reserved(runner.device)
    if runner.images.graphs is not None:
        progress("capturing the vision tower's graphs", 0, 1)
        held = runner.prepare_vision_graphs(sample_image_prompt(runner))
        failed = runner.images.graphs.cache.failed
        log.info("vision graphs: %d held", held)
        if failed:
            faults.append(f"{len(failed)} vision graph capture(s) failed ({next(iter(failed.values()))}): images run "
                          "eagerly (slower)")
    torch.cuda.empty_cache()  # the warm runs' memory, once (capture frees nothing between graphs)
    vision = torch.cuda.memory_reserved(runner.device) - reserved
    progress("capturing the flat turn's graphs", 0, 1)
    report = runner.flat.prepare_graphs()  # logs its line: buckets x pieces, memory, seconds
    graphs = runner.flat.forward.graphs
    if report is None or graphs is None:
        return max(0, vision), faults
    faults += capture_faults(graphs.cache.failed)
    return max(0, vision) + report.memory_bytes + report.buffer_bytes, faults


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


# MAX_PROMPT_TOKENS=0: the longest state asked for, by the device (the KV store may hold fewer:
# `sizing.plan_store`).
CUDA_PROMPT_TOKENS = 131072
CPU_PROMPT_TOKENS = 32768
# TURN_TOKENS=0: a flat turn's budget by the device. On the CPU a turn of the tiny model costs about
# 0.3 ms a token, so 2048 keeps a steady client's wait near half a second. A steady client waits up
# to two turns: beside the served burst on an H100, turns of up to 8192 tokens gave it a p99 of
# 911 ms (docs/benchmarks.md), and past ~4000 tokens a turn's time grows with its tokens, so 4096
# halves that wait for little throughput (the ticket's turns at 32 clients hold ~3,900 tokens).
CUDA_TURN_TOKENS = 4096
CPU_TURN_TOKENS = 2048


def turn_tokens(requested: int, on_cuda: bool) -> int:
    """A turn's token budget: TURN_TOKENS where set, else by the device."""
    return requested or (CUDA_TURN_TOKENS if on_cuda else CPU_TURN_TOKENS)


# The KV store on CUDA with PROMPT_CACHE_GB=0: the memory free after the weights less this, which the
# turn's work takes beside it: the graphs by token count and their buffers (~0.5 GiB at a budget of 4096
# on an H100), the vision tower's graphs, a multi-step read's self-conditioning logits (64 MiB a canvas
# of 128 tokens, every step), the slot reads' unembedding (0.5 GiB), the compiled kernels' workspaces,
# the allocator's fragmentation. On an H100, 8 GiB left 6.8 GiB free at ready and the served walk ran
# out of memory in 212 turns; 16 GiB (a 16 GiB store) served every row with none
# (docs/results/h100_served_store{23,16}*).
FLAT_RESERVE_BYTES = 16 * 2**30
MIN_STORE_BYTES = 2**30


def store_bytes(free_bytes: int) -> int:
    """The KV store's bytes on a card with `free_bytes` free after the weights (PROMPT_CACHE_GB=0)."""
    return max(MIN_STORE_BYTES, free_bytes - FLAT_RESERVE_BYTES)


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
