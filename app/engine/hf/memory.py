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
    cuts: tuple[str, ...] = ()  # what `plan_graphs` cut to fit the card

    def line(self) -> str:
        """The start-up log's one line."""
        held = ", ".join(f"{kind} {count}" for kind, count in self.held.items()) or "none"
        left = ", ".join(f"{kind} {count}" for kind, count in self.left_out.items())
        graphs = f"graphs {self.graphs / GiB:.1f} GiB ({held} held" + (f"; left out: {left})" if left else ")")
        limit = f"prompts up to {self.prompt_tokens} tokens" + (
            f" (not {self.prompt_wanted}: the free memory)" if self.prompt_forced else "")
        cut = f"; cut to fit: {'; '.join(self.cuts)}" if self.cuts else ""
        return (f"GPU memory {self.total / GiB:.1f} GiB: weights {self.weights / GiB:.1f} GiB, {graphs}, {limit}, "
                f"{self.free / GiB:.1f} GiB free{cut}")

    def forced(self) -> str | None:
        """Why this card serves less than the defaults (for `/health`'s `degraded`), or None."""
        reasons = []
        if self.prompt_forced:
            reasons.append(f"prompts up to {self.prompt_tokens} tokens, not {self.prompt_wanted}")
        left = sum(self.left_out.values())
        if left:
            reasons.append(f"{left} CUDA graph(s) left out, their passes run eagerly (slower)")
        reasons.extend(self.cuts)
        if not reasons:
            return None
        return f"the GPU's {self.total / GiB:.0f} GiB forced " + " and ".join(reasons)


# What the graphs' captures add beside their static buffers (their pools: about 2 GiB for the whole
# set on the H200, 21.3 GiB in all with 19.25 GiB of buffers).
CAPTURE_BYTES = 2 * GiB
# The graphs' static buffers are halved down to these tokens at the least.
MIN_DECODER_SLOTS = 8 * 1024
MIN_ENCODER_SLOTS = 4 * 1024


@dataclass(frozen=True)
class GraphPlan:
    """How the memory left after the weights is shared: the graphs' static buffers (in tokens of KV,
    the decoder's and the encoder's) and the prompt cache's bytes, and what the card cut."""

    decoder_slots: int
    encoder_slots: int
    prompt_cache_bytes: int
    cuts: tuple[str, ...] = ()


def plan_graphs(free: int, token_bytes: int, *, decoder_slots: int, encoder_slots: int, cache_bytes: int,
                reserve: int) -> GraphPlan:
    """Fit what the hf engine keeps on the device into `free` bytes (the memory left after the
    weights): the prompt cache at most a quarter of it (`cache_bytes` 0: not bounded in bytes, as
    PROMPT_CACHE_GB=0 asks), `reserve` left for the requests' own work, the captures' pools, and
    then the graphs' static buffers (`token_bytes` of KV a token, for all layers), halved, the
    larger first, until they fit. An H200's 92 GiB after the weights keep the defaults; an 80 GB
    card's 31 GiB do not (the defaults' buffers alone are 19.25 GiB). The flat turn asks for no static
    buffers (its graphs by token count hold about 1 GiB, within the captures' allowance)."""
    cuts: list[str] = []
    cache = cache_bytes
    if cache_bytes and cache_bytes > free // 4:
        cache = free // 4
        cuts.append(f"the prompt cache to {cache / GiB:.1f} GiB (PROMPT_CACHE_GB asks {cache_bytes / GiB:.1f})")
    budget = free - reserve - cache - CAPTURE_BYTES
    decoder, encoder = decoder_slots, encoder_slots
    while (decoder + encoder) * token_bytes > budget:
        can_decoder, can_encoder = decoder // 2 >= MIN_DECODER_SLOTS, encoder // 2 >= MIN_ENCODER_SLOTS
        if can_decoder and (decoder >= 2 * encoder or not can_encoder):
            decoder //= 2
        elif can_encoder:
            encoder //= 2
        else:
            break
    if (decoder, encoder) != (decoder_slots, encoder_slots):
        cuts.append(f"the graphs' static buffers to {decoder} decoder and {encoder} encoder tokens (from "
                    f"{decoder_slots} and {encoder_slots}: the largest passes run eagerly)")
    return GraphPlan(decoder, encoder, cache, tuple(cuts))
