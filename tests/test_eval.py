"""`djev eval` on tests/data/labelled_small.jsonl against the scripted reader, whose every slot puts 0.7
on its first label and shares 0.3 among the others: the figures match a hand computation, in process
and over HTTP; it writes its PNG and JSON; bad lines and unknown kinds are reported, not fatal."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from PIL import Image

from app.calibrate import run_eval
from app.config import Settings
from app.decisions.labelled import permuted
from app.server import create_app
from tests.conftest import live_server
from tests.fakes import ScriptedReader

DATA = Path(__file__).resolve().parent / "data" / "labelled_small.jsonl"

# Each line's labelled questions: noul labels yes, no, yes, no; choice billing, outage, billing,
# feature; score 0, 1, 2, 0. Every answer is its first alternative at 0.7: half of each bucket right.
NOUL = {"count": 4, "ece": 0.2, "accuracy": 0.5, "brier": (2 * 0.18 + 2 * 0.98) / 4,
        "log_loss": -(math.log(0.7) + math.log(0.3)) / 2}
THREE = {"count": 4, "ece": 0.2, "accuracy": 0.5, "brier": (2 * (0.09 + 2 * 0.0225) + 2 * (0.49 + 0.7225 + 0.0225)) / 4,
         "log_loss": -(math.log(0.7) + math.log(0.15)) / 2}
ALL = {"count": 12, "ece": 0.2, "accuracy": 0.5, "brier": (NOUL["brier"] + 2 * THREE["brier"]) / 3,
       "log_loss": (NOUL["log_loss"] + 2 * THREE["log_loss"]) / 3}


def expected_order_changes() -> int:
    """With the scripted reader the top answer is the first option shown, so the top changes
    exactly where the permuted order does not start with billing."""
    changed = 0
    for number, text in enumerate(DATA.read_text().splitlines(), 1):
        request = json.loads(text)["request"]
        changed += next(iter(permuted(request, 0, number)["questions"]["team"]["criteria"])) != "billing"
    return changed


def check_figures(result: dict) -> None:
    for key, expected in (("all", ALL), ("noul", NOUL), ("choice:3", THREE), ("score:2-5", THREE)):
        got = result["buckets"][key]
        for name, value in expected.items():
            assert got[name] == pytest.approx(value), (key, name)
        seven = got["bins"][7]
        assert (seven["count"], seven["confidence"], seven["accuracy"]) == (expected["count"], pytest.approx(0.7), 0.5)
    assert result["order"] == {"questions": 4, "changed": expected_order_changes(),
                               "rate": pytest.approx(expected_order_changes() / 4)}
    assert result["data"]["unknown_kinds"] == {"rank": 1}


def test_eval_in_process_writes_json_and_png_matching_a_hand_computation(tokenizer, tmp_path, capsys):
    status = run_eval(Settings(), DATA, out_dir=tmp_path / "out", reader=ScriptedReader(tokenizer, conf=0.7))
    assert status == 0
    result = json.loads((tmp_path / "out" / "eval.json").read_text())
    check_figures(result)
    assert result["against"] == "in process" and result["calibration"] is None
    with Image.open(tmp_path / "out" / "reliability.png") as image:
        assert image.format == "PNG" and image.size[0] > 300
    captured = capsys.readouterr()
    assert "unknown question kind 'rank': 1 question(s) left out" in captured.err
    assert "eval [" in captured.err  # the progress bar
    assert "order: the top answer changed for" in captured.out


def test_eval_over_http_gives_the_same_figures(tokenizer, tmp_path):
    app = create_app(Settings(), ScriptedReader(tokenizer, conf=0.7))
    with live_server(app) as url:
        assert run_eval(Settings(), DATA, url=url, out_dir=tmp_path) == 0
    check_figures(json.loads((tmp_path / "eval.json").read_text()))


def test_max_ece_fails_the_check_past_the_threshold(tokenizer, capsys):
    assert run_eval(Settings(), DATA, max_ece=0.1, permute=False, reader=ScriptedReader(tokenizer)) == 1
    assert "ECE 0.2000 is above --max-ece 0.1" in capsys.readouterr().err
    assert run_eval(Settings(), DATA, max_ece=0.25, permute=False, reader=ScriptedReader(tokenizer)) == 0


def test_malformed_lines_are_named_by_number_and_unknown_kinds_reported(tokenizer, tmp_path, capsys):
    good = DATA.read_text().splitlines()[0]
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join([
        good, "{not json", "[1, 2]", json.dumps({"request": {"state": "x", "questions": {"r": {"type": "rank"}}},
                                                 "expected": {"r": 1}}),
        json.dumps({"request": {"state": "x", "questions": {"u": {"type": "noul"}}}, "expected": {"u": "maybe"}}),
        "",
    ]))
    assert run_eval(Settings(), data, out_dir=tmp_path / "out", permute=False, reader=ScriptedReader(tokenizer)) == 0
    err = capsys.readouterr().err
    assert "line 2: not JSON" in err and "line 3: a line must be an object" in err
    assert "line 4: no question of a known kind" in err and "unknown question kind 'rank'" in err
    assert "line 5: 'u': expected 'maybe' for a noul" in err
    result = json.loads((tmp_path / "out" / "eval.json").read_text())
    assert result["buckets"]["all"]["count"] == 3 and len(result["data"]["malformed"]) == 2


def test_nothing_usable_is_an_error(tokenizer, tmp_path, capsys):
    data = tmp_path / "data.jsonl"
    data.write_text("{nope\n")
    assert run_eval(Settings(), data, reader=ScriptedReader(tokenizer)) == 2
    assert "no usable labelled question in 1 line(s)" in capsys.readouterr().err


def test_eval_against_a_server_that_is_not_there_is_one_clear_error(tmp_path, capsys):
    from tests.conftest import free_port

    data = Path(__file__).parent / "data" / "labelled_small.jsonl"
    status = run_eval(Settings(), data, url=f"http://127.0.0.1:{free_port()}", out_dir=tmp_path)
    err = capsys.readouterr().err
    assert status == 2 and "cannot be reached" in err and err.count("\n") == 1
    assert not (tmp_path / "eval.json").exists()


def test_calibrate_with_no_usable_checkpoint_says_so_without_a_traceback(tmp_path, capsys):
    from app.calibrate import run_calibrate

    data = Path(__file__).parent / "data" / "labelled_small.jsonl"
    status = run_calibrate(Settings.of(model=str(tmp_path / "missing")), data, tmp_path / "cal.json")
    err = capsys.readouterr().err
    assert status == 2 and "no checkpoint directory there" in err and "Traceback" not in err
    assert not (tmp_path / "cal.json").exists()


def test_many_failed_lines_are_printed_up_to_a_bound_and_counted():
    import io

    from app.calibrate import SHOWN_PROBLEMS, DataReport, print_problems

    report = DataReport()
    report.problems.extend(f"line {n}: refused" for n in range(1, SHOWN_PROBLEMS + 6))
    out = io.StringIO()
    print_problems(report, out)
    lines = out.getvalue().splitlines()
    assert len(lines) == SHOWN_PROBLEMS + 1 and lines[-1] == "skipped: ... and 5 more line(s)"
