"""The one translation of pydantic's errors: every row of the refusal table is reached by a body and
says what it says; unknown keys at the top are ignored and listed, inside a question refused; the
order of the checks; nulls; the cost of a big body."""

from __future__ import annotations

import base64
import dataclasses
import time

import pytest

from app.decisions import refusals
from app.decisions.errors import RequestError
from app.decisions.refusals import ANY, REFUSALS
from app.decisions.request import parse_decision
from app.engine.base import ImageInput
from tests.conftest import LIMITS

BASE = {"state": "x", "questions": {"q": {"type": "noul"}}}
PNG = base64.b64encode(b"\x89PNG fake").decode()
Q = ("questions", ANY)


def body(**changes):
    return {**BASE, **changes}


def question(**spec):
    return body(questions={"q": spec})


# One body for every row of the table: (row) -> (body, limits changes, status, message, loc)
ROWS = {
    ((), None): ("text", {}, 422, "body: must be a JSON object with state and questions", ()),
    (("questions",), None): (body(questions=[]), {}, 422, "questions: needs a non-empty map of id -> question", ("questions",)),
    (("questions",), "too_long"): (body(questions={"a": {"type": "noul"}, "b": {"type": "noul"}}), {"max_questions": 1}, 400,
                                   "questions: at most 1 questions per request, got 2", ("questions",)),
    ((*Q, "[key]"), "string_too_long"): (body(questions={"x" * 50: {"type": "noul"}}), {"max_id_length": 45}, 400,
                                         f"question id '{'x' * 40}...' is longer than 45 characters", ("questions", "x" * 50)),
    ((*Q, "[key]"), None): (body(questions={7: {"type": "noul"}}), {}, 422, "questions: ids must be strings", ("questions", 7)),
    (Q, None): (body(questions={"q": ["noul"]}), {}, 422, "question 'q': must be an object", ("questions", "q")),
    (Q, "union_tag_invalid"): (question(type="rank"), {}, 422, "question 'q': unknown type 'rank'", ("questions", "q", "type")),
    (Q, "union_tag_not_found"): (question(alone=True), {}, 422, "question 'q': unknown type 'None'", ("questions", "q", "type")),
    ((*Q, ANY), "too_short"): (question(type="score", criteria=["only"]), {}, 422,
                               "question 'q': needs at least two alternatives", ("questions", "q", "criteria")),
    ((*Q, ANY, ANY), "extra_forbidden"): (question(type="noul", critera={}), {}, 422, "question 'q': unknown field 'critera'",
                                          ("questions", "q", "critera")),
    ((*Q, "noul", "criteria"), None): (question(type="noul", criteria="yes or no"), {}, 422,
                                       "question 'q': noul criteria must be an object with true and false",
                                       ("questions", "q", "criteria")),
    ((*Q, "noul", "criteria", ANY), "extra_forbidden"): (question(type="noul", criteria={"yes": "x"}), {}, 422,
                                                         "question 'q': noul criteria take only true and false, not 'yes'",
                                                         ("questions", "q", "criteria", "yes")),
    ((*Q, "choice", "criteria"), None): (question(type="choice"), {}, 422,
                                         "question 'q': choice criteria must map option names to descriptions",
                                         ("questions", "q", "criteria")),
    ((*Q, "choice", "criteria"), "too_long"): (question(type="choice", criteria={f"o{i}": None for i in range(256)}), {}, 400,
                                               "Too many choices. Must have at most 255 choices.",
                                               ("questions", "q", "criteria")),
    ((*Q, "choice", "criteria", ANY), None): (question(type="choice", criteria={"a": None, "\t": None}), {}, 422,
                                              "question 'q': option names must not be empty",
                                              ("questions", "q", "criteria", "\t")),
    ((*Q, "score", "criteria"), None): (question(type="score", criteria="low, high"), {}, 422,
                                        "question 'q': score criteria must be an ordered list of levels",
                                        ("questions", "q", "criteria")),
    ((*Q, "score", "criteria"), "too_long"): (question(type="score", criteria=[str(i) for i in range(11)]), {}, 400,
                                              "Too many score levels. Must have at most 10 levels.",
                                              ("questions", "q", "criteria")),
    ((*Q, "score", "criteria", ANY), None): (question(type="score", criteria=["low", " "]), {}, 422,
                                             "question 'q': level 1 must not be empty", ("questions", "q", "criteria", 1)),
    ((*Q, ANY, "depends_on"), None): (question(type="noul", depends_on=[["a"]]), {}, 422,
                                      "question 'q': depends_on must be a list of question ids",
                                      ("questions", "q", "depends_on")),
    ((*Q, ANY, "ask_if"), None): (question(type="noul", ask_if={"a": "yes"}), {}, 422,
                                  "question 'q': ask_if must map a question id to a non-empty list of its answers",
                                  ("questions", "q", "ask_if")),
    ((*Q, ANY, "alone"), None): (question(type="noul", alone=0), {}, 422, "question 'q': alone must be true or false",
                                 ("questions", "q", "alone")),
    (("auto_max",), None): (body(auto_max=1.5), {}, 422, "schema: auto_max must be an integer of at least 1", ("auto_max",)),
    (("auto_threshold",), None): (body(auto_threshold=True), {}, 422, "schema: auto_threshold must be a number of at least 0",
                                  ("auto_threshold",)),
    (("samples",), None): (body(samples="all"), {}, 422, 'schema: samples must be a positive count or "auto"', ("samples",)),
    (("steps",), None): (body(steps=4), {"max_steps": 3}, 422, "schema: steps must be an integer from 1 to 3", ("steps",)),
    (("think",), None): (body(think=-1), {}, 422, "schema: think must be a thought budget in tokens, 0 to 4096", ("think",)),
    (("seed",), None): (body(seed=-(2**63)), {}, 422,
                        "seed: must be an integer from -9223372036854775807 to 9223372036854775807", ("seed",)),
    (("ask",), None): (body(ask=[1]), {}, 422, "schema: ask must list question ids from this schema", ("ask",)),
    (("chunk_rows",), None): (body(chunk_rows=7), {}, 422, "schema: chunk_rows must be an integer of at least 8",
                              ("chunk_rows",)),
    (("chunk_prompt",), None): (body(chunk_prompt="OWN"), {}, 422, 'schema: chunk_prompt must be "shared" or "own"',
                                ("chunk_prompt",)),
    (("sequential",), None): (body(sequential="true"), {}, 422, "schema: sequential must be true or false", ("sequential",)),
    (("isolate",), None): (body(isolate="false"), {}, 422, "schema: isolate must be true or false", ("isolate",)),
    (("confidence",), None): (body(confidence="JEV"), {}, 422,
                              'schema: confidence must be "djev" (probability of the answer) or "jev"', ("confidence",)),
    (("debias",), None): (body(debias="sorted"), {}, 422,
                          'schema: debias must be one of "off", "canonical", "rotate", "prior", "canonical+prior", '
                          '"rotate+prior"', ("debias",)),
    (("model",), None): (body(model=["jev-latest"]), {}, 422, 'model: must be a string such as "jev-latest"', ("model",)),
    (("state",), None): ({"questions": BASE["questions"]}, {}, 422, "state: required", ("state",)),
    (("images",), None): (body(images={"a": PNG}), {}, 422,
                          "images: must be a list of data:image/... URLs or {content_type, base64} objects", ("images",)),
    (("images",), "too_long"): (body(images=[f"data:image/png;base64,{PNG}"] * 2), {"max_images": 1}, 400,
                                "images: at most 1 images per request, got 2", ("images",)),
    (("images", ANY), None): (body(images=[{"content_type": "image/png"}]), {}, 422,
                              "images[0]: a data:image/... URL or an object with content_type and base64", ("images", 0)),
    (("images", ANY), "too_large"): (body(images=[f"data:image/png;base64,{PNG}"]), {"max_image_bytes": 4}, 413,
                                     "images[0]: an image may be at most 4 bytes", ("images", 0)),
    (("images", ANY), "base64_decode"): (body(images=["data:image/png;base64,AAA"]), {}, 422,
                                         "images[0]: the base64 data does not decode", ("images", 0)),
    (("images", ANY), "empty"): (body(images=[{"content_type": "image/png", "base64": ""}]), {}, 422,
                                 "images[0]: the image is empty", ("images", 0)),
    (("assets",), None): (body(assets="asset-0"), {}, 422,
                          'assets: must map a reference to {"type": "image", "part": "asset-N"}', ("assets",)),
    (("assets", ANY), None): (body(assets={"<image:a>": {"part": "asset-0"}}), {}, 422,
                              'assets[\'<image:a>\']: must be {"type": "image", "part": "asset-N"}', ("assets", "<image:a>")),
}


