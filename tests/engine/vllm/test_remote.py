"""`--engine remote` against two real vLLM OpenAI servers (subprocesses of the CPU vLLM venv; the
remote engine itself needs no vLLM and runs in this process): decisions agree with the hf engine to
1e-4, a 255-option read split over several requests agrees too, the chat route's rendered prompt is
djev's own token ids, and killing one upstream mid-run fails no decision. Servers start once for the
module; the kill test runs last."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from app.config import Settings
from app.engine.base import Prompt, ReadSpec
from app.engine.tiny import TINY_MODEL_NAME
from app.engine.vllm.remote import RemoteOptions, load_remote_reader
from app.engine.vllm.wire import (
    chat_read_body,
    collapse_images,
    completion_read_body,
    label_id_groups,
    parse_chat_read,
    parse_completion_read,
)
from app.server import create_app, serve_in_background
from tests.conftest import make_tiny_reader
from tests.vllm_support import (
    TICKET,
    assert_same_answers,
    base_url,
    require_vllm,
    server_processes,
    stop_process,
    vllm_openai_command,
)


def remote_options(*urls: str) -> RemoteOptions:
    return RemoteOptions(upstreams=urls, connect_timeout=2.0, read_timeout=60.0, health_interval=0.5,
                         max_prompt_tokens=4096, served_name=TINY_MODEL_NAME, canvas_length=128, tiny=True)


# The first test also waits for the module's servers to start (minutes on two shared cores).
pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def cluster(tiny_dir, tmp_path_factory):
    """hf base URL, remote djev base URL, the remote reader, and the two upstreams (url, process)."""
    python = require_vllm()
    logs = tmp_path_factory.mktemp("vllm-remote-logs")
    commands = [vllm_openai_command(python, tiny_dir, logs, name) for name in ("vllm-a", "vllm-b")]
    with server_processes(commands) as processes:
        first, second = [(base_url(command[1]), process) for command, process in zip(commands, processes)]
        reader = load_remote_reader(tiny_dir, remote_options(first[0], second[0]))
        settings = Settings.of(engine="remote", upstream=(first[0], second[0]))
        with serve_in_background(create_app(settings, reader)) as remote_url, \
                serve_in_background(create_app(Settings.of(device="cpu"), make_tiny_reader(tiny_dir))) as hf_url:
            yield {"hf": hf_url, "remote": remote_url, "reader": reader, "upstreams": [first, second]}


def decide(base: str, body: dict) -> dict:
    response = httpx.post(f"{base}/v1/systemone", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def test_remote_decisions_agree_with_hf(cluster):
    hf, remote = decide(cluster["hf"], TICKET), decide(cluster["remote"], TICKET)
    assert assert_same_answers(hf, remote) > 20
    assert remote["diagnostics"]["engine"] == "remote"
    assert httpx.get(f"{cluster['remote']}/", timeout=10).status_code == 200  # the pages, as on hf


def test_255_options_split_over_requests_agree_with_hf(cluster):
    """The upstreams keep vLLM's own cap of 128 logprob_token_ids: 255 labels must be split."""
    body = {"state": "A long list.", "seed": 3, "samples": 1, "questions": {
        "pick": {"type": "choice", "instructions": "Which option fits?",
                 "criteria": {f"option {i}": None for i in range(255)}}}}
    requests_before = cluster["reader"].stats.get("requests", 0)
    hf, remote = decide(cluster["hf"], body), decide(cluster["remote"], body)
    assert assert_same_answers(hf, remote) >= 255
    assert cluster["reader"].stats["requests"] - requests_before >= 2  # more than one request per canvas


def test_the_chat_route_renders_djevs_own_prompt_ids(cluster, tiny_dir, tokenizer):
    """Image reads go through /v1/chat/completions, where vLLM renders the prompt from messages. The
    rendered ids (returned by vLLM) must be djev's, and the read must equal the completions read."""
    upstream = cluster["upstreams"][0][0]
    reader = load_remote_reader(tiny_dir, remote_options(upstream))
    prompt = Prompt(tuple(tokenizer.render_chat("Question q1: is it urgent?", "The printer is on fire.", 0,
                                                thinking=False)))
    canvas = tuple(tokenizer.encode("q1: yes")) + (tokenizer.turn_close_id,) + (tokenizer.pad_id,) * 10
    labels = (tuple(tokenizer.encode("yes")[:1]) + tuple(tokenizer.encode("no")[:1]),)
    slot = len(tokenizer.encode("q1: yes")) - 1
    spec = ReadSpec(prompt, (canvas,), (slot,), labels, 1, 0)

    async def both_routes():
        await reader.start()
        try:
            [chosen] = reader.upstreams
            [ids] = label_id_groups(spec, 128)
            messages = reader.chat_former.form(prompt).request_fields(())
            answer = await reader.pool.post_json(chosen, "/v1/chat/completions",
                                                 chat_read_body(spec, canvas, ids, messages))
            body = completion_read_body(spec, canvas, ids, None)
            completion = parse_completion_read(await reader.pool.post_json(chosen, "/v1/completions", body))
            return answer, completion
        finally:
            await reader.stop()

    answer, completion = asyncio.run(both_routes())
    # The ids vLLM rendered from the messages are djev's (the check the reader makes on every chat read).
    rendered = collapse_images(answer["prompt_token_ids"], reader.image_id, reader.boi_id, reader.eoi_id)
    assert rendered == list(prompt.ids)
    chat = parse_chat_read(answer)
    assert chat.prompt_tokens == completion.prompt_tokens == len(prompt.ids)
    assert chat.argmax_ids == completion.argmax_ids
    for token in labels[0]:
        assert abs(chat.logprobs[slot][token] - completion.logprobs[slot][token]) < 1e-5


def test_killing_one_upstream_mid_run_fails_no_decision(cluster):
    body = {**TICKET, "samples": 2}
    victim = cluster["upstreams"][1][1]
    statuses: list[int] = []

    def one(index: int) -> int:
        response = httpx.post(f"{cluster['remote']}/v1/systemone", json={**body, "seed": index}, timeout=120)
        return response.status_code

    with ThreadPoolExecutor(max_workers=4) as pool:
        futures = [pool.submit(one, index) for index in range(16)]
        while sum(future.done() for future in futures) < 3:
            time.sleep(0.05)
        stop_process(victim, hard=True)
        statuses = [future.result() for future in futures]
    assert statuses == [200] * 16
    health = httpx.get(f"{cluster['remote']}/health", timeout=10).json()
    assert health["ready"] is True
    assert [u.healthy for u in cluster["reader"].upstreams] == [True, False]
    # Whether a request was caught on the victim (failed, then retried on the survivor) or the health
    # check saw the death first depends on timing; either way the survivor answered what was left.
    survivor, dead = cluster["reader"].upstreams
    assert survivor.counts["requests"] > dead.counts["requests"] - dead.counts.get("failures", 0)
