"""Attention by segment over the flat batch: the CPU reference (`ReferenceAttention`) and the Triton
kernel's backend on CUDA (`SegmentAttention`, checked against the reference in Triton's interpreter).

Each segment's queries read the keys its `KeySpan` names: its sequence's stored positions (gathered
from the KV blocks), and for a canvas its own new keys after them, under the mask of its kind (causal,
with the window on a sliding layer, for a prompt segment; none for a canvas). torch's SDPA runs each
segment on its own, its query heads sharing their KV heads (`enable_gqa`): the arithmetic of the
reads it replaces, one segment at a time. The masks and spans are worked out once a turn (`plan`),
not once a layer.

`SegmentAttention` runs every segment of a layer in one launch of app/engine/hf/segment_kernel.py's
kernel: its plan is the segments' numbers, their work items and their block tables as int32 tensors
on the device, built once a turn from the same `key_span`s. It reads image blocks causally (the
reference's default); the bidirectional switch keeps the CPU reference.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import torch
import torch.nn.functional as F

from app.engine.hf.layout import KeySpan, Placed, TurnLayout, key_span

if TYPE_CHECKING:
    from app.engine.hf.blocks import KVStore, SequenceKV


@dataclass(frozen=True)
class SegmentPlan:
    """One segment's attention on one kind of layer: its queries' rows, the keys it reads (their slots
    in that kind's pool), its mask."""

    placed: Placed
    span: KeySpan
    slots: torch.Tensor  # the stored keys' slots, `span.start` to `span.end`
    mask: torch.Tensor | None  # [queries, keys] bool; None: every query sees every key


@dataclass(frozen=True)
class AttentionPlan:
    """A turn's attention metadata, by kind of layer (sliding or not)."""

    layout: TurnLayout
    sequences: Sequence[SequenceKV]
    by_kind: dict[bool, list[SegmentPlan]]


class ReferenceAttention:
    """SDPA per segment on the CPU (or any device), reading the stored keys at the plan's slots:
    `plan` once a turn, then `attend` once a layer."""

    def __init__(self, store: KVStore, window: int, *, bidirectional_images: bool = False) -> None:
        self.store = store
        self.window = window
        self.bidirectional_images = bidirectional_images

    def plan(self, layout: TurnLayout, sequences: Sequence[SequenceKV], device: torch.device | str) -> AttentionPlan:
        """Spans, slots and masks for every segment, once a turn."""
        by_kind: dict[bool, list[SegmentPlan]] = {}
        for sliding in (False, True):
            by_kind[sliding] = [self._segment_plan(item, sequences[item.segment.sequence], sliding, device)
                                for item in layout.placed]
        return AttentionPlan(layout, sequences, by_kind)

    def _segment_plan(self, item: Placed, sequence: SequenceKV, sliding: bool, device: torch.device | str) -> SegmentPlan:
        segment = item.segment
        span = key_span(segment, sliding, self.window)
        where = self.store.sliding_slots if sliding else self.store.full_slots
        slots = where(sequence, span.start, span.end)
        if not span.causal:
            return SegmentPlan(item, span, slots, None)
        queries = torch.arange(segment.position, segment.position + segment.tokens, device=device).unsqueeze(1)
        keys = torch.arange(span.start, span.end, device=device).unsqueeze(0)
        mask = keys <= queries
        if span.window is not None:
            mask &= keys > queries - span.window
        if self.bidirectional_images:
            for start, end in segment.images:  # every soft token of an image sees the whole image
                first, last = segment.position + start, segment.position + end
                block = (queries >= first) & (queries < last) & (keys >= first) & (keys < last)
                mask |= block
        return SegmentPlan(item, span, slots, mask)

    def attend(self, layer: int, sliding: bool, scaling: float, queries: torch.Tensor, keys: torch.Tensor,
               values: torch.Tensor, plan: AttentionPlan, out: torch.Tensor | None = None) -> torch.Tensor:
        """The layer's attention output [tokens, heads, head_dim] for queries [heads, tokens, head_dim]
        and the turn's new keys and values [kv heads, tokens, head_dim] (a prompt segment's are in the
        store already; a canvas's are read from here). Rows past the layout's tokens (a graph's
        padding) are not read; `out`, where given, gets the layout's rows written and is returned."""
        if out is None:
            out = queries.new_empty(queries.shape[1], queries.shape[0], queries.shape[2])
        for segment_plan in plan.by_kind[sliding]:
            item, span = segment_plan.placed, segment_plan.span
            stored_keys, stored_values = self.store.read(layer, segment_plan.slots)
            k = stored_keys.transpose(0, 1)  # [kv heads, keys, dim]
            v = stored_values.transpose(0, 1)
            if span.own:
                k = torch.cat([k, keys[:, item.start:item.end]], dim=1)
                v = torch.cat([v, values[:, item.start:item.end]], dim=1)
            q = queries[:, item.start:item.end]
            result = F.scaled_dot_product_attention(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0),
                                                    attn_mask=segment_plan.mask, scale=scaling, enable_gqa=True)
            out[item.start:item.end] = result[0].transpose(0, 1)
        return out


# The kernel metadata's parts start at multiples of this many int32 (`SegmentAttention.plan`).
ALIGN = 16


