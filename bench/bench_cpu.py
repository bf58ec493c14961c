"""Where the time of one decision goes, and how the server batches under load (tiny model, CPU).

Measured in ONE run, so the ratios compare numbers taken side by side on the same machine state:

(a) One decision -- the README's ticket example (noul + choice + score, `samples: 1`) -- three ways
    and a transport floor, interleaved request by request so drift hits all four alike:
      engine    HFReader.read([spec]) of the exact ReadSpec the Decider sends for that decision
                (captured by running the real Decider against a recording reader);
      decision  parse_decision(body, build.limits(Settings())) + Decider.decide() in process: templating, the read, answers;
      http      POST /v1/systemone to the real app under uvicorn on 127.0.0.1 (httpx, keep-alive);
      floor     the same POST, body and client to a bare Starlette app under the same uvicorn options
                whose one route reads the body and returns a fixed JSON reply: what the client, the
                loopback and uvicorn cost before any of djev's code runs (its prompt-token and
                encoder-pass columns are 0: it reads nothing).
    The differences are the decision logic (decision - engine) and the HTTP layer (http - decision);
    http_p50 / engine_p50 is the overhead ratio. With --server process (the default) the djev server
    and the floor app each run in their own process, as `djev serve` does and as a real client sees
    them; with --server thread they run in threads of this process, beside the client and the
    in-process reader (the harness of the earlier runs: one GIL for all of it). Two conditions: "repeat" sends the same decision
    every time (its prompt's KV stays in the engine's KV store, so a read writes no prompt tokens: one
    turn over its canvas) and "unique" gives every request its own state (its prompt written too, like
    distinct tickets; the engine counts a turn that wrote prompt KV as an encoder pass, one that read
    canvases as a decoder pass).

(b) A concurrency curve: 1, 8, 32 closed-loop clients, each posting unique-state ticket decisions
    for --seconds per level. Reported: req/s, decisions/s (3 questions per request), p50/p95, and the
    engine's encoder and decoder passes per request from the server reader's counters: below 1 means
    concurrent decisions shared engine turns (the batching loop in app/engine/hf/reader.py, each turn one
    forward over every queued read's new tokens: app/engine/hf/engine.py). The clients run in a
    separate process so they do not share the server's GIL (they do share the CPU cores; see
    --torch-threads).

Usage: python bench/bench_cpu.py [--seconds 10] [--levels 1,8,32] [--reads 150] [--server process|thread]
                                 [--torch-threads N] [--json OUT]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from contextlib import ExitStack, contextmanager
from multiprocessing import get_context
from pathlib import Path
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Iterator, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from app import build  # noqa: E402 - this checkout's app, not an installed one
from app.config import Settings  # noqa: E402
from bench.common import (  # noqa: E402 - the repository root must be importable first
    at_least,
    fmt,
    header,
    latency_summary,
    live_server,
    machine,
    markdown_table,
    numbers,
    positive_seconds,
    set_torch_threads,
    tiny_checkpoint,
    tiny_reader,
    tiny_server,
    write_json,
)
from bench.served_load import load_level  # noqa: E402
from bench.workload import TICKET_QUESTIONS, ticket  # noqa: E402

if TYPE_CHECKING:
    from app.engine.base import ReadResult, ReadSpec

# The ticket example of README.md (the first curl), with one noise draw.
TICKET = "Everything is down and we have a demo at noon."
QUESTIONS_PER_DECISION = len(TICKET_QUESTIONS)
HTTP_TIMEOUT_S = 60.0


def ticket_body(tag: str | None = None) -> dict[str, Any]:
    """The ticket decision; a tag makes the state (and so the prompt) unique."""
    return ticket(TICKET if tag is None else f"{TICKET} Ticket {tag}.", model="jev-latest")


class SpecRecorder:
    """A Reader with no model: records the ReadSpecs the Decider sends and answers uniformly.

    Running the real Decider against it yields exactly the spec a decision reads, without touching
    the engine (so its prompt stays uncached there)."""

    def __init__(self, reader: Any) -> None:
        self.tokenizer = reader.tokenizer
        self.info = reader.info
        self.specs: list[ReadSpec] = []

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    async def read(self, specs: Sequence[ReadSpec]) -> list[ReadResult]:
        from app.engine.base import ReadResult, SlotRead

        self.specs.extend(specs)
        return [
            ReadResult(
                slots=tuple(tuple(SlotRead(tuple(0.0 for _ in ids), ids[0]) for ids in spec.label_ids)
                            for _ in spec.canvases),
                prompt_tokens=len(spec.prompt.ids),
            )
            for spec in specs
        ]

    async def generate(self, spec: Any) -> Any:
        raise NotImplementedError("the ticket decision writes no thought")


async def read_spec_for(recorder: SpecRecorder, body: dict[str, Any]) -> ReadSpec:
    from app.decisions.request import parse_decision
    from app.decisions.run import Decider

    recorder.specs.clear()
    await Decider(recorder, build.read_settings(Settings())).decide(parse_decision(body, build.limits(Settings())))
    if len(recorder.specs) != 1:
        raise RuntimeError(f"the ticket decision should be one read, the Decider sent {len(recorder.specs)}")
    return recorder.specs[0]


# ---------------------------------------------------------------------------------------- (a)

class RemoteStats:
    """A server process's reader counters, read from its /metrics (`djev_hf_<name>_total`) when asked,
    which the timed loops do only between calls."""

    def __init__(self, url: str) -> None:
        self.url = url

    @property
    def stats(self) -> dict[str, float]:
        import httpx

        text = httpx.get(f"{self.url}/metrics", timeout=HTTP_TIMEOUT_S).text
        stats = {}
        for line in text.splitlines():
            if line.startswith("djev_hf_") and "_total " in line:
                name, value = line.split(" ")
                stats[name.removeprefix("djev_hf_").removesuffix("_total")] = float(value)
        return stats


def _serve(which: str, checkpoint: Path, port: int, threads: int) -> None:
    """A server process's body: the real app on its own tiny reader (`tiny_server`'s settings), or the
    floor app, served as `djev serve` serves (app.server.serve_app: the same uvicorn options)."""
    from app.server import create_app, serve_app

    set_torch_threads(threads)
    config = Settings.of(host="127.0.0.1", port=port, pages=False, log_level="warning")
    app = create_app(config, tiny_reader(checkpoint, config)) if which == "djev" else floor_app()
    asyncio.run(serve_app(app, config))


@contextmanager
def server_process(which: str, checkpoint: Path, threads: int) -> Iterator[str]:
    """`_serve` in a spawned process on a free port; yields its base URL once it answers."""
    import httpx

    from app.server import free_port

    port = free_port()
    process = get_context("spawn").Process(target=_serve, args=(which, checkpoint, port, threads), daemon=True)
    process.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    try:
        while True:
            try:
                httpx.get(f"{url}/health", timeout=2)
                break
            except httpx.HTTPError:
                if not process.is_alive() or time.monotonic() > deadline:
                    raise RuntimeError(f"the {which} server process did not start") from None
                time.sleep(0.1)
        yield url
    finally:
        process.terminate()
        process.join(timeout=30)


def floor_app() -> Any:
    """A bare Starlette app: one POST route that reads the body and answers a fixed JSON reply."""
    from starlette.applications import Starlette
    from starlette.responses import Response
    from starlette.routing import Route

    reply = json.dumps({"answers": {}, "usage": {"input_tokens": 0}}).encode()

    async def echo(request: Any) -> Response:
        await request.body()
        return Response(reply, media_type="application/json")

    app = Starlette(routes=[Route("/v1/systemone", echo, methods=["POST"])])
    app.state.startup = None  # no reader starting up: serve_app's start-up watch has nothing to watch
    return app


async def single_decision(url: str, server_reader: Any, checkpoint: Path, reads: int, warmup: int,
                          floor_url: str) -> dict[str, Any]:
    """Engine read vs in-process decision vs HTTP (and the transport floor), interleaved, for both
    conditions."""
    import httpx

    from app.decisions.run import Decider

    reader = tiny_reader(checkpoint)  # in-process: its own reader in this event loop
    await reader.start()
    try:
        async with httpx.AsyncClient(base_url=url, timeout=HTTP_TIMEOUT_S) as client, \
                httpx.AsyncClient(base_url=floor_url, timeout=HTTP_TIMEOUT_S) as floor_client:
            paths = Paths(reader, Decider(reader, build.read_settings(Settings())), client, floor_client)
            await paths.check_same_answers(ticket_body("x000000"))
            return {
                condition: await interleaved(paths, condition, {"engine": reader, "decision": reader,
                                                                "http": server_reader, "floor": reader},
                                             reads, warmup)
                for condition in ("repeat", "unique")
            }
    finally:
        await reader.stop()


class Paths:
    """The three ways to run one ticket decision, and the transport floor; each returns the prompt
    tokens it read, so the report shows the three did the same work (the floor reads none: 0)."""

    def __init__(self, reader: Any, decider: Any, client: Any, floor_client: Any) -> None:
        self.reader = reader
        self.decider = decider
        self.client = client
        self.floor_client = floor_client
        self.recorder = SpecRecorder(reader)

    async def spec(self, body: dict[str, Any]) -> ReadSpec:
        return await read_spec_for(self.recorder, body)

    async def engine(self, spec: ReadSpec) -> int:
        results = await self.reader.read([spec])
        return results[0].prompt_tokens

    async def decision(self, body: dict[str, Any]) -> int:
        from app.decisions.request import parse_decision

        outcome = await self.decider.decide(parse_decision(body, build.limits(Settings())))
        return outcome.input_tokens

    async def http(self, body: dict[str, Any]) -> int:
        return await self._post(self.client, body)

    async def floor(self, body: dict[str, Any]) -> int:
        return await self._post(self.floor_client, body)

    @staticmethod
    async def _post(client: Any, body: dict[str, Any]) -> int:
        response = await client.post("/v1/systemone", json=body)
        response.raise_for_status()
        return response.json()["usage"]["input_tokens"]

    async def check_same_answers(self, body: dict[str, Any]) -> None:
        """The in-process decision and the HTTP one must agree, or they did not do the same work."""
        from app.decisions.request import parse_decision

        local = await self.decider.decide(parse_decision(body, build.limits(Settings())))
        response = await self.client.post("/v1/systemone", json=body)
        response.raise_for_status()
        if not same(response.json()["answers"], json.loads(json.dumps(local.answers))):
            raise RuntimeError("the HTTP decision and the in-process decision disagree: not the same work")


def same(a: Any, b: Any, tolerance: float = 1e-4) -> bool:
    """Equal JSON values, floats within `tolerance` (the response may round)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k], tolerance) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same(x, y, tolerance) for x, y in zip(a, b))
    if isinstance(a, float) or isinstance(b, float):
        return isinstance(a, (int, float)) and isinstance(b, (int, float)) and abs(a - b) <= tolerance
    return a == b


