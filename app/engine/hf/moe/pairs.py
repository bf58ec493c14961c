"""What every experts kernel of djev shares (the bf16 ones in app/engine/hf/moe/fused.py, the FP8
ones in app/engine/hf/moe/fp8.py): the token-expert pairs aligned by expert in blocks, the tiles'
shape and how a tile is picked, and the weighted top-k sum of the pairs' rows. Plain torch."""

from __future__ import annotations

from dataclasses import dataclass

import torch

ACTIVATIONS = ("gelu_pytorch_tanh",)  # what the kernels compute (Gemma 4's experts)


@dataclass(frozen=True)
class BlockConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


Tiles = tuple[tuple[int, BlockConfig], ...]  # (most pairs an expert on average, the tiles up to there)


def pick_tiles(pairs: int, experts: int, tiles: Tiles, large: BlockConfig) -> BlockConfig:
    """The first of `tiles` whose limit holds the pairs an expert gets on average, else `large`."""
    per_expert = pairs / max(1, experts)
    for limit, config in tiles:
        if per_expert <= limit:
            return config
    return large


def both_tiles(chosen: BlockConfig, down: BlockConfig | None, down_tiles: dict[BlockConfig, BlockConfig]
               ) -> tuple[BlockConfig, BlockConfig]:
    """(gate/up tiles, down tiles): `down` where given, else the down kernel's own for `chosen`
    (`down_tiles`), else the same; ValueError where their block_m differ."""
    down = down or down_tiles.get(chosen, chosen)
    if down.block_m != chosen.block_m:
        raise ValueError("both kernels read the same blocks of pairs: block_m must match")
    return chosen, down


def align(top_k_index: torch.Tensor, experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(pairs, block_experts): the pair ids (token x top_k + slot) sorted by expert (stable), each
    expert's run padded to a multiple of `block_m` with the sentinel tokens x top_k; and each block
    of `block_m` entries' expert, or `experts` for the blocks past the last run (the kernels skip
    them). Sizes depend only on the shapes: no host sync."""
    flat = top_k_index.reshape(-1)
    total = flat.numel()
    device = flat.device
    counts = torch.zeros(experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_ends = torch.cumsum(padded, 0)
    padded_starts = padded_ends - padded
    starts = torch.cumsum(counts, 0) - counts
    order = torch.argsort(flat, stable=True)
    expert_of = flat[order]
    rank = torch.arange(total, device=device) - starts[expert_of]
    capacity = -(-(total + experts * (block_m - 1)) // block_m) * block_m
    pairs = torch.full((capacity,), total, dtype=torch.int32, device=device)
    pairs[padded_starts[expert_of] + rank] = order.to(torch.int32)
    block_starts = torch.arange(0, capacity, block_m, device=device)
    block_experts = torch.searchsorted(padded_ends, block_starts, right=True)
    return pairs, block_experts


def weighted_sum(rows: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
    """Each token's top-k expert rows ([tokens x top_k, hidden], in the pairs' order) times their
    routing weights, summed in fp32 slot by slot and rounded once to the rows' dtype."""
    tokens, top_k = top_k_weights.shape
    rows = rows.view(tokens, top_k, -1)
    weights = top_k_weights.to(torch.float32).unsqueeze(-1)
    total = rows[:, 0].to(torch.float32) * weights[:, 0]
    for slot in range(1, top_k):
        total = total + rows[:, slot].to(torch.float32) * weights[:, slot]
    return total.to(rows.dtype)


# Token counts whose pairs pick each tile (with 128 experts x top-8: at most 128 tokens the first
# tile, 512 the second, 1024 the third, past that the large one), each odd and even: Triton
# specialises an int argument divisible by 16 (`total` = tokens x top_k), so both variants of every
# tile are compiled.
def warm_up_tokens(experts: int, top_k: int, tiles: Tiles) -> list[int]:
    """Token counts that between them compile every tile `pick_tiles` can pick from `tiles` (and the
    large one past them), each with its pair count divisible by 16 and not (where top_k allows both)."""
    counts: list[int] = []
    for limit, _ in tiles:
        most = max(1, int(limit * experts // max(1, top_k)))  # the most tokens this tile takes
        counts += [most - 1, most] if most > 1 else [most]
    largest = int(tiles[-1][0] * experts // max(1, top_k))
    counts += [largest + 1, largest + 2]
    return sorted(set(count for count in counts if count >= 1))