def test_every_row_of_the_table_has_a_body():
    assert set(ROWS) == set(REFUSALS)


@pytest.mark.parametrize("row", list(ROWS), ids=[f"{'.'.join(map(str, p)) or 'body'}:{t}" for p, t in ROWS])
def test_each_refusal_row(row, monkeypatch):
    payload, changes, status, message, loc = ROWS[row]
    used = []
    matching_row = refusals.matching_row

    def recording(prefix, kind):
        found = matching_row(prefix, kind)
        if found is not None:
            used.append(found)
        return found

    monkeypatch.setattr(refusals, "matching_row", recording)
    with pytest.raises(RequestError) as info:
        parse_decision(payload, dataclasses.replace(LIMITS, **changes))
    error = info.value
    assert used == [row]
    assert (error.status, error.message, error.loc) == (status, message, loc)
    assert error.jev_detail == (message if REFUSALS[row].jev_detail else None)


def test_the_kind_is_pydantics_error_type():
    """Jev's server is FastAPI: a 422's detail type is pydantic's."""
    assert refused(body(seed="42")).kind == "int_type"
    assert refused({"questions": BASE["questions"]}).kind == "missing"
    assert refused(question(type="noul", extra=1)).kind == "extra_forbidden"
    assert refused(body(steps=9)).kind == "less_than_equal"


