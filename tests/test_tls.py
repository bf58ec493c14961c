"""The HTTPS certificate: a local certificate authority written once and kept, a server certificate
it issues (reused, reissued when names change or when an older djev self-signed it), trusted by a
client that trusts the authority alone; the authority served at /djev-ca.crt; and `djev serve`
running HTTP and HTTPS in one process."""

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
from cryptography.hazmat.primitives import hashes
from starlette.testclient import TestClient

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
    context = ssl.create_default_context(cafile=str(tmp_path / tls.CA_CERT_NAME))  # the authority alone
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


def load_chain(path: Path) -> list[x509.Certificate]:
    return x509.load_pem_x509_certificates(path.read_bytes())


def test_the_authority_is_written_once_and_issues_the_server_certificate(tmp_path):
    cert, key = tls.ensure_certificate(tmp_path)
    ca_path = tmp_path / tls.CA_CERT_NAME
    (ca,) = load_chain(ca_path)
    leaf, chained = load_chain(Path(cert))
    assert chained == ca  # the listener sends the chain
    leaf.verify_directly_issued_by(ca)
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca is True
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.path_length == 0
    assert leaf.extensions.get_extension_for_class(x509.BasicConstraints).value.ca is False
    assert list(leaf.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value) == [
        x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]
    assert (leaf.not_valid_after_utc - leaf.not_valid_before_utc).days <= 825  # Apple's limit
    assert (ca.not_valid_after_utc - ca.not_valid_before_utc).days >= 3650
    assert oct(os.stat(tmp_path / tls.CA_KEY_NAME).st_mode & 0o777) == "0o600"
    assert "PRIVATE KEY" not in ca_path.read_text()
    assert tls.ca_fingerprint(tmp_path) == ca.fingerprint(hashes.SHA256()).hex(":").upper()


def test_new_addresses_reissue_the_server_certificate_under_the_same_authority(tmp_path, monkeypatch):
    cert, _ = tls.ensure_certificate(tmp_path)
    authority = (tmp_path / tls.CA_CERT_NAME).read_bytes()
    real = tls.wanted_names
    monkeypatch.setattr(tls, "wanted_names", lambda: (real()[0], real()[1] + ["10.11.12.13"]))
    cert, _ = tls.ensure_certificate(tmp_path)
    assert (tmp_path / tls.CA_CERT_NAME).read_bytes() == authority  # a phone installs it once
    leaf, ca = load_chain(Path(cert))
    leaf.verify_directly_issued_by(ca)
    assert "10.11.12.13" in sans(Path(cert))[1]


def test_a_self_signed_certificate_from_an_older_djev_is_reissued(tmp_path):
    cert, _ = tls.ensure_certificate(tmp_path)
    # What djev wrote before it had an authority: one certificate, its own issuer, no authority key id.
    (ca,) = load_chain(tmp_path / tls.CA_CERT_NAME)
    Path(cert).write_bytes((tmp_path / tls.CA_CERT_NAME).read_bytes())
    cert, _ = tls.ensure_certificate(tmp_path)
    leaf, _ = load_chain(Path(cert))
    assert leaf != ca
    leaf.verify_directly_issued_by(ca)


def test_a_broken_authority_is_replaced_and_the_server_certificate_reissued(tmp_path):
    tls.ensure_certificate(tmp_path)
    (old_ca,) = load_chain(tmp_path / tls.CA_CERT_NAME)
    (tmp_path / tls.CA_KEY_NAME).write_text("not a key")
    cert, _ = tls.ensure_certificate(tmp_path)
    (new_ca,) = load_chain(tmp_path / tls.CA_CERT_NAME)
    assert new_ca != old_ca
    leaf, _ = load_chain(Path(cert))
    leaf.verify_directly_issued_by(new_ca)


def test_the_authority_is_served_for_a_phone_to_install(tiny_dir, tmp_path):
    settings = Settings.of(cert_dir=str(tmp_path))
    with TestClient(create_app(settings, make_tiny_reader(tiny_dir))) as client:
        missing = client.get("/djev-ca.crt")
        assert missing.status_code == 404 and "--tls-port" in missing.text
        tls.ensure_certificate(tmp_path)
        response = client.get("/djev-ca.crt")
    assert response.status_code == 200
    assert response.headers["content-type"] == "application/x-x509-ca-cert"
    assert response.content == (tmp_path / tls.CA_CERT_NAME).read_bytes()
    assert x509.load_pem_x509_certificate(response.content).extensions.get_extension_for_class(
        x509.BasicConstraints).value.ca is True


def test_the_balancer_file_holds_certificate_chain_and_key_from_the_one_authority(tmp_path):
    """`djev cert`'s file, for HAProxy's `crt`: issued by the authority phones already trust (the
    HTTPS test of tests/deploy/test_replicas.py has HAProxy present it), its key owner-only."""
    from cryptography.hazmat.primitives import serialization

    path = Path(tls.ensure_bundle(tmp_path, ["djev.lan", "10.9.8.7"]))
    assert path.name == tls.BUNDLE_NAME and oct(os.stat(path).st_mode & 0o777) == "0o600"
    leaf, chained = load_chain(path)
    (ca,) = load_chain(tmp_path / tls.CA_CERT_NAME)
    assert chained == ca
    leaf.verify_directly_issued_by(ca)
    key = serialization.load_pem_private_key(path.read_bytes(), password=None)  # the PEM's key block
    assert key.public_key() == leaf.public_key()
    dns, ips = sans(path)
    own_dns, own_ips = tls.wanted_names()
    assert dns == set(own_dns) | {"djev.lan"} and ips == set(own_ips) | {"10.9.8.7"}
    assert not (tmp_path / tls.CERT_NAME).exists()  # the listener's own pair is not the balancer's

    before = path.read_bytes()
    assert Path(tls.ensure_bundle(tmp_path, ["10.9.8.7", "djev.lan"])).read_bytes() == before  # kept
    tls.ensure_bundle(tmp_path, ["djev.lan"])
    assert path.read_bytes() != before and "10.9.8.7" not in sans(path)[1]  # names changed: reissued
    assert load_chain(tmp_path / tls.CA_CERT_NAME) == [ca]  # by the same authority


def test_djev_cert_writes_the_file_and_names_the_authority(tmp_path, capsys):
    from app.cli import main

    assert main(["cert", "--cert-dir", str(tmp_path), "--name", "djev.lan"]) == 0
    out = capsys.readouterr().out
    assert str(tmp_path / tls.BUNDLE_NAME) in out and "djev.lan" in out
    assert tls.ca_fingerprint(tmp_path) in out
