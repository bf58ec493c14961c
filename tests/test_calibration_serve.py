"""`djev serve --calibration FILE`: the fit changes every answer exactly as its parameters say, /health
and each response's diagnostics name it, and a file fitted for something else, or malformed, is
refused at start."""

from __future__ import annotations

import asyncio
import json
import math
import threading

import pytest
from starlette.testclient import TestClient

from app import build
from app.config import Settings
from app.decisions.calibration import CalibrationError, parse_calibration
from app.decisions.request import parse_decision
from app.decisions.run import Decider
from app.server import create_app
from app.web.services import Services
from tests.conftest import LIMITS
from tests.fakes import ScriptedReader
from tests.test_cli import serve_in_this_thread

QUESTIONS = {
    "urgent": {"type": "noul", "instructions": "Urgent?"},
    "team": {"type": "choice", "instructions": "Which team?", "criteria": {"billing": None, "outage": None, "feature": None}},
    "tone": {"type": "score", "instructions": "How angry?", "criteria": ["calm", "annoyed", "furious"]},
}


def calibration_json(reader: ScriptedReader, settings: Settings, **fitted_for) -> dict:
    meta = build.fitted_for(settings, reader.info, reader.tokenizer).as_json()
    meta.update(fitted_for)
    return {
        "format": "djev-calibration", "version": 1, "fitted_for": meta,
        "buckets": {
            "noul": {"kind": "noul", "method": "platt", "a": 2.0, "b": 0.5, "train": 100},
            "choice:3": {"kind": "choice", "method": "temperature", "temperature": 2.0, "bias": [0.0, 0.5, -0.5], "train": 100},
            "score:2-5": {"kind": "score", "method": "temperature", "temperature": 0.5, "bias": [], "train": 100},
        },
        "report": {},
    }


def write(tmp_path, data: dict, name: str = "cal.json"):
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return path


def softmax(z):
    weights = [math.exp(v) for v in z]
    return [w / sum(weights) for w in weights]


def test_a_calibration_changes_the_answers_exactly_as_its_parameters_say(tokenizer):
    reader = ScriptedReader(tokenizer, conf=0.7)  # every slot: its first label at 0.7, the others sharing 0.3
    calibration = parse_calibration(calibration_json(reader, Settings()), {"file": "cal.json", "sha256": "abc"})
    decider = Decider(reader, build.read_settings(Settings()), calibration=calibration)
    outcome = asyncio.run(decider.decide(parse_decision({"state": "x", "samples": 2, "questions": QUESTIONS}, LIMITS)))
    answers = outcome.answers
    # noul: σ(2 · ln(0.7 / 0.3) + 0.5)
    assert answers["urgent"]["noul"] == pytest.approx(1 / (1 + math.exp(-(2 * math.log(0.7 / 0.3) + 0.5))))
    # choice: softmax(ln p / 2 + bias), p = (0.7, 0.15, 0.15)
    team = softmax([math.log(0.7) / 2, math.log(0.15) / 2 + 0.5, math.log(0.15) / 2 - 0.5])
    assert list(answers["team"]["probabilities"].values()) == pytest.approx(team)
    assert answers["team"]["confidence"] == pytest.approx(team[0]) and answers["team"]["choice"] == "billing"
    # score at T = 0.5: p² renormalised
    tone = [0.49 / 0.535, 0.0225 / 0.535, 0.0225 / 0.535]
    assert list(answers["tone"]["probabilities"].values()) == pytest.approx(tone)
    assert answers["tone"]["score"] == pytest.approx(tone[1] + 2 * tone[2])
    assert answers["tone"]["confidence"] == pytest.approx(tone[0])
    assert outcome.diagnostics["calibration"] == {"file": "cal.json", "sha256": "abc"}
    # auto decides on the raw entropy: a sure read (0.999) is not read again, though calibrated at T = 2
    # the choice's entropy is about 0.2, past the threshold of 0.1
    sure = Decider(ScriptedReader(tokenizer, conf=0.999), build.read_settings(Settings()), calibration=calibration)
    auto = asyncio.run(sure.decide(parse_decision({"state": "x", "questions": QUESTIONS}, LIMITS)))
    assert auto.diagnostics["samples"]["n"] == 1 and auto.diagnostics["questions"]["team"]["entropy"][0] > 0.1
    raw = asyncio.run(Decider(reader, build.read_settings(Settings())).decide(
        parse_decision({"state": "x", "samples": 1, "questions": QUESTIONS}, LIMITS)))
    assert raw.answers["urgent"]["noul"] == pytest.approx(0.7) and raw.diagnostics["calibration"] is None


