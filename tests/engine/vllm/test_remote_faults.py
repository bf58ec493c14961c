"""The remote engine against fake vLLM servers (tests/engine/vllm/fake_vllm.py, each its own process):
what it sends, how it routes and retries, and what a client sees when an upstream refuses, hangs,
answers garbage or dies mid-request: 502 naming the upstream, 503 when none is left, and nothing
leaked (no task left running, every request the fake saw closed); what `/health` says of the
upstreams as they go down and come back. No vLLM needed."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from app.config import Settings
from app.engine.base import (
    EngineError,
    EngineInputError,
    EngineUnavailable,
    GenerateSpec,
    ImageInput,
    Prompt,
    ReadSpec,
    UpstreamState,
    upstreams_degraded,
    upstreams_unavailable,
)
from app.engine.tiny import TINY_MODEL_NAME
from app.engine.vllm.remote import RemoteOptions, load_remote_reader
from app.server import create_app, free_port, serve_in_background
from tests.engine.vllm.fake_vllm import argmax_at, fake_logprob

REPO = Path(__file__).resolve().parents[3]


class Fake:
    def __init__(self, port: int, process: subprocess.Popen) -> None:
        self.port, self.process = port, process
        self.url = f"http://127.0.0.1:{port}"

    def mode(self, mode: str) -> None:
        httpx.post(f"{self.url}/_mode", json={"mode": mode}, timeout=5).raise_for_status()

    def state(self) -> dict:
        return httpx.get(f"{self.url}/_state", timeout=5).json()

    def reset(self) -> None:
        self.mode("ok")


@contextmanager
def fake_upstream(mode: str = "ok", port: int | None = None):
    port = port or free_port()
    process = subprocess.Popen([sys.executable, "-m", "tests.engine.vllm.fake_vllm", str(port), mode], cwd=REPO)
    fake = Fake(port, process)
    deadline = time.monotonic() + 30
    while True:
        try:
            httpx.get(f"{fake.url}/health", timeout=1)
            break
        except httpx.HTTPError:
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the fake upstream did not start")
            time.sleep(0.1)
    try:
        yield fake
    finally:
        process.terminate()
        process.wait(timeout=10)


@pytest.fixture(scope="module")
def fakes():
    with fake_upstream() as first, fake_upstream() as second:
        yield first, second


def options(*urls: str, read_timeout: float = 5.0, health_interval: float = 0.2) -> RemoteOptions:
    return RemoteOptions(upstreams=tuple(urls), connect_timeout=1.0, read_timeout=read_timeout,
                         health_interval=health_interval, max_prompt_tokens=4096, served_name=TINY_MODEL_NAME,
                         canvas_length=128, tiny=True)


def a_spec(tokenizer, canvases: int = 2, steps: int = 1, labels: int = 2) -> ReadSpec:
    prompt = Prompt(tuple(tokenizer.render_chat("Answer.", "the state", 0, thinking=False)))
    width = 16
    base = [tokenizer.pad_id] * width
    slots = (2, 5)
    label_ids = tuple(tuple(range(100 + s * 300, 100 + s * 300 + labels)) for s in range(len(slots)))
    rows = []
    for index in range(canvases):
        canvas = list(base)
        for slot in slots:
            canvas[slot] = 40 + index
        rows.append(tuple(canvas))
    return ReadSpec(prompt, tuple(rows), slots, label_ids, steps, seed=3)


async def with_reader(reader, body):
    await reader.start()
    try:
        return await body()
    finally:
        await reader.stop()


def leftover_tasks() -> list[asyncio.Task]:
    return [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]


def test_a_read_sends_one_request_per_canvas_with_the_canvas_fields(fakes, tiny_dir, tokenizer):
    fake = fakes[0]
    fake.reset()
    seen_before = len(fake.state()["bodies"])
    spec = a_spec(tokenizer, canvases=3, steps=2)
    reader = load_remote_reader(tiny_dir, options(fake.url))
    [result] = asyncio.run(with_reader(reader, lambda: reader.read([spec])))
    bodies = fake.state()["bodies"][seen_before:]
    assert len(bodies) == 3
    assert sorted(tuple(b["vllm_xargs"]["diffusion_seed_canvas"]) for b in bodies) == sorted(spec.canvases)
    for body in bodies:
        assert body["prompt"] == list(spec.prompt.ids)
        assert body["max_tokens"] == 16
        assert body["logprob_token_ids"] == sorted({i for labels in spec.label_ids for i in labels})
        assert body["logprobs"] == len(body["logprob_token_ids"])
        assert body["return_tokens_as_token_ids"] is True
        xargs = body["vllm_xargs"]
        assert xargs["diffusion_canvas_length"] == 16 and xargs["diffusion_max_steps"] == 2
        assert xargs["diffusion_read_only"] is True
        assert xargs["diffusion_pinned"] == [p for p in range(16) if p not in spec.slots]
        assert "seed" not in body and "temperature" not in body
    for canvas in result.slots:
        for slot, labels, read in zip(spec.slots, spec.label_ids, canvas):
            assert read.label_logprobs == tuple(fake_logprob(i, slot) for i in labels)
            assert read.argmax_id == argmax_at(slot)
    assert result.prompt_tokens == len(spec.prompt.ids)


def test_one_step_reads_send_no_pins(fakes, tiny_dir, tokenizer):
    fake = fakes[0]
    fake.reset()
    seen_before = len(fake.state()["bodies"])
    reader = load_remote_reader(tiny_dir, options(fake.url))
    asyncio.run(with_reader(reader, lambda: reader.read([a_spec(tokenizer, canvases=1)])))
    [body] = fake.state()["bodies"][seen_before:]
    assert "diffusion_pinned" not in body["vllm_xargs"]


def test_255_label_ids_are_split_into_requests_of_at_most_128_and_merged(fakes, tiny_dir, tokenizer):
    fake = fakes[0]
    fake.reset()
    seen_before = len(fake.state()["bodies"])
    prompt = Prompt(tuple(tokenizer.render_chat("Pick.", "state", 0, thinking=False)))
    labels = tuple(range(200, 455))
    spec = ReadSpec(prompt, ((0,) * 16,), (3,), (labels,), 1, 0)
    reader = load_remote_reader(tiny_dir, options(fake.url))
    [result] = asyncio.run(with_reader(reader, lambda: reader.read([spec])))
    bodies = fake.state()["bodies"][seen_before:]
    assert sorted(len(b["logprob_token_ids"]) for b in bodies) == [127, 128]
    assert sorted(i for b in bodies for i in b["logprob_token_ids"]) == list(labels)
    assert result.slots[0][0].label_logprobs == tuple(fake_logprob(i, 3) for i in labels)


def test_a_large_answer_is_decoded_and_parsed_off_the_event_loop(fakes, tiny_dir, tokenizer, monkeypatch):
    from app.engine.vllm import remote as vllm_remote
    from app.engine.vllm import upstreams

    fake = fakes[0]
    fake.reset()
    threads = []
    parse = vllm_remote.parse_completion_read

    def recording(answer):
        parsed = parse(answer)
        threads.append((len(parsed.argmax_ids), threading.current_thread() is threading.main_thread()))
        return parsed

    monkeypatch.setattr(vllm_remote, "parse_completion_read", recording)
    prompt = Prompt(tuple(tokenizer.render_chat("Pick.", "state", 0, thinking=False)))
    labels = tuple(range(200, 328))
    small = ReadSpec(prompt, ((0,) * 16,), (3,), (labels[:2],), 1, 0)  # 16 positions x 2 logprobs
    large = ReadSpec(prompt, ((0,) * 128,), (3,), (labels,), 1, 0)  # 128 positions x 128 logprobs
    reader = load_remote_reader(tiny_dir, options(fake.url))
    small_result, large_result = asyncio.run(with_reader(reader, lambda: reader.read([small, large])))
    assert sorted(threads) == [(16, True), (128, False)]  # the small answer on the loop, the large one not
    assert large_result.slots[0][0].label_logprobs == tuple(fake_logprob(i, 3) for i in labels)
    assert small_result.slots[0][0].label_logprobs == tuple(fake_logprob(i, 3) for i in labels[:2])
    assert upstreams.OFFLOAD_ANSWER_BYTES > 2_000  # the small answer is a few kB


def test_reads_go_to_the_upstream_with_fewest_outstanding(fakes, tiny_dir, tokenizer):
    for fake in fakes:
        fake.mode("slow")
    before = [len(fake.state()["bodies"]) for fake in fakes]
    reader = load_remote_reader(tiny_dir, options(*(fake.url for fake in fakes)))
    asyncio.run(with_reader(reader, lambda: reader.read([a_spec(tokenizer, canvases=8)])))
    after = [len(fake.state()["bodies"]) for fake in fakes]
    assert [a - b for a, b in zip(after, before)] == [4, 4]
    for fake in fakes:
        fake.reset()


@pytest.mark.parametrize("mode, words", [
    ("garbage", "not JSON"), ("badshape", "unusable answer"), ("error500", "answered 500: engine crashed"),
    ("error400", "answered 400: bad field"),
])
def test_a_bad_answer_is_an_engine_error_naming_the_upstream(fakes, tiny_dir, tokenizer, mode, words):
    fake = fakes[0]
    fake.mode(mode)
    reader = load_remote_reader(tiny_dir, options(fake.url))

    async def body():
        with pytest.raises(EngineError) as caught:
            await reader.read([a_spec(tokenizer)])
        assert not isinstance(caught.value, EngineUnavailable)
        return str(caught.value), leftover_tasks()

    message, tasks = asyncio.run(with_reader(reader, body))
    fake.reset()
    assert fake.url in message and words in message
    assert [t.get_name() for t in tasks] == ["djev-upstream-health"]  # only the reader's own health check


def test_a_bad_upstream_is_retried_on_another(fakes, tiny_dir, tokenizer):
    bad, good = fakes
    bad.mode("garbage")
    reader = load_remote_reader(tiny_dir, options(bad.url, good.url))
    results = asyncio.run(with_reader(reader, lambda: reader.read([a_spec(tokenizer, canvases=4)])))
    bad.reset()
    assert len(results[0].slots) == 4
    assert reader.stats["retries"] >= 1


def test_a_hanging_upstream_times_out_with_its_name_and_its_request_is_closed(fakes, tiny_dir, tokenizer):
    fake = fakes[0]
    fake.mode("hang")
    left_before = fake.state()["client_left"]
    reader = load_remote_reader(tiny_dir, options(fake.url, read_timeout=0.5))

    async def body():
        with pytest.raises(EngineError) as caught:
            await reader.read([a_spec(tokenizer, canvases=2)])
        return str(caught.value)

    message = asyncio.run(with_reader(reader, body))
    assert fake.url in message and "no answer within the timeout" in message
    deadline = time.monotonic() + 5
    while fake.state()["open"] and time.monotonic() < deadline:
        time.sleep(0.05)
    state = fake.state()
    fake.reset()
    assert state["open"] == 0 and state["client_left"] - left_before == 2


def test_a_cancelled_read_closes_its_requests(fakes, tiny_dir, tokenizer):
    fake = fakes[0]
    fake.mode("hang")
    left_before = fake.state()["client_left"]
    reader = load_remote_reader(tiny_dir, options(fake.url, read_timeout=60))

    async def body():
        task = asyncio.create_task(reader.read([a_spec(tokenizer, canvases=3)]))
        await asyncio.sleep(0.5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return leftover_tasks(), reader.stats["outstanding"]

    tasks, outstanding = asyncio.run(with_reader(reader, body))
    deadline = time.monotonic() + 5
    while fake.state()["open"] and time.monotonic() < deadline:
        time.sleep(0.05)
    state = fake.state()
    fake.reset()
    assert [t.get_name() for t in tasks] == ["djev-upstream-health"] and outstanding == 0
    assert state["open"] == 0 and state["client_left"] - left_before == 3


def test_an_upstream_that_refuses_connections_is_unavailable(tiny_dir, tokenizer):
    url = f"http://127.0.0.1:{free_port()}"
    reader = load_remote_reader(tiny_dir, options(url))

    async def body():
        assert not reader.ready
        with pytest.raises(EngineUnavailable) as caught:
            await reader.read([a_spec(tokenizer)])
        return str(caught.value)

    message = asyncio.run(with_reader(reader, body))
    assert url in message and "no upstream available" in message


def test_an_upstream_that_dies_mid_request_is_taken_out_and_the_read_retried(fakes, tiny_dir, tokenizer):
    good = fakes[1]
    good.reset()
    with fake_upstream("die") as dying:
        reader = load_remote_reader(tiny_dir, options(dying.url, good.url, health_interval=30))

        async def body():
            results = await reader.read([a_spec(tokenizer, canvases=4)])
            return results, [u.healthy for u in reader.upstreams]

        results, healthy = asyncio.run(with_reader(reader, body))
        assert dying.process.wait(timeout=5) == 3
    assert len(results[0].slots) == 4 and healthy == [False, True]


def test_the_only_upstream_dying_mid_request_leaves_none(tiny_dir, tokenizer):
    with fake_upstream("die") as dying:
        reader = load_remote_reader(tiny_dir, options(dying.url, health_interval=30))

        async def body():
            with pytest.raises(EngineUnavailable) as caught:
                await reader.read([a_spec(tokenizer)])
            return str(caught.value)

        message = asyncio.run(with_reader(reader, body))
    assert named_once(message, dying.url) and "no upstream available" in message


def named_once(message: str, url: str) -> bool:
    """`url` is in `message` exactly once (not as the start of a longer port)."""
    return len(re.findall(re.escape(url) + r"(?!\d)", message)) == 1


def test_a_dead_upstream_comes_back_after_a_health_check(tiny_dir, tokenizer):
    port = free_port()
    reader = load_remote_reader(tiny_dir, options(f"http://127.0.0.1:{port}", health_interval=0.2))

    async def body():
        assert not reader.ready
        process = subprocess.Popen([sys.executable, "-m", "tests.engine.vllm.fake_vllm", str(port), "ok"], cwd=REPO)
        try:
            deadline = time.monotonic() + 30
            while not reader.ready and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            return await reader.read([a_spec(tokenizer, canvases=1)])
        finally:
            process.terminate()
            process.wait(timeout=10)

    results = asyncio.run(with_reader(reader, body))
    assert len(results) == 1


def test_a_prompt_past_the_limit_is_refused_before_sending(fakes, tiny_dir, tokenizer):
    reader = load_remote_reader(tiny_dir, options(fakes[0].url))
    spec = a_spec(tokenizer)
    long = ReadSpec(Prompt(tuple(range(5000))), spec.canvases, spec.slots, spec.label_ids)

    async def body():
        with pytest.raises(EngineInputError) as caught:
            await reader.read([long])
        return caught.value

    error = asyncio.run(with_reader(reader, body))
    assert error.status == 400 and error.param == "state"


def test_generation_streams_and_stops_at_a_stop_id(fakes, tiny_dir, tokenizer):
    fake = fakes[0]
    fake.reset()
    reader = load_remote_reader(tiny_dir, options(fake.url))
    prompt = Prompt(tuple(tokenizer.render_chat("Think.", "state", 0, thinking=True)))
    spec = GenerateSpec(prompt, max_tokens=100, stop_ids=(7,), seed=5)

    async def body():
        chunks = [chunk async for chunk in reader.stream(spec)]
        whole = await reader.generate(spec)
        return chunks, whole

    chunks, whole = asyncio.run(with_reader(reader, body))
    assert [c.ids for c in chunks] == [(50, 51, 52), (53, 54), ()]
    assert chunks[-1].done and chunks[-1].stopped and not chunks[0].done
    assert whole.ids == (50, 51, 52, 53, 54) and whole.stopped and whole.prompt_tokens == len(prompt.ids)
    sent = fake.state()["bodies"][-1]
    assert sent["stream"] is True and sent["prompt"] == list(prompt.ids) and "seed" not in sent


def test_generation_refuses_a_temperature_vllm_cannot_apply(fakes, tiny_dir, tokenizer):
    reader = load_remote_reader(tiny_dir, options(fakes[0].url))
    spec = GenerateSpec(Prompt((1, 2, 3)), 10, (7,), 0, temperature=0.0)

    async def body():
        with pytest.raises(EngineInputError) as caught:
            await reader.generate(spec)
        return caught.value

    assert asyncio.run(with_reader(reader, body)).param == "temperature"


def test_raw_chat_is_relayed_unchanged_whole_and_streamed(fakes, tiny_dir):
    fake = fakes[0]
    fake.reset()
    reader = load_remote_reader(tiny_dir, options(fake.url))
    request = {"model": "anything", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}

    async def body():
        whole = await reader.relay_chat(request)
        streamed = await reader.relay_chat({**request, "stream": True})
        chunks = [chunk async for chunk in streamed.chunks]
        return whole, streamed, b"".join(chunks)

    whole, streamed, text = asyncio.run(with_reader(reader, body))
    assert whole.status == 200 and json.loads(whole.body)["echo"] == request
    assert streamed.status == 200 and streamed.media_type.startswith("text/event-stream")
    assert text.count(b"data: ") == 4 and text.endswith(b"data: [DONE]\n\n")


def test_over_http_a_failing_upstream_is_a_502_naming_it_and_none_left_a_503(fakes, tiny_dir):
    fake = fakes[0]
    decision = {"state": "the printer is on fire",
                "questions": {"urgent": {"type": "noul", "instructions": "Is it urgent?"}}}
    fake.mode("error500")
    reader = load_remote_reader(tiny_dir, options(fake.url))
    with serve_in_background(create_app(Settings.of(engine="remote", upstream=(fake.url,)), reader)) as base:
        failed = httpx.post(f"{base}/v1/systemone", json=decision, timeout=30)
    fake.reset()
    assert failed.status_code == 502 and fake.url in failed.json()["error"]["message"]

    nowhere = f"http://127.0.0.1:{free_port()}"
    reader = load_remote_reader(tiny_dir, options(nowhere))
    with serve_in_background(create_app(Settings.of(engine="remote", upstream=(nowhere,)), reader)) as base:
        down = httpx.post(f"{base}/v1/systemone", json=decision, timeout=30)
        health = httpx.get(f"{base}/health", timeout=30)
    assert down.status_code == 503 and nowhere in down.json()["error"]["message"]
    assert health.status_code == 503 and health.json()["engine"] == "remote"


def test_the_upstreams_reasons_name_each_down_one_once():
    up = UpstreamState("http://a:1", True, None)
    down = UpstreamState("http://b:2", False, "ConnectError: refused")
    dead = UpstreamState("http://c:3", False, "GET /health answered 503")
    assert upstreams_degraded([up, up]) is None and upstreams_degraded([down, dead]) is None
    assert upstreams_degraded([up, down, dead]) == \
        "2 of 3 upstreams down: http://b:2 (ConnectError: refused); http://c:3 (GET /health answered 503)"
    assert upstreams_unavailable([down, dead]) == \
        "no upstream available: http://b:2 (ConnectError: refused); http://c:3 (GET /health answered 503)"
    assert down.as_json() == {"url": "http://b:2", "state": "down", "last_error": "ConnectError: refused"}


def health_until(base: str, status: str, timeout: float = 20.0) -> httpx.Response:
    """GET /health until it says `status` (the pool's health checks run every 0.2 s)."""
    deadline = time.monotonic() + timeout
    while True:
        response = httpx.get(f"{base}/health", timeout=10)
        if response.json()["status"] == status or time.monotonic() > deadline:
            assert response.json()["status"] == status, response.json()
            return response
        time.sleep(0.1)


def test_health_lists_the_upstreams_degraded_while_one_is_down_unavailable_once_all_are(tiny_dir):
    decision = {"state": "the printer is on fire", "samples": 1,
                "questions": {"urgent": {"type": "noul", "instructions": "Is it urgent?"}}}
    with fake_upstream() as first, fake_upstream() as second:
        urls, ports = (first.url, second.url), (first.port, second.port)
        reader = load_remote_reader(tiny_dir, options(*urls))
        with serve_in_background(create_app(Settings.of(engine="remote", upstream=urls), reader)) as base:
            ok = health_until(base, "ok")
            assert ok.status_code == 200 and "reason" not in ok.json()
            assert ok.json()["upstreams"] == [{"url": url, "state": "up", "last_error": None} for url in urls]

            second.process.terminate()
            second.process.wait(timeout=10)
            degraded = health_until(base, "degraded")
            body = degraded.json()
            assert degraded.status_code == 200 and body["ready"] is True
            assert body["reason"].startswith("1 of 2 upstreams down: ")
            assert named_once(body["reason"], second.url) and first.url not in body["reason"]
            up, down = body["upstreams"]
            assert up == {"url": first.url, "state": "up", "last_error": None}
            assert down["url"] == second.url and down["state"] == "down"
            assert down["last_error"] and second.url not in down["last_error"]  # the bare error
            assert httpx.post(f"{base}/v1/systemone", json=decision, timeout=30).status_code == 200  # routed around

            first.process.terminate()
            first.process.wait(timeout=10)
            unavailable = health_until(base, "unavailable")
            body = unavailable.json()
            assert unavailable.status_code == 503 and body["ready"] is False
            assert body["reason"].startswith("no upstream available: ")
            assert all(named_once(body["reason"], url) for url in urls), body["reason"]
            assert [u["state"] for u in body["upstreams"]] == ["down", "down"]
            assert all(url not in u["last_error"] for u in body["upstreams"] for url in urls)
            refused = httpx.post(f"{base}/v1/systemone", json=decision, timeout=30)
            message = refused.json()["error"]["message"]
            assert refused.status_code == 503 and all(named_once(message, url) for url in urls), message

            with fake_upstream(port=ports[0]), fake_upstream(port=ports[1]):
                back = health_until(base, "ok")
                assert back.status_code == 200 and "reason" not in back.json()
                assert [u["state"] for u in back.json()["upstreams"]] == ["up", "up"]


def test_a_chat_prompt_vllm_rendered_unlike_djevs_ids_is_counted_and_read_on(fakes, tiny_dir, tokenizer, caplog):
    fake = fakes[0]
    prompt = Prompt(tuple(tokenizer.render_chat("Question q1: is it clear?", "the camera frame", 1, thinking=False)),
                    (ImageInput(b"\x89PNG\r\n", "image/png"),))
    base = a_spec(tokenizer, canvases=1)
    spec = ReadSpec(prompt, base.canvases, base.slots, base.label_ids, 1, 0)
    reader = load_remote_reader(tiny_dir, options(fake.url))
    fake.mode("rerender")
    try:
        with caplog.at_level("WARNING", logger="djev.engine"):
            [result] = asyncio.run(with_reader(reader, lambda: reader.read([spec])))
    finally:
        fake.reset()
    assert reader.stats["chat_prompts_checked"] == 1 and reader.stats["chat_prompt_mismatches"] == 1
    assert any("rendered the chat prompt differently" in record.getMessage() for record in caplog.records)
    assert result.prompt_tokens == 77  # the read went on with vLLM's rendering


def test_chat_forms_made_in_workers_share_the_tokenizers_lock(tiny_dir):
    reader = load_remote_reader(tiny_dir, options("http://127.0.0.1:9"))
    assert reader.chat_former.lock is reader.tokenizer.lock  # one transformers wrapper, one lock


def test_an_image_read_goes_through_the_chat_route_as_djevs_conversation(fakes, tiny_dir, tokenizer):
    fake = fakes[0]
    fake.reset()
    seen_before = len(fake.state()["bodies"])
    image = ImageInput(b"\x89PNG\r\n", "image/png")
    prompt = Prompt(tuple(tokenizer.render_chat("Question q1: is it clear?", "the camera frame", 1, thinking=False)),
                    (image,))
    base = a_spec(tokenizer, canvases=1, steps=2)
    spec = ReadSpec(prompt, base.canvases, base.slots, base.label_ids, 2, 0)
    reader = load_remote_reader(tiny_dir, options(fake.url))
    form, threads = reader.chat_former.form, []
    reader.chat_former.form = lambda p: threads.append(threading.current_thread()) or form(p)
    [result] = asyncio.run(with_reader(reader, lambda: reader.read([spec])))
    assert threads and threading.main_thread() not in threads  # formed off the event loop
    [body] = fake.state()["bodies"][seen_before:]
    assert body["messages"] == [
        {"role": "system", "content": "Question q1: is it clear?"},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0K"}},
                                     {"type": "text", "text": "the camera frame"}]}]
    assert body["chat_template_kwargs"] == {"enable_thinking": False} and "continue_final_message" not in body
    assert body["logprobs"] is True and body["top_logprobs"] == len(body["logprob_token_ids"])
    assert body["return_tokens_as_token_ids"] is True and body["return_token_ids"] is True
    assert body["vllm_xargs"]["diffusion_seed_canvas"] == list(spec.canvases[0])
    assert body["vllm_xargs"]["diffusion_pinned"] == [p for p in range(16) if p not in spec.slots]
    assert result.prompt_tokens == 77
    assert result.slots[0][1].label_logprobs == tuple(fake_logprob(i, spec.slots[1]) for i in spec.label_ids[1])
