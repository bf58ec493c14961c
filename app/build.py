"""Settings -> a reader: the checkpoint to load (a directory, a Hugging Face id, or the tiny random
model) and the engine's options, made here and only here from Settings (engines never import it)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from app.config import Settings
from app.decisions.calibration import Calibration, CalibrationError, FittedFor, read_calibration, tokenizer_fingerprint
from app.decisions.limits import Limits
from app.decisions.prompt import TEMPLATE_VERSION
from app.decisions.reading import ReadSettings
from app.engine.base import ChatTokenizer, ReaderInfo, StartupProgress

log = logging.getLogger("djev")

TINY_DIR_NAME = "djev-tiny-random"
# CACHE_DIR's folders, by the variable that points each tool at its own (set where not set already).
CACHE_FOLDERS = {"TORCHINDUCTOR_CACHE_DIR": "inductor", "TRITON_CACHE_DIR": "triton", "VLLM_CACHE_ROOT": "vllm"}


class CheckpointError(Exception):
    """No usable checkpoint: the message says what to do."""


def resolve_checkpoint(settings: Settings) -> tuple[Path, bool]:
    """The checkpoint directory to load, and whether it is the tiny random model.

    --model wins (a directory, or a Hugging Face id downloaded with a progress bar); else
    $MODELS_DIR/$MODEL_NAME if it holds a checkpoint; else, with no GPU, the tiny random model
    (built on first use). A GPU with no checkpoint is an error: it would be a waste to answer randomly.
    """
    from app.engine.tiny import is_tiny_checkpoint, write_tiny_model

    runtime = settings.runtime

    if runtime.model:
        candidate = Path(runtime.model).expanduser()
        if candidate.is_dir():
            if not (candidate / "config.json").is_file():
                raise CheckpointError(f"{candidate} has no config.json: not a checkpoint directory")
            return candidate, is_tiny_checkpoint(candidate)
        if candidate.exists() or runtime.model.startswith((".", "/", "~")) or runtime.model.count("/") != 1:
            raise CheckpointError(f"--model {runtime.model}: no checkpoint directory there, and not a Hugging Face id")
        return download_checkpoint(runtime.model, Path(runtime.models_dir)), False
    default = Path(runtime.models_dir) / runtime.model_name
    if (default / "config.json").is_file():
        return default, is_tiny_checkpoint(default)
    if gpu_available() and runtime.device != "cpu":
        raise CheckpointError(
            f"a GPU is present but no checkpoint was given: pass --model (a directory or a Hugging Face id "
            f"such as google/diffusiongemma-26B-A4B-it) or put one at {default}"
        )
    tiny = Path(runtime.models_dir) / TINY_DIR_NAME
    if not (tiny / "config.json").is_file():
        log.info("no GPU and no --model: writing the tiny random-weight model to %s", tiny)
        write_tiny_model(tiny)
    return tiny, True


def download_checkpoint(repo_id: str, models_dir: Path) -> Path:
    from huggingface_hub import snapshot_download

    target = models_dir / repo_id.replace("/", "--")
    log.info("downloading %s to %s", repo_id, target)
    try:
        return Path(snapshot_download(repo_id=repo_id, local_dir=str(target)))
    except Exception as exc:  # noqa: BLE001 - offline, gated, missing: the user needs the reason
        raise CheckpointError(
            f"could not download {repo_id} ({type(exc).__name__}: {exc}). Offline? Download it elsewhere and "
            f"pass --model DIR."
        ) from exc


def gpu_available() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:  # noqa: BLE001
        return False


def hf_options(settings: Settings, served_name: str, tiny: bool):
    """The hf engine's options, from Settings (the one place defaults are defined)."""
    from app.engine.hf.reader import HFOptions

    return HFOptions(
        device=settings.runtime.device,
        max_prompt_tokens=settings.limits.max_prompt_tokens,
        kv_cache_entries=settings.hf.kv_cache_entries,
        max_batch_rows=settings.hf.max_batch_rows,
        gather_ms=settings.hf.batch_gather_ms,
        gather_rows=settings.hf.batch_gather_rows,
        queue_limit=max(1024, 4 * settings.limits.max_inflight),
        served_name=served_name,
        canvas_length=settings.decisions.canvas,
        tiny=tiny,
        torch_threads=settings.hf.torch_threads,
        cuda_graphs=settings.hf.cuda_graphs,
        torch_compile=settings.hf.torch_compile,
        fused_moe=settings.hf.fused_moe,
        prefill_chunk=settings.hf.prefill_chunk,
        prompt_cache_bytes=round(settings.hf.prompt_cache_gb * 2**30),
        turn_tokens=settings.hf.turn_tokens,
        quantize=settings.hf.quantize,
    )


