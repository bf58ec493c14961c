"""`djev serve | calibrate | eval | selftest | cert | haproxy-config | tiny-model`: parse flags, build
Settings, choose the checkpoint, start the server or run the command."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence

from app.balancer import CHECK_INTERVAL_MS, FIRST_REPLICA_PORT
from app.config import Settings, field_kind, setting_fields
from app.logs import configure_logging

if TYPE_CHECKING:
    from app.engine.base import Reader, StartupProgress


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_setting_flags(parser: argparse.ArgumentParser) -> None:
    """A flag for every setting, overriding its environment variable."""
    for _, f in setting_fields():
        env = f.metadata["env"]
        kind = field_kind(f)
        if kind is bool:
            parser.add_argument(_flag(f.name), dest=f.name, action=argparse.BooleanOptionalAction, default=None,
                                help=f"{f.metadata['help']} (env {env})")
        elif kind is tuple:  # a list setting: the flag repeats
            parser.add_argument(_flag(f.name), dest=f.name, action="append", default=None,
                                help=f"{f.metadata['help']} (env {env})")
        else:
            parser.add_argument(_flag(f.name), dest=f.name, type=kind, default=None,
                                help=f"{f.metadata['help']} (env {env}, default {f.default!r})")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="djev", description="DiffusionGemma decision server (Jev /v1/systemone)")
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="start the server", description=(
        "Start the decision server. Every flag overrides the environment variable named in its help."))
    add_setting_flags(serve)

    calibrate = commands.add_parser("calibrate", help="fit a calibration on labelled JSONL", description=(
        "Read each line's request through the engine the settings configure (as `djev serve` builds it, in "
        "this process), record every read's raw label distribution, fit a calibration on the training share "
        "of the lines and print ECE, Brier and log loss before and after on the held-out share, per bucket. "
        "A line is {\"request\": <Jev body>, \"expected\": {<question id>: <answer>}}; docs/quality.md."))
    calibrate.add_argument("data", type=Path, help="labelled JSONL")
    calibrate.add_argument("--out", type=Path, required=True, help="the calibration file to write")
    calibrate.add_argument("--held-out", type=float, default=0.3, help="share of lines held out (by a hash of the line)")
    calibrate.add_argument("--min-id-labels", type=int, default=100,
                           help="labels a question id needs for a bucket of its own")
    calibrate.add_argument("--concurrency", type=int, default=8, help="decisions in flight at once")
    add_setting_flags(calibrate)

    evaluate = commands.add_parser("eval", help="score answers on labelled JSONL", description=(
        "Ask each line's request of a running server (--url) or of the engine the settings configure in this "
        "process (with CALIBRATION applied), and report ECE, Brier and log loss per bucket, how often a choice's "
        "top answer changes with its options permuted, and (--out) the numbers as JSON and a reliability PNG."))
    evaluate.add_argument("data", type=Path, help="labelled JSONL (the format of djev calibrate)")
    evaluate.add_argument("--url", help="a running djev server, e.g. http://127.0.0.1:8011")
    evaluate.add_argument("--out", type=Path, help="folder for eval.json and reliability.png")
    evaluate.add_argument("--max-ece", type=float, help="exit 1 when the ECE over all questions is above this")
    evaluate.add_argument("--permute", action=argparse.BooleanOptionalAction, default=True,
                          help="ask every line again with its choice options shuffled (order robustness)")
    evaluate.add_argument("--seed", type=int, default=0, help="seed of the option shuffles")
    evaluate.add_argument("--timeout", type=float, default=120.0, help="seconds per request with --url")
    evaluate.add_argument("--concurrency", type=int, default=8, help="decisions in flight at once")
    add_setting_flags(evaluate)

    selftest = commands.add_parser("selftest", help="one decision end to end, printed; exit 1 on failure", description=(
        "Send the README's three-question decision to a running server (--url), or, without --url, build the "
        "engine the environment configures in this process and ask it. Settings come from the environment."))
    selftest.add_argument("--url", help="a running djev server, e.g. http://127.0.0.1:8011")
    selftest.add_argument("--timeout", type=float, default=120.0, help="seconds for the engine and the answer")

    cert = commands.add_parser("cert", help="write the certificate a TLS-terminating balancer presents", description=(
        "Write djev's local certificate authority (once, as `djev serve --tls-port` does) and, issued by it, the "
        "certificate of a load balancer in front of djev replicas: CERT_DIR/djev.pem, the certificate, the "
        "authority's and the key in one file, as HAProxy's `crt` takes it. It covers this machine's names and "
        "addresses (as djev's own), plus each --name; it is reissued when they change. Phones trust the one "
        "authority (docs/deploy.md)."))
    cert.add_argument("--cert-dir", dest="cert_dir", default=None, help="where the authority and the file live (env CERT_DIR)")
    cert.add_argument("--name", action="append", default=[], help="another DNS name or IP address the balancer is reached "
                      "by (repeat)")

    haproxy = commands.add_parser("haproxy-config", help="print HAProxy's configuration for djev replicas", description=(
        "Print the haproxy.cfg for djev replicas behind HAProxy (docs/deploy.md, \"Replicas behind HAProxy\"): "
        "leastconn, readiness on /health, camera sessions kept on their replica with maxconn MAX_SESSIONS + 1, "
        "HTTPS with `djev cert`'s file. MAX_SESSIONS and REQUEST_TIMEOUT are the replicas' (the environment, as "
        "`djev serve` reads it, or the flags)."))
    replicas = haproxy.add_mutually_exclusive_group(required=True)
    replicas.add_argument("--replicas", type=int, help="N replicas gpu0 ... gpuN-1 on consecutive ports from --first-port")
    replicas.add_argument("--server", action="append", metavar="ID=HOST:PORT", help="one replica (repeat)")
    haproxy.add_argument("--first-port", type=int, default=FIRST_REPLICA_PORT, help="the first replica's port (--replicas)")
    haproxy.add_argument("--replica-host", default="127.0.0.1", help="where the replicas listen (--replicas)")
    haproxy.add_argument("--bind", default=Settings().server.host, help="the interface HAProxy listens on")
    haproxy.add_argument("--http-port", type=int, default=Settings().server.port, help="HAProxy's HTTP port")
    haproxy.add_argument("--https-port", type=int, default=0, help="HAProxy's HTTPS port; 0 = none")
    haproxy.add_argument("--crt", help="the file `djev cert` writes (default CERT_DIR/djev.pem)")
    haproxy.add_argument("--stats-port", type=int, default=0, help="HAProxy's stats page on 127.0.0.1; 0 = none")
    haproxy.add_argument("--user", default="", help="the user HAProxy drops to after reading its files as root")
    haproxy.add_argument("--check-interval-ms", type=int, default=CHECK_INTERVAL_MS, help="ms between /health checks")
    haproxy.add_argument("--max-sessions", dest="max_sessions", type=int, default=None,
                         help="the replicas' MAX_SESSIONS (env MAX_SESSIONS)")
    haproxy.add_argument("--request-timeout", dest="request_timeout", type=float, default=None,
                         help="the replicas' REQUEST_TIMEOUT (env REQUEST_TIMEOUT)")

    tiny = commands.add_parser("tiny-model", help="write the tiny random-weight checkpoint to DIR")
    tiny.add_argument("directory", type=Path)
    tiny.add_argument("--seed", type=int, default=0, help="weights seed (the same seed writes the same files)")
    return parser


def settings_from_args(args: argparse.Namespace) -> Settings:
    overrides = {f.name: getattr(args, f.name, None) for _, f in setting_fields()}
    return Settings.from_env(**overrides)


def use_switch_interval(settings: Settings) -> float:
    """Give the interpreter SWITCH_INTERVAL_MS; returns the interval it had (seconds). Every torch op
    releases the interpreter, and a thread that wants it back waits up to the interval while another
    thread runs Python: an eager pass of ~4,000 ops took 1.9-2.3 s on the H200 beside the event
    loop's work on a heavy burst, where it takes ~100 ms alone (docs/design.md §5.2)."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(settings.runtime.switch_interval_ms / 1000)
    return before


