"""The flat turn's piecewise graphs by token count: which token counts get graphs, which one a turn
runs in, and how the set is reported. Pure: no torch, no model (the pieces themselves are run by
`PiecewiseForward`, app/engine/hf/forward.py).

A turn's forward is the same sequence of kernels for every turn of a token count, but for the
attention, whose work depends on the segments and on what each reads from the KV store. So the
forward is cut at every attention: piece 0 is layer 0's pre-attention, piece i the post-attention
of layer i - 1 and the pre-attention of layer i, the last piece the post-attention of the last
layer. The pieces are captured once per token-count bucket (a turn's tokens padded up to the
smallest bucket that holds them), and the attention runs eagerly between them. A turn past the
largest bucket runs the plain eager forward, counted as a fallback.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Sequence

SMALLEST_BUCKET = 16  # a canvas or a short prompt tail: fewer tokens cost about the same
DOUBLING_UNTIL = 512  # buckets double up to here, then step by half again (see `token_buckets`)


def token_buckets(budget: int) -> tuple[int, ...]:
    """The token counts the pieces are captured for, ascending, the turn's budget (TURN_TOKENS) last.

    16, 32, ..., 512 doubling, then 768, 1024, 1536, 2048, 3072, ...: up to about 512 tokens a layer
    costs about what reading its weights costs (128 experts x top-8 give 32 token-expert pairs an
    expert at 512 tokens: each expert's weights are read whatever the count), so padding a turn up to
    twice its tokens is nearly free there. Past it the projections and experts grow with the tokens,
    and doubling would pay for up to twice a turn's work; steps of x1.5 (two per doubling) hold a
    padded turn to at most 1.5x its tokens for two sets of graphs per doubling (14 buckets for a
    budget of 8192, 10 for 2048)."""
    if budget < 1:
        raise ValueError(f"a turn's budget is at least 1 token, not {budget}")
    buckets: list[int] = []
    size = SMALLEST_BUCKET
    while size < budget:
        buckets.append(size)
        if size < DOUBLING_UNTIL:
            size *= 2
        elif size & (size - 1) == 0:  # a power of two: half again
            size += size // 2
        else:  # 3 x 2^k: on to 2^(k+2)
            size = size // 3 * 4
    buckets.append(budget)
    return tuple(buckets)


def bucket_for(tokens: int, buckets: Sequence[int]) -> int | None:
    """The smallest bucket that holds `tokens` (ascending `buckets`); None past the largest: that
    turn runs eagerly."""
    index = bisect.bisect_left(buckets, tokens)
    return buckets[index] if index < len(buckets) else None


@dataclass(frozen=True)
class PiecewiseConfig:
    """How the flat forward runs its pieces: the token-count buckets, and whether they are captured
    as CUDA graphs (False: the same static buffers, padding and pieces, run eagerly: the CPU tests)."""

    buckets: tuple[int, ...]
    capture: bool

    def __post_init__(self) -> None:
        if not self.buckets or list(self.buckets) != sorted(set(self.buckets)) or self.buckets[0] < 1:
            raise ValueError(f"buckets are distinct positive token counts in ascending order, not {self.buckets}")

    @classmethod
    def for_budget(cls, budget: int, capture: bool) -> PiecewiseConfig:
        return cls(token_buckets(budget), capture)


@dataclass(frozen=True)
class GraphReport:
    """What the piecewise graphs hold once captured (`PiecewiseForward.report`)."""

    buckets: tuple[int, ...]  # the token counts held, ascending
    pieces: int  # pieces a bucket (layers + 1)
    graphs: int  # CUDA graphs held (0 where the pieces run eagerly)
    memory_bytes: int  # device memory the graphs' pool (and their capture) holds; 0 without capture
    buffer_bytes: int  # the static buffers the pieces read and write, sized for the largest bucket
    seconds: float  # what capturing them all took
    failed: tuple[int, ...] = ()  # buckets whose capture failed: their turns run eagerly

    def line(self) -> str:
        """The start-up log's line, e.g. "flat graphs: 10 buckets × 31 pieces = 310 graphs, 1.2 GiB
        (+ 420 MiB buffers), 8.3 s"."""
        count = f"{len(self.buckets)} buckets × {self.pieces} pieces"
        failed = f", {len(self.failed)} failed" if self.failed else ""
        if not self.graphs:
            return (f"flat pieces: {count}, run eagerly (not captured), {human_bytes(self.buffer_bytes)} buffers"
                    f"{failed}, {self.seconds:.1f} s")
        return (f"flat graphs: {count} = {self.graphs} graphs, {human_bytes(self.memory_bytes)} "
                f"(+ {human_bytes(self.buffer_bytes)} buffers){failed}, {self.seconds:.1f} s")


def human_bytes(count: int) -> str:
    """Bytes in GiB from 1 GiB up, else in MiB."""
    if count >= 1 << 30:
        return f"{count / (1 << 30):.1f} GiB"
    return f"{count / (1 << 20):.0f} MiB"
