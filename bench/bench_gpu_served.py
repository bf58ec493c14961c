"""`djev serve` as users see it: HTTP and websockets, clients in other processes, from the first second
after ready, with the in-process figure of the same request generator beside each row, in one run.

The server is `app.cli.serve` in a subprocess (its own process group; bench/server.py), over random
weights: the full-size DiffusionGemma 26B-A4B architecture on CUDA (bench/models.py's
FULL_TEXT_CONFIG and build_model; in bf16, or FP8 with QUANTIZE=fp8 in the environment: the text
layers' projections and experts made as e4m3 on the device, as quantizing at load would give them),
or the tiny config on the CPU with --tiny. Only the weights are random: the reader is
`hf_reader` over the model, as `djev serve` builds it, and the settings are `Settings.from_env` with
this script's flags as overrides, as `djev serve` reads them (the server's defaults where a flag is
not given). The tokenizer is the tiny model's, as in bench_gpu_decisions.py. A bench-only route,
`POST /bench/inprocess`, runs the same generator against the server's own Decider (no HTTP, no
admission, no session) right after the served row.

Rows, in this order from ready (each --seconds; --workers client processes, asyncio + httpx or
websockets in each; every state and frame unique, frames encoded before the clock):
  (a) every request its own question sheet (1-6 questions, 2-8 options, random instructions);
  (b) one sheet, the README's ticket, at --ticket-clients;
  (c) walk frames over REST: the walk page's request, multipart with the frame;
  (d) cameras over /v1/stream, closed loop like the walk page (next frame when the answer comes);
  (e) cameras at 2 fps, open loop (a frame every 500 ms whatever comes back): answered share, answer
      age (receipt - send of the answered frame), sessions refused at open (1013; a refused camera
      asks again as the walk page does, 2 s, 4 s, ... jittered), answers/s per admitted session over
      the time it was open; `next_frame_ms` in results is honoured as the page does (after the send);
  (f) a burst: a steady ticket client, alone for a fifth of the row, then beside --heavy-copies of
      every heavy kind sent at once (a long state, 255 options x 8 questions, 200 questions, a big think
      budget, steps 8 x samples 32; each copy sends again when answered until the row's seconds end).
      A heavy request waits up to --heavy-timeout (default 120 s, never cut by --deadline) for its
      answer, and the row waits for the last one (the steady
      client sending on), so the row lasts its seconds and the burst's tail, and may end up to
      --heavy-timeout past --deadline. Reported: the steady client's p50/p99/max alone and beside the
      heavy requests; per heavy kind, the requests sent, answered, timed out at the client and refused
      (by status), their p50 and max; whether the burst was answered in full. A heavy request the
      server refuses is recorded, not fatal.
Before and after each row /metrics is read and the deltas of the engine counters whose names hold
capture, compile, fallback, recompile, graph or retries are reported, so a compile after ready (or the
allocator freeing its cache to find memory) shows. Right after ready the server's compile counts are
printed (the reader's `compile_counts` through `GET /bench/compile-counts`, the graphs by kind from
/metrics), and at the end its after-ready counters (djev_hf_*_after_ready; a WARNING line names
any that is not 0). Each row ends by checking that the KV store's blocks in use
(djev_hf_kv_blocks_used) are back to their resting count, the value read before the row once the
server was idle (cached and pinned blocks may stay): `blocks_used_before` and `blocks_used_after` in
the row, a line when they are not (None where there is no count: another engine).

Output: the markdown tables (printed, and $OUT/bench_gpu_served.md), $OUT/bench_gpu_served.json,
$OUT/camera_curve.png (row e), and the server's log $OUT/bench_gpu_served.server.log.

    python bench/bench_gpu_served.py            # full run on CUDA (about 7-9 minutes with start-up)
    python bench/bench_gpu_served.py --quick    # fewer levels, 5 s rows: within 4 minutes
    python bench/bench_gpu_served.py --rows f --no-stages --heavy-copies 4   # the burst alone
    python bench/bench_gpu_served.py --tiny --device cpu --seconds 1 --workers 4 --sheet-clients 2 \\
        --ticket-clients 2 --walk-clients 2 --closed-cameras 1 --open-cameras 1,2   # CPU smoke test
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import multiprocessing
import os
import signal
import sys
import time
from dataclasses import dataclass
from multiprocessing.connection import wait as wait_any
from pathlib import Path
from typing import Any, Callable, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (  # noqa: E402
    after_ready_lines,
    after_ready_metrics,
    fmt,
    header,
    latency_summary,
    machine,
    markdown_table,
    numbers,
    percentile,
    write_json,
)
from bench.models import random_weights  # noqa: E402
from bench.served_load import (  # noqa: E402
    FRESH_S,
    HEAVY_KINDS,
    auth_headers,
    merge,
    shares,
    worker_main,
)
from bench.server import (  # noqa: E402
    RandomServe,
    Server,
    compile_report,
    compile_report_lines,
    engine_of,
    read_metrics,
    spawn_random,
    wait_ready,
)

COUNTER_WORDS = ("capture", "compile", "fallback", "recompile", "graph", "retries")
# The engine's work in a row (its turns, the canvases they read, the prompts found whole in the KV
# store, the prompt tokens written, its busy time): kept apart from the counters above, in each row's
# `engine` and the report's engine table. An engine turn that wrote prompt KV counts as an encoder
# pass, one that read canvases as a decoder pass (app/engine/hf/engine.py).
WORK_STATS = ("decoder_passes", "decoder_rows", "encoder_passes", "vision_passes", "kv_hits", "kv_misses",
              "flat_prompt_tokens", "busy_ms", "flat_turn_count", "flat_turn_ms")
ROW_OVERHEAD_S = 6.0  # frames, the end's grace, the scrapes: what a row costs beyond its seconds, for the deadline
KV_GAUGE = "djev_hf_kv_blocks_used"  # the flat turn's KV store: blocks referenced by a read or generation
KV_SETTLE_S = 5.0  # how long a row's end waits for the blocks in use to come back to their resting count
now = time.monotonic


class Deadline(Exception):
    """--deadline passed: stop, clean up, write what there is."""


# ---------------------------------------------------------------------------------------- the server

def served(args: argparse.Namespace) -> RandomServe:
    """The server this run measures: random weights, this script's flags (None: the server's default)."""
    return RandomServe(args.tiny, args.device, args.compile, args.fused_moe, args.cuda_graphs)


def scrape(server: Server, words: Sequence[str] = (*COUNTER_WORDS, *WORK_STATS)) -> dict[str, float]:
    """The engine counters of /metrics whose names hold one of `words`, by series (`picked` keeps
    a subset's)."""
    return {key: value for key, value in picked(read_metrics(server.url), words).items()
            if not key.split("{", 1)[0].endswith("_created")}


def picked(series: dict[str, float], words: Sequence[str]) -> dict[str, float]:
    return {key: value for key, value in series.items() if any(word in key.split("{", 1)[0] for word in words)}


def deltas(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {key: value - before.get(key, 0.0) for key, value in after.items() if value != before.get(key, 0.0)}


def drain_sessions(server: Server, api_key: str, timeout: float = 5.0) -> None:
    """Wait (briefly) for the last row's camera sessions to close on the server."""
    import httpx

    limit = now() + timeout
    while now() < limit:
        try:
            if httpx.get(server.url + "/health", headers=auth_headers(api_key), timeout=2.0).json().get("sessions") == 0:
                return
        except (httpx.HTTPError, ValueError):
            return
        time.sleep(0.1)


def kv_blocks_used(series: dict[str, float]) -> tuple[float | None, str]:
    """The KV store's blocks in use in /metrics `series` (KV_GAUGE): (the count, "") or (None, why
    there is none). Before the engine's first turn the gauge is not exported yet and the store holds
    nothing: 0."""
    if not series:
        return None, "/metrics did not answer"
    engine = engine_of(series)
    if engine != "hf":
        return None, f"the {engine} engine keeps no KV blocks gauge ({KV_GAUGE})"
    if KV_GAUGE in series:
        return series[KV_GAUGE], ""
    if not series.get("djev_hf_flat_turn_count_total"):
        return 0.0, ""  # no engine turn has run: no block was ever taken
    return None, f"{KV_GAUGE} is missing from /metrics though engine turns ran"


class BlocksCheck:
    """Each row ends with the KV store's blocks in use back at their resting count: `resting` reads
    the count before a row once the server is idle (no decision in flight, nothing queued), `settled`
    waits up to KV_SETTLE_S after it for the count to come back (cached and pinned blocks may stay:
    they are not in use). Where there is no count (not hf, the gauge missing) it says why once, in
    `notes`."""

    def __init__(self, server: Server, notes: list[str], settle_s: float = KV_SETTLE_S) -> None:
        self.server = server
        self.notes = notes
        self.settle_s = settle_s
        self.said: set[str] = set()

    def _poll(self, back_to: float | None) -> tuple[float | None, str]:
        """The blocks in use once the server is idle and (given `back_to`) they are back at or below
        it, or as they are after `settle_s`; and "" or what was still running then."""
        limit = now() + self.settle_s
        while True:
            series = read_metrics(self.server.url)
            used, why = kv_blocks_used(series)
            if used is None:
                if why not in self.said:
                    self.said.add(why)
                    note = f"KV blocks not checked: {why}; blocks_used_before/after recorded as None"
                    self.notes.append(note)
                    print(f"    {note}", flush=True)
                return None, ""
            in_flight, queued = series.get("djev_in_flight", 0.0), series.get("djev_queue_depth", 0.0)
            if not in_flight and not queued and (back_to is None or used <= back_to):
                return used, ""
            if now() >= limit:
                return used, f"{in_flight:g} decision(s) still in flight, {queued:g} queued" if in_flight or queued \
                    else "the server idle"
            time.sleep(0.1)

    def resting(self) -> float | None:
        """The blocks in use before a row, once the server is idle (or after KV_SETTLE_S)."""
        return self._poll(None)[0]

    def settled(self, label: str, resting: float | None) -> dict[str, float | None]:
        """After a row: the blocks in use once back at `resting` (or after KV_SETTLE_S), as the row's
        `blocks_used_before` and `blocks_used_after`; a line (printed, and in `notes`) when not back."""
        after, busy = self._poll(resting) if resting is not None else (None, "")
        if after is None:
            return {"blocks_used_before": None, "blocks_used_after": None}
        assert resting is not None
        if after > resting:
            line = (f"KV BLOCKS NOT BACK after {label}: {after:g} blocks in use {self.settle_s:g} s after the row "
                    f"({busy}), {resting:g} at rest before it ({KV_GAUGE})")
            self.notes.append(line)
            print(f"    {line}", flush=True)
        return {"blocks_used_before": resting, "blocks_used_after": after}


# ---------------------------------------------------------------------------------------- client processes

class ClientPool:
    """--workers client processes (spawn); each runs its share of a row's clients."""

    generation = 0

    def __init__(self, count: int) -> None:
        self.count = count
        self.conns: list[Any] = []
        self.processes: list[Any] = []
        self.heavy_left: Any = None  # row (f)'s heavy clients still running, across the processes
        self.start()

    def start(self) -> None:
        ClientPool.generation += 1
        context = multiprocessing.get_context("spawn")
        self.conns, self.processes = [], []
        self.heavy_left = context.Value("i", 0)
        for index in range(self.count):
            parent, child = context.Pipe()
            process = context.Process(target=worker_main, daemon=True, name=f"bench-client-{index}",
                                      args=(child, index, f"g{ClientPool.generation}w{index}", self.heavy_left))
            process.start()
            child.close()
            self.conns.append(parent)
            self.processes.append(process)

    def pids(self) -> list[int]:
        return [process.pid for process in self.processes if process.pid]

    def collect(self, expect: str, timeout: float) -> list[Any]:
        results: dict[int, Any] = {}
        limit = now() + timeout
        while len(results) < len(self.conns):
            waiting = [conn for index, conn in enumerate(self.conns) if index not in results]
            ready = wait_any(waiting, timeout=max(0.0, limit - now()))
            if not ready:
                raise RuntimeError(f"client processes did not answer '{expect}' in {timeout:.0f} s")
            for conn in ready:
                index = self.conns.index(conn)
                try:
                    kind, payload = conn.recv()
                except (EOFError, OSError):
                    raise RuntimeError(f"client process {index} died") from None
                if kind == "failed":
                    raise RuntimeError(f"client process {index} failed:\n{payload}")
                results[index] = payload
        return [results[index] for index in range(len(self.conns))]

    def run(self, specs: Sequence[dict[str, Any]], timeout: float) -> list[dict[str, Any]]:
        """One row: every process prepares (frames), then all start at one moment; their tallies."""
        self.heavy_left.value = sum(len(spec.get("heavy", ())) for spec in specs)
        for conn, spec in zip(self.conns, specs):
            conn.send(spec)
        self.collect("prepared", 180.0)
        start = now() + 0.5  # every process is waiting on its pipe: they start together
        for conn in self.conns:
            conn.send(start)
        return self.collect("done", timeout)

    def restart(self) -> None:
        """Fresh processes (after a row that failed: the old ones may be anywhere in a row)."""
        self.close()
        self.start()

    def close(self) -> None:
        for conn in self.conns:
            try:
                conn.send(None)
            except OSError:
                pass
        for process in self.processes:
            process.join(timeout=5)
            if process.is_alive():
                process.terminate()
                process.join(timeout=5)
            if process.is_alive():
                process.kill()
                process.join(timeout=5)


# ---------------------------------------------------------------------------------------- rows

@dataclass(frozen=True)
class Row:
    key: str  # a..f
    name: str
    kind: str  # rest, camera_closed, camera_open, steady
    clients: int
    request: str = ""  # rest: sheets, ticket, walk
    twin: str = ""  # the in-process workload, "" for none
    switch_ms: float | None = None  # the server's switch interval for this row (--switch-intervals)
    gather_rows: int | None = None  # the server's BATCH_GATHER_ROWS for this row (--gather-rows)
    headroom: float | None = None  # the camera pacer's SESSION_HEADROOM for this row (--session-headroom)


ROW_KEYS = ("a", "b", "c", "d", "e", "f")


def plan(args: argparse.Namespace) -> list[Row]:
    rows = [Row("a", "own question sheet each request", "rest", n, "sheets", "sheets") for n in args.sheet_clients]
    rows += [Row("b", "one sheet (the ticket)", "rest", n, "ticket", "ticket") for n in args.ticket_clients]
    rows += [Row("c", "walk frames over REST (multipart)", "rest", n, "walk", "walk") for n in args.walk_clients]
    rows += [Row("d", "cameras, closed loop (/v1/stream)", "camera_closed", n, twin="walk") for n in args.closed_cameras]
    rows += [Row("e", "cameras at 2 fps (/v1/stream)", "camera_open", n, twin="cameras_open") for n in args.open_cameras]
    if args.steady:
        rows.append(Row("f", "steady ticket client beside heavy requests", "steady",
                        1 + len(HEAVY_KINDS) * args.heavy_copies))
    if args.rows:
        rows = [row for row in rows if row.key in args.rows]
    # Each row once per interval (and gather cap), one after the other, so the runs of an A/B meet
    # the same host and caches.
    if args.switch_intervals:
        rows = [dataclasses.replace(row, name=f"{row.name}, switch interval {ms:g} ms", switch_ms=ms)
                for row in rows for ms in args.switch_intervals]
    if args.gather_rows:
        rows = [dataclasses.replace(row, name=f"{row.name}, gather rows {cap}", gather_rows=cap)
                for row in rows for cap in args.gather_rows]
    if args.session_headroom:
        rows = [dataclasses.replace(row, name=f"{row.name}, headroom {share:g}", headroom=share)
                for row in rows for share in args.session_headroom]
    return rows


def heavy_assignment(kinds: Sequence[str], copies: int, workers: int) -> list[list[str]]:
    """Row (f)'s heavy clients by client process: every kind `copies` times, dealt round the processes
    after the first (the steady client has process 0 to itself where there are two or more), a kind's
    copies on different processes where there are enough."""
    heavy: list[list[str]] = [[] for _ in range(workers)]
    for index, kind in enumerate(kind for _ in range(copies) for kind in kinds):
        heavy[1 + index % (workers - 1) if workers > 1 else 0].append(kind)
    return heavy


def heavy_wait_s(args: argparse.Namespace) -> float:
    """How far past --deadline the run may go: row (f)'s heavy requests each wait up to --heavy-timeout
    (never cut, so runs of different settings wait alike) and the row waits for the last
    (plus the clients' grace); 0 where row (f) does not run."""
    steady = any(row.kind == "steady" for row in plan(args))
    return args.heavy_timeout + 3.0 + 5.0 if steady else 0.0  # the clients' grace past it, the cancelled ones' wait


def worker_specs(row: Row, number: int, args: argparse.Namespace, url: str, api_key: str,
                 heavy_timeout: float = 0.0) -> list[dict[str, Any]]:
    """Each client process's share of a row; row (f)'s heavy requests wait up to `heavy_timeout` s."""
    workers = args.workers
    common = {"kind": row.kind, "seconds": args.seconds, "base_url": url, "api_key": api_key, "request": row.request}
    if row.kind != "steady":
        return [{**common, "clients": n, "tag": f"r{number}w{index}"} for index, n in enumerate(shares(row.clients, workers))]
    heavy = heavy_assignment(HEAVY_KINDS, args.heavy_copies, workers)
    params = {"state_tokens": args.heavy_tokens, "think": args.heavy_think}
    return [{**common, "clients": len(heavy[index]) + (index == 0), "tag": f"r{number}w{index}", "steady": index == 0,
             "heavy": heavy[index], "alone_s": args.seconds / 5, "heavy_timeout_s": heavy_timeout, "params": params}
            for index in range(workers)]


def ms(seconds: Sequence[float]) -> dict[str, float]:
    summary = latency_summary(seconds)
    summary["p99_ms"] = round(percentile([s * 1000 for s in seconds], 99), 3) if seconds else float("nan")
    return summary


def closed_summary(tally: dict[str, Any]) -> dict[str, Any]:
    elapsed = tally["elapsed"] or float("nan")
    return {"requests": len(tally["latencies"]), "per_s": len(tally["latencies"]) / elapsed, **ms(tally["latencies"]),
            "errors": tally["errors"], "counts": tally["counts"], "elapsed_s": round(tally["elapsed"], 2)}


def heavy_summary(tally: dict[str, Any]) -> dict[str, Any]:
    """A heavy kind's requests in row (f): the closed-loop figures, and how each request sent ended:
    answered (200), timed out at the client, refused (by status), or otherwise (an exception, cancelled
    at the row's end)."""
    sent = tally["counts"].get("sent", 0)
    answered = len(tally["latencies"])
    timed_out = tally["errors"].get("timeout", 0)
    refused = {key: count for key, count in tally["errors"].items() if key.isdigit()}
    return {**closed_summary(tally), "sent": sent, "answered": answered, "timed_out": timed_out, "refused": refused,
            "other": sent - answered - timed_out - sum(refused.values())}


def burst_summary(heavy: dict[str, dict[str, Any]], kinds: Sequence[str]) -> dict[str, Any]:
    """Row (f)'s burst over every heavy kind (`heavy`: heavy_summary by kind): the requests sent and
    how they ended, the kinds never sent, and whether it was answered in full (every kind sent, every
    request sent answered)."""
    totals = {key: sum(q[key] for q in heavy.values()) for key in ("sent", "answered", "timed_out", "other")}
    refused = sum(sum(q["refused"].values()) for q in heavy.values())
    not_sent = [kind for kind in kinds if not heavy.get(kind, {}).get("sent")]
    return {**totals, "refused": refused, "kinds_not_sent": not_sent,
            "in_full": not not_sent and totals["sent"] > 0 and totals["answered"] == totals["sent"]}


def burst_line(burst: dict[str, Any], timeout: float) -> str:
    """The report's sentence on row (f)'s burst (`timeout`: each heavy request's, --heavy-timeout)."""
    said = (f"{burst['answered']} of {burst['sent']} heavy requests answered (client timeout {timeout:g} s); "
            f"{burst['timed_out']} timed out, {burst['refused']} refused, {burst['other']} failed otherwise")
    if burst["in_full"]:
        return f"the burst was answered in full: every heavy kind sent, {said}"
    missing = f"; kinds never sent: {', '.join(burst['kinds_not_sent'])}" if burst["kinds_not_sent"] else ""
    return f"the burst was NOT answered in full: {said}{missing}"


def knob_note(row: dict[str, Any]) -> str:
    """The A/B knobs a row ran under (--switch-intervals, --gather-rows, --session-headroom), for a
    table cell; "" for none."""
    knobs = [f"{label} {row[key]:g}" for key, label in (("switch_ms", "switch ms"), ("gather_rows", "gather rows"),
                                                         ("headroom", "headroom")) if row.get(key) is not None]
    return f" ({', '.join(knobs)})" if knobs else ""


def camera_summary(tally: dict[str, Any], seconds: float, admitted: int | None = None) -> dict[str, Any]:
    counts = tally["counts"]
    sent = counts.get("frames sent", 0)
    answers = counts.get("answers", 0)
    admitted = counts.get("admitted", 0) if admitted is None else admitted
    ages = tally["ages"]
    return {
        "admitted": admitted, "refused_1013": counts.get("refused (1013)", 0), "frames_sent": sent,
        "frames_per_s": sent / seconds, "answers": answers, "answers_per_s": answers / seconds,
        # per session over the time it was open (a camera admitted on a retry is open for less)
        "answers_per_s_per_session": (answers / (counts["session ms"] / 1000) if counts.get("session ms")
                                      else answers / seconds / admitted if admitted else float("nan")),
        "answered_share": answers / sent if sent else float("nan"),
        "fresh_share": sum(1 for age in ages if age <= FRESH_S) / sent if sent else float("nan"),
        "age": ms(ages),
        # the answer's age plus the next_frame_ms sent with it: what the walk page's 1.5 s guard bounds
        "age_plus_next": ms(tally.get("guards") or []),
        "next_frame_ms_seen": counts.get("next_frame_ms seen", 0), "errors": tally["errors"], "counts": counts,
    }


def twin(server: Server, api_key: str, row: Row, clients: int, seconds: float, number: int,
         frames_per_client: int) -> dict[str, Any]:
    import httpx

    response = httpx.post(server.url + "/bench/inprocess", headers=auth_headers(api_key), timeout=seconds + 180,
                          json={"workload": row.twin, "clients": clients, "seconds": seconds, "tag": number,
                                "frames_per_client": frames_per_client})
    response.raise_for_status()
    return response.json()


def set_knob(server: Server, api_key: str, path: str, body: dict[str, Any]) -> None:
    """One of the server's bench knobs (`bench_routes`: the switch interval, the gather cap, the
    camera pacer's headroom) set for
    the row about to run."""
    import httpx

    response = httpx.post(server.url + path, headers=auth_headers(api_key), json=body, timeout=10)
    response.raise_for_status()


def run_row(row: Row, number: int, args: argparse.Namespace, server: Server, pool: ClientPool,
            api_key: str, deadline: float, blocks: BlocksCheck | None = None) -> dict[str, Any]:
    """One row: its served clients, then its in-process twin; with `blocks`, the KV store's blocks in
    use read before it (idle) and checked back at that count after it."""
    out: dict[str, Any] = {"row": row.key, "name": row.name, "kind": row.kind, "clients": row.clients}
    wait = 0.0  # row (f): how long a heavy request may wait for its answer (--heavy-timeout, never cut)
    if row.kind == "steady":
        wait = args.heavy_timeout
        out["heavy_timeout_s"], out["heavy_copies"] = wait, args.heavy_copies
    if row.switch_ms is not None:
        set_knob(server, api_key, "/bench/switch-interval", {"ms": row.switch_ms})
        out["switch_ms"] = row.switch_ms
    if row.gather_rows is not None:
        set_knob(server, api_key, "/bench/gather-rows", {"rows": row.gather_rows})
        out["gather_rows"] = row.gather_rows
    if row.headroom is not None:
        set_knob(server, api_key, "/bench/session-headroom", {"headroom": row.headroom})
        out["headroom"] = row.headroom
    resting = blocks.resting() if blocks is not None else None
    before = scrape(server)
    tallies = pool.run(worker_specs(row, number, args, server.url, api_key, wait), args.seconds + wait + 60.0)
    after = scrape(server)
    out["counters"] = deltas(picked(before, COUNTER_WORDS), picked(after, COUNTER_WORDS))
    out["engine"] = deltas(picked(before, WORK_STATS), picked(after, WORK_STATS))
    names = sorted({name for tally in tallies for name in tally})
    merged = {name: merge([tally[name] for tally in tallies if name in tally]) for name in names}
    if row.kind == "camera_open":
        out["served"] = camera_summary(merged["main"], args.seconds)
    elif row.kind == "steady":
        out["phases"] = {name: closed_summary(tally) for name, tally in merged.items() if name.startswith("steady")}
        out["heavy"] = {name[len("heavy: "):]: heavy_summary(tally) for name, tally in merged.items()
                        if name.startswith("heavy: ")}
        out["burst"] = {**burst_summary(out["heavy"], HEAVY_KINDS),
                        "elapsed_s": max((q["elapsed_s"] for q in out["phases"].values()), default=0.0)}
    else:
        out["served"] = closed_summary(merged["main"])
    if not server.alive():
        raise RuntimeError(f"the server died during row {row.key}:\n{server.log_tail()}")
    if row.kind.startswith("camera"):
        drain_sessions(server, api_key)
    if row.twin:
        clients = row.clients
        if row.kind == "camera_open":
            clients = out["served"]["admitted"] or row.clients  # the sessions the server took
            out["twin_clients"] = clients
        # Frames for the twin: what a served client used, scaled to the twin's seconds, with room to
        # spare (encoding the served rows' generous budget in the server would take seconds).
        served_per_client = out["served"].get("requests", 0) / max(1, row.clients)
        frames_per_client = math.ceil(2 * served_per_client * args.twin_seconds / args.seconds) + 8
        before = scrape(server, COUNTER_WORDS)
        tally = twin(server, api_key, row, clients, args.twin_seconds, number, frames_per_client)
        out["twin_counters"] = deltas(before, scrape(server, COUNTER_WORDS))
        out["twin"] = camera_summary(tally, args.twin_seconds, clients) if row.kind == "camera_open" \
            else closed_summary(tally)
    if blocks is not None:
        out.update(blocks.settled(f"row ({row.key}) {row.name}, {row.clients} clients", resting))
    return out


def measure(args: argparse.Namespace, server: Server, pool: ClientPool, results: dict[str, Any], deadline: float,
            api_key: str) -> None:
    blocks = BlocksCheck(server, results["notes"])
    for number, row in enumerate(plan(args)):
        label = f"({row.key}) {row.name}, {row.clients} {'cameras' if row.kind.startswith('camera') else 'clients'}"
        need = args.seconds + (args.twin_seconds if row.twin else 0.0) + ROW_OVERHEAD_S
        if now() + need > deadline:
            results["notes"].append(f"skipped {label}: --deadline")
            print(f"  skipped {label}: the deadline is {deadline - now():.0f} s away", flush=True)
            continue
        print(f"  {label} ...", flush=True)
        try:
            point = run_row(row, number, args, server, pool, api_key, deadline, blocks)
        except Exception as exc:  # noqa: BLE001 - one failed row is recorded; the next rows still run
            results["notes"].append(f"{label} failed: {type(exc).__name__}: {str(exc)[:1500]}")
            print(f"  {label} failed: {type(exc).__name__}: {exc}", flush=True)
            if not server.alive():
                raise RuntimeError(f"the server died:\n{server.log_tail()}") from None
            pool.restart()
            continue
        results["rows"].append(point)
        print("    " + one_line(point), flush=True)


def one_line(point: dict[str, Any]) -> str:
    return row_line(point) + blocks_note(point)


def blocks_note(point: dict[str, Any]) -> str:
    """The row's KV blocks in use before and after it, for its printed line ("" where not checked)."""
    before, after = point.get("blocks_used_before"), point.get("blocks_used_after")
    if before is None or after is None:
        return ""
    return f"; KV blocks in use {before:g} -> {after:g}{'' if after <= before else ' (NOT BACK)'}"


def row_line(point: dict[str, Any]) -> str:
    if point["kind"] == "steady":
        burst = point["burst"]
        return "; ".join(f"{name}: p50 {fmt(p['p50_ms'], 0)} ms, p99 {fmt(p['p99_ms'], 0)} ms, max {fmt(p['max_ms'], 0)} ms"
                         for name, p in point["phases"].items()) + (
            f"; heavy answered {burst['answered']} of {burst['sent']}{'' if burst['in_full'] else ' (not in full)'}")
    served = point["served"]
    if point["kind"] == "camera_open":
        return (f"answered {fmt(served['answered_share'] * 100, 0)} %, age p50 {fmt(served['age']['p50_ms'], 0)} ms, "
                f"refused {served['refused_1013']}; counters {point['counters'] or 'none'}")
    return (f"{fmt(served['per_s'], 1)}/s, p50 {fmt(served['p50_ms'], 0)} ms, p99 {fmt(served['p99_ms'], 0)} ms; "
            f"in-process {fmt(point.get('twin', {}).get('per_s', float('nan')), 1)}/s; counters {point['counters'] or 'none'}")


# ---------------------------------------------------------------------------------------- report

NOTED_COUNTS = ("cancelled at the end", "late frames")  # counts a row's errors cell shows beside the errors


def errors_cell(errors: dict[str, int], counts: dict[str, int] | None = None) -> str:
    noted = {key: value for key, value in (counts or {}).items() if key in NOTED_COUNTS and value}
    return ", ".join(f"{key}: {count}" for key, count in sorted({**errors, **noted}.items())) or "-"


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if a == a and b == b and b else "-"


def memory_line(log_path: Path) -> str:
    """The server log's split of the GPU's memory at start (the weights', the graphs' and the KV
    store's GiB: `MemorySplit.line`), or "" where it logged none (the CPU)."""
    try:
        text = log_path.read_text(errors="replace")
    except OSError:
        return ""
    found = [line.split(": ", 1)[-1] for line in text.splitlines() if "GPU memory" in line and "weights" in line]
    return found[-1] if found else ""


def report(results: dict[str, Any]) -> str:
    startup = results.get("startup") or {}
    settings = results.get("settings") or {}
    lines = [
        f"start-up: spawn to the first /health answer {startup.get('first_answer_s', '-')} s "
        f"(HTTP {startup.get('first_status', '-')}), to ready (200) {startup.get('ready_s', '-')} s; "
        f"rows of {results['args']['seconds']:g} s (in-process twins {results['args']['twin_seconds']:g} s), "
        f"{results['args']['workers']} client processes; settings: "
        + ", ".join(f"{key} {value}" for key, value in settings.items())
        + f"; camera sessions at most {(startup.get('health') or {}).get('max_sessions', '-')} (/health)",
        *([f"memory at ready: {startup['memory']}"] if startup.get("memory") else []),
        "",
    ]
    built = results.get("compile_counts_at_ready")
    if built:
        lines += compile_report_lines(built, "the server at ready") + [""]
    if results.get("after_ready"):
        lines += after_ready_lines(results["after_ready"], "the server at the end") + [""]
    restart = results.get("restart")
    if restart:
        lines += [f"restart over the first start's compile caches: the first /health answer {restart.get('first_answer_s')} "
                  f"s (HTTP {restart.get('first_status')}), ready (200) {restart.get('ready_s')} s", ""]
    closed = [p for p in results["rows"] if p["kind"] in ("rest", "camera_closed")]
    if closed:
        rows = []
        for p in closed:
            s, t = p["served"], p.get("twin") or {}
            nan = float("nan")
            rows.append([f"({p['row']}) {p['name']}", p["clients"], fmt(s["per_s"], 1), fmt(s["p50_ms"], 0),
                         fmt(s["p95_ms"], 0), fmt(s["p99_ms"], 0), errors_cell(s["errors"], s["counts"]),
                         fmt(t.get("per_s", nan), 1),
                         fmt(t.get("p50_ms", nan), 0), fmt(t.get("p95_ms", nan), 0), fmt(t.get("p99_ms", nan), 0),
                         f"{ratio(s['per_s'], t.get('per_s', nan))} /s; {ratio(s['p50_ms'], t.get('p50_ms', nan))} p50"])
        lines += ["closed loops (requests, or camera frames, a second; latencies in ms):", "", markdown_table(
            ["row", "clients", "served /s", "p50", "p95", "p99", "errors / notes", "in-process /s", "p50", "p95", "p99",
             "served / in-process"], rows), ""]
    cameras = [p for p in results["rows"] if p["kind"] == "camera_open"]
    if cameras:
        rows = []
        for p in cameras:
            s, t = p["served"], p.get("twin") or {}
            hint = f"honoured ({s['next_frame_ms_seen']} results)" if s["next_frame_ms_seen"] else "not sent"
            twin_age = (t.get("age") or {})
            guard = s.get("age_plus_next") or {}
            rows.append([f"{p['clients']}{knob_note(p)}", s["admitted"], s["refused_1013"], fmt(s["frames_per_s"], 1),
                         fmt(s["answers_per_s"], 1), fmt(s["answers_per_s_per_session"], 2),
                         fmt(s["answered_share"] * 100, 0) + " %", fmt(s["fresh_share"] * 100, 0) + " %",
                         fmt(s["age"]["p50_ms"], 0), fmt(s["age"]["p95_ms"], 0), fmt(s["age"]["p99_ms"], 0),
                         fmt(guard.get("p95_ms", float("nan")), 0), errors_cell(s["errors"], s["counts"]),
                         f"{p.get('twin_clients', '-')}: {fmt(t.get('answered_share', float('nan')) * 100, 0)} %, "
                         f"{fmt(twin_age.get('p50_ms', float('nan')), 0)} / {fmt(twin_age.get('p95_ms', float('nan')), 0)}",
                         hint])
        lines += [f"(e) cameras at 2 fps, open loop (answered = answers / frames sent; fresh = answered within "
                  f"{FRESH_S:g} s, what the walk page shows; age in ms, receipt - send of the answered frame):", "",
                  markdown_table(["cameras", "admitted", "refusals (1013)", "frames/s sent", "answers/s",
                                  "answers/s per session", "answered", "fresh", "age p50", "p95", "p99",
                                  "age + next_frame_ms p95", "errors / notes",
                                  "in-process (cameras: answered, age p50 / p95)", "next_frame_ms"], rows), ""]
    for p in (p for p in results["rows"] if p["kind"] == "steady"):
        rows = [[name, q["requests"], fmt(q["p50_ms"], 0), fmt(q["p99_ms"], 0), fmt(q["max_ms"], 0),
                 errors_cell(q["errors"], q["counts"])] for name, q in p["phases"].items()]
        heavy = [[name, q["sent"], q["answered"], q["timed_out"],
                  ", ".join(f"{status}: {count}" for status, count in sorted(q["refused"].items())) or "-",
                  fmt(q["p50_ms"], 0), fmt(q["max_ms"], 0),
                  errors_cell({k: v for k, v in q["errors"].items() if k != "timeout" and not k.isdigit()},
                              {k: v for k, v in q["counts"].items() if k != "sent"})]
                 for name, q in sorted(p["heavy"].items())]
        lines += [f"(f) {p['name']}: the steady client alone for the first fifth of the row's seconds, then beside "
                  f"{p['heavy_copies']} of each heavy kind sent at once (each sending again when answered until the "
                  f"row's seconds end) until every heavy request is answered or timed out, "
                  f"{fmt(p['burst']['elapsed_s'], 1)} s in all (ms):", "",
                  markdown_table(["steady client", "requests", "p50", "p99", "max", "errors / notes"], rows), "",
                  markdown_table(["heavy kind", "sent", "answered", "timed out", "refused (status)", "p50", "max",
                                  "errors / notes"], heavy), "",
                  burst_line(p["burst"], p["heavy_timeout_s"]), ""]
    counters = [[f"({p['row']}) {p['clients']}", counters_cell(p.get("counters")),
                 counters_cell(p.get("twin_counters")) if "twin" in p else "-"] for p in results["rows"]]
    if counters:
        lines += [f"engine counters that moved during each row (/metrics series naming {', '.join(COUNTER_WORDS)}):", "",
                  markdown_table(["row", "served", "in-process"], counters), ""]
    blocks = [[f"({p['row']}) {p['clients']}{knob_note(p)}", f"{p['blocks_used_before']:g}", f"{p['blocks_used_after']:g}",
               "yes" if p["blocks_used_after"] <= p["blocks_used_before"] else "NO"]
              for p in results["rows"] if p.get("blocks_used_before") is not None and p.get("blocks_used_after") is not None]
    if blocks:
        lines += [f"the KV store's blocks in use ({KV_GAUGE}) before each row, the server idle, and after it, settled "
                  f"(up to {KV_SETTLE_S:g} s):", "",
                  markdown_table(["row", "before", "after", "back"], blocks), ""]
    work = [engine_row(p, results["args"]["seconds"]) for p in results["rows"] if p.get("engine")]
    if work:
        lines += ["the engine's work in each served row (/metrics deltas; turns that read canvases, and their "
                  "canvases a turn; turns that wrote prompt KV, and the prompt tokens written; prompts found whole "
                  "in the KV store):", "",
                  markdown_table(["row", "canvas turns", "canvases a turn", "prompt turns", "prompt tokens written",
                                  "vision passes", "KV store hits / misses", "busy share", "mean turn ms"], work), ""]
    if results.get("stages"):
        lines += stages_table(results["stages"])
    if results["notes"]:
        lines += ["notes:", ""] + [f"- {note}" for note in results["notes"]]
    return "\n".join(lines)


def engine_row(point: dict[str, Any], row_seconds: float) -> list[Any]:
    def stat(name: str) -> float:
        return sum(value for key, value in point["engine"].items() if key.split("{", 1)[0].endswith(f"_{name}_total"))

    passes = stat("decoder_passes")
    seconds = (point.get("served") or point.get("burst") or {}).get("elapsed_s") or row_seconds
    busy = stat("busy_ms") / 1000 / seconds if seconds else float("nan")
    per_pass = stat("decoder_rows") / passes if passes else float("nan")
    return [f"({point['row']}) {point['clients']}", f"{passes:g}", fmt(per_pass, 1),
            f"{stat('encoder_passes'):g}", f"{stat('flat_prompt_tokens'):g}", f"{stat('vision_passes'):g}",
            f"{stat('kv_hits'):g} / {stat('kv_misses'):g}", fmt(busy, 2), mean_turn(stat, "flat")]


def mean_turn(stat: Callable[[str], float], kind: str) -> str:
    """The mean engine turn of `kind` over a row, from the reader's `<kind>_turn_count/_ms` ("-": none)."""
    count = stat(f"{kind}_turn_count")
    return fmt(stat(f"{kind}_turn_ms") / count, 0) if count else "-"


def counters_cell(moved: dict[str, float] | None) -> str:
    if moved is None:
        return "-"
    return ", ".join(f"{key} +{value:g}" for key, value in sorted(moved.items())) or "none"


def camera_plot(results: dict[str, Any], path: Path) -> Path | None:
    from bench.plot import Panel, Series, plot_panels

    points = [p for p in results["rows"] if p["kind"] == "camera_open"]
    if not points:
        return None
    knobs = knob_note(points[0])  # under A/B knobs, the curve of their first values
    points = [p for p in points if knob_note(p) == knobs]
    xs = [p["clients"] for p in points]
    served = [p["served"] for p in points]
    return plot_panels(path, f"djev serve: cameras at 2 fps over /v1/stream{knobs}", "cameras", xs, [
        Panel("answer age, ms", [Series("p50", [s["age"]["p50_ms"] for s in served]),
                                 Series("p95", [s["age"]["p95_ms"] for s in served])]),
        Panel("share", [Series("cameras admitted", [s["admitted"] / max(1, p["clients"]) for s, p in zip(served, points)]),
                        Series("frames answered", [s["answered_share"] for s in served]),
                        Series(f"answered within {FRESH_S:g} s", [s["fresh_share"] for s in served])],
              y_max=1.0),
    ])


# ---------------------------------------------------------------------------------------- main

# How long past --deadline a --restart may wait for the second start to be ready.
RESTART_S = 170.0
# Row (f): how long each heavy request may wait for its answer (--heavy-timeout), the server's
# REQUEST_TIMEOUT by default. Never cut to fit --deadline: an A/B of two settings waits alike (a cut
# made it 5 s on one side and 32 s on the other in one run).
HEAVY_TIMEOUT_S = 120.0
# The workloads whose engine stages are timed after the rows (in process: `POST /bench/stages`).
STAGE_RUNS = (("walk", 16), ("ticket", 32))


def time_stages(args: argparse.Namespace, server: Server, results: dict[str, Any], deadline: float,
                api_key: str) -> None:
    """Where the engine's time goes in the walk and ticket loops: each run in process for
    --twin-seconds with the hf runner's stages timed between device syncs (bench/served_load.py
    `StageTimer`). The syncs slow the run: read the shares, not the rate."""
    import httpx

    results["stages"] = []
    for workload, clients in STAGE_RUNS:
        if now() + args.twin_seconds + ROW_OVERHEAD_S > deadline:
            results["notes"].append(f"skipped the stage timing of {workload}: --deadline")
            continue
        response = httpx.post(server.url + "/bench/stages", headers=auth_headers(api_key),
                              timeout=args.twin_seconds + 180,
                              json={"workload": workload, "clients": clients, "seconds": args.twin_seconds,
                                    "tag": f"stages-{workload}", "frames_per_client": 64})
        response.raise_for_status()
        body = response.json()
        results["stages"].append({"workload": workload, "clients": clients, **body})
        print(f"  stages of {workload} at {clients}: "
              + ", ".join(f"{name} {stage['share']:.2f}" for name, stage in body["stages"].items() if stage["calls"]),
              flush=True)


def stages_table(runs: list[dict[str, Any]]) -> list[str]:
    rows = []
    for run in runs:
        served = closed_summary(run["tally"])
        for name, stage in run["stages"].items():
            if stage["calls"]:
                rows.append([f"{run['workload']} x {run['clients']} ({fmt(served['per_s'], 1)}/s timed)", name,
                             stage["calls"], fmt(stage["ms_a_call"], 1), fmt(stage["rows_a_call"], 1),
                             fmt(stage["share"] * 100, 0) + " %"])
    return ["where the engine's time goes, in process with every stage timed between device syncs (stages nest: "
            "flat.step, an engine turn, holds the rest; share = of the run's seconds):", "",
            markdown_table(["loop", "stage", "calls", "ms a call", "rows a call", "share"], rows), ""]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="the tiny config on the CPU (a smoke test of this script)")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    parser.add_argument("--quick", action="store_true",
                        help="fewer levels, 5 s rows, 3 s twins: within 4 minutes on an H200 with start-up")
    parser.add_argument("--seconds", type=float, default=None, help="seconds a row (default 10; --quick 5)")
    parser.add_argument("--twin-seconds", type=float, default=None, help="seconds an in-process twin (default: --seconds; "
                                                                         "--quick 3)")
    parser.add_argument("--workers", type=int, default=None, help="client processes (default: cores / 2, 4 to 8)")
    parser.add_argument("--sheet-clients", default=None, help="row (a) clients (default 32)")
    parser.add_argument("--ticket-clients", default=None, help="row (b) clients (default 32,64; --quick 32)")
    parser.add_argument("--walk-clients", default=None, help="row (c) clients (default 16)")
    parser.add_argument("--closed-cameras", default=None, help="row (d) cameras (default 8,32; --quick 8)")
    parser.add_argument("--open-cameras", default=None, help="row (e) cameras (default 8,16,32,64; --quick 8,32)")
    parser.add_argument("--switch-intervals", type=numbers(float), default="",
                        help="run every row once per server switch interval in ms (e.g. 5,0.2: Python's default "
                             "beside SWITCH_INTERVAL_MS's), one after the other")
    parser.add_argument("--gather-rows", type=numbers(int), default="", help="run every row once per server BATCH_GATHER_ROWS "
                        "(comma-separated, e.g. 0,32: an A/B in one call; 0 = the last batch's count)")
    parser.add_argument("--session-headroom", type=numbers(float), default="", help="run every row once per camera pacer "
                        "SESSION_HEADROOM (comma-separated shares in (0, 1], e.g. 0.8,0.92: an A/B of the admission)")
    parser.add_argument("--no-steady", dest="steady", action="store_false", help="skip row (f)")
    parser.add_argument("--rows", default="", help="run only these rows, by letter (e.g. c,d,e: the walk and "
                        "camera rows of an A/B; default all)")
    parser.add_argument("--restart", action="store_true",
                        help="after the rows, stop the server and time a second start over the compile caches the "
                             "first left in CACHE_DIR (a restart)")
    parser.add_argument("--no-stages", dest="stages", action="store_false",
                        help="skip timing the engine's stages in the walk and ticket loops after the rows")
    parser.add_argument("--heavy-tokens", type=int, default=None, help="row (f): the long state, tokens (default "
                                                                       "26000; --tiny 1500)")
    parser.add_argument("--heavy-think", type=int, default=None, help="row (f): the think budget (default 4096; "
                                                                      "--tiny 64)")
    parser.add_argument("--heavy-copies", type=int, default=None, help="row (f): how many of each heavy kind are sent "
                        "at once beside the steady client (default 4; --tiny 1)")
    parser.add_argument("--heavy-timeout", type=float, default=HEAVY_TIMEOUT_S, help="row (f): seconds each heavy "
                        "request may wait for its answer, on either path alike; the row waits for every heavy answer "
                        f"up to it, past --deadline if need be (default {HEAVY_TIMEOUT_S:g})")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                        help="TORCH_COMPILE (default: the server's)")
    parser.add_argument("--fused-moe", action=argparse.BooleanOptionalAction, default=None,
                        help="FUSED_MOE (default: the server's)")
    parser.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=None,
                        help="CUDA_GRAPHS (default: the server's)")
    parser.add_argument("--deadline", type=float, default=None,
                        help="seconds from start after which no row starts and the run stops and writes what it has "
                             "(default 520; --quick 228); row (f)'s heavy requests may keep it up to --heavy-timeout "
                             "longer, and the stage timing and --restart after it get that much more")
    parser.add_argument("--startup-timeout", type=float, default=600.0, help="seconds the server may take to be ready")
    parser.add_argument("--out-dir", default=os.environ.get("OUT") or ".", help="where the outputs go (default $OUT)")
    parser.add_argument("--replot", metavar="JSON", help="only redraw the camera curve of a stored run's JSON "
                        "(beside it, as <name>_camera_curve.png)")
    args = parser.parse_args(argv)
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.replot:
        return args
    if not args.tiny and not args.device.startswith("cuda"):
        parser.error("the full-size model needs a GPU; use --tiny to check the script on a CPU")
    quick = args.quick
    args.seconds = args.seconds or (5.0 if quick else 10.0)
    args.twin_seconds = args.twin_seconds or (min(3.0, args.seconds) if quick else args.seconds)
    cores = os.cpu_count() or 4
    args.workers = args.workers or min(8, max(4, cores // 2))
    clients = numbers(int)  # a flag given as "," (no levels) stays empty; one not given takes the default
    args.sheet_clients = clients(args.sheet_clients or "32")
    args.ticket_clients = clients(args.ticket_clients or ("32" if quick else "32,64"))
    args.walk_clients = clients(args.walk_clients or "16")
    args.closed_cameras = clients(args.closed_cameras or ("8" if quick else "8,32"))
    args.open_cameras = clients(args.open_cameras or ("8,32" if quick else "8,16,32,64"))
    if any(not 0.01 <= ms <= 100 for ms in args.switch_intervals):
        parser.error("--switch-intervals: each from 0.01 to 100 ms")
    if any(cap < 0 for cap in args.gather_rows):
        parser.error("--gather-rows: each at least 0")
    if any(not 0 < share <= 1 for share in args.session_headroom):
        parser.error("--session-headroom: each more than 0 and at most 1")
    args.rows = sorted({part.strip() for part in args.rows.split(",") if part.strip()})  # a list: JSON
    if not set(args.rows) <= set(ROW_KEYS):
        parser.error(f"--rows: letters among {', '.join(ROW_KEYS)}")
    args.heavy_tokens = args.heavy_tokens or (1500 if args.tiny else 26000)
    args.heavy_think = args.heavy_think or (64 if args.tiny else 4096)
    args.heavy_copies = args.heavy_copies if args.heavy_copies is not None else (1 if args.tiny else 4)
    if args.heavy_copies < 1:
        parser.error("--heavy-copies must be at least 1")
    if args.heavy_timeout <= 0:
        parser.error("--heavy-timeout must be more than 0")
    args.deadline = args.deadline or (228.0 if quick else 520.0)
    if args.workers < 1:
        parser.error("--workers must be at least 1")
    return args


def write_outputs(results: dict[str, Any], out_dir: Path, info: dict[str, Any]) -> None:
    text = header("bench_gpu_served: djev serve over HTTP and websockets, random weights", info) + "\n\n" + report(results)
    print()
    print(text, flush=True)
    (out_dir / "bench_gpu_served.md").write_text(text + "\n")
    plot = camera_plot(results, out_dir / "camera_curve.png")
    print(f"\nresults: {write_json(out_dir / 'bench_gpu_served.json', results)}"
          + (f"; plot: {plot}" if plot else ""), flush=True)


def end_report(server: Server, results: dict[str, Any]) -> None:
    """The server's after-ready counters at the end of the run (/metrics), printed with a WARNING line
    naming any that is not 0."""
    results["after_ready"] = after_ready_metrics(read_metrics(server.url))
    for line in after_ready_lines(results["after_ready"], "the server at the end"):
        print(f"  {line}", flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.replot:  # redraw the camera curve of a stored run
        import json

        source = Path(args.replot)
        plot = camera_plot(json.loads(source.read_text()), source.with_name(source.stem + "_camera_curve.png"))
        print(f"plot: {plot}")
        return 0 if plot else 1
    began = now()
    deadline = began + args.deadline
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    info = machine()
    api_key = os.environ.get("API_KEY", "")
    settings = served(args).settings()
    results: dict[str, Any] = {
        "machine": info,
        "model": "tiny config" if args.tiny else f"DiffusionGemma 26B-A4B architecture, random {random_weights(settings)}",
        "args": vars(args),
        "settings": {"torch_compile": settings.hf.torch_compile, "turn_tokens": settings.hf.turn_tokens,
                     "fused_moe": settings.hf.fused_moe, "cuda_graphs": settings.hf.cuda_graphs,
                     "quantize": settings.hf.quantize,
                     "batch_gather_ms": settings.hf.batch_gather_ms,
                     "max_sessions": settings.limits.max_sessions, "max_inflight": settings.limits.max_inflight},
        "startup": {}, "rows": [], "notes": [],
    }

    def stop(signum: int, frame: Any) -> None:
        raise Deadline("--deadline passed (hard stop)") if signum == signal.SIGALRM else SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGALRM, stop)
    # After the rows: row (f)'s heavy requests may wait --heavy-timeout past the deadline; what follows
    # them (the stage timing, a restart) keeps the room it had.
    after_rows = deadline + heavy_wait_s(args)
    # the net behind the per-row checks: nothing blocks past it (a restart may wait RESTART_S more)
    signal.alarm(int(after_rows - began + 30 + (RESTART_S if args.restart else 0)))
    server: Server | None = None
    pool: ClientPool | None = None
    try:
        print(f"starting the server ({'tiny' if args.tiny else 'full-size'} model on {args.device}) ...", flush=True)
        server = spawn_random(served(args), out_dir / "bench_gpu_served.server.log")
        pool = ClientPool(args.workers)  # the client processes start while the model builds
        results["startup"] = wait_ready(server, min(args.startup_timeout, deadline - now()))
        results["startup"]["memory"] = memory_line(server.log_path)
        print(f"  ready in {results['startup']['ready_s']} s; {results['startup']['memory']}", flush=True)
        results["compile_counts_at_ready"] = compile_report(server.url, api_key)
        for line in compile_report_lines(results["compile_counts_at_ready"], "the server at ready"):
            print(f"  {line}", flush=True)
        measure(args, server, pool, results, deadline, api_key)
        if args.stages:
            time_stages(args, server, results, after_rows, api_key)
        end_report(server, results)
        if args.restart:
            server.stop()
            server = None
            print("restarting the server over the compile caches the first start left in CACHE_DIR ...", flush=True)
            server = spawn_random(served(args), out_dir / "bench_gpu_served.restart.log")
            results["restart"] = wait_ready(server, min(args.startup_timeout, after_rows + RESTART_S - now()))
            print(f"  ready again in {results['restart']['ready_s']} s", flush=True)
    except (Deadline, RuntimeError, OSError) as exc:
        results["stopped"] = f"{type(exc).__name__}: {str(exc)[:2000]}"
        results["notes"].append(f"stopped: {str(exc)[:2000]}")
        print(f"stopped: {exc}", file=sys.stderr, flush=True)
    finally:
        signal.alarm(0)
        if pool is not None:
            results["client_pids"] = pool.pids()
            pool.close()
        if server is not None:
            if "after_ready" not in results and "restart" not in results and server.alive():
                end_report(server, results)  # a run stopped early: the counters so far
            results["server_pid"] = server.process.pid
            server.stop()
        results["wall_s"] = round(now() - began, 1)
        write_outputs(results, out_dir, info)
    return 1 if "stopped" in results or not results["rows"] else 0  # rows skipped for --deadline are not a failure


if __name__ == "__main__":
    sys.exit(main())
