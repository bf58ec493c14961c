"""TORCH_COMPILE (app/engine/hf/compiled.py, app/engine/hf/layers.py), on the CPU with torch.compile's
`aot_eager` backend (it traces and runs what inductor would compile, in seconds): the split layers
read exactly what the library's layers read, eager and compiled, no piece recompiles per layer, the
warm-up leaves nothing behind, and the engine thread gets the compile limits (torch keeps them per
thread)."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from types import SimpleNamespace

import pytest
import torch

from app.engine.base import GenerateSpec, Prompt
from app.engine.hf import compiled
from tests.conftest import make_tiny_reader
from tests.engine.hf.test_reader import spec_for
from tests.engine.hf.test_scheduling import FakeRunner, make_reader
from tests.engine.hf.test_scheduling import spec as tagged_spec


def logprobs(results):
    return [[slot.label_logprobs for canvas in result.slots for slot in canvas] for result in results]


@torch.no_grad()
def test_the_split_layers_read_what_the_library_layers_read(tiny_dir, tokenizer):
    from app.engine.hf import layers

    library, split = make_tiny_reader(tiny_dir, flat_turn=False).runner, make_tiny_reader(tiny_dir, flat_turn=False).runner
    specs = [spec_for(tokenizer, "state one", "q1: yes\nq2: no", [42, 7]),
             spec_for(tokenizer, "another state, longer than the first", "q1: yes", [5], steps=2, seed=3)]
    layers.install(compiled.model_layers(split.model))
    assert all(getattr(layer.forward, "djev_split", False) for layer in compiled.model_layers(split.model))
    # The same ops in the same order but the decoder's attention, which stacks the query heads of a
    # KV head (grouped_attention): SDPA then blocks its rows differently, fp32 rounding apart.
    got, expected = logprobs(split.read(specs)), logprobs(library.read(specs))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    generation = GenerateSpec(Prompt(tuple(tokenizer.render_chat("Think.", "a state", 0, thinking=True))), 16, (),
                              seed=5, temperature=0.0)
    assert split.generate(generation, 16) == library.generate(generation, 16)


@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_grouped_attention_is_sdpa_over_repeated_kv_heads(kv_heads):
    from transformers.integrations.sdpa_attention import repeat_kv

    from app.engine.hf.layers import grouped_attention

    generator = torch.Generator().manual_seed(kv_heads)
    queries = torch.randn(3, 4, 5, 8, generator=generator)
    keys, values = (torch.randn(3, kv_heads, 7, 8, generator=generator) for _ in range(2))
    mask = torch.rand(3, 1, 5, 7, generator=generator) > 0.4
    mask[..., 0] = True  # every query row reads at least one key
    expected = torch.nn.functional.scaled_dot_product_attention(
        queries, repeat_kv(keys, 4 // kv_heads), repeat_kv(values, 4 // kv_heads), attn_mask=mask, scale=0.3)
    got = grouped_attention(queries, keys, values, mask, 0.3)
    assert got.shape == (3, 5, 4, 8)  # [batch, tokens, heads, dim], as the library's attention returns
    torch.testing.assert_close(got, expected.transpose(1, 2), rtol=1e-6, atol=1e-6)


def test_grouped_attention_is_taken_only_for_masked_grouped_sdpa():
    from transformers import PretrainedConfig

    from app.engine.hf.layers import uses_grouped_attention

    def attention(implementation):
        return SimpleNamespace(config=PretrainedConfig(attn_implementation=implementation))

    queries, keys = torch.zeros(2, 4, 3, 8), torch.zeros(2, 2, 6, 8)
    mask = torch.ones(2, 1, 3, 6, dtype=torch.bool)
    assert uses_grouped_attention(attention("sdpa"), queries, keys, mask)
    assert not uses_grouped_attention(attention("eager"), queries, keys, mask)
    assert not uses_grouped_attention(attention("sdpa"), queries, keys, None)  # SDPA's own grouped kernels run
    assert not uses_grouped_attention(attention("sdpa"), queries, torch.zeros(2, 4, 6, 8), mask)  # no groups
    assert not uses_grouped_attention(attention("sdpa"), queries[:, :, :1], keys, mask[:, :, :1])  # one query token
    assert not uses_grouped_attention(attention("sdpa"), queries, keys, mask.expand(2, 4, 3, 6))  # a mask per head


@torch.no_grad()
def test_compiled_layers_read_exactly_what_the_eager_split_layers_read(tiny_dir, tokenizer):
    import torch._dynamo.utils

    from app.engine.hf import layers as split_layers

    eager, runner = make_tiny_reader(tiny_dir, flat_turn=False).runner, make_tiny_reader(tiny_dir, flat_turn=False).runner
    specs = [spec_for(tokenizer, "state one", "q1: yes\nq2: no", [42, 7]),
             spec_for(tokenizer, "another state, longer than the first", "q1: yes", [5], steps=2, seed=3)]
    split_layers.install(compiled.model_layers(eager.model))  # the split forward, eager
    expected = eager.read(specs)

    layers = compiled.model_layers(runner.model)
    assert compiled.compile_layers(runner.model, backend="aot_eager") == len(layers)
    assert all(getattr(layer.forward, "djev_split", False) for layer in layers)

    torch._dynamo.utils.counters.clear()
    got = runner.read(specs) + runner.read(specs[:1])  # two batch shapes: static, then dynamic
    assert logprobs(got[:2]) == logprobs(expected)
    assert logprobs(got[2:]) == logprobs(expected[:1])
    # One body per piece, layer kind and input layout, shared by every layer: a per-layer compile
    # would make hundreds of graphs here (12 layers x 2 pieces x shapes).
    assert 0 < torch._dynamo.utils.counters["stats"]["unique_graphs"] <= 16
    assert not torch._dynamo.utils.counters["graph_break"]


def test_warm_up_reads_then_leaves_no_prompt_or_counter_behind(tiny_dir):
    runner = make_tiny_reader(tiny_dir, flat_turn=False).runner
    read, specs = runner.read, []
    runner.read = lambda batch, *rest: (specs.extend(batch), read(batch, *rest))[1]
    seconds = compiled.warm_up(runner, canvas_length=16)
    assert seconds > 0
    # rows 1 and 2, a long prompt in chunks (three: the first, a full one, a short last), an image,
    # then a two-step read of several canvases (its second step the eager self-conditioned pass)
    assert [len(spec.prompt.images) for spec in specs] == [0, 0, 0, 0, 1, 0]
    assert specs[5].steps == 2 and len(specs[5].canvases) == compiled.WARM_UP_CANVASES > 1
    long = specs[3].prompt
    assert len(long.ids) == 2 * runner.prefill_chunk + 64 and runner.prefill_chunk < len(long.ids)
    assert len(runner.prompts) == 0 and len(runner.vision) == 0
    assert not runner.stats


@torch.no_grad()
def test_compiled_vision_layers_see_exactly_what_the_library_sees(tiny_dir):
    import io

    from PIL import Image

    from app.engine.base import ImageInput

    eager, runner = make_tiny_reader(tiny_dir, flat_turn=False).runner, make_tiny_reader(tiny_dir, flat_turn=False).runner
    buffer = io.BytesIO()
    Image.new("RGB", (80, 60), (200, 40, 90)).save(buffer, "JPEG")
    prompt = Prompt((5, 6, int(eager.config.image_token_id), 7), (ImageInput(buffer.getvalue(), "image/jpeg"),))

    def features(reader_runner):
        inputs = reader_runner.model_inputs(prompt)
        return reader_runner.input_embeds(inputs)

    expected = features(eager)
    compiled.compile_layers(runner.model, backend="aot_eager")
    vision = compiled.vision_layers(runner.model)
    assert vision and all(getattr(layer.forward, "djev_split", False) for layer in vision)
    assert torch.equal(features(runner), expected)


def test_compile_limits_are_set_on_the_calling_thread_and_the_engine_thread():
    import torch._dynamo

    seen: list[int] = []
    thread = threading.Thread(target=lambda: seen.append(torch._dynamo.config.recompile_limit))
    compiled.configure_thread()
    assert torch._dynamo.config.recompile_limit >= compiled.RECOMPILE_LIMIT
    assert torch._dynamo.config.suppress_errors
    thread.start()
    thread.join()
    assert seen[0] < compiled.RECOMPILE_LIMIT  # torch keeps these per thread: hence the engine thread's own call

    async def engine_thread_limit(on_cuda: bool) -> int:
        runner = FakeRunner(delay=0)
        runner.device = SimpleNamespace(type="cuda" if on_cuda else "cpu")
        limits, plain_read = [], runner.read

        def read_noting_the_limit(specs, preprocessed=None):  # runs on the engine thread
            limits.append(torch._dynamo.config.recompile_limit)
            return plain_read(specs, preprocessed)

        runner.read = read_noting_the_limit
        reader = make_reader(runner)
        reader.options = dataclasses.replace(reader.options, torch_compile=True)
        await reader.start()
        try:
            await reader.read([tagged_spec(1)])
        finally:
            await reader.stop()
        return limits[0]

    assert asyncio.run(engine_thread_limit(on_cuda=True)) >= compiled.RECOMPILE_LIMIT
    assert asyncio.run(engine_thread_limit(on_cuda=False)) < compiled.RECOMPILE_LIMIT  # the CPU engine never compiles


def test_the_flat_turn_compiles_the_vision_layers_alone(tiny_dir):
    runner = make_tiny_reader(tiny_dir, flat_turn=True).runner
    assert compiled.compile_layers(runner.model, backend="aot_eager", text=False) == 0
    from app.engine.hf.parts import decoder_layers

    # (the encoder's layers have the eager split forward every reader gives them: a long prompt's chunks)
    assert not any(getattr(layer.forward, "djev_split", False) for layer in decoder_layers(runner.model))
    vision = compiled.vision_layers(runner.model)
    assert vision and all(getattr(layer.forward, "djev_split", False) for layer in vision)
