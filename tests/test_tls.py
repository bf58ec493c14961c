"""The self-signed certificate: generated once, reused, regenerated when names change, trusted by a
client that trusts the file; and `djev serve` running HTTP and HTTPS in one process."""

from __future__ import annotations

import ipaddress
import json
import os
import socket
import ssl
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from cryptography import x509

from app import tls
from app.config import Settings
from app.server import create_app
from tests.conftest import free_port, live_server, make_tiny_reader


def sans(cert_path: Path) -> tuple[set[str], set[str]]:
    cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
    ext = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return set(ext.get_values_for_type(x509.DNSName)), {str(i) for i in ext.get_values_for_type(x509.IPAddress)}


def test_generated_once_with_every_local_name_and_reused(tmp_path):
    cert, key = tls.ensure_certificate(tmp_path)
    dns, ips = sans(Path(cert))
    assert {"localhost", socket.gethostname()} <= dns
    assert {"127.0.0.1", "::1"} <= ips
    assert set(tls.local_ipv4_addresses()) <= ips
    assert all(ipaddress.ip_address(ip) for ip in ips)
    assert oct(os.stat(key).st_mode & 0o777) == "0o600"
    before = Path(cert).read_bytes()
    again, _ = tls.ensure_certificate(tmp_path)
    assert Path(again).read_bytes() == before


def test_regenerated_when_the_addresses_change(tmp_path, monkeypatch):
    cert, _ = tls.ensure_certificate(tmp_path)
    before = Path(cert).read_bytes()
    real = tls.wanted_names
    monkeypatch.setattr(tls, "wanted_names", lambda: (real()[0], real()[1] + ["10.11.12.13"]))
    cert, _ = tls.ensure_certificate(tmp_path)
    assert Path(cert).read_bytes() != before
    assert "10.11.12.13" in sans(Path(cert))[1]


def test_a_client_trusting_the_certificate_gets_https_and_wss(tiny_dir, tmp_path):
    from websockets.sync.client import connect

    cert, key = tls.ensure_certificate(tmp_path)
    context = ssl.create_default_context(cafile=cert)
    app = create_app(Settings(), make_tiny_reader(tiny_dir))
    with live_server(app, ssl_certfile=cert, ssl_keyfile=key) as url:
        assert url.startswith("https://127.0.0.1")
        for host in ("127.0.0.1", "localhost"):
            response = httpx.get(url.replace("127.0.0.1", host) + "/health", verify=context)
            assert response.status_code == 200 and response.json()["status"] == "ok"
        with pytest.raises(httpx.ConnectError):
            httpx.get(url + "/health")  # the default trust store does not know it
        with connect(url.replace("https", "wss") + "/v1/stream", ssl=context) as ws:
            assert json.loads(ws.recv(timeout=10))["type"] == "ready"


def test_serve_runs_http_and_https_in_one_process(tiny_dir, tmp_path):
    http_port, https_port = free_port(), free_port()
    env = {**os.environ, "CERT_DIR": str(tmp_path / "certs"), "LOG_LEVEL": "warning"}
    process = subprocess.Popen(
        [sys.executable, "-m", "app", "serve", "--model", str(tiny_dir), "--host", "127.0.0.1",
         "--port", str(http_port), "--tls-port", str(https_port)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{http_port}/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert process.poll() is None and time.monotonic() < deadline, process.stdout.read().decode()
            time.sleep(0.2)
        context = ssl.create_default_context(cafile=str(tmp_path / "certs" / "djev.crt"))
        secure = httpx.get(f"https://127.0.0.1:{https_port}/health", verify=context)
        assert secure.json()["tiny"] is True
        assert httpx.get(f"https://localhost:{https_port}/v1/models", verify=context).status_code == 200
    finally:
        process.terminate()
        process.wait(timeout=20)
    assert process.returncode is not None
