"""HAProxy in front of djev replicas: the configuration `djev haproxy-config` writes.

One `djev serve` per GPU answers for one engine; a school or a class of phones needs several. The
field's answer for replicas of a stateful server is a load balancer that routes by readiness and
keeps each websocket on the replica it opened on, not a router of djev's own. What the rendered
configuration does, and why (docs/deploy.md, "Replicas behind HAProxy"):

- **Readiness.** Every replica is checked with `GET /health`, which answers 200 once the model is
  ready (`ok`, and `degraded`: still serving) and 503 while it starts, fails or stops: a replica
  that is loading gets no traffic, and one that stops answering is taken out. HAProxy counts a
  server up until its first check, so the first `CHECK_INTERVAL_MS` after HAProxy starts are
  covered by the retry below.
- **Two backends on the same replicas.** REST goes to `api`, camera sessions (`/v1/stream`) to
  `stream`; both balance `leastconn`, so each counts only its own kind: a replica's open cameras,
  not its REST connections, decide where the next camera goes. `stream` tracks `api`'s checks
  (one check per replica).
- **Camera admission stays djev's.** A `stream` server takes at most MAX_SESSIONS + 1 websockets:
  the one over MAX_SESSIONS reaches the full replica, which refuses it with its own 1013 and reason
  (the walk page backs off from a 1013; an HTTP 503 from HAProxy at the handshake would reach the
  page as a bare 1006, which it retries every second). Leastconn sends the reconnect to the replica
  with the fewest cameras, so it lands where one closed. Past every server's limit, a handshake
  waits in HAProxy's queue up to `QUEUE_TIMEOUT_S` for a slot, which a refusal frees in
  milliseconds. With MAX_SESSIONS=0 (each replica holds what its card holds) no cap is written: every
  replica refuses past its own limit with its 1013, and leastconn still spreads the cameras.
- **Websockets pass through** with `timeout tunnel`: an open camera session is idle for HAProxy only
  while djev's own pings (uvicorn's, every 20 s) are not flowing, so the tunnel's limit is a
  backstop, not the liveness check.
- **Retries are safe.** A decision is a read: nothing changes on the replica that answers it. A
  request whose replica refused the connection, died before answering, or answered 503 (starting,
  stopped, out of memory) is sent again to another replica (`retries`, `option redispatch 1`,
  `retry-on`); HAProxy keeps a copy of requests up to its buffer (16 KiB), so big image uploads
  are not retried. A 529 (the replica's MAX_INFLIGHT) is the client's to retry, as from one server.
- **The balancer's own errors are djev's envelope** (wire.md §5): with no replica ready a client
  gets 503 `unavailable_error` with `Retry-After`, the request id header and all, as from djev.
- **TLS once.** The HTTPS listener presents `djev cert`'s one-file certificate, issued by djev's
  local authority: a phone trusts that authority once, whatever replica answers.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

from app.config import REPLICA_ID, Settings
from app.tls import BUNDLE_NAME

# The first replica's port with --replicas (8011 + 10: the balancer keeps djev's own 8011 and 8443).
FIRST_REPLICA_PORT = 8021
# Milliseconds between two /health checks of a replica. Two failed checks in a row take it out, one
# good check brings it back (rise 1: djev's ready is a state it reaches once, not a flaky signal).
CHECK_INTERVAL_MS = 2000
CHECK_FALL = 2
# Seconds to connect to a replica, for a slot in the queue, and for a request's headers.
CONNECT_TIMEOUT_S = 5
QUEUE_TIMEOUT_S = 5
HTTP_REQUEST_TIMEOUT_S = 10
# Added to REQUEST_TIMEOUT for the client and server timeouts: djev answers its own 504 first.
TIMEOUT_SLACK_S = 30
# An open websocket with nothing passing in either direction for this long is closed.
TUNNEL_TIMEOUT = "1h"
# Client connections at once, cameras and REST together (each costs HAProxy two buffers).
MAX_CONNECTIONS = 4096
# Retries of a failed request, each to another replica when there is one.
RETRIES = 2

HEADER = "# HAProxy in front of djev replicas (docs/deploy.md, \"Replicas behind HAProxy\")."


@dataclass(frozen=True)
class Replica:
    """One `djev serve`: its REPLICA_ID (HAProxy's server name too) and where it listens."""

    id: str
    host: str
    port: int

    def problems(self) -> list[str]:
        problems = []
        if not REPLICA_ID.fullmatch(self.id):
            problems.append(f"replica id {self.id!r}: 1 to 64 letters, digits, '.', '_', ':' or '-'")
        if not 0 < self.port < 65536:
            problems.append(f"replica {self.id}: port {self.port} is not a port")
        if not self.host or any(c.isspace() for c in self.host):
            problems.append(f"replica {self.id}: host {self.host!r} is not a host")
        return problems

    @property
    def address(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


@dataclass(frozen=True)
class BalancerConfig:
    """What the configuration is written for. `max_sessions` and `request_timeout_s` are the
    replicas' MAX_SESSIONS and REQUEST_TIMEOUT (the caller reads them from Settings)."""

    replicas: tuple[Replica, ...]
    max_sessions: int
    request_timeout_s: float
    bind: str
    http_port: int
    https_port: int = 0  # 0: no HTTPS listener
    crt: str = ""  # the one-file certificate (`djev cert`) the HTTPS listener presents
    stats_port: int = 0  # 0: no stats page; else HAProxy's stats (and its CSV at /;csv) on 127.0.0.1
    user: str = ""  # the user HAProxy drops to once it has read its files (started as root); "" = stay
    check_interval_ms: int = CHECK_INTERVAL_MS
    command: str = ""  # the command line that wrote it, recorded in the header

    def problems(self) -> list[str]:
        problems = [p for replica in self.replicas for p in replica.problems()]
        if not self.replicas:
            problems.append("at least one replica")
        ids = [replica.id for replica in self.replicas]
        if len(set(ids)) != len(ids):
            problems.append(f"replica ids must differ: {', '.join(ids)}")
        if self.max_sessions < 0:
            problems.append("MAX_SESSIONS must be at least 0")
        if not 0 < self.http_port < 65536 or not 0 <= self.https_port < 65536 or not 0 <= self.stats_port < 65536:
            problems.append("the HTTP port must be a port, and the HTTPS and stats ports a port or 0")
        if self.https_port and not self.crt:
            problems.append("an HTTPS port needs the certificate file (djev cert writes it)")
        if any(c.isspace() for c in self.crt + self.bind) or not self.bind:
            problems.append("the bind address and the certificate path are single words")
        if self.check_interval_ms < 10:
            problems.append("the check interval must be at least 10 ms")
        if self.user and not re.fullmatch(r"[a-z_][a-z0-9_-]*", self.user):
            problems.append(f"user {self.user!r} is not a user name")
        return problems


def replicas_on_ports(count: int, first_port: int, host: str = "127.0.0.1", prefix: str = "gpu") -> tuple[Replica, ...]:
    """`count` replicas named gpu0, gpu1, ... on consecutive ports: one per GPU of a machine."""
    return tuple(Replica(f"{prefix}{i}", host, first_port + i) for i in range(count))


def error_body(kind: str, message: str) -> str:
    """djev's error envelope (app/web/errors.py) for an answer the balancer gives itself, as one
    single-quoted HAProxy word (so no single quote inside)."""
    body = json.dumps({"error": {"message": message, "type": kind, "param": None},
                       "detail": {"error_type": kind, "message": message}}, separators=(",", ":"))
    assert "'" not in body
    return body


# The x-typesafe-request-id of the balancer's own answers, shaped as djev's: req_ and 24 hex digits
# (three random 32-bit words; the official clients read the header on every answer).
REQUEST_ID = "req_" + "%[rand(4294967295),bytes(4,4),hex,lower]" * 3

# The balancer's own answers, in djev's envelope: (status, type, message, retry).
ERRORS = (
    (502, "upstream_error", "balancer: a replica broke off or garbled its answer", False),
    (503, "unavailable_error", "balancer: no djev replica is ready (starting, or down); try again later", True),
    (504, "timeout_error", "balancer: the replica took longer than the balancer waits", False),
)


def render(config: BalancerConfig) -> str:
    """The haproxy.cfg text. Raises ValueError naming each problem of `config`."""
    problems = config.problems()
    if problems:
        raise ValueError("; ".join(problems))
    timeout = f"{int(config.request_timeout_s + TIMEOUT_SLACK_S)}s"
    check = f"check inter {config.check_interval_ms}ms fall {CHECK_FALL} rise 1"
    lines = [HEADER]
    if config.command:
        lines.append(f"# Written by: {config.command}")
    lines += [
        f"# For {plural(len(config.replicas), 'replica')} with MAX_SESSIONS={config.max_sessions} and "
        f"REQUEST_TIMEOUT={config.request_timeout_s:g}: write it again (djev haproxy-config) rather than edit it.",
        "",
        "global",
        f"    maxconn {MAX_CONNECTIONS}",
        "    log stderr format raw local0 info",
    ]
    if config.user:
        lines += [f"    user {config.user}", f"    group {config.user}"]
    lines += [
        "",
        "defaults",
        "    mode http",
        "    log global",
        "    option httplog",
        "    option dontlognull",
        f"    timeout connect {CONNECT_TIMEOUT_S}s",
        f"    timeout client {timeout}",
        f"    timeout server {timeout}",
        f"    timeout http-request {HTTP_REQUEST_TIMEOUT_S}s",
        f"    timeout queue {QUEUE_TIMEOUT_S}s",
        f"    timeout tunnel {TUNNEL_TIMEOUT}",
        "    # A decision is a read: sent again to another replica when its own refused, died or was not ready.",
        f"    retries {RETRIES}",
        "    option redispatch 1",
        "    retry-on conn-failure empty-response 503",
    ]
    for status, kind, message, retry in ERRORS:
        hdrs = " hdr retry-after 1 hdr retry-after-ms 1000" if retry else ""
        lines.append(f"    http-error status {status} content-type application/json "
                     f"string '{error_body(kind, message)}'"
                     f" hdr x-typesafe-request-id {REQUEST_ID}{hdrs}")
    lines += [
        "",
        "frontend djev",
        f"    bind {bracket(config.bind)}:{config.http_port}",
    ]
    if config.https_port:
        # HTTP/1.1 only, as djev's own TLS listener: websockets upgrade the one way every browser has.
        lines.append(f"    bind {bracket(config.bind)}:{config.https_port} ssl crt {config.crt} alpn http/1.1")
    lines += [
        "    use_backend stream if { path /v1/stream }",
        "    default_backend api",
        "",
        "backend api",
        "    balance leastconn",
        # The whole request (up to a buffer) before a replica is picked: what a retry resends.
        "    option http-buffer-request",
        "    option httpchk GET /health",
        "    http-check expect status 200",
        # A connection refused takes the replica out at once (a killed replica), without waiting for checks.
        f"    default-server {check} observe layer4 error-limit 1 on-error mark-down",
    ]
    lines += [f"    server {replica.id} {replica.address}" for replica in config.replicas]
    lines += [
        "",
        "backend stream",
        "    balance leastconn",
    ]
    if config.max_sessions:
        lines += [
            "    # MAX_SESSIONS + 1: the one over the limit is refused by the replica itself, with its 1013 and reason.",
            f"    default-server maxconn {config.max_sessions + 1}",
        ]
    else:
        lines.append("    # MAX_SESSIONS=0: each replica takes what its card holds and refuses the next with its 1013.")
    lines += [f"    server {replica.id} {replica.address} track api/{replica.id}" for replica in config.replicas]
    if config.stats_port:
        lines += [
            "",
            "listen stats",
            f"    bind 127.0.0.1:{config.stats_port}",
            "    stats enable",
            "    stats uri /",
        ]
    return "\n".join(lines) + "\n"


def bracket(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def parse_server(text: str) -> Replica:
    """`ID=HOST:PORT` (an IPv6 host in brackets) as a Replica; ValueError saying what is wrong."""
    match = re.fullmatch(r"([^=]+)=(\[[^\]]+\]|[^:]+):(\d+)", text)
    if match is None:
        raise ValueError(f"--server {text!r}: expected ID=HOST:PORT")
    return Replica(match[1], match[2].strip("[]"), int(match[3]))


def run_haproxy_config(settings: Settings, args: argparse.Namespace, argv: list[str]) -> int:
    """`djev haproxy-config`: print the configuration (exit 0), or say what is wrong (exit 2)."""
    try:
        if args.server:
            replicas = tuple(parse_server(text) for text in args.server)
        else:
            replicas = replicas_on_ports(args.replicas, args.first_port, args.replica_host)
        config = BalancerConfig(
            replicas=replicas, max_sessions=settings.limits.max_sessions,
            request_timeout_s=settings.limits.request_timeout, bind=args.bind, http_port=args.http_port,
            https_port=args.https_port, crt=args.crt or str(Path(settings.server.cert_dir) / BUNDLE_NAME),
            stats_port=args.stats_port, user=args.user, check_interval_ms=args.check_interval_ms,
            command=shlex.join(["djev", *argv]))
        text = render(config)
    except ValueError as exc:
        print(f"djev haproxy-config: {exc}", file=sys.stderr)
        return 2
    sys.stdout.write(text)
    return 0


def plural(count: int, noun: str) -> str:
    return f"{count} {noun}" + ("" if count == 1 else "s")