def serve(settings: Settings, load: Callable[[StartupProgress], Reader] | None = None, *,
          extra_routes: list | None = None) -> int:
    """Run the server until it is stopped; the exit status. The listener is up at once; `load`
    builds the reader behind it, in a thread (default: the one the settings ask for,
    `app.build.build_reader`), told each start-up phase. A bench passes its own, e.g. random weights
    through the hf engine's `hf_reader`, and is served exactly as `djev serve` serves; its
    `extra_routes` go to `create_app` as they are. A load that fails stops the server within
    seconds: 2 when no checkpoint was usable (the message says what to do), 1 otherwise (the log
    says why). A CALIBRATION file that is malformed, or fitted for another model than the one
    loaded, is refused the same way, with exit status 2."""
    from app.build import CheckpointError, build_reader, check_calibration, load_calibration, provisional_info, use_cache_dir
    from app.decisions.calibration import CalibrationError
    from app.engine.starting import StartingReader
    from app.server import create_app, serve_app

    try:
        calibration = load_calibration(settings)  # a malformed file stops the start before any load
    except CalibrationError as exc:
        print(f"djev: {exc}", file=sys.stderr)
        return 2
    build = load or (lambda progress: build_reader(settings, progress))

    def load_checked(progress: StartupProgress) -> Reader:
        reader = build(progress)
        check_calibration(calibration, settings, reader.info, reader.tokenizer)  # fitted for this model?
        return reader

    for name, value in use_cache_dir(settings).items():  # before the load imports torch
        logging.getLogger("djev").info("cache: %s=%s", name, value)
    starting = StartingReader(provisional_info(settings), load_checked)
    app = create_app(settings, starting, extra_routes, calibration)
    ssl = None
    if settings.server.tls_port:
        from app.tls import ensure_certificate

        ssl = ensure_certificate(Path(settings.server.cert_dir))
    interval = use_switch_interval(settings)
    try:
        status = asyncio.run(serve_app(app, settings, ssl))
    finally:
        sys.setswitchinterval(interval)  # a caller that serves in-process (tests) gets its own back
    if isinstance(starting.failure, (CheckpointError, CalibrationError)):
        print(f"djev: {starting.failure}", file=sys.stderr)
        return 2
    return status


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "tiny-model":
        logging.basicConfig(level=logging.INFO, format="%(message)s")
        from app.engine.tiny import write_tiny_model

        path = write_tiny_model(args.directory, seed=args.seed)
        print(f"tiny random-weight DiffusionGemma written to {path}")
        return 0
    try:
        settings = settings_from_args(args)
    except ValueError as exc:
        print(f"djev: {exc}", file=sys.stderr)
        return 2
    configure_logging(settings)
    if args.command == "cert":
        from app.tls import run_cert

        return run_cert(Path(settings.server.cert_dir), args.name)
    if args.command == "haproxy-config":
        from app.balancer import run_haproxy_config

        return run_haproxy_config(settings, args, list(sys.argv[1:] if argv is None else argv))
    if args.command == "selftest":
        from app.selftest import run_selftest

        return run_selftest(settings, args.url, args.timeout)  # it reports every failure itself
    if args.command == "calibrate":
        from app.calibrate import run_calibrate

        return run_calibrate(settings, args.data, args.out, args.held_out, args.min_id_labels, args.concurrency)
    if args.command == "eval":
        from app.calibrate import run_eval

        return run_eval(settings, args.data, args.url, args.out, args.max_ece, args.permute, args.seed, args.timeout,
                        args.concurrency)
    return serve(settings)