async def interleaved(paths: Paths, condition: str, readers: dict[str, Any], reads: int,
                      warmup: int) -> dict[str, Any]:
    """Run each path once per iteration, in turn; time each call and count its encoder passes.

    "repeat" sends the same body every time; "unique" tags each state with the path's letter and
    the iteration (tags of equal shape keep the prompts the same length on every path)."""

    def body(path: str, i: int) -> dict[str, Any]:
        return ticket_body(None if condition == "repeat" else f"{path}{i + warmup:06d}")

    # The engine path reads the exact spec the Decider sends, captured before the clock starts.
    specs = {i: await paths.spec(body("e", i)) for i in range(-warmup, reads)}
    calls: dict[str, Callable[[int], Awaitable[int]]] = {
        "engine": lambda i: paths.engine(specs[i]),
        "decision": lambda i: paths.decision(body("d", i)),
        "http": lambda i: paths.http(body("h", i)),
        "floor": lambda i: paths.floor(body("f", i)),
    }
    seconds: dict[str, list[float]] = {name: [] for name in calls}
    encoder_passes = {name: 0 for name in calls}
    prompt_tokens: dict[str, list[int]] = {name: [] for name in calls}
    for i in range(-warmup, reads):
        for name, call in calls.items():
            before = readers[name].stats.get("encoder_passes", 0)
            started = time.perf_counter()
            tokens = await call(i)
            elapsed = time.perf_counter() - started
            if i >= 0:
                seconds[name].append(elapsed)
                encoder_passes[name] += readers[name].stats.get("encoder_passes", 0) - before
                prompt_tokens[name].append(tokens)
    return {name: {**latency_summary(seconds[name]), "encoder_passes_per_call": encoder_passes[name] / reads,
                   "prompt_tokens": sum(prompt_tokens[name]) / reads}
            for name in calls}


