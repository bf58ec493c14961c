"""What the tests that run real vLLM share: the CPU vLLM venv (.venv-vllm, built by
`scripts/setup.sh --vllm`), the environment vLLM's CPU build needs, starting servers as
subprocesses (vLLM is not in the main venv), and comparing two engines' answers.

Without .venv-vllm these tests skip with a message, except in CI (env CI set), where they fail.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import subprocess
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Sequence

import httpx
import pytest

from app.selftest import DECISION
from app.server import free_port
from bench.common import vllm_cpu_env
from tests.processes import stop_group
from tests.processes import tail as log_tail

REPO = Path(__file__).resolve().parent.parent
VLLM_PYTHON = Path(os.environ.get("DJEV_VLLM_VENV", REPO / ".venv-vllm")) / "bin" / "python"
START_TIMEOUT_S = 300  # a vLLM process starts in ~25 s alone; 2 shared cores can make that minutes
PROBABILITY_TOLERANCE = 1e-4

# The decision both engines answer in the parity tests: all three question types.
TICKET = {
    "state": {"ticket": "Everything is down and we have a demo at noon. Fix it now."},
    "questions": DECISION["questions"],  # the README's three question types (app/selftest.py)
    "samples": 2,
    "seed": 11,
}


# vLLM's processes talk over ZeroMQ IPC sockets in VLLM_RPC_BASE_PATH, the system temp folder by
# default, and a process the tests stop leaves its sockets there (hundreds over a few CI runs): the
# tests give vLLM a folder of their own, removed when pytest exits.
RPC_DIR = tempfile.mkdtemp(prefix="djev-vllm-ipc-")
atexit.register(shutil.rmtree, RPC_DIR, ignore_errors=True)

# vLLM's CPU build as it runs DiffusionGemma here (one place: scripts/vllm_cpu/cpu.env).
VLLM_ENV = {**vllm_cpu_env(), "VLLM_RPC_BASE_PATH": RPC_DIR}


# A server to start: argv, its health URL, its log file, environment beyond VLLM_ENV.
Command = tuple[list[str], str, Path, dict[str, str]]


def interpreted_checks(script: Path) -> dict:
    """Run a checks script of Triton kernels in the CPU vLLM venv (it has Triton) under Triton's
    interpreter; the JSON object its last line prints."""
    python = require_vllm()
    done = subprocess.run([str(python), str(script)], cwd=REPO, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "TRITON_INTERPRET": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def require_vllm() -> Path:
    """The CPU vLLM venv's python, or skip (fail under CI) with what to run."""
    if VLLM_PYTHON.is_file():
        return VLLM_PYTHON
    message = f"{VLLM_PYTHON} is missing: run scripts/setup.sh --vllm to build the CPU vLLM venv"
    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message)


@contextmanager
def server_processes(commands: Sequence[Command]) -> Iterator[list[subprocess.Popen]]:
    """Start server processes all at once, wait until every health URL answers 200, and stop them
    (and their children) afterwards."""
    processes: list[subprocess.Popen] = []
    try:
        for argv, _, log_path, extra_env in commands:
            env = {**os.environ, **VLLM_ENV, "PYTHONPATH": str(REPO), **extra_env}
            with open(log_path, "wb") as log:
                processes.append(subprocess.Popen(list(argv), cwd=REPO, env=env, stdout=log,
                                                  stderr=subprocess.STDOUT, start_new_session=True))
        deadline = time.monotonic() + START_TIMEOUT_S
        for process, (argv, health_url, log_path, _) in zip(processes, commands):
            while True:
                if process.poll() is not None:
                    raise RuntimeError(f"{argv[1:4]} exited with {process.returncode}; log:\n{tail(log_path)}")
                try:
                    if httpx.get(health_url, timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{argv[1:4]} not healthy after {START_TIMEOUT_S} s; log:\n{tail(log_path)}")
                time.sleep(0.5)
        yield processes
    finally:
        for process in processes:
            stop_process(process)


def stop_process(process: subprocess.Popen, hard: bool = False) -> None:
    """The process group this test started stopped (vLLM's engine core included): `stop_group`."""
    stop_group(process, hard=hard)


def tail(path: Path, lines: int = 40) -> str:
    return log_tail(path, lines, missing="(no log)")


def vllm_openai_command(python: Path, checkpoint: Path, log_dir: Path, name: str) -> Command:
    """vLLM's OpenAI server on the checkpoint (`vllm serve` cannot find the vllm-cpu distribution, so
    the module it would run), with vLLM's own 128 logprob_token_ids cap (the plugin's raised cap
    off), as any stock upstream has it."""
    port = free_port()
    argv = [str(python), "-m", "vllm.entrypoints.launchers.api_server.entry", "--model", str(checkpoint),
            "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--enforce-eager",
            "--max-model-len", "4096", "--max-num-seqs", "8", "--max-num-batched-tokens", "4096",
            "--enable-prefix-caching", "--diffusion-config", json.dumps({"canvas_length": 128}),
            "--limit-mm-per-prompt", json.dumps({"image": 0, "video": 0, "audio": 0})]
    return argv, f"http://127.0.0.1:{port}/health", log_dir / f"{name}.log", {"DJEV_VLLM_PATCH_DISABLE": "logprob_cap"}


def base_url(health_url: str) -> str:
    return health_url.rsplit("/health", 1)[0]


def djev_vllm_command(python: Path, checkpoint: Path, log_dir: Path) -> Command:
    """`djev serve --engine vllm` on the checkpoint, as the README starts it: (argv, health URL, log)."""
    port = free_port()
    argv = [str(python), "-m", "app", "serve", "--engine", "vllm", "--model", str(checkpoint), "--device", "cpu",
            "--host", "127.0.0.1", "--port", str(port), "--max-seqs", "8", "--max-model-len", "4096",
            "--kv-cache-gb", "1", "--max-num-batched-tokens", "4096"]
    return argv, f"http://127.0.0.1:{port}/health", log_dir / "djev-vllm.log", {}


# Keys whose numbers measure time or say which engine answered: not compared between engines.
NOT_COMPARED = {"timing", "ms", "total_ms", "engine", "uptime_s", "id", "created", "request_id"}


def numbers_and_words(value: Any, path: str = "") -> dict[str, Any]:
    """Every leaf of a JSON answer by its path, leaving out NOT_COMPARED keys."""
    out: dict[str, Any] = {}
    if isinstance(value, dict):
        for key, item in value.items():
            if key not in NOT_COMPARED:
                out.update(numbers_and_words(item, f"{path}.{key}"))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            out.update(numbers_and_words(item, f"{path}[{index}]"))
    else:
        out[path] = value
    return out


def assert_same_answers(reference: dict, other: dict, tolerance: float = PROBABILITY_TOLERANCE) -> int:
    """Two engines' answers to the same request: the same shape and words, every number within
    `tolerance`. Returns how many numbers were compared."""
    expected, actual = numbers_and_words(reference), numbers_and_words(other)
    assert expected.keys() == actual.keys(), sorted(set(expected) ^ set(actual))[:10]
    compared = 0
    for path, value in expected.items():
        if isinstance(value, float) and not isinstance(actual[path], bool):
            assert abs(value - actual[path]) <= tolerance, f"{path}: {value} vs {actual[path]}"
            compared += 1
        else:
            assert value == actual[path], f"{path}: {value!r} vs {actual[path]!r}"
    return compared
