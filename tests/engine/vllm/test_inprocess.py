"""`djev serve --engine vllm` on the tiny model, started as the README says (a subprocess of the CPU
vLLM venv), against the hf engine in this process on the same checkpoint: whole decisions over
HTTP agree to 1e-4 in every probability. One server for the module (a vLLM start costs ~25 s, a read
~250 ms); each request is chosen for what it proves.

Images do not run on vLLM's CPU build with the tiny checkpoint (vLLM wants a full Gemma 4 processor,
which the tiny checkpoint does not write), so image decisions are tested on hf only."""

from __future__ import annotations

import httpx
import pytest

from app.config import Settings
from app.server import create_app, serve_in_background
from tests.conftest import make_tiny_reader
from tests.vllm_support import TICKET, assert_same_answers, base_url, djev_vllm_command, require_vllm, server_processes

# The first test also waits for the module's servers to start (minutes on two shared cores).
pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def servers(tiny_dir, tmp_path_factory):
    """(hf base URL, vllm base URL) on the same tiny checkpoint."""
    python = require_vllm()
    logs = tmp_path_factory.mktemp("vllm-engine-logs")
    command = djev_vllm_command(python, tiny_dir, logs)
    with server_processes([command]):
        vllm_url = base_url(command[1])
        reader = make_tiny_reader(tiny_dir)
        with serve_in_background(create_app(Settings.of(device="cpu"), reader)) as hf_url:
            yield hf_url, vllm_url


def both(servers, body: dict) -> tuple[dict, dict]:
    hf_url, vllm_url = servers
    answers = []
    for base in (hf_url, vllm_url):
        response = httpx.post(f"{base}/v1/systemone", json=body, timeout=120)
        assert response.status_code == 200, response.text
        answers.append(response.json())
    return answers[0], answers[1]


def test_health_names_the_vllm_engine_and_the_pages_are_served(servers):
    health = httpx.get(f"{servers[1]}/health", timeout=10).json()
    assert health["engine"] == "vllm" and health["device"] == "cpu (vLLM)" and health["tiny"] is True
    for page in ("/", "/walk", "/cube"):
        assert httpx.get(f"{servers[1]}{page}", timeout=10).status_code == 200


def test_three_question_types_agree_with_hf(servers):
    hf, vllm = both(servers, TICKET)
    assert assert_same_answers(hf, vllm) > 20
    assert vllm["diagnostics"]["engine"] == "vllm"


def test_stages_with_ask_if_agree_with_hf(servers):
    body = {**TICKET, "samples": 1, "questions": {
        **TICKET["questions"],
        "refund": {"type": "noul", "instructions": "Should we offer a refund?", "ask_if": {"team": ["billing"]}},
        "escalate": {"type": "noul", "instructions": "Escalate to a manager?",
                     "ask_if": {"team": ["outage", "feature"]}},
    }}
    hf, vllm = both(servers, body)
    assert len(vllm["diagnostics"]["stages"]) == 2
    assert assert_same_answers(hf, vllm) > 10


def test_255_options_agree_with_hf(servers):
    """255 labels in one canvas: more label ids than stock vLLM's 128 per request."""
    body = {"state": "A long list.", "seed": 3, "samples": 1, "questions": {
        "pick": {"type": "choice", "instructions": "Which option fits?",
                 "criteria": {f"option {i}": None for i in range(255)}}}}
    hf, vllm = both(servers, body)
    assert len(vllm["answers"]["pick"]["probabilities"]) == 255
    assert assert_same_answers(hf, vllm) >= 255


def test_a_long_state_past_the_sliding_window_agrees_with_hf(servers):
    """The tiny model's window is 64 tokens: this prompt is several windows long (the plugin's
    canvas window fix on vLLM's CPU backend is what makes this hold)."""
    body = {**TICKET, "samples": 1, "state": {"ticket": "The service is down again. " * 40}}
    hf, vllm = both(servers, body)
    assert vllm["usage"]["input_tokens"] > 3 * 64
    assert_same_answers(hf, vllm)


def test_think_and_steps_run_on_vllm_generation(servers):
    """vLLM's sampler takes no per-request seed, so thoughts and steps > 1 are not compared with hf:
    they must simply run and be reported."""
    body = {**TICKET, "samples": 1, "think": 12, "steps": 2, "ask": ["urgent"]}
    response = httpx.post(f"{servers[1]}/v1/systemone", json=body, timeout=120)
    assert response.status_code == 200, response.text
    diagnostics = response.json()["diagnostics"]
    assert diagnostics["steps"] == 2
    assert response.json()["usage"]["output_tokens"] > 0


def test_raw_chat_is_relayed_to_vllms_own_chat_serving(servers):
    """The raw route hands the body, unchanged, to vLLM's OpenAI chat serving in the djev process:
    vLLM's own answers come back, its errors with its status, streams as server-sent events."""
    url = f"{servers[1]}/v1/raw/chat/completions"
    body = {"model": "djev-tiny-random", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    whole = httpx.post(url, json=body, timeout=120)
    assert whole.status_code == 200 and whole.json()["object"] == "chat.completion"
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=120) as streamed:
        assert streamed.status_code == 200 and streamed.headers["content-type"].startswith("text/event-stream")
        events = [line for line in streamed.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and '"chat.completion.chunk"' in events[0]
    unknown = httpx.post(url, json={**body, "model": "no-such-model"}, timeout=120)
    assert unknown.status_code == 404 and "does not exist" in unknown.json()["error"]["message"]
