"""What every benchmark script shares: percentiles, timing on a device, the machine it ran on, a
markdown table, the JSON results file, the tiny checkpoint, and a live server on 127.0.0.1.

Only the standard library is imported at module level, so `bench_gpu.py` can use this module on a
GPU box that has torch and transformers but no Starlette or uvicorn; the server helpers import them
when they are called.

Conventions (docs/benchmarks.md): latencies are wall-clock seconds from `time.perf_counter()`,
reported in milliseconds; p50/p95 interpolate linearly between the two nearest ranks (numpy's default),
so they are comparable with numbers from numpy-based tools.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import hashlib
import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence, TypeVar

REPO = Path(__file__).resolve().parent.parent
CACHE_DIR = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "djev-bench"
T = TypeVar("T")


def vllm_cpu_env() -> dict[str, str]:
    """The environment vLLM's CPU build runs DiffusionGemma with (scripts/vllm_cpu/cpu.env)."""
    env = {}
    for line in (REPO / "scripts" / "vllm_cpu" / "cpu.env").read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            env[key.strip()] = value.strip()
    return env


# ---------------------------------------------------------------------------------------- numbers

def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between the closest ranks."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def latency_summary(seconds: Sequence[float]) -> dict[str, float]:
    """n, p50, p95, mean, min and max of durations given in seconds, reported in milliseconds."""
    ms = [s * 1000.0 for s in seconds]
    if not ms:
        return {"n": 0, "p50_ms": float("nan"), "p95_ms": float("nan"), "mean_ms": float("nan"),
                "min_ms": float("nan"), "max_ms": float("nan")}
    return {
        "n": len(ms),
        "p50_ms": round(percentile(ms, 50), 3),
        "p95_ms": round(percentile(ms, 95), 3),
        "mean_ms": round(sum(ms) / len(ms), 3),
        "min_ms": round(min(ms), 3),
        "max_ms": round(max(ms), 3),
    }


class CollectorPauses:
    """The garbage collector's passes while the block runs: how many, and the longest, in ms
    (gc.callbacks; a full pass over a loaded model's heap can cost hundreds of ms)."""

    def __init__(self) -> None:
        self.pauses: list[tuple[int, float]] = []  # (generation, ms)
        self._started = 0.0

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.pauses.append((int(info["generation"]), (time.perf_counter() - self._started) * 1000))

    def __enter__(self) -> "CollectorPauses":
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._callback)

    def summary(self) -> dict[str, float]:
        return {"gc_passes": len(self.pauses), "gc_full_passes": sum(1 for g, _ in self.pauses if g == 2),
                "gc_longest_ms": round(max((ms for _, ms in self.pauses), default=0.0), 1)}


def settle_device_and_out(parser: argparse.ArgumentParser, args: argparse.Namespace, out_name: str) -> None:
    """A GPU bench's --device (default: CUDA where there is one; the full-size model refused off a GPU)
    and --out (default: `out_name` under $OUT where $OUT is set)."""
    import torch

    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if not args.tiny and not args.device.startswith("cuda"):
        parser.error("the full-size model needs a GPU; use --tiny to check the script on a CPU")
    if args.out is None and os.environ.get("OUT"):
        args.out = str(Path(os.environ["OUT"]) / out_name)


def at_least(low: int) -> Callable[[str], int]:
    """An argparse type: a whole number no less than `low` (a count of reps, frames, tokens)."""
    def whole(text: str) -> int:
        value = int(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"{value}: at least {low}")
        return value

    return whole


def numbers(kind: Callable[[str], T]) -> Callable[[str], list[T]]:
    """An argparse type: comma-separated numbers of `kind` ("" or "," for none)."""
    def parse(text: str) -> list[T]:
        return [kind(part) for part in text.split(",") if part.strip()]

    return parse


def positive_seconds(text: str) -> float:
    """An argparse type: a duration in seconds, more than zero."""
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text}: more than 0 seconds")
    return value


def fmt(value: float, digits: int = 1) -> str:
    """A table cell: fixed digits, or a dash for a missing (NaN) value."""
    return "-" if value != value else f"{value:.{digits}f}"


# ---------------------------------------------------------------------------------------- built after ready

# What the hf reader counts when a pass builds something after ready: a CUDA graph captured, a
# torch.compile graph or a Triton kernel compiled (app/engine/hf/reader.py AFTER_READY, the reader's
# `stats`; on /metrics `djev_hf_<name>_total`). A bench's run must leave every one at 0.
AFTER_READY = ("captures_after_ready", "recompiles_after_ready", "triton_compiles_after_ready")
# `app.engine.hf.reader.compile_counts`'s triple, by name.
COMPILE_COUNTS = ("cuda_graphs_captured", "torch_compile_graphs", "triton_kernels_compiled")


