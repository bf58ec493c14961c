"""How the KV store's bytes are split between its two pools, and the longest state that split holds.
Pure: block sizes in, block counts out.

A short prompt needs as many blocks in each pool (every position has its full and its sliding KV
while it is written). A long state needs every full block but only a window of sliding ones
(`KVStore.sliding_bound`): 110k tokens of the full-size model take ~6,900 full blocks (2.1 GiB) and
~200 sliding ones. So the full pool holds as many blocks as the sliding pool plus one longest state's
full blocks: short prompts can use every sliding block, and the longest state still finds its full
blocks. Where the store is too small for the longest state asked for, the limit comes down to what
it holds beside `floor_blocks` sliding blocks (a long state's window and a turn of other work).
"""

from __future__ import annotations

from dataclasses import dataclass

GiB = 2**30


@dataclass(frozen=True)
class StorePlan:
    """The pools' sizes in blocks, and the longest state (prompt tokens) the store reads."""

    full_blocks: int
    sliding_blocks: int
    full_block_bytes: int
    sliding_block_bytes: int
    block_tokens: int
    max_prompt_tokens: int
    wanted_prompt_tokens: int  # what the settings asked (MAX_PROMPT_TOKENS, or the device's default)

    @property
    def full_bytes(self) -> int:
        return self.full_blocks * self.full_block_bytes

    @property
    def sliding_bytes(self) -> int:
        return self.sliding_blocks * self.sliding_block_bytes

    @property
    def short_tokens(self) -> int:
        """Tokens of short prompts (each needing a block of each pool) the store holds at once."""
        blocks = self.sliding_blocks if self.sliding_block_bytes else self.full_blocks
        return blocks * self.block_tokens

    def line(self) -> str:
        """The start-up log's line."""
        limited = (f" (not {self.wanted_prompt_tokens}: the store holds no more beside a turn's work)"
                   if self.max_prompt_tokens < self.wanted_prompt_tokens else "")
        return (f"KV store {(self.full_bytes + self.sliding_bytes) / GiB:.1f} GiB: {self.full_blocks} full-attention "
                f"blocks ({self.full_bytes / GiB:.1f} GiB) and {self.sliding_blocks} sliding ones "
                f"({self.sliding_bytes / GiB:.1f} GiB) of {self.block_tokens} tokens; {self.short_tokens} tokens of "
                f"short prompts at once; states up to {self.max_prompt_tokens} tokens{limited}")


def floor_blocks(budget: int, window: int, block_tokens: int) -> int:
    """The fewest blocks of each pool the store keeps: a turn's work (a long state's chunk, or short
    prompts) beside a long state's window."""
    return -(-(budget + window) // block_tokens) + 1


def plan_store(store_bytes: int, full_block_bytes: int, sliding_block_bytes: int, *, block_tokens: int,
               window: int, budget: int, wanted_prompt_tokens: int) -> StorePlan:
    """Split `store_bytes` (see the module): the full pool gets the sliding pool's blocks plus one
    longest state's, the longest state being `wanted_prompt_tokens` where the store holds it beside
    `floor_blocks` blocks of each pool, else what it holds beside them (ValueError where it cannot
    hold the floor itself)."""
    if block_tokens < 1 or (full_block_bytes <= 0 and sliding_block_bytes <= 0):
        raise ValueError("a KV store plan needs a block of at least one token and one kind of layer")
    floor = floor_blocks(budget, window, block_tokens)
    pair = full_block_bytes + sliding_block_bytes  # a block of each pool: what a short prompt's block takes
    if floor * pair > store_bytes:
        raise ValueError(f"a KV store of {store_bytes / GiB:.2f} GiB cannot hold {floor} blocks of each pool "
                         f"({floor * pair / GiB:.2f} GiB: a turn's work beside a long state's window); give "
                         f"PROMPT_CACHE_GB more")
    if not full_block_bytes:  # sliding layers alone: a state of any length holds a window
        blocks = store_bytes // sliding_block_bytes
        return StorePlan(0, blocks, 0, sliding_block_bytes, block_tokens, wanted_prompt_tokens,
                         wanted_prompt_tokens)
    long_blocks = -(-wanted_prompt_tokens // block_tokens)
    if long_blocks * full_block_bytes + floor * pair > store_bytes:  # the longest state asked does not fit
        long_blocks = (store_bytes - floor * pair) // full_block_bytes
    sliding = (store_bytes - long_blocks * full_block_bytes) // pair if sliding_block_bytes else 0
    full = (store_bytes - sliding * sliding_block_bytes) // full_block_bytes
    longest = min(wanted_prompt_tokens, long_blocks * block_tokens)
    return StorePlan(full, sliding, full_block_bytes, sliding_block_bytes, block_tokens, longest,
                     wanted_prompt_tokens)


# Camera sessions may fill at most this share of the store's short-prompt tokens with their frames; the
# rest is the other reads'.
CAMERA_STORE_SHARE = 0.5


def camera_sessions(short_tokens: int, frame_tokens: int, share: float = CAMERA_STORE_SHARE) -> int:
    """The camera sessions a store of `short_tokens` tokens of short prompts holds (`StorePlan.short_tokens`):
    a session has one decision in flight, whose prompt (a frame's image and its instructions) takes
    `frame_tokens` of the store; sessions take at most `share` of it. At least one."""
    if frame_tokens < 1:
        raise ValueError(f"a camera frame's prompt takes at least one token, not {frame_tokens}")
    return max(1, int(short_tokens * share) // frame_tokens)
