"""The hf engine on the tiny model: reads batched in one turn equal single reads, concurrent decisions
share turns, a repeated prompt is read from the KV store, steps and generation are seeded."""

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
    """A reader of its own: this module counts its encoder and decoder passes (turns that wrote prompt
    KV, turns that read canvases)."""
    from tests.conftest import make_tiny_reader

    return make_tiny_reader(tiny_dir)


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
                assert slot_a.label_logprobs == pytest.approx(slot_b.label_logprobs, abs=1e-5)


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


def test_a_repeated_prompt_is_read_from_the_kv_store(tiny_reader, tokenizer):
    from tests.conftest import REPEAT_TOLERANCE

    spec = spec_for(tokenizer, "the same state every time", "q1: yes", [1])
    store = tiny_reader.runner.flat.store

    async def twice():
        first = await tiny_reader.read([spec])
        hits = store.stats["hit_tokens"]
        second = await tiny_reader.read([spec])
        return first, second, store.stats["hit_tokens"] - hits

    first, second, hit = run(started(tiny_reader, twice))
    size = store.block_tokens
    assert hit == len(spec.prompt.ids) // size * size > 0  # every whole block of it: only its tail written again
    assert tiny_reader.stats["kv_hits"] == 1 and tiny_reader.stats["kv_misses"] == 1
    assert first[0].prompt_tokens == second[0].prompt_tokens
    (a,), (b,) = first[0].slots[0], second[0].slots[0]
    assert a.argmax_id == b.argmax_id and a.label_logprobs == pytest.approx(b.label_logprobs, abs=REPEAT_TOLERANCE)


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

    reader = make_tiny_reader(tiny_dir, max_prompt_tokens=100)
    short = spec_for(tokenizer, "short", "q1: yes", [1])
    long = spec_for(tokenizer, "word " * 300, "q1: yes", [1])

    async def both():
        ok, bad = await asyncio.gather(reader.read([short]), reader.read([long]), return_exceptions=True)
        return ok, bad

    ok, bad = run(started(reader, both))
    assert isinstance(bad, EngineInputError) and bad.error_type == "max_tokens_exceeded" and bad.status == 400
    assert len(ok) == 1 and ok[0].prompt_tokens < 100
    assert reader.stats["kv_misses"] == 1  # refused before it was queued: only the short prompt was prepared


def test_a_stopped_reader_refuses_work(tiny_reader, tokenizer):
    from app.engine.base import EngineUnavailable

    with pytest.raises(EngineUnavailable):
        run(tiny_reader.read([spec_for(tokenizer, "x", "q1: yes", [1])]))


def test_batched_prefill_equals_single_prefill(tiny_dir, tokenizer):
    """Uncached prompts of different lengths (longer and shorter than the sliding window) are written in
    one turn; the reads equal reads of each prompt written alone."""
    from tests.conftest import make_tiny_reader

    specs = [
        spec_for(tokenizer, "tiny", "q1: yes", [5]),
        spec_for(tokenizer, "a state past the sliding window " * 12, "q1: yes", [9, 10]),
        spec_for(tokenizer, "medium sized state here", "q1: no\nq2: yes", [100]),
    ]
    alone_reader, batch_reader = make_tiny_reader(tiny_dir), make_tiny_reader(tiny_dir)

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
                assert slot_a.label_logprobs == pytest.approx(slot_b.label_logprobs, abs=1e-5)


def test_loading_sets_the_heap_aside_from_the_collectors_passes(tiny_dir):
    import gc

    from tests.conftest import make_tiny_reader

    gc.unfreeze()
    reader = make_tiny_reader(tiny_dir)
    frozen = gc.get_freeze_count()
    assert frozen > 10_000  # the model, the libraries: out of every later full pass
    assert not any(obj is reader.runner.model for obj in gc.get_objects(generation=2))


def test_a_read_of_more_canvases_than_a_turn_reads_takes_turns_of_max_batch_rows(tiny_dir, tokenizer):
    """The canvases of one read go through turns of at most MAX_BATCH_ROWS canvases, each turn a step
    of its own (a yield between two), and read what one turn reads."""
    from app.engine.hf.layout import Kind
    from tests.conftest import make_tiny_reader

    spec = spec_for(tokenizer, "a long state " * 20, "q1: yes", list(range(100, 110)))
    expected = make_tiny_reader(tiny_dir).runner.read([spec])[0]
    runner = make_tiny_reader(tiny_dir, max_batch_rows=3).runner
    sizes: list[int] = []
    run_turn = runner.flat.turn.run

    def counted(parts):
        sizes.append(sum(1 for part in parts if part.kind is Kind.CANVAS))
        return run_turn(parts)

    runner.flat.turn.run = counted
    steps = runner.read_steps([spec])
    turns = 0
    try:
        while True:
            next(steps)
            turns += 1
    except StopIteration as done:
        got = done.value[0]
    assert sizes == [3, 3, 3, 1] and turns == 3  # a yield between two turns
    for a, b in zip(expected.slots, got.slots, strict=True):
        assert a[0].argmax_id == b[0].argmax_id
        assert a[0].label_logprobs == pytest.approx(b[0].label_logprobs, abs=1e-5)
