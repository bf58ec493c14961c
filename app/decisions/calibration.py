"""Fitted calibration: the models, their fitting by log loss, the metrics, and the file format.

A read's renormalised label distribution is taken at temperature 1 as the model gives it. A fitted
calibration changes each read before the draws are averaged (an `Adjust`, app/decisions/estimate.py):

- noul: Platt scaling, P'(yes) = σ(a · logit P(yes) + b);
- choice and score: a temperature T and a bias per label position (the index in the shown order),
  p'_k ∝ exp(log p_k / T + bias_k), the biases L2-regularised (`BIAS_L2`); positions past
  `MAX_BIAS_POSITIONS` get none.

Parameters are fitted per *bucket*: a question id with at least `ID_BUCKET_LABELS` labels has its
own, every other question its kind's (noul; choice with 2, 3, 4, 5-8, 9+ options; score with 2-5
or 6+ levels). Fitting is damped Newton over the few parameters (the losses are convex), in plain
Python: no I/O here, no torch. The file (`Calibration.to_json`) records what it was fitted for, so a
server refuses one fitted for another model, tokenizer, template, canvas or debias mode.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

from app.decisions.questions import DIGIT_LABELS, LETTER_LABELS, Question, top_index

FORMAT = "djev-calibration"
FORMAT_VERSION = 1
ID_BUCKET_LABELS = 100  # labels a question id needs for a bucket of its own
MAX_BIAS_POSITIONS = 16  # label positions that get a bias; later ones get none
BIAS_L2 = 1.0  # the biases' penalty, λ Σ b², beside the summed (not averaged) log loss
ECE_BINS = 10
EPS = 1e-12  # probabilities are clamped to [EPS, 1 − EPS] before a log
INVERSE_TEMPERATURE = (1e-3, 1e3)  # 1/T is kept within this box


class CalibrationError(ValueError):
    """A calibration file that is malformed, or fitted for something other than what is served."""


# ---------------------------------------------------------------------------------------- buckets

def kind_bucket(kind: str, options: int) -> str | None:
    """The bucket of a question kind with this many alternatives (None: a kind calibration does not know)."""
    if kind == "noul":
        return "noul"
    if kind == "choice":
        if options <= 4:
            return f"choice:{options}"
        return "choice:5-8" if options <= 8 else "choice:9+"
    if kind == "score":
        return "score:2-5" if options <= 5 else "score:6+"
    return None


KIND_BUCKETS = ("noul", "choice:2", "choice:3", "choice:4", "choice:5-8", "choice:9+", "score:2-5", "score:6+")


def id_bucket(qid: str) -> str:
    return f"id:{qid}"


def bucket_of(qid: str, kind: str, options: int, own_buckets: Mapping[str, tuple[str, int]]) -> str | None:
    """The bucket a question falls in: its id's when `own_buckets` has one for the same kind and
    count of alternatives (qid -> (kind, options)), else its kind's."""
    own = own_buckets.get(qid)
    if own is not None and own == (kind, options):
        return id_bucket(qid)
    return kind_bucket(kind, options)


# ----------------------------------------------------------------------------------------- models

def _clamp(p: float) -> float:
    return min(1.0 - EPS, max(EPS, p))


def _logit(p: float) -> float:
    p = _clamp(p)
    return math.log(p / (1.0 - p))


def _sigmoid(z: float) -> float:
    if z >= 0:
        return 1.0 / (1.0 + math.exp(-z))
    e = math.exp(z)
    return e / (1.0 + e)


def _softmax(z: Sequence[float]) -> list[float]:
    peak = max(z)
    weights = [math.exp(v - peak) for v in z]
    total = sum(weights)
    return [w / total for w in weights]


@dataclass(frozen=True)
class Platt:
    """noul: P'(yes) = σ(a · logit P(yes) + b)."""

    a: float = 1.0
    b: float = 0.0

    def p_yes(self, p: float) -> float:
        return _sigmoid(self.a * _logit(p) + self.b)

    def as_json(self) -> dict:
        return {"method": "platt", "a": self.a, "b": self.b}


