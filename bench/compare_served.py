"""Two `bench/bench_gpu_served.py` runs side by side: the A/B of one warm machine (bf16 weights and
FP8, QUANTIZE=fp8), figure by figure, with the ratio of the second to the first.

The figures: start-up to ready, the weights' and the KV store's GiB and the longest state (the
server's memory line at ready), the camera sessions /health allows; per closed-loop row (a)-(d)
the served rate, p50 and p95, and the in-process rate; per open-camera row (e) the cameras admitted,
answers a second per session, the answer age's p95 and the fresh share; row (f)'s steady client's
p99 beside the heavy requests and the heavy requests answered; the engine's stages (a turn's step and
forward, ms a call) for each timed workload. A figure one run lacks shows "-".

    python bench/compare_served.py "$OUT/bf16/bench_gpu_served.json" "$OUT/fp8/bench_gpu_served.json" \
        [--labels bf16,fp8] [--out "$OUT/served_ab.md"]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import markdown_table  # noqa: E402

Figures = dict[str, float | None]
MEMORY = re.compile(r"weights (?P<weights>[\d.]+) GiB, graphs (?P<graphs>[\d.]+) GiB, KV store (?P<store>[\d.]+) GiB "
                    r"\(states up to (?P<tokens>\d+) tokens\)")
# Stages whose ms a call the table shows, and how each is named there.
STAGES = {"flat.step": "a turn (step)", "flat.turn.forward": "its forward", "images.image_features": "vision"}


def memory_figures(line: str) -> Figures:
    """The weights', graphs' and KV store's GiB and the longest state from the server's memory line
    (app/engine/hf/memory.py's `MemorySplit.line`); none where the line is missing or other."""
    found = MEMORY.search(line or "")
    if found is None:
        return {"weights GiB": None, "graphs GiB": None, "KV store GiB": None, "longest state, tokens": None}
    return {"weights GiB": float(found["weights"]), "graphs GiB": float(found["graphs"]),
            "KV store GiB": float(found["store"]), "longest state, tokens": float(found["tokens"])}


def number(value: Any) -> float | None:
    """A figure as a float, or None where the run has none (missing, not a number, or NaN: a row
    that answered nothing has no percentiles)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        return None
    return float(value)


def figures(results: dict[str, Any]) -> Figures:
    """One run's figures, by label, in the table's order (None where it has none). Pure."""
    return {label: number(value) for label, value in raw_figures(results).items()}


def raw_figures(results: dict[str, Any]) -> dict[str, Any]:
    startup = results.get("startup") or {}
    out: dict[str, Any] = {"start-up to ready, s": startup.get("ready_s")}
    out.update(memory_figures(startup.get("memory", "")))
    out["camera sessions at most (/health)"] = (startup.get("health") or {}).get("max_sessions")
    for row in results.get("rows", []):
        name, clients = row["row"], row.get("clients")
        served, twin = row.get("served") or {}, row.get("twin") or {}
        if row.get("kind") == "camera_open":
            label = f"({name}) {clients} cameras at 2 fps"
            age = served.get("age") or {}
            out.update({f"{label}: admitted": served.get("admitted"),
                        f"{label}: answers/s a session": served.get("answers_per_s_per_session"),
                        f"{label}: age p95 ms": age.get("p95_ms"), f"{label}: fresh share": served.get("fresh_share")})
        elif name == "f":
            beside = (row.get("phases") or {}).get("steady beside the heavy clients") or {}
            burst = row.get("burst") or {}
            out.update({"(f) steady client beside heavy requests: p99 ms": beside.get("p99_ms"),
                        "(f) heavy requests answered": burst.get("answered"),
                        "(f) heavy requests sent": burst.get("sent")})
        else:
            label = f"({name}) {row.get('name', '')}, {clients} clients"
            out.update({f"{label}: served /s": served.get("per_s"), f"{label}: p50 ms": served.get("p50_ms"),
                        f"{label}: p95 ms": served.get("p95_ms"), f"{label}: in-process /s": twin.get("per_s")})
    for timed in results.get("stages") or []:
        stages = timed.get("stages") or {}
        for stage, named in STAGES.items():
            if stage in stages:
                out[f"stages, {timed['workload']} x {timed['clients']}: {named}, ms"] = stages[stage].get("ms_a_call")
    return out


def cell(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.3g}" if abs(value) < 10 and value != int(value) else f"{value:,.1f}".removesuffix(".0")


def table(first: dict[str, Any], second: dict[str, Any], labels: Sequence[str]) -> str:
    """The markdown table of both runs' figures (every label either has, the first's order first) and
    the second's ratio to the first. Pure."""
    a, b = figures(first), figures(second)
    rows = []
    for label in [*a, *(label for label in b if label not in a)]:
        x, y = a.get(label), b.get(label)
        rows.append([label, cell(x), cell(y), f"{y / x:.2f}x" if x and y is not None else "-"])
    return markdown_table(["figure", labels[0], labels[1], f"{labels[1]} / {labels[0]}"], rows)


def header(results: dict[str, Any], label: str) -> str:
    machine = results.get("machine") or {}
    device = machine.get("device") or machine.get("gpu") or "-"
    return (f"- {label}: {results.get('date', '-')}, {results.get('model', '-')}, {device}; "
            f"`{results.get('command', '-')}`")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("first", type=Path, help="the first run's bench_gpu_served.json (e.g. bf16)")
    parser.add_argument("second", type=Path, help="the second run's (e.g. FP8)")
    parser.add_argument("--labels", default="bf16,fp8", help="the two runs' names (default bf16,fp8)")
    parser.add_argument("--out", type=Path, help="write the markdown here too")
    args = parser.parse_args(argv)
    labels = [part.strip() for part in args.labels.split(",")]
    if len(labels) != 2 or not all(labels):
        parser.error(f"--labels {args.labels!r}: two names, comma-separated")
    runs = []
    for path in (args.first, args.second):
        try:
            runs.append(json.loads(path.read_text()))
        except (OSError, ValueError) as exc:
            parser.error(f"{path}: not a readable bench_gpu_served JSON ({exc})")
    text = "\n".join([f"## bench_gpu_served A/B: {labels[0]} and {labels[1]}", "",
                      header(runs[0], labels[0]), header(runs[1], labels[1]), "", table(*runs, labels), ""])
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
