"""The remote engine's upstreams: vLLM OpenAI servers reached over HTTP, with routing, health
checks, one retry elsewhere, and errors that name the upstream.

Routing: each request goes to the healthy upstream with the fewest requests outstanding (ties
rotate). A failed request is retried once on another upstream (reads are idempotent); an upstream
whose connection fails is taken out of rotation at once, and the health check (`GET /health` every
`health_interval` seconds) brings it back. An upstream's failure is an `EngineError` naming it (502);
no upstream left to try is `EngineUnavailable` (503), naming each upstream once with its last error.
While some are down and some up the pool is `degraded` (`/health` says so and lists each one's state).
A cancelled request closes its connection (httpx closes a connection whose request is cancelled).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Sequence, TypeVar

import httpx

from app.engine.base import (
    EngineError,
    EngineInputError,
    EngineUnavailable,
    UpstreamState,
    describe,
    upstreams_degraded,
    upstreams_unavailable,
)

log = logging.getLogger("djev.engine")

T = TypeVar("T")

# An answer this large (a canvas of many positions, each with many label logprobs: 128 x 128 is
# ~1.3 MB of JSON, ~20 ms to decode and parse) is decoded and parsed in a worker thread, not on the
# event loop; a small one costs less than the hop.
OFFLOAD_ANSWER_BYTES = 64 * 1024


@dataclass
class Upstream:
    url: str
    healthy: bool = False
    outstanding: int = 0
    last_error: str = "not checked yet"  # the bare error (the URL is `url`); "" while healthy
    counts: Counter = field(default_factory=Counter)


class Failed(Exception):
    """One request to one upstream failed; `down` when the upstream could not be reached at all,
    `retry` when another upstream may well answer (not for a refusal of the request itself).
    `reason` is the message without the upstream's URL (what its `last_error` keeps)."""

    def __init__(self, upstream: Upstream, message: str, *, down: bool = False, retry: bool = True) -> None:
        super().__init__(f"upstream {upstream.url}: {message}")
        self.reason = message
        self.down = down
        self.retry = retry


