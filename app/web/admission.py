"""Admission control: a bounded amount of work in flight, counted two ways.

By count (MAX_INFLIGHT decisions and generations at once) and by cost (MAX_INFLIGHT_COST: the
canvases plus thought tokens of the work in flight, so one `think: 4096` request weighs what it
costs the engine, not what one canvas does). Past either the server sheds load with Jev's 529
Overloaded and a Retry-After the official clients honour, instead of queueing without bound. One
request that costs more than the whole budget could never be admitted: that is the client's 400,
naming the field that makes it expensive.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

from app.web.errors import RETRY_AFTER_SECONDS, RETRY_HEADERS, HTTPError


class Admission:
    def __init__(self, max_requests: int, max_cost: int) -> None:
        self.max_requests = max_requests
        self.max_cost = max_cost
        self.in_flight = 0
        self.cost = 0

    def check_fits(self, cost: int, field: str) -> None:
        """A 400 naming `field` when `cost` alone is more than the whole budget."""
        if cost > self.max_cost:
            raise HTTPError(
                400,
                f"{field}: this request costs {cost} (canvases plus thought tokens), more than this server "
                f"admits at once (MAX_INFLIGHT_COST={self.max_cost}); ask for less {field}",
                param=field,
            )

    @contextmanager
    def admit(self, cost: int) -> Iterator[None]:
        """Hold a slot and `cost` for the body of the `with`, or raise the 529."""
        if self.in_flight >= self.max_requests:
            raise _overloaded(f"{self.in_flight} requests in flight")
        if self.cost + cost > self.max_cost:
            raise _overloaded(f"{self.cost} of {self.max_cost} cost units in flight")
        self.in_flight += 1
        self.cost += cost
        try:
            yield
        finally:
            self.in_flight -= 1
            self.cost -= cost


def _overloaded(why: str) -> HTTPError:
    return HTTPError(529, f"overloaded: {why}; retry after {RETRY_AFTER_SECONDS} s", headers=dict(RETRY_HEADERS))
