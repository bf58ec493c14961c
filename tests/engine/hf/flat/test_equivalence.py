"""The flat turn (FLAT_TURN=1) reads what the row path reads: in float32 on the tiny model, the same
slot distributions within 1e-4, for reads (text and JSON states, images, a shared sheet prefix, long
prompts in chunks across the sliding window, several canvases, steps > 1) and for whole decisions
(stages, `sequential`, `isolate`, `debias`, `samples` and `auto`, `think`).

A pass that reads a self-conditioning signal (a step after the first, a generation's pass) turns a
difference of 1e-6 in that signal into ~6e-5 in its hidden states on the tiny model, so a multi-step
read or a sampled thought drifts apart over its steps on either path alone (the row path against
itself at another batch size). Those are checked pass by pass (each flat pass fed the row path's
canvas and signal), and `think` with greedy thoughts.
"""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch

from app import build
from app.config import Settings
from app.decisions.request import parse_decision
from app.decisions.run import Decider
from app.engine.base import ImageInput, Prompt, ReadSpec
from app.engine.hf.flat.layout import Kind
from app.engine.hf.flat.prompts import prepare
from app.engine.hf.flat.turn import Part
from tests.conftest import LIMITS, make_tiny_reader
from tests.engine.hf.graphs.test_encoder import jpeg
from tests.engine.hf.test_reader import spec_for

TOLERANCE = 1e-4
LONG_STATE = " ".join(f"word{i % 97} and{i % 13}" for i in range(120))  # past 4 sliding windows of 64


@pytest.fixture(scope="module")
def row(tiny_dir):
    return make_tiny_reader(tiny_dir, flat_turn=False).runner


@pytest.fixture(scope="module")
def flat(tiny_dir):
    return make_tiny_reader(tiny_dir, flat_turn=True).runner


def deviation(a, b) -> float:
    """The largest difference between two lists of read results' label log-probabilities; their
    prompt lengths and argmaxes must be equal."""
    largest = 0.0
    assert len(a) == len(b)
    for ra, rb in zip(a, b):
        assert not isinstance(ra, Exception) and not isinstance(rb, Exception), (ra, rb)
        assert ra.prompt_tokens == rb.prompt_tokens
        for canvas_a, canvas_b in zip(ra.slots, rb.slots, strict=True):
            for slot_a, slot_b in zip(canvas_a, canvas_b, strict=True):
                assert slot_a.argmax_id == slot_b.argmax_id
                largest = max(largest, *(abs(x - y) for x, y in zip(slot_a.label_logprobs, slot_b.label_logprobs)))
    return largest


def image_spec(tokenizer, colours, state: str = "what is ahead?") -> ReadSpec:
    images = tuple(ImageInput(jpeg(colour), "image/jpeg", f"image {n}") for n, colour in enumerate(colours))
    base = spec_for(tokenizer, state, "q1: yes", [11, 12])
    return dataclasses.replace(base, prompt=Prompt(tuple(tokenizer.render_chat("Look.", state, len(images), False)),
                                                   images))


def test_text_and_json_states_read_the_same(row, flat, tokenizer):
    specs = [spec_for(tokenizer, "the state is fine", "q1: yes\nq2: no", [42, 7, 3]),
             spec_for(tokenizer, '{"ticket": "down", "tier": 2}', "q1: yes", [5, 9])]
    assert deviation(row.read(specs), flat.read(specs)) < TOLERANCE


@pytest.mark.parametrize("colours", [[(200, 30, 30)], [(10, 200, 30), (30, 30, 200), (90, 90, 90)]])
def test_image_states_read_the_same(row, flat, tokenizer, colours):
    spec = image_spec(tokenizer, colours)
    assert deviation(row.read([spec]), flat.read([spec])) < TOLERANCE


def test_a_shared_sheet_prefix_is_read_from_its_blocks_the_same(row, flat, tokenizer):
    sheet = "Question q1: is the customer angry? Question q2: is it urgent? " * 3
    first = spec_for(tokenizer, sheet + "state one", "q1: yes", [5])
    second = spec_for(tokenizer, sheet + "state two, another", "q1: yes", [6, 7])
    assert deviation(row.read([first]), flat.read([first])) < TOLERANCE
    shared = flat.flat.store.stats["hit_tokens"]
    assert deviation(row.read([second]), flat.read([second])) < TOLERANCE
    assert flat.flat.store.stats["hit_tokens"] - shared >= 32  # the sheet's whole blocks, not encoded again


