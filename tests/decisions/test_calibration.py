"""Fitted calibration, pure: the models recover a known miscalibration, the metrics are what their
definitions say, the buckets are chosen as documented, and the file format refuses what is wrong."""

from __future__ import annotations

import json
import math
import random

import pytest

from app.decisions.calibration import (
    CalibrationError,
    FittedFor,
    Item,
    Platt,
    Scaling,
    bucket_of,
    compare,
    fit,
    fit_platt,
    fit_scaling,
    kind_bucket,
    metrics,
    own_buckets_of,
    parse_calibration,
    read_calibration,
)

FOR = FittedFor(model="m", tokenizer="t" * 16, template_version="1", canvas=128, debias="off")


def test_platt_recovers_a_known_slope_and_offset():
    rng = random.Random(7)
    truth = Platt(a=0.6, b=-0.4)
    items = []
    for _ in range(4000):
        p = 1 / (1 + math.exp(-rng.gauss(0, 2.5)))
        label = 0 if rng.random() < truth.p_yes(p) else 1
        items.append(Item("n", "noul", ("yes", "no"), ((p, 1 - p),), label))
    fitted = fit_platt(items)
    assert fitted.a == pytest.approx(0.6, abs=0.06) and fitted.b == pytest.approx(-0.4, abs=0.1)


def test_platt_finds_yes_by_name_whatever_the_shown_order():
    rng = random.Random(3)
    items = []
    for _ in range(3000):
        p = 1 / (1 + math.exp(-rng.gauss(0, 2)))
        yes = rng.random() < Platt(2.0, 0.5).p_yes(p)
        items.append(Item("n", "noul", ("no", "yes"), ((1 - p, p),), 1 if yes else 0))
    fitted = fit_platt(items)
    assert fitted.a == pytest.approx(2.0, rel=0.15) and fitted.b == pytest.approx(0.5, abs=0.15)


def test_scaling_recovers_temperature_and_bias_on_synthetic_logits():
    rng = random.Random(11)
    truth = Scaling(temperature=2.5, bias=(0.6, 0.0, -0.6))
    items = []
    for _ in range(3000):
        z = [rng.gauss(0, 3) for _ in range(3)]
        peak = max(z)
        weights = [math.exp(v - peak) for v in z]
        p = tuple(w / sum(weights) for w in weights)
        label = rng.choices(range(3), truth.apply(p))[0]
        items.append(Item("c", "choice", ("a", "b", "c"), (p,), label))
    fitted = fit_scaling(items)
    assert fitted.temperature == pytest.approx(2.5, rel=0.1)
    assert fitted.bias[0] > 0.3 and fitted.bias[2] < -0.3


def test_the_draws_of_a_question_share_its_weight():
    rng = random.Random(2)
    once, twice = [], []
    for _ in range(300):
        p = rng.uniform(0.05, 0.95)
        label = 0 if rng.random() < 0.5 else 1
        once.append(Item("c", "choice", ("a", "b"), ((p, 1 - p),), label))
        twice.append(Item("c", "choice", ("a", "b"), ((p, 1 - p), (p, 1 - p)), label))
    a, b = fit_scaling(once), fit_scaling(twice)
    assert a.temperature == pytest.approx(b.temperature) and a.bias == pytest.approx(b.bias)


def test_metrics_by_hand():
    rows = [([0.7, 0.3], 0), ([0.7, 0.3], 1), ([0.2, 0.8], 1), ([0.55, 0.45], 0)]
    m = metrics(rows)
    assert m.count == 4 and m.accuracy == pytest.approx(0.75)
    # bins: 0.7 twice (half right), 0.8 once (right), 0.55 once (right)
    assert m.ece == pytest.approx((2 * abs(0.5 - 0.7) + abs(1 - 0.8) + abs(1 - 0.55)) / 4)
    brier = (0.18 + 0.98 + 0.08 + 2 * 0.45 ** 2) / 4
    assert m.brier == pytest.approx(brier)
    assert m.log_loss == pytest.approx(-(math.log(0.7) + math.log(0.3) + math.log(0.8) + math.log(0.55)) / 4)
    seven = m.bins[7]
    assert (seven.count, seven.confidence, seven.accuracy) == (2, pytest.approx(0.7), 0.5)
    assert metrics([]).count == 0


