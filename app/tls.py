"""The HTTPS listener's certificate (browsers open a webcam only on a secure origin), issued by a
local certificate authority that djev writes once.

certs/djev-ca.crt (and its key) is the authority: made on first start, kept for ten years, never
regenerated on its own. A phone that installs it once (docs/deploy.md "From a phone on the LAN") trusts
every server certificate it issues: no warning, and the browser then allows what it refuses on an
untrusted certificate (a service worker, installing the page). certs/djev.crt is the server's
certificate followed by the authority's (the chain the listener sends); it is reissued when the set
of names and addresses it must cover changes (a new LAN address, a renamed host), when it nears
expiry, or when it was not issued by the current authority. The names: localhost, 127.0.0.1, ::1,
the hostname and every local IPv4 address.

certs/djev.pem is the same kind of certificate for a TLS-terminating load balancer in front of djev
replicas (`djev cert`; docs/deploy.md, "Replicas behind HAProxy"): the certificate, the authority's
and the key in one file, as HAProxy's `crt` takes it. It is issued by the same authority, so a phone
that trusts it once trusts the balancer and every replica behind it; the listener's own pair is left
alone (a replica behind the balancer serves HTTP only).
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
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    from cryptography import x509
    from cryptography.hazmat.primitives.asymmetric import ec

log = logging.getLogger("djev.tls")

CERT_NAME = "djev.crt"
KEY_NAME = "djev.key"
CA_CERT_NAME = "djev-ca.crt"
CA_KEY_NAME = "djev-ca.key"
BUNDLE_NAME = "djev.pem"  # a balancer's certificate, chain and key in one file
VALID_DAYS = 825  # the longest server certificate Apple's platforms accept
CA_VALID_DAYS = 3650
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


def with_extra_names(names: tuple[list[str], list[str]], extra: Sequence[str]) -> tuple[list[str], list[str]]:
    """`names` plus each of `extra` (an IP address, or else a DNS name) it lacks: the name a balancer
    is reached by when that is not this machine's own (a DNS alias, a Kubernetes ingress host)."""
    dns, ips = list(names[0]), list(names[1])
    for name in extra:
        try:
            ip = str(ipaddress.ip_address(name))
        except ValueError:
            if name not in dns:
                dns.append(name)
            continue
        if ip not in ips:
            ips.append(ip)
    return dns, ips


def certificate_names(cert_path: Path) -> tuple[set[str], set[str], dt.datetime, bytes] | None:
    """(DNS names, IPs, expiry, issuer key id) of the first certificate in the file, or None."""
    from cryptography import x509

    try:
        cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        issuer = cert.extensions.get_extension_for_class(x509.AuthorityKeyIdentifier).value.key_identifier
    except Exception:  # noqa: BLE001 - unreadable, or self-signed by an older djev: reissue
        return None
    dns = set(sans.get_values_for_type(x509.DNSName))
    ips = {str(ip) for ip in sans.get_values_for_type(x509.IPAddress)}
    return dns, ips, cert.not_valid_after_utc, issuer or b""


def ensure_certificate(cert_dir: Path) -> tuple[str, str]:
    """The server's (certificate chain, key) paths, writing the authority and issuing as needed."""
    cert_dir.mkdir(parents=True, exist_ok=True)
    ca_cert, ca_key = ensure_authority(cert_dir)
    cert_path, key_path = cert_dir / CERT_NAME, cert_dir / KEY_NAME
    dns, ips = wanted_names()
    current = certificate_names(cert_path) if cert_path.is_file() and key_path.is_file() else None
    if still_good(current, dns, ips, ca_cert):
        return str(cert_path), str(key_path)
    if current is not None:
        log.info("certificate names, validity or authority changed: reissuing %s", cert_path)
    write_certificate(cert_path, key_path, dns, ips, ca_cert, ca_key)
    log.info("issued a certificate for %s to %s", ", ".join(dns + ips), cert_path)
    return str(cert_path), str(key_path)


def ensure_bundle(cert_dir: Path, extra_names: Sequence[str] = ()) -> str:
    """The balancer's one-file certificate (certificate, authority, key: what HAProxy's `crt` takes),
    issued by djev's local authority for this machine's names plus `extra_names`, written or
    reissued as `ensure_certificate` does its pair. Its path."""
    cert_dir.mkdir(parents=True, exist_ok=True)
    ca_cert, ca_key = ensure_authority(cert_dir)
    path = cert_dir / BUNDLE_NAME
    dns, ips = with_extra_names(wanted_names(), extra_names)
    current = certificate_names(path) if path.is_file() else None
    if still_good(current, dns, ips, ca_cert):
        return str(path)
    if current is not None:
        log.info("certificate names, validity or authority changed: reissuing %s", path)
    cert, key = issue_certificate(dns, ips, ca_cert, ca_key)
    write_bundle(path, [cert, ca_cert], key)
    log.info("issued a balancer certificate for %s to %s", ", ".join(dns + ips), path)
    return str(path)


def still_good(current: tuple[set[str], set[str], dt.datetime, bytes] | None, dns: list[str], ips: list[str],
               ca_cert: "x509.Certificate") -> bool:
    """Whether a certificate (`certificate_names`' reading of it) covers exactly these names, was
    issued by this authority and is not near its expiry."""
    if current is None:
        return False
    have_dns, have_ips, expires, issuer = current
    now = dt.datetime.now(dt.timezone.utc)
    return (have_dns == set(dns) and have_ips == set(ips) and issuer == key_id(ca_cert)
            and expires - now > dt.timedelta(days=RENEW_BEFORE_DAYS))


