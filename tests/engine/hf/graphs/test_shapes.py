"""The shape policy (app/engine/hf/graphs/shapes.py) as pure functions, the one graph cache
(app/engine/hf/graphs/cache.py), and the rule they make together: every shape a request within the
settings can produce maps to a captured graph or to the counted eager fallback, and nothing is
built after the graphs are prepared (`DiffusionRunner.prepare_graphs`)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from app.build import prompt_limit
from app.config import Settings
from app.engine.hf.graphs.cache import GraphCache
from app.engine.hf.graphs.shapes import EAGER_STEP, ShapePolicy, bucket_of, doubling
from tests.conftest import make_tiny_reader
from tests.engine.hf.test_reader import spec_for


def policy_of(settings: Settings, sliding_window: int = 1024) -> ShapePolicy:
    return ShapePolicy(max_rows=settings.hf.max_batch_rows, canvas=settings.decisions.canvas,
                       canvas_step=settings.decisions.canvas_step, max_prompt_tokens=prompt_limit(settings),
                       sliding_window=sliding_window, max_images=settings.limits.max_images)


DEFAULT = policy_of(Settings.of())


def test_doubling_and_buckets():
    assert doubling(256, 1000) == (256, 512, 1024) and doubling(1, 1) == (1,)
    assert bucket_of(3, (1, 2, 4)) == 4 and bucket_of(5, (1, 2, 4)) is None


def test_the_default_sets_are_bounded():
    decoder, encoder = DEFAULT.decoder_keys(), DEFAULT.encoder_keys()
    assert len(decoder) == len(set(decoder)) and len(encoder) == len(set(encoder))
    assert len(decoder) <= 260 and len(encoder) <= 260  # captured in under a minute each kind on an H200
    assert DEFAULT.width_buckets == (16, 32, 64, 128) and DEFAULT.kv_buckets[-1] >= 32768


def test_a_capture_runs_the_pass_first_once_per_shape_its_compiled_pieces_see():
    """Keys that differ only in the KV attention reads (its length,
    a prefix's slots) share their pieces' shape, and the start-up runs a pass before recording only
    for the first of them (about a quarter of the captures at the defaults); keys that differ in
    rows, tokens a row, self-conditioning (decoder) or in running over a prefix or not (encoder)
    never share one."""
    decoder_pieces, encoder_pieces = DEFAULT.decoder_pieces, DEFAULT.encoder_pieces
    decoder, encoder = DEFAULT.decoder_keys(), DEFAULT.encoder_keys()
    decoder_shapes = {decoder_pieces(key) for key in decoder}
    encoder_shapes = {encoder_pieces(key) for key in encoder}
    assert len(decoder_shapes) == len({(rows, width, conditioned) for rows, width, _, _, conditioned in decoder})
    assert len(decoder_shapes) + len(encoder_shapes) <= (len(decoder) + len(encoder)) / 2
    assert decoder_pieces((8, 16, 256, 256, False)) == decoder_pieces((8, 16, 4096, 1024, False))
    assert decoder_pieces((8, 16, 256, 256, False)) != decoder_pieces((8, 16, 256, 256, True))
    # Over a prefix the pass needs a run of its own: the H200 failed that capture unwarmed.
    assert encoder_pieces((4, 160, 256)) == encoder_pieces((4, 160, 768)) != encoder_pieces((4, 160, 0))
    assert encoder_pieces((4, 160, 0)) != encoder_pieces((8, 160, 0)) != encoder_pieces((8, 192, 0))


@pytest.mark.parametrize("settings", [Settings.of(), Settings.of(canvas=96, max_batch_rows=48),
                                      Settings.of(canvas=256, canvas_step=32, max_prompt_tokens=8000)])
def test_every_decoder_shape_maps_to_a_captured_key_that_holds_it_or_to_the_fallback(settings):
    policy = policy_of(settings)
    captured = set(policy.decoder_keys())
    widths = range(settings.decisions.canvas_step, settings.decisions.canvas + 1, settings.decisions.canvas_step)
    lengths = sorted({1, 255, 256, 257, 1023, 1024, 1025, 5000, prompt_limit(settings)})
    for rows in range(1, settings.hf.max_batch_rows + 1):
        for width in widths:
            for length in lengths:
                for conditioned in (False, True):
                    key = policy.decoder_key(rows, width, length, conditioned)
                    if key is None:
                        continue  # the eager path, counted by the cache
                    assert key in captured
                    batch, padded, full, sliding, flag = key
                    assert batch >= rows and padded >= width and full >= length and flag == conditioned
                    assert sliding == min(full, policy.sliding_bucket)
    # The common shapes are captured: a read of up to 16 canvases over prompts up to 1,024 tokens (32 at
    # the default canvas).
    most = 32 if settings.decisions.canvas <= 128 else 16
    assert all(policy.decoder_key(rows, settings.decisions.canvas, 1024, False) is not None for rows in range(1, most + 1))
    assert policy.decoder_key(1, settings.decisions.canvas, 4096, True) is not None  # a thought's passes


def test_decoder_rows_step_between_the_powers_of_two_up_to_max_batch_rows():
    """45 tickets pad to 48 rows, not 64; 9 walk frames to 12; MAX_BATCH_ROWS is always a bucket."""
    assert DEFAULT.row_buckets == (1, 2, 4, 8, 12, 16, 24, 32, 48, 64)
    assert DEFAULT.decoder_key(45, 16, 300, False) == (48, 16, 512, 512, False)
    assert DEFAULT.decoder_key(9, 16, 700, False) == (12, 16, 1024, 1024, False)
    assert policy_of(Settings.of(max_batch_rows=40)).row_buckets == (1, 2, 4, 8, 12, 16, 24, 32, 40)
    assert policy_of(Settings.of(max_batch_rows=1)).row_buckets == (1,)


def test_past_the_caps_the_decoder_has_no_key():
    assert DEFAULT.decoder_key(65, 16, 100, False) is None  # more rows than MAX_BATCH_ROWS
    assert DEFAULT.decoder_key(64, 128, 4096, False) is None  # past the shared buffers' tokens
    assert DEFAULT.decoder_key(2, 64, 100, True) is None  # conditioned graphs hold one row
    assert DEFAULT.decoder_key(1, 129, 100, False) is None  # wider than CANVAS


def test_every_encoder_shape_maps_to_a_captured_key_or_runs_unbucketed_or_falls_back():
    captured = set(DEFAULT.encoder_keys())
    for rows in range(1, 33):
        for longest in (1, 63, 64, 65, 300, 700, 1024, 2000, 4096, 5000):
            for prefix in (0, 64, 200, 257, 600, 900):
                key = DEFAULT.encoder_key(rows, longest, prefix)
                if key is None:
                    continue  # eager, counted
                if DEFAULT.encoder_graphed(key):
                    assert key in captured and key[0] >= rows and key[1] >= longest and key[2] >= prefix
                else:  # a large pass: the static path without a graph, its own rows, lengths to EAGER_STEP
                    assert key == (rows, -(-longest // EAGER_STEP) * EAGER_STEP, -(-prefix // EAGER_STEP) * EAGER_STEP)
    assert DEFAULT.encoder_key(1, 5000) is None  # past the largest bucket: eager
    assert DEFAULT.encoder_key(1, 900, 600) is None  # a prefix pass past the sliding window


def test_passes_over_a_prefix_pad_to_finer_rows():
    """The served batches run over a shared prefix and come in every count: 5 walk frames pad to 6
    rows, 22 tickets to 24; a pass without a prefix keeps the powers of two."""
    assert DEFAULT.encoder_key(5, 355, 400) == (6, 384, 512)
    assert DEFAULT.encoder_key(22, 150, 256) == (24, 160, 256)
    assert DEFAULT.encoder_key(5, 355) == (8, 384, 0) and DEFAULT.encoder_key(22, 150) == (32, 160, 0)
    captured = set(DEFAULT.encoder_keys())
    assert {(6, 384, 512), (12, 384, 512), (24, 160, 256)} <= captured and (6, 384, 0) not in captured
    assert not DEFAULT.encoder_graphed((6, 384, 0)) and DEFAULT.encoder_graphed((6, 384, 512))


# The walk page's frame at full size: 411 prompt ids ahead of the frame (the sheet), the frame's 280
# soft tokens between begin and end, 62 ids after it; the gated stage restates the answer in 76.
WALK_SHEET, WALK_FRAME, WALK_AFTER, WALK_RESTATED = 411, 282, 62, 76


@pytest.mark.parametrize("rows", [1, 5, 16])
def test_both_stages_of_walk_frames_replay_graphs_over_their_prefixes(rows):
    """Frames of one sheet: the frame and what follows it over the sheet's KV (its prefix ends at a
    16-token block); their gated stages: the restated suffix over each frame's own prompt."""
    sheet = WALK_SHEET // 16 * 16
    first = DEFAULT.encoder_key(rows, WALK_SHEET - sheet + WALK_FRAME + WALK_AFTER, sheet)
    second = DEFAULT.encoder_key(rows, WALK_RESTATED, WALK_SHEET + WALK_FRAME)
    captured = set(DEFAULT.encoder_keys())
    assert first in captured and second in captured


