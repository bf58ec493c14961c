"""Running a request's work: prepared off the loop (inline for a small plain body), admitted by cost, bounded by
REQUEST_TIMEOUT, and dropped when the client leaves.

Cancellation is how a reader drops queued work (the Reader contract), so both the deadline and a
disconnect end a decision the same way: the task awaiting it is cancelled.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, TypeVar

from starlette.responses import Response
from starlette.types import Receive

from app.decisions.chat import chat_to_body
from app.decisions.debias import OFF
from app.decisions.outcome import Outcome
from app.decisions.plan import Plan
from app.decisions.request import Decision, parse_decision
from app.engine.base import current_caller, new_caller
from app.web.body import RawBody, parse_payload
from app.web.errors import ClientGone, render_json
from app.web.images import check_images
from app.web.services import Services

log = logging.getLogger("djev.decisions")
T = TypeVar("T")


async def guarded(svc: Services, work: Callable[[], Awaitable[T]], receive: Receive | None = None) -> T:
    """`await work()` under REQUEST_TIMEOUT (TimeoutError past it: a 504), cancelled when `receive`
    (the request's ASGI channel, its body already read) reports the client gone (ClientGone).

    Plain asyncio: a watcher task cancels the request's own task on a disconnect. (An anyio task
    group, cancel scope and fail_after did the same for ~0.8 ms more of the event loop a request on
    the CPU box, which every request pays: docs/design.md §5.2, bench/bench_overhead.py.)"""
    task = asyncio.current_task()
    assert task is not None
    gone = False
    watcher: asyncio.Task[None] | None = None

    async def watch() -> None:
        nonlocal gone
        assert receive is not None and task is not None
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                gone = True
                task.cancel()
                return

    if receive is not None:
        watcher = asyncio.create_task(watch(), name="djev-disconnect-watch")
    try:
        async with asyncio.timeout(svc.settings.limits.request_timeout):
            outcome = await work()
    except asyncio.CancelledError:
        if gone and task.uncancel() == 0:  # our own cancel, and no other pending: the client left
            raise ClientGone() from None
        raise
    finally:
        if watcher is not None:
            watcher.cancel()
    if gone:  # not expected (the watcher's cancel lands in the await above), but never answer a gone client
        task.uncancel()
        raise ClientGone()
    return outcome


def unwrap(error: BaseException) -> BaseException:
    """The exception that ended a task group, out of its exception group: the first, where several
    tasks failed (a camera session's two loops); `guarded`'s group only ever holds the work's own."""
    while isinstance(error, BaseExceptionGroup) and error.exceptions:
        error = error.exceptions[0]
    return error


@dataclass(frozen=True)
class Prepared:
    decision: Decision
    plan: Plan  # made once, while preparing: priced for admission, then run
    body: Any  # the parsed JSON body (the chat form echoes its model)

    @property
    def cost(self) -> int:
        return self.plan.cost


def prepare(svc: Services, raw: RawBody, chat_form: bool = False) -> Prepared:
    """Parse, validate and price a decision request (blocking: `Services.prepare` runs it inline for a
    small plain body, in the worker pool otherwise)."""
    settings = svc.settings
    payload = parse_payload(raw, settings.limits.max_body_bytes)
    body = chat_to_body(payload.body) if chat_form else payload.body
    decision = parse_decision(body, svc.limits, images=payload.images, assets=payload.assets)
    return Prepared(decision, checked_plan(svc, decision), payload.body)


def checked_plan(svc: Services, decision: Decision) -> Plan:
    """The decision's images checked and its plan made (blocking: part of `prepare`)."""
    check_images(decision.images, svc.settings.limits.max_image_pixels)
    return priced_plan(svc, decision)


def priced_plan(svc: Services, decision: Decision) -> Plan:
    """The decision's plan; a 400 naming the expensive field when the decision alone costs more than
    the whole admission budget (blocking: run through `Services.prepare`, inline for a small body and
    in the worker pool otherwise, or for a camera frame). Its images must be checked already."""
    plan = svc.plan(decision)
    if plan.cost > svc.admission.max_cost:
        svc.admission.check_fits(plan.cost, expensive_field(svc, decision))
    return plan


def expensive_field(svc: Services, decision: Decision) -> str:
    """Which field to name when a decision costs too much: the first of think, samples and debias
    whose removal alone brings it within budget, else the questions."""
    budget = svc.admission.max_cost
    cheaper = []
    if decision.think:
        cheaper.append(("think", dataclasses.replace(decision, think=0)))
    if decision.samples.count > 1:
        cheaper.append(("samples", dataclasses.replace(decision, samples=dataclasses.replace(decision.samples, count=1))))
    if not decision.debias.off:
        cheaper.append(("debias", dataclasses.replace(decision, debias=OFF)))
    for name, variant in cheaper:
        if svc.plan(variant).cost <= budget:
            return name
    return "questions"


async def decide(svc: Services, prepared: Prepared, route: str, receive: Receive | None = None) -> Outcome:
    """Run one decision admitted by its cost, under the deadline, count it and log it in one line."""
    started = time.perf_counter()
    token = current_caller.set(new_caller())  # the engine shares its batches fairly among decisions
    try:
        with svc.admission.admit(prepared.cost):
            outcome = await guarded(svc, lambda: svc.decider.decide(prepared.decision, prepared.plan), receive)
    finally:
        current_caller.reset(token)
    svc.metrics.decided(route, outcome, time.perf_counter() - started)
    log.info("%s: %s", route, outcome.summary)
    return outcome


# Up to this many answer options, rendering the response takes tens of microseconds: less than a
# trip to the worker pool, so it stays on the loop.
INLINE_RENDER_OPTIONS = 256


def options_in(decision: Decision) -> int:
    return sum(len(question.alternatives) for question in decision.questions)


async def rendered(svc: Services, options: int, render: Callable[..., bytes], *args: Any) -> bytes:
    """`render(*args)`, in the worker pool when the answer is large (`options` answer options: an
    answer to 256 questions of 255 options is megabytes of JSON), else right here."""
    if options <= INLINE_RENDER_OPTIONS:
        return render(*args)
    return await svc.offload(render, *args)


async def json_reply(svc: Services, payload: Any, options: int) -> Response:
    """A JSON response, rendered where `rendered` says."""
    return Response(await rendered(svc, options, render_json, payload), media_type="application/json")
