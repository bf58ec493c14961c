"""The flat forward's piecewise path (app/engine/hf/graphs/pieces.py, `PiecewiseForward`) on the tiny
model in float32 on the CPU, run eagerly (capture=False: the static buffers, padding and pieces the
CUDA graphs replay): the token buckets; the plain forward's hidden states and KV for turns of
prompt segments, canvases, a conditioned canvas, images given whole and two sequences, with nothing
written at the padding; a turn past the largest bucket run eagerly and counted; nothing built once
frozen; the report.

Where a bucket is the turn's own size the pieces are bitwise the plain forward. Padded, a matrix
product of more rows may round a row differently (MKL picks its kernel by the row count, and the
experts' per-expert products grow by the padding tokens routed to them): up to 1.9e-5 here on
hidden states of magnitude ~3 (a conditioned canvas over KV that differs by ~3e-6), so padded turns
are held to PADDED_TOLERANCE.

The two forwards share the model and each has its own KV store, the same sequences opened in both,
their pools filled with a sentinel first: a slot no turn writes holds it in both after.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass

import pytest
import torch

from app.engine.hf.attention import ReferenceAttention
from app.engine.hf.blocks import KVStore, LayerShape, SequenceKV
from app.engine.hf.forward import FlatForward
from app.engine.hf.graphs.pieces import GraphReport, PiecewiseConfig, bucket_for, token_buckets
from app.engine.hf.layout import Kind
from app.engine.hf.parts import encoder_layers, layer_types, text_config
from app.engine.hf.turn import FlatTurn, Part

PADDED_TOLERANCE = 5e-5
SENTINEL = 1024.0  # what the pools hold before any turn: a slot nobody writes keeps it (exact in bf16)
BUCKETS = (16, 32, 64, 128)


# ---------------------------------------------------------------------------------------- buckets

@pytest.mark.parametrize("budget", [1, 16, 17, 100, 512, 1024, 2048, 3000, 8192])
def test_buckets_ascend_to_the_budget(budget):
    buckets = token_buckets(budget)
    assert list(buckets) == sorted(set(buckets)) and buckets[-1] == budget
    assert buckets[0] == min(16, budget)
    for small, large in zip(buckets, buckets[1:]):
        assert large <= 2 * small  # at most twice a turn's tokens, however many
        if small >= 512:
            assert large <= small * 3 // 2  # past 512, at most half again


def test_the_served_budgets_buckets():
    assert token_buckets(8192) == (16, 32, 64, 128, 256, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192)
    assert token_buckets(2048) == (16, 32, 64, 128, 256, 512, 768, 1024, 1536, 2048)


def test_a_turn_takes_the_smallest_bucket_that_holds_it():
    buckets = token_buckets(2048)
    assert bucket_for(1, buckets) == 16
    assert bucket_for(16, buckets) == 16  # an exact fit
    assert bucket_for(17, buckets) == 32  # one over
    assert bucket_for(513, buckets) == 768
    assert bucket_for(2048, buckets) == 2048
    assert bucket_for(2049, buckets) is None  # past the largest: eager


def test_a_config_takes_ascending_distinct_buckets():
    assert PiecewiseConfig.for_budget(2048, capture=False).buckets == token_buckets(2048)
    for bad in [(), (32, 16), (16, 16), (0, 16)]:
        with pytest.raises(ValueError):
            PiecewiseConfig(bad, capture=False)


# ---------------------------------------------------------------------------------------- the forward

@pytest.fixture(scope="module")
def model(tiny_dir):
    from transformers import DiffusionGemmaForBlockDiffusion

    return DiffusionGemmaForBlockDiffusion.from_pretrained(str(tiny_dir), dtype=torch.float32,
                                                          attn_implementation="sdpa").eval()


@dataclass
class Setup:
    """A KV store, attention, forward and turn over the tiny model."""

    store: KVStore
    forward: FlatForward
    turn: FlatTurn
    stats: Counter[str]


def make(model, config: PiecewiseConfig | None) -> Setup:
    """A setup on the model's device, its pools full of SENTINEL."""
    device = next(model.parameters()).device
    shapes = []
    for layer, kind in zip(encoder_layers(model), layer_types(model)):
        attention = layer.self_attn
        shapes.append(LayerShape(kind == "sliding_attention", attention.k_proj.out_features // attention.head_dim,
                                 attention.head_dim))
    window = int(text_config(model).sliding_window)
    store = KVStore(shapes, window, 4 << 20, device, model.dtype, preallocate=True)
    for layer in range(len(shapes)):
        for pool in store.pool_tensors(layer):
            pool.fill_(SENTINEL)
    stats: Counter[str] = Counter()
    forward = FlatForward(model, store, ReferenceAttention(store, window), graphs=config, stats=stats)
    return Setup(store, forward, FlatTurn(forward, store, device), stats)


