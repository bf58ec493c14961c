"""Step-wise generation and the one sampler step on the tiny model: stepping runs one model pass a
step and equals a one-shot block-diffusion loop, temperature 0 is greedy whatever the seed, top_p
narrows every draw to its nucleus, passes are counted, bad sampler fields are refused by name."""

from __future__ import annotations

import math

import pytest
import torch

from app.engine.base import EngineInputError, GenerateSpec, Prompt
from app.engine.hf.sampler import entropy_bound_accept, gumbel_argmax, nucleus, sample_step, temperature_at
from tests.conftest import make_tiny_reader

STEPS = 6  # denoise passes a block at most: enough to exercise the schedule, quick on a CPU


@pytest.fixture(scope="module")
def reader(tiny_dir):
    reader = make_tiny_reader(tiny_dir, flat_turn=False)
    reader.runner.generation["max_denoising_steps"] = STEPS
    return reader


@pytest.fixture(scope="module")
def prompt(reader) -> Prompt:
    tokenizer = reader.tokenizer
    return Prompt(tuple(tokenizer.render_chat("Think.", "a state", 0, thinking=True)) + tuple(tokenizer.thought_open))


def one_shot(runner, spec: GenerateSpec, canvas_length: int) -> tuple[list[int], int]:
    """Block diffusion written as one loop, the way generation ran before it was step-wise: each
    block is denoised to the end, then committed through the encoder. (ids, denoise passes)."""
    settings = runner.generation
    started = runner.start_generation(spec, canvas_length)  # only for its prompt's KV cache
    cache, length = started.cache, started.length
    generator = torch.Generator().manual_seed(spec.seed)
    produced: list[int] = []
    passes = 0
    while len(produced) < spec.max_tokens:
        left = spec.max_tokens - len(produced)
        width = min(canvas_length, max(16, 16 * math.ceil(left / 16)))
        canvas = torch.randint(0, runner.vocab_size, (1, width), generator=generator)
        positions = (length + torch.arange(width)).unsqueeze(0)
        conditioning, history, argmax = None, [], None
        steps = int(settings["max_denoising_steps"])
        for remaining in range(steps, 0, -1):
            hidden = runner.model.model(past_key_values=cache, decoder_input_ids=canvas,
                                        decoder_position_ids=positions,
                                        self_conditioning_logits=conditioning).last_hidden_state
            passes += 1
            scaled = runner.logits(hidden)[0] / temperature_at(remaining, steps, settings["t_min"], settings["t_max"])
            argmax = torch.argmax(scaled, dim=-1)
            sampled = gumbel_argmax(scaled, generator)
            logp = torch.log_softmax(scaled, dim=-1)
            entropy = -(logp.exp() * logp).sum(dim=-1)
            accepted = entropy_bound_accept(entropy, settings["entropy_bound"])
            noise = torch.randint(0, runner.vocab_size, (width,), generator=generator)
            canvas = torch.where(accepted, sampled, noise).unsqueeze(0)
            conditioning = scaled.unsqueeze(0).to(runner.model.dtype)
            history.append(argmax)
            need = int(settings["stability_threshold"]) + 1
            if len(history) >= need and all(torch.equal(h, argmax) for h in history[-need:]):
                if float(entropy.mean()) < settings["confidence_threshold"]:
                    break
        block = argmax.tolist()
        cut = next((i for i, t in enumerate(block) if t in spec.stop_ids), None)
        take = (block if cut is None else block[:cut])[:left]
        produced.extend(take)
        if (cut is not None and cut < left) or len(produced) >= spec.max_tokens:
            break
        runner.model.model.encoder(input_ids=torch.tensor([block]), past_key_values=cache,
                                   position_ids=positions)
        length += width
    return produced, passes


def passes_of(runner) -> int:
    return runner.stats["decoder_passes"] + runner.stats["encoder_passes"]


@torch.no_grad()
def test_each_step_is_one_model_pass_and_stepping_equals_one_shot_generation(reader, prompt):
    runner = reader.runner
    spec = GenerateSpec(prompt, 40, (), seed=4)  # blocks of 32 then 16: one commit in between
    expected, expected_passes = one_shot(runner, spec, canvas_length=32)

    before = passes_of(runner)
    gen = runner.start_generation(spec, 32)
    assert passes_of(runner) - before == 1  # the prompt's encoder pass
    ids, chunks, steps = [], [], 0
    while not gen.done:
        at = passes_of(runner)
        chunk = runner.step_generation(gen)
        steps += 1
        assert passes_of(runner) - at == 1
        if chunk is not None:
            chunks.append(chunk)
            ids.extend(chunk.ids)
    assert ids == expected and len(ids) == 40
    assert [c.done for c in chunks] == [False, True] and [len(c.ids) for c in chunks] == [32, 8]
    assert chunks[-1].passes == expected_passes and steps == expected_passes + 1  # + the commit step
    assert chunks[-1].prompt_tokens == len(prompt.ids) and not chunks[-1].stopped
    with pytest.raises(RuntimeError):
        runner.step_generation(gen)

    whole = runner.generate(spec, 32)
    assert list(whole.ids) == expected and whole.passes == expected_passes and not whole.stopped


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
    gen = runner.start_generation(GenerateSpec(prompt, 0, (), seed=1), 32)
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
        reader.runner.start_generation(GenerateSpec(prompt, fields["max_tokens"], (), seed=1,
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


def test_left_padded_pads_short_kv_on_the_left_and_returns_full_kv_itself():
    from app.engine.hf.runner import left_padded

    kv = torch.arange(1 * 2 * 3 * 4, dtype=torch.float32).reshape(1, 2, 3, 4)
    assert left_padded(kv, 3) is kv  # no zero-width pad: no copy
    padded = left_padded(kv, 5)
    assert padded.shape == (1, 2, 5, 4)
    assert torch.equal(padded[:, :, :2], torch.zeros(1, 2, 2, 4)) and torch.equal(padded[:, :, 2:], kv)
