"""The official Jev client (`typesafe-sdk` from PyPI, unmodified) against a real uvicorn server on
127.0.0.1 serving the tiny model: sync and async, all three answer types, with and without a key,
zstd-compressed bodies, models.list, error classes."""

from __future__ import annotations

import asyncio

import pytest
import typesafe_sdk as ts

from app.config import Settings
from app.server import create_app
from tests.conftest import live_server, make_tiny_reader

QUESTIONS = {
    "urgent": ts.Noul(instructions="Does the customer need a reply within the hour?",
                      criteria=ts.NoulCriteria(true="needs a reply now", false="can wait")),
    "team": ts.Choice(instructions="Which team owns this?",
                      criteria={"billing": None, "outage": "service down", "feature": None}),
    "tone": ts.Score(instructions="How angry is the customer?", criteria=["calm", "annoyed", "furious"]),
}
STATE = {"ticket": "Everything is down and we have a demo at noon."}


@pytest.fixture(scope="module")
def server(tiny_dir):
    with live_server(create_app(Settings(), make_tiny_reader(tiny_dir))) as url:
        yield url


@pytest.fixture(scope="module")
def keyed_server(tiny_dir):
    with live_server(create_app(Settings.of(api_key="sdk-key"), make_tiny_reader(tiny_dir))) as url:
        yield url


def check(result) -> None:
    assert result.model == "djev-tiny-random"
    assert set(result.answers) == {"urgent", "team", "tone"}
    assert 0.0 <= result.nouls["urgent"].noul <= 1.0
    team = result.choices["team"]
    assert team.choice in ("billing", "outage", "feature")
    assert list(team.probabilities) == ["billing", "outage", "feature"]
    tone = result.scores["tone"]
    assert tone.legend == {0: "calm", 1: "annoyed", 2: "furious"}
    assert set(tone.probabilities) == {0, 1, 2}
    assert result.usage.input_tokens > 0 and result.usage.output_tokens > 0
    assert result.request_id.startswith("req_")


def test_sync_client(server):
    with ts.TypeSafeClient(api_key="anything", base_url=server, compression=False) as client:
        check(client.system_one(STATE, QUESTIONS))
        check(client.system_one("a plain text state", QUESTIONS, model="jev-1.13.0"))
        models = client.models.list()
        assert [m.name for m in models.models][:2] == ["jev-latest", "jev-preview"]


def test_async_client_concurrently(server):
    async def main():
        async with ts.AsyncTypeSafeClient(api_key="anything", base_url=server) as client:
            results = await asyncio.gather(*(client.system_one(STATE, QUESTIONS) for _ in range(6)))
            for result in results:
                check(result)
            await client.models.list()

    asyncio.run(main())


def test_zstd_compressed_bodies_from_the_sdk(server):
    long_state = {"ticket": "Everything is down and we have a demo at noon. " * 40}  # > 1 KiB: compressed
    with ts.TypeSafeClient(api_key="anything", base_url=server, compression="zstd") as client:
        check(client.system_one(long_state, QUESTIONS))


def test_extensions_through_extra_body(server):
    with ts.TypeSafeClient(api_key="anything", base_url=server) as client:
        result = client.system_one(STATE, QUESTIONS, extra_body={"samples": 2, "seed": 3})
        check(result)
        diagnostics = result.raw_http_response.json()["diagnostics"]
        assert diagnostics["samples"]["n"] == 2


def test_with_api_key(keyed_server):
    with ts.TypeSafeClient(api_key="sdk-key", base_url=keyed_server) as client:
        check(client.system_one(STATE, QUESTIONS))
    with ts.TypeSafeClient(api_key="wrong-key", base_url=keyed_server) as client:
        with pytest.raises(ts.TypeSafeAuthenticationError) as info:
            client.system_one(STATE, QUESTIONS)
        assert "Cannot authenticate" in str(info.value)


def test_async_with_api_key(keyed_server):
    async def main():
        async with ts.AsyncTypeSafeClient(api_key="sdk-key", base_url=keyed_server) as client:
            check(await client.system_one(STATE, QUESTIONS))

    asyncio.run(main())


def test_validation_errors_reach_the_sdk_as_readable_exceptions(server):
    with ts.TypeSafeClient(api_key="anything", base_url=server, retry=ts.RetryPolicy(max_retries=0)) as client:
        with pytest.raises(ts.TypeSafeBadRequestError) as info:
            client.system_one(STATE, {"big": ts.Choice(criteria={f"o{i}": None for i in range(256)})})
        assert "Too many choices" in str(info.value)
        with pytest.raises(ts.TypeSafeUnprocessableEntityError) as info:
            client.system_one(STATE, {"one": {"type": "choice", "criteria": {"only": None}}})
        assert "at least two" in str(info.value)
