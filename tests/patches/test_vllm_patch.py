"""The djev vLLM plugin (patches/) on real vLLM 0.32 (CPU build, .venv-vllm), against the hf engine.

One vLLM engine for the whole module (a fresh one costs ~25 s here; a read ~250 ms): it reads the
same canvases with the plugin as installed, then with each patch uninstalled, so every patch has a
test that fails without it. transformers (the hf engine) is the reference: float32, every slot
probability within 1e-4.
"""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path

import pytest

from app.decisions.questions import softmax
from app.engine.base import Prompt, ReadResult, ReadSpec
from tests.conftest import make_tiny_reader
from tests.patches.vllm_subprocess import run_driver, run_python

SLIDING_WINDOW = 64  # the tiny model's (app/engine/tiny.py)
TOLERANCE = 1e-4

# (state words, canvas width, canvases): prompt + canvas inside the window, at its edge, and past it
# by a little and by a lot, including a canvas as wide as the window and a prompt that is chunked
# across steps (the engine's token budget is small, so prefill chunks and canvas passes share steps).
READ_SHAPES = [(3, 16, 2), (9, 16, 1), (14, 16, 2), (60, 32, 2), (150, 16, 2), (20, 64, 1)]
# max_logprobs: vLLM refuses `logprobs` above it (default 20), and a read sets logprobs = number of ids.
ENGINE = {"max_num_batched_tokens": 160, "max_num_seqs": 8, "max_logprobs": 1024}
OPTIONS_255 = 255