def named_compile_counts(counts: Sequence[int]) -> dict[str, int]:
    """`compile_counts(runner)` (captures, torch.compile graphs, Triton kernels) by name, for JSON."""
    return {name: int(count) for name, count in zip(COMPILE_COUNTS, counts)}


def compile_counts_line(counts: dict[str, int], where: str) -> str:
    """The line a bench prints right after ready: what the start-up built."""
    return (f"{where}: {counts['cuda_graphs_captured']} CUDA graphs captured, {counts['torch_compile_graphs']} "
            f"torch.compile graphs, {counts['triton_kernels_compiled']} Triton kernels compiled")


def after_ready(stats: Any) -> dict[str, float | None]:
    """The after-ready counters in a reader's `stats`, by name; None for one that is not there."""
    return {name: (float(stats[name]) if name in stats else None) for name in AFTER_READY}


def after_ready_metrics(series: Any) -> dict[str, float | None]:
    """The after-ready counters in /metrics `series` (bench/server.py `read_metrics`), by their reader
    names; None for one that is not there. Each is `djev_hf_<name>_total` as a counter, or
    `djev_hf_<name>` as /metrics exports it today: a gauge, its name ending in `_ready`
    (app/web/metrics.py GAUGE_SUFFIXES)."""
    found: dict[str, float | None] = {}
    for name in AFTER_READY:
        keys = [key for key in (f"djev_hf_{name}_total", f"djev_hf_{name}") if key in series]
        found[name] = float(series[keys[0]]) if keys else None
    return found


def after_ready_lines(counts: dict[str, float | None], where: str) -> list[str]:
    """The lines a bench prints at its end: every after-ready counter, and a WARNING line naming each
    that is not 0 (something was captured or compiled while serving: the start-up missed a shape)."""
    said = ", ".join(f"{name} {'not reported' if value is None else f'{value:g}'}" for name, value in counts.items())
    lines = [f"{where}, built after ready: {said} (each must be 0)"]
    moved = [f"{name} = {value:g}" for name, value in counts.items() if value]
    if moved:
        lines.append(f"WARNING: {where}: built after ready: {', '.join(moved)}; every one must be 0 (a pass captured "
                     "or compiled a shape the start-up did not)")
    return lines


# ---------------------------------------------------------------------------------------- timing

def no_sync() -> None:
    """Nothing to wait for: the CPU's work is done when a call returns."""


