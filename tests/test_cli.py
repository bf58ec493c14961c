"""Checkpoint resolution for `djev serve`: a directory, a Hugging Face id, the default folder, or
the tiny model when there is no GPU."""

from __future__ import annotations

import pytest

from app.build import CheckpointError, resolve_checkpoint
from app.config import Settings


def test_a_checkpoint_directory_is_used_as_is(tiny_dir):
    path, tiny = resolve_checkpoint(Settings.of(model=str(tiny_dir)))
    assert path == tiny_dir and tiny is True


def test_a_directory_without_config_is_refused(tmp_path):
    with pytest.raises(CheckpointError, match="no config.json"):
        resolve_checkpoint(Settings.of(model=str(tmp_path)))


def test_nonsense_is_neither_a_directory_nor_an_id(tmp_path):
    with pytest.raises(CheckpointError, match="not a Hugging Face id"):
        resolve_checkpoint(Settings.of(model=str(tmp_path / "missing" / "deep" / "path")))


def test_without_gpu_or_model_the_tiny_model_is_built_once(tmp_path, monkeypatch):
    monkeypatch.setattr("app.build.gpu_available", lambda: False)
    path, tiny = resolve_checkpoint(Settings.of(models_dir=str(tmp_path)))
    assert tiny and (path / "config.json").is_file()
    stamp = (path / "model.safetensors").stat().st_mtime
    again, _ = resolve_checkpoint(Settings.of(models_dir=str(tmp_path)))
    assert again == path and (path / "model.safetensors").stat().st_mtime == stamp


def test_with_a_gpu_and_no_checkpoint_serve_refuses_to_answer_randomly(tmp_path, monkeypatch):
    monkeypatch.setattr("app.build.gpu_available", lambda: True)
    with pytest.raises(CheckpointError, match="a GPU is present but no checkpoint"):
        resolve_checkpoint(Settings.of(models_dir=str(tmp_path)))


def test_the_default_folder_is_used_when_it_holds_a_checkpoint(tmp_path, tiny_dir, monkeypatch):
    import shutil

    shutil.copytree(tiny_dir, tmp_path / "dgemma")
    path, tiny = resolve_checkpoint(Settings.of(models_dir=str(tmp_path)))
    assert path == tmp_path / "dgemma" and tiny is True


def test_an_offline_download_fails_with_a_clear_message(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(CheckpointError) as info:
        resolve_checkpoint(Settings.of(model="google/diffusiongemma-26B-A4B-it", models_dir=str(tmp_path)))
    assert "could not download google/diffusiongemma-26B-A4B-it" in str(info.value)
    assert "Offline?" in str(info.value)



def serve_in_this_thread(load, monkeypatch, said_starting, **settings) -> tuple[int, list[dict], float]:
    """`cli.serve` on a free port with `load`, while a thread polls /health (setting `said_starting`
    once it says so): the exit status, each new health body seen, and the seconds serve took."""
    import threading
    import time

    import httpx

    from app import cli, server
    from tests.conftest import free_port

    monkeypatch.setattr(server, "FAILED_START_LINGER_S", 0.5)
    port = free_port()
    seen: list[dict] = []
    done = threading.Event()

    def poll() -> None:
        while not done.is_set():
            try:
                body = httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).json()
            except httpx.TransportError:
                body = None
            if body is not None and (not seen or seen[-1]["status"] != body["status"]):
                seen.append(body)
                if body["status"] == "starting":
                    said_starting.set()
            time.sleep(0.02)

    watcher = threading.Thread(target=poll, daemon=True)
    watcher.start()
    started = time.monotonic()
    try:
        status = cli.serve(Settings.of(host="127.0.0.1", port=port, pages=False, **settings), load)
    finally:
        done.set()
        watcher.join(timeout=5)
    return status, seen, time.monotonic() - started


