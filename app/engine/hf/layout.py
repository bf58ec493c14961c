"""A turn's work as one flat sequence of tokens in segments: what the forward computes and what each
token's attention reads. Pure: no torch, no model.

Every new token of a turn is in exactly one segment, and the segments lie end to end in the flat
batch (T tokens in all):

- A **prompt** segment is a run of a sequence's prompt tokens: a tail after its cached prefix, a
  chunk of a long prompt, a gated stage's suffix after its first stage, a generation's committed
  block. It is causal over every earlier position of its sequence and over itself, and writes its
  KV into the sequence's blocks. On a sliding layer a token at position p sees the keys at positions
  above p − W (W: the sliding window).
- A **canvas** segment is one canvas read over a sequence: bidirectional over itself and over every
  position of its sequence before it (the prompt, which may have been written by a prompt segment
  earlier in the same turn), and on a sliding layer over the prompt's last W − 1 positions plus the
  whole canvas (transformers' rule: its sliding cache holds W − 1 positions; the reference semantics,
  not vLLM's symmetric window). It writes nothing: canvas KV is never kept.
- An **image block** is a run of a prompt segment's tokens (an image's soft tokens) that is never
  split across segments, so a chunk or a turn never ends inside an image. transformers 5.23's encoder
  reads them causally (it builds the vision blocks' mask and drops it), so that is the reference and
  the default; `bidirectional images` in the attention backend reads each block bidirectionally.

A segment names the logits it wants (`logits`: offsets within it): a read's slots, or the whole
canvas where a multi-step read or a generation needs them. Their rows in the forward's output follow
the segments' order (`logit_rows`).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Sequence


class Kind(str, Enum):
    PROMPT = "prompt"
    CANVAS = "canvas"


@dataclass(frozen=True)
class Segment:
    """A run of one sequence's new tokens in a turn."""

    kind: Kind
    sequence: int  # which of the turn's sequences it reads (and a prompt segment writes)
    tokens: int
    position: int  # the sequence position of its first token (a canvas: its prompt's length)
    images: tuple[tuple[int, int], ...] = ()  # image blocks as (start, end) offsets within the segment
    logits: tuple[int, ...] = ()  # offsets within the segment whose logits the turn returns
    conditioned: bool = False  # a canvas that reads a self-conditioning signal (a step after the first)

    def problems(self) -> list[str]:
        """What makes this segment malformed (empty when it is well formed)."""
        problems = []
        if self.tokens < 1:
            problems.append("a segment holds at least one token")
        if self.position < 0 or self.sequence < 0:
            problems.append("positions and sequence indices are at least 0")
        if self.kind is Kind.CANVAS and self.images:
            problems.append("a canvas holds no image")
        if self.kind is Kind.PROMPT and self.conditioned:
            problems.append("only a canvas is self-conditioned")
        last = 0
        for start, end in self.images:
            if not last <= start < end <= self.tokens:
                problems.append(f"image block {(start, end)} is not inside the segment in order")
            last = end
        if any(not 0 <= offset < self.tokens for offset in self.logits):
            problems.append("logit offsets are inside the segment")
        return problems


@dataclass(frozen=True)
class Placed:
    """A segment at its place in the flat batch: tokens [start, start + segment.tokens)."""

    segment: Segment
    start: int

    @property
    def end(self) -> int:
        return self.start + self.segment.tokens


@dataclass(frozen=True)
class KeySpan:
    """What one segment's attention reads on one kind of layer: the stored positions [start, end) of its
    sequence (for a prompt segment, its own tokens included: they are written before attention runs),
    and, for a canvas, its own new keys after them."""

    start: int
    end: int
    own: bool  # a canvas: its own keys follow the stored ones
    causal: bool  # a prompt: a query sees no later position
    window: int | None  # a prompt on a sliding layer: a query sees positions above its own minus this


def key_span(segment: Segment, sliding: bool, window: int) -> KeySpan:
    """The keys a segment's attention reads on a sliding (`sliding`) or full-attention layer."""
    if segment.kind is Kind.CANVAS:
        start = max(0, segment.position - (window - 1)) if sliding else 0
        return KeySpan(start, segment.position, own=True, causal=False, window=None)
    end = segment.position + segment.tokens
    start = max(0, segment.position - (window - 1)) if sliding else 0
    return KeySpan(start, end, own=False, causal=True, window=window if sliding else None)


@dataclass(frozen=True)
class TurnLayout:
    """The turn's segments, end to end."""

    placed: tuple[Placed, ...]
    tokens: int

    @classmethod
    def of(cls, segments: Sequence[Segment]) -> TurnLayout:
        """The segments in order, end to end; ValueError for a malformed one, or for prompt segments of
        one sequence that are not in position order without gaps (a turn writes a sequence's prompt
        left to right)."""
        placed: list[Placed] = []
        start = 0
        written: dict[int, int] = {}  # sequence -> the position after its last prompt segment so far
        for index, segment in enumerate(segments):
            problems = segment.problems()
            if problems:
                raise ValueError(f"segment {index}: {'; '.join(problems)}")
            if segment.kind is Kind.PROMPT:
                expected = written.get(segment.sequence)
                if expected is not None and segment.position != expected:
                    raise ValueError(f"segment {index}: sequence {segment.sequence}'s prompt segments are not "
                                     f"contiguous ({segment.position}, expected {expected})")
                written[segment.sequence] = segment.position + segment.tokens
            elif segment.sequence in written and segment.position < written[segment.sequence]:
                raise ValueError(f"segment {index}: a canvas over sequence {segment.sequence} ahead of its prompt's "
                                 f"end ({segment.position} < {written[segment.sequence]})")
            placed.append(Placed(segment, start))
            start += segment.tokens
        if not placed:
            raise ValueError("a turn holds at least one segment")
        return cls(tuple(placed), start)

    def positions(self) -> list[int]:
        """Each token's position in its sequence (what the rotary embedding reads)."""
        return [item.segment.position + offset for item in self.placed for offset in range(item.segment.tokens)]

    def canvas_tokens(self) -> list[bool]:
        """Whether each token is a canvas token (the decoder's embedding, self-conditioning and layer
        scalars) or a prompt token (the encoder's)."""
        return [item.segment.kind is Kind.CANVAS for item in self.placed for _ in range(item.segment.tokens)]

    def prompt_runs(self) -> list[Placed]:
        """The prompt segments: the tokens whose KV the turn writes."""
        return [item for item in self.placed if item.segment.kind is Kind.PROMPT]

    def logit_rows(self) -> list[int]:
        """The flat indices of the tokens whose logits the turn returns, segment by segment."""
        return [item.start + offset for item in self.placed for offset in item.segment.logits]

    def logit_counts(self) -> list[int]:
        """How many logit rows each segment owns, in order (to split the forward's output)."""
        return [len(item.segment.logits) for item in self.placed]
