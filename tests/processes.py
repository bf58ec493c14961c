"""The processes a test starts (servers, vLLM, HAProxy): stopped with their whole process group, and
the end of their logs for a failure's message."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path


def stop_group(process: subprocess.Popen, grace: float = 30.0, hard: bool = False) -> None:
    """SIGTERM to the process group the test started (at once SIGKILL with `hard`: a server dying
    without warning), then SIGKILL past `grace` seconds."""
    if process.poll() is not None:
        return
    try:
        os.killpg(process.pid, signal.SIGKILL if hard else signal.SIGTERM)
        process.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=grace)
    except ProcessLookupError:
        pass


def tail(path: Path, lines: int = 40, missing: str = "") -> str:
    """A log's last `lines` lines (`missing` where there is no log)."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return missing
