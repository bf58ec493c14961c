"""How the hf engine split the GPU's memory at start: the weights, the graphs, the KV store, the
longest state, what is left free. Logged once before `ready`. The split itself is pure; `unique_bytes`
reads a module's tensors."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

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
    """The device's memory after start-up, in bytes, and the longest state the KV store holds."""

    total: int
    free: int
    weights: int
    graphs: int  # the graphs' pools and static buffers
    store: int  # the KV store's pools
    prompt_tokens: int  # the longest state read

    def line(self) -> str:
        """The start-up log's one line."""
        return (f"GPU memory {self.total / GiB:.1f} GiB: weights {self.weights / GiB:.1f} GiB, graphs "
                f"{self.graphs / GiB:.1f} GiB, KV store {self.store / GiB:.1f} GiB (states up to {self.prompt_tokens} "
                f"tokens), {self.free / GiB:.1f} GiB free")
