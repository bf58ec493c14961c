"""Step-wise generation and the one sampler step on the tiny model: stepping runs one turn a step,
equals the whole generation and, greedy, block diffusion over transformers' own forward; temperature
0 is greedy whatever the seed, top_p narrows every draw to its nucleus, passes are counted, bad
sampler fields are refused by name."""

from __future__ import annotations

import math

import pytest
import torch

from app.engine.base import EngineInputError, GenerateSpec, Prompt
from app.engine.hf.runner import run_steps
from app.engine.hf.sampler import nucleus, sample_step
from tests.conftest import make_tiny_reader
from tests.engine.hf.reference import reference_generate, reference_model

STEPS = 6  # denoise passes a block at most: enough to exercise the schedule, quick on a CPU


@pytest.fixture(scope="module")
def reader(tiny_dir):
    reader = make_tiny_reader(tiny_dir)
    reader.runner.generation["max_denoising_steps"] = STEPS
    return reader


@pytest.fixture(scope="module")
def prompt(reader) -> Prompt:
    tokenizer = reader.tokenizer
    return Prompt(tuple(tokenizer.render_chat("Think.", "a state", 0, thinking=True)) + tuple(tokenizer.thought_open))


def start(runner, spec: GenerateSpec, canvas_length: int):
    """A generation started: its prompt's turns run (`start_steps`), its `Generation` returned."""
    return run_steps(runner.start_steps(spec, canvas_length))


def turns_of(runner) -> int:
    return runner.stats["flat_turns"]


def fresh_runner(tiny_dir):
    """A runner of its own, with the module's schedule: its KV store empty. (A sampled generation is
    seeded, but a repeated one reads its prompt from the store, in turns of another shape: float32
    results ~1e-6 apart, which the self-conditioning signal amplifies until a draw flips.)"""
    runner = make_tiny_reader(tiny_dir).runner
    runner.generation["max_denoising_steps"] = STEPS
    return runner


@torch.no_grad()
def test_each_step_is_one_turn_and_stepping_equals_the_whole_generation(tiny_dir, prompt):
    spec = GenerateSpec(prompt, 40, (), seed=4)  # blocks of 32 then 16: one commit in between
    whole = fresh_runner(tiny_dir).generate(spec, 32)

    runner = fresh_runner(tiny_dir)
    before = turns_of(runner)
    gen = start(runner, spec, 32)
    assert turns_of(runner) - before == 1  # the prompt's turn (the first pass rides it)
    ids, chunks, steps = [], [], 0
    while not gen.done:
        at = turns_of(runner)
        chunk = runner.step_generation(gen)
        steps += 1
        assert turns_of(runner) - at == 1
        if chunk is not None:
            chunks.append(chunk)
            ids.extend(chunk.ids)
    assert ids == list(whole.ids) and len(ids) == 40
    assert [c.done for c in chunks] == [False, True] and [len(c.ids) for c in chunks] == [32, 8]
    # Every pass a turn, the first riding the prompt's; the commit rides the next block's first pass.
    assert chunks[-1].passes == whole.passes == steps + 1
    assert chunks[-1].prompt_tokens == len(prompt.ids) and not chunks[-1].stopped and not whole.stopped
    with pytest.raises(RuntimeError):
        runner.step_generation(gen)


@torch.no_grad()
def test_greedy_stepping_equals_block_diffusion_over_transformers_forward(tiny_dir, reader, prompt):
    """Block diffusion written over transformers' own forward (tests/engine/hf/reference.py: every
    pass over the whole prompt and the committed blocks): a greedy generation of two blocks is its
    ids token for token, in as many passes (a sampled one drifts from it: test_reference.py)."""
    runner = reader.runner
    spec = GenerateSpec(prompt, 40, (), seed=4, temperature=0.0)
    expected = reference_generate(reference_model(tiny_dir), spec, 32, runner=runner)
    gen = start(runner, spec, 32)
    ids: list[int] = []
    chunk = None
    while not gen.done:
        chunk = runner.step_generation(gen)
        if chunk is not None:
            ids.extend(chunk.ids)
    assert chunk is not None and len(ids) == 40
    assert tuple(ids) == expected.ids and chunk.passes == expected.passes


