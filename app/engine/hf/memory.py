"""How the hf engine split the GPU's memory at start: the weights, the graphs, the longest prompt, what
is left free. Logged once before `ready`; when the card was too small for the defaults (a shorter
prompt limit, graphs left out), the same words become the reader's `degraded` reason, so `/health`
says it plainly. The split itself is pure; `unique_bytes` reads a module's tensors."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Mapping

if TYPE_CHECKING:
    from torch import nn

GiB = 2**30


def unique_bytes(module: nn.Module) -> int:
    """The bytes a module's parameters and buffers hold, each storage counted once: tied weights (the
    decoder's layers are the encoder's) are one copy in memory, not two."""
    seen: dict[int, int] = {}
    named = [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]
    for _, tensor in named:
        storage = tensor.untyped_storage()
        seen[storage.data_ptr()] = max(seen.get(storage.data_ptr(), 0), storage.nbytes())
    return sum(seen.values())


@dataclass(frozen=True)
class MemorySplit:
    """The device's memory after start-up, in bytes, and what it decided."""

    total: int
    free: int
    weights: int
    graphs: int
    prompt_tokens: int  # the longest prompt read
    prompt_wanted: int  # what the settings asked for (MAX_PROMPT_TOKENS, or the CUDA default when 0)
    prompt_forced: bool  # the free memory, not the settings, set `prompt_tokens`
    held: Mapping[str, int] = field(default_factory=dict)  # graphs held, by kind
    left_out: Mapping[str, int] = field(default_factory=dict)  # graphs left out, by kind

    def line(self) -> str:
        """The start-up log's one line."""
        held = ", ".join(f"{kind} {count}" for kind, count in self.held.items()) or "none"
        left = ", ".join(f"{kind} {count}" for kind, count in self.left_out.items())
        graphs = f"graphs {self.graphs / GiB:.1f} GiB ({held} held" + (f"; left out: {left})" if left else ")")
        limit = f"prompts up to {self.prompt_tokens} tokens" + (
            f" (not {self.prompt_wanted}: the free memory)" if self.prompt_forced else "")
        return (f"GPU memory {self.total / GiB:.1f} GiB: weights {self.weights / GiB:.1f} GiB, {graphs}, {limit}, "
                f"{self.free / GiB:.1f} GiB free")

    def forced(self) -> str | None:
        """Why this card serves less than the defaults (for `/health`'s `degraded`), or None."""
        reasons = []
        if self.prompt_forced:
            reasons.append(f"prompts up to {self.prompt_tokens} tokens, not {self.prompt_wanted}")
        left = sum(self.left_out.values())
        if left:
            reasons.append(f"{left} CUDA graph(s) left out, their passes run eagerly (slower)")
        if not reasons:
            return None
        return f"the GPU's {self.total / GiB:.0f} GiB forced " + " and ".join(reasons)
