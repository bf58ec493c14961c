"""The encoder-graph path (app/engine/hf/graphs/encoder.py) run eagerly on the CPU (capture=False): its
bucketing, left padding, on-device masks and positions, sliding-window crop and image embeddings
give the eager encoder's KV; prompts past the largest bucket fall back to the eager pass; the
number of graphs is bounded."""

from __future__ import annotations

import dataclasses
import io

import pytest
import torch

from app.engine.base import GenerateSpec, ImageInput, Prompt
from app.engine.hf.graphs.encoder import EncoderGraphs
from app.engine.hf.graphs.shapes import EAGER_STEP, bucket_of
from tests.conftest import make_tiny_reader

LENGTHS = (32, 64, 128, 256)  # small buckets: the tiny model's sliding window is 64


def graphed_runner(tiny_dir, **options):
    """The tiny model's runner with encoder graphs run eagerly (capture=False), over a shape policy
    with small buckets (`lengths`, `rows`; prefix slots from the length buckets) and the policy's
    other fields as given (`encoder_slots`, `eager_tokens`)."""
    runner = make_tiny_reader(tiny_dir, flat_turn=False).runner
    lengths = options.pop("lengths", LENGTHS)
    rows = options.pop("rows", (1, 2, 4))
    runner.policy = dataclasses.replace(runner.policy, encoder_lengths=lengths, prefix_slots=lengths,
                                        encoder_rows=rows, prefix_rows=rows, **options)
    runner.encoder_graphs = EncoderGraphs(
        runner.model, runner.layer_types, runner.device, capture=False,
        sliding_window=int(runner.text_config.sliding_window), policy=runner.policy, stats=runner.stats)
    return runner


@pytest.fixture(scope="module")
def runners(tiny_dir, eager_runner):
    return eager_runner, graphed_runner(tiny_dir)


def text_prompt(tokenizer, words: int, tag: str) -> Prompt:
    return Prompt(tuple(tokenizer.render_chat("Answer.", " ".join(f"{tag}{i}" for i in range(words)), 0, False)))


def assert_same_kv(a, b):
    assert a.length == b.length and len(a.layers) == len(b.layers)
    for (ka, va), (kb, vb) in zip(a.layers, b.layers):
        assert ka.shape == kb.shape and va.shape == vb.shape
        assert torch.allclose(ka, kb, atol=1e-4) and torch.allclose(va, vb, atol=1e-4)


def test_buckets():
    assert [bucket_of(n, (1, 2, 4)) for n in (1, 2, 3, 4, 5)] == [1, 2, 4, 4, None]


@torch.no_grad()
def test_graph_path_equals_the_eager_encoder_for_short_long_and_padded_prompts(runners, tokenizer):
    eager, graphed = runners
    prompts = [text_prompt(tokenizer, 2, "a"), text_prompt(tokenizer, 40, "b"), text_prompt(tokenizer, 12, "c")]
    assert max(len(p.ids) for p in prompts) > 64 > min(len(p.ids) for p in prompts)  # past the window and not
    alone = [eager.encode_many([p])[0] for p in prompts]  # each alone, unpadded, eager
    before = graphed.stats["encoder_graph_replays"]
    together = graphed.encode_many(prompts)  # one padded graph-path pass
    assert graphed.stats["encoder_graph_replays"] - before == 1
    for a, b in zip(alone, together):
        assert_same_kv(a, b)
    key = graphed.encoder_graphs.key(3, max(len(p.ids) for p in prompts))
    assert key in graphed.encoder_graphs.cache and key[0] == 4  # 3 rows ride the 4-row bucket
    assert key[1] > 64  # a bucket past the sliding window: the window's mask is applied
    short = text_prompt(tokenizer, 3, "d")  # alone in a bucket within the window: no mask at all
    assert graphed.encoder_graphs.key(1, len(short.ids))[1] <= 64
    assert_same_kv(eager.encode_many([short])[0], graphed.encode_many([short])[0])


@torch.no_grad()
def test_a_prompt_past_the_largest_bucket_is_encoded_eagerly(tiny_dir, runners, tokenizer):
    eager, _ = runners
    small = graphed_runner(tiny_dir, lengths=(32,))
    prompt = text_prompt(tokenizer, 20, "z")
    assert len(prompt.ids) > 32
    encoded = small.encode_many([prompt])[0]
    assert small.stats["encoder_graph_replays"] == 0 and small.stats["encoder_passes"] == 1
    assert_same_kv(eager.encode_many([prompt])[0], encoded)