@pytest.mark.parametrize(("error", "exit_status"), [
    (OSError("the weights are truncated"), 1),
    (CheckpointError("--model x: no checkpoint directory there"), 2),
])
def test_serve_listens_while_loading_and_exits_non_zero_when_the_load_fails(monkeypatch, capsys, error, exit_status):
    import threading

    said_starting = threading.Event()

    def load(progress):
        progress("loading weights", 0, 1)
        assert said_starting.wait(20), "the listener never said starting"
        raise error

    status, seen, took = serve_in_this_thread(load, monkeypatch, said_starting)
    assert status == exit_status and took < 15
    assert [body["status"] for body in seen] == ["starting", "failed"]
    assert seen[0]["phase"] == "loading weights" and seen[1]["reason"].endswith(str(error))
    if exit_status == 2:
        assert f"djev: {error}" in capsys.readouterr().err


def test_the_provisional_info_names_the_model_before_anything_loads(tiny_dir, tmp_path):
    from app.build import provisional_info
    from app.engine.tiny import TINY_MODEL_NAME

    info = provisional_info(Settings.of(model=str(tiny_dir)))
    assert (info.model, info.engine, info.device, info.tiny) == (TINY_MODEL_NAME, "hf", "loading", True)
    hub = provisional_info(Settings.of(model="google/diffusiongemma-26B-A4B-it", models_dir=str(tmp_path)))
    assert hub.model == "google--diffusiongemma-26B-A4B-it" and not hub.tiny
    assert provisional_info(Settings.of(model="x/y", served_name="dgemma")).model == "dgemma"
    assert provisional_info(Settings.of(models_dir=str(tmp_path))).model == TINY_MODEL_NAME


CACHE_VARIABLES = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "VLLM_CACHE_ROOT")


def test_cache_dir_points_the_compiler_caches_into_it_unless_the_environment_does(tmp_path, monkeypatch):
    import os

    from app.build import use_cache_dir

    for name in CACHE_VARIABLES:
        monkeypatch.setenv(name, "")  # empty counts as unset; the test's values are undone after it
    monkeypatch.setenv("TRITON_CACHE_DIR", "/elsewhere/triton")
    chosen = use_cache_dir(Settings.of(cache_dir=str(tmp_path / "cache")))
    assert chosen == {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "cache" / "inductor"),
                      "VLLM_CACHE_ROOT": str(tmp_path / "cache" / "vllm")}
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "cache" / "inductor")
    assert os.environ["TRITON_CACHE_DIR"] == "/elsewhere/triton"  # the environment's own wins
    assert use_cache_dir(Settings.of(cache_dir="")) == {}


def test_serve_runs_with_the_switch_interval_and_gives_the_old_one_back(monkeypatch):
    """SWITCH_INTERVAL_MS holds while the server runs (the load runs inside it), and a caller that
    serves in its own process gets its interval back."""
    import sys
    import threading

    before = sys.getswitchinterval()
    seen: list[float] = []

    def load(progress):
        seen.append(sys.getswitchinterval())
        raise OSError("only the interval was wanted")

    status, _, _ = serve_in_this_thread(load, monkeypatch, threading.Event(), switch_interval_ms=0.5)
    assert status == 1 and seen == [0.0005]
    assert sys.getswitchinterval() == before


def test_serve_sets_the_cache_variables_before_the_load_runs(tmp_path, monkeypatch):
    import os
    import threading

    for name in CACHE_VARIABLES:
        monkeypatch.setenv(name, "")  # empty counts as unset; the test's values are undone after it
    seen: dict[str, str | None] = {}

    def load(progress):
        seen.update({name: os.environ.get(name) for name in CACHE_VARIABLES})
        raise OSError("only the environment was wanted")

    said_starting = threading.Event()
    status, _, _ = serve_in_this_thread(load, monkeypatch, said_starting, cache_dir=str(tmp_path))
    assert status == 1
    assert seen["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "inductor")
    assert seen["TRITON_CACHE_DIR"] == str(tmp_path / "triton")
