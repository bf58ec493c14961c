"""The reference's end-to-end cases (docs/behavior.md §8) and worked examples (§7), against the
scripted reader, with the tiny model's real tokenizer. Ids in prompts are positional (q1, q2, ...)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import re

import pytest

from app import build
from app.config import Settings
from app.decisions.request import parse_decision
from app.decisions.run import Decider
from app.engine.base import ReadResult, SlotRead
from tests.conftest import LIMITS
from tests.fakes import PROMPT_TOKENS, THOUGHT_TEXT, ScriptedReader

SCHEMA = {
    "urgent": {"type": "noul", "instructions": "Does the customer need a reply within the hour?",
               "criteria": {"true": "needs a reply now", "false": "can wait"}},
    "bucket": {"type": "choice", "instructions": "Which team owns this?",
               "criteria": {"billing": None, "outage": "service down", "feature": None}},
    "tone": {"type": "score", "instructions": "How angry is the customer?", "criteria": ["calm", "annoyed", "furious"]},
}
STATE = {"ticket": "Everything is down and we have a demo at noon."}
DEPS = {
    "urgent": {"type": "noul", "instructions": "Urgent?"},
    "bucket": {"type": "choice", "instructions": "Which team?", "criteria": {"billing": None, "outage": None, "feature": None}},
    "escalate": {"type": "noul", "instructions": "Escalate?", "depends_on": ["urgent", "bucket"]},
    "refund": {"type": "noul", "instructions": "Refund?", "ask_if": {"bucket": ["billing"]}},
    "outage_note": {"type": "noul", "instructions": "Outage note?", "ask_if": {"bucket": ["outage"]}, "depends_on": ["urgent"]},
}
TWELVE = {f"w{i}": {"type": "noul", "instructions": f"Is word {i} a name?"} for i in range(12)}


def decide(reader, settings=build.read_settings(Settings.of(canvas=64)), **body):
    body.setdefault("state", STATE)
    body.setdefault("questions", SCHEMA)
    return asyncio.run(Decider(reader, settings).decide(parse_decision(body, LIMITS)))


def text(tokenizer, ids):
    return tokenizer.decode(ids)


def scaffold(tokenizer):
    return tuple(tokenizer.thought_open) + tuple(tokenizer.thought_close)


def test_t1_fixed_samples_read_distinct_canvases_in_one_read(scripted, tokenizer):
    outcome = decide(scripted, samples=3)
    (spec,) = scripted.reads
    assert len(spec.canvases) == 3 and len(set(spec.canvases)) == 3
    assert outcome.answers["urgent"] == {"type": "noul", "noul": pytest.approx(0.7)}
    assert outcome.answers["bucket"]["choice"] == "billing"
    assert outcome.diagnostics["samples"]["n"] == 3
    diag = outcome.diagnostics["questions"]["urgent"]
    assert diag["stderr"] < 1e-9 and diag["agreement"] == 1.0
    assert outcome.diagnostics["thought"] is None
    width = len(spec.canvases[0])
    rows = list(spec.canvases[0]).index(tokenizer.turn_close_id) + 1
    assert outcome.output_tokens == rows and width % 16 == 0 and width >= rows
    # the canvases differ only at the slots
    for canvas in spec.canvases[1:]:
        assert [i for i, (a, b) in enumerate(zip(canvas, spec.canvases[0])) if a != b] == \
            [i for i in spec.slots if canvas[i] != spec.canvases[0][i]]


def test_t2_auto_reads_again_only_when_the_first_read_is_unsure(tokenizer):
    unsure = ScriptedReader(tokenizer, conf=0.7)
    outcome = decide(unsure)
    assert outcome.diagnostics["samples"]["n"] == 4 and len(unsure.reads) == 2
    assert sum(len(spec.canvases) for spec in unsure.reads) == 4
    policy = outcome.diagnostics["samples"]["policy"]
    assert policy["extended"] is True
    for qid, diag in outcome.diagnostics["questions"].items():
        assert len(diag["entropy"]) == 4
        assert policy["first_read_entropy"][qid] == diag["entropy"][0]
    assert [outcome.diagnostics["questions"][q]["pos"] for q in SCHEMA] == list(unsure.reads[0].slots)
    sure = ScriptedReader(tokenizer, conf=0.999)
    outcome = decide(sure)
    assert outcome.diagnostics["samples"]["n"] == 1 and len(sure.reads) == 1
    assert outcome.diagnostics["samples"]["policy"]["extended"] is False


def test_t3_mass_outside_the_labels_does_not_force_a_reread(tokenizer):
    leaky = ScriptedReader(tokenizer, conf=0.99, leak=0.3)
    outcome = decide(leaky)
    assert outcome.diagnostics["samples"]["n"] == 1
    assert outcome.diagnostics["questions"]["urgent"]["label_mass"] == pytest.approx(0.7)


def test_t4_think_writes_a_thought_then_reads_continue_it(scripted, tokenizer):
    outcome = decide(scripted, think=64, samples=2)
    assert [kind for kind, _ in scripted.calls] == ["generate", "read"]
    gen = scripted.generations[0]
    assert gen.max_tokens == 64 and tuple(tokenizer.thought_close)[0] in gen.stop_ids
    assert gen.prompt.ids[-len(tokenizer.thought_open):] == tuple(tokenizer.thought_open)
    assert "<|think|>" in text(tokenizer, gen.prompt.ids)
    (spec,) = scripted.reads
    assert spec.prompt.ids == gen.prompt.ids + scripted.thought + tuple(tokenizer.thought_close)
    assert spec.canvases[0][: len(scaffold(tokenizer))] != scaffold(tokenizer)
    thought = outcome.diagnostics["thought"]
    assert thought["tokens"] == len(scripted.thought) and thought["closed"] is True and "urgent" in thought["text"]
    assert outcome.diagnostics["samples"]["n"] == 2
    rows = list(spec.canvases[0]).index(tokenizer.turn_close_id) + 1
    assert outcome.output_tokens == len(scripted.thought) + rows
    assert THOUGHT_TEXT in thought["text"]


def test_t5_long_lists_are_chunked_and_use_the_indexed_format(scripted, tokenizer):
    outcome = decide(scripted, questions=TWELVE, samples=1, chunk_rows=32, chunk_prompt="shared")
    assert outcome.diagnostics["format"] == "indexed"
    chunks = outcome.diagnostics["chunks"]
    assert len(chunks) > 1 and [q for chunk in chunks for q in chunk] == list(TWELVE)
    assert all(answer["noul"] > 0.5 for answer in outcome.answers.values())
    assert len(scripted.reads) == len(chunks)
    assert len({spec.prompt.ids for spec in scripted.reads}) == 1
    assert "A reply may cover only some of the questions" in text(tokenizer, scripted.reads[0].prompt.ids)
    assert all(len(spec.canvases[0]) <= 32 for spec in scripted.reads)
    own = ScriptedReader(tokenizer)
    outcome = decide(own, questions=TWELVE, samples=1, chunk_rows=32)
    assert len({spec.prompt.ids for spec in own.reads}) == len(outcome.diagnostics["chunks"])
    assert decide(ScriptedReader(tokenizer), samples=1).diagnostics["format"] == "lines"


def test_t6_parallel_chunks_each_write_a_thought(scripted):
    outcome = decide(scripted, questions=TWELVE, samples=1, chunk_rows=32, think=64)
    chunks = outcome.diagnostics["chunks"]
    assert len(scripted.generations) == len(chunks) and len(scripted.reads) == len(chunks)
    thoughts = outcome.diagnostics["thought"]
    assert isinstance(thoughts, list) and len(thoughts) == len(chunks)
    assert all(t["tokens"] == len(scripted.thought) for t in thoughts)


def test_t7_sequential_chunks_continue_with_earlier_answers_prefilled(scripted, tokenizer):
    outcome = decide(scripted, questions=TWELVE, samples=1, chunk_rows=32, sequential=True)
    assert outcome.diagnostics["sequential"] is True
    chunks = outcome.diagnostics["chunks"]
    assert len(scripted.reads) == len(chunks) > 1
    first, second = scripted.reads[0], scripted.reads[1]
    tail = text(tokenizer, second.prompt.ids)
    last_of_first = f"q{len(chunks[0])}yes"
    assert "<channel|>" in tail and tail.endswith(last_of_first) and "q1yes q2yes" in tail
    assert second.prompt.ids[: len(first.prompt.ids)] == first.prompt.ids
    assert outcome.diagnostics["conditioning"] == "prefill"


def test_t8_sequential_with_think_writes_one_thought_for_the_chain(scripted, tokenizer):
    outcome = decide(scripted, questions=TWELVE, samples=1, chunk_rows=32, sequential=True, think=64)
    chunks = outcome.diagnostics["chunks"]
    assert [kind for kind, _ in scripted.calls] == ["generate"] + ["read"] * len(chunks)
    gen = scripted.generations[0]
    first, second = scripted.reads[0], scripted.reads[1]
    assert first.prompt.ids == gen.prompt.ids + scripted.thought + tuple(tokenizer.thought_close)
    assert second.prompt.ids[: len(first.prompt.ids)] == first.prompt.ids
    assert text(tokenizer, second.prompt.ids).endswith(f"q{len(chunks[0])}yes")
    assert isinstance(outcome.diagnostics["thought"], dict)
    rows = sum(list(spec.canvases[0]).index(tokenizer.turn_close_id) + 1 for spec in scripted.reads)
    assert outcome.output_tokens == len(scripted.thought) + rows


def test_t9_jev_answer_shapes_and_prompt_contents(scripted, tokenizer):
    outcome = decide(scripted, samples=2)
    assert list(outcome.answers) == ["urgent", "bucket", "tone"]
    assert outcome.answers["urgent"] == {"type": "noul", "noul": pytest.approx(0.7)}
    bucket = outcome.answers["bucket"]
    assert bucket["choice"] == "billing" and list(bucket["probabilities"]) == ["billing", "outage", "feature"]
    assert bucket["confidence"] == pytest.approx(0.7)
    tone = outcome.answers["tone"]
    assert tone["legend"] == {"0": "calm", "1": "annoyed", "2": "furious"}
    assert list(tone["probabilities"]) == ["0", "1", "2"] and tone["score"] == pytest.approx(0.45)
    assert outcome.input_tokens == PROMPT_TOKENS
    assert outcome.diagnostics["samples"]["n"] == 2 and len(scripted.reads) == 1
    prompt = text(tokenizer, scripted.reads[0].prompt.ids)
    assert "yes: needs a reply now" in prompt and "no: can wait" in prompt and "outage (service down)" in prompt
    assert json.dumps(STATE, ensure_ascii=False) in prompt
    for qid in SCHEMA:  # caller ids never reach the model
        assert qid not in prompt
    assert "Question q1:" in prompt and "Question q3:" in prompt


def test_a_string_state_is_sent_verbatim(scripted, tokenizer):
    decide(scripted, state="Everything is down <turn|> really", samples=1)
    prompt_ids = scripted.reads[0].prompt.ids
    assert "Everything is down <turn|> really" in text(tokenizer, prompt_ids)
    # the special-token string in the state stays plain text
    assert prompt_ids.count(tokenizer.turn_close_id) == 2


def test_t15_dependencies_run_in_stages_with_prefill(scripted, tokenizer):
    outcome = decide(scripted, questions=DEPS, samples=1)
    d = outcome.diagnostics
    assert d["stages"] == [["urgent", "bucket"], ["escalate", "refund"]]
    assert outcome.answers["outage_note"] is None
    assert d["skipped"]["outage_note"] == {"because": "bucket", "was": "billing", "wanted": ["outage"]}
    assert outcome.answers["refund"]["type"] == "noul" and outcome.answers["escalate"]["type"] == "noul"
    assert list(outcome.answers) == list(DEPS)
    assert len(scripted.reads) == 2 and d["conditioning"] == "prefill" and d["chunk_prompt"] == "full"
    first, second = scripted.reads
    assert "Question q4: Refund?" in text(tokenizer, first.prompt.ids)
    tail = text(tokenizer, second.prompt.ids)[-40:]
    assert "q1: yes" in tail and "q2: A" in tail
    assert second.prompt.ids[: len(first.prompt.ids)] == first.prompt.ids


def test_t16_alone_questions_read_in_canvases_of_their_own(scripted, tokenizer):
    questions = {**SCHEMA, "bucket": {**SCHEMA["bucket"], "alone": True}}
    outcome = decide(scripted, questions=questions, samples=1)
    assert outcome.diagnostics["stages"] == [["urgent", "bucket", "tone"]]
    assert outcome.diagnostics["chunks"] == [["urgent"], ["bucket"], ["tone"]]
    assert len(scripted.reads) == 3
    for spec in scripted.reads:
        prompt = text(tokenizer, spec.prompt.ids)
        if "Question q1" in prompt:
            assert "Question q2" not in prompt


def test_isolate_reads_every_question_alone(scripted):
    outcome = decide(scripted, samples=1, isolate=True)
    assert outcome.diagnostics["chunks"] == [["urgent"], ["bucket"], ["tone"]]
    assert len(scripted.reads) == 3


def test_ask_answers_only_the_asked_questions(scripted, tokenizer):
    outcome = decide(scripted, samples=1, ask=["bucket"])
    assert list(outcome.answers) == ["bucket"]
    assert outcome.diagnostics["not_asked"] == ["urgent", "tone"]
    assert "Question q2" in text(tokenizer, scripted.reads[0].prompt.ids)


def test_walk_page_example_clear_frame_skips_the_side_question(tokenizer):
    walk = {
        "ahead": {"type": "choice", "instructions": "What is ahead?", "criteria": {
            "all clear ahead": None, "danger: stairs": None, "danger: wall ahead": None,
            "danger: object ahead": None, "danger: pet ahead": None, "door ahead": None}},
        "side": {"type": "choice", "instructions": "Which half?", "criteria": {"left half": None, "right half": None},
                 "ask_if": {"ahead": ["danger: stairs", "danger: wall ahead", "danger: object ahead", "danger: pet ahead"]}},
    }
    clear = ScriptedReader(tokenizer)
    outcome = decide(clear, questions=walk, samples=1)
    assert outcome.answers["side"] is None and len(clear.reads) == 1
    blocked = ScriptedReader(tokenizer, pick=lambda spec, slot: 2 if len(spec.label_ids[slot]) == 6 else 1)
    outcome = decide(blocked, questions=walk, samples=1)
    assert outcome.answers["ahead"]["choice"] == "danger: wall ahead"
    assert outcome.answers["side"]["choice"] == "right half"
    assert len(blocked.reads) == 2 and outcome.diagnostics["stages"] == [["ahead"], ["side"]]


def test_same_seed_same_canvases_different_seed_different_noise(tokenizer):
    a, b, c = (ScriptedReader(tokenizer) for _ in range(3))
    decide(a, samples=2, seed=7)
    decide(b, samples=2, seed=7)
    decide(c, samples=2, seed=8)
    assert a.reads[0].canvases == b.reads[0].canvases
    assert a.reads[0].canvases != c.reads[0].canvases
    slots = a.reads[0].slots
    assert [a.reads[0].canvases[0][s] for s in slots] != [c.reads[0].canvases[0][s] for s in slots]


def test_renaming_ids_does_not_change_what_the_model_reads(tokenizer):
    a, b = ScriptedReader(tokenizer), ScriptedReader(tokenizer)
    decide(a, samples=1)
    renamed = {f"renamed-{qid}-✓": spec for qid, spec in SCHEMA.items()}
    decide(b, samples=1, questions=renamed)
    assert a.reads[0] == b.reads[0]


def test_steps_pass_through_to_the_reads(scripted):
    decide(scripted, steps=3, samples=1)
    assert scripted.reads[0].steps == 3


def test_thought_placement_in_the_canvas(tokenizer):
    reader = ScriptedReader(tokenizer)
    decide(reader, build.read_settings(Settings.of(canvas=64, thought_placement="canvas")), samples=1)
    spec = reader.reads[0]
    head = scaffold(tokenizer)
    assert spec.canvases[0][: len(head)] == head
    assert spec.prompt.ids[-len(head):] != head
    reader = ScriptedReader(tokenizer)
    decide(reader, samples=1)
    assert reader.reads[0].prompt.ids[-len(head):] == head


def test_a_template_past_the_canvas_is_refused(scripted):
    from app.decisions.errors import RequestError

    huge = {"big": {"type": "choice", "criteria": {f"o{i}": None for i in range(40)}}}
    outcome = decide(scripted, questions=huge, samples=1)  # one question fits a small canvas
    assert outcome.answers["big"]["choice"] == "o0"
    with pytest.raises(RequestError) as info:  # the thought block in the canvas leaves no room
        narrow = dataclasses.replace(build.read_settings(Settings.of(thought_placement="canvas")), canvas_length=8)
        decide(scripted, narrow, samples=1)
    assert "the canvas holds 7" in info.value.message and info.value.status == 422


def test_usage_counts_one_read_of_rows_per_group(scripted, tokenizer):
    outcome = decide(scripted, questions=DEPS, samples=3)
    rows = sum(list(spec.canvases[0]).index(tokenizer.turn_close_id) + 1 for spec in scripted.reads)
    assert outcome.output_tokens == rows
    assert outcome.input_tokens == PROMPT_TOKENS
    assert math.isfinite(outcome.diagnostics["timing"]["total_ms"])


# ------------------------------------------------------------ images (docs/design.md §3.11; T11, T17)

def image_inputs(n=1):
    from app.engine.base import ImageInput

    return tuple(ImageInput(data=b"png-%d" % i, content_type="image/png", source=f"part 'photo{i}'") for i in range(n))


def decide_with_images(reader, images, settings=build.read_settings(Settings.of(canvas=64)), **body):
    body.setdefault("state", STATE)
    body.setdefault("questions", SCHEMA)
    return asyncio.run(Decider(reader, settings).decide(parse_decision(body, LIMITS, images=images)))


def test_t11_images_go_ahead_of_the_state(scripted, tokenizer):
    outcome = decide_with_images(scripted, image_inputs(2), samples=1)
    (spec,) = scripted.reads
    assert spec.prompt.images == image_inputs(2)
    ids = spec.prompt.ids
    placeholders = [i for i, t in enumerate(ids) if t == tokenizer.image_placeholder_id]
    state_at = text(tokenizer, ids).index(json.dumps(STATE))
    assert len(placeholders) == 2
    assert len(tokenizer.decode(ids[: placeholders[-1] + 1])) <= state_at
    assert outcome.input_tokens == PROMPT_TOKENS


def test_t11_image_think_seeds_the_thought_into_the_canvas(scripted, tokenizer):
    outcome = decide_with_images(scripted, image_inputs(), think=64, samples=1)
    gen = scripted.generations[0]
    assert gen.prompt.images == image_inputs() and gen.prompt.ids[-len(tokenizer.thought_open):] == tuple(tokenizer.thought_open)
    assert "<|think|>" in text(tokenizer, gen.prompt.ids)
    (spec,) = scripted.reads
    head = tuple(tokenizer.thought_open) + scripted.thought + tuple(tokenizer.thought_close)
    assert spec.canvases[0][: len(head)] == head
    assert "<|think|>" in text(tokenizer, spec.prompt.ids) and spec.prompt.images == image_inputs()
    thought = outcome.diagnostics["thought"]
    assert thought["tokens"] == len(scripted.thought) and thought["closed"] and thought["budget"] <= 64


@pytest.mark.parametrize("images, state, offloaded", [
    (1, STATE, False),  # a walk frame: its pieces read the image count only, so they run inline
    (8, STATE, False),
    (0, STATE, False),
    (1, {"ticket": "x" * (16 * 1024)}, True),  # a long state: tokenizing it grows with it
])
def test_small_decisions_run_their_pieces_inline_images_or_not(scripted, images, state, offloaded):
    """A decision within the small bounds (state, options, canvases) runs its synchronous pieces
    (prompt, specs, estimates) on the spot, with images too; past them, through the offload."""
    calls = []

    async def offload(fn, *args):
        calls.append(fn)
        return fn(*args)

    decider = Decider(scripted, build.read_settings(Settings.of(canvas=64)), offload=offload)
    decision = parse_decision({"state": state, "questions": SCHEMA, "samples": 1}, LIMITS, images=image_inputs(images))
    plan = decider.plan(decision)
    outcome = asyncio.run(decider.decide(decision, plan))
    assert plan.small is not offloaded
    assert bool(calls) is offloaded
    assert set(outcome.answers) == set(SCHEMA)


def test_t11_image_think_is_clipped_to_the_canvas(scripted):
    outcome = decide_with_images(scripted, image_inputs(), think=4096, samples=1)
    assert outcome.diagnostics["thought"]["budget"] < 4096
    assert scripted.generations[0].max_tokens == outcome.diagnostics["thought"]["budget"]


def test_image_think_that_leaves_no_room_is_refused(scripted):
    from app.decisions.errors import RequestError

    with pytest.raises(RequestError) as info:
        decide_with_images(scripted, image_inputs(), build.read_settings(Settings.of(canvas=24)), think=64, samples=1)
    assert "think: the canvas leaves" in info.value.message


def test_t11_image_with_sequential_chunks_is_restated(scripted, tokenizer):
    outcome = decide_with_images(scripted, image_inputs(), questions=TWELVE, sequential=True, chunk_rows=8, samples=1)
    assert outcome.diagnostics["conditioning"] == "restated"
    last = text(tokenizer, scripted.reads[-1].prompt.ids)
    assert "Answers so far:" in last and "q1: yes" in last
    assert all(spec.prompt.images == image_inputs() for spec in scripted.reads)


def test_t17_dependencies_with_an_image_restate_the_answers(scripted, tokenizer):
    outcome = decide_with_images(scripted, image_inputs(), questions=DEPS, samples=1)
    assert outcome.diagnostics["conditioning"] == "restated"
    assert len(scripted.reads) == 2
    second = scripted.reads[1]
    assert second.prompt.images == image_inputs()
    restated = text(tokenizer, second.prompt.ids)
    assert "Answers so far:" in restated and "q2: billing" in restated and "q1: yes" in restated
    placeholder_at = second.prompt.ids.index(tokenizer.image_placeholder_id)
    assert len(tokenizer.decode(second.prompt.ids[:placeholder_at])) < restated.index("Answers so far:")
    assert "A reply may cover only some of the questions" in restated


def test_noise_is_keyed_by_canvas_content_not_position(tokenizer):
    a, b = ScriptedReader(tokenizer), ScriptedReader(tokenizer)
    decide(a, samples=2, isolate=True)
    reordered = dict(reversed(list(SCHEMA.items())))
    decide(b, samples=2, isolate=True, questions=reordered)
    by_prompt_a = {spec.prompt.ids: spec.canvases for spec in a.reads}
    by_prompt_b = {spec.prompt.ids: spec.canvases for spec in b.reads}
    assert by_prompt_a == by_prompt_b  # each question reads the same prompt and canvases in any order


def test_isolate_answers_do_not_depend_on_order_or_other_questions(tiny_reader):
    """On the tiny model (real reads): reversing the questions or adding one changes no answer."""
    settings = build.read_settings(Settings.of(canvas=64))

    async def answers(questions):
        await tiny_reader.start()
        try:
            body = {"state": STATE, "questions": questions, "isolate": True, "samples": 2}
            return (await Decider(tiny_reader, settings).decide(parse_decision(body, LIMITS))).answers
        finally:
            await tiny_reader.stop()

    forward = asyncio.run(answers(SCHEMA))
    backward = asyncio.run(answers(dict(reversed(list(SCHEMA.items())))))
    more = asyncio.run(answers({"extra": {"type": "noul", "instructions": "Is it Monday?"}, **SCHEMA}))
    # Equal up to the float noise of batching (canvases of other questions share the decoder pass).
    def numbers(answer):
        return [answer.get("noul", answer.get("score"))] + list(answer.get("probabilities", {}).values())

    for qid in SCHEMA:
        assert numbers(backward[qid]) == pytest.approx(numbers(forward[qid]), abs=1e-4)
        assert numbers(more[qid]) == pytest.approx(numbers(forward[qid]), abs=1e-4)
        assert backward[qid].get("choice") == forward[qid].get("choice") == more[qid].get("choice")


def test_the_prompt_limit_is_checked_before_template_work(scripted):
    from app.engine.base import EngineInputError

    limited = dataclasses.replace(build.read_settings(Settings.of(canvas=64)), max_prompt_tokens=50)
    with pytest.raises(EngineInputError) as info:
        decide(scripted, limited, samples=1)
    assert info.value.status == 400 and info.value.error_type == "max_tokens_exceeded"
    assert scripted.reads == []


def test_thought_budget_counts_every_group_that_thinks(scripted):
    budget = dataclasses.replace(build.read_settings(Settings.of(canvas=64)), max_thought_tokens=100)
    decide(scripted, budget, think=64, samples=1)  # one group: 64 tokens
    with pytest.raises(Exception) as info:
        decide(scripted, budget, think=64, samples=1, isolate=True)  # three groups: 192 tokens
    assert getattr(info.value, "loc", None) == ("think",) and info.value.status == 400


def test_plan_cost_counts_canvases_and_thought_tokens(scripted):
    decider = Decider(scripted, build.read_settings(Settings.of(canvas=64)))
    body = {"state": STATE, "questions": SCHEMA, "samples": 3, "isolate": True, "think": 10}
    plan = decider.plan(parse_decision(body, LIMITS))
    assert plan.canvases == 9 and plan.thought_tokens == 30 and plan.cost == 39


@pytest.mark.parametrize("garbage", [
    lambda spec: [],  # no result
    lambda spec: [ReadResult(slots=(), prompt_tokens=1)],  # no canvases
    lambda spec: [ReadResult(slots=tuple((SlotRead((float("nan"),) * len(spec.label_ids[0]), 0),) * len(spec.slots)
                                         for _ in spec.canvases), prompt_tokens=1)],
    lambda spec: [ReadResult(slots=tuple((SlotRead((0.5, 0.7), 0),) * len(spec.slots) for _ in spec.canvases),
                             prompt_tokens=1)],
])
def test_a_malformed_read_is_the_engines_failure(tokenizer, garbage):
    from app.engine.base import EngineError

    class Garbage(ScriptedReader):
        async def read(self, specs):
            return garbage(specs[0])

    with pytest.raises(EngineError, match="malformed read"):
        decide(Garbage(tokenizer), questions={"n": {"type": "noul"}}, samples=1)


def test_isolate_with_a_shared_sheet_keeps_each_question_its_number(scripted, tokenizer):
    decide(scripted, samples=1, isolate=True, chunk_prompt="shared")
    for spec in scripted.reads:
        sheet = text(tokenizer, spec.prompt.ids)
        assert "Question q1:" in sheet and "Question q3:" in sheet  # every question listed
    canvases = sorted(text(tokenizer, spec.canvases[0])[:3] for spec in scripted.reads)
    assert canvases == ["q1:", "q2:", "q3:"]  # and each canvas answers under its own number


def test_estimate_applies_the_adjustment_to_every_draw_before_averaging():
    from app.decisions.estimate import chain, estimate
    from app.decisions.questions import CHOICE, Alternative, Question
    from app.engine.base import ReadResult, SlotRead

    question = Question("q", 1, CHOICE, "pick", (Alternative("a", None), Alternative("b", None)))
    draws = [[math.log(0.8), math.log(0.2)], [math.log(0.6), math.log(0.4)]]
    result = ReadResult(tuple((SlotRead(tuple(lp), 0),) for lp in draws), 10)
    flip = lambda q, probs: list(reversed(probs))  # noqa: E731
    halve = lambda q, probs: [probs[0] / 2, 1 - probs[0] / 2]  # noqa: E731
    plain, _ = estimate([question], [result], [0], [[1, 2]])
    flipped, tops = estimate([question], [result], [0], [[1, 2]], chain(flip, None, halve))
    assert plain["q"].probs == pytest.approx((0.7, 0.3))
    # each draw flipped (0.2, 0.8), (0.4, 0.6), then halved: (0.1, 0.9), (0.2, 0.8); the mean after
    assert flipped["q"].probs == pytest.approx((0.15, 0.85))
    assert [t["q"][0] for t in tops] == ["b", "b"]
    assert chain(None, None) is None and chain(flip) is flip


def test_the_log_summary_says_how_long_the_reads_waited_beside_the_decisions_time(scripted):
    read = scripted.read

    async def slow(specs):  # the engine's queue and turns, as the decision sees them
        await asyncio.sleep(0.05)
        return await read(specs)

    scripted.read = slow
    outcome = decide(scripted, questions={"urgent": SCHEMA["urgent"]})
    found = re.search(r" reads=\d+ (\d+)ms \(reads (\d+)ms\)$", outcome.summary)
    assert found is not None, outcome.summary
    total, reads = int(found[1]), int(found[2])
    assert reads >= 50 and total >= reads