@torch.no_grad()
def test_passes_are_counted_and_a_stop_id_ends_generation(reader, prompt):
    runner = reader.runner
    free = runner.generate(GenerateSpec(prompt, 16, (), seed=3), 32)
    assert 1 <= free.passes <= STEPS
    stop = free.ids[5]
    before = runner.stats["generation_passes"]
    cut = runner.generate(GenerateSpec(prompt, 16, (stop,), seed=3), 32)
    assert cut.stopped and cut.ids == free.ids[: free.ids.index(stop)]
    assert cut.passes == free.passes == runner.stats["generation_passes"] - before


@torch.no_grad()
def test_zero_max_tokens_finishes_without_a_denoise_pass(reader, prompt):
    runner = reader.runner
    gen = start(runner, GenerateSpec(prompt, 0, (), seed=1), 32)
    chunk = runner.step_generation(gen)
    assert chunk is not None and chunk.done and chunk.ids == () and chunk.passes == 0


@torch.no_grad()
def test_temperature_zero_is_greedy_whatever_the_seed(reader, prompt):
    runner = reader.runner
    greedy = [runner.generate(GenerateSpec(prompt, 24, (), seed=seed, temperature=0.0), 32) for seed in (1, 2, 99)]
    assert greedy[0].ids == greedy[1].ids == greedy[2].ids
    sampled = [runner.generate(GenerateSpec(prompt, 24, (), seed=seed), 32).ids for seed in (1, 2)]
    assert sampled[0] != sampled[1]  # the seed matters when sampling
    # A greedy block is every position's argmax given the canvas before it: it settles as soon as two
    # passes agree (entropy 0 is confident), well before the step cap.
    assert greedy[0].passes < STEPS * 2


@torch.no_grad()
def test_a_tiny_top_p_keeps_only_the_most_probable_token(reader, prompt):
    """With a nucleus of one token every draw is the argmax and every entropy is 0, so a one-block
    generation equals greedy decoding from the same starting canvas (greedy starts from seed 0)."""
    runner = reader.runner
    narrow = runner.generate(GenerateSpec(prompt, 16, (), seed=0, top_p=1e-6), 32)
    greedy = runner.generate(GenerateSpec(prompt, 16, (), seed=0, temperature=0.0), 32)
    wide = runner.generate(GenerateSpec(prompt, 16, (), seed=0, top_p=1.0), 32)
    assert narrow.ids == greedy.ids
    assert wide.ids != narrow.ids


@pytest.mark.parametrize("field, value", [("temperature", -0.5), ("temperature", math.nan), ("top_p", 0.0),
                                           ("top_p", 1.5), ("max_tokens", -1)])
def test_bad_sampler_fields_are_refused_by_name(reader, prompt, field, value):
    fields = {"temperature": 1.0, "top_p": 1.0, "max_tokens": 8, field: value}
    with pytest.raises(EngineInputError) as caught:
        start(reader.runner, GenerateSpec(prompt, fields["max_tokens"], (), seed=1,
                                          temperature=fields["temperature"], top_p=fields["top_p"]), 32)
    assert caught.value.param == field and caught.value.status == 400


def test_the_nucleus_is_the_smallest_set_reaching_top_p():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log()
    kept = lambda p: torch.isfinite(nucleus(logits, p))[0].tolist()  # noqa: E731
    assert kept(0.5) == [True, False, False, False]
    assert kept(0.6) == [True, True, False, False]
    assert kept(0.95) == [True, True, True, False]
    assert kept(0.96) == [True, True, True, True]
    assert kept(1e-9) == [True, False, False, False]
    assert torch.equal(nucleus(logits, 1.0), logits)


def test_sample_step_draws_only_inside_the_nucleus_and_greedy_draws_nothing():
    logits = torch.log(torch.tensor([[0.4, 0.35, 0.2, 0.05]] * 64))
    drawn = set()
    for seed in range(20):
        step = sample_step(logits, 1.0, top_p=0.7, entropy_bound=1e9, vocab_size=4,
                           generator=torch.Generator().manual_seed(seed))
        drawn |= set(step.tokens.tolist())  # an unbounded entropy bound accepts every draw
        assert torch.isfinite(step.entropy).all()
    assert drawn == {0, 1}
    generator = torch.Generator().manual_seed(5)
    state = generator.get_state()
    greedy = sample_step(logits, 0.0, top_p=1.0, entropy_bound=0.1, vocab_size=4, generator=generator)
    assert greedy.tokens.tolist() == [0] * 64 and greedy.entropy.tolist() == [0.0] * 64
    assert torch.equal(generator.get_state(), state)  # nothing drawn
    assert torch.equal(greedy.conditioning.softmax(-1), torch.nn.functional.one_hot(greedy.argmax, 4).float())
