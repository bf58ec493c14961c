"""A self-signed certificate for the HTTPS listener (browsers open a webcam only on a secure origin).

Written into certs/ on first start and reused; regenerated when the set of names and addresses it
must cover changes (a new LAN address, a renamed host) or when it nears expiry. The names: localhost,
127.0.0.1, ::1, the hostname and every local IPv4 address.
"""

from __future__ import annotations

import datetime as dt
import fcntl
import ipaddress
import logging
import os
import socket
import struct
from pathlib import Path

log = logging.getLogger("djev.tls")

CERT_NAME = "djev.crt"
KEY_NAME = "djev.key"
VALID_DAYS = 825
RENEW_BEFORE_DAYS = 30
SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's IPv4 address


def local_ipv4_addresses() -> list[str]:
    """Every IPv4 address of this machine's interfaces (Linux), plus what the hostname resolves to."""
    found: set[str] = {"127.0.0.1"}
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            for _, name in socket.if_nameindex():
                try:
                    packed = fcntl.ioctl(sock.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
                    found.add(socket.inet_ntoa(packed[20:24]))
                except OSError:
                    continue
    except OSError:
        pass
    try:
        for info in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET):
            found.add(str(info[4][0]))
    except OSError:
        pass
    return sorted(found, key=lambda a: ipaddress.ip_address(a))


def wanted_names() -> tuple[list[str], list[str]]:
    """(DNS names, IP addresses) the certificate must cover."""
    dns = ["localhost"]
    hostname = socket.gethostname()
    if hostname and hostname != "localhost":
        dns.append(hostname)
    ips = local_ipv4_addresses() + ["::1"]
    return dns, ips


def certificate_names(cert_path: Path) -> tuple[set[str], set[str], dt.datetime] | None:
    from cryptography import x509

    try:
        cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except Exception:  # noqa: BLE001 - unreadable means regenerate
        return None
    dns = set(sans.get_values_for_type(x509.DNSName))
    ips = {str(ip) for ip in sans.get_values_for_type(x509.IPAddress)}
    return dns, ips, cert.not_valid_after_utc


def ensure_certificate(cert_dir: Path) -> tuple[str, str]:
    """The (certificate, key) paths, generating or regenerating them as needed."""
    cert_dir.mkdir(parents=True, exist_ok=True)
    cert_path, key_path = cert_dir / CERT_NAME, cert_dir / KEY_NAME
    dns, ips = wanted_names()
    current = certificate_names(cert_path) if cert_path.is_file() and key_path.is_file() else None
    now = dt.datetime.now(dt.timezone.utc)
    if current is not None:
        have_dns, have_ips, expires = current
        if have_dns == set(dns) and have_ips == set(ips) and expires - now > dt.timedelta(days=RENEW_BEFORE_DAYS):
            return str(cert_path), str(key_path)
        log.info("certificate names or validity changed: regenerating %s", cert_path)
    write_certificate(cert_path, key_path, dns, ips)
    log.info("wrote a self-signed certificate for %s to %s", ", ".join(dns + ips), cert_path)
    return str(cert_path), str(key_path)


def write_certificate(cert_path: Path, key_path: Path, dns: list[str], ips: list[str]) -> None:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "djev"),
                      x509.NameAttribute(NameOID.ORGANIZATION_NAME, "djev self-signed")])
    now = dt.datetime.now(dt.timezone.utc)
    alt_names: list[x509.GeneralName] = [x509.DNSName(d) for d in dns]
    alt_names += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ips]
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=VALID_DAYS))
        .add_extension(x509.SubjectAlternativeName(alt_names), critical=False)
        # Its own issuer: a client that trusts this file trusts the server.
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, content_commitment=False,
                                     key_encipherment=False, data_encipherment=False, key_agreement=False,
                                     crl_sign=False, encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    key_bytes = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                  serialization.NoEncryption())
    tmp_key = key_path.with_suffix(".key.tmp")
    with open(os.open(tmp_key, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as handle:
        handle.write(key_bytes)
    tmp_key.replace(key_path)
    tmp_cert = cert_path.with_suffix(".crt.tmp")
    tmp_cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    tmp_cert.replace(cert_path)
