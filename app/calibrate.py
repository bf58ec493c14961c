"""`djev calibrate` and `djev eval`: labelled JSONL in, a fitted calibration or a report out.

Both read the data through the path serving takes: each line's request is validated by
`parse_decision` and decided by a `Decider` over the reader `djev serve` would build from the same
settings and flags (in this process), or, for `eval --url`, posted to a running server's
`/v1/systemone`. `calibrate` records each read's raw distribution (an `Adjust` that changes
nothing, in place of any calibration), fits on the training share of the lines and measures on the
held-out share; `eval` scores the answers as they come back, calibrated or not, re-asks every line
with its choice options permuted, and writes the numbers as JSON and the reliability diagram as a
PNG. Formats: app/decisions/labelled.py (the lines), app/decisions/calibration.py (the file).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Callable, Sequence, TextIO

from app.config import Settings
from app.decisions.calibration import Calibration, CalibrationError, Item, compare, fit, own_buckets_of
from app.decisions.errors import RequestError
from app.decisions.labelled import (
    DataReport,
    Line,
    answer_distribution,
    label_index,
    parse_lines,
    permuted,
    shown_index,
    split,
    top_name,
)
from app.decisions.questions import Question
from app.decisions.request import Decision, parse_decision
from app.engine.base import EngineError, EngineInputError, Reader

DEFAULT_HELD_OUT = 0.3
DEFAULT_CONCURRENCY = 8


class Progress:
    """A one-line progress bar on stderr, redrawn at most ten times a second."""

    def __init__(self, label: str, total: int, stream: TextIO | None = None) -> None:
        self.label, self.total, self.done = label, total, 0
        self.stream = stream or sys.stderr
        self.started = self.drawn = time.monotonic()
        self.draw()

    def advance(self) -> None:
        self.done += 1
        now = time.monotonic()
        if now - self.drawn >= 0.1 or self.done == self.total:
            self.drawn = now
            self.draw()

    def draw(self) -> None:
        width = 30
        filled = width * self.done // self.total if self.total else width
        elapsed = time.monotonic() - self.started
        self.stream.write(f"\r{self.label} [{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} "
                          f"{elapsed:.0f}s")
        self.stream.flush()

    def close(self) -> None:
        self.stream.write("\n")
        self.stream.flush()


@dataclass
class Prepared:
    """A usable line: its decision and each answered question's label (index in request order)."""

    line: Line
    decision: Decision
    labels: dict[str, int]

    def question(self, qid: str) -> Question:
        return next(q for q in self.decision.questions if q.qid == qid)


@dataclass
class Answered:
    prepared: Prepared
    answers: dict[str, Any]  # qid -> the Jev answer
    reads: dict[str, list[tuple[Question, tuple[float, ...]]]] = field(default_factory=dict)  # raw, as shown


def read_data(path: Path, held_out_share: float, report: DataReport) -> list[Line]:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise SystemExit(f"djev: {path}: cannot read it ({exc})") from None
    return parse_lines(text.splitlines(), held_out_share, report)


def prepare(lines: Sequence[Line], settings: Settings, report: DataReport) -> list[Prepared]:
    """Each line's request validated as the server validates it, and its expected answers as labels."""
    from app.build import limits

    request_limits = limits(settings)
    out = []
    for line in lines:
        try:
            decision = parse_decision(line.request, request_limits)
        except RequestError as exc:
            report.problems.append(f"line {line.number}: the request is refused: {exc}")
            continue
        questions = {q.qid: q for q in decision.asked()}
        labels = {}
        for qid, answer in line.expected.items():
            if qid not in questions:
                report.problems.append(f"line {line.number}: {qid!r} is not asked (ask)")
                continue
            try:
                labels[qid] = label_index(questions[qid], answer)
            except ValueError as exc:
                report.problems.append(f"line {line.number}: {qid!r}: {exc}")
        out.append(Prepared(line, decision, labels))
    return out


Ask = Callable[[Prepared, dict], Awaitable[tuple[dict, dict]]]  # (prepared, request) -> (answers, reads)


