"""The decoder-graph path (app/engine/hf/graphs/decoder.py) run eagerly on the CPU (capture=False) with
self-conditioning: multi-step reads and generation's denoise passes through the static buffers
equal the plain eager passes; every graph views one set of KV buffers."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from app.engine.base import GenerateSpec, Prompt
from app.engine.hf.graphs.decoder import DecoderGraphs
from tests.conftest import make_tiny_reader
from tests.engine.hf.test_reader import spec_for


def static_runner(tiny_dir, **policy):
    """The tiny model's runner with decoder graphs run eagerly (capture=False), over its shape policy
    with these fields changed."""
    runner = make_tiny_reader(tiny_dir, flat_turn=False).runner
    runner.policy = dataclasses.replace(runner.policy, **policy)
    runner.graphs = DecoderGraphs(runner.model, runner.layer_types, runner.device, pad_id=runner.pad_id,
                                  capture=False, policy=runner.policy, stats=runner.stats)
    return runner


@torch.no_grad()
def test_multi_step_reads_replay_conditioned_graphs_and_equal_the_eager_path(tiny_dir, tokenizer):
    eager, static = make_tiny_reader(tiny_dir, flat_turn=False).runner, static_runner(tiny_dir, conditioned_rows=4)
    specs = [spec_for(tokenizer, "state one", "q1: yes\nq2: no", [42, 7], steps=3, seed=9),
             spec_for(tokenizer, "another state, longer than the first", "q1: yes", [5], steps=3, seed=2)]
    expected = eager.read(specs)
    got = static.read(specs)
    assert static.stats["graph_replays"] == 3  # every step, the later two with self-conditioning
    assert any(key[4] for key in static.graphs.cache) and any(not key[4] for key in static.graphs.cache)
    # Each step's sampled slot ids agree; the tiny model's wide random weights amplify float32
    # rounding about 100x per self-conditioned step (3e-6 -> 2e-4 -> 1e-2), so the last step's
    # log-probabilities agree to 0.05, while one pass agrees to 1e-4 (below).
    for a, b in zip(expected, got):
        for canvas_a, canvas_b in zip(a.slots, b.slots):
            for slot_a, slot_b in zip(canvas_a, canvas_b):
                assert slot_a.argmax_id == slot_b.argmax_id
                assert slot_a.label_logprobs == pytest.approx(slot_b.label_logprobs, abs=0.05)
    encoded = static.encode_many([specs[0].prompt])[0]
    rows = [(encoded, list(canvas)) for canvas in specs[0].canvases]
    conditioning = torch.randn(len(rows), len(rows[0][1]), static.vocab_size, generator=torch.Generator().manual_seed(0))
    static_hidden = static.graphs.hidden(rows, conditioning)
    static.graphs = None  # the eager decoder pass, for comparison
    eager_hidden = static.decoder_hidden(rows, conditioning)
    assert torch.allclose(static_hidden, eager_hidden, atol=1e-4)


def greedy_generations(tokenizer, *runners):
    """The same greedy 40-token thought from each runner (4 denoise passes a block at most): greedy, so
    that float32 rounding cannot flip a random draw or an entropy-bound acceptance (sampled runs diverge
    after a few passes on this tiny model, whose passes agree to 1e-5); two blocks, the second reading
    the committed first. Returns the spec and the results."""
    for runner in runners:
        runner.generation["max_denoising_steps"] = 4
    prompt = Prompt(tuple(tokenizer.render_chat("Think.", "a state", 0, thinking=True)))
    spec = GenerateSpec(prompt, 40, (), seed=11, temperature=0.0)
    return spec, [runner.generate(spec, 32) for runner in runners]


@torch.no_grad()
def test_generation_on_the_graph_path_equals_eager_generation(tiny_dir, tokenizer):
    eager, static = make_tiny_reader(tiny_dir, flat_turn=False).runner, static_runner(tiny_dir)
    _, (a, b) = greedy_generations(tokenizer, eager, static)
    assert a.ids == b.ids and a.passes == b.passes
    assert static.stats["graph_replays"] == b.passes and eager.stats["graph_replays"] == 0
    assert any(key[4] for key in static.graphs.cache)  # self-conditioned passes replayed graphs too


@torch.no_grad()
def test_graphs_share_one_set_of_kv_buffers_and_bound_conditioning(tiny_dir, tokenizer):
    runner = static_runner(tiny_dir, conditioned_rows=0)
    encoded = runner.encode_many([spec_for(tokenizer, "s", "q1: yes", [1]).prompt])[0]
    canvas = list(spec_for(tokenizer, "s", "q1: yes", [1]).canvases[0])
    runner.graphs.hidden([(encoded, canvas)])
    runner.graphs.hidden([(encoded, canvas)] * 3)
    first, second = runner.graphs.cache.graphs()
    assert first.keys[0].data_ptr() == second.keys[0].data_ptr()  # views of the same storage
    # The storage holds the policy's decoder_slots tokens of every layer's KV (prompt and canvas), no more.
    per_token = sum(k.shape[1] * k.shape[3] + v.shape[1] * v.shape[3] for k, v in encoded.layers)
    assert runner.graphs.memory_bytes == runner.policy.decoder_slots * per_token * encoded.layers[0][0].element_size()
    conditioning = torch.zeros(1, len(canvas), runner.vocab_size)
    assert runner.graphs.hidden([(encoded, canvas)], conditioning) is None  # past conditioned_rows: eager
    assert runner.stats["decoder_graph_fallbacks"] == 1


@torch.no_grad()
def test_a_graph_pass_writes_the_canvas_kv_after_the_prompt_instead_of_concatenating(tiny_dir, tokenizer, monkeypatch):
    """The static path's decoder attention writes each layer's canvas KV into the buffer after the
    prompt (graphs.CanvasKV) and reads the same as the eager pass, which still concatenates."""
    from transformers.cache_utils import DynamicLayer

    concatenated = []
    original_cat = torch.cat

    def counting_cat(tensors, *args, **kwargs):
        dim = kwargs.get("dim", args[0] if args else 0)
        if any(getattr(t, "ndim", 0) == 4 for t in tensors) and dim in (2, -2):  # along the tokens
            concatenated.append(len(tensors))
        return original_cat(tensors, *args, **kwargs)

    static = static_runner(tiny_dir)
    spec = spec_for(tokenizer, "a state", "q1: yes\nq2: no", [42, 7], seed=3)
    rows = [(static.encode_many([spec.prompt])[0], list(canvas)) for canvas in spec.canvases]
    static.graphs.hidden(rows)  # builds the graph (its cache's set-up concatenates once)
    monkeypatch.setattr(torch, "cat", counting_cat)
    got = static.graphs.hidden(rows)
    in_place = len(concatenated)
    static.graphs, graphs = None, static.graphs  # the eager decoder pass, for comparison
    want = static.decoder_hidden(rows)
    monkeypatch.undo()
    assert in_place == 0 and len(concatenated) > 0  # the eager pass still concatenates
    assert torch.allclose(got, want, atol=1e-4)
    graph = next(iter(graphs.cache.graphs()))
    for index, layer in enumerate(graph.cache.layers):
        assert isinstance(layer, DynamicLayer)
        buffers = layer.canvas_kv
        assert buffers.keys.shape[2] == buffers.length + graph.width
        assert buffers.keys[:, :, :buffers.length].data_ptr() == graph.keys[index].data_ptr()
        assert buffers.keys[:, :, buffers.length:].abs().sum() > 0  # the canvas's KV landed there