def remote_options(settings: Settings, served_name: str, tiny: bool):
    from app.engine.vllm.remote import RemoteOptions

    return RemoteOptions(
        upstreams=settings.remote.upstream,
        connect_timeout=settings.remote.upstream_connect_timeout,
        read_timeout=settings.remote.upstream_read_timeout,
        health_interval=settings.remote.upstream_health_interval,
        max_prompt_tokens=prompt_limit(settings),
        served_name=served_name,
        canvas_length=settings.decisions.canvas,
        tiny=tiny,
    )


def vllm_options(settings: Settings, served_name: str, tiny: bool):
    from app.engine.vllm.inprocess import VLLMOptions

    return VLLMOptions(
        device=settings.runtime.device,
        canvas_length=settings.decisions.canvas,
        max_seqs=settings.vllm.max_seqs,
        max_model_len=settings.vllm.max_model_len,
        max_num_batched_tokens=settings.vllm.max_num_batched_tokens,
        gpu_util=settings.vllm.gpu_util,
        kv_cache_gb=settings.vllm.kv_cache_gb,
        attn=settings.vllm.attn,
        extra_args=settings.vllm.extra_args,
        cache_dir=settings.runtime.cache_dir,
        torch_mem_fraction=settings.vllm.torch_mem_fraction,
        max_prompt_tokens=prompt_limit(settings),
        served_name=served_name,
        tiny=tiny,
    )


def use_cache_dir(settings: Settings) -> dict[str, str]:
    """Point torch.compile's, Triton's and vLLM's caches into CACHE_DIR, so compiled kernels survive
    a restart: each variable the environment does not set already. Call it before torch is imported
    (their defaults are read then). Returns the variables it set."""
    if not settings.runtime.cache_dir:
        return {}
    root = Path(settings.runtime.cache_dir).expanduser().resolve()
    chosen = {name: str(root / folder) for name, folder in CACHE_FOLDERS.items() if not os.environ.get(name)}
    os.environ.update(chosen)
    return chosen


def served_name(settings: Settings, checkpoint: Path, tiny: bool) -> str:
    from app.engine.tiny import TINY_MODEL_NAME

    return settings.runtime.served_name or (TINY_MODEL_NAME if tiny else checkpoint.name)


def provisional_info(settings: Settings) -> ReaderInfo:
    """What `/health` and the pages say while the model loads: the served name the checkpoint will
    most likely have (read from the settings and the folders, nothing loaded or downloaded), the
    engine, device "loading"."""
    from app.engine.tiny import is_tiny_checkpoint

    runtime = settings.runtime
    if runtime.model:
        given = Path(runtime.model).expanduser()
        folder = given if given.is_dir() else Path(runtime.models_dir) / runtime.model.replace("/", "--")
    else:
        folder = Path(runtime.models_dir) / runtime.model_name
        if not (folder / "config.json").is_file():
            folder = Path(runtime.models_dir) / TINY_DIR_NAME
    tiny = folder.name == TINY_DIR_NAME or is_tiny_checkpoint(folder)
    return ReaderInfo(model=served_name(settings, folder, tiny), engine=runtime.engine, device="loading", tiny=tiny,
                      canvas_length=settings.decisions.canvas)


def build_reader(settings: Settings, progress: StartupProgress | None = None):
    """The reader the settings ask for, loaded (blocking: minutes for a full model on the GPU);
    `progress` hears each start-up phase (finding the checkpoint, and the hf engine's own)."""
    if progress is not None:
        progress("finding the checkpoint", 0, 1)
    checkpoint, tiny = resolve_checkpoint(settings)
    served = served_name(settings, checkpoint, tiny)
    if settings.runtime.engine == "remote":
        from app.engine.vllm.remote import load_remote_reader

        return load_remote_reader(checkpoint, remote_options(settings, served, tiny))
    if settings.runtime.engine == "vllm":
        from app.engine.vllm.inprocess import load_vllm_reader

        try:
            return load_vllm_reader(checkpoint, vllm_options(settings, served, tiny))
        except ImportError as exc:  # vLLM missing: the message says what to install
            raise CheckpointError(str(exc)) from None
    from app.engine.hf.loader import load_hf_reader

    return load_hf_reader(checkpoint, hf_options(settings, served, tiny), progress)