def passes_of(rows, conditioned=False, graphs=True, policy=DEFAULT):
    passes = policy.decoder_passes(rows, conditioned, graphs)
    assert sorted(index for group in passes for index in group) == list(range(len(rows)))  # each row once
    return [[rows[index] for index in group] for group in passes]


def test_a_reads_rows_are_split_into_passes_a_graph_holds():
    # 200 questions over a ~4,000-token prompt: passes of 16 rows (32 x (4,096 + 32) is past the buffers).
    passes = passes_of([(4000, 32)] * 200)
    assert [len(group) for group in passes] == [16] * 12 + [8]
    assert all(DEFAULT.decoder_key(len(group), 32, 4000, False) is not None for group in passes)
    # 255 options x 8 questions: a prompt of ~10,000 tokens, 64 canvases: four at a time.
    assert {len(group) for group in passes_of([(10_000, 128)] * 64)} == {4}
    # A batch of short tickets beside a 26k-token state: the tickets in one pass, the long state's
    # canvases by twos, each pass graphed.
    mixed = [(300, 32)] * 30 + [(26_000, 32)] * 3
    passes = passes_of(mixed)
    assert [len(group) for group in passes] == [30, 2, 1] and passes[0] == [(300, 32)] * 30
    assert all(DEFAULT.decoder_key(len(g), max(w for _, w in g), max(k for k, _ in g), False) for g in passes)


