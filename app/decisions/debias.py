"""Order-free options (`debias`, docs/quality.md): the order each question's options are shown in,
the rotations of that order, a shown read mapped back to the caller's order, the average over
rotations, and the label prior divided out of a read.

Pure: no I/O. `app.decisions.run` builds the shown questions from these orders (their
`alternatives` permuted), reads them, and maps each estimate back here. An order is a tuple of the
caller's indices in shown order: shown position i holds the caller's option `order[i]`.
"""

from __future__ import annotations

import math
import threading
from collections import Counter, OrderedDict
from dataclasses import dataclass, replace
from typing import Mapping, Sequence

from app.decisions.estimate import Adjust, QuestionEstimate
from app.decisions.questions import Question, top_index

# The request key's values (and DEBIAS's; app/config.py keeps the same list): an order, with or
# without the label prior. `rotate` lists the canonical order and its shifts.
MODES = ("off", "canonical", "rotate", "prior", "canonical+prior", "rotate+prior")
ORDERS = ("off", "canonical", "rotate")

# The state of a prior read: content-free text, no images.
CONTENT_FREE_STATE = "N/A"
# The prior read's noise: its own fixed seed, so a sheet's prior is the same whatever the request's
# seed, and a few draws averaged, so it is not one noise token's.
PRIOR_SEED = 0
PRIOR_DRAWS = 4
# A prior probability is floored here before it divides a read (a label the prior gives no mass
# would otherwise take all of it).
PRIOR_FLOOR = 1e-6
PRIOR_ENTRIES = 256  # the Decider's LRU of priors: sheets, not requests

Order = tuple[int, ...]
Prior = tuple[tuple[float, ...], ...]  # per slot, the mean renormalised label distribution, in shown order


@dataclass(frozen=True)
class Debias:
    """A request's `debias`: which order the options are shown in, and whether the prior is divided out."""

    order: str = "off"  # "off" (the caller's order), "canonical" or "rotate"
    prior: bool = False

    @classmethod
    def parse(cls, mode: str) -> "Debias":
        if mode not in MODES:
            raise ValueError(f"debias must be one of {', '.join(MODES)}, not {mode!r}")
        order, _, prior = mode.partition("+")
        if order == "prior":
            return cls("off", True)
        return cls(order, prior == "prior")

    @property
    def mode(self) -> str:
        if not self.prior:
            return self.order
        return "prior" if self.order == "off" else f"{self.order}+prior"

    @property
    def off(self) -> bool:
        return self.order == "off" and not self.prior


OFF = Debias()


def canonical_order(question: Question) -> Order:
    """Options sorted by name (Unicode code points), so the order depends only on the set of names;
    noul's two answers too (`no` before `yes`). A score keeps its levels in sequence (the sequence is
    their meaning) but is listed in the direction chosen by its names alone (`scale_direction`), so a
    scale and its reverse are shown alike."""
    names = [alternative.name for alternative in question.alternatives]
    if question.kind.name == "score":
        return scale_direction(names)
    return tuple(sorted(range(len(names)), key=lambda index: names[index]))


def scale_direction(names: Sequence[str]) -> Order:
    """A scale's levels as sent, or reversed when the reversed list of names is the smaller (Python's
    order of lists of strings): `[low, mid, high]` is listed `high, mid, low` (`h` < `l`), and so is
    `[high, mid, low]`. A tie (a palindrome of names) keeps the scale as sent."""
    forwards = tuple(range(len(names)))
    return forwards[::-1] if list(names[::-1]) < list(names) else forwards


def reversed_scales(questions: Sequence[Question], orders: Mapping[str, Order]) -> tuple[str, ...]:
    """The score questions these orders list reversed (by qid, in the order given)."""
    return tuple(q.qid for q in questions
                 if q.kind.name == "score" and q.qid in orders and not is_identity(orders[q.qid]))


def listings(question: Question) -> int:
    """How many distinct listings `rotate` cycles through: every cyclic shift of the options, or a
    score's two directions (forwards, reversed)."""
    return 2 if question.kind.name == "score" else len(question.alternatives)


def rotation_count(questions: Sequence[Question], rotations: int) -> int:
    """K for a sheet listing `questions`: each question's listings, at most `rotations`
    (DEBIAS_ROTATIONS), and the most over the questions."""
    return max(min(listings(question), rotations) for question in questions)