def test_health_and_diagnostics_name_the_calibration_in_force(tokenizer, tmp_path):
    reader = ScriptedReader(tokenizer)
    path = write(tmp_path, calibration_json(reader, Settings()))
    with TestClient(create_app(Settings.of(calibration=str(path)), reader)) as client:
        health = client.get("/health").json()
        assert health["calibration"]["file"] == "cal.json" and len(health["calibration"]["sha256"]) == 12
        body = client.post("/v1/systemone", json={"state": "x", "samples": 1, "questions": QUESTIONS}).json()
        assert body["diagnostics"]["calibration"] == health["calibration"]
        assert body["answers"]["urgent"]["noul"] != pytest.approx(0.7)
    with TestClient(create_app(Settings(), ScriptedReader(tokenizer))) as client:
        assert client.get("/health").json()["calibration"] is None


@pytest.mark.parametrize("field, value", [
    ("model", "another-model"), ("tokenizer", "0123456789abcdef"), ("template_version", "0"), ("canvas", 64),
    ("debias", "rotate"),
])
def test_a_calibration_fitted_for_something_else_is_refused_naming_it(tokenizer, tmp_path, field, value):
    reader = ScriptedReader(tokenizer)
    path = write(tmp_path, calibration_json(reader, Settings(), **{field: value}))
    with pytest.raises(CalibrationError) as info:
        Services.build(Settings.of(calibration=str(path)), reader)
    assert f"{field}: fitted for {value!r}" in str(info.value) and "cal.json" in str(info.value)


def test_serve_refuses_a_mismatched_calibration_at_start_with_exit_2(tokenizer, tmp_path, monkeypatch, capsys):
    reader = ScriptedReader(tokenizer)
    path = write(tmp_path, calibration_json(reader, Settings(), model="another-model"))
    status, seen, _ = serve_in_this_thread(lambda progress: reader, monkeypatch, threading.Event(), calibration=str(path))
    assert status == 2 and seen[-1]["status"] == "failed"
    assert "model: fitted for 'another-model', serving 'dgemma'" in capsys.readouterr().err


@pytest.mark.parametrize("content, message", [
    ("{", "not JSON"),
    ('{"format": "djev-calibration", "version": 1}', "fitted_for must be an object"),
    (None, "cannot read it"),
])
def test_serve_refuses_a_malformed_calibration_before_loading(tmp_path, capsys, content, message):
    from app.cli import main

    path = tmp_path / "cal.json"
    if content is not None:
        path.write_text(content)
    assert main(["serve", "--calibration", str(path)]) == 2
    err = capsys.readouterr().err
    assert message in err and str(path) in err


def test_with_the_prior_the_calibration_acts_on_the_read_after_the_raw_prior_is_divided_out(tokenizer):
    """Every read here, the content-free one too, puts 0.7 on the first label: divided by the raw prior
    a read is uniform, and the calibration then leaves only its per-position bias. Had the prior
    been calibrated too, the division would not give uniform and the answer would differ."""
    reader = ScriptedReader(tokenizer, conf=0.7)
    data = calibration_json(reader, Settings(), debias="prior")
    calibration = parse_calibration(data, {"file": "cal.json", "sha256": "abc"})
    decider = Decider(reader, build.read_settings(Settings()), calibration=calibration)
    body = {"state": "x", "samples": 1, "debias": "prior", "questions": {"team": QUESTIONS["team"]}}
    outcome = asyncio.run(decider.decide(parse_decision(body, LIMITS)))
    assert outcome.diagnostics["calibration"] == {"file": "cal.json", "sha256": "abc"}
    assert list(outcome.answers["team"]["probabilities"].values()) == pytest.approx(softmax([0.0, 0.5, -0.5]))
    plain = asyncio.run(decider.decide(parse_decision({**body, "debias": "off"}, LIMITS)))
    assert plain.diagnostics["calibration"] is None  # fitted under "prior": another mode reads uncalibrated