async def ask_all(ask: Ask, work: Sequence[tuple[Prepared, dict]], concurrency: int, label: str,
                  report: DataReport) -> list[Answered]:
    """Every request through `ask`, `concurrency` at a time, with a progress bar; a request that
    fails is reported by its line and left out."""
    gate = asyncio.Semaphore(max(1, concurrency))
    progress = Progress(label, len(work))
    results: list[Answered | None] = [None] * len(work)

    async def one(index: int, prepared: Prepared, request: dict) -> None:
        async with gate:
            try:
                answers, reads = await ask(prepared, request)
                results[index] = Answered(prepared, answers, reads)
            except (RequestError, EngineError, EngineInputError, AskFailed) as exc:
                report.problems.append(f"line {prepared.line.number}: {type(exc).__name__}: {exc}")
            finally:
                progress.advance()

    try:
        await asyncio.gather(*(one(i, p, r) for i, (p, r) in enumerate(work)))
    finally:
        progress.close()
    return [r for r in results if r is not None]


class AskFailed(Exception):
    """A server's answer that is not a decision (its status and message)."""


class InProcess:
    """The reader `djev serve` builds from these settings (or `reader`, a test's), with a Decider
    over it: `record` keeps each read's raw distribution (and applies no calibration); otherwise
    CALIBRATION applies."""

    def __init__(self, settings: Settings, record: bool, reader: Reader | None = None) -> None:
        self.settings, self.record = settings, record
        self.decider: Any = None
        self.reader: Any = reader
        self.calibration: Calibration | None = None

    async def __aenter__(self) -> "InProcess":
        from app.build import build_reader, check_calibration, load_calibration, read_settings
        from app.decisions.run import Decider

        calibration = None if self.record else load_calibration(self.settings)
        if self.reader is None:
            self.reader = await asyncio.to_thread(build_reader, self.settings)
        check_calibration(calibration, self.settings, self.reader.info, self.reader.tokenizer)
        await self.reader.start()
        self.calibration = calibration
        self.decider = Decider(self.reader, read_settings(self.settings, self.reader.info), calibration=calibration)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.reader is not None:
            await self.reader.stop()

    async def ask(self, prepared: Prepared, request: dict) -> tuple[dict, dict]:
        from app.build import limits

        decision = prepared.decision if request is prepared.line.request else parse_decision(request, limits(self.settings))
        reads: dict[str, list[tuple[Question, tuple[float, ...]]]] = {}

        def observe(question: Question, probs: list[float]) -> list[float]:
            reads.setdefault(question.qid, []).append((question, tuple(probs)))
            return probs

        outcome = await self.decider.decide(decision, adjust=observe if self.record else None)
        return outcome.answers, reads


class OverHTTP:
    """A running server's `/v1/systemone`, with the settings' API_KEY as the bearer token."""

    def __init__(self, url: str, settings: Settings, timeout: float) -> None:
        import httpx

        headers = {"authorization": f"Bearer {settings.server.api_key}"} if settings.server.api_key else {}
        self.url = url.rstrip("/")
        self.client = httpx.AsyncClient(timeout=timeout, headers=headers, verify=False)

    async def __aenter__(self) -> "OverHTTP":
        await self.client.get(self.url + "/health")  # unreachable: one clear error, not one a line
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.client.aclose()

    async def health(self) -> dict:
        try:
            response = await self.client.get(self.url + "/health")
            return response.json()
        except Exception:  # noqa: BLE001 - only what /health says of the calibration is wanted
            return {}

    async def ask(self, prepared: Prepared, request: dict) -> tuple[dict, dict]:
        import httpx

        try:
            response = await self.client.post(self.url + "/v1/systemone", json=request)
        except httpx.HTTPError as exc:
            raise AskFailed(f"{self.url}: {exc}") from None
        try:
            body = response.json()
        except ValueError:
            body = {}
        if response.status_code != 200 or not isinstance(body.get("answers"), dict):
            message = body.get("error", {}).get("message") if isinstance(body.get("error"), dict) else response.text[:200]
            raise AskFailed(f"HTTP {response.status_code}: {message}")
        return body["answers"], {}


# ------------------------------------------------------------------------------------ reporting

def print_table(title: str, buckets: dict, out: TextIO) -> None:
    print(title, file=out)
    print(f"  {'bucket':<14} {'n':>6}  {'ECE':>15}  {'Brier':>15}  {'log loss':>15}", file=out)
    for key in sorted(buckets, key=lambda k: (k != "all", k)):
        entry = buckets[key]
        before, after = entry["before"], entry.get("after")

        def pair(name: str) -> str:
            return f"{before[name]:.4f}" + (f" -> {after[name]:.4f}" if after else "")

        print(f"  {key:<14} {before['count']:>6}  {pair('ece'):>15}  {pair('brier'):>15}  {pair('log_loss'):>15}", file=out)