def refused(payload, limits=LIMITS) -> RequestError:
    with pytest.raises(RequestError) as info:
        parse_decision(payload, limits)
    return info.value


def test_unknown_top_level_keys_are_ignored_and_listed_in_body_order():
    decision = parse_decision({"x_trace_id": "t-1", **BASE, "sample": 2, "debug": None}, LIMITS)
    assert decision.ignored == ("x_trace_id", "sample", "debug")
    assert decision.samples.mode == "auto"  # `sample` is not `samples`
    assert parse_decision(BASE, LIMITS).ignored == ()


def test_unknown_keys_inside_a_question_are_refused_first():
    error = refused(question(type="choice", criteria={"only": None}, bogus=1, alone="no"))
    assert (error.message, error.loc, error.kind) == (
        "question 'q': unknown field 'bogus'", ("questions", "q", "bogus"), "extra_forbidden")
    # and in question order: the first question's bad value before the second's unknown key
    error = refused(body(questions={"a": {"type": "noul", "alone": "no"}, "b": {"type": "noul", "bogus": 1}}))
    assert error.loc == ("questions", "a", "alone")


def test_the_order_of_the_checks():
    bad_question = {"q": {"type": "noul", "alone": "no"}}
    # a question before the extension keys, the extension keys before model, state and images
    assert refused(body(questions=bad_question, steps=0)).loc == ("questions", "q", "alone")
    assert refused(body(steps=0, model=1, state=None, images="x")).loc == ("steps",)
    assert refused(body(model=1, images="x", state=None)).loc == ("model",)
    assert refused({"questions": BASE["questions"], "images": "x"}).loc == ("state",)
    # the dependencies between questions before the extension keys
    deps = {"a": {"type": "noul", "depends_on": ["zzz"]}}
    assert refused(body(questions=deps, steps=0)).loc == ("questions", "a", "depends_on")
    # the count before any entry: 256 options with a blank one is Jev's 400
    many = {" ": None, **{f"o{i}": None for i in range(255)}}
    assert refused(question(type="choice", criteria=many)).status == 400
    assert refused(body(questions={f"q{i}": "bad" for i in range(300)})).status == 400
    # the assets map before the body
    assert refused({"assets": 3}).loc == ("assets",)


def test_a_null_is_a_member_left_out():
    decision = parse_decision(body(
        samples=None, steps=None, think=None, seed=None, isolate=None, confidence=None, chunk_prompt=None,
        sequential=None, images=None, assets=None, model=None, instructions=None, ask=None, chunk_rows=None,
        questions={"q": {"type": "noul", "criteria": None, "depends_on": None, "ask_if": None, "alone": None,
                         "instructions": None}},
    ), LIMITS)
    assert (decision.samples.mode, decision.steps, decision.think, decision.seed) == ("auto", 1, 0, LIMITS.default_seed)
    assert (decision.isolate, decision.confidence, decision.chunk_prompt) == (LIMITS.isolate, LIMITS.confidence, "own")
    assert decision.questions[0].names == ("yes", "no") and decision.questions[0].instructions == ""
    assert refused(body(state=None)).message == "state: required"


def test_dependency_chains_and_cycles_are_checked_in_one_pass():
    chain = {f"q{i}": {"type": "noul", "depends_on": [f"q{i + 1}"] if i < 255 else []} for i in range(256)}
    assert parse_decision(body(questions=chain), LIMITS).questions[0].depends_on == ("q1",)
    # a cycle lists every question that can never be read: those in it and those after it
    looped = {**chain, "q255": {"type": "noul", "depends_on": ["q250"]}}
    error = refused(body(questions=looped))
    assert error.loc == ("questions",)
    assert error.message == "schema: dependency cycle among " + ", ".join(f"q{i}" for i in range(256))
    ok = {"a": {"type": "noul"}, "b": {"type": "noul", "depends_on": ["c"]}, "c": {"type": "noul", "depends_on": ["b"]}}
    assert refused(body(questions=ok)).message == "schema: dependency cycle among b, c"


