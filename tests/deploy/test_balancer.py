"""`djev haproxy-config` (app/balancer.py): the HAProxy configuration for djev replicas says what
docs/deploy.md promises (leastconn, readiness on /health, websockets through a tunnel, cameras
capped at MAX_SESSIONS + 1 a replica, safe retries, TLS with `djev cert`'s file), HAProxy 2.6
accepts it, bad input is refused by name, a degraded replica (200 "degraded") keeps its traffic,
and the balancer's own errors are djev's envelope; the compose profile `replicas` runs one replica
per GPU behind the checked-in deploy/haproxy/haproxy.cfg, which is what its recorded command
writes. tests/deploy/test_replicas.py runs the configuration in front of real replicas."""

from __future__ import annotations

import csv
import io
import re
import shlex
import subprocess
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import httpx
import pytest
import yaml

from app import balancer, tls
from app.cli import main
from app.config import Settings
from app.server import create_app, free_port
from app.web.frontdoor import REPLICA_HEADER
from tests.conftest import live_server
from tests.deploy.replicas import HAPROXY_MISSING, haproxy_executable, stop, tail, wait_for
from tests.fakes import ScriptedReader

HAPROXY = haproxy_executable()
needs_haproxy = pytest.mark.skipif(HAPROXY is None, reason=HAPROXY_MISSING)
ROOT = Path(__file__).resolve().parents[2]
CHECKED_IN = ROOT / "deploy" / "haproxy" / "haproxy.cfg"  # the compose profile's
TICKET = {"state": "x", "samples": 1, "questions": {"urgent": {"type": "noul"}}}


def sections(text: str) -> dict[str, list[str]]:
    """haproxy.cfg as {"global": [lines], "backend api": [lines], ...}, comments left out."""
    found: dict[str, list[str]] = {}
    current: list[str] = []
    for line in text.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        if not line.startswith(" "):
            current = found.setdefault(line.strip(), [])
        else:
            current.append(line.strip())
    return found


def config(**changes) -> balancer.BalancerConfig:
    values = dict(replicas=balancer.replicas_on_ports(3, 8021), max_sessions=32, request_timeout_s=120,
                  bind="0.0.0.0", http_port=8011, https_port=8443, crt="/certs/djev.pem", user="haproxy")
    return balancer.BalancerConfig(**{**values, **changes})


def test_readiness_leastconn_and_one_check_per_replica():
    cfg = sections(balancer.render(config()))
    api, stream = cfg["backend api"], cfg["backend stream"]
    assert "balance leastconn" in api and "balance leastconn" in stream
    assert "option httpchk GET /health" in api and "http-check expect status 200" in api  # 200: ok and degraded
    assert [line for line in api if line.startswith("server ")] == [
        "server gpu0 127.0.0.1:8021", "server gpu1 127.0.0.1:8022", "server gpu2 127.0.0.1:8023"]
    assert any(line.startswith("default-server check inter 2000ms fall 2 rise 1") for line in api)
    # The stream backend follows api's checks: one /health check per replica, not two.
    assert [line for line in stream if line.startswith("server ")] == [
        f"server gpu{i} 127.0.0.1:{8021 + i} track api/gpu{i}" for i in range(3)]
    assert not any("httpchk" in line for line in stream)


def test_cameras_go_to_the_stream_backend_capped_one_over_max_sessions_through_a_tunnel():
    cfg = sections(balancer.render(config(max_sessions=20)))
    assert "use_backend stream if { path /v1/stream }" in cfg["frontend djev"]
    assert "default_backend api" in cfg["frontend djev"]
    assert "default-server maxconn 21" in cfg["backend stream"]  # the 21st is the replica's own 1013
    assert not any("maxconn" in line for line in cfg["backend api"])  # REST: the replica's own 529
    assert "timeout tunnel 1h" in cfg["defaults"]


def test_timeouts_outlast_the_replicas_request_timeout_and_retries_are_the_safe_ones():
    defaults = sections(balancer.render(config(request_timeout_s=300)))["defaults"]
    assert "timeout server 330s" in defaults and "timeout client 330s" in defaults  # djev's own 504 comes first
    assert "retry-on conn-failure empty-response 503" in defaults
    assert "option redispatch 1" in defaults and "retries 2" in defaults
    assert "option http-buffer-request" in sections(balancer.render(config()))["backend api"]  # what a retry resends


def test_tls_ends_at_the_balancer_with_djev_certs_file_and_http_1_1():
    cfg = sections(balancer.render(config()))
    assert cfg["frontend djev"][:2] == ["bind 0.0.0.0:8011", "bind 0.0.0.0:8443 ssl crt /certs/djev.pem alpn http/1.1"]
    assert "user haproxy" in cfg["global"] and "group haproxy" in cfg["global"]
    plain = sections(balancer.render(config(https_port=0, user="")))
    assert plain["frontend djev"][0] == "bind 0.0.0.0:8011" and not any("ssl" in line for line in plain["frontend djev"])
    assert not any(line.startswith("user") for line in plain["global"])