@dataclass(frozen=True)
class KernelPlan:
    """A turn's metadata for the segment kernel, by kind of layer (sliding or not): the segments'
    numbers [segments, SEGMENT_FIELDS], the work items [items, 2] and the block table, int32 on the
    device."""

    layout: TurnLayout
    by_kind: dict[bool, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    tiles: dict[bool, tuple[int, int, int, int, int]]  # by kind of layer: the tile the items are cut for


def kernel_metadata(layout: TurnLayout, sequences: Sequence[SequenceKV], sliding: bool, window: int,
                    block_tokens: int, block_m: int) -> tuple[list[list[int]], list[list[int]], list[int]]:
    """The segment kernel's metadata for one kind of layer as lists: per segment its row of
    kernel.SEGMENT_FIELDS numbers, the work items (segment, first query row: `block_m` rows a program),
    and the block table every segment's row points into. Pure: the sequences' block lists are read,
    nothing is allocated."""
    segments: list[list[int]] = []
    items: list[list[int]] = []
    table: list[int] = []
    for number, item in enumerate(layout.placed):
        segment = item.segment
        span = key_span(segment, sliding, window)
        sequence = sequences[segment.sequence]
        first = span.start // block_tokens
        blocks = (sequence.sliding if sliding else sequence.full)[first:-(-span.end // block_tokens)]
        if None in blocks:
            raise ValueError(f"segment {number}: positions [{span.start}, {span.end}) reach released sliding blocks")
        own = (item.start, item.end) if span.own else (0, 0)
        # The column order is kernel.py's: Q_START, Q_END, POSITION, KEY_START, KEY_END, OWN_START,
        # OWN_END, WINDOW, TABLE, FIRST_BLOCK.
        segments.append([item.start, item.end, segment.position, span.start, span.end, *own, span.window or 0,
                         len(table), first])
        table.extend(block for block in blocks if block is not None)
        items.extend([number, row] for row in range(item.start, item.end, block_m))
    return segments, items, table


class SegmentAttention:
    """Every segment of a layer in one launch of the Triton kernel (CUDA; the CPU tests run it in
    Triton's interpreter): `plan` once a turn, then `attend` once a layer, as `ReferenceAttention`."""

    def __init__(self, store: KVStore, window: int) -> None:
        from app.engine.hf import segment_kernel as kernel

        self.kernel = kernel
        self.store = store
        self.window = window
        shapes = {shape.sliding: shape.head_dim for shape in store.layers}
        dtype = store.pool_tensors(0)[0].dtype
        # by (sliding, long): a turn with a segment of kernel.LONG_ROWS query rows or more takes the long tiles
        self.tiles = {(sliding, long): kernel.tile_for(dim, dtype, long) for sliding, dim in shapes.items()
                      for long in (False, True)}

    def plan(self, layout: TurnLayout, sequences: Sequence[SequenceKV], device: torch.device | str) -> KernelPlan:
        """The kernel's metadata for each kind of layer, in one copy to the device, its work items cut
        for the turn's tiles (the long ones where a segment has LONG_ROWS query rows or more)."""
        long = any(item.end - item.start >= self.kernel.LONG_ROWS for item in layout.placed)
        tiles = {sliding: tile for (sliding, is_long), tile in self.tiles.items() if is_long == long}
        lists: dict[bool, tuple[list[list[int]], list[list[int]], list[int]]] = {
            sliding: kernel_metadata(layout, sequences, sliding, self.window, self.store.block_tokens, tile[0])
            for sliding, tile in tiles.items()}
        flat: list[int] = []
        sizes: list[tuple[int, int, int]] = []
        for segments, items, table in lists.values():
            for values in ([value for row in segments for value in row], [value for row in items for value in row],
                           table):
                # Each part starts 64 bytes in: Triton specialises a pointer on its 16-byte alignment,
                # and a part at an odd offset would compile the kernel again (after `ready`).
                flat += values + [0] * (-len(values) % ALIGN)
            sizes.append((len(segments), len(items), len(table)))
        data = torch.tensor(flat, dtype=torch.int32).to(device, non_blocking=True)
        by_kind = {}
        offset = 0
        for sliding, (segments, items, table) in zip(lists, sizes):
            parts = []
            for count, width in ((segments, self.kernel.SEGMENT_FIELDS), (items, 2), (table, 1)):
                parts.append(data[offset:offset + count * width].view(count, width) if width > 1
                             else data[offset:offset + count])
                offset += count * width + (-(count * width) % ALIGN)
            by_kind[sliding] = (parts[0], parts[1], parts[2])
        return KernelPlan(layout, by_kind, tiles)

    def attend(self, layer: int, sliding: bool, scaling: float, queries: torch.Tensor, keys: torch.Tensor,
               values: torch.Tensor, plan: KernelPlan, out: torch.Tensor | None = None) -> torch.Tensor:
        """As `ReferenceAttention.attend`, in one kernel launch."""
        if out is None:
            out = queries.new_empty(queries.shape[1], queries.shape[0], queries.shape[2])
        key_pool, value_pool = self.store.pool_tensors(layer)
        segments, items, table = plan.by_kind[sliding]
        return self.kernel.segment_attention(queries, keys, values, key_pool, value_pool, out, segments, items, table,
                                             scaling, block_tokens=self.store.block_tokens, tile=plan.tiles[sliding])
