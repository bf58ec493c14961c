"""`djev selftest`: one decision end to end, in process or against a running server; exit 1 on failure."""

from __future__ import annotations

from pathlib import Path

from app.cli import main
from app.config import Settings
from app.selftest import SelftestFailure, check_answer, run_selftest
from app.server import create_app, free_port
from tests.conftest import live_server, make_tiny_reader


def test_in_process_on_the_configured_engine(tiny_dir: Path, capsys):
    assert run_selftest(Settings.of(model=str(tiny_dir), device="cpu"), None, 60) == 0
    out = capsys.readouterr().out
    assert "selftest ok: hf in process, model djev-tiny-random" in out
    for line in ('  urgent: {"noul"', '  team: {"choice"', '  tone: {"confidence"', "  usage: {"):
        assert line in out, out


def test_against_a_running_server_with_an_api_key(tiny_dir: Path, capsys):
    settings = Settings.of(device="cpu", api_key="s3cret")
    with live_server(create_app(settings, make_tiny_reader(tiny_dir))) as url:
        assert run_selftest(settings, url, 30) == 0
        assert f"selftest ok: {url}" in capsys.readouterr().out
        # Without the key the server refuses (Jev: 403), and the self-test says so.
        assert run_selftest(Settings.of(device="cpu"), url, 30) == 1
        assert "selftest FAILED: HTTP 403" in capsys.readouterr().out


def test_a_dead_server_fails_through_the_command_line(capsys):
    assert main(["selftest", "--url", f"http://127.0.0.1:{free_port()}", "--timeout", "5"]) == 1
    assert "selftest FAILED: ConnectError" in capsys.readouterr().out


def test_an_answer_of_the_wrong_shape_is_a_failure_naming_it():
    good = {"answers": {"urgent": {"type": "noul"}, "team": {"type": "choice"}, "tone": {"type": "score"}}}
    assert check_answer(200, good) == good["answers"]
    for status, body, expected in [
        (503, {"error": {"message": "engine starting"}}, "HTTP 503"),
        (200, {"nothing": 1}, "no answers"),
        (200, {"answers": {**good["answers"], "tone": {"type": "noul"}}}, "'tone' should be a score"),
    ]:
        try:
            check_answer(status, body)
        except SelftestFailure as exc:
            assert expected in str(exc)
        else:
            raise AssertionError(f"accepted {status} {body}")
