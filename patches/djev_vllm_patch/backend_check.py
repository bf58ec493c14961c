"""Name the attention backends a DiffusionGemma model runs on, so an unverified one is never silent.

Why: the canvas window fix (`canvas_window.py`) is installed and verified on vLLM's CPU backend
only. On any other backend (FlashAttention or Triton on a GPU box) vLLM still applies the sliding
window per canvas position, so reads whose prompt + canvas passes the window differ from
transformers'. vLLM picks the backend while it builds the model, after plugins load, so this wraps
DiffusionGemma's constructor and reports the backends of its sliding-window layers once the model
exists; `__init__.py` logs a warning naming each unverified one and records it in `status()`.

How to tell upstream no longer needs it: it goes away with `canvas_window.py`, when stock vLLM
anchors the canvas window on every backend.
"""

from __future__ import annotations

import functools
from typing import Callable

_MARK = "_djev_backend_check"


def sliding_backends(model) -> list[str]:
    """Backend names of the model's sliding-window attention layers (sorted, unique)."""
    from vllm.model_executor.layers.attention import Attention

    names = {module.attn_backend.get_name() for module in model.modules()
             if isinstance(module, Attention) and (getattr(module, "sliding_window", None) or 0) > 0}
    return sorted(names)


def install(report: Callable[[list[str]], None]) -> None:
    from vllm.model_executor.models import diffusion_gemma

    model_cls = diffusion_gemma.DiffusionGemmaForConditionalGeneration
    if getattr(model_cls, _MARK, False):
        return
    original_init = model_cls.__init__

    # vLLM inspects the constructor's signature (keyword-only `vllm_config`) to decide how to call it.
    @functools.wraps(original_init)
    def __init__(self, *, vllm_config, prefix: str = "") -> None:
        original_init(self, vllm_config=vllm_config, prefix=prefix)
        report(sliding_backends(self))

    model_cls.__init__ = __init__
    setattr(model_cls, _MARK, True)