@torch.no_grad()
def test_batches_split_at_the_graph_buckets_and_a_frozen_cache_only_falls_back(tiny_dir, tokenizer):
    runner = graphed_runner(tiny_dir, encoder_slots=256)
    prompts = [text_prompt(tokenizer, 2, f"p{i}") for i in range(3)] + [text_prompt(tokenizer, 40, "q")]
    runner.encode_many(prompts)
    # Three short prompts fill a 4 x 32 bucket; the long one (past 128 tokens with 4 rows would break the
    # 256-slot cap) gets a pass of its own.
    assert runner.stats["encoder_passes"] == 2 and runner.stats["encoder_graph_replays"] == 2
    held = set(runner.encoder_graphs.cache)
    assert held <= set(runner.policy.encoder_keys())  # only the policy's shapes are ever held
    runner.freeze_graphs()
    runner.encode_many([text_prompt(tokenizer, 2, "r")])  # a new bucket once frozen: eager, counted
    assert set(runner.encoder_graphs.cache) == held
    assert runner.stats["encoder_graph_fallbacks"] == 1 and runner.stats["encoder_graph_replays"] == 2


@torch.no_grad()
def test_a_large_batch_runs_the_static_path_unbucketed_without_a_graph(tiny_dir, runners, tokenizer):
    eager, _ = runners
    runner = graphed_runner(tiny_dir, eager_tokens=96)  # tiny: "large" from 96 tokens
    prompts = [text_prompt(tokenizer, 8, "u"), text_prompt(tokenizer, 11, "v"), text_prompt(tokenizer, 9, "w")]
    longest = max(len(p.ids) for p in prompts)
    key = runner.encoder_graphs.key(3, longest)
    assert key == (3, -(-longest // EAGER_STEP) * EAGER_STEP, 0)  # its own rows, its length to a multiple of 8
    assert key != (4, bucket_of(longest, LENGTHS), 0) and not runner.encoder_graphs.graphed(key)
    together = runner.encode_many(prompts)
    assert runner.stats["encoder_passes"] == runner.stats["encoder_unbucketed_passes"] == 1
    assert "encoder_graph_replays" not in runner.stats and not len(runner.encoder_graphs.cache)  # nothing held
    for prompt, encoded in zip(prompts, together):
        assert_same_kv(eager.encode_many([prompt])[0], encoded)
    short = len(text_prompt(tokenizer, 2, "x").ids)  # under the threshold: the buckets, a graph
    small = runner.encoder_graphs.key(1, short)
    assert small == (1, bucket_of(short, LENGTHS), 0) and runner.encoder_graphs.graphed(small)


def jpeg(colour: tuple[int, int, int]) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (64, 48), colour).save(buffer, "JPEG")
    return buffer.getvalue()


@torch.no_grad()
def test_image_prompts_share_the_graph_path_and_equal_the_eager_encoder(tiny_dir, runners, tokenizer):
    eager, _ = runners
    graphed = graphed_runner(tiny_dir, lengths=(128, 256))
    prompts = [Prompt(tuple(tokenizer.render_chat("Look.", "what is ahead?", 1, False)),
                      (ImageInput(jpeg(colour), "image/jpeg", f"frame {n}"),))
               for n, colour in enumerate([(200, 10, 10), (10, 10, 200)])]
    alone = [eager.encode_many([p])[0] for p in prompts]
    together = graphed.encode_many(prompts)
    # Both prompts' images share one vision pass, then one encoder pass.
    assert graphed.stats["encoder_graph_replays"] == 1 and graphed.stats["vision_passes"] == 1
    for a, b in zip(alone, together):
        assert a.length > len(prompts[0].ids)  # soft tokens expanded
        assert_same_kv(a, b)


@torch.no_grad()
def test_a_restated_image_skips_the_vision_tower_and_reads_the_same(tiny_dir, runners, tokenizer):
    eager, _ = runners
    runner = graphed_runner(tiny_dir, lengths=(128, 256))
    frame = (ImageInput(jpeg((30, 200, 30)), "image/jpeg", "frame"),)
    first = Prompt(tuple(tokenizer.render_chat("Look.", "what is ahead?", 1, False)), frame)
    restated = Prompt(tuple(tokenizer.render_chat("Look.", "ahead: wall. which side?", 1, False)), frame)
    runner.encode_many([first])
    encoded = runner.encode_many([restated])[0]
    assert runner.stats["vision_passes"] == 1 and runner.stats["vision_hits"] == 1
    assert_same_kv(eager.encode_many([restated])[0], encoded)


@torch.no_grad()
def test_the_vision_graph_path_equals_the_library_forward(tiny_dir, tokenizer):
    from app.engine.hf.graphs.vision import VisionGraphs

    runner = make_tiny_reader(tiny_dir, flat_turn=False).runner
    vision = VisionGraphs(runner.model, runner.device, capture=False)
    frames = tuple(ImageInput(jpeg(colour), "image/jpeg", f"frame {n}")
                   for n, colour in enumerate([(200, 10, 10), (10, 200, 10), (10, 10, 200)]))
    inputs = runner.model_inputs(Prompt(tuple(tokenizer.render_chat("Look.", "ahead?", 3, False)), frames))
    pixels, positions = inputs["pixel_values"], inputs["image_position_ids"]
    expected = runner.model.model.encoder.get_image_features(pixels, positions, return_dict=True).pooler_output
    got = vision.features(pixels, positions)  # 3 images ride the 4-image bucket: one padding image
    assert list(vision.cache) == [(4, *pixels.shape[1:])]
    assert got.shape == expected.reshape(-1, expected.shape[-1]).shape
    assert torch.allclose(got, expected.reshape(got.shape), atol=1e-4)
    assert got.shape[0] == int(inputs["soft_token_counts"].sum())
    one = vision.features(pixels[:1], positions[:1])  # a different bucket, built once
    assert torch.allclose(one, got[: one.shape[0]], atol=1e-4) and len(vision.cache) == 2


@torch.no_grad()
def test_a_generation_prompt_takes_the_encoder_graph_path_and_generates_as_eager(tiny_dir, tokenizer):
    from tests.engine.hf.graphs.test_decoder import greedy_generations

    eager, graphed = make_tiny_reader(tiny_dir, flat_turn=False).runner, graphed_runner(tiny_dir)
    spec, (a, b) = greedy_generations(tokenizer, eager, graphed)
    prompt = spec.prompt
    assert len(prompt.ids) < graphed.text_config.sliding_window
    assert a.ids == b.ids and a.passes == b.passes and a.prompt_tokens == b.prompt_tokens
    assert graphed.stats["encoder_graph_replays"] == 1 and eager.stats["encoder_graph_replays"] == 0
    # The prompt's KV in the LRU is not touched by the blocks the generation committed after it.
    cached = graphed.prompts.get(prompt.cache_key)
    assert cached is not None and all(k.shape[2] == len(prompt.ids) for k, _ in cached.layers)
    again = graphed.generate(spec, 32)  # the LRU serves the second one: no encoder pass
    assert again.ids == b.ids and graphed.stats["encoder_graph_replays"] == 1


@torch.no_grad()
def test_a_long_or_image_generation_prompt_stays_on_the_eager_pass(tiny_dir, tokenizer):
    graphed = graphed_runner(tiny_dir)
    window = int(graphed.text_config.sliding_window)

    def encoded_on_the_graph_path(prompt: Prompt) -> bool:
        """Whether starting a generation encoded its prompt on the encoder graphs' path (a replay)
        rather than in the eager pass: one encoder pass either way."""
        passes, replays = graphed.stats["encoder_passes"], graphed.stats["encoder_graph_replays"]
        graphed.start_generation(GenerateSpec(prompt, 16, (), seed=0), 32)
        assert graphed.stats["encoder_passes"] == passes + 1
        return graphed.stats["encoder_graph_replays"] == replays + 1

    long_prompt = text_prompt(tokenizer, window, "w")
    assert window <= len(long_prompt.ids) <= LENGTHS[-1]  # a bucket holds it: only the window keeps it eager
    assert not encoded_on_the_graph_path(long_prompt)
    image = ImageInput(jpeg((30, 200, 30)), "image/jpeg", "frame")
    assert not encoded_on_the_graph_path(Prompt(tuple(tokenizer.render_chat("Look.", "ahead?", 1, False)), (image,)))
    assert encoded_on_the_graph_path(Prompt(tuple(tokenizer.render_chat("Think.", "a state", 0, True))))


def test_kv_is_copied_token_major_in_the_rows_own_structure():
    """copy_rows: copies laid out [rows, tokens, heads, dim] (a row's KV one contiguous block, so a
    batch's copies can take foreach's fast path), equal to their sources whatever their layout, in
    the rows' own structure."""
    from app.engine.hf.graphs.encoder import copy_all, copy_rows

    generator = torch.Generator().manual_seed(0)
    head_major = torch.randn(1, 4, 7, 8, generator=generator)
    token_major_source = torch.randn(2, 9, 4, 8, generator=generator).transpose(1, 2)[1:2, :, 2:7]
    rows = [[(head_major, token_major_source)], [(token_major_source, head_major), (head_major, head_major)]]
    copies = copy_rows(rows)
    assert [len(layers) for layers in copies] == [1, 2]
    for layers, copied in zip(rows, copies):
        for pair, copied_pair in zip(layers, copied):
            for source, copy in zip(pair, copied_pair):
                assert torch.equal(copy, source)
                assert copy.transpose(1, 2).is_contiguous()  # token-major storage
    targets = [torch.zeros(4, 7, 8), torch.zeros(2, 9, 4, 8).transpose(1, 2)[0, :, 2:7]]
    copy_all(targets, [head_major[0], token_major_source[0]])
    assert torch.equal(targets[0], head_major[0]) and torch.equal(targets[1], token_major_source[0])