# Lines of each kind of problem printed before the rest are only counted (all are in eval.json).
SHOWN_PROBLEMS = 20


def print_problems(report: DataReport, out: TextIO) -> None:
    for label, messages in (("malformed", report.malformed), ("skipped", report.problems)):
        for message in messages[:SHOWN_PROBLEMS]:
            print(f"{label}: {message}", file=out)
        if len(messages) > SHOWN_PROBLEMS:
            print(f"{label}: ... and {len(messages) - SHOWN_PROBLEMS} more line(s)", file=out)
    for kind, count in sorted(report.unknown_kinds.items()):
        print(f"unknown question kind {kind!r}: {count} question(s) left out", file=out)


# ------------------------------------------------------------------------------------ calibrate

def items_from_reads(answered: Sequence[Answered]) -> list[Item]:
    """Each labelled question's raw reads, in the order it was shown, with its label in that order."""
    items = []
    for result in answered:
        for qid, label in result.prepared.labels.items():
            if qid not in result.reads:
                continue  # skipped by ask_if: nothing was read
            question = result.prepared.question(qid)
            by_order: dict[tuple[str, ...], list[tuple[float, ...]]] = {}
            shown_as: dict[tuple[str, ...], Question] = {}
            for shown, probs in result.reads[qid]:  # one order unless a debias mode shows several
                by_order.setdefault(shown.names, []).append(probs)
                shown_as[shown.names] = shown
            for names, reads in by_order.items():
                index = shown_index(shown_as[names], question, label)
                items.append(Item(qid, question.kind.name, names, tuple(reads), index))
    return items


def run_calibrate(settings: Settings, data: Path, out_path: Path, held_out_share: float = DEFAULT_HELD_OUT,
                  min_id_labels: int = 100, concurrency: int = DEFAULT_CONCURRENCY, stream: TextIO | None = None,
                  reader: Reader | None = None) -> int:
    from app.build import CheckpointError, fitted_for

    out: TextIO = stream or sys.stdout
    report = DataReport()
    lines = read_data(data, held_out_share, report)
    prepared = prepare(lines, settings, report)
    if not any(p.labels for p in prepared):
        print_problems(report, sys.stderr)
        print(f"djev: {data}: no usable labelled question in {report.lines} line(s)", file=sys.stderr)
        return 2

    async def go() -> tuple[list[Answered], Any]:
        async with InProcess(settings, record=True, reader=reader) as engine:
            answered = await ask_all(engine.ask, [(p, p.line.request) for p in prepared if p.labels], concurrency,
                                     "calibrate", report)
            return answered, fitted_for(settings, engine.reader.info, engine.reader.tokenizer)

    try:
        answered, meta = asyncio.run(go())
    except (CalibrationError, CheckpointError) as exc:
        print(f"djev: {exc}", file=sys.stderr)
        return 2
    train_lines, test_lines = split([a.prepared.line for a in answered])
    train_numbers = {line.number for line in train_lines}
    test_numbers = {line.number for line in test_lines}
    train = items_from_reads([a for a in answered if a.prepared.line.number in train_numbers])
    test = items_from_reads([a for a in answered if a.prepared.line.number in test_numbers])
    print_problems(report, sys.stderr)
    if not train:
        print(f"djev: {data}: no labelled question was read", file=sys.stderr)
        return 2
    calibration = fit(train, meta, min_id_labels)
    own = own_buckets_of(train, min_id_labels)
    buckets = compare(test, calibration, own)
    shared = train_numbers == test_numbers
    written = Calibration(meta, calibration.buckets, {
        "data": {"file": data.name, "lines": report.lines, "train_lines": len(train_numbers),
                 "held_out_lines": len(test_numbers), "held_out_share": held_out_share,
                 "split": "none: too few lines, fitted and measured on all" if shared else "sha256 of the line"},
        "held_out": buckets,
    })
    out_path.write_text(json.dumps(written.to_json(), indent=2) + "\n")
    print_table(f"held-out questions ({'all lines: too few to split' if shared else f'{len(test_numbers)} lines'}), "
                "before -> after", buckets, out)
    for key, bucket in calibration.buckets.items():
        print(f"  {key}: {bucket.model.as_json()} ({bucket.train} questions)", file=out)
    print(f"wrote {out_path}", file=out)
    return 0


# ------------------------------------------------------------------------------------------- eval

