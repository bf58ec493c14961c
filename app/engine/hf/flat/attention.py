"""Attention by segment over the flat batch: the CPU reference every later kernel is checked against.

Each segment's queries read the keys its `KeySpan` names: its sequence's stored positions (gathered
from the KV blocks), and for a canvas its own new keys after them, under the mask of its kind (causal,
with the window on a sliding layer, for a prompt segment; none for a canvas). torch's SDPA runs each
segment on its own, its query heads sharing their KV heads (`enable_gqa`): the arithmetic of the
reads it replaces, one segment at a time. The masks and spans are worked out once a turn (`plan`),
not once a layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import torch
import torch.nn.functional as F

from app.engine.hf.flat.layout import KeySpan, Placed, TurnLayout, key_span

if TYPE_CHECKING:
    from app.engine.hf.flat.blocks import KVStore, SequenceKV


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
                 values: torch.Tensor, plan: AttentionPlan) -> torch.Tensor:
        """The layer's attention output [tokens, heads, head_dim] for queries [heads, tokens, head_dim]
        and the turn's new keys and values [kv heads, tokens, head_dim] (a prompt segment's are in the
        store already; a canvas's are read from here)."""
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