def test_rows_no_graph_holds_go_in_passes_within_the_buffers_tokens():
    for kv, width in ((100_000, 32), (40_000, 128)):
        passes = passes_of([(kv, width)] * 10)
        assert all(len(group) * (kv + width) <= DEFAULT.decoder_slots or len(group) == 1 for group in passes)
    assert [len(g) for g in passes_of([(300, 32)] * 64, conditioned=True)] == [64]  # 64 x 332 tokens
    assert [len(g) for g in passes_of([(300, 32)] * 100, graphs=False)] == [64, 36]  # MAX_BATCH_ROWS
    assert [len(g) for g in passes_of([(5000, 32)] * 20, graphs=False)] == [14, 6]  # 14 x 5,032 <= 72 K


def test_frames_go_through_the_vision_tower_in_passes_of_the_largest_bucket():
    assert DEFAULT.image_chunks(1) == [1] and DEFAULT.image_chunks(8) == [8]
    assert DEFAULT.image_chunks(19) == [8, 8, 3]


def test_the_graph_cache_builds_until_frozen_then_only_counts_fallbacks():
    stats: Counter[str] = Counter()
    built: list[int] = []

    def build(key: int) -> str:
        if key == 13:
            raise RuntimeError("cannot capture")
        built.append(key)
        return f"graph {key}"

    cache: GraphCache[int, str] = GraphCache("decoder", build, stats)
    assert cache.get(1) == "graph 1" and cache.get(1) == "graph 1" and built == [1]
    assert cache.get(None) is None and stats["decoder_graph_fallbacks"] == 1  # no key: past the caps
    cache.freeze()
    assert cache.get(2) is None and built == [1]  # frozen: nothing built, the pass goes eager
    assert stats["decoder_graph_fallbacks"] == 2 and stats["decoder_graphs_built"] == 1


