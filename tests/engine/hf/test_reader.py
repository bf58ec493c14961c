"""The hf engine on the tiny model: batched decoder passes equal single reads, concurrent decisions
share passes, prompts are encoded once, steps and generation are seeded."""

from __future__ import annotations

import asyncio

import pytest

from app import build
from app.config import Settings
from app.decisions.request import parse_decision
from app.decisions.run import Decider
from app.engine.base import EngineInputError, GenerateSpec, Prompt, ReadSpec
from tests.conftest import LIMITS


def run(coro):
    return asyncio.run(coro)


async def started(reader, coro_factory):
    await reader.start()
    try:
        return await coro_factory()
    finally:
        await reader.stop()



@pytest.fixture
def tiny_reader(tiny_dir):
    """The row path's reader: this module counts its encoder and decoder passes."""
    from tests.conftest import make_tiny_reader

    return make_tiny_reader(tiny_dir, flat_turn=False)


def spec_for(tokenizer, state: str, answer: str, noise: list[int], steps: int = 1, seed: int = 0) -> ReadSpec:
    prompt = Prompt(tuple(tokenizer.render_chat("Answer.", state, 0, thinking=False)))
    template = tokenizer.encode(answer)
    width = 16 * ((len(template) + 1 + 15) // 16)
    base = template + [tokenizer.turn_close_id] + [tokenizer.pad_id] * (width - len(template) - 1)
    slots = (len(template) - 1,)
    canvases = []
    for token in noise:
        canvas = list(base)
        canvas[slots[0]] = token
        canvases.append(tuple(canvas))
    labels = (tuple(tokenizer.encode(" yes")), tuple(tokenizer.encode(" no")))
    return ReadSpec(prompt, tuple(canvases), slots, ((labels[0][0], labels[1][0]),), steps, seed)


def test_a_batched_pass_equals_single_reads(tiny_reader, tokenizer):
    specs = [
        spec_for(tokenizer, "short state", "q1: yes", [5, 77]),
        spec_for(tokenizer, "a much longer state " * 12, "q1: yes", [9]),
        spec_for(tokenizer, "third", "q1: no\nq2: yes\nq3: yes\nq4: yes\nq5: yes\nq6: yes", [100, 200, 300]),
    ]

    async def both():
        alone = [(await tiny_reader.read([spec]))[0] for spec in specs]
        passes = tiny_reader.stats.get("decoder_passes", 0)
        together = await tiny_reader.read(specs)
        return alone, together, tiny_reader.stats["decoder_passes"] - passes

    alone, together, passes = run(started(tiny_reader, both))
    assert passes == 1
    for single, batched in zip(alone, together):
        assert single.prompt_tokens == batched.prompt_tokens
        for canvas_a, canvas_b in zip(single.slots, batched.slots):
            for slot_a, slot_b in zip(canvas_a, canvas_b):
                assert slot_a.argmax_id == slot_b.argmax_id
                assert slot_a.label_logprobs == pytest.approx(slot_b.label_logprobs, abs=1e-4)


def test_concurrent_decisions_share_decoder_passes(tiny_reader):
    decider = Decider(tiny_reader, build.read_settings(Settings()))
    bodies = [parse_decision({"state": f"ticket number {i}", "samples": 2, "questions": {
        "urgent": {"type": "noul", "instructions": "Urgent?"},
        "team": {"type": "choice", "criteria": {"billing": None, "outage": None}},
    }}, LIMITS) for i in range(8)]

    async def many():
        before = dict(tiny_reader.stats)
        outcomes = await asyncio.gather(*(decider.decide(body) for body in bodies))
        after = tiny_reader.stats
        return outcomes, after["decoder_passes"] - before.get("decoder_passes", 0), after["reads"] - before.get("reads", 0)

    outcomes, passes, reads = run(started(tiny_reader, many))
    assert len(outcomes) == 8 and reads == 8
    assert passes < 8, f"8 concurrent decisions took {passes} decoder passes"


def test_a_repeated_prompt_is_encoded_once(tiny_reader, tokenizer):
    spec = spec_for(tokenizer, "the same state every time", "q1: yes", [1])

    async def twice():
        before = tiny_reader.stats.get("encoder_passes", 0)
        first = await tiny_reader.read([spec])
        second = await tiny_reader.read([spec])
        return first, second, tiny_reader.stats["encoder_passes"] - before

    first, second, encodes = run(started(tiny_reader, twice))
    assert encodes == 1 and first == second
    assert tiny_reader.stats["kv_hits"] >= 1


def test_steps_move_only_the_slots_and_are_seeded(tiny_reader, tokenizer):
    one = spec_for(tokenizer, "state", "q1: yes", [42], steps=1)
    three = spec_for(tokenizer, "state", "q1: yes", [42], steps=3, seed=9)

    async def reads():
        return [(await tiny_reader.read([s]))[0] for s in (one, three, three)]

    r1, r3, r3_again = run(started(tiny_reader, reads))
    assert r3 == r3_again
    assert r3.slots != r1.slots


def test_sampler_pieces():
    import torch

    from app.engine.hf.sampler import (
        entropy_bound_accept,
        gumbel_argmax,
        temperature_at,
    )

    flat = torch.zeros(4, 1000)
    draws = {tuple(gumbel_argmax(flat, torch.Generator().manual_seed(seed)).tolist()) for seed in range(5)}
    assert len(draws) == 5  # a flat distribution: the seed decides
    peaked = torch.full((4, 1000), -50.0)
    peaked[:, 7] = 50.0
    assert gumbel_argmax(peaked, torch.Generator().manual_seed(0)).tolist() == [7, 7, 7, 7]
    accepted = entropy_bound_accept(torch.tensor([0.5, 0.01, 0.02, 0.3]), bound=0.1)
    assert accepted.tolist() == [False, True, True, True]  # 0.01 + 0.02 + 0.3 less the largest is within 0.1
    assert entropy_bound_accept(torch.tensor([2.0, 3.0]), bound=0.1).tolist() == [True, False]
    assert temperature_at(48, 48, 0.4, 0.8) == pytest.approx(0.8)
    assert temperature_at(1, 48, 0.4, 0.8) == pytest.approx(0.4 + 0.4 / 48)


def test_generation_is_seeded_and_bounded(tiny_reader, tokenizer):
    prompt = Prompt(tuple(tokenizer.render_chat("Think.", "state", 0, thinking=True)) + tuple(tokenizer.thought_open))

    async def gens():
        a = await tiny_reader.generate(GenerateSpec(prompt, 20, tuple(tokenizer.thought_close), seed=1))
        b = await tiny_reader.generate(GenerateSpec(prompt, 20, tuple(tokenizer.thought_close), seed=1))
        c = await tiny_reader.generate(GenerateSpec(prompt, 20, tuple(tokenizer.thought_close), seed=2))
        return a, b, c

    a, b, c = run(started(tiny_reader, gens))
    assert a == b and a.ids != c.ids
    assert len(a.ids) <= 20 and all(t not in tokenizer.thought_close for t in a.ids)
    assert a.prompt_tokens == len(prompt.ids)


def test_generation_stops_at_a_stop_id(tiny_reader, tokenizer):
    prompt = Prompt(tuple(tokenizer.render_chat("Think.", "state", 0, thinking=True)))

    async def gen():
        free = await tiny_reader.generate(GenerateSpec(prompt, 40, (), seed=3))
        stop = free.ids[5]
        cut = await tiny_reader.generate(GenerateSpec(prompt, 40, (stop,), seed=3))
        return free, cut, stop

    free, cut, stop = run(started(tiny_reader, gen))
    assert cut.stopped and cut.ids == free.ids[: free.ids.index(stop)]


def test_a_prompt_past_the_limit_fails_alone(tiny_dir, tokenizer):
    from tests.conftest import make_tiny_reader

    reader = make_tiny_reader(tiny_dir, flat_turn=False, max_prompt_tokens=100)
    short = spec_for(tokenizer, "short", "q1: yes", [1])
    long = spec_for(tokenizer, "word " * 300, "q1: yes", [1])

    async def both():
        ok, bad = await asyncio.gather(reader.read([short]), reader.read([long]), return_exceptions=True)
        return ok, bad

    ok, bad = run(started(reader, both))
    assert isinstance(bad, EngineInputError) and bad.error_type == "max_tokens_exceeded"
    assert len(ok) == 1 and ok[0].prompt_tokens < 100


def test_a_stopped_reader_refuses_work(tiny_reader, tokenizer):
    from app.engine.base import EngineUnavailable

    with pytest.raises(EngineUnavailable):
        run(tiny_reader.read([spec_for(tokenizer, "x", "q1: yes", [1])]))


def test_batched_prefill_equals_single_prefill(tiny_dir, tokenizer):
    """Uncached prompts of different lengths (longer and shorter than the sliding window) share one
    left-padded encoder pass; the reads equal reads of each prompt encoded alone."""
    from tests.conftest import make_tiny_reader

    specs = [
        spec_for(tokenizer, "tiny", "q1: yes", [5]),
        spec_for(tokenizer, "a state past the sliding window " * 12, "q1: yes", [9, 10]),
        spec_for(tokenizer, "medium sized state here", "q1: no\nq2: yes", [100]),
    ]
    alone_reader, batch_reader = make_tiny_reader(tiny_dir, flat_turn=False), make_tiny_reader(tiny_dir, flat_turn=False)

    async def alone():
        return [(await alone_reader.read([spec]))[0] for spec in specs]

    async def together():
        return await batch_reader.read(specs)

    single = run(started(alone_reader, alone))
    batched = run(started(batch_reader, together))
    assert batch_reader.stats["encoder_passes"] == 1 and alone_reader.stats["encoder_passes"] == 3
    for a, b in zip(single, batched):
        assert a.prompt_tokens == b.prompt_tokens
        for canvas_a, canvas_b in zip(a.slots, b.slots):
            for slot_a, slot_b in zip(canvas_a, canvas_b):
                assert slot_a.argmax_id == slot_b.argmax_id
                assert slot_a.label_logprobs == pytest.approx(slot_b.label_logprobs, abs=1e-3)


def test_the_static_buffer_path_of_cuda_graphs_equals_the_eager_pass(tiny_reader, tokenizer):
    """The graph path's bucketing (rows to a power of two, KV doubling from 256), left padding, masks
    and padding rows, run eagerly on the CPU (capture=False), give the eager pass's hidden states."""
    import torch

    from app.engine.hf.graphs.decoder import DecoderGraphs, bucket_length, bucket_rows

    assert [bucket_rows(n) for n in (1, 2, 3, 5, 33)] == [1, 2, 4, 8, 64]
    assert [bucket_length(n) for n in (1, 256, 257, 513)] == [256, 256, 512, 1024]
    runner = tiny_reader.runner
    specs = [
        spec_for(tokenizer, "short", "q1: yes", [5, 6]),
        spec_for(tokenizer, "a longer state that passes the sliding window " * 8, "q1: yes", [9]),
    ]
    with torch.no_grad():
        encoded = runner.encode_many([spec.prompt for spec in specs])
        rows = [(encoded[0], list(specs[0].canvases[0])), (encoded[0], list(specs[0].canvases[1])),
                (encoded[1], list(specs[1].canvases[0]))]
        eager = runner.decoder_hidden(rows)
        graphs = DecoderGraphs(runner.model, runner.layer_types, runner.device, pad_id=runner.pad_id, capture=False,
                               policy=runner.policy)
        static = graphs.hidden(rows)
        again = graphs.hidden(rows[:2])  # a smaller batch reuses... a different bucket, built once
    assert static.shape == eager.shape
    assert torch.allclose(static, eager, atol=1e-4)
    assert torch.allclose(again, eager[:2], atol=1e-4)
    assert len(graphs.cache) == 2 and not graphs.cache.failed


def test_loading_sets_the_heap_aside_from_the_collectors_passes(tiny_dir):
    import gc

    from tests.conftest import make_tiny_reader

    gc.unfreeze()
    reader = make_tiny_reader(tiny_dir, flat_turn=False)
    frozen = gc.get_freeze_count()
    assert frozen > 10_000  # the model, the libraries: out of every later full pass
    assert not any(obj is reader.runner.model for obj in gc.get_objects(generation=2))


def test_a_read_of_many_canvases_over_a_long_prompt_takes_passes_within_the_decoder_budget(tiny_dir, tokenizer):
    """The rows of one read go through the decoder in passes of at most `decoder_slots` tokens
    (rows x (prompt + canvas)), each pass a step of its own, and read what one pass reads."""
    import dataclasses

    from tests.conftest import make_tiny_reader

    runner = make_tiny_reader(tiny_dir, flat_turn=False).runner
    spec = spec_for(tokenizer, "a long state " * 20, "q1: yes", list(range(100, 110)))
    prompt = runner.encode(spec.prompt).length
    width = len(spec.canvases[0])
    expected = runner.read([spec])[0]
    runner.policy = dataclasses.replace(runner.policy, decoder_slots=3 * (prompt + width))
    sizes: list[int] = []
    real = runner.decoder_hidden

    def counted(rows, conditioning=None):
        sizes.append(len(rows))
        return real(rows, conditioning)

    runner.decoder_hidden = counted
    steps = runner.read_steps([spec])
    turns = 0
    try:
        while True:
            next(steps)
            turns += 1
    except StopIteration as done:
        got = done.value[0]
    assert sizes == [3, 3, 3, 1] and turns == 3  # a yield between two passes
    for a, b in zip(expected.slots, got.slots):
        assert a[0].label_logprobs == pytest.approx(b[0].label_logprobs, abs=1e-4)
