"""A capture's run before recording (app/engine/hf/graphs/cache.py `capture`'s `first`): the text
passes run only the first layer of each attention type there (app/engine/hf/parts.py
`first_layers`), then record the whole stack. On the CPU, with `capture` stood in for (it needs
CUDA): which layers each run went through, and that the stack is whole again after."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from app.engine.hf.graphs import decoder as decoder_module
from app.engine.hf.graphs import encoder as encoder_module
from app.engine.hf.parts import decoder_layers, encoder_layers, first_layers, pattern_length
from tests.engine.hf.graphs.test_decoder import static_runner
from tests.engine.hf.graphs.test_encoder import graphed_runner

SLIDING, FULL = "sliding_attention", "full_attention"


def test_the_pattern_is_as_long_as_the_first_layer_of_its_last_new_type():
    assert pattern_length([SLIDING] * 5 + [FULL] + [SLIDING] * 5 + [FULL] * 2) == 6  # DiffusionGemma's 5:1
    assert pattern_length([FULL, SLIDING, SLIDING]) == 2
    assert pattern_length([SLIDING] * 4) == 1


def layer_calls(layers) -> tuple[list[int], list]:
    """Each layer's index, appended whenever it runs (forward hooks), and the hooks' handles."""
    seen: list[int] = []
    handles = [layer.register_forward_hook(lambda module, args, out, index=index: seen.append(index))
               for index, layer in enumerate(layers)]
    return seen, handles


@torch.no_grad()
def test_first_layers_runs_that_many_and_gives_the_whole_stack_back(tiny_dir):
    runner = graphed_runner(tiny_dir)
    stack = runner.model.model.encoder.language_model
    whole = stack.layers
    seen, handles = layer_calls(whole)
    embeds = torch.randn(1, 5, runner.text_config.hidden_size)
    try:
        with first_layers(stack, 2):
            stack(inputs_embeds=embeds)
        assert seen == [0, 1]
        seen.clear()
        with pytest.raises(RuntimeError), first_layers(stack, 3):
            raise RuntimeError("a failed run")
        assert stack.layers is whole  # given back after a failure too
        stack(inputs_embeds=embeds)
        assert seen == list(range(len(whole)))
    finally:
        for handle in handles:
            handle.remove()


def fake_capture(runs: list[str], seen: list[int]):
    """A stand-in for `capture` on the CPU: the run before recording where there is one (`first`),
    then the recorded pass, noting which layers each went through."""
    def capture(forward, pool, device, *, first, times=None):
        for name, call in ((("first", first),) if first is not None else ()) + (("recorded", forward),):
            seen.clear()
            output = call()
            runs.append(f"{name}: {seen}")
        return None, output
    return capture


@torch.no_grad()
@pytest.mark.parametrize("kind", ["encoder", "decoder"])
def test_a_capture_runs_the_pattern_first_then_records_every_layer(tiny_dir, monkeypatch, kind):
    if kind == "encoder":
        runner = graphed_runner(tiny_dir)
        graphs, module, layers = runner.encoder_graphs, encoder_module, encoder_layers(runner.model)
        keys = [(1, 32, 0), (1, 32, 32), (2, 32, 0)]
    else:
        runner = static_runner(tiny_dir)
        graphs, module, layers = runner.graphs, decoder_module, decoder_layers(runner.model)
        keys = [(1, 16, 256, 64, False), (1, 16, 512, 64, False), (2, 16, 256, 64, False)]
    assert graphs is not None and len(layers) == 6
    runs: list[str] = []
    seen, handles = layer_calls(layers)
    monkeypatch.setattr(module, "capture", fake_capture(runs, seen))
    graphs.pattern = 2  # the tiny model's 6 layers are one pattern
    monkeypatch.setattr(module.torch.cuda, "memory_allocated", lambda device=None: 0)
    graphs.capture = True
    graphs.stats = Counter()
    try:
        for key in keys:
            assert graphs.prepare(key)
    finally:
        for handle in handles:
            handle.remove()
    whole = f"recorded: {list(range(6))}"
    # The first key of each pieces value runs first (the second encoder key is over a prefix, the
    # second decoder key only reads a longer KV: recorded straight away), through two layers.
    expected_second = ["first: [0, 1]", whole] if kind == "encoder" else [whole]
    assert runs == ["first: [0, 1]", whole, *expected_second, "first: [0, 1]", whole]
    assert graphs.captures == len(keys)