def limits(settings: Settings) -> Limits:
    """The decision core's request limits and defaults, from Settings."""
    return Limits(
        max_questions=settings.limits.max_questions,
        max_samples=settings.limits.max_samples,
        max_think=settings.limits.max_think,
        max_steps=settings.limits.max_steps,
        max_id_length=settings.limits.max_id_length,
        max_images=settings.limits.max_images,
        max_image_bytes=settings.limits.max_image_bytes,
        max_total_image_bytes=settings.limits.max_total_image_bytes,
        confidence=settings.decisions.confidence,
        isolate=settings.decisions.isolate,
        default_seed=settings.decisions.default_seed,
        auto_max=settings.decisions.auto_max,
        auto_threshold=settings.decisions.auto_threshold,
        debias=settings.decisions.debias,
    )


# MAX_PROMPT_TOKENS=0 (the default): the engine's own limit; these where the engine says none.
DEFAULT_PROMPT_TOKENS = 32768
CUDA_PROMPT_TOKENS = 131072


def prompt_limit(settings: Settings, info: ReaderInfo | None = None) -> int:
    """The longest prompt a read may have: MAX_PROMPT_TOKENS where set, else the engine's (the hf
    engine sizes it to the GPU's free memory at start), else DEFAULT_PROMPT_TOKENS."""
    if settings.limits.max_prompt_tokens:
        return settings.limits.max_prompt_tokens
    if info is not None and info.max_prompt_tokens:
        return info.max_prompt_tokens
    return DEFAULT_PROMPT_TOKENS


def read_settings(settings: Settings, info: ReaderInfo | None = None) -> ReadSettings:
    """How the decision core reads, from Settings (and the engine's prompt limit, `prompt_limit`)."""
    return ReadSettings(
        canvas_length=settings.decisions.canvas,
        canvas_step=settings.decisions.canvas_step,
        thought_in_prompt=settings.decisions.thought_placement == "prompt",
        max_prompt_tokens=prompt_limit(settings, info),
        max_thought_tokens=settings.limits.max_thought_tokens,
        debias_rotations=settings.decisions.debias_rotations,
    )


def debias_mode(settings: Settings) -> str:
    """The `debias` mode a request that sends none is read under (a calibration is fitted for one)."""
    return settings.decisions.debias


def load_calibration(settings: Settings) -> Calibration | None:
    """The calibration file CALIBRATION names, read and checked for form (None when unset); a
    CalibrationError naming the file when it is missing or malformed."""
    path = settings.decisions.calibration
    if not path:
        return None
    file = Path(path).expanduser()
    try:
        content = file.read_bytes()
    except OSError as exc:
        raise CalibrationError(f"calibration {path}: cannot read it ({exc.strerror or exc})") from None
    try:
        return read_calibration(content, file.name)
    except CalibrationError as exc:
        raise CalibrationError(f"calibration {path}: {exc}") from None


def fitted_for(settings: Settings, info: ReaderInfo, tokenizer: ChatTokenizer) -> FittedFor:
    """What a calibration fitted now, on this reader and these settings, is fitted for."""
    return FittedFor(model=info.model, tokenizer=tokenizer_fingerprint(tokenizer), template_version=TEMPLATE_VERSION,
                     canvas=settings.decisions.canvas, debias=debias_mode(settings))


def check_calibration(calibration: Calibration | None, settings: Settings, info: ReaderInfo,
                      tokenizer: ChatTokenizer) -> None:
    """Refuse a calibration fitted for another model, tokenizer, template version, canvas or debias
    mode, naming each that differs."""
    if calibration is None:
        return
    differ = calibration.fitted_for.mismatches(fitted_for(settings, info, tokenizer))
    if differ:
        name = (calibration.source or {}).get("file") or "the calibration"
        raise CalibrationError(f"calibration {name} does not fit what is served: {'; '.join(differ)}")
