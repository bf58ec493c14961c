"""Request validation: every rule of a decision body (and Jev's limits) with the field it names."""

from __future__ import annotations

import base64
import dataclasses

import pytest

from app.decisions.errors import RequestError
from app.decisions.request import parse_decision
from app.selftest import DECISION
from tests.conftest import LIMITS

TICKET = {"model": "jev-latest", **DECISION}  # the README's example (app/selftest.py)


def with_(**changes):
    body = {**TICKET, **changes}
    return {k: v for k, v in body.items() if v is not ...}


def question(**spec):
    return with_(questions={"q": spec})


def refused(body, limits=LIMITS) -> RequestError:
    with pytest.raises(RequestError) as info:
        parse_decision(body, limits)
    return info.value


def test_the_readme_example_parses_in_order():
    decision = parse_decision(TICKET, LIMITS)
    assert [q.qid for q in decision.questions] == ["urgent", "team", "tone"]
    assert [q.model_id for q in decision.questions] == ["q1", "q2", "q3"]
    assert decision.questions[1].names == ("billing", "outage", "feature")
    assert decision.questions[1].alternatives[1].description == "service down"
    assert decision.questions[2].names == ("calm", "annoyed", "furious")
    assert decision.seed == 42 and decision.samples.mode == "auto" and decision.samples.count == 4
    assert decision.state_text == '{"ticket": "Everything is down and we have a demo at noon."}'


def test_a_string_state_is_read_verbatim_and_unicode_is_kept():
    decision = parse_decision(with_(state="  naïve café ☕  "), LIMITS)
    assert decision.state_text == "  naïve café ☕  "
    decision = parse_decision(with_(state={"note": "日本語"}), LIMITS)
    assert decision.state_text == '{"note": "日本語"}'


def test_ids_and_option_names_are_kept_byte_for_byte():
    body = with_(questions={
        "Ünïcode id 🚀": {"type": "choice", "criteria": {"option 😀": None, " spaced ": None}},
        "id: with colon\nand newline": {"type": "noul"},
    })
    decision = parse_decision(body, LIMITS)
    assert decision.questions[0].qid == "Ünïcode id 🚀"
    assert decision.questions[0].names == ("option 😀", " spaced ")
    assert decision.questions[1].qid == "id: with colon\nand newline"


