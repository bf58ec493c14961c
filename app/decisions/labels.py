"""Label alphabets: which label strings are one token at an answer slot for a tokenizer, so a
question's alternatives can be read at one position. Past A-Z the candidates are further strings,
verified here for the loaded tokenizer."""

from __future__ import annotations

import threading

from app.decisions.template import answer_text
from app.engine.base import ChatTokenizer


class LabelAlphabets:
    """Verified alphabets for one tokenizer, each label set and format checked once, then cached.
    Safe to use from several worker threads at once."""

    def __init__(self, tokenizer: ChatTokenizer) -> None:
        self.tokenizer = tokenizer
        self._alphabets: dict[tuple, tuple[str, ...]] = {}
        self._lock = threading.Lock()

    def labels(self, candidates: tuple[str, ...], count: int, fmt: str) -> tuple[str, ...]:
        """The first `count` candidates that are one token at a slot for this tokenizer."""
        alphabet = self._alphabet(candidates, fmt)
        return alphabet[:count]

    def _alphabet(self, candidates: tuple[str, ...], fmt: str) -> tuple[str, ...]:
        """Verified once per label set and format, then cached."""
        key = (candidates, fmt)
        with self._lock:
            found = self._alphabets.get(key)
        if found is None:
            found = self._verify_alphabet(candidates, fmt)
            with self._lock:
                self._alphabets[key] = found
        return found

    def _verify_alphabet(self, candidates: tuple[str, ...], fmt: str) -> tuple[str, ...]:
        """Keep the candidates that differ from a reference candidate at exactly one token, at the
        same position, in a probe template. The reference is the first candidate that works."""
        encode = self.tokenizer.encode
        for base in candidates[:8]:
            def probe(label: str) -> list[int]:
                return encode(answer_text([("q9", label), ("q10", base)], fmt))

            base_ids = probe(base)
            kept = [base]
            slot = None
            for candidate in candidates:
                if candidate == base:
                    continue
                ids = probe(candidate)
                if len(ids) != len(base_ids):
                    continue
                diffs = [i for i, (a, b) in enumerate(zip(ids, base_ids)) if a != b]
                if len(diffs) != 1 or (slot is not None and diffs[0] != slot):
                    continue
                slot = diffs[0]
                kept.append(candidate)
            if len(kept) > 1:
                order = {label: index for index, label in enumerate(candidates)}
                return tuple(sorted(kept, key=order.__getitem__))
        return ()