@pytest.mark.parametrize("changes, message", [
    (dict(replicas=()), "at least one replica"),
    (dict(replicas=(balancer.Replica("a", "h", 1), balancer.Replica("a", "h", 2))), "replica ids must differ"),
    (dict(replicas=(balancer.Replica("gpu 0", "h", 1),)), "replica id 'gpu 0'"),
    (dict(replicas=(balancer.Replica("a", "h", 70000),)), "port 70000 is not a port"),
    (dict(crt=""), "an HTTPS port needs the certificate file"),
    (dict(max_sessions=-1), "MAX_SESSIONS must be at least 0"),
    (dict(user="root; x"), "is not a user name"),
])
def test_bad_input_is_refused_by_name(changes, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        balancer.render(config(**changes))


def test_the_command_reads_the_replicas_settings_as_djev_serve_does(monkeypatch, capsys):
    monkeypatch.setenv("MAX_SESSIONS", "7")
    monkeypatch.setenv("REQUEST_TIMEOUT", "60")
    assert main(["haproxy-config", "--server", "a=10.0.0.5:9000", "--server", "b=[::1]:9001"]) == 0
    text = capsys.readouterr().out
    assert "# Written by: djev haproxy-config --server a=10.0.0.5:9000 --server 'b=[::1]:9001'" in text
    cfg = sections(text)
    assert "default-server maxconn 8" in cfg["backend stream"] and "timeout server 90s" in cfg["defaults"]
    assert "server b [::1]:9001" in cfg["backend api"]
    assert main(["haproxy-config", "--replicas", "2", "--max-sessions", "9"]) == 0  # a flag wins, as for serve
    assert "default-server maxconn 10" in sections(capsys.readouterr().out)["backend stream"]
    assert main(["haproxy-config", "--server", "a=nowhere"]) == 2
    assert "expected ID=HOST:PORT" in capsys.readouterr().err


def test_defaults_come_from_settings():
    settings = Settings()
    text = balancer.render(balancer.BalancerConfig(
        replicas=balancer.replicas_on_ports(1, balancer.FIRST_REPLICA_PORT), max_sessions=settings.limits.max_sessions,
        request_timeout_s=settings.limits.request_timeout, bind=settings.server.host, http_port=settings.server.port))
    assert settings.limits.max_sessions == 0  # each replica holds what its card holds
    stream = sections(text)["backend stream"]
    assert not any("maxconn" in line for line in stream)  # the replicas refuse past their own limits
    assert "MAX_SESSIONS=0: each replica takes what its card holds" in text
    assert f"bind {settings.server.host}:{settings.server.port}" in text


@needs_haproxy
def test_haproxy_accepts_the_configuration(tmp_path: Path):
    bundle = tls.ensure_bundle(tmp_path / "certs")
    path = tmp_path / "haproxy.cfg"
    path.write_text(balancer.render(config(crt=bundle, user="", stats_port=free_port())))
    done = subprocess.run([HAPROXY or "haproxy", "-c", "-f", str(path)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


@contextmanager
def haproxy_over(replicas: tuple[balancer.Replica, ...], work: Path) -> Iterator[tuple[str, str]]:
    """HAProxy in the foreground over `replicas` on a free loopback port; yields (its URL, its stats
    CSV's URL) once it answers, stopped on the way out."""
    port = free_port()
    cfg = config(replicas=replicas, bind="127.0.0.1", http_port=port, https_port=0, user="", stats_port=free_port())
    path = work / "haproxy.cfg"
    path.write_text(balancer.render(cfg))
    log = work / "haproxy.log"
    with open(log, "wb") as out:
        process = subprocess.Popen([HAPROXY or "haproxy", "-db", "-f", str(path)], stdout=out, stderr=subprocess.STDOUT,
                                   start_new_session=True)
    try:
        def listening() -> bool:
            try:
                httpx.get(f"http://127.0.0.1:{cfg.stats_port}/", timeout=2)
            except httpx.TransportError:
                return False
            return True

        wait_for("HAProxy to listen", listening, 10, log=lambda: tail(log))
        yield f"http://127.0.0.1:{port}", f"http://127.0.0.1:{cfg.stats_port}/;csv"
    finally:
        stop(process)


@needs_haproxy
def test_a_degraded_replica_is_still_ready(tokenizer, tmp_path: Path):
    """/health answers 200 with "degraded" for an engine that had to degrade but serves (a card too
    small for the defaults): HAProxy's check expects 200, so it keeps its traffic."""
    reader = ScriptedReader(tokenizer)
    reader.degraded = "CUDA graphs off: capture failed"
    app = create_app(Settings.of(replica_id="worn"), reader)
    with live_server(app) as url:
        health = httpx.get(url + "/health")
        assert (health.status_code, health.json()["status"]) == (200, "degraded")
        port = int(url.rsplit(":", 1)[1])
        with haproxy_over((balancer.Replica("worn", "127.0.0.1", port),), tmp_path) as (proxy, stats):
            def checked() -> str:  # the api backend's last check of it: L7OK is a 200
                rows = csv.DictReader(io.StringIO(httpx.get(stats, timeout=2).text.lstrip("# ")))
                return next(row["check_status"] for row in rows if row["pxname"] == "api" and row["svname"] == "worn")

            def first_check() -> str | None:
                status = checked()
                return None if status.lstrip("* ") in ("", "INI") else status

            assert wait_for("HAProxy's first check", first_check, 10) == "L7OK"
            answers = [httpx.post(proxy + "/v1/systemone", json=TICKET, timeout=10) for _ in range(3)]
            assert checked() == "L7OK" and "UP" in httpx.get(stats, timeout=2).text
    assert [(r.status_code, r.headers.get(REPLICA_HEADER)) for r in answers] == [(200, "worn")] * 3


@needs_haproxy
def test_with_no_replica_ready_the_balancer_answers_503_in_djevs_envelope(tmp_path: Path):
    """What a client of djev expects of any answer: the error envelope (wire.md §5), Retry-After,
    and x-typesafe-request-id (the official clients read it on every answer)."""
    with haproxy_over((balancer.Replica("gone", "127.0.0.1", free_port()),), tmp_path) as (proxy, _):
        response = httpx.post(proxy + "/v1/systemone", json={}, timeout=10)
    assert response.status_code == 503
    body = response.json()
    assert body["error"]["type"] == "unavailable_error" and body["error"]["param"] is None
    assert body["detail"] == {"error_type": "unavailable_error", "message": body["error"]["message"]}
    assert "no djev replica is ready" in body["error"]["message"]
    assert response.headers["retry-after"] == "1" and response.headers["retry-after-ms"] == "1000"
    assert re.fullmatch(r"req_[0-9a-f]{24}", response.headers["x-typesafe-request-id"])


def test_the_compose_profile_runs_one_replica_per_gpu_behind_the_checked_in_config(monkeypatch, capsys, tmp_path):
    services = yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]
    text = CHECKED_IN.read_text()
    cfg = sections(text)
    assert "profiles" not in services["djev"]  # `docker compose up` still starts the one server alone
    replicas = {name: service for name, service in services.items() if name.startswith("djev-gpu")}
    assert len(replicas) >= 2
    servers = []
    for i, name in enumerate(sorted(replicas)):
        service, env = replicas[name], replicas[name]["environment"]
        assert service["profiles"] == ["replicas"] and service["command"] == ["serve"]
        assert service["deploy"]["resources"]["reservations"]["devices"] == [
            {"driver": "nvidia", "device_ids": [str(i)], "capabilities": ["gpu"]}]  # one GPU a replica
        assert (env["ENGINE"], env["HOST"], env["TLS_PORT"], env["REPLICA_ID"]) == ("hf", "127.0.0.1", "0", f"gpu{i}")
        assert f"default-server maxconn {int(env['MAX_SESSIONS']) + 1}" in cfg["backend stream"]
        assert f"timeout server {int(env['REQUEST_TIMEOUT']) + balancer.TIMEOUT_SLACK_S}s" in cfg["defaults"]
        assert "${DJEV_CERTS_DIR:-./certs}:/certs:ro" in service["volumes"] and env["CERT_DIR"] == "/certs"
        servers.append(f"server {env['REPLICA_ID']} 127.0.0.1:{env['STRUCTURED_PORT']}")
    assert [line for line in cfg["backend api"] if line.startswith("server ")] == servers

    proxy, cert = services["haproxy"], services["djev-cert"]
    assert proxy["profiles"] == cert["profiles"] == ["replicas"] and proxy["image"] == "haproxy:2.6"
    assert "./deploy/haproxy/haproxy.cfg:/usr/local/etc/haproxy/haproxy.cfg:ro" in proxy["volumes"]
    assert proxy["depends_on"] == {"djev-cert": {"condition": "service_completed_successfully"},
                                   **{name: {"condition": "service_started"} for name in replicas}}
    assert cert["command"] == ["cert", "--cert-dir", "/certs"]
    assert "bind 0.0.0.0:8443 ssl crt /certs/djev.pem alpn http/1.1" in cfg["frontend djev"]
    assert proxy["user"] == "root" and "user haproxy" in cfg["global"]  # reads the key, then drops

    # The file is what its recorded command writes today (a changed default shows up here).
    for name in ("MAX_SESSIONS", "REQUEST_TIMEOUT", "CERT_DIR"):
        monkeypatch.delenv(name, raising=False)
    command = re.search(r"^# Written by: (.+)$", text, re.M)
    assert command is not None
    argv = shlex.split(command[1])
    assert argv[:2] == ["djev", "haproxy-config"] and main(argv[1:]) == 0
    assert capsys.readouterr().out == text, f"write it again: {command[1]} > deploy/haproxy/haproxy.cfg"

    if HAPROXY is not None:  # and HAProxy takes it, with a certificate where compose mounts one
        bundle = tls.ensure_bundle(tmp_path)
        (tmp_path / "haproxy.cfg").write_text(text.replace("/certs/djev.pem", bundle).replace("user haproxy\n", "")
                                              .replace("group haproxy\n", ""))
        done = subprocess.run([HAPROXY, "-c", "-f", str(tmp_path / "haproxy.cfg")], capture_output=True, text=True)
        assert done.returncode == 0, done.stdout + done.stderr
