"""djev's vLLM general plugin: the patches djev's DiffusionGemma canvas reads need in vLLM 0.32.0.

vLLM calls `register()` once per process (API server, engine core, worker) before the model is
built, through the entry point group `vllm.general_plugins`. The plugin knows nothing of djev's
app; it only patches vLLM:

- `canvas_window` (CPU attention backend only): canvas queries of a diffusion request see the whole
  cached sliding window plus the whole canvas, as transformers' DiffusionGemma does
  (`canvas_window.py`).
- `logprob_cap`: more than vLLM's 128 `logprob_token_ids` per request (`logprob_cap.py`).
- `backend_check`: a start-up warning naming every attention backend of a DiffusionGemma model whose
  canvas window this plugin has not verified (`backend_check.py`).

The patches wrap private vLLM code, so `register()` refuses (a logged error, nothing patched) on any
vLLM version outside TESTED_VLLM_VERSIONS. `status()` says what this process's plugin did; an
engine that runs vLLM in its own process uses it to learn that the plugin is loaded and what it
verified.

Environment:
- DJEV_VLLM_PATCH_DISABLE: comma-separated patch names not to install (canvas_window, logprob_cap,
  backend_check), for before/after comparisons.
- DJEV_MAX_LOGPROB_TOKEN_IDS: the raised cap (default 1024).
"""

from __future__ import annotations

import logging
import os
from typing import Any

PLUGIN_VERSION = "0.32.0.1"
TESTED_VLLM_VERSIONS = ("0.32.0",)
# Attention backends on which the canvas window fix is installed and verified against transformers
# (float32, every slot probability within 1e-4, prompts inside and past the window).
VERIFIED_WINDOW_BACKENDS = ("CPU_ATTN",)
PATCH_NAMES = ("canvas_window", "logprob_cap", "backend_check")
DEFAULT_MAX_LOGPROB_TOKEN_IDS = 1024

# A child of vLLM's logger, so the lines come out in vLLM's format wherever vLLM logs.
log = logging.getLogger("vllm.djev_vllm_patch")

_state: dict[str, Any] = {
    "registered": False,  # register() ran in this process
    "loaded": False,  # ... and accepted this vLLM version
    "refused": None,  # why nothing was patched
    "vllm_version": None,
    "patches": [],  # names installed in this process
    "max_logprob_token_ids": None,
    "backends_seen": [],  # attention backends of DiffusionGemma models built in this process
    "unverified_backends_seen": [],
}


def status() -> dict[str, Any]:
    """What the plugin did in this process (a copy; safe to serialise as JSON).

    Keys: `loaded` (True when the version check passed and patches were installed), `refused` (the
    reason when not), `registered`, `plugin_version`, `vllm_version`, `tested_vllm_versions`,
    `patches` (installed patch names), `verified_window_backends` (backends whose canvas window
    matches transformers past the sliding window), `max_logprob_token_ids` (the raised cap, or None),
    `backends_seen` / `unverified_backends_seen` (attention backends of DiffusionGemma models built
    in this process; empty where the model runs in another process), `canvas_rows_anchored` /
    `canvas_mixed_steps` (what the window fix did in this process).
    """
    from . import canvas_window

    snapshot = {key: (list(value) if isinstance(value, list) else value) for key, value in _state.items()}
    snapshot["plugin_version"] = PLUGIN_VERSION
    snapshot["tested_vllm_versions"] = list(TESTED_VLLM_VERSIONS)
    snapshot["verified_window_backends"] = (
        list(VERIFIED_WINDOW_BACKENDS) if "canvas_window" in _state["patches"] else []
    )
    snapshot["canvas_rows_anchored"] = canvas_window.rows_anchored()
    snapshot["canvas_mixed_steps"] = canvas_window.mixed_steps()
    return snapshot


def _disabled() -> set[str]:
    raw = os.environ.get("DJEV_VLLM_PATCH_DISABLE", "")
    names = {name.strip() for name in raw.split(",") if name.strip()}
    unknown = names - set(PATCH_NAMES)
    if unknown:
        log.warning("djev_vllm_patch: DJEV_VLLM_PATCH_DISABLE names unknown patches %s (known: %s)",
                    sorted(unknown), ", ".join(PATCH_NAMES))
    return names