@pytest.mark.parametrize("body, message, loc", [
    (with_(questions={}), "non-empty map", ("questions",)),
    (with_(questions=["a"]), "non-empty map", ("questions",)),
    (with_(questions=...), "non-empty map", ("questions",)),
    (question(type="noul", criteria=["yes"]), "noul criteria must be an object", ("questions", "q", "criteria")),
    (question(type="noul", criteria={"maybe": "x"}), "only true and false", ("questions", "q", "criteria", "maybe")),
    (question(type="choice", criteria=["a", "b"]), "map option names", ("questions", "q", "criteria")),
    (question(type="choice", criteria={}), "map option names", ("questions", "q", "criteria")),
    (question(type="choice", criteria={"only": None}), "at least two", ("questions", "q", "criteria")),
    (question(type="choice", criteria={"a": None, "  ": None}), "must not be empty", ("questions", "q", "criteria", "  ")),
    (question(type="score", criteria={"a": 1}), "ordered list of levels", ("questions", "q", "criteria")),
    (question(type="score", criteria=["one"]), "at least two", ("questions", "q", "criteria")),
    (question(type="score", criteria=["one", None]), "must not be empty", ("questions", "q", "criteria", 1)),
    (question(type="rank"), "unknown type 'rank'", ("questions", "q", "type")),
    (question(type=None), "unknown type", ("questions", "q", "type")),
    (question(instructions="no type"), "unknown type 'None'", ("questions", "q", "type")),
    (with_(questions={1: {"type": "noul"}}), "ids must be strings", ("questions", 1)),
    (question(type="noul", extra=1), "unknown field 'extra'", ("questions", "q", "extra")),
    (with_(questions={"q": "noul"}), "must be an object", ("questions", "q")),
    (question(type="noul", depends_on="x"), "depends_on must be a list", ("questions", "q", "depends_on")),
    (question(type="noul", depends_on=[1]), "depends_on must be a list", ("questions", "q", "depends_on")),
    (question(type="noul", ask_if=["x"]), "ask_if must map", ("questions", "q", "ask_if")),
    (question(type="noul", ask_if={"x": []}), "ask_if must map", ("questions", "q", "ask_if")),
    (question(type="noul", alone="yes"), "alone must be true or false", ("questions", "q", "alone")),
    (with_(state=...), "state: required", ("state",)),
    (with_(state=None), "state: required", ("state",)),
    (with_(model=7), "model: must be a string", ("model",)),
    (with_(samples=0), "samples must be a positive count", ("samples",)),
    (with_(samples="lots"), "samples must be a positive count", ("samples",)),
    (with_(samples=True), "samples must be a positive count", ("samples",)),
    (with_(samples=2.5), "samples must be a positive count", ("samples",)),
    (with_(auto_max=0), "auto_max must be an integer", ("auto_max",)),
    (with_(auto_max="4"), "auto_max must be an integer", ("auto_max",)),
    (with_(auto_threshold="0.1"), "auto_threshold must be a number", ("auto_threshold",)),
    (with_(auto_threshold=-1), "auto_threshold must be a number", ("auto_threshold",)),
    (with_(steps=0), "steps must be an integer from 1 to 8", ("steps",)),
    (with_(steps=9), "steps must be an integer from 1 to 8", ("steps",)),
    (with_(steps="2"), "steps must be an integer", ("steps",)),
    (with_(think="lots"), "think must be a thought budget", ("think",)),
    (with_(think=True), "think must be a thought budget", ("think",)),
    (with_(think=4097), "think must be a thought budget", ("think",)),
    (with_(seed="abc"), "seed: must be an integer", ("seed",)),
    (with_(seed=1.5), "seed: must be an integer", ("seed",)),
    (with_(seed=2**70), "seed: must be an integer", ("seed",)),
    (with_(seed=True), "seed: must be an integer", ("seed",)),
    (with_(ask=[]), "ask must list question ids", ("ask",)),
    (with_(ask=["nope"]), "ask must list question ids", ("ask",)),
    (with_(ask="urgent"), "ask must list question ids", ("ask",)),
    (with_(chunk_rows=4), "chunk_rows must be an integer of at least 8", ("chunk_rows",)),
    (with_(chunk_prompt="mine"), 'chunk_prompt must be "shared" or "own"', ("chunk_prompt",)),
    (with_(sequential="yes"), "sequential must be true or false", ("sequential",)),
    (with_(isolate=1), "isolate must be true or false", ("isolate",)),
    (with_(confidence="entropy"), "confidence must be", ("confidence",)),
    (with_(images="data:image/png;base64,AAAA"), "images: must be a list", ("images",)),
    (with_(images=["not an image"]), "images[0]", ("images", 0)),
    (with_(images=[{"content_type": "text/plain", "base64": "AAAA"}]), "images[0]", ("images", 0)),
    (with_(images=["data:image/png;base64,***"]), "does not decode", ("images", 0)),
    (with_(images=["data:image/png;base64,"]), "images[0]: the image is empty", ("images", 0)),
    (with_(assets=["x"]), "assets: must map a reference", ("assets",)),
    (with_(assets={"<image:x>": {"type": "video", "part": "asset-0"}}), "assets['<image:x>']: must be", ("assets", "<image:x>")),
    (with_(assets={"<image:x>": {"type": "image", "part": "asset-0"}}), "the request has no part 'asset-0'",
     ("assets", "<image:x>")),
    ("not an object", "must be a JSON object", ()),
])
def test_refusals_name_the_field(body, message, loc):
    error = refused(body)
    assert error.status == 422
    assert message in error.message
    assert error.loc == loc


def test_dependency_refusals():
    deps = {
        "a": {"type": "noul"},
        "b": {"type": "choice", "criteria": {"billing": None, "outage": None}},
    }
    error = refused(with_(questions={**deps, "c": {"type": "noul", "depends_on": ["zzz"]}}))
    assert "depends on unknown question 'zzz'" in error.message
    error = refused(with_(questions={"a": {"type": "noul", "depends_on": ["a"]}}))
    assert "unknown question 'a'" in error.message
    error = refused(with_(questions={
        "a": {"type": "noul", "depends_on": ["b"]}, "b": {"type": "noul", "depends_on": ["a"]}}))
    assert "cycle" in error.message and "a, b" in error.message
    error = refused(with_(questions={**deps, "c": {"type": "noul", "ask_if": {"b": ["legal"]}}}))
    assert "ask_if values for 'b' must be among" in error.message and "'billing'" in error.message
    assert error.loc == ("questions", "c", "ask_if", "b")
    error = refused(with_(questions={**deps, "c": {"type": "noul", "depends_on": ["a"]}}, ask=["c"]))
    assert "ask names 'c' but not everything it depends on" in error.message


def test_ask_if_values_are_answer_names_per_type():
    body = with_(questions={
        "n": {"type": "noul"},
        "s": {"type": "score", "criteria": ["low", "high"]},
        "x": {"type": "noul", "ask_if": {"n": ["yes"], "s": ["high"]}},
    })
    decision = parse_decision(body, LIMITS)
    assert decision.questions[2].depends_on == ("n", "s")
    error = refused(with_(questions={"n": {"type": "noul"}, "x": {"type": "noul", "ask_if": {"n": ["true"]}}}))
    assert "['yes', 'no']" in error.message


