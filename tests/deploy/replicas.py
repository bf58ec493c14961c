"""djev replicas and HAProxy as subprocesses on 127.0.0.1, for the tests of a replicated deployment
(tests/deploy/test_replicas.py): each replica is `djev serve` on the tiny model (one torch thread),
HAProxy runs in the foreground on the configuration `app.balancer` renders, and everything started
is stopped by process group. Every wait is bounded by a deadline."""

from __future__ import annotations

import csv
import io
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, TypeVar

import httpx

from app import balancer
from app.server import free_port
from app.web.frontdoor import REPLICA_HEADER
from tests.processes import stop_group, tail

ROOT = Path(__file__).resolve().parents[2]
T = TypeVar("T")

# `djev serve` exactly as the command runs it (app.cli.serve), but its load waits for a gate file
# first: a replica that listens and answers /health 503 "starting" for as long as a test wants.
GATED_SERVE = """
import sys, time
from pathlib import Path
from app.build import build_reader
from app.cli import build_parser, serve, settings_from_args
from app.logs import configure_logging

gate = Path(sys.argv[1])
settings = settings_from_args(build_parser().parse_args(["serve", *sys.argv[2:]]))
configure_logging(settings)


def load(progress):
    progress("waiting for the test's gate", 0, 1)
    while not gate.exists():
        time.sleep(0.05)
    return build_reader(settings, progress)


sys.exit(serve(settings, load))
"""


def haproxy_executable() -> str | None:
    """HAProxy's path: on PATH, or in /usr/sbin where Debian puts it (a user's PATH may lack it)."""
    return shutil.which("haproxy") or shutil.which("haproxy", path="/usr/sbin:/usr/local/sbin")


HAPROXY_MISSING = "haproxy is not installed: scripts/setup.sh --test installs Debian's"


def wait_for(what: str, check: Callable[[], T | None], timeout: float, every: float = 0.05,
              log: Callable[[], str] = lambda: "") -> T:
    """check()'s first truthy value, polling until the deadline; AssertionError naming `what`."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}\n{log()}")
        time.sleep(every)


def stop(process: subprocess.Popen, grace: float = 5.0) -> None:
    """SIGTERM to the process group, then SIGKILL past `grace` seconds."""
    stop_group(process, grace)


@dataclass
class Replica:
    """One `djev serve` subprocess with REPLICA_ID `id`."""

    id: str
    port: int
    process: subprocess.Popen
    log: Path
    gate: Path | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def health(self) -> dict | None:
        """/health's body (200 or 503), or None while nothing answers."""
        try:
            response = httpx.get(self.url + "/health", timeout=2)
        except httpx.TransportError:
            return None
        return response.json()

    def ready(self) -> bool:
        health = self.health()
        return health is not None and health["ready"]

    def sessions(self) -> int | None:
        health = self.health()
        return None if health is None else health["sessions"]

    def requests_to(self, route: str) -> float:
        """djev_http_requests_total of `route` on this replica, all methods and statuses: what
        reached it, whatever it answered."""
        text = httpx.get(self.url + "/metrics", timeout=2).text
        total = 0.0
        for line in text.splitlines():
            if line.startswith("djev_http_requests_total{") and f'route="{route}"' in line:
                total += float(line.rsplit(" ", 1)[1])
        return total

    def open_gate(self) -> None:
        assert self.gate is not None
        self.gate.touch()

    def kill(self) -> None:
        """SIGKILL: the replica dies mid-run, as a crashed process or a lost GPU would."""
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait(timeout=10)

    def stop(self) -> None:
        stop(self.process)