@pytest.mark.parametrize("kind, options, bucket", [
    ("noul", 2, "noul"), ("choice", 2, "choice:2"), ("choice", 4, "choice:4"), ("choice", 5, "choice:5-8"),
    ("choice", 8, "choice:5-8"), ("choice", 9, "choice:9+"), ("choice", 255, "choice:9+"),
    ("score", 2, "score:2-5"), ("score", 5, "score:2-5"), ("score", 6, "score:6+"), ("rank", 3, None),
])
def test_kind_buckets(kind, options, bucket):
    assert kind_bucket(kind, options) == bucket


def test_an_id_gets_its_own_bucket_from_100_labels_of_one_shape():
    items = [Item("team", "choice", ("a", "b", "c"), ((0.5, 0.3, 0.2),), 0)] * 100
    items += [Item("few", "choice", ("a", "b", "c"), ((0.5, 0.3, 0.2),), 0)] * 99
    own = own_buckets_of(items)
    assert own == {"team": ("choice", 3)}
    assert bucket_of("team", "choice", 3, own) == "id:team"
    assert bucket_of("team", "choice", 4, own) == "choice:4"  # another shape: its kind's
    assert bucket_of("few", "choice", 3, own) == "choice:3"
    calibration = fit(items, FOR)
    assert set(calibration.buckets) == {"id:team", "choice:3"}
    assert calibration.buckets["id:team"].options == 3 and calibration.buckets["choice:3"].train == 99


def test_compare_reports_before_and_after_per_bucket():
    rng = random.Random(5)
    items = []
    for _ in range(600):
        p = 1 / (1 + math.exp(-rng.gauss(0, 4)))
        label = 0 if rng.random() < Platt(0.3, 0.0).p_yes(p) else 1
        items.append(Item("n", "noul", ("yes", "no"), ((p, 1 - p),), label))
    calibration = fit(items[:300], FOR)
    report = compare(items[300:], calibration, {})
    assert set(report) == {"all", "noul"}
    assert report["noul"]["after"]["ece"] < report["noul"]["before"]["ece"]
    assert report["noul"]["after"]["log_loss"] < report["noul"]["before"]["log_loss"]


def written(**changes) -> dict:
    calibration = fit([Item("n", "noul", ("yes", "no"), ((0.8, 0.2),), 0), Item("n", "noul", ("yes", "no"), ((0.3, 0.7),), 1),
                       Item("c", "choice", ("a", "b"), ((0.6, 0.4),), 1)], FOR)
    data = json.loads(json.dumps(calibration.to_json()))
    for path, value in changes.items():
        target = data
        *parents, last = path.split(".")
        for part in parents:
            target = target[part]
        if value is ...:
            del target[last]
        else:
            target[last] = value
    return data


def test_a_written_file_reads_back_the_same():
    data = written()
    again = parse_calibration(data)
    assert again.to_json() == data
    loaded = read_calibration(json.dumps(data).encode(), "cal.json")
    assert loaded.source is not None and loaded.source["file"] == "cal.json" and len(loaded.source["sha256"]) == 12


@pytest.mark.parametrize("changes, message", [
    ({"format": "other"}, "format must be 'djev-calibration'"),
    ({"version": 2}, "version must be 1"),
    ({"fitted_for": ...}, "fitted_for must be an object"),
    ({"fitted_for.canvas": "128"}, "fitted_for.canvas must be an integer"),
    ({"fitted_for.debias": None}, "fitted_for.debias must be a string"),
    ({"buckets.noul.a": "x"}, "buckets['noul'].a must be a finite number"),
    ({"buckets.noul.method": "temperature"}, "buckets['noul'].method must be 'platt'"),
    ({"buckets.choice:2.temperature": 0}, "temperature must be more than 0"),
    ({"buckets.choice:2.bias": [0.0] * 17}, "bias must be a list of at most 16"),
    ({"buckets.choice:7": {"kind": "choice"}}, "not a bucket"),
    ({"buckets.noul.kind": "choice"}, "kind must be 'noul'"),
])
def test_a_malformed_file_is_refused_naming_the_field(changes, message):
    with pytest.raises(CalibrationError, match=message.replace("[", r"\[").replace("+", r"\+")):
        parse_calibration(written(**changes))


def test_bytes_that_are_not_json_are_refused():
    with pytest.raises(CalibrationError, match="not JSON"):
        read_calibration(b"{nope", "cal.json")


def test_mismatches_name_each_field_that_differs():
    other = FittedFor(model="n", tokenizer="t" * 16, template_version="2", canvas=64, debias="off")
    assert FOR.mismatches(other) == ["model: fitted for 'm', serving 'n'", "template_version: fitted for '1', serving '2'",
                                     "canvas: fitted for 128, serving 64"]
    assert FOR.mismatches(FOR) == []
