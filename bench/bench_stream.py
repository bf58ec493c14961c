"""Per-frame latency of the walk page's decision: websocket /v1/stream vs one REST POST per frame.

The walk page (app/static/js/walk.js) sends each camera frame -- 512 px wide, JPEG quality 0.7 --
as one decision with two questions: `ahead` (a 6-way hazard choice) and `side` (left/right half,
asked only when `ahead` names a danger, via ask_if). A clear frame is one image read, a blocked frame
two. This script measures, in ONE run on the tiny model, what a client sees per frame over the two
transports the server offers:

  websocket  one /v1/stream session: a config message with the request, then each frame as a binary
             message; the client waits for the frame's result before sending the next one.
  rest       POST /v1/systemone per frame, multipart (`request` JSON + `frame` file), as the
             reference system's walk page sent it (docs/behavior.md §7); keep-alive connection.

Both get the same frames in the same order (the same picture; each transport's stamp its own, so the
bytes differ), interleaved frame by frame so drift hits both alike.
Reported per transport: p50/p95 of the client-observed ms per frame, frames/s of the sequential loop,
the server-side decision time (diagnostics.timing.total_ms), reads per frame; for the websocket also
the server's own timing (queue_ms, read_ms, total_ms). Every frame is new, as a live camera's: the
engine keeps every prompt's KV in its KV store, keyed by the images' digests, so a frame sent twice
(or to both transports) would be read the second time over the first one's KV; with the vision
features' LRU off too (KV_CACHE_ENTRIES=0) every frame pays its vision tower and its prompt.

`--blocked` gates `side` on every `ahead` label, so every frame is two reads (a blocked frame); the
tiny random model rarely names a danger, so without it most frames are one read. The reads/frame
column says which was measured.

Usage: python bench/bench_stream.py [--frames 40] [--warmup 3] [--blocked] [--torch-threads N] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (  # noqa: E402 - the repository root must be importable first
    at_least,
    fmt,
    header,
    latency_summary,
    machine,
    markdown_table,
    percentile,
    set_torch_threads,
    tiny_checkpoint,
    tiny_server,
    write_json,
)
from bench.workload import FRAME_SIZE, JPEG_QUALITY, WALK_REQUEST, FrameMaker  # noqa: E402

TIMEOUT_S = 60.0


class WebsocketTransport:
    """One /v1/stream session, used strictly one frame at a time (send, wait for its result)."""

    def __init__(self, base_url: str, request: dict[str, Any]) -> None:
        self.url = base_url.replace("http://", "ws://") + "/v1/stream"
        self.request = request

    def __enter__(self) -> "WebsocketTransport":
        from websockets.sync.client import connect

        self.ws = connect(self.url, max_size=None, open_timeout=TIMEOUT_S, close_timeout=5).__enter__()
        self.expect("ready")
        self.ws.send(json.dumps({"type": "config", "request": self.request}))
        self.expect("configured")
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.ws.__exit__(*exc_info)

    def expect(self, kind: str) -> dict[str, Any]:
        while True:
            message = json.loads(self.ws.recv(timeout=TIMEOUT_S))
            if message.get("type") == kind:
                return message
            if message.get("type") == "error":
                raise RuntimeError(f"/v1/stream error: {message.get('error', message)}")

    def decide(self, frame: bytes) -> dict[str, Any]:
        self.ws.send(frame)
        return self.expect("result")


class RestTransport:
    """POST /v1/systemone per frame, multipart like the walk page: `request` JSON + `frame` file."""

    def __init__(self, base_url: str, request: dict[str, Any]) -> None:
        self.base_url = base_url
        self.request_json = json.dumps(request)

    def __enter__(self) -> "RestTransport":
        import httpx

        self.client = httpx.Client(base_url=self.base_url, timeout=TIMEOUT_S)
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.client.close()

    def decide(self, frame: bytes) -> dict[str, Any]:
        response = self.client.post("/v1/systemone", data={"request": self.request_json},
                                    files={"frame": ("frame.jpg", frame, "image/jpeg")})
        if response.status_code != 200:
            raise RuntimeError(f"POST /v1/systemone: HTTP {response.status_code}: {response.text[:200]}")
        return response.json()


def walk_request(blocked: bool) -> dict[str, Any]:
    """The walk page's request; `blocked` gates `side` on every `ahead` label, so every frame costs
    what a blocked frame costs (two reads) even on a model that never names a danger."""
    if not blocked:
        return WALK_REQUEST
    questions = dict(WALK_REQUEST["questions"])
    questions["side"] = {**questions["side"], "ask_if": {"ahead": list(questions["ahead"]["criteria"])}}
    return {**WALK_REQUEST, "questions": questions}


def run_frames(url: str, request: dict[str, Any], frames: dict[str, list[bytes]], count: int,
               warmup: int) -> dict[str, Any]:
    """Each transport's frames (`frames`, warmup + count each) in turn, frame by frame."""
    names = ("websocket", "rest")
    seconds: dict[str, list[float]] = {name: [] for name in names}
    decision_ms: dict[str, list[float]] = {name: [] for name in names}
    reads: dict[str, int] = {name: 0 for name in names}
    choices: dict[str, list[str]] = {name: [] for name in names}
    server: dict[str, list[float]] = {"queue_ms": [], "read_ms": [], "total_ms": []}
    with WebsocketTransport(url, request) as websocket, RestTransport(url, request) as rest:
        transports = {"websocket": websocket, "rest": rest}
        for i in range(-warmup, count):
            for name, transport in transports.items():
                frame = frames[name][i + warmup]
                started = time.perf_counter()
                result = transport.decide(frame)
                elapsed = time.perf_counter() - started
                if i < 0:
                    continue
                seconds[name].append(elapsed)
                decision_ms[name].append(result["diagnostics"]["timing"]["total_ms"])
                reads[name] += len(result["diagnostics"]["stages"])
                choices[name].append(result["answers"]["ahead"]["choice"])
                if name == "websocket":
                    for key in server:
                        server[key].append(result["timing"][key])
    out: dict[str, Any] = {}
    for name in names:
        out[name] = {
            **latency_summary(seconds[name]),
            "frames_per_s": len(seconds[name]) / sum(seconds[name]),
            "decision_p50_ms": percentile(decision_ms[name], 50),
            "reads_per_frame": reads[name] / count,
        }
    out["websocket"]["server_timing_p50_ms"] = {key: percentile(values, 50) for key, values in server.items()}
    out["websocket"]["server_timing_p95_ms"] = {key: percentile(values, 95) for key, values in server.items()}
    # The same picture on both (the stamps differ): with random weights a near tie may still go either way.
    out["same_answers_share"] = sum(a == b for a, b in zip(choices["websocket"], choices["rest"])) / count
    return out


