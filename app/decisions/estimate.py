"""From a group's reads to its estimates: each question's label distribution averaged over the noise
draws, the chosen alternative, and the per-read statistics `diagnostics` reports.

Pure arithmetic over `ReadResult`s; it grows with questions x options x draws, so the Decider runs it
off the event loop.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

from app.decisions.questions import Question, entropy, softmax, top_index
from app.engine.base import ReadResult


@dataclass(frozen=True)
class QuestionEstimate:
    """One question's answer distribution and how sure the reads were of it."""

    probs: tuple[float, ...]  # renormalised over the labels, averaged over the draws
    top: int  # the most probable alternative (ties: the earliest)
    entropies: tuple[float, ...]  # per draw
    slot: int  # the canvas position read
    label_mass: float  # first draw: probability mass the whole vocabulary put on the labels
    argmax_is_label: bool  # first draw: the model's own argmax was one of the labels
    stderr: float | None  # of the chosen alternative's probability across draws (n > 1)
    agreement: float | None  # share of draws whose top was the chosen alternative (n > 1)

    def diagnostics(self) -> dict:
        out: dict = {"pos": self.slot, "entropy": list(self.entropies), "label_mass": self.label_mass,
                     "argmax_is_label": self.argmax_is_label}
        if self.stderr is not None:
            out["stderr"] = self.stderr
            out["agreement"] = self.agreement
        return out


# A change to one read's renormalised label distribution before the draws are averaged (the label
# prior divided out, a fitted calibration): the question as shown on the canvas, the distribution in
# its shown order; returns a distribution over the same labels. `samples: "auto"` decides on the raw one.
Adjust = Callable[[Question, list[float]], list[float]]


def chain(*steps: Adjust | None) -> Adjust | None:
    """The adjustments given, applied in order; None when there are none."""
    present = [step for step in steps if step is not None]
    if not present:
        return None
    if len(present) == 1:
        return present[0]

    def adjusted(question: Question, probs: list[float]) -> list[float]:
        for step in present:
            probs = step(question, probs)
        return probs

    return adjusted


def first_read_entropies(questions: Sequence[Question], result: ReadResult) -> dict[str, float]:
    """The entropy of each question's renormalised label distribution in the first draw (`auto`
    re-reads when any is above its threshold)."""
    return {q.qid: entropy(softmax(slot.label_logprobs)) for q, slot in zip(questions, result.slots[0])}


def estimate(
    questions: Sequence[Question], results: Sequence[ReadResult], slots: Sequence[int],
    label_ids: Sequence[Sequence[int]], adjust: Adjust | None = None,
) -> tuple[dict[str, QuestionEstimate], list[dict]]:
    """Per question its estimate; per draw the top alternative of every question
    ({qid: [name, p, entropy]}, what `diagnostics.samples.tops` lists). `adjust`, when given, changes
    every draw's distribution before anything is taken from it."""
    draws = [[softmax(slot.label_logprobs) for slot in canvas] for result in results for canvas in result.slots]
    if adjust is not None:
        draws = [[adjust(q, probs) for q, probs in zip(questions, draw)] for draw in draws]
    first = results[0].slots[0]
    n = len(draws)
    tops: list[dict] = [{} for _ in range(n)]
    estimates: dict[str, QuestionEstimate] = {}
    for qi, question in enumerate(questions):
        per_draw = [draw[qi] for draw in draws]
        mean = [sum(values) / n for values in zip(*per_draw)]
        top = top_index(mean)
        entropies = tuple(entropy(p) for p in per_draw)
        for r, probs in enumerate(per_draw):
            best = top_index(probs)
            tops[r][question.qid] = [question.alternatives[best].name, probs[best], entropies[r]]
        stderr = agreement = None
        if n > 1:
            chosen = [p[top] for p in per_draw]
            variance = sum((c - mean[top]) ** 2 for c in chosen) / (n - 1)
            stderr = math.sqrt(variance / n)
            agreement = sum(1 for p in per_draw if top_index(p) == top) / n
        estimates[question.qid] = QuestionEstimate(
            probs=tuple(mean), top=top, entropies=entropies, slot=slots[qi],
            label_mass=sum(math.exp(lp) for lp in first[qi].label_logprobs),
            argmax_is_label=first[qi].argmax_id in label_ids[qi],
            stderr=stderr, agreement=agreement,
        )
    return estimates, tops
