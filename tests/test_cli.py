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