def open_sequence(store: KVStore, name: str, length: int) -> SequenceKV:
    """A sequence of `length` reserved positions, its keys its own (no block shared with another)."""
    keys = [(name, position) for position in range(length)]
    sequence = store.open(keys)
    store.reserve(sequence, keys[sequence.reserved:])
    return sequence


@dataclass(frozen=True)
class Ask:
    """A part of a turn, by the sequence's name, for both setups alike."""

    kind: Kind
    sequence: str
    position: int
    tokens: int
    logits: tuple[int, ...] = ()
    embeds: tuple[int, int] | None = None  # an image given whole: (start, end) offsets within the part
    conditioned: bool = False


def parts_for(setup: Setup, sequences: dict[str, SequenceKV], asks: list[Ask], seed: int, model) -> list[Part]:
    """The turn's parts, their ids, embeddings and conditioning drawn from `seed` (the same for both setups)."""
    generator = torch.Generator().manual_seed(seed)
    config, device = text_config(model), next(model.parameters()).device
    parts = []
    for ask in asks:
        ids = torch.randint(0, int(config.vocab_size), (ask.tokens,), generator=generator).tolist()
        part = Part(ask.kind, sequences[ask.sequence], ask.position, ids,
                    logits=ask.logits or tuple(range(ask.tokens)))
        if ask.embeds is not None:
            start, end = ask.embeds
            embeds = torch.zeros(ask.tokens, int(config.hidden_size))
            embeds[start:end] = torch.randn(end - start, int(config.hidden_size), generator=generator)
            part.embeds, part.images = embeds.to(device, model.dtype), (ask.embeds,)
        if ask.conditioned:
            part.conditioning = (torch.randn(ask.tokens, int(config.vocab_size), generator=generator) * 3).to(device)
        parts.append(part)
    return parts


# Turns over three sequences (A: a prompt past the 64-token sliding window, in chunks; B: with an image
# given whole; C: a short one), none of a bucket's token count: (turn, its bucket).
TURNS = [
    ([Ask(Kind.PROMPT, "A", 0, 37, logits=(36,)),
      Ask(Kind.PROMPT, "B", 0, 9, embeds=(2, 6)),
      Ask(Kind.CANVAS, "B", 9, 12)], 64),  # 58 tokens: prompts, and a canvas over a prompt written in the turn
    ([Ask(Kind.PROMPT, "A", 37, 43, logits=(0, 42)),
      Ask(Kind.CANVAS, "A", 80, 10, conditioned=True),
      Ask(Kind.CANVAS, "B", 9, 7)], 64),  # 60: a chunk across the window, a conditioned canvas, two sequences
    ([Ask(Kind.CANVAS, "A", 80, 11, conditioned=True)], 16),  # 11: a conditioned canvas alone
    ([Ask(Kind.PROMPT, "C", 0, 21, logits=(20,))], 32),  # 21: a prompt alone
    ([Ask(Kind.PROMPT, "B", 9, 70), Ask(Kind.CANVAS, "C", 21, 16)], 128),  # 86: a long chunk beside a canvas
]
LENGTHS = {"A": 90, "B": 79, "C": 37}
OWN_SIZES = tuple(sorted({sum(ask.tokens for ask in asks) for asks, _ in TURNS}))  # (11, 21, 58, 60, 86)


