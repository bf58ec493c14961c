"""Run vLLM work from the main venv's pytest: vLLM lives in .venv-vllm (scripts/setup.sh --vllm), so
tests start its python in a subprocess with the environment vLLM's CPU build needs here
(tests/vllm_support.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.vllm_support import VLLM_ENV, require_vllm  # the venv, its environment, skip/fail policy

ROOT = Path(__file__).resolve().parents[2]
DRIVER = Path(__file__).resolve().parent / "vllm_driver.py"


def vllm_env(**extra: str) -> dict[str, str]:
    return {**os.environ, **VLLM_ENV, **extra}


def run_python(code: str, timeout: float = 120, **env: str) -> subprocess.CompletedProcess:
    """Run `code` with .venv-vllm's python (the plugin is loaded by whatever vLLM call `code` makes)."""
    return subprocess.run([str(require_vllm()), "-c", code], env=vllm_env(**env), capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT)


def run_driver(job: dict, work: Path, timeout: float = 600, **env: str) -> dict:
    """One vLLM engine running `job` (see vllm_driver.py); its JSON result. vLLM's log goes to
    work/vllm.log, and into the failure message when the run fails."""
    python = require_vllm()
    job_path, result_path, log_path = work / "job.json", work / "result.json", work / "vllm.log"
    job_path.write_text(json.dumps(job))
    with log_path.open("w") as log:
        done = subprocess.run([str(python), str(DRIVER), str(job_path), str(result_path)],
                              env=vllm_env(**env), stdout=log, stderr=subprocess.STDOUT,
                              timeout=timeout, cwd=ROOT)
    if done.returncode != 0:
        tail = log_path.read_text()[-6000:]
        print(tail, file=sys.stderr)
        raise AssertionError(f"vLLM driver exited {done.returncode}; log tail:\n{tail}")
    return json.loads(result_path.read_text())