def items_from_answers(answered: Sequence[Answered]) -> list[Item]:
    items = []
    for result in answered:
        for qid, label in result.prepared.labels.items():
            question = result.prepared.question(qid)
            probs = answer_distribution(question, result.answers.get(qid))
            if probs is not None:
                items.append(Item(qid, question.kind.name, question.names, (tuple(probs),), label))
    return items


def order_changes(original: Sequence[Answered], permuted_answers: Sequence[Answered]) -> dict:
    """How often a labelled choice question's top answer changed with its options permuted."""
    by_line = {a.prepared.line.number: a for a in permuted_answers}
    asked = changed = 0
    for result in original:
        again = by_line.get(result.prepared.line.number)
        if again is None:
            continue
        for qid in result.prepared.labels:
            question = result.prepared.question(qid)
            if question.kind.name != "choice" or len(question.alternatives) < 2:
                continue
            first, second = top_name(question, result.answers.get(qid)), top_name(question, again.answers.get(qid))
            if first is None or second is None:
                continue
            asked += 1
            changed += first != second
    return {"questions": asked, "changed": changed, "rate": changed / asked if asked else None}


def run_eval(settings: Settings, data: Path, url: str | None = None, out_dir: Path | None = None,
             max_ece: float | None = None, permute: bool = True, seed: int = 0, timeout: float = 120.0,
             concurrency: int = DEFAULT_CONCURRENCY, stream: TextIO | None = None, reader: Reader | None = None) -> int:
    from app.build import CheckpointError
    from app.decisions.calibration import ID_BUCKET_LABELS
    from app.reliability import draw_reliability

    unreachable: tuple[type[Exception], ...] = ()
    if url:
        import httpx

        unreachable = (httpx.TransportError,)

    out: TextIO = stream or sys.stdout
    report = DataReport()
    lines = read_data(data, 0.0, report)
    prepared = [p for p in prepare(lines, settings, report) if p.labels]
    if not prepared:
        print_problems(report, sys.stderr)
        print(f"djev: {data}: no usable labelled question in {report.lines} line(s)", file=sys.stderr)
        return 2

    async def go() -> tuple[list[Answered], list[Answered], Any]:
        engine: Any = OverHTTP(url, settings, timeout) if url else InProcess(settings, record=False, reader=reader)
        async with engine:
            calibration = (await engine.health()).get("calibration") if url else (
                engine.calibration.identity() if engine.calibration else None)
            answered = await ask_all(engine.ask, [(p, p.line.request) for p in prepared], concurrency, "eval", report)
            again: list[Answered] = []
            if permute:
                work = [(p, permuted(p.line.request, seed, p.line.number)) for p in prepared
                        if any(p.question(q).kind.name == "choice" for q in p.labels)]
                again = await ask_all(engine.ask, work, concurrency, "eval, options permuted", report)
            return answered, again, calibration

    try:
        answered, again, calibration = asyncio.run(go())
    except (CalibrationError, CheckpointError) as exc:
        print(f"djev: {exc}", file=sys.stderr)
        return 2
    except unreachable as exc:
        print(f"djev: {url} cannot be reached ({type(exc).__name__}: {exc})", file=sys.stderr)
        return 2
    items = items_from_answers(answered)
    print_problems(report, sys.stderr)
    if not items:
        print(f"djev: {data}: no labelled question was answered", file=sys.stderr)
        return 2
    buckets = compare(items, None, own_buckets_of(items, ID_BUCKET_LABELS))
    order = order_changes(answered, again) if permute else None
    result = {
        "data": {"file": data.name, **report.as_json()},
        "against": url or "in process",
        "calibration": calibration,
        "buckets": {key: entry["before"] for key, entry in buckets.items()},
        "order": order,
    }
    print_table(f"answers of {len(answered)} line(s)", buckets, out)
    if order is not None:
        rate = "n/a" if order["rate"] is None else f"{order['rate']:.3f}"
        print(f"order: the top answer changed for {order['changed']} of {order['questions']} choice questions "
              f"with their options permuted ({rate})", file=out)
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "eval.json").write_text(json.dumps(result, indent=2) + "\n")
        draw_reliability(result["buckets"], out_dir / "reliability.png")
        print(f"wrote {out_dir / 'eval.json'} and {out_dir / 'reliability.png'}", file=out)
    overall = result["buckets"]["all"]["ece"]
    if max_ece is not None and overall > max_ece:
        print(f"djev: ECE {overall:.4f} is above --max-ece {max_ece}", file=sys.stderr)
        return 1
    return 0