class UpstreamPool:
    def __init__(self, urls: Sequence[str], *, connect_timeout: float, read_timeout: float,
                 health_interval: float) -> None:
        if not urls:
            raise ValueError("the remote engine needs at least one --upstream URL")
        self.upstreams = [Upstream(url.rstrip("/")) for url in urls]
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.health_interval = health_interval
        self.counts: Counter[str] = Counter()
        self.client: httpx.AsyncClient | None = None
        self._health_task: asyncio.Task | None = None
        self._turn = 0

    @property
    def ready(self) -> bool:
        return self.client is not None and any(upstream.healthy for upstream in self.upstreams)

    @property
    def states(self) -> list[UpstreamState]:
        return [UpstreamState(u.url, u.healthy, None if u.healthy else (u.last_error or "down")) for u in self.upstreams]

    @property
    def degraded(self) -> str | None:
        """Why the pool serves with less while some upstreams are down and some up; else None."""
        if self.client is None:
            return None
        return upstreams_degraded(self.states)

    @property
    def stats(self) -> dict[str, float]:
        return {
            **self.counts,
            "upstreams_healthy": sum(upstream.healthy for upstream in self.upstreams),
            "outstanding": sum(upstream.outstanding for upstream in self.upstreams),
        }

    # ------------------------------------------------------------------ life and health

    async def start(self) -> None:
        if self.client is not None:
            return
        timeout = httpx.Timeout(connect=self.connect_timeout, read=self.read_timeout, write=self.read_timeout,
                                pool=self.read_timeout)
        self.client = httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=1024,
                                                                              max_keepalive_connections=64))
        await self.check_health()
        for upstream in self.upstreams:
            if not upstream.healthy:
                log.warning("upstream %s is not healthy yet: %s", upstream.url, upstream.last_error)
        self._health_task = asyncio.create_task(self._health_loop(), name="djev-upstream-health")

    async def stop(self) -> None:
        task, self._health_task = self._health_task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        client, self.client = self.client, None
        if client is not None:
            await client.aclose()

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval)
            await self.check_health()

    async def check_health(self) -> None:
        await asyncio.gather(*(self._check(upstream) for upstream in self.upstreams))

    async def _check(self, upstream: Upstream) -> None:
        assert self.client is not None
        timeout = httpx.Timeout(self.connect_timeout, read=min(5.0, self.read_timeout))
        try:
            response = await self.client.get(f"{upstream.url}/health", timeout=timeout)
            healthy = response.status_code == 200
            error = "" if healthy else f"GET /health answered {response.status_code}"
        except httpx.HTTPError as exc:
            healthy, error = False, describe(exc)
        if healthy != upstream.healthy:
            log.log(logging.INFO if healthy else logging.WARNING, "upstream %s is %s%s", upstream.url,
                    "healthy" if healthy else "down", "" if healthy else f": {error}")
        upstream.healthy, upstream.last_error = healthy, error

    # ------------------------------------------------------------------ routing

    def _pick(self, tried: Sequence[Upstream]) -> Upstream | None:
        candidates = [u for u in self.upstreams if u.healthy and u not in tried]
        if not candidates:
            return None
        self._turn += 1
        count = len(self.upstreams)
        rank = {id(u): (index - self._turn) % count for index, u in enumerate(self.upstreams)}
        return min(candidates, key=lambda u: (u.outstanding, rank[id(u)]))

    def _all_down(self) -> EngineUnavailable:
        return EngineUnavailable(upstreams_unavailable(self.states))

    async def call(self, attempt: Callable[[Upstream], Awaitable[T]]) -> T:
        """Run `attempt` on the least loaded healthy upstream; once more on another if it fails."""
        if self.client is None:
            raise EngineUnavailable("the engine is not running")
        tried: list[Upstream] = []
        failure: Failed | None = None
        for _ in range(2):
            upstream = self._pick(tried)
            if upstream is None:
                break
            tried.append(upstream)
            upstream.outstanding += 1
            try:
                upstream.counts["requests"] += 1
                self.counts["requests"] += 1
                return await attempt(upstream)
            except Failed as exc:
                failure = exc
                upstream.counts["failures"] += 1
                self.counts["failures"] += 1
                if exc.down:
                    upstream.healthy, upstream.last_error = False, exc.reason
                log.warning("%s", exc)
                if not exc.retry:
                    break
                self.counts["retries"] += 1
            finally:
                upstream.outstanding -= 1
        if failure is None or (failure.down and not any(u.healthy for u in self.upstreams)):
            raise self._all_down()
        raise EngineError(str(failure))

    # ------------------------------------------------------------------ requests

    async def post_json(self, upstream: Upstream, path: str, body: dict,
                        parse: Callable[[Any], T] | None = None) -> Any:
        """POST a JSON body, return the JSON answer (`parse(answer)` when given); anything else
        raises Failed (or EngineInputError for a prompt past the upstream's context: the client's
        input, not a failure). An answer of OFFLOAD_ANSWER_BYTES or more is decoded and parsed in a
        worker thread."""
        assert self.client is not None
        try:
            response = await self.client.post(upstream.url + path, json=body)
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            raise Failed(upstream, f"cannot connect ({describe(exc)})", down=True) from None
        except httpx.TimeoutException as exc:
            raise Failed(upstream, f"no answer within the timeout ({describe(exc)})") from None
        except httpx.HTTPError as exc:
            raise Failed(upstream, f"the connection failed ({describe(exc)})", down=True) from None
        if response.status_code == 400 and "maximum context length" in error_text(response):
            raise EngineInputError(f"upstream {upstream.url}: {error_text(response)}", status=400, param="state",
                                   error_type="max_tokens_exceeded")
        if response.status_code != 200:
            raise Failed(upstream, f"{path} answered {response.status_code}: {error_text(response)}",
                         retry=response.status_code >= 500)
        content = response.content

        def decoded() -> Any:
            try:
                answer = json.loads(content)
            except ValueError:
                raise Failed(upstream, f"{path} answered with something that is not JSON: {content[:80]!r}") from None
            return answer if parse is None else parse(answer)

        if len(content) >= OFFLOAD_ANSWER_BYTES:
            return await asyncio.to_thread(decoded)
        return decoded()

    async def open_stream(self, upstream: Upstream, path: str, body: dict, *,
                          any_status: bool = False) -> tuple[httpx.Response, Upstream]:
        """POST and return the response with its body still to be read, holding the upstream as
        outstanding until `close_stream`. A status other than 200 raises Failed unless `any_status`
        (the raw relay hands vLLM's own errors back as they are)."""
        assert self.client is not None
        request = self.client.build_request("POST", upstream.url + path, json=body)
        try:
            response = await self.client.send(request, stream=True)
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            raise Failed(upstream, f"cannot connect ({describe(exc)})", down=True) from None
        except httpx.HTTPError as exc:
            raise Failed(upstream, f"the request failed ({describe(exc)})", retry=False) from None
        if response.status_code != 200 and not any_status:
            await response.aread()
            await response.aclose()
            raise Failed(upstream, f"{path} answered {response.status_code}: {error_text(response)}",
                         retry=response.status_code >= 500)
        upstream.outstanding += 1
        return response, upstream

    @staticmethod
    async def close_stream(response: httpx.Response, upstream: Upstream) -> None:
        upstream.outstanding -= 1
        await response.aclose()


def error_text(response: httpx.Response) -> str:
    """vLLM's error message from an error answer, else the start of its body."""
    try:
        payload = response.json()
        error = payload.get("error") if isinstance(payload, dict) else None
        message = error.get("message") if isinstance(error, dict) else payload.get("message")
        if isinstance(message, str):
            return message[:300]
    except (ValueError, AttributeError):
        pass
    return response.text[:200]