def key_id(cert: "x509.Certificate") -> bytes:
    from cryptography import x509

    return x509.SubjectKeyIdentifier.from_public_key(cert.public_key()).digest


def ca_fingerprint(cert_dir: Path) -> str:
    """The authority's SHA-256 fingerprint as phones show it (AB:CD:...), to compare before trusting."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes

    cert = x509.load_pem_x509_certificate((cert_dir / CA_CERT_NAME).read_bytes())
    return cert.fingerprint(hashes.SHA256()).hex(":").upper()


def ensure_authority(cert_dir: Path) -> tuple["x509.Certificate", "ec.EllipticCurvePrivateKey"]:
    """The local authority, written on first start (or when its files are unreadable or expiring)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    cert_path, key_path = cert_dir / CA_CERT_NAME, cert_dir / CA_KEY_NAME
    now = dt.datetime.now(dt.timezone.utc)
    try:
        cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
        key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
        if isinstance(key, ec.EllipticCurvePrivateKey) and (
                cert.not_valid_after_utc - now > dt.timedelta(days=RENEW_BEFORE_DAYS)) and key_id(cert) == (
                x509.SubjectKeyIdentifier.from_public_key(key.public_key()).digest):
            log.info("local certificate authority %s (SHA-256 %s), served at /djev-ca.crt",
                     cert_path, ca_fingerprint(cert_dir))
            return cert, key
    except (OSError, ValueError):
        pass
    replacing = cert_path.exists()
    cert, key = write_authority(cert_path, key_path)
    if replacing:
        log.warning("wrote a new local certificate authority to %s (SHA-256 %s): phones that trusted the "
                    "old one must install this one", cert_path, ca_fingerprint(cert_dir))
    else:
        log.info("wrote a local certificate authority to %s (SHA-256 %s): install it once on a phone "
                 "(it is served at /djev-ca.crt) and the HTTPS port opens without a warning",
                 cert_path, ca_fingerprint(cert_dir))
    return cert, key


def write_authority(cert_path: Path, key_path: Path) -> tuple["x509.Certificate", "ec.EllipticCurvePrivateKey"]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    # The hostname in the name tells two djev machines' authorities apart in a phone's list.
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"djev local CA ({socket.gethostname()})"[:64]),
                      x509.NameAttribute(NameOID.ORGANIZATION_NAME, "djev")])
    now = dt.datetime.now(dt.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=CA_VALID_DAYS))
        # path_length=0: it issues server certificates only, never another authority.
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=False, key_cert_sign=True, crl_sign=True,
                                     content_commitment=False, key_encipherment=False, data_encipherment=False,
                                     key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    write_private(key_path, key)
    write_public(cert_path, [cert])
    return cert, key


def write_certificate(cert_path: Path, key_path: Path, dns: list[str], ips: list[str],
                      ca_cert: "x509.Certificate", ca_key: "ec.EllipticCurvePrivateKey") -> None:
    cert, key = issue_certificate(dns, ips, ca_cert, ca_key)
    write_private(key_path, key)
    # The chain the listener sends: the server's certificate, then the authority's.
    write_public(cert_path, [cert, ca_cert])


def issue_certificate(dns: list[str], ips: list[str], ca_cert: "x509.Certificate",
                      ca_key: "ec.EllipticCurvePrivateKey") -> tuple["x509.Certificate", "ec.EllipticCurvePrivateKey"]:
    """A server certificate for these names, signed by the authority, and its new key."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "djev"),
                      x509.NameAttribute(NameOID.ORGANIZATION_NAME, "djev")])
    now = dt.datetime.now(dt.timezone.utc)
    alt_names: list[x509.GeneralName] = [x509.DNSName(d) for d in dns]
    alt_names += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ips]
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(min(now + dt.timedelta(days=VALID_DAYS), ca_cert.not_valid_after_utc))
        .add_extension(x509.SubjectAlternativeName(alt_names), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=False, content_commitment=False,
                                     key_encipherment=False, data_encipherment=False, key_agreement=False,
                                     crl_sign=False, encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    return cert, key


def write_private(path: Path, key: "ec.EllipticCurvePrivateKey") -> None:
    from cryptography.hazmat.primitives import serialization

    data = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as handle:
        handle.write(data)
    tmp.replace(path)


def write_public(path: Path, certs: "list[x509.Certificate]") -> None:
    from cryptography.hazmat.primitives import serialization

    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_bytes(b"".join(cert.public_bytes(serialization.Encoding.PEM) for cert in certs))
    tmp.replace(path)


def write_bundle(path: Path, certs: "list[x509.Certificate]", key: "ec.EllipticCurvePrivateKey") -> None:
    """The certificates, then the key, in one PEM file readable by its owner only (it holds the key)."""
    from cryptography.hazmat.primitives import serialization

    data = b"".join(cert.public_bytes(serialization.Encoding.PEM) for cert in certs)
    data += key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                              serialization.NoEncryption())
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as handle:
        handle.write(data)
    tmp.replace(path)


def run_cert(cert_dir: Path, names: Sequence[str]) -> int:
    """`djev cert`: write (or keep) the balancer's one-file certificate and say what it is."""
    path = ensure_bundle(cert_dir, names)
    read = certificate_names(Path(path))
    covered = sorted(read[0]) + sorted(read[1]) if read else []
    print(f"{path}: certificate, chain and key for {', '.join(covered)}")
    print(f"issued by {cert_dir / CA_CERT_NAME} (SHA-256 {ca_fingerprint(cert_dir)}): the authority phones trust once")
    return 0

