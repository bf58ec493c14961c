"""`djev serve | selftest | tiny-model`: parse flags, build Settings, choose the checkpoint, start the server."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from dataclasses import fields
from pathlib import Path
from typing import Sequence

from app.config import Settings, field_kind
from app.logs import configure_logging

log = logging.getLogger("djev")

TINY_DIR_NAME = "djev-tiny-random"


class CheckpointError(Exception):
    """No usable checkpoint: the message says what to do."""


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="djev", description="DiffusionGemma decision server (Jev /v1/systemone)")
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="start the server", description=(
        "Start the decision server. Every flag overrides the environment variable named in its help."))
    for f in fields(Settings):
        env = f.metadata["env"]
        kind = field_kind(f)
        if kind is bool:
            serve.add_argument(_flag(f.name), dest=f.name, action=argparse.BooleanOptionalAction, default=None,
                               help=f"{f.metadata['help']} (env {env})")
        elif kind is tuple:  # a list setting: the flag repeats
            serve.add_argument(_flag(f.name), dest=f.name, action="append", default=None,
                               help=f"{f.metadata['help']} (env {env})")
        else:
            serve.add_argument(_flag(f.name), dest=f.name, type=kind, default=None,
                               help=f"{f.metadata['help']} (env {env}, default {f.default!r})")

    selftest = commands.add_parser("selftest", help="one decision end to end, printed; exit 1 on failure", description=(
        "Send the README's three-question decision to a running server (--url), or, without --url, build the "
        "engine the environment configures in this process and ask it. Settings come from the environment."))
    selftest.add_argument("--url", help="a running djev server, e.g. http://127.0.0.1:8011")
    selftest.add_argument("--timeout", type=float, default=120.0, help="seconds for the engine and the answer")

    tiny = commands.add_parser("tiny-model", help="write the tiny random-weight checkpoint to DIR")
    tiny.add_argument("directory", type=Path)
    tiny.add_argument("--seed", type=int, default=0, help="weights seed (the same seed writes the same files)")
    return parser


def settings_from_args(args: argparse.Namespace) -> Settings:
    overrides = {f.name: getattr(args, f.name, None) for f in fields(Settings)}
    return Settings.from_env(**overrides)


def resolve_checkpoint(settings: Settings) -> tuple[Path, bool]:
    """The checkpoint directory to load, and whether it is the tiny random model.

    --model wins (a directory, or a Hugging Face id downloaded with a progress bar); else
    $MODELS_DIR/$MODEL_NAME if it holds a checkpoint; else, with no GPU, the tiny random model
    (built on first use). A GPU with no checkpoint is an error: it would be a waste to answer randomly.
    """
    from app.engine.tiny import is_tiny_checkpoint, write_tiny_model

    if settings.model:
        candidate = Path(settings.model).expanduser()
        if candidate.is_dir():
            if not (candidate / "config.json").is_file():
                raise CheckpointError(f"{candidate} has no config.json: not a checkpoint directory")
            return candidate, is_tiny_checkpoint(candidate)
        if candidate.exists() or settings.model.startswith((".", "/", "~")) or settings.model.count("/") != 1:
            raise CheckpointError(f"--model {settings.model}: no checkpoint directory there, and not a Hugging Face id")
        return download_checkpoint(settings.model, Path(settings.models_dir)), False
    default = Path(settings.models_dir) / settings.model_name
    if (default / "config.json").is_file():
        return default, is_tiny_checkpoint(default)
    if _gpu_available() and settings.device != "cpu":
        raise CheckpointError(
            f"a GPU is present but no checkpoint was given: pass --model (a directory or a Hugging Face id "
            f"such as google/diffusiongemma-26B-A4B-it) or put one at {default}"
        )
    tiny = Path(settings.models_dir) / TINY_DIR_NAME
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


def _gpu_available() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:  # noqa: BLE001
        return False


def hf_options(settings: Settings, served_name: str, tiny: bool):
    """The hf engine's options, from Settings (the one place defaults are defined)."""
    from app.engine.hf.reader import HFOptions

    return HFOptions(
        device=settings.device,
        max_prompt_tokens=settings.max_prompt_tokens,
        kv_cache_entries=settings.kv_cache_entries,
        max_batch_rows=settings.max_batch_rows,
        gather_ms=settings.batch_gather_ms,
        queue_limit=max(1024, 4 * settings.max_inflight),
        served_name=served_name,
        canvas_length=settings.canvas,
        tiny=tiny,
        torch_threads=settings.torch_threads,
        cuda_graphs=settings.cuda_graphs,
        torch_compile=settings.torch_compile,
        fused_moe=settings.fused_moe,
    )


