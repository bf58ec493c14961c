"""One engine turn of the flat engine: the parts the programs ask for, laid out end to end, through one
forward; each part's hidden states back to its program.

A `Part` is a segment with its sequence and its inputs. The turn numbers the sequences, lays the
segments out (`TurnLayout`), puts the token ids, the embeddings given whole and the self-conditioning
logits where the forward finds them, runs the forward, marks the prompt segments' KV written, and
splits the hidden states at the logit rows by part.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

import torch

from app.engine.hf.forward import TurnInputs
from app.engine.hf.layout import Kind, Segment, TurnLayout

if TYPE_CHECKING:
    from app.engine.hf.blocks import KVStore, SequenceKV
    from app.engine.hf.forward import FlatForward


@dataclass(eq=False)
class Part:
    """One segment a program asks a turn for, with what the forward needs to run it."""

    kind: Kind
    sequence: SequenceKV
    position: int  # the sequence position of its first token (a canvas: its prompt's length)
    ids: Sequence[int]
    images: tuple[tuple[int, int], ...] = ()  # image blocks, offsets within the part
    logits: tuple[int, ...] = ()  # offsets whose hidden states come back
    embeds: torch.Tensor | None = None  # [tokens, hidden] given whole (an image prompt's chunk)
    source: object = field(default=None, repr=False)  # the prompt whose image tokens it holds (a PromptState)
    conditioning: torch.Tensor | None = None  # [tokens, vocab] a canvas's self-conditioning logits
    hidden: torch.Tensor | None = field(default=None, repr=False)  # [len(logits), hidden], after the turn

    @property
    def tokens(self) -> int:
        return len(self.ids)


class FlatTurn:
    """Runs a list of parts as one forward (`run`)."""

    def __init__(self, forward: FlatForward, store: KVStore, device: torch.device) -> None:
        self.forward = forward
        self.store = store
        self.device = device

    def run(self, parts: Sequence[Part]) -> None:
        """One forward over `parts`, in order; each part's `hidden` set to its logit rows' states."""
        numbers: dict[int, int] = {}
        sequences: list[SequenceKV] = []
        segments = []
        for part in parts:
            number = numbers.setdefault(id(part.sequence), len(sequences))
            if number == len(sequences):
                sequences.append(part.sequence)
            segments.append(Segment(part.kind, number, part.tokens, part.position, part.images, part.logits,
                                    conditioned=part.conditioning is not None))
        layout = TurnLayout.of(segments)
        ids = torch.tensor([token for part in parts for token in part.ids], dtype=torch.long, device=self.device)
        inputs = TurnInputs(ids)
        for item, part in zip(layout.placed, parts):
            if part.images and part.embeds is None:
                raise ValueError("a part holding image tokens is given its embeddings (`embed_images`) first")
            if part.embeds is not None:
                inputs.embeds.append((item.start, part.embeds))
            if part.conditioning is not None:
                inputs.conditioning.append((item.start, part.conditioning))
        hidden = self.forward(layout, sequences, inputs)
        offset = 0
        for part, count in zip(parts, layout.logit_counts()):
            part.hidden = hidden[offset:offset + count]
            offset += count
        for part in parts:
            if part.kind is Kind.PROMPT:
                self.store.mark_written(part.sequence, part.position + part.tokens)