# ---------------------------------------------------------------------------------------- (b)

def concurrency_curve(url: str, server_reader: Any, levels: Sequence[int], seconds: float) -> list[dict[str, Any]]:
    rows = []
    with ProcessPoolExecutor(max_workers=1, mp_context=get_context("spawn")) as pool:
        # Warm-up (not reported): one short burst at the widest level, so the first level does not
        # pay for first-time batch shapes and the load generator's own start.
        pool.submit(load_level, url, max(levels), min(1.0, seconds), "warm", ticket_body).result()
        for clients in levels:
            before = dict(server_reader.stats)
            level = pool.submit(load_level, url, clients, seconds, f"c{clients}", ticket_body).result()
            after = dict(server_reader.stats)
            done = len(level["latencies"])
            delta = {key: after.get(key, 0) - before.get(key, 0) for key in after}
            per_request = {key: delta.get(key, 0) / done if done else math.nan
                           for key in ("encoder_passes", "decoder_passes")}
            rows.append({
                "clients": clients,
                "seconds": round(level["elapsed_s"], 2),
                "requests": done,
                "errors": level["errors"],
                "req_per_s": done / level["elapsed_s"],
                "decisions_per_s": QUESTIONS_PER_DECISION * done / level["elapsed_s"],
                **latency_summary(level["latencies"]),
                "encoder_passes_per_request": per_request["encoder_passes"],
                "decoder_passes_per_request": per_request["decoder_passes"],
                "rows_per_decoder_pass": (delta.get("decoder_rows", 0) / delta["decoder_passes"]
                                          if delta.get("decoder_passes") else math.nan),
            })
    return rows