def test_messages_are_not_reinterpreted():
    """Ids and values are data, never format fields."""
    error = refused(body(questions={"{qid}": {"type": "noul", "depends_on": ["{message}"]}}))
    assert error.message == "question '{qid}': depends on unknown question '{message}'"
    error = refused(body(questions={"{limits}": {"type": "rank"}}))
    assert error.message == "question '{limits}': unknown type 'rank'"


class TestAssets:
    REF = "<image:" + "ab" * 16 + ">"
    PART = ImageInput(data=b"png", content_type="image/png", source="part 'asset-0'")

    def test_references_become_image_numbers_after_the_multipart_images(self):
        first = ImageInput(data=b"jpg", content_type="image/jpeg", source="part 'photo'")
        payload = body(state=f"look at {self.REF}", assets={self.REF: {"type": "image", "part": "asset-0"}},
                       questions={"q": {"type": "noul", "instructions": [f"is {self.REF} torn?"]}})
        decision = parse_decision(payload, LIMITS, images=(first,), assets={"asset-0": self.PART})
        assert decision.images == (first, self.PART)
        assert decision.state_text == "look at [image 2]"
        assert decision.questions[0].instructions == '["is [image 2] torn?"]'

    def test_parts_and_the_map_must_agree(self):
        error = refused_with(BASE, {"asset-0": self.PART})
        assert error.message == "part 'asset-0': an asset part, but the request has no assets map"
        error = refused_with(body(assets={}), {"asset-0": self.PART})
        assert error.message == "part 'asset-0': not named in the assets map" and error.loc == ("assets",)
        error = refused_with(body(assets={self.REF: {"type": "image", "part": "asset-1"}}), {"asset-0": self.PART})
        assert "the request has no part 'asset-1'" in error.message and error.loc == ("assets", self.REF)

    def test_asset_images_count_toward_the_image_limit(self):
        payload = body(assets={self.REF: {"type": "image", "part": "asset-0"}}, images=[f"data:image/png;base64,{PNG}"])
        limits = dataclasses.replace(LIMITS, max_images=1)
        with pytest.raises(RequestError) as info:
            parse_decision(payload, limits, assets={"asset-0": self.PART})
        assert info.value.status == 400 and info.value.message == "images: at most 1 images per request, got 2"


def refused_with(payload, assets) -> RequestError:
    with pytest.raises(RequestError) as info:
        parse_decision(payload, LIMITS, assets=assets)
    return info.value


MANY = 200_000
FLOODS = {
    "depends_on": (question(type="noul", depends_on=[1] * MANY), ("questions", "q", "depends_on")),
    "ask": (body(ask=[1] * MANY), ("ask",)),
    "ask_if values": (question(type="noul", ask_if={"q": [1] * MANY}), ("questions", "q", "ask_if")),
    "ask_if keys": (question(type="noul", ask_if={f"k{i}": 1 for i in range(MANY)}), ("questions", "q", "ask_if")),
    "question keys": (question(type="noul", **{f"k{i}": 1 for i in range(MANY)}), ("questions", "q", "k0")),
    "noul criteria keys": (question(type="noul", criteria={f"k{i}": 1 for i in range(MANY)}),
                           ("questions", "q", "criteria", "k0")),
    "blank option names": (body(questions={f"q{i}": {"type": "choice", "criteria": {" " * j: None for j in range(1, 256)}}
                                           for i in range(256)}), ("questions", "q0", "criteria", " ")),
}


@pytest.mark.parametrize("name", list(FLOODS))
def test_a_flood_of_bad_entries_is_one_cheap_error(name):
    """Pydantic reports every error it finds; the rules keep that to one per list, map or question,
    so a body of a million bad entries costs no more than a good one."""
    payload, loc = FLOODS[name]
    started = time.process_time()
    error = refused(payload)
    assert error.loc == loc
    assert time.process_time() - started < 0.2  # reporting every entry took ~0.5 s for 200,000


def test_the_largest_body_validates_in_well_under_100_ms():
    """256 questions x 255 options (every documented limit at once). The bound is loose: the point
    is that nothing here grows worse than linearly with the body."""
    payload = body(questions={
        f"question {i}": {"type": "choice", "instructions": f"question {i}?",
                          "criteria": {f"option {j}": f"description {j}" if j % 2 else None for j in range(255)}}
        for i in range(256)
    })
    parse_decision(payload, LIMITS)
    best = min(_timed(lambda: parse_decision(payload, LIMITS)) for _ in range(3))
    assert best < 0.5


def _timed(run) -> float:
    started = time.process_time()  # CPU time: the machine may be busy with other work
    run()
    return time.process_time() - started