def remote_options(settings: Settings, served_name: str, tiny: bool):
    from app.engine.vllm.remote import RemoteOptions

    return RemoteOptions(
        upstreams=settings.upstream,
        connect_timeout=settings.upstream_connect_timeout,
        read_timeout=settings.upstream_read_timeout,
        health_interval=settings.upstream_health_interval,
        max_prompt_tokens=settings.max_prompt_tokens,
        served_name=served_name,
        canvas_length=settings.canvas,
        tiny=tiny,
    )


def vllm_options(settings: Settings, served_name: str, tiny: bool):
    from app.engine.vllm.inprocess import VLLMOptions

    return VLLMOptions(
        device=settings.device,
        canvas_length=settings.canvas,
        max_seqs=settings.max_seqs,
        max_model_len=settings.max_model_len,
        max_num_batched_tokens=settings.max_num_batched_tokens,
        gpu_util=settings.gpu_util,
        kv_cache_gb=settings.kv_cache_gb,
        attn=settings.attn,
        extra_args=settings.extra_args,
        cache_dir=settings.cache_dir,
        torch_mem_fraction=settings.torch_mem_fraction,
        max_prompt_tokens=settings.max_prompt_tokens,
        served_name=served_name,
        tiny=tiny,
    )


def build_reader(settings: Settings):
    from app.engine.tiny import TINY_MODEL_NAME

    checkpoint, tiny = resolve_checkpoint(settings)
    served = settings.served_name or (TINY_MODEL_NAME if tiny else checkpoint.name)
    if settings.engine == "remote":
        from app.engine.vllm.remote import load_remote_reader

        return load_remote_reader(checkpoint, remote_options(settings, served, tiny))
    if settings.engine == "vllm":
        from app.engine.vllm.inprocess import load_vllm_reader

        try:
            return load_vllm_reader(checkpoint, vllm_options(settings, served, tiny))
        except ImportError as exc:  # vLLM missing: the message says what to install
            raise CheckpointError(str(exc)) from None
    from app.engine.hf.reader import load_hf_reader

    return load_hf_reader(checkpoint, hf_options(settings, served, tiny))


def serve(settings: Settings) -> int:
    from app.server import create_app, serve_app

    reader = build_reader(settings)
    app = create_app(settings, reader)
    ssl = None
    if settings.tls_port:
        from app.tls import ensure_certificate

        ssl = ensure_certificate(Path(settings.cert_dir))
    asyncio.run(serve_app(app, settings, ssl))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "tiny-model":
        logging.basicConfig(level=logging.INFO, format="%(message)s")
        from app.engine.tiny import write_tiny_model

        path = write_tiny_model(args.directory, seed=args.seed)
        print(f"tiny random-weight DiffusionGemma written to {path}")
        return 0
    try:
        settings = settings_from_args(args)
    except ValueError as exc:
        print(f"djev: {exc}", file=sys.stderr)
        return 2
    configure_logging(settings)
    if args.command == "selftest":
        from app.selftest import run_selftest

        return run_selftest(settings, args.url, args.timeout)  # it reports every failure itself
    try:
        return serve(settings)
    except CheckpointError as exc:
        print(f"djev: {exc}", file=sys.stderr)
        return 2
