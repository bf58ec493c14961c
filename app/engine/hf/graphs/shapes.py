"""Which shapes the hf engine runs as CUDA graphs: a bounded set decided at start from the settings'
domain (MAX_BATCH_ROWS, CANVAS, CANVAS_STEP, MAX_PROMPT_TOKENS, MAX_IMAGES), never from a workload,
and the bucket every pass is padded up to. Pure: no tensors, no model.

The set is captured before the server says `ready` (`DiffusionRunner.prepare_graphs`) and never
evicted; a pass whose shape maps to no key in it runs eagerly and is counted. Why these buckets:
docs/design.md §4.8.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

# Encoder buckets. Fine steps where batches are large (a padded token costs a token's full compute:
# at 32 rows of 300-token prompts a 512 bucket made the encoder 1.7x slower than 320 would; 160 holds
# the ticket's ~120-137 tokens after its sheet, which went to 192), coarse where prompts are long and
# batches small.
ROW_BUCKETS = (1, 2, 4, 8, 16, 32)
# Rows of a pass over a shared prefix: the served batches (a question sheet's tickets, walk frames
# over their sheet, gated stages over their frames) come in every count, and a padded row costs its
# full suffix (5.4 walk frames a turn padded to 8, 22 tickets to 32: docs/benchmarks.md), so the
# steps between the powers of two are captured too.
PREFIX_ROW_BUCKETS = (1, 2, 4, 6, 8, 12, 16, 24, 32)
LENGTH_BUCKETS = (64, 128, 160, 192, 256, 320, 384, 448, 512, 640, 768, 896, 1024, 1536, 2048, 3072, 4096)
# A shared prefix's slots ahead of the suffixes (a question sheet's system turn is 100-500 tokens;
# a longer one is encoded with each prompt, whole).
PREFIX_BUCKETS = (256, 512, 768)
# An encoder batch whose buckets hold this many tokens (rows x length) or more runs the static path
# without a graph (GPU-bound: launch overhead no longer matters), unpadded but for EAGER_STEP.
EAGER_TOKENS = 8192
EAGER_STEP = 8

# Decoder rows: the powers of two and the steps between them from 8 up (a pass of 45 tickets at 64
# clients padded to 64 rows, 8.3 walk frames to 16: a graphed pass costs about 1.15 ms a row on the
# H200), up to MAX_BATCH_ROWS, which is always a bucket.
DECODER_ROW_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64)

# Decoder KV lengths double from the first bucket: the decoder's cost is the canvas's tokens through
# the experts, and attention over padded prompt slots that the mask hides is cheap beside it.
FIRST_KV_BUCKET = 256

# Vision passes: images at once (frames of any number of camera sessions); more are split.
IMAGE_BUCKETS = (1, 2, 4, 8)

# (rows, canvas width, full-attention KV length, sliding-window KV length, self-conditioned)
DecoderKey = tuple[int, int, int, int, bool]
# (rows, suffix length, prefix slots); prefix slots are 0 without a prefix
EncoderKey = tuple[int, int, int]
# What a capture's run before recording stands for (`ShapePolicy.decoder_pieces` /
# `encoder_pieces`): keys that map to the same value share one run, and only the first of them is
# run before it is recorded (app/engine/hf/graphs/cache.py `capture`): the shape the compiled
# pieces see (rows, tokens a row, and for the decoder whether it is self-conditioned, for the
# encoder whether it runs over a prefix), so keys that differ only in the KV length attention reads
# share it. On the H200 the 204 decoder graphs captured with 32 runs and none failed; an encoder
# pass over a prefix needs a run of its own (recorded after only its shape's plain pass, the first
# one of several rows failed). One run per compiled variant instead failed (docs/design.md §4.8).
Pieces = tuple[int, int, bool]


def bucket_of(value: int, buckets: Sequence[int]) -> int | None:
    """The smallest bucket that holds `value`, or None past the largest."""
    return next((bucket for bucket in buckets if bucket >= value), None)


def doubling(first: int, last: int) -> tuple[int, ...]:
    """first, 2 first, 4 first, ... up to the first value >= last."""
    values = [first]
    while values[-1] < last:
        values.append(values[-1] * 2)
    return tuple(values)


def round_up(value: int, step: int) -> int:
    return -(-value // step) * step


@dataclass(frozen=True)
class ShapePolicy:
    """The buckets and the captured set, from the settings' domain. `decoder_slots` and
    `encoder_slots` are the shared static buffers' tokens (rows x (KV + canvas), rows x (prefix +
    suffix)); `conditioned_rows` bounds the self-conditioned decoder graphs (a generation is one
    row; a multi-step read of more canvases runs eagerly, counted)."""

    max_rows: int
    canvas: int
    canvas_step: int
    max_prompt_tokens: int
    sliding_window: int
    decoder_slots: int = 72 * 1024
    encoder_slots: int = 16 * 1024
    eager_tokens: int = EAGER_TOKENS
    conditioned_rows: int = 1
    max_images: int = 8
    # The buckets themselves (the module's constants; a test with the tiny model's 64-token window
    # gives smaller ones).
    encoder_rows: tuple[int, ...] = ROW_BUCKETS
    prefix_rows: tuple[int, ...] = PREFIX_ROW_BUCKETS
    encoder_lengths: tuple[int, ...] = LENGTH_BUCKETS
    prefix_slots: tuple[int, ...] = PREFIX_BUCKETS
    first_kv_bucket: int = FIRST_KV_BUCKET
    image_buckets: tuple[int, ...] = IMAGE_BUCKETS

    # ------------------------------------------------------------------ buckets

    @property
    def row_buckets(self) -> tuple[int, ...]:
        """DECODER_ROW_BUCKETS under MAX_BATCH_ROWS, then MAX_BATCH_ROWS itself."""
        return (*(rows for rows in DECODER_ROW_BUCKETS if rows < self.max_rows), self.max_rows)

    @property
    def width_buckets(self) -> tuple[int, ...]:
        """Canvas widths are multiples of CANVAS_STEP up to CANVAS; a pass pads to the next of
        step, 2 step, 4 step, ... and CANVAS itself (the mask keeps each canvas to its own width)."""
        widths = [width for width in doubling(self.canvas_step, self.canvas) if width < self.canvas]
        return (*widths, self.canvas)

    @property
    def kv_buckets(self) -> tuple[int, ...]:
        return doubling(self.first_kv_bucket, self.max_prompt_tokens)

    @property
    def sliding_bucket(self) -> int:
        """The bucket of a sliding-window layer's KV past the window (it keeps window - 1 tokens)."""
        bucket = bucket_of(self.sliding_window - 1, self.kv_buckets)
        return bucket if bucket is not None else self.kv_buckets[-1]

    # ------------------------------------------------------------------ decoder

    def decoder_key(self, rows: int, width: int, kv_length: int, conditioned: bool) -> DecoderKey | None:
        """The captured shape a decoder pass of `rows` canvases of at most `width` tokens over prompts
        of at most `kv_length` KV tokens (the full-attention layers') pads up to; None where none does."""
        batch = bucket_of(rows, self.row_buckets)
        padded_width = bucket_of(width, self.width_buckets)
        length = bucket_of(kv_length, self.kv_buckets)
        if batch is None or padded_width is None or length is None or rows < 1:
            return None
        key = (batch, padded_width, length, min(length, self.sliding_bucket), conditioned)
        return key if self._decoder_fits(key) else None

    def _decoder_fits(self, key: DecoderKey) -> bool:
        batch, width, length, _, conditioned = key
        if batch * (length + width) > self.decoder_slots:
            return False
        return not conditioned or batch <= self.conditioned_rows

    def decoder_keys(self) -> list[DecoderKey]:
        """Every decoder shape to capture, most used first (short prompts, few rows)."""
        keys = [(rows, width, length, min(length, self.sliding_bucket), conditioned)
                for conditioned in (False, True) for length in self.kv_buckets
                for rows in self.row_buckets for width in self.width_buckets]
        return [key for key in keys if self._decoder_fits(key)]

    def decoder_passes(self, rows: Sequence[tuple[int, int]], conditioned: bool = False,
                       graphs: bool = True) -> list[list[int]]:
        """A read's rows (each its prompt's KV length and its canvas's width) split into decoder
        passes, as indices into `rows`: shortest prompts first, at most `max_rows` rows a pass; with
        `graphs`, a pass one graph holds grows only while a graph still holds it; a pass none holds
        (rows over long prompts, no graphs at all, or `conditioned`: the self-conditioned graphs hold
        `conditioned_rows`, and one eager pass of many rows beats as many one-row replays) only while
        it stacks at most `decoder_slots` tokens (rows x (KV + width)), so no eager pass copies more KV
        than the graphs' buffers hold. Every pass has a row."""
        passes: list[list[int]] = []
        current: list[int] = []
        kv = width = 0
        for index in sorted(range(len(rows)), key=lambda i: rows[i]):
            grown_kv, grown_width = max(kv, rows[index][0]), max(width, rows[index][1])
            graphed = graphs and not conditioned and self.decoder_key(len(current), width, kv, False) is not None
            if current and not self._pass_holds(len(current) + 1, grown_kv, grown_width, conditioned, graphed):
                passes.append(current)
                current, grown_kv, grown_width = [], rows[index][0], rows[index][1]
            current.append(index)
            kv, width = grown_kv, grown_width
        if current:
            passes.append(current)
        return passes

    def _pass_holds(self, rows: int, kv: int, width: int, conditioned: bool, graphed: bool) -> bool:
        if rows > self.max_rows:
            return False
        if graphed:
            return self.decoder_key(rows, width, kv, conditioned) is not None
        return rows * (kv + width) <= self.decoder_slots

    # ------------------------------------------------------------------ encoder

    def encoder_key(self, rows: int, longest: int, prefix: int = 0) -> EncoderKey | None:
        """(rows, length, prefix slots) of the static pass for `rows` suffixes of at most `longest`
        tokens over a shared prefix of `prefix` tokens (0: none): its buckets, or, where the buckets
        hold `eager_tokens` or more, its own rows and lengths rounded to EAGER_STEP (run without a
        graph); None past the caps, and for a prefix whose pass would not fit the sliding window."""
        if rows < 1 or longest < 1:
            return None
        batch = bucket_of(rows, self.prefix_rows if prefix else self.encoder_rows)
        length = bucket_of(longest, self.encoder_lengths)
        slots = bucket_of(prefix, self.prefix_slots) if prefix else 0
        if batch is None or length is None or slots is None:
            return None
        if batch * length >= self.eager_tokens:
            batch, length, slots = rows, round_up(longest, EAGER_STEP), round_up(prefix, EAGER_STEP)
        return (batch, length, slots) if self._encoder_fits((batch, length, slots)) else None

    def _encoder_fits(self, key: EncoderKey) -> bool:
        rows, length, slots = key
        if rows * (slots + length) > self.encoder_slots:
            return False
        return not slots or slots + length <= self.sliding_window

    def encoder_graphed(self, key: EncoderKey) -> bool:
        """Whether the static pass for `key` replays a graph: its buckets hold fewer than
        `eager_tokens` tokens (an unbucketed key never is one: its buckets would hold more)."""
        rows, length, slots = key
        if slots:
            return (rows in self.prefix_rows and slots in self.prefix_slots and length in self.encoder_lengths
                    and rows * length < self.eager_tokens)
        return rows in self.encoder_rows and length in self.encoder_lengths and rows * length < self.eager_tokens

    def encoder_keys(self) -> list[EncoderKey]:
        """Every encoder shape to capture, most used first (no prefix, short, few rows)."""
        keys = [(rows, length, slots) for slots in (0, *self.prefix_slots) for length in self.encoder_lengths
                for rows in (self.prefix_rows if slots else self.encoder_rows)]
        return [key for key in keys if key[0] <= self._largest_rows(key[2]) and self.encoder_graphed(key)
                and self._encoder_fits(key)]

    def _largest_rows(self, slots: int) -> int:
        """The most rows an encoder graph holds: the bucket of MAX_BATCH_ROWS (or the largest)."""
        buckets = self.prefix_rows if slots else self.encoder_rows
        return bucket_of(min(self.max_rows, buckets[-1]), buckets) or buckets[-1]

    # ------------------------------------------------------------------ the runs before capture

    def decoder_pieces(self, key: DecoderKey) -> Pieces:
        """What a decoder key's run before capture stands for: (rows, canvas width, self-conditioned)."""
        rows, width, _, _, conditioned = key
        return rows, width, conditioned

    def encoder_pieces(self, key: EncoderKey) -> Pieces:
        """What an encoder key's run before capture stands for: (rows, suffix length, over a prefix)."""
        rows, length, slots = key
        return rows, length, slots > 0

    # ------------------------------------------------------------------ vision

    def image_chunks(self, images: int) -> list[int]:
        """How many images each vision pass takes, for `images` frames of one patch layout: the
        largest bucket at a time, so every pass pads to a captured count."""
        largest = self.image_buckets[-1]
        return [min(largest, images - start) for start in range(0, images, largest)]