def report(results: dict[str, Any], frames: dict[str, list[bytes]], blocked: bool) -> str:
    rows = []
    for name in ("websocket", "rest"):
        r = results[name]
        rows.append([name, fmt(r["p50_ms"], 1), fmt(r["p95_ms"], 1), fmt(r["frames_per_s"], 2),
                     fmt(r["decision_p50_ms"], 1), fmt(r["reads_per_frame"], 2)])
    ws = results["websocket"]
    p50, p95 = ws["server_timing_p50_ms"], ws["server_timing_p95_ms"]
    server_rows = [[key, fmt(p50[key], 1), fmt(p95[key], 1)] for key in ("queue_ms", "read_ms", "total_ms")]
    sizes = [len(frame) for frame in frames["websocket"]]
    asked = ("`side` asked on every frame (--blocked: two reads a frame)" if blocked
             else "the walk page's request (`side` only after a danger label)")
    return "\n".join([
        f"Request: {asked}.",
        f"Frames: new {FRAME_SIZE[0]}x{FRAME_SIZE[1]} JPEGs (quality {JPEG_QUALITY}; {min(sizes) // 1024} to "
        f"{max(sizes) // 1024} KiB), every one sent once; {results['frames']} timed frames per transport; the same "
        f"answer on both transports for {results['same_answers_share']:.0%} of the frames.",
        "",
        "### client-observed, sequential (send a frame, wait for its answer, next)",
        "",
        markdown_table(["transport", "p50 ms/frame", "p95 ms/frame", "frames/s", "decision p50 ms (server)",
                        "reads/frame"], rows),
        "",
        "### websocket: the server's own timing per frame (`result.timing`)",
        "",
        markdown_table(["timing", "p50 ms", "p95 ms"], server_rows),
    ])


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--frames", type=at_least(1), default=40, help="timed frames per transport (default 40)")
    parser.add_argument("--warmup", type=at_least(0), default=3, help="untimed frames per transport first (default 3)")
    parser.add_argument("--blocked", action="store_true",
                        help="ask `side` on every frame (two reads per frame, a blocked frame's cost)")
    parser.add_argument("--torch-threads", type=int, default=None,
                        help="torch intra-op threads for the server (default: usable cores - 1, at least 1)")
    parser.add_argument("--json", dest="json_out", help="also write the results to this JSON file")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    threads = set_torch_threads(args.torch_threads)
    info = machine()
    frames = {name: FrameMaker(f"stream {name}").make(args.warmup + args.frames) for name in ("websocket", "rest")}
    with tiny_server(tiny_checkpoint(), kv_cache_entries=0) as (url, _):
        results = run_frames(url, walk_request(args.blocked), frames, args.frames, args.warmup)
    results["frames"] = args.frames
    print(header("bench_stream: walk-page frames over /v1/stream vs REST (tiny model)", info))
    print()
    print(report(results, frames, args.blocked))
    if args.json_out:
        path = write_json(args.json_out, {
            "machine": info, "model": "tiny random-weight (app/engine/tiny.py)",
            "args": {"frames": args.frames, "warmup": args.warmup, "blocked": args.blocked,
                     "torch_threads": threads, "kv_cache_entries": 0},
            "frame_bytes": {name: [len(frame) for frame in made] for name, made in frames.items()},
            "results": results,
        })
        print(f"\nresults: {path}")


if __name__ == "__main__":
    main()