def test_a_failed_capture_stops_every_capture_after_it():
    """A capture that fails half-way may leave the shared pool recording (seen on the H200: every
    capture after it failed): the cache builds nothing more, and prepare_graphs stops."""
    stats: Counter[str] = Counter()
    built: list[int] = []

    def build(key: int) -> str:
        if key == 13:
            raise RuntimeError("operation failed due to a previous error during capture")
        built.append(key)
        return f"graph {key}"

    cache: GraphCache[int, str] = GraphCache("encoder", build, stats)
    assert cache.get(1) == "graph 1"
    assert cache.get(13) is None and cache.frozen and 13 in cache.failed
    assert cache.get(2) is None and built == [1]  # nothing built after the failure
    assert stats["encoder_graph_failures"] == 1 and stats["encoder_graph_fallbacks"] == 1
    assert cache.get(1) == "graph 1"  # what was built before still replays


def test_out_of_memory_while_building_is_not_a_shape_that_cannot_be_captured():
    def build(key: int) -> str:
        raise torch.OutOfMemoryError("CUDA out of memory")

    cache: GraphCache[int, str] = GraphCache("encoder", build, Counter())
    with pytest.raises(torch.OutOfMemoryError):
        cache.get(1)
    assert not cache.failed  # a later try, with memory, may build it


@torch.no_grad()
def test_prepared_graphs_cover_the_reads_and_nothing_is_built_after(tiny_dir, tokenizer):
    runner = make_tiny_reader(tiny_dir, flat_turn=False).runner
    runner.use_graphs(capture=False)  # the static-buffer paths, run eagerly on the CPU
    held = runner.prepare_graphs()
    assert held["decoder"] == len(runner.policy.decoder_keys()) and held["encoder"] == len(runner.policy.encoder_keys())
    before = dict(runner.graphs_held())
    specs = [spec_for(tokenizer, f"state {n} " * (1 + 7 * n), "q1: yes\nq2: no", [3, 4]) for n in range(5)]
    assert all(not isinstance(result, Exception) for result in runner.read(specs))
    assert runner.graphs_held() == before  # frozen: no build while serving
    assert runner.stats["graph_replays"] >= 1 and runner.stats["decoder_graph_fallbacks"] == 0


def test_the_memory_reserve_counts_what_the_allocator_keeps_cached(monkeypatch):
    """Capture frees nothing between graphs, so the warm runs' blocks stay in the allocator's cache:
    the reserve check gives them back before it leaves a graph out (a run on the H200 left 184
    encoder graphs out when it did not)."""
    from types import SimpleNamespace

    from app.engine.hf.runner import DiffusionRunner

    free = {"bytes": 4 << 30, "cached": 10 << 30}
    emptied = []

    def empty_cache():
        emptied.append(True)
        free["bytes"] += free.pop("cached", 0)

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free["bytes"], 80 << 30))
    monkeypatch.setattr(torch.cuda, "empty_cache", empty_cache)
    runner = SimpleNamespace(device=torch.device("cuda", 0))
    assert DiffusionRunner.room_left(runner, 12 << 30) and emptied == [True]  # type: ignore[arg-type]
    assert DiffusionRunner.room_left(runner, 12 << 30) and emptied == [True]  # enough free: nothing emptied
    assert not DiffusionRunner.room_left(runner, 20 << 30) and emptied == [True, True]  # type: ignore[arg-type]


def test_the_graph_cache_runs_the_first_key_of_each_pieces_value_before_capture():
    """`GraphCache.first_run`, what a kind's capture asks before recording: the first key of each
    value of the policy's pieces rule runs first, the rest do not; without a rule every key does."""
    cache: GraphCache[tuple, str] = GraphCache("decoder", lambda key: "graph", Counter(), DEFAULT.decoder_pieces)
    assert cache.first_run((8, 16, 256, 256, False)) and not cache.first_run((8, 16, 4096, 1024, False))
    assert cache.first_run((8, 32, 256, 256, False))
    vision: GraphCache[tuple, str] = GraphCache("vision", lambda key: "graph", Counter())
    assert vision.first_run((1, 256, 768)) and vision.first_run((1, 256, 768))