@dataclass(frozen=True)
class Scaling:
    """choice and score: p'_k ∝ exp(log p_k / T + bias_k), bias 0 past the fitted positions."""

    temperature: float = 1.0
    bias: tuple[float, ...] = ()

    def apply(self, probs: Sequence[float]) -> list[float]:
        inverse = 1.0 / self.temperature
        z = [inverse * math.log(_clamp(p)) + (self.bias[k] if k < len(self.bias) else 0.0) for k, p in enumerate(probs)]
        return _softmax(z)

    def as_json(self) -> dict:
        return {"method": "temperature", "temperature": self.temperature, "bias": list(self.bias)}


Model = Platt | Scaling


def _yes_index(names: Sequence[str]) -> int:
    return names.index("yes") if "yes" in names else 0


def apply_model(model: Model, names: Sequence[str], probs: Sequence[float]) -> list[float]:
    """One read's distribution (shown order; `names` the alternatives in that order) calibrated."""
    if isinstance(model, Platt):
        yes = _yes_index(names)
        p = model.p_yes(probs[yes])
        return [p if k == yes else 1.0 - p for k in range(len(probs))]
    return model.apply(probs)


# ---------------------------------------------------------------------------------------- fitting

@dataclass(frozen=True)
class Item:
    """One labelled question as it was read: each draw's renormalised distribution in the shown
    order, the alternatives' names in that order, and the index of the expected answer among them."""

    qid: str
    kind: str
    names: tuple[str, ...]
    reads: tuple[tuple[float, ...], ...]
    label: int

    def answer(self, model: Model | None) -> list[float]:
        """The answer's distribution as the server forms it: each draw calibrated, then averaged."""
        reads = [list(r) if model is None else apply_model(model, self.names, r) for r in self.reads]
        return [sum(values) / len(reads) for values in zip(*reads)]


