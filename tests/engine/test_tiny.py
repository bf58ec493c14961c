"""The tiny checkpoint: the real architecture's shape, the real special tokens and chat format,
deterministic for a seed, written by `djev tiny-model`."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from app.cli import main
from app.engine.tiny import SPECIAL_TOKENS, is_tiny_checkpoint, write_tiny_model


def digest(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir()) if p.is_file()}


def test_the_same_seed_writes_the_same_files(tmp_path, tiny_dir):
    again = write_tiny_model(tmp_path / "again", seed=0)
    assert digest(again) == digest(tiny_dir)
    other = write_tiny_model(tmp_path / "other", seed=1)
    assert digest(other)["model.safetensors"] != digest(tiny_dir)["model.safetensors"]
    assert digest(other)["tokenizer.json"] == digest(tiny_dir)["tokenizer.json"]


def test_the_config_has_the_real_architectures_shape(tiny_dir):
    config = json.loads((tiny_dir / "config.json").read_text())
    assert config["architectures"] == ["DiffusionGemmaForBlockDiffusion"]
    text = config["text_config"]
    assert text["layer_types"] == ["sliding_attention"] * 5 + ["full_attention"]
    assert text["num_experts"] > 1 and text["top_k_experts"] > 1 and text["moe_intermediate_size"]
    assert text["use_bidirectional_attention"] == "vision"
    assert config["vision_config"]["model_type"] == "gemma4_vision"
    assert is_tiny_checkpoint(tiny_dir)


def test_the_model_has_self_conditioning_and_a_vision_tower(tiny_reader):
    model = tiny_reader.runner.model
    assert hasattr(model.model.decoder, "self_conditioning")
    assert model.model.encoder.vision_tower is not None
    full = model.model.encoder.language_model.layers[-1].self_attn
    assert full.v_proj is None  # K = V on full-attention layers


def test_special_tokens_and_chat_format(tokenizer):
    from transformers import AutoTokenizer

    assert tokenizer.thought_close and tokenizer.thought_open
    assert tokenizer.decode(tokenizer.thought_open) == "<|channel>thought\n"
    ids = tokenizer.render_chat("SYS", "USER", images=1, thinking=False)
    rendered = tokenizer.decode(ids)
    assert rendered.startswith("<bos><|turn>system\nSYS<turn|>\n<|turn>user\n")
    assert rendered.endswith("USER<turn|>\n<|turn>model\n<|channel>thought\n<channel|>")
    assert ids.count(tokenizer.image_placeholder_id) == 1
    thinking = tokenizer.decode(tokenizer.render_chat("SYS", "USER", images=0, thinking=True))
    assert "<|think|>" in thinking and thinking.endswith("<|turn>model\n")
    del AutoTokenizer


def test_every_special_token_is_one_id(tiny_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_dir))
    for token in SPECIAL_TOKENS:
        assert len(tok.encode(token, add_special_tokens=False)) == 1, token


def test_cli_writes_a_tiny_model(tmp_path, capsys):
    assert main(["tiny-model", str(tmp_path / "m"), "--seed", "3"]) == 0
    assert (tmp_path / "m" / "model.safetensors").is_file()
    assert "written to" in capsys.readouterr().out