def shift(j: int, count: int, k: int) -> int:
    """Rotation j's shift of `count` listings over K rotations: round(j·count/K) mod count, rounded
    half up, in integers."""
    return ((2 * j * count + k) // (2 * k)) % count


def rotated_order(question: Question, j: int, k: int) -> Order:
    """Rotation j of K: the canonical order shifted cyclically (shown position i holds canonical
    position i + shift), or a score in its canonical direction (even shifts) and the other (odd)."""
    base = canonical_order(question)
    s = shift(j, listings(question), k)
    if question.kind.name == "score":
        return base if s == 0 else base[::-1]
    return base[s:] + base[:s]


def shown_orders(order: str, questions: Sequence[Question], rotations: int) -> list[dict[str, Order]]:
    """Per read of a sheet listing `questions`, each question's shown order: one read for `off`
    (empty: the caller's order) and `canonical`, K for `rotate`."""
    if order == "off":
        return [{}]
    if order == "canonical":
        return [{q.qid: canonical_order(q) for q in questions}]
    k = rotation_count(questions, rotations)
    return [{q.qid: rotated_order(q, j, k) for q in questions} for j in range(k)]


def is_identity(order: Order) -> bool:
    return all(index == position for position, index in enumerate(order))


def shown_question(question: Question, order: Order | None) -> Question:
    """The question as the sheet lists it: its alternatives in shown order."""
    if order is None or is_identity(order):
        return question
    return replace(question, alternatives=tuple(question.alternatives[index] for index in order))


def shown_labels(question: Question, labels: tuple[str, ...], order: Order | None) -> tuple[str, ...]:
    """The labels of the shown listing. Letters and digits go by position, so a rotation moves an
    option to another label too (a label's own pull is part of the position bias); a reversed scale
    is labelled 1 at its top. Noul's `yes` and `no` are the answers themselves and follow them."""
    if order is None or question.kind.name != "noul":
        return labels
    return tuple(labels[index] for index in order)


def to_caller(values: Sequence[float], order: Order) -> list[float]:
    """Values in shown order back in the caller's order."""
    out = [0.0] * len(order)
    for position, index in enumerate(order):
        out[index] = values[position]
    return out


def divide_prior(probs: Sequence[float], prior: Sequence[float]) -> list[float]:
    """Contextual calibration: each label's probability divided by the content-free read's, renormalised."""
    ratios = [p / max(q, PRIOR_FLOOR) for p, q in zip(probs, prior)]
    total = sum(ratios)
    if not (total > 0 and math.isfinite(total)):
        return list(probs)
    return [ratio / total for ratio in ratios]


def mean_prior(draws: Sequence[Sequence[Sequence[float]]]) -> Prior:
    """The prior from a content-free read's draws (per draw, per slot, a renormalised distribution):
    per slot, the mean over the draws."""
    return tuple(tuple(sum(values) / len(draws) for values in zip(*slot)) for slot in zip(*draws))


def prior_adjust(priors: Mapping[str, Sequence[float]]) -> Adjust:
    """The group's per-read adjustment: each question's prior (by qid, in shown order) divided out."""

    def adjust(question: Question, probs: list[float]) -> list[float]:
        return divide_prior(probs, priors[question.qid])

    return adjust


def rotation_weights(orders: Sequence[Order]) -> list[float]:
    """Each distinct listing of a question weighs the same: in a canvas whose K is another
    question's, a listing some rotations repeat shares one listing's weight among them."""
    counts = Counter(orders)
    return [1.0 / (len(counts) * counts[order]) for order in orders]


def combine(estimates: Sequence[QuestionEstimate], orders: Sequence[Order]) -> QuestionEstimate:
    """One question's estimate in the caller's order from its reads in shown orders: one read mapped
    back; several averaged by option name (each distinct listing weighing the same), the top taken
    from the average, `stderr` and `agreement` across the reads (how much the order moved the
    answer), the per-draw entropies of every read, the slot and first-draw figures of the first."""
    if len(estimates) == 1:
        estimate, order = estimates[0], orders[0]
        if is_identity(order):
            return estimate
        probs = to_caller(estimate.probs, order)
        return replace(estimate, probs=tuple(probs), top=top_index(probs))
    weights = rotation_weights(orders)
    per_read = [to_caller(estimate.probs, order) for estimate, order in zip(estimates, orders)]
    mean = [sum(w * probs[i] for w, probs in zip(weights, per_read)) for i in range(len(orders[0]))]
    top = top_index(mean)
    n = len(per_read)
    chosen = [probs[top] for probs in per_read]
    centre = sum(chosen) / n
    variance = sum((c - centre) ** 2 for c in chosen) / (n - 1)
    first = estimates[0]
    return QuestionEstimate(
        probs=tuple(mean), top=top, entropies=tuple(e for estimate in estimates for e in estimate.entropies),
        slot=first.slot, label_mass=first.label_mass, argmax_is_label=first.argmax_is_label,
        stderr=math.sqrt(variance / n), agreement=sum(1 for probs in per_read if top_index(probs) == top) / n,
    )


@dataclass(frozen=True)
class Cost:
    """What debiasing one group cost: its reads of the state and its prior reads; and which of its
    scales its canonical listing showed reversed."""

    rotations: int  # prompts of the state (K; 1 for canonical or prior alone)
    reads: int  # reader calls for the state (auto's second call counts)
    canvases: int  # canvases of the state read (every draw of every rotation)
    prior_reads: int = 0  # content-free reads made (a prompt and PRIOR_DRAWS canvases each)
    prior_cached: int = 0  # content-free reads found in the cache
    reversed_scales: tuple[str, ...] = ()  # score qids its first (canonical) listing showed reversed


def cost_json(mode: str, costs: Sequence[Cost]) -> dict:
    """`diagnostics.debias`: the mode and what it cost over the decision's groups."""
    prior_reads = sum(c.prior_reads for c in costs)
    return {
        "mode": mode,
        "rotations": [c.rotations for c in costs],
        "prompts": sum(c.rotations for c in costs) + prior_reads,
        "reads": sum(c.reads for c in costs) + prior_reads,
        "canvases": sum(c.canvases for c in costs) + prior_reads * PRIOR_DRAWS,
        "prior": {"read": prior_reads, "cached": sum(c.prior_cached for c in costs)},
        "reversed_scales": [qid for c in costs for qid in c.reversed_scales],
    }


class PriorCache:
    """Priors by their content-free read (prompt ids, canvas ids, steps): a bounded LRU, safe across
    threads. Concurrent misses of one sheet may both read it; the later write wins, with the same value."""

    def __init__(self, entries: int = PRIOR_ENTRIES) -> None:
        self.entries = entries
        self._items: OrderedDict[tuple, Prior] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: tuple) -> Prior | None:
        with self._lock:
            found = self._items.get(key)
            if found is not None:
                self._items.move_to_end(key)
            return found

    def put(self, key: tuple, prior: Prior) -> None:
        with self._lock:
            self._items[key] = prior
            self._items.move_to_end(key)
            while len(self._items) > self.entries:
                self._items.popitem(last=False)

    def __len__(self) -> int:
        return len(self._items)