def _solve(matrix: list[list[float]], vector: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting (the systems here are at most 17 x 17)."""
    n = len(vector)
    a = [row[:] + [vector[i]] for i, row in enumerate(matrix)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
        if abs(a[pivot][col]) < 1e-300:
            raise ZeroDivisionError("singular system")
        a[col], a[pivot] = a[pivot], a[col]
        for r in range(col + 1, n):
            factor = a[r][col] / a[col][col]
            if factor:
                for c in range(col, n + 1):
                    a[r][c] -= factor * a[col][c]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (a[r][n] - sum(a[r][c] * x[c] for c in range(r + 1, n))) / a[r][r]
    return x


def _newton(loss_grad_hess, theta: list[float], project, iterations: int = 100, tolerance: float = 1e-9) -> list[float]:
    """Damped Newton: the Newton step, halved until the loss falls (a gradient step when the Hessian
    fails), each point projected onto the parameters' box."""
    loss, grad, hess = loss_grad_hess(theta)
    for _ in range(iterations):
        try:
            step = _solve(hess, grad)
        except ZeroDivisionError:
            step = grad
        scale = 1.0
        while scale > 1e-10:
            candidate = project([t - scale * s for t, s in zip(theta, step)])
            new_loss, new_grad, new_hess = loss_grad_hess(candidate)
            if new_loss <= loss:
                break
            scale /= 2
        else:
            break
        improvement = loss - new_loss
        theta, loss, grad, hess = candidate, new_loss, new_grad, new_hess
        if improvement < tolerance * max(1.0, abs(loss)):
            break
    return theta


def fit_platt(items: Sequence[Item], ridge: float = 1e-6) -> Platt:
    """Platt's a and b by log loss over every draw (a question's draws share its weight)."""
    points = []
    for item in items:
        yes = _yes_index(item.names)
        for read in item.reads:
            points.append((_logit(read[yes]), 1.0 if item.label == yes else 0.0, 1.0 / len(item.reads)))

    def loss_grad_hess(theta: list[float]):
        a, b = theta
        loss = ga = gb = haa = hab = hbb = 0.0
        for x, y, w in points:
            z = a * x + b
            p = _sigmoid(z)
            # log(1 + e^z) − y z, computed without overflow
            loss += w * ((max(z, 0.0) + math.log1p(math.exp(-abs(z)))) - y * z)
            r = w * (p - y)
            ga += r * x
            gb += r
            v = w * p * (1.0 - p)
            haa += v * x * x
            hab += v * x
            hbb += v
        loss += ridge * (a * a + b * b)
        return loss, [ga + 2 * ridge * a, gb + 2 * ridge * b], [[haa + 2 * ridge, hab], [hab, hbb + 2 * ridge]]

    a, b = _newton(loss_grad_hess, [1.0, 0.0], lambda t: t)
    return Platt(a, b)


def fit_scaling(items: Sequence[Item], l2: float = BIAS_L2) -> Scaling:
    """T and the position biases by log loss over every draw (a question's draws share its weight),
    plus `l2` Σ bias²."""
    width = min(MAX_BIAS_POSITIONS, max(len(item.names) for item in items))
    points = []
    for item in items:
        for read in item.reads:
            points.append(([math.log(_clamp(p)) for p in read], item.label, 1.0 / len(item.reads)))
    low, high = INVERSE_TEMPERATURE

    def loss_grad_hess(theta: list[float]):
        s, bias = theta[0], theta[1:]
        n = 1 + width
        loss = 0.0
        grad = [0.0] * n
        hess = [[0.0] * n for _ in range(n)]
        for logs, label, w in points:
            z = [s * lp + (bias[k] if k < width else 0.0) for k, lp in enumerate(logs)]
            q = _softmax(z)
            loss += w * (-math.log(max(q[label], 1e-300)))
            # features of class k: (log p_k, e_k for k < width)
            mean_s = sum(qk * lp for qk, lp in zip(q, logs))
            grad[0] += w * (mean_s - logs[label])
            hess[0][0] += w * (sum(qk * lp * lp for qk, lp in zip(q, logs)) - mean_s * mean_s)
            for j in range(min(width, len(q))):
                grad[1 + j] += w * (q[j] - (1.0 if j == label else 0.0))
                cross = w * (q[j] * logs[j] - q[j] * mean_s)
                hess[0][1 + j] += cross
                hess[1 + j][0] += cross
                for k in range(min(width, len(q))):
                    hess[1 + j][1 + k] += w * ((q[j] if j == k else 0.0) - q[j] * q[k])
        for j in range(width):
            loss += l2 * bias[j] * bias[j]
            grad[1 + j] += 2 * l2 * bias[j]
            hess[1 + j][1 + j] += 2 * l2
        return loss, grad, hess

    def project(theta: list[float]) -> list[float]:
        return [min(high, max(low, theta[0])), *theta[1:]]

    theta = _newton(loss_grad_hess, [1.0] + [0.0] * width, project)
    return Scaling(temperature=1.0 / theta[0], bias=tuple(theta[1:]))


def fit_model(kind: str, items: Sequence[Item]) -> Model:
    return fit_platt(items) if kind == "noul" else fit_scaling(items)


# ---------------------------------------------------------------------------------------- metrics

@dataclass(frozen=True)
class Bin:
    lower: float
    upper: float
    count: int
    confidence: float  # mean top-answer probability of the answers in the bin (0 when empty)
    accuracy: float  # share of them whose top answer was the label (0 when empty)

    def as_json(self) -> dict:
        return {"lower": self.lower, "upper": self.upper, "count": self.count,
                "confidence": self.confidence, "accuracy": self.accuracy}


@dataclass(frozen=True)
class Metrics:
    """Over answers (distribution, label): ECE over `ECE_BINS` equal-width bins of the top answer's
    probability, Brier (Σ over the alternatives of (p − 1[label])², so a noul's is twice the binary
    one), log loss (−ln p_label), accuracy, and the reliability diagram's bins."""

    count: int
    ece: float
    brier: float
    log_loss: float
    accuracy: float
    bins: tuple[Bin, ...]

    def as_json(self) -> dict:
        return {"count": self.count, "ece": self.ece, "brier": self.brier, "log_loss": self.log_loss,
                "accuracy": self.accuracy, "bins": [b.as_json() for b in self.bins]}


def metrics(answers: Iterable[tuple[Sequence[float], int]], bins: int = ECE_BINS) -> Metrics:
    rows = list(answers)
    counts = [0] * bins
    confidence = [0.0] * bins
    correct = [0.0] * bins
    brier = log_loss = hits = 0.0
    for probs, label in rows:
        top = top_index(probs)
        p_top = probs[top]
        index = min(bins - 1, int(p_top * bins + 1e-9))  # 0.7 computed as 0.6999999999 is in the 0.7 bin
        counts[index] += 1
        confidence[index] += p_top
        correct[index] += 1.0 if top == label else 0.0
        hits += 1.0 if top == label else 0.0
        brier += sum((p - (1.0 if k == label else 0.0)) ** 2 for k, p in enumerate(probs))
        log_loss += -math.log(_clamp(probs[label]))
    n = len(rows)
    table = tuple(
        Bin(i / bins, (i + 1) / bins, counts[i], confidence[i] / counts[i] if counts[i] else 0.0,
            correct[i] / counts[i] if counts[i] else 0.0)
        for i in range(bins)
    )
    if n == 0:
        return Metrics(0, 0.0, 0.0, 0.0, 0.0, table)
    ece = sum(b.count * abs(b.accuracy - b.confidence) for b in table) / n
    return Metrics(n, ece, brier / n, log_loss / n, hits / n, table)


# ------------------------------------------------------------------------------- the calibration

@dataclass(frozen=True)
class FittedFor:
    """What a calibration was fitted on; a server serving anything else refuses the file."""

    model: str  # the served model name
    tokenizer: str  # `tokenizer_fingerprint`
    template_version: str  # app/decisions/prompt.py TEMPLATE_VERSION
    canvas: int  # CANVAS
    debias: str  # the option-order mode the reads were taken under ("off")

    def as_json(self) -> dict:
        return {"model": self.model, "tokenizer": self.tokenizer, "template_version": self.template_version,
                "canvas": self.canvas, "debias": self.debias}

    def mismatches(self, serving: "FittedFor") -> list[str]:
        """Each field that differs: `canvas: fitted for 128, serving 64`."""
        return [f"{name}: fitted for {mine!r}, serving {theirs!r}"
                for name, mine, theirs in zip(self.as_json(), self.as_json().values(), serving.as_json().values())
                if mine != theirs]


@dataclass(frozen=True)
class Bucket:
    key: str
    kind: str
    options: int | None  # an id bucket: its question's count of alternatives; a kind bucket: None
    model: Model
    train: int  # labelled questions it was fitted on

    def as_json(self) -> dict:
        out: dict[str, Any] = {"kind": self.kind}
        if self.options is not None:
            out["options"] = self.options
        return {**out, **self.model.as_json(), "train": self.train}


@dataclass(frozen=True)
class Calibration:
    fitted_for: FittedFor
    buckets: dict[str, Bucket]
    report: dict = field(default_factory=dict)  # what the fit measured (split, metrics per bucket), kept as written
    source: dict | None = None  # {"file", "sha256"} of the file it was read from

    def own_buckets(self) -> dict[str, tuple[str, int]]:
        return {key[3:]: (b.kind, b.options) for key, b in self.buckets.items()
                if key.startswith("id:") and b.options is not None}

    def model_for(self, qid: str, kind: str, options: int) -> Model | None:
        """The question id's own model where one was fitted for its shape, else its kind bucket's."""
        own = self.buckets.get(id_bucket(qid))
        if own is not None and own.kind == kind and own.options == options:
            return own.model
        key = kind_bucket(kind, options)
        bucket = self.buckets.get(key) if key else None
        return bucket.model if bucket is not None else None

    def adjust(self, question: Question, probs: list[float]) -> list[float]:
        """An `Adjust`: one read's distribution (shown order) calibrated by its bucket's model;
        unchanged where no bucket was fitted."""
        model = self.model_for(question.qid, question.kind.name, len(question.alternatives))
        if model is None:
            return probs
        return apply_model(model, question.names, probs)

    def identity(self) -> dict:
        """What `/health` and `diagnostics` say of it: its file's name and a short hash of the content."""
        if self.source is not None:
            return self.source
        return {"file": None, "sha256": content_digest(json.dumps(self.to_json(), sort_keys=True).encode())}

    def to_json(self) -> dict:
        return {"format": FORMAT, "version": FORMAT_VERSION, "fitted_for": self.fitted_for.as_json(),
                "buckets": {key: b.as_json() for key, b in self.buckets.items()}, "report": self.report}


def fit(items: Sequence[Item], fitted_for: FittedFor, min_id_labels: int = ID_BUCKET_LABELS) -> Calibration:
    """A bucket for every question id with at least `min_id_labels` labelled questions (all of one
    kind and count of alternatives), and one per kind bucket for the rest; each fitted on its items."""
    own = own_buckets_of(items, min_id_labels)
    by_bucket: dict[str, list[Item]] = {}
    for item in items:
        key = bucket_of(item.qid, item.kind, len(item.names), own)
        if key is not None:
            by_bucket.setdefault(key, []).append(item)
    buckets = {}
    for key in sorted(by_bucket):
        members = by_bucket[key]
        kind = members[0].kind
        options = len(members[0].names) if key.startswith("id:") else None
        buckets[key] = Bucket(key, kind, options, fit_model(kind, members), len(members))
    return Calibration(fitted_for, buckets)


def own_buckets_of(items: Sequence[Item], min_id_labels: int = ID_BUCKET_LABELS) -> dict[str, tuple[str, int]]:
    """qid -> (kind, options) for each id with enough labels, all of one shape."""
    shapes: dict[str, set[tuple[str, int]]] = {}
    counts: dict[str, int] = {}
    for item in items:
        shapes.setdefault(item.qid, set()).add((item.kind, len(item.names)))
        counts[item.qid] = counts.get(item.qid, 0) + 1
    return {qid: next(iter(shape)) for qid, shape in shapes.items()
            if counts[qid] >= min_id_labels and len(shape) == 1}


def compare(items: Sequence[Item], calibration: Calibration | None, own: Mapping[str, tuple[str, int]]) -> dict:
    """Metrics before and after `calibration` per bucket (and "all"), as JSON."""
    grouped: dict[str, list[Item]] = {"all": list(items)}
    for item in items:
        key = bucket_of(item.qid, item.kind, len(item.names), own)
        if key is not None:
            grouped.setdefault(key, []).append(item)
    out = {}
    for key, members in grouped.items():
        before = metrics((item.answer(None), item.label) for item in members)
        entry: dict[str, Any] = {"before": before.as_json()}
        if calibration is not None:
            after = metrics((item.answer(calibration.model_for(item.qid, item.kind, len(item.names))), item.label)
                            for item in members)
            entry["after"] = after.as_json()
        out[key] = entry
    return out


# ------------------------------------------------------------------------------------ the file

def tokenizer_fingerprint(tokenizer: Any) -> str:
    """16 hex of a SHA-256 over what calibration depends on in a tokenizer: its special ids, its
    vocabulary size and how it encodes every label candidate and a probe answer template."""
    probe = " ".join(("yes", "no", *DIGIT_LABELS, *LETTER_LABELS))
    parts = [tokenizer.vocab_size, tokenizer.pad_id, tokenizer.turn_close_id, tokenizer.image_placeholder_id,
             list(tokenizer.thought_open), list(tokenizer.thought_close), tokenizer.encode(probe),
             tokenizer.encode("q1: yes\nq2: A\nq3: 1"), tokenizer.encode("q1yes q2A q3b")]
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:16]