def run_both(model, buckets: tuple[int, ...], compile=None) -> tuple[Setup, float, float]:
    """TURNS on the plain forward and on the pieces over `buckets` (their layer bodies through
    `compile` where given), each turn's hidden states and KV compared: the piecewise setup, and the
    largest differences in hidden states and in the pools."""
    plain, pieces = make(model, None), make(model, PiecewiseConfig(buckets, capture=False))
    if compile is not None:
        pieces.forward.compile(compile)
    opened = {id(setup): {name: open_sequence(setup.store, name, length) for name, length in LENGTHS.items()}
              for setup in (plain, pieces)}
    hidden = pools = 0.0
    for seed, (asks, _) in enumerate(TURNS):
        expected = parts_for(plain, opened[id(plain)], asks, seed, model)
        got = parts_for(pieces, opened[id(pieces)], asks, seed, model)
        plain.turn.run(expected)
        pieces.turn.run(got)
        for want, have in zip(expected, got):
            assert want.hidden is not None and have.hidden is not None
            assert want.hidden.shape == have.hidden.shape
            hidden = max(hidden, float((want.hidden - have.hidden).abs().max()))
        pools = max(pools, pool_difference(plain.store, pieces.store))
    return pieces, hidden, pools


def test_padded_turns_read_and_write_what_the_plain_forward_does(model):
    for asks, bucket in TURNS:
        tokens = sum(ask.tokens for ask in asks)
        assert bucket_for(tokens, BUCKETS) == bucket != tokens
    pieces, hidden, pools = run_both(model, BUCKETS)
    assert hidden < PADDED_TOLERANCE and pools < PADDED_TOLERANCE
    assert pieces.stats["flat_graph_fallbacks"] == 0
    assert pieces.stats["flat_graphs_built"] == len({bucket for _, bucket in TURNS})  # built once, then reused


def test_unpadded_turns_are_bitwise_the_plain_forward(model):
    pieces, hidden, pools = run_both(model, OWN_SIZES)
    assert hidden == 0.0 and pools == 0.0 and pieces.stats["flat_graph_fallbacks"] == 0


def pool_difference(expected: KVStore, got: KVStore) -> float:
    """The largest difference between two stores' pools, layer by layer; the sentinel (never written)
    must be at the same slots in both."""
    largest = 0.0
    for layer in range(len(expected.layers)):
        for want, have in zip(expected.pool_tensors(layer), got.pool_tensors(layer)):
            untouched = want == SENTINEL
            assert torch.equal(untouched, have == SENTINEL), f"layer {layer}: the pieces wrote other slots"
            assert not bool(untouched.all())
            largest = max(largest, float((want - have).abs().max()))
    return largest


def test_a_turn_past_the_largest_bucket_runs_eagerly_and_counts(model):
    plain, pieces = make(model, None), make(model, PiecewiseConfig((16, 32), capture=False))
    asks = [Ask(Kind.PROMPT, "A", 0, 30), Ask(Kind.CANVAS, "A", 30, 10)]  # 40 tokens
    results = []
    for setup in (plain, pieces):
        parts = parts_for(setup, {"A": open_sequence(setup.store, "A", 30)}, asks, 3, model)
        setup.turn.run(parts)
        results.append(torch.cat([part.hidden for part in parts if part.hidden is not None]))
    assert torch.equal(results[0], results[1])  # the very same eager forward
    assert pieces.stats["flat_graph_fallbacks"] == 1
    assert pieces.stats["flat_graphs_built"] == 0


