"""A listener open to the network with no API_KEY says so at start: which hosts count as loopback, which
listeners are open, and the warning `djev serve` logs (and does not log on loopback or with a key)."""

from __future__ import annotations

import logging

import pytest

from app.config import Settings
from app.server import is_loopback, open_listeners, warn_if_open

OPEN_WORDS = "is open to the network with no API key"


@pytest.mark.parametrize("host", ["127.0.0.1", "127.8.9.10", "::1", "[::1]", "localhost", "LocalHost",
                                  "::ffff:127.0.0.1"])
def test_loopback_hosts(host):
    assert is_loopback(host)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "[::]", "", "192.168.1.20", "10.0.0.5", "fe80::1",
                                  "::ffff:192.168.1.20", "djev.lan", "localhost.example.com"])
def test_hosts_the_network_reaches(host):
    assert not is_loopback(host)


def test_open_listeners_name_each_url_unless_loopback_or_keyed():
    assert open_listeners(Settings.of(host="0.0.0.0", port=8011), tls=False) == ["http://0.0.0.0:8011"]
    assert open_listeners(Settings.of(host="::", port=8011, tls_port=8443), tls=True) == [
        "http://[::]:8011", "https://[::]:8443"]
    assert open_listeners(Settings.of(host="192.168.1.20"), tls=False) == ["http://192.168.1.20:8011"]
    assert open_listeners(Settings.of(host="0.0.0.0", api_key="s3cret"), tls=True) == []
    assert open_listeners(Settings.of(host="127.0.0.1"), tls=True) == []
    assert open_listeners(Settings(), tls=False) == ["http://0.0.0.0:8011"]  # the default is open


def test_the_warning_names_the_address_and_how_to_set_a_key(caplog):
    with caplog.at_level(logging.WARNING, logger="djev"):
        warn_if_open(Settings.of(host="0.0.0.0", port=8011, tls_port=8443), tls=True)
    messages = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(messages) == 2
    assert messages[0].startswith("http://0.0.0.0:8011 " + OPEN_WORDS)
    assert messages[1].startswith("https://0.0.0.0:8443 " + OPEN_WORDS)
    for message in messages:
        assert "API_KEY" in message and "--api-key" in message and "--host 127.0.0.1" in message


def served_warnings(monkeypatch, caplog, **settings) -> list[str]:
    """`cli.serve` with a load that fails at once (so it exits within a second): the warnings it logged."""
    from app import cli, server
    from tests.conftest import free_port

    def load(progress):
        raise OSError("no weights here")

    monkeypatch.setattr(server, "FAILED_START_LINGER_S", 0.1)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="djev"):
        status = cli.serve(Settings.of(port=free_port(), pages=False, **settings), load)
    assert status == 1
    return [r.getMessage() for r in caplog.records if OPEN_WORDS in r.getMessage()]


def test_serve_warns_of_an_open_listener_and_not_of_a_loopback_or_keyed_one(monkeypatch, caplog):
    [warning] = served_warnings(monkeypatch, caplog, host="0.0.0.0")
    assert warning.startswith("http://0.0.0.0:") and "API_KEY" in warning
    assert served_warnings(monkeypatch, caplog, host="127.0.0.1") == []
    assert served_warnings(monkeypatch, caplog, host="0.0.0.0", api_key="s3cret") == []