def content_digest(data: bytes) -> str:
    """The short hash `/health` and `diagnostics` name a calibration file by."""
    return hashlib.sha256(data).hexdigest()[:12]


def _number(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise CalibrationError(f"{where} must be a finite number, not {value!r}")
    return float(value)


def _text(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise CalibrationError(f"{where} must be a string, not {value!r}")
    return value


def _count(value: Any, where: str, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise CalibrationError(f"{where} must be an integer of at least {least}, not {value!r}")
    return value


def _object(value: Any, where: str) -> dict:
    if not isinstance(value, dict):
        raise CalibrationError(f"{where} must be an object, not {type(value).__name__}")
    return value


def parse_calibration(data: Any, source: dict | None = None) -> Calibration:
    """A calibration from its JSON (as `Calibration.to_json` writes it); CalibrationError names the
    first field that is missing or wrong."""
    data = _object(data, "the file")
    if data.get("format") != FORMAT:
        raise CalibrationError(f"format must be {FORMAT!r}, not {data.get('format')!r}")
    if data.get("version") != FORMAT_VERSION:
        raise CalibrationError(f"version must be {FORMAT_VERSION}, not {data.get('version')!r}")
    meta = _object(data.get("fitted_for"), "fitted_for")
    fitted_for = FittedFor(
        model=_text(meta.get("model"), "fitted_for.model"),
        tokenizer=_text(meta.get("tokenizer"), "fitted_for.tokenizer"),
        template_version=_text(meta.get("template_version"), "fitted_for.template_version"),
        canvas=_count(meta.get("canvas"), "fitted_for.canvas", 1),
        debias=_text(meta.get("debias"), "fitted_for.debias"),
    )
    buckets: dict[str, Bucket] = {}
    for key, raw in _object(data.get("buckets"), "buckets").items():
        where = f"buckets[{key!r}]"
        entry = _object(raw, where)
        kind = _text(entry.get("kind"), f"{where}.kind")
        options: int | None = None
        if key.startswith("id:"):
            options = _count(entry.get("options"), f"{where}.options", 2)
            if kind_bucket(kind, options) is None:
                raise CalibrationError(f"{where}.kind must be noul, choice or score, not {kind!r}")
        elif key not in KIND_BUCKETS:
            raise CalibrationError(f"{where}: not a bucket (id:<question id> or one of {', '.join(KIND_BUCKETS)})")
        elif kind != key.split(":")[0]:
            raise CalibrationError(f"{where}.kind must be {key.split(':')[0]!r}, not {kind!r}")
        method = entry.get("method")
        model: Model
        if kind == "noul":
            if method != "platt":
                raise CalibrationError(f"{where}.method must be 'platt' for a noul, not {method!r}")
            model = Platt(_number(entry.get("a"), f"{where}.a"), _number(entry.get("b"), f"{where}.b"))
        else:
            if method != "temperature":
                raise CalibrationError(f"{where}.method must be 'temperature' for a {kind}, not {method!r}")
            temperature = _number(entry.get("temperature"), f"{where}.temperature")
            if temperature <= 0:
                raise CalibrationError(f"{where}.temperature must be more than 0, not {temperature!r}")
            bias = entry.get("bias")
            if not isinstance(bias, list) or len(bias) > MAX_BIAS_POSITIONS:
                raise CalibrationError(f"{where}.bias must be a list of at most {MAX_BIAS_POSITIONS} numbers")
            model = Scaling(temperature, tuple(_number(b, f"{where}.bias[{i}]") for i, b in enumerate(bias)))
        buckets[key] = Bucket(key, kind, options, model, _count(entry.get("train", 0), f"{where}.train", 0))
    report = data.get("report", {})
    return Calibration(fitted_for, buckets, report if isinstance(report, dict) else {}, source)


def read_calibration(content: bytes, name: str) -> Calibration:
    """A calibration from a file's bytes (`name` is what /health and diagnostics call it)."""
    try:
        data = json.loads(content)
    except (UnicodeDecodeError, ValueError) as exc:
        raise CalibrationError(f"not JSON ({exc})") from None
    return parse_calibration(data, {"file": name, "sha256": content_digest(content)})