def test_jev_limits_are_400_with_jevs_message():
    error = refused(question(type="choice", criteria={f"o{i}": None for i in range(256)}))
    assert error.status == 400 and error.jev_detail == "Too many choices. Must have at most 255 choices."
    error = refused(question(type="score", criteria=[f"l{i}" for i in range(11)]))
    assert error.status == 400 and error.jev_detail == "Too many score levels. Must have at most 10 levels."
    many = question(type="choice", criteria={f"o{i}": None for i in range(255)})
    assert len(parse_decision(many, LIMITS).questions[0].names) == 255
    assert len(parse_decision(question(type="score", criteria=[f"l{i}" for i in range(10)]), LIMITS).questions[0].names) == 10


def test_question_count_and_id_length_limits():
    many = {f"q{i}": {"type": "noul"} for i in range(257)}
    error = refused(with_(questions=many))
    assert error.status == 400 and "at most 256 questions" in error.message
    error = refused(with_(questions={"x" * 300: {"type": "noul"}}))
    assert error.status == 400 and "longer than 256 characters" in error.message


def test_samples_and_auto_max_are_clamped_to_the_cap():
    assert parse_decision(with_(samples=100), LIMITS).samples.count == 32
    assert parse_decision(with_(auto_max=100), LIMITS).samples.count == 32
    assert parse_decision(with_(samples=3), dataclasses.replace(LIMITS, max_samples=2)).samples.count == 2
    auto = parse_decision(with_(auto_max=2, auto_threshold=0.5), LIMITS).samples
    assert (auto.mode, auto.count, auto.threshold) == ("auto", 2, 0.5)


def test_defaults_and_extension_values():
    decision = parse_decision(with_(
        seed=7, samples=2, steps=3, think=64, instructions={"ctx": "x"}, ask=["urgent", "tone"],
        chunk_rows=32, chunk_prompt="shared", sequential=True, isolate=True, confidence="jev",
    ), LIMITS)
    assert decision.seed == 7 and decision.samples.count == 2 and decision.steps == 3 and decision.think == 64
    assert decision.instructions == '{"ctx": "x"}'
    assert decision.ask == ("urgent", "tone") and [q.qid for q in decision.asked()] == ["urgent", "tone"]
    assert (decision.chunk_rows, decision.chunk_prompt, decision.sequential, decision.isolate) == (32, "shared", True, True)
    assert decision.confidence == "jev"
    assert parse_decision(with_(seed=42.0), LIMITS).seed == 42
    assert parse_decision(TICKET, dataclasses.replace(LIMITS, confidence="jev", isolate=True)).confidence == "jev"


def test_jev_content_forms_for_instructions_descriptions_and_levels():
    body = with_(questions={
        "n": {"type": "noul", "instructions": {"task": "x"}, "criteria": {"true": None, "false": ["ok", 1]}},
        "s": {"type": "score", "criteria": ["low", {"label": "mid"}, ["high"]]},
    })
    decision = parse_decision(body, LIMITS)
    noul, score = decision.questions
    assert noul.instructions == '{"task": "x"}'
    assert noul.alternatives[0].description is None and noul.alternatives[1].description == '["ok", 1]'
    assert score.names == ("low", '{"label": "mid"}', '["high"]')
    assert score.alternatives[1].legend == {"label": "mid"}


def test_json_images_parse_in_both_forms():
    png = base64.b64encode(b"\x89PNG fake").decode()
    images = [f"data:image/png;base64,{png}", {"content_type": "image/jpeg", "base64": png}]
    decision = parse_decision(with_(images=images), LIMITS)
    assert [image.content_type for image in decision.images] == ["image/png", "image/jpeg"]
    assert decision.images[0].data == b"\x89PNG fake" and decision.images[1].source == "images[1]"


def test_image_limits():
    png = base64.b64encode(b"x" * 100).decode()
    error = refused(with_(images=[f"data:image/png;base64,{png}"] * 3), dataclasses.replace(LIMITS, max_images=2))
    assert error.status == 400 and "at most 2 images" in error.message
    error = refused(with_(images=[f"data:image/png;base64,{png}"]), dataclasses.replace(LIMITS, max_image_bytes=50))
    assert error.status == 413 and "images[0]" in error.message
    error = refused(with_(images=[f"data:image/png;base64,{png}"] * 2), dataclasses.replace(LIMITS, max_total_image_bytes=150))
    assert error.status == 413 and "bytes of images" in error.message