def _cap_from_env() -> int:
    raw = os.environ.get("DJEV_MAX_LOGPROB_TOKEN_IDS", "")
    if not raw:
        return DEFAULT_MAX_LOGPROB_TOKEN_IDS
    try:
        cap = int(raw)
    except ValueError:
        cap = 0
    if cap < 128:
        log.warning("djev_vllm_patch: DJEV_MAX_LOGPROB_TOKEN_IDS=%r is not an integer >= 128; using %d",
                    raw, DEFAULT_MAX_LOGPROB_TOKEN_IDS)
        return DEFAULT_MAX_LOGPROB_TOKEN_IDS
    return cap


def register() -> None:
    """The entry point: check the vLLM version, then install the patches (once per process)."""
    if _state["registered"]:
        return
    _state["registered"] = True
    import vllm

    version = getattr(vllm, "__version__", "unknown")
    _state["vllm_version"] = version
    if version not in TESTED_VLLM_VERSIONS:
        reason = (f"vLLM {version} is not a version this plugin was tested on "
                  f"({', '.join(TESTED_VLLM_VERSIONS)}); nothing patched")
        _state["refused"] = reason
        log.error("djev_vllm_patch %s: %s. Canvas reads whose prompt + canvas passes the sliding "
                  "window will not match transformers, and requests keep vLLM's own "
                  "logprob_token_ids cap.", PLUGIN_VERSION, reason)
        return

    from vllm.platforms import current_platform

    disabled = _disabled()
    if "canvas_window" not in disabled and current_platform.is_cpu():
        from . import canvas_window

        _install("canvas_window", canvas_window.install)
    if "logprob_cap" not in disabled:
        from . import logprob_cap

        cap = _cap_from_env()
        if _install("logprob_cap", lambda: logprob_cap.install(cap)):
            _state["max_logprob_token_ids"] = cap
    if "backend_check" not in disabled:
        from . import backend_check

        _install("backend_check", lambda: backend_check.install(note_backends))
    _state["loaded"] = True
    log.info("djev_vllm_patch %s on vLLM %s: installed %s", PLUGIN_VERSION, version,
             ", ".join(_state["patches"]) or "nothing")


def _install(name: str, install) -> bool:
    """Install one patch; a failure is logged and leaves that patch out (status() says so) rather
    than stopping vLLM."""
    try:
        install()
    except Exception as exc:  # noqa: BLE001 - vLLM's private code moved: say which patch and why
        log.error("djev_vllm_patch: patch %s could not be installed (%s: %s); continuing without it",
                  name, type(exc).__name__, exc)
        return False
    _state["patches"].append(name)
    return True


def uninstall(name: str) -> None:
    """Undo one installed patch in this process (`canvas_window` or `logprob_cap`): for before/after
    comparisons in tests; a server uses DJEV_VLLM_PATCH_DISABLE instead."""
    if name not in ("canvas_window", "logprob_cap"):
        raise ValueError(f"cannot uninstall {name!r}: only canvas_window and logprob_cap")
    if name not in _state["patches"]:
        return
    if name == "canvas_window":
        from . import canvas_window

        canvas_window.uninstall()
    else:
        from . import logprob_cap

        logprob_cap.uninstall()
        _state["max_logprob_token_ids"] = None
    _state["patches"].remove(name)
    log.warning("djev_vllm_patch: %s uninstalled in this process", name)


def note_backends(names: list[str]) -> None:
    """Record the attention backends a DiffusionGemma model was built with (in `status()`'s
    `backends_seen`, and `unverified_backends_seen` for those the canvas window fix has not been
    verified on) and warn once about each unverified one. The `backend_check` patch calls it as
    each model is built."""
    verified = set(VERIFIED_WINDOW_BACKENDS) if "canvas_window" in _state["patches"] else set()
    log.info("djev_vllm_patch %s: DiffusionGemma's sliding-window layers run on %s", PLUGIN_VERSION,
             ", ".join(names) or "no backend")
    for name in names:
        if name not in _state["backends_seen"]:
            _state["backends_seen"].append(name)
        if name not in verified and name not in _state["unverified_backends_seen"]:
            _state["unverified_backends_seen"].append(name)
            log.warning(
                "djev_vllm_patch: attention backend %s is not verified for DiffusionGemma canvas "
                "reads: where prompt + canvas is longer than the sliding window, vLLM applies the "
                "window per canvas position and its slot probabilities differ from transformers' "
                "(verified: %s).", name, ", ".join(sorted(verified)) or "none")