def start_replica(replica_id: str, tiny_dir: Path, work: Path, *, gated: bool = False, **flags: object) -> Replica:
    """`djev serve` on the tiny model on a free port of 127.0.0.1 (not waited for); gated: its load
    waits until `open_gate()`. `flags` become `--name value` flags."""
    port = free_port()
    args = ["--model", str(tiny_dir), "--host", "127.0.0.1", "--port", str(port), "--replica-id", replica_id,
            "--torch-threads", "1"]
    for name, value in flags.items():
        args += ["--" + name.replace("_", "-"), str(value)]
    gate = work / f"{replica_id}.gate" if gated else None
    command = ([sys.executable, "-c", GATED_SERVE, str(gate)] if gate else [sys.executable, "-m", "app", "serve"]) + args
    log = work / f"{replica_id}.log"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "LOG_LEVEL": "info"}
    with open(log, "wb") as out:
        process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, start_new_session=True)
    return Replica(replica_id, port, process, log, gate)


@dataclass
class Haproxy:
    """HAProxy in the foreground over some replicas, with its stats page on 127.0.0.1."""

    config: balancer.BalancerConfig
    process: subprocess.Popen
    log: Path
    replicas: dict[str, Replica] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.config.http_port}"

    @property
    def https_url(self) -> str:
        return f"https://localhost:{self.config.https_port}"

    def stats(self) -> dict[tuple[str, str], dict[str, str]]:
        """HAProxy's stats CSV by (proxy, server)."""
        text = httpx.get(f"http://127.0.0.1:{self.config.stats_port}/;csv", timeout=2).text
        rows = csv.DictReader(io.StringIO(text.lstrip("# ")))
        return {(row["pxname"], row["svname"]): row for row in rows}

    def state(self, replica_id: str) -> str:
        """The api backend's view of a replica: UP, DOWN, ... (its checks decide both backends)."""
        return self.stats()[("api", replica_id)]["status"].split(" ")[0]

    def wait_state(self, replica_id: str, state: str, timeout: float = 15) -> None:
        wait_for(f"HAProxy to see {replica_id} {state}", lambda: self.state(replica_id) == state, timeout,
                 log=lambda: tail(self.log))

    def cameras(self, replica_id: str) -> int:
        """Websockets HAProxy holds open to a replica now (the stream backend's current sessions)."""
        return int(self.stats()[("stream", replica_id)]["scur"])

    def stop(self) -> None:
        stop(self.process)


def start_haproxy(replicas: list[Replica], work: Path, *, max_sessions: int, crt: str = "") -> Haproxy:
    """HAProxy on free ports of 127.0.0.1 in front of `replicas`, its configuration rendered by
    app.balancer as shipped (HTTPS too when `crt` is given); returns once it accepts connections."""
    executable = haproxy_executable()
    assert executable, HAPROXY_MISSING
    config = balancer.BalancerConfig(
        replicas=tuple(balancer.Replica(r.id, "127.0.0.1", r.port) for r in replicas), max_sessions=max_sessions,
        request_timeout_s=30, bind="127.0.0.1", http_port=free_port(), https_port=free_port() if crt else 0, crt=crt,
        stats_port=free_port(), command="tests/deploy/replicas.py")
    name = f"{len(list(work.glob('haproxy-*.cfg'))) + 1}-" + "-".join(r.id for r in replicas)
    path = work / f"haproxy-{name}.cfg"
    path.write_text(balancer.render(config))
    log = work / f"haproxy-{name}.log"
    with open(log, "wb") as out:
        process = subprocess.Popen([executable, "-db", "-f", str(path)], stdout=out, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, start_new_session=True)
    proxy = Haproxy(config, process, log, {r.id: r for r in replicas})

    def listening() -> bool:
        assert process.poll() is None, f"haproxy exited {process.returncode}\n{tail(log)}"
        try:
            httpx.get(f"http://127.0.0.1:{config.stats_port}/;csv", timeout=1)
        except httpx.TransportError:
            return False
        return True

    try:
        wait_for("HAProxy to listen", listening, 10, log=lambda: tail(log))
    except BaseException:
        proxy.stop()  # not handed to the caller: stopped here
        raise
    return proxy


def landed(response: httpx.Response) -> str:
    """The replica that answered, from its header (AssertionError when absent)."""
    replica = response.headers.get(REPLICA_HEADER)
    assert replica, f"no {REPLICA_HEADER} header: {response.status_code} {response.text[:200]}"
    return replica
