"""Admission control: a bounded number of decisions in flight. Past it the server sheds load with
Jev's 529 Overloaded and a Retry-After the official clients honour, instead of queueing without
bound."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

from app.web.errors import HTTPError

RETRY_AFTER_SECONDS = 1


class Admission:
    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.in_flight = 0
        self.shed = 0

    @contextmanager
    def slot(self) -> Iterator[None]:
        if self.in_flight >= self.limit:
            self.shed += 1
            raise HTTPError(
                529,
                f"overloaded: {self.in_flight} decisions in flight; retry after {RETRY_AFTER_SECONDS} s",
                headers={"retry-after": str(RETRY_AFTER_SECONDS), "retry-after-ms": str(RETRY_AFTER_SECONDS * 1000)},
            )
        self.in_flight += 1
        try:
            yield
        finally:
            self.in_flight -= 1