def device_sync(device: Any) -> Callable[[], None]:
    """A call that waits until `device` (a torch device or its name) has run the work queued on it:
    `torch.cuda.synchronize` on CUDA, nothing on the CPU."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return no_sync


def timed_call(call: Callable[[], T], sync: Callable[[], None] = no_sync) -> tuple[T, float]:
    """`call`'s result and its wall-clock seconds, the device synchronised before and after (so the
    seconds hold its device work, and none queued before it)."""
    sync()
    started = time.perf_counter()
    out = call()
    sync()
    return out, time.perf_counter() - started


def time_calls(call: Callable[[], Any], reps: int, sync: Callable[[], None] = no_sync, warmup: int = 0) -> list[float]:
    """The seconds of each of `reps` calls (`timed_call`), after `warmup` untimed ones."""
    for _ in range(warmup):
        call()
    return [timed_call(call, sync)[1] for _ in range(reps)]


def median_ms(call: Callable[[], Any], reps: int, sync: Callable[[], None] = no_sync, warmup: int = 0) -> float:
    """The median of `time_calls`, in milliseconds."""
    return statistics.median(time_calls(call, reps, sync, warmup)) * 1000


def event_median_ms(call: Callable[[], Any], reps: int) -> float:
    """The median device time of `reps` calls on CUDA, in milliseconds, from CUDA events recorded
    around each: the GPU's time alone, without the host's launch and synchronisation (for a CUDA
    graph's replay, whose host side is a few microseconds)."""
    import torch

    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


# ---------------------------------------------------------------------------------------- reporting

def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def git_revision() -> str:
    """The commit the benchmark ran on, with "+dirty" when the tree has changes ("" outside git)."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                              text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return head + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return ""


def machine() -> dict[str, Any]:
    """What the numbers depend on: CPU, cores, Python, torch and transformers, the accelerator."""
    info: dict[str, Any] = {
        "cpu": cpu_model(),
        "logical_cpus": os.cpu_count(),
        "usable_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "git": git_revision(),
    }
    try:
        import torch

        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
        if torch.cuda.is_available():
            info["device"] = torch.cuda.get_device_name(0)
            info["cuda"] = torch.version.cuda
        else:
            info["device"] = "cpu"
    except ImportError:
        info["device"] = "cpu"
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    return info


def command_line() -> str:
    """The command as typed, runnable again from the repository root."""
    script = Path(sys.argv[0])
    try:
        script = script.resolve().relative_to(REPO)
    except ValueError:
        pass
    return " ".join(shlex.quote(part) for part in ["python", str(script), *sys.argv[1:]])


def header(title: str, info: dict[str, Any]) -> str:
    """The lines that go above every results table: what, when, the command and the machine."""
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    cpus = f"{info.get('usable_cpus')} of {info.get('logical_cpus')} logical CPUs"
    versions = ", ".join(f"{name} {info[name]}" for name in ("python", "torch", "transformers") if name in info)
    if "torch_threads" in info:
        versions += f", torch intra-op threads {info['torch_threads']}"
    return "\n".join([
        f"## {title}",
        "",
        f"- date: {date}",
        f"- command: `{command_line()}`",
        f"- machine: {info.get('cpu')} ({cpus}), device {info.get('device')}; {versions}",
        f"- commit: {info.get('git') or 'unknown'}",
    ])


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def write_json(path: str | Path, payload: dict[str, Any]) -> Path:
    """Write the results (with the command, date and machine) as indented JSON; returns the path."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    document = {
        "command": command_line(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        **payload,
    }
    target.write_text(json.dumps(document, indent=2, sort_keys=False) + "\n")
    return target


# ---------------------------------------------------------------------------------------- torch, the tiny model

def set_torch_threads(requested: int | None) -> int:
    """Set torch's intra-op threads for this process; returns the count in force.

    The default (None) leaves one core to the load generator and the event loop: on a small CPU box a
    client process beside torch threads on every core oversubscribes it, and torch's spinning
    OpenMP threads then slow a read by 10-50x, which would measure the contention, not the server.
    """
    import torch

    if requested is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        requested = max(1, cores - 1)
    torch.set_num_threads(requested)
    return torch.get_num_threads()


def quiet_transformers() -> None:
    """No progress bars for writing and loading the tiny checkpoint: they would interleave with the
    tables."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def tiny_checkpoint() -> Path:
    """The tiny random-weight checkpoint, written once into the cache and reused.

    The folder name carries a hash of `app/engine/tiny.py` and the transformers version, so a change
    to either builds a new one instead of benchmarking a stale model. It is written to a temporary
    folder and renamed into place, so two benchmarks starting at once cannot see half a checkpoint.
    """
    import transformers

    from app.engine.tiny import write_tiny_model

    quiet_transformers()
    digest = hashlib.sha256((REPO / "app" / "engine" / "tiny.py").read_bytes()).hexdigest()[:12]
    target = CACHE_DIR / f"tiny-{digest}-tf{transformers.__version__}"
    if (target / "djev.json").is_file():
        return target
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="tiny-", dir=CACHE_DIR))
    write_tiny_model(scratch / "model")
    try:
        (scratch / "model").rename(target)
    except OSError:  # another process got there first
        pass
    shutil.rmtree(scratch, ignore_errors=True)
    return target


def tiny_reader(checkpoint: Path, settings: Any = None):
    """A fresh hf reader on the tiny checkpoint, on the CPU, with the limits of `settings` (default:
    the server's defaults) mapped the way `djev serve` maps them (app/build.py, build_reader). A reader
    belongs to one event loop, so the in-process measurements and the server each get their own."""
    from app.build import hf_options
    from app.config import Settings
    from app.engine.hf.loader import load_hf_reader
    from app.engine.tiny import TINY_MODEL_NAME

    quiet_transformers()
    settings = (settings or Settings()).replace(device="cpu")
    return load_hf_reader(checkpoint, hf_options(settings, TINY_MODEL_NAME, tiny=True))


# ---------------------------------------------------------------------------------------- servers

@contextmanager
def live_server(app: Any, ws_max_size: int = 16 * 1024 * 1024) -> Iterator[str]:
    """Serve `app` on 127.0.0.1 (a free port) in a background thread, with the options `djev serve`
    uses (no access log, no proxy headers, lifespan on); yields the base URL."""
    from app.server import serve_in_background

    with serve_in_background(app, ws_max_size=ws_max_size) as url:
        yield url


@contextmanager
def tiny_server(checkpoint: Path, **settings: Any) -> Iterator[tuple[str, Any]]:
    """The real app (`create_app`) on its own tiny-model reader, served on 127.0.0.1.

    `settings` override `Settings` fields, the reader's limits included (see `tiny_reader`). The
    pages are off and the log is quiet (no per-decision log line); everything else is the server's
    default. Yields (base URL, reader); the reader's `stats` counters show what the engine did.
    """
    from app.config import Settings
    from app.server import create_app

    config = Settings.of(host="127.0.0.1", pages=False, log_level="warning", **settings)
    reader = tiny_reader(checkpoint, config)
    app = create_app(config, reader)
    with live_server(app, ws_max_size=config.limits.max_image_bytes + 65536) as url:
        yield url, reader