@pytest.mark.parametrize("chunk", [16, 48, 100])  # under, near and past the 64-token window
def test_long_prompts_in_chunks_across_the_window_read_the_same(tiny_dir, row, tokenizer, chunk):
    flat = make_tiny_reader(tiny_dir, flat_turn=True, prefill_chunk=chunk).runner
    spec = spec_for(tokenizer, LONG_STATE, "q1: yes\nq2: no", [42, 7, 3])
    assert len(spec.prompt.ids) > 4 * 64
    assert deviation(row.read([spec]), flat.read([spec])) < TOLERANCE
    assert flat.stats["flat_turns"] >= -(-len(spec.prompt.ids) // chunk)  # a chunk a turn at most


def test_a_long_image_prompt_in_chunks_reads_the_same(tiny_dir, row, tokenizer):
    flat = make_tiny_reader(tiny_dir, flat_turn=True, prefill_chunk=40).runner
    spec = image_spec(tokenizer, [(120, 30, 200)], state=LONG_STATE)
    assert deviation(row.read([spec]), flat.read([spec])) < TOLERANCE


def test_a_reads_answer_does_not_depend_on_what_shares_its_turn(flat, tokenizer):
    specs = [spec_for(tokenizer, f"state {n} " * (1 + 3 * n), "q1: yes\nq2: no", [3 + n, 4]) for n in range(4)]
    alone = [flat.read([spec])[0] for spec in specs]
    together = flat.read(specs)
    reversed_mix = flat.read(list(reversed(specs)))[::-1]
    assert deviation(alone, together) < 1e-5
    assert deviation(alone, reversed_mix) < 1e-5


def test_each_pass_of_a_multi_step_read_is_the_row_paths(row, flat, tokenizer):
    """The row path's passes recorded (canvas, self-conditioning signal), each run again through the
    flat turn over the same prompt: the same hidden states at every canvas position."""
    spec = spec_for(tokenizer, "x y " * 5, "q1: yes", [5, 9], steps=3, seed=4)
    passes = []
    hidden = row.decoder_hidden

    def recorded(rows, conditioning=None):
        out = hidden(rows, conditioning)
        passes.append(([list(canvas) for _, canvas in rows], conditioning, out))
        return out

    row.decoder_hidden = recorded
    try:
        row.read([spec])
    finally:
        del row.decoder_hidden
    assert len(passes) == 3 and passes[1][1] is not None
    engine = flat.flat
    largest = 0.0
    for canvases, conditioning, expected in passes:
        (state,) = prepare(flat, engine.store, [spec.prompt], None)
        parts = [part for part in [state.chunk(engine.store, 10_000, 10_000)] if part is not None]
        reads = [Part(Kind.CANVAS, state.sequence, state.length, canvas, logits=tuple(range(len(canvas))),
                      conditioning=None if conditioning is None else conditioning[number])
                 for number, canvas in enumerate(canvases)]
        engine.turn.run(parts + reads)
        assert state.sequence is not None
        engine.store.close(state.sequence)
        for number, part in enumerate(reads):
            assert part.hidden is not None
            largest = max(largest, float((part.hidden - expected[number]).abs().max()))
    assert largest < TOLERANCE


# ---------------------------------------------------------------------------------------- decisions

SCHEMA = {
    "urgent": {"type": "noul", "instructions": "Does the customer need a reply within the hour?"},
    "bucket": {"type": "choice", "instructions": "Which team owns this?",
               "criteria": {"billing": None, "outage": "service down", "feature": None}},
    "tone": {"type": "score", "instructions": "How angry is the customer?", "criteria": ["calm", "annoyed", "furious"]},
    "escalate": {"type": "noul", "instructions": "Escalate?", "depends_on": ["urgent"]},
    "refund": {"type": "noul", "instructions": "Refund?", "ask_if": {"bucket": ["billing", "outage", "feature"]}},
}
TICKET = {"ticket": "Everything is down and we have a demo at noon."}


class Greedy:
    """A reader whose generations are greedy (temperature 0): a thought owes nothing to sampling."""

    def __init__(self, reader):
        self.reader = reader

    def __getattr__(self, name):
        return getattr(self.reader, name)

    async def generate(self, spec):
        return await self.reader.generate(dataclasses.replace(spec, temperature=0.0))


def decide(reader, body, images=(), greedy=False):
    async def scenario():
        await reader.start()
        try:
            served = Greedy(reader) if greedy else reader
            decision = parse_decision(body, LIMITS, images=images)
            return await Decider(served, build.read_settings(Settings.of(canvas=64))).decide(decision)
        finally:
            await reader.stop()

    return asyncio.run(scenario())


def distributions(outcome) -> dict[str, list[float]]:
    found = {}
    for qid, answer in outcome.answers.items():
        if answer["type"] == "noul":
            found[qid] = [answer["noul"]]
        else:
            found[qid] = list(answer["probabilities"].values())
    return found


@pytest.mark.parametrize("body", [
    {"state": TICKET, "questions": SCHEMA},
    {"state": "a plain text state " * 4, "questions": SCHEMA, "sequential": True},
    {"state": TICKET, "questions": SCHEMA, "isolate": True},
    {"state": TICKET, "questions": SCHEMA, "debias": "rotate"},
    {"state": TICKET, "questions": SCHEMA, "debias": "prior"},
    {"state": TICKET, "questions": SCHEMA, "samples": 3},
    {"state": TICKET, "questions": SCHEMA, "samples": "auto"},
    {"state": {"log": LONG_STATE}, "questions": SCHEMA},
], ids=["stages", "sequential", "isolate", "rotate", "prior", "samples", "auto", "long"])
def test_decisions_give_the_same_distributions(tiny_dir, body):
    row = decide(make_tiny_reader(tiny_dir, flat_turn=False), body)
    flat = decide(make_tiny_reader(tiny_dir, flat_turn=True), body)
    expected, got = distributions(row), distributions(flat)
    assert expected.keys() == got.keys()
    assert max(abs(a - b) for qid in expected for a, b in zip(expected[qid], got[qid], strict=True)) < TOLERANCE
    assert row.diagnostics["stages"] == flat.diagnostics["stages"]


def test_an_image_decision_gives_the_same_distributions(tiny_dir):
    images = (ImageInput(jpeg((40, 160, 40)), "image/jpeg", "frame"),)
    body = {"state": "a camera frame", "questions": SCHEMA, "samples": 1}
    expected = distributions(decide(make_tiny_reader(tiny_dir, flat_turn=False), body, images))
    got = distributions(decide(make_tiny_reader(tiny_dir, flat_turn=True), body, images))
    assert max(abs(a - b) for qid in expected for a, b in zip(expected[qid], got[qid], strict=True)) < TOLERANCE


def test_a_decision_with_a_greedy_thought_gives_the_same_thought_and_distributions(tiny_dir):
    body = {"state": TICKET, "questions": SCHEMA, "think": 24, "samples": 1}
    row = decide(make_tiny_reader(tiny_dir, flat_turn=False), body, greedy=True)
    flat = decide(make_tiny_reader(tiny_dir, flat_turn=True), body, greedy=True)
    thought = {key: value for key, value in row.diagnostics["thought"].items() if key != "ms"}
    assert thought == {key: value for key, value in flat.diagnostics["thought"].items() if key != "ms"}
    assert thought["tokens"] > 0
    expected, got = distributions(row), distributions(flat)
    assert max(abs(a - b) for qid in expected for a, b in zip(expected[qid], got[qid], strict=True)) < TOLERANCE


def test_a_generation_is_the_row_paths_token_for_token_when_greedy(row, flat, tokenizer):
    from app.engine.base import GenerateSpec

    for state in ("short state", LONG_STATE):
        prompt = Prompt(tuple(tokenizer.render_chat("Think.", state, 0, thinking=True)))
        spec = GenerateSpec(prompt, 40, (), seed=3, temperature=0.0)
        expected, got = row.generate(spec, 32), flat.generate(spec, 32)
        assert (expected.ids, expected.passes, expected.prompt_tokens) == (got.ids, got.passes, got.prompt_tokens)


def test_the_encoders_and_decoders_layer_scalars_apply_each_to_its_own_tokens(tiny_dir, tokenizer):
    """Random weights leave every layer_scalar at 1; set apart, the flat turn scales prompt tokens
    by the encoder's and canvas tokens by the decoder's, as the row path's two stacks do."""
    row = make_tiny_reader(tiny_dir, flat_turn=False).runner
    flat = make_tiny_reader(tiny_dir, flat_turn=True).runner
    for runner in (row, flat):
        with torch.no_grad():
            for number, (encoder, decoder) in enumerate(zip(runner.model.model.encoder.language_model.layers,
                                                            runner.model.model.decoder.layers)):
                encoder.layer_scalar.fill_(0.8 + 0.05 * number)
                decoder.layer_scalar.fill_(1.3 - 0.07 * number)
    specs = [spec_for(tokenizer, "the state is fine", "q1: yes\nq2: no", [42, 7, 3])]
    assert deviation(row.read(specs), flat.read(specs)) < TOLERANCE
    plain = make_tiny_reader(tiny_dir, flat_turn=True).runner.read(specs)[0].slots[0][0].label_logprobs
    scaled = flat.read(specs)[0].slots[0][0].label_logprobs
    assert max(abs(a - b) for a, b in zip(plain, scaled)) > 1e-3  # the scalars change the read
