"""`djev calibrate`: the fit recovers a known miscalibration of the tiny model's own reads, and the
command reads labelled JSONL through the serving path, writes a file a server accepts, and names bad
lines by number."""

from __future__ import annotations

import asyncio
import json
import random

import pytest

from app import build
from app.calibrate import run_calibrate
from app.config import Settings
from app.decisions.calibration import FittedFor, Item, Scaling, fit, metrics, parse_calibration
from app.decisions.labelled import held_out
from app.decisions.request import parse_decision
from app.decisions.run import Decider
from app.web.services import Services
from tests.conftest import LIMITS, make_tiny_reader
from tests.fakes import ScriptedReader
from tests.test_eval import DATA

TRUE_T = 2.5
TRUE_BIAS = (0.8, 0.0, 0.0, -0.8)
OPTIONS = {"a": {"billing": None, "outage": None, "feature": None, "other": None},
           "b": {"red": "warm", "green": None, "blue": "cold", "grey": None}}


def tiny_reads(tiny_dir, states: int) -> list[tuple[float, ...]]:
    """The tiny model's renormalised label distributions of two four-option choices, one read each
    of `states` states, recorded in the shown order as `djev calibrate` records them. One torch
    thread: on a shared two-core machine torch's own threads can make each read 40 times slower."""
    import torch

    threads = torch.get_num_threads()
    reader = make_tiny_reader(tiny_dir, torch_threads=1)
    reads: list[tuple[float, ...]] = []

    def observe(question, probs):
        reads.append(tuple(probs))
        return probs

    async def go() -> None:
        await reader.start()
        try:
            decider = Decider(reader, build.read_settings(Settings.of(device="cpu"), reader.info))
            for i in range(states):
                questions = {qid: {"type": "choice", "instructions": "Which fits the ticket?", "criteria": criteria}
                             for qid, criteria in OPTIONS.items()}
                body = {"state": f"ticket {i}: {'the site is down' if i % 3 else 'an invoice'} ({i * 7 % 11})",
                        "samples": 1, "questions": questions}
                await decider.decide(parse_decision(body, LIMITS), adjust=observe)
        finally:
            await reader.stop()

    try:
        asyncio.run(go())
    finally:
        torch.set_num_threads(threads)
    return reads


def test_the_fit_recovers_temperature_and_position_bias_from_the_tiny_models_reads(tiny_dir):
    reads = tiny_reads(tiny_dir, 30)  # 60 distinct distributions, reused
    truth = Scaling(TRUE_T, TRUE_BIAS)
    rng = random.Random(1234)
    items = []
    for n in range(4000):
        probs = reads[n % len(reads)]
        label = rng.choices(range(4), truth.apply(probs))[0]
        items.append(Item("pick", "choice", ("w", "x", "y", "z"), (probs,), label))
    train = [item for n, item in enumerate(items) if n % 2 == 0]
    test = [item for n, item in enumerate(items) if n % 2 == 1]
    calibration = fit(train, FittedFor("djev-tiny-random", "t" * 16, "1", 128, "off"))
    model = calibration.buckets["id:pick"].model  # 2,000 labels: a bucket of its own
    assert isinstance(model, Scaling)
    assert model.temperature == pytest.approx(TRUE_T, rel=0.1)
    assert model.bias[0] > 0.2 and model.bias[3] < -0.2 and model.bias[0] - model.bias[3] > 0.8
    before = metrics((item.answer(None), item.label) for item in test)
    after = metrics((item.answer(model), item.label) for item in test)
    assert after.ece < before.ece / 2 and after.log_loss < before.log_loss


def test_calibrate_fits_on_the_training_lines_and_writes_a_file_the_server_accepts(tokenizer, tmp_path, capsys):
    out = tmp_path / "calibration.json"
    reader = ScriptedReader(tokenizer, conf=0.7)
    assert run_calibrate(Settings(), DATA, out, reader=reader) == 0
    data = json.loads(out.read_text())
    calibration = parse_calibration(data)
    assert calibration.fitted_for == build.fitted_for(Settings(), reader.info, tokenizer)
    assert set(calibration.buckets) == {"noul", "choice:3", "score:2-5"}
    report = data["report"]
    train = [n for n, line in enumerate(DATA.read_text().splitlines(), 1) if not held_out(line, 0.3)]
    assert report["data"]["lines"] == 4 and report["data"]["train_lines"] in (len(train), 4)
    assert set(report["held_out"]["all"]) == {"before", "after"}
    captured = capsys.readouterr()
    assert "before -> after" in captured.out and "calibrate [" in captured.err
    assert "unknown question kind 'rank': 1 question(s) left out" in captured.err
    Services.build(Settings.of(calibration=str(out)), ScriptedReader(tokenizer))  # accepted: fitted for this reader


def test_calibrate_names_malformed_lines_and_fails_when_nothing_usable_remains(tokenizer, tmp_path, capsys):
    data = tmp_path / "data.jsonl"
    data.write_text("{broken\n" + json.dumps({"request": {"questions": {}}, "expected": {}}) + "\n[]\n")
    assert run_calibrate(Settings(), data, tmp_path / "c.json", reader=ScriptedReader(tokenizer)) == 2
    err = capsys.readouterr().err
    assert "line 1: not JSON" in err and "line 3: a line must be an object" in err
    assert "no usable labelled question in 3 line(s)" in err
    assert not (tmp_path / "c.json").exists()


def test_the_command_line_runs_calibrate(tokenizer, tmp_path, monkeypatch):
    from app import calibrate, cli

    seen = {}

    def fake(settings, data, out, held_out, min_id_labels, concurrency):
        seen.update(data=data, out=out, held_out=held_out, canvas=settings.decisions.canvas)
        return 0

    monkeypatch.setattr(calibrate, "run_calibrate", fake)
    assert cli.main(["calibrate", str(DATA), "--out", str(tmp_path / "c.json"), "--held-out", "0.5", "--canvas", "64"]) == 0
    assert seen == {"data": DATA, "out": tmp_path / "c.json", "held_out": 0.5, "canvas": 64}


def test_reads_shown_in_several_orders_become_one_item_per_order():
    import dataclasses

    from app.calibrate import Answered, Prepared, items_from_reads
    from app.decisions.labelled import Line

    request = {"state": "x", "questions": {"team": {"type": "choice", "instructions": "Which?",
                                                    "criteria": {"billing": None, "outage": None}}}}
    decision = parse_decision(request, LIMITS)
    question = decision.questions[0]
    flipped = dataclasses.replace(question, alternatives=question.alternatives[::-1])
    prepared = Prepared(Line(1, request, {"team": "outage"}, False), decision, {"team": 1})
    answered = Answered(prepared, {}, {"team": [(question, (0.8, 0.2)), (flipped, (0.3, 0.7)), (question, (0.6, 0.4))]})
    items = items_from_reads([answered])
    assert [(i.names, i.reads, i.label) for i in items] == [
        (("billing", "outage"), ((0.8, 0.2), (0.6, 0.4)), 1), (("outage", "billing"), ((0.3, 0.7),), 0)]
