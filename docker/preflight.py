"""The image's start-up checks, before vLLM loads anything (run by docker/entrypoint.sh).

1. A checkpoint at $MODEL (config.json), else a clear message and exit 2.
2. An NVFP4 checkpoint runs natively on Blackwell (compute capability 10.0+, from nvidia-smi), through
   vLLM's Marlin kernels on Ampere/Ada (8.0+, with a note), and is refused (exit 2, naming the bf16
   release) on older GPUs or with no GPU.
3. Memory, computed from the checkpoint actually present:
     weights   = the size of its *.safetensors files
     KV        = KV_CACHE_GB (djev's setting)
     transient = floor(MAX_SEQS x CANVAS x vocab x 4 bytes x TRANSIENT_COPIES / 2^30) + 1 GiB (the fp32
                 [canvases, vocab] logits copies vLLM makes while it starts and samples)
     headroom  = HEADROOM_GB
   against MemAvailable in /proc/meminfo (MEMINFO overrides the path, for tests). The breakdown is
   printed; short memory exits 2. On unified-memory machines (DGX Spark / GB10) a CUDA overshoot
   hangs the whole host instead of failing a request, which is why this refuses up front.
   MEMORY_CHECK=0 skips it.

MAX_SEQS, CANVAS and KV_CACHE_GB come from djev's Settings (the one place their defaults live);
HEADROOM_GB and TRANSIENT_COPIES are the image's own (documented in docker/entrypoint.sh).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

GIB = 2**30
BF16_RELEASE = "google/diffusiongemma-26B-A4B-it"


def fail(message: str) -> None:
    print(f"djev-image: {message}", file=sys.stderr)
    sys.exit(2)


def load_config(model: Path) -> dict:
    config = model / "config.json"
    if not config.is_file():
        fail(f"no model at {model} (no config.json). Put a DiffusionGemma checkpoint in the models volume "
             f"({BF16_RELEASE}, or its NVFP4 variant on Blackwell) at $MODELS_DIR/$MODEL_NAME on the host, "
             f"e.g. `huggingface-cli download {BF16_RELEASE} --local-dir models/dgemma`.")
    try:
        return json.loads(config.read_text())
    except ValueError as exc:
        fail(f"{config} is not valid JSON: {exc}")
    raise AssertionError("unreachable")


def is_nvfp4(config: dict) -> bool:
    quant = config.get("quantization_config") or {}
    text = json.dumps(quant).lower()
    return "nvfp4" in text or "fp4" in str(quant.get("quant_algo", "")).lower()


def compute_capability() -> float | None:
    """The first GPU's compute capability from nvidia-smi, or None when it cannot say."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
        return float(out.strip().splitlines()[0])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def check_quantization(config: dict) -> str:
    """bf16 runs on any GPU vLLM supports. NVFP4 is native on Blackwell (compute capability 10.0+, the
    reference's DGX Spark / GB10); vLLM runs it on Ampere and Ada (8.0+) through Marlin's weight-only
    FP4 kernels, slower; older GPUs cannot run it."""
    if not is_nvfp4(config):
        return "bf16"
    capability = compute_capability()
    if capability is None:
        fail("the checkpoint is NVFP4 and nvidia-smi reports no GPU. NVFP4 needs a GPU of compute "
             f"capability 8.0 or newer (native FP4 on Blackwell); use the bf16 release ({BF16_RELEASE}) otherwise.")
    if capability < 8.0:
        fail(f"the checkpoint is NVFP4, which needs compute capability 8.0 or newer (native FP4 on Blackwell, "
             f"10.0+); this GPU is {capability}. Use the bf16 release ({BF16_RELEASE}).")
    if capability < 10.0:
        print(f"note: NVFP4 on compute capability {capability} runs through vLLM's Marlin kernels (weight-only "
              f"FP4), slower than native FP4 on Blackwell; the bf16 release ({BF16_RELEASE}) is the alternative "
              "where memory allows")
        return f"NVFP4 via Marlin on compute capability {capability}"
    return f"NVFP4 on Blackwell, compute capability {capability}"


def mem_available_gib(path: str) -> float:
    for line in Path(path).read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024 / GIB
    fail(f"no MemAvailable line in {path}")
    raise AssertionError("unreachable")


def env_float(name: str, default: float) -> float:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        return float(raw)
    except ValueError:
        fail(f"{name}={raw!r} is not a number")
    raise AssertionError("unreachable")


def check_memory(model: Path, config: dict) -> None:
    from app.config import Settings

    if os.environ.get("MEMORY_CHECK", "1") == "0":
        print("memory: check skipped (MEMORY_CHECK=0)")
        return
    settings = Settings.from_env()
    vocab = int((config.get("text_config") or config).get("vocab_size", 262144))
    weights = sum(f.stat().st_size for f in model.glob("*.safetensors")) / GIB
    if weights == 0:
        fail(f"no *.safetensors files in {model}")
    copies = env_float("TRANSIENT_COPIES", 2)
    transient = int(settings.vllm.max_seqs * settings.decisions.canvas * vocab * 4 * copies // GIB) + 1
    headroom = env_float("HEADROOM_GB", 12)
    need = weights + settings.vllm.kv_cache_gb + transient + headroom
    available = mem_available_gib(os.environ.get("MEMINFO", "/proc/meminfo"))
    print(f"memory: {available:.1f} GB available, need {need:.1f} (weights {weights:.1f} + KV "
          f"{settings.vllm.kv_cache_gb:g} + start-up transient {transient} [{settings.vllm.max_seqs} seqs x "
          f"{settings.decisions.canvas} "
          f"canvas x {vocab} vocab x {copies:g} fp32 copies] + headroom {headroom:g})")
    if available < need:
        fail("refusing to start: not enough memory; stop other models first, or lower MAX_SEQS, CANVAS or "
             "KV_CACHE_GB (MEMORY_CHECK=0 skips this check)")


def main() -> None:
    model = Path(os.environ.get("MODEL") or "/models/dgemma")
    config = load_config(model)
    kind = check_quantization(config)
    print(f"checkpoint: {model} ({kind})")
    check_memory(model, config)


if __name__ == "__main__":
    main()
