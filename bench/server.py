"""A served djev in a process of its own, for the benches that measure it from outside: started
(`spawn`; `spawn_random` for random weights), awaited (`wait_ready`) and stopped (`Server.stop`),
with no process left behind. The random-weight server's process runs this module:

    python -m bench.server --port PORT --device cuda [--tiny] [--compile] [--fused-moe] [--cuda-graphs]

which serves `djev serve`'s app (`app.cli.serve`) over bench/models.py's `load_random`, with the
served bench's own routes (bench/served_load.py `bench_routes`).

Only the standard library is imported at module level; httpx and the app are imported where used.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

REPO = Path(__file__).resolve().parent.parent
now = time.monotonic


@dataclass(frozen=True)
class RandomServe:
    """What the random-weight server serves: the tiny config or the full size, on `device`, with
    the flags given (None: not given, the server's default, or the environment's)."""

    tiny: bool
    device: str
    compile: bool | None = None
    fused_moe: bool | None = None
    cuda_graphs: bool | None = None

    def settings(self, port: int = 0) -> Any:
        """The settings as `djev serve` reads them: the environment, then these flags."""
        from app.config import Settings

        return Settings.from_env(host="127.0.0.1", port=port or None, device=self.device, torch_compile=self.compile,
                                 fused_moe=self.fused_moe, cuda_graphs=self.cuda_graphs)

    def argv(self, port: int) -> list[str]:
        """The command line of the server process on `port`."""
        argv = [sys.executable, "-m", "bench.server", "--port", str(port), "--device", self.device]
        argv += ["--tiny"] if self.tiny else []
        for flag, value in (("compile", self.compile), ("fused-moe", self.fused_moe), ("cuda-graphs", self.cuda_graphs)):
            if value is not None:
                argv.append(("--" if value else "--no-") + flag)
        return argv


@dataclass
class Server:
    process: subprocess.Popen
    url: str
    log_path: Path
    spawned: float

    def alive(self) -> bool:
        return self.process.poll() is None

    def log_tail(self, lines: int = 8) -> str:
        try:
            return "\n".join(line[:200] for line in self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self) -> None:
        """SIGTERM to the server's process group (compile workers included), SIGKILL after 10 s."""
        for sig, wait_s in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(self.process.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
            try:
                self.process.wait(timeout=wait_s)
                break
            except subprocess.TimeoutExpired:
                continue
        try:  # anything the group still holds (a compile worker that outlived the server)
            os.killpg(self.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def spawn(argv: Sequence[str], port: int, log_path: Path, env: dict[str, str] | None = None) -> Server:
    """`argv` (a server that listens on 127.0.0.1:`port`) in a process group of its own, from the
    repository root, its output to `log_path`."""
    with open(log_path, "wb") as log:
        process = subprocess.Popen(list(argv), cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True)
    return Server(process, f"http://127.0.0.1:{port}", log_path, now())


def spawn_random(served: RandomServe, log_path: Path) -> Server:
    """The random-weight server (this module's `main`) on a free port."""
    from app.server import free_port

    port = free_port()
    return spawn(served.argv(port), port, log_path)


def wait_ready(server: Server, timeout: float) -> dict[str, Any]:
    """Poll /health until 200: the seconds from spawn to the first answer (any status) and to ready."""
    import httpx

    out: dict[str, Any] = {}
    limit = now() + timeout
    while True:
        if not server.alive():
            raise RuntimeError(f"the server exited with {server.process.returncode}:\n{server.log_tail()}")
        try:
            response = httpx.get(server.url + "/health", timeout=2.0)
        except httpx.HTTPError:
            response = None
        if response is not None:
            if "first_answer_s" not in out:
                out["first_answer_s"] = round(now() - server.spawned, 1)
                out["first_status"] = response.status_code
                out["first_body"] = response.text[:300]
            if response.status_code == 200:
                out["ready_s"] = round(now() - server.spawned, 1)
                out["health"] = response.json()
                return out
        if now() > limit:
            raise RuntimeError(f"the server was not ready after {timeout:.0f} s:\n{server.log_tail()}")
        time.sleep(0.2)


def read_metrics(url: str, timeout: float = 10.0) -> dict[str, float]:
    """Every series of the server's /metrics as {series (the name with its labels): value}; {} when
    it does not answer."""
    import httpx

    try:
        text = httpx.get(url + "/metrics", timeout=timeout).text
    except httpx.HTTPError:
        return {}
    series: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        try:
            series[key] = float(value)
        except ValueError:
            pass
    return series


def engine_of(series: dict[str, float]) -> str | None:
    """The engine `djev_info` names in /metrics `series` (None: not there)."""
    import re

    for key in series:
        if key.split("{", 1)[0] == "djev_info":
            found = re.search(r'engine="([^"]*)"', key)
            return found.group(1) if found else None
    return None


def compile_report(url: str, api_key: str = "") -> dict[str, Any]:
    """What the server's start-up built, read after ready: from /metrics the graphs captured by kind
    (`djev_hf_<kind>_graphs_built_total`) and the after-ready counters (bench/common.py AFTER_READY);
    from the bench server's `GET /bench/compile-counts` (bench/served_load.py `bench_routes`) the
    reader's `compile_counts` (captures, torch.compile graphs, Triton kernels), which /metrics does
    not carry. A server without that route gives `counts` None."""
    import httpx

    from bench.common import after_ready_metrics

    series = read_metrics(url)
    graphs = {key.removeprefix("djev_hf_").removesuffix("_graphs_built_total"): value for key, value in series.items()
              if key.startswith("djev_hf_") and key.endswith("_graphs_built_total")}
    counts = None
    try:
        response = httpx.get(url + "/bench/compile-counts", timeout=10.0,
                             headers={"authorization": f"Bearer {api_key}"} if api_key else {})
        if response.status_code == 200:
            counts = response.json().get("counts")
    except (httpx.HTTPError, ValueError):
        pass
    return {"engine": engine_of(series), "graphs_built": graphs, "counts": counts,
            "after_ready": after_ready_metrics(series)}


def compile_report_lines(report: dict[str, Any], where: str) -> list[str]:
    """`compile_report` as the lines a bench prints right after ready."""
    from bench.common import compile_counts_line

    if report["engine"] is None:
        return [f"{where}: /metrics did not answer: no compile counts"]
    lines = [compile_counts_line(report["counts"], where) if report["counts"] is not None
             else f"{where}: compile counts not reported (no /bench/compile-counts on this server)"]
    built = ", ".join(f"{kind} {value:g}" for kind, value in sorted(report["graphs_built"].items()))
    lines.append(f"{where}: graphs captured by kind (/metrics *_graphs_built_total): {built or 'none'}")
    return lines


# ---------------------------------------------------------------------------------------- the server process

def watch_parent() -> None:
    """In the server: if the bench goes away without stopping it, end this process group (no orphans)."""
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(1.0)
            if os.getppid() != parent:
                os.killpg(os.getpgid(0), signal.SIGKILL)

    threading.Thread(target=watch, name="bench-parent-watch", daemon=True).start()


def main(argv: Sequence[str] | None = None) -> int:
    """The random-weight server: `djev serve` over `load_random`, with the bench routes."""
    parser = argparse.ArgumentParser(description="djev serve over random weights, for the benches")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--device", required=True)
    parser.add_argument("--tiny", action="store_true")
    for flag in ("compile", "fused-moe", "cuda-graphs"):
        parser.add_argument(f"--{flag}", action=argparse.BooleanOptionalAction, default=None)
    args = parser.parse_args(argv)
    served = RandomServe(args.tiny, args.device, args.compile, args.fused_moe, args.cuda_graphs)

    from app.cli import serve
    from app.logs import configure_logging
    from bench.models import load_random, random_weights
    from bench.served_load import bench_routes

    settings = served.settings(args.port)
    configure_logging(settings)
    watch_parent()
    return serve(settings, load=lambda progress: load_random(served.tiny, served.device, settings, progress,
                                                             weights=random_weights(settings)),
                 extra_routes=bench_routes())


if __name__ == "__main__":
    sys.exit(main())