def test_nothing_is_built_once_frozen(model, caplog):
    pieces = make(model, PiecewiseConfig(BUCKETS, capture=False))
    graphs = pieces.forward.graphs
    assert graphs is not None
    sequences = {"A": open_sequence(pieces.store, "A", 320)}
    pieces.turn.run(parts_for(pieces, sequences, [Ask(Kind.PROMPT, "A", 0, 20)], 1, model))
    assert pieces.stats["flat_graphs_built"] == 1  # before start-up's capture: built on first use
    with caplog.at_level(logging.INFO, logger="djev.engine"):
        report = graphs.capture_all()
    assert report.buckets == BUCKETS and graphs.cache.frozen
    assert pieces.stats["flat_graphs_built"] == len(BUCKETS)
    assert any(record.getMessage() == report.line() for record in caplog.records)
    position = 20
    for tokens in (5, 16, 40, 100, 129):  # each bucket, then past the largest
        pieces.turn.run(parts_for(pieces, sequences, [Ask(Kind.PROMPT, "A", position, tokens)], tokens, model))
        position += tokens
    assert pieces.stats["flat_graphs_built"] == len(BUCKETS)
    assert pieces.stats["flat_graph_fallbacks"] == 1


def test_the_report_counts_buckets_pieces_graphs_and_memory(model):
    pieces = make(model, PiecewiseConfig(BUCKETS, capture=False))
    graphs = pieces.forward.graphs
    assert graphs is not None
    report = graphs.capture_all()
    layers = len(encoder_layers(model))
    assert (report.buckets, report.pieces, report.graphs, report.memory_bytes) == (BUCKETS, layers + 1, 0, 0)
    hidden = int(text_config(model).hidden_size)
    assert report.buffer_bytes > 128 * hidden * 4  # the hidden buffer alone, float32
    assert report.failed == () and report.seconds >= 0
    assert report.line().startswith(f"flat pieces: 4 buckets × {layers + 1} pieces, run eagerly")


def test_the_reports_line():
    report = GraphReport(buckets=tuple(16 << n for n in range(10)), pieces=31, graphs=310,
                         memory_bytes=int(1.2 * (1 << 30)), buffer_bytes=420 << 20, seconds=8.26)
    assert report.line() == "flat graphs: 10 buckets × 31 pieces = 310 graphs, 1.2 GiB (+ 420 MiB buffers), 8.3 s"


def test_graphs_are_captured_on_cuda_alone(model):
    with pytest.raises(ValueError, match="CUDA"):
        make(model, PiecewiseConfig(BUCKETS, capture=True))


def test_compiled_layer_bodies_read_what_the_eager_ones_do(model):
    """TORCH_COMPILE on the flat turn: the layers' two bodies through torch.compile (aot_eager on the
    CPU: the graphs dynamo traces, without inductor's kernels), in the pieces and in the eager
    forward of a turn past the largest bucket, against the plain forward."""
    import functools

    compile = functools.partial(torch.compile, backend="aot_eager", dynamic=None)
    pieces, hidden, pools = run_both(model, (16, 32, 64), compile)  # sizes 11 to 86: one past the buckets
    assert hidden < PADDED_TOLERANCE and pools < PADDED_TOLERANCE
    assert pieces.stats["flat_graph_fallbacks"] == 1  # the 86-token turn: the compiled eager forward


def test_a_failed_capture_makes_the_reader_degraded_naming_it():
    from app.engine.hf.graphs.cache import GraphCache
    from app.engine.hf.loader import capture_faults

    def build(bucket):
        if bucket == BUCKETS[-2]:
            raise RuntimeError("operation not permitted when stream is capturing")
        return bucket

    cache: GraphCache[int, int] = GraphCache("flat", build, Counter())
    for bucket in reversed(BUCKETS):  # largest first, as `capture_all`: the failure freezes the rest
        if not cache.frozen:
            cache.build(bucket)
    assert list(cache) == [BUCKETS[-1]] and list(cache.failed) == [BUCKETS[-2]]
    (fault,) = capture_faults(cache.failed)
    assert f"failed at 1 token bucket(s) ({BUCKETS[-2]}: RuntimeError: operation not permitted" in fault
    assert "run eagerly" in fault
    assert capture_faults({}) == []  # nothing failed: not degraded