# ---------------------------------------------------------------------------------------- report

def report(single: dict[str, Any], curve: list[dict[str, Any]]) -> str:
    labels = {"engine": "engine read (HFReader.read)", "decision": "in-process decision (parse + Decider)",
              "http": "HTTP POST /v1/systemone",
              "floor": "transport floor: the same POST to a bare Starlette echo"}
    rows = []
    for condition, paths in single.items():
        engine_p50 = paths["engine"]["p50_ms"]
        for name, stats in paths.items():
            rows.append([condition, labels[name], fmt(stats["p50_ms"], 2), fmt(stats["p95_ms"], 2),
                         fmt(stats["p50_ms"] / engine_p50, 2), fmt(stats["prompt_tokens"], 0),
                         fmt(stats["encoder_passes_per_call"], 2)])
    lines = ["### (a) one ticket decision, sequential", "",
             markdown_table(["condition", "path", "p50 ms", "p95 ms", "x engine p50", "prompt tokens",
                             "encoder passes/call"], rows), ""]
    for condition, paths in single.items():
        engine, decision, http, floor = (paths[name]["p50_ms"] for name in ("engine", "decision", "http", "floor"))
        lines.append(f"- {condition}: HTTP overhead over the engine read {http - engine:.2f} ms "
                     f"(ratio {http / engine:.2f}); split of the HTTP p50: engine {engine:.2f} ms, decision logic "
                     f"{decision - engine:.2f} ms, HTTP layer {http - decision:.2f} ms, of which the transport "
                     f"floor (client, loopback, uvicorn) is {floor:.2f} ms")
    curve_rows = [[r["clients"], r["requests"], fmt(r["req_per_s"], 2), fmt(r["decisions_per_s"], 1),
                   fmt(r["p50_ms"], 1), fmt(r["p95_ms"], 1), fmt(r["encoder_passes_per_request"], 2),
                   fmt(r["decoder_passes_per_request"], 2), fmt(r["rows_per_decoder_pass"], 1),
                   sum(r["errors"].values())] for r in curve]
    lines += ["", "### (b) concurrency curve: closed-loop clients, unique-state ticket decisions", "",
              markdown_table(["clients", "requests", "req/s", "decisions/s", "p50 ms", "p95 ms",
                              "encoder passes/request", "decoder passes/request", "canvases/decoder pass",
                              "errors"], curve_rows)]
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=positive_seconds, default=10.0, help="seconds per concurrency level (default 10)")
    parser.add_argument("--levels", type=numbers(int), default="1,8,32", help="comma-separated client counts (default 1,8,32)")
    parser.add_argument("--reads", type=at_least(1), default=150, help="timed calls per path and condition in (a) (default 150)")
    parser.add_argument("--warmup", type=at_least(0), default=5, help="untimed calls per path first (default 5)")
    parser.add_argument("--torch-threads", type=int, default=None,
                        help="torch intra-op threads for the server (default: usable cores - 1, at least 1)")
    parser.add_argument("--server", choices=("process", "thread"), default="process",
                        help="the djev server and the floor app in their own processes (default; as `djev serve` "
                             "runs) or in threads of the bench process (the earlier harness)")
    parser.add_argument("--json", dest="json_out", help="also write the results to this JSON file")
    args = parser.parse_args(argv)
    if not args.levels or min(args.levels) < 1:
        parser.error("--levels: positive whole numbers, comma-separated")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    threads = set_torch_threads(args.torch_threads)
    info = machine()
    checkpoint = tiny_checkpoint()
    with ExitStack() as stack:
        if args.server == "process":
            url = stack.enter_context(server_process("djev", checkpoint, threads))
            floor_url = stack.enter_context(server_process("floor", checkpoint, threads))
            server_reader: Any = RemoteStats(url)
        else:
            url, server_reader = stack.enter_context(tiny_server(checkpoint))
            floor_url = stack.enter_context(live_server(floor_app()))
        single = asyncio.run(single_decision(url, server_reader, checkpoint, args.reads, args.warmup, floor_url))
        curve = concurrency_curve(url, server_reader, args.levels, args.seconds)
    print(header("bench_cpu: engine vs decision vs HTTP, and concurrency (tiny model)", info))
    print(f"server: {'its own process (as `djev serve`)' if args.server == 'process' else 'a thread of this process'}")
    print()
    print(report(single, curve))
    if args.json_out:
        path = write_json(args.json_out, {"machine": info, "model": "tiny random-weight (app/engine/tiny.py)",
                                          "args": {"seconds": args.seconds, "levels": args.levels,
                                                   "reads": args.reads, "warmup": args.warmup,
                                                   "server": args.server, "torch_threads": threads},
                                          "single": single, "curve": curve})
        print(f"\nresults: {path}")


if __name__ == "__main__":
    main()