def _specs(tokenizer) -> list[ReadSpec]:
    rng = random.Random(7)
    words = ["ticket", "billing", "outage", "calm", "door", "stairs", "wall", "pet", "toast", "soup"]
    yes, no = tokenizer.encode(" yes")[0], tokenizer.encode(" no")[0]
    digits = tuple(tokenizer.encode(str(d))[0] for d in range(10))
    letters = tuple(tokenizer.encode(c)[0] for c in "ABCDE")
    specs = []
    for count, width, canvases in READ_SHAPES:
        state = " ".join(rng.choice(words) for _ in range(count))
        prompt = Prompt(tuple(tokenizer.render_chat("Answer.", state, 0, thinking=False)))
        noise = tuple(tuple(rng.randrange(20, tokenizer.vocab_size) for _ in range(width)) for _ in range(canvases))
        specs.append(ReadSpec(prompt, noise, (1, width // 2, width - 2), ((yes, no), digits, letters)))
    return specs


def _spec_255(tokenizer) -> ReadSpec:
    """A 255-option question: one slot whose label family has 255 ids, prompt past the window."""
    rng = random.Random(11)
    prompt = Prompt(tuple(tokenizer.render_chat("Pick one.", "option " * 40, 0, thinking=False)))
    labels = tuple(rng.sample(range(20, tokenizer.vocab_size), OPTIONS_255))
    canvas = tuple(rng.randrange(20, tokenizer.vocab_size) for _ in range(16))
    return ReadSpec(prompt, (canvas,), (3,), (labels,))


def _wire(spec: ReadSpec) -> dict:
    return {"prompt": list(spec.prompt.ids), "canvases": [list(c) for c in spec.canvases],
            "slots": list(spec.slots), "label_ids": [list(ids) for ids in spec.label_ids]}


def _hf_reads(tiny_dir: Path, specs: list[ReadSpec]) -> list[ReadResult]:
    reader = make_tiny_reader(tiny_dir)

    async def read() -> list[ReadResult]:
        await reader.start()
        try:
            return await reader.read(specs)
        finally:
            await reader.stop()

    return asyncio.run(read())


def _max_dp(hf: ReadResult, vllm_read: list) -> float:
    """Largest |p_hf - p_vllm| over every canvas and slot of one read, where p is the slot's
    distribution over its labels (renormalised, as the decisions use it)."""
    worst = 0.0
    for hf_canvas, vllm_canvas in zip(hf.slots, vllm_read, strict=True):
        for hf_slot, vllm_slot in zip(hf_canvas, vllm_canvas, strict=True):
            for a, b in zip(softmax(hf_slot.label_logprobs), softmax(vllm_slot), strict=True):
                worst = max(worst, abs(a - b))
    return worst


def _max_dlogprob(hf: ReadResult, vllm_read: list) -> float:
    """Largest |log p_hf - log p_vllm| of any label id over the whole vocabulary."""
    return max(abs(a - b)
               for hf_canvas, vllm_canvas in zip(hf.slots, vllm_read, strict=True)
               for hf_slot, vllm_slot in zip(hf_canvas, vllm_canvas, strict=True)
               for a, b in zip(hf_slot.label_logprobs, vllm_slot, strict=True))


def _past_window(spec: ReadSpec) -> bool:
    return len(spec.prompt.ids) + spec.width > SLIDING_WINDOW


@pytest.fixture(scope="module")
def run(tiny_dir: Path, tokenizer, tmp_path_factory, artifacts: Path):
    specs = _specs(tokenizer)
    wide = _spec_255(tokenizer)
    assert any(_past_window(s) for s in specs) and any(not _past_window(s) for s in specs)
    reads = [_wire(s) for s in specs]
    job = {
        "model": str(tiny_dir),
        "engine": ENGINE,
        "steps": [
            {"op": "reads", "name": "patched", "reads": reads},
            {"op": "reads", "name": "ids255", "reads": [_wire(wide)]},
            {"op": "status", "name": "status"},
            {"op": "note_backends", "names": ["FLASH_ATTN"]},
            {"op": "note_backends", "names": ["FLASH_ATTN", "CPU_ATTN"]},
            {"op": "status", "name": "status_unverified"},
            {"op": "uninstall", "patch": "canvas_window"},
            {"op": "reads", "name": "stock", "reads": reads},
            {"op": "uninstall", "patch": "logprob_cap"},
            {"op": "reads", "name": "ids255_stock", "reads": [_wire(wide)]},
        ],
    }
    work = tmp_path_factory.mktemp("vllm-patch")
    result = run_driver(job, work)
    hf = _hf_reads(tiny_dir, specs + [wide])
    measured = [{"prompt": len(s.prompt.ids), "canvas": s.width, "patched_dp": _max_dp(h, p),
                 "patched_dlogprob": _max_dlogprob(h, p), "stock_dp": _max_dp(h, q)}
                for s, h, p, q in zip(specs, hf, result["patched"], result["stock"])]
    timings = {k: v for k, v in result.items() if k.endswith("_s")}
    (artifacts / "vllm_patch_parity.json").write_text(json.dumps({"reads": measured, "seconds": timings}, indent=1))
    return {"specs": specs, "wide": wide, "vllm": result, "hf": hf[:-1], "hf_wide": hf[-1],
            "log": (work / "vllm.log").read_text()}


def test_plugin_loads_and_says_what_it_verified(run):
    status = run["vllm"]["status"]
    assert status["loaded"] is True and status["refused"] is None
    assert status["vllm_version"] == "0.32.0"
    assert status["patches"] == ["canvas_window", "logprob_cap", "backend_check"]
    assert status["verified_window_backends"] == ["CPU_ATTN"]
    assert status["backends_seen"] == ["CPU_ATTN"] and status["unverified_backends_seen"] == []
    assert status["max_logprob_token_ids"] >= OPTIONS_255
    assert status["canvas_rows_anchored"] > 0  # the fix ran on the reads past the window
    assert status["canvas_mixed_steps"] > 0  # ... also in steps shared with prompt prefill chunks


def test_slot_probabilities_match_transformers_inside_and_past_the_window(run):
    for spec, hf, read in zip(run["specs"], run["hf"], run["vllm"]["patched"], strict=True):
        assert _max_dp(hf, read) < TOLERANCE, (len(spec.prompt.ids), spec.width)
        assert _max_dlogprob(hf, read) < 1e-3, (len(spec.prompt.ids), spec.width)


def test_without_the_window_fix_reads_past_the_window_differ(run):
    """The parity test above fails on stock vLLM: proof that it tests the patch."""
    past = []
    for spec, hf, patched, stock in zip(run["specs"], run["hf"], run["vllm"]["patched"], run["vllm"]["stock"],
                                        strict=True):
        if _past_window(spec):
            past.append((len(spec.prompt.ids), spec.width, _max_dp(hf, stock), _max_dlogprob(hf, stock)))
        else:  # reads inside the window are vLLM's own, bit for bit
            assert stock == patched
    assert all(dp > TOLERANCE for _, _, dp, _ in past), past
    assert max(dp for _, _, dp, _ in past) > 100 * TOLERANCE, past


def test_a_255_option_question_is_one_request_with_the_raised_cap(run):
    read = run["vllm"]["ids255"]
    assert not isinstance(read, dict), read
    assert len(read[0][0][0]) == OPTIONS_255
    assert _max_dp(run["hf_wide"], read[0]) < TOLERANCE
    assert _max_dlogprob(run["hf_wide"], read[0]) < 1e-3


def test_without_the_raised_cap_vllm_refuses_255_ids(run):
    stock = run["vllm"]["ids255_stock"]
    assert isinstance(stock, dict) and "128" in stock["error"], stock


VERSION_GATE = """
import vllm
vllm.__version__ = "0.33.0"
from vllm.plugins import load_general_plugins
load_general_plugins()
import djev_vllm_patch, json
from djev_vllm_patch import canvas_window
import vllm.sampling_params as sp
print("STATUS", json.dumps(djev_vllm_patch.status()))
print("PATCHED", canvas_window.installed(), sp.MAX_LOGPROB_TOKEN_IDS)
"""


def test_an_untested_vllm_version_is_refused_with_a_clear_message():
    done = run_python(VERSION_GATE)
    assert done.returncode == 0, done.stderr[-3000:]
    status = json.loads(_line(done.stdout, "STATUS"))
    assert status["loaded"] is False and status["patches"] == []
    assert "0.33.0" in status["refused"] and "0.32.0" in status["refused"]
    assert _line(done.stdout, "PATCHED") == "False 128"
    assert "not a version this plugin was tested on" in done.stdout + done.stderr


def test_an_unverified_attention_backend_is_named_at_start_up(run):
    assert run["vllm"]["status_unverified"]["unverified_backends_seen"] == ["FLASH_ATTN"]
    warnings = [line for line in run["log"].splitlines() if "is not verified" in line]
    assert len(warnings) == 1 and "attention backend FLASH_ATTN" in warnings[0]  # once, naming it


def _line(text: str, tag: str) -> str:
    for line in text.splitlines():
        if line.startswith(tag + " "):
            return line[len(tag) + 1:]
    raise AssertionError(f"no {tag} line in:\n{text[-2000:]}")
