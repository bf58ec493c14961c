"""What the vLLM engines read of a checkpoint themselves: a few ids and sizes from config.json, and
the tokenizer (templates are built here, whatever runs the model)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

    from app.engine.tokenizer import HFChatTokenizer


@dataclass(frozen=True)
class CheckpointConfig:
    """What the vLLM engines take from the checkpoint's config.json, read once at start-up."""

    vocab_size: int
    image_id: int
    boi_id: int  # begin-of-image
    eoi_id: int  # end-of-image
    sliding_window: int  # 0 = none

    @classmethod
    def read(cls, checkpoint: Path) -> "CheckpointConfig":
        config = json.loads((checkpoint / "config.json").read_text())
        text = config.get("text_config") or config
        return cls(vocab_size=int(text["vocab_size"]), image_id=int(config.get("image_token_id", -1)),
                   boi_id=int(config.get("boi_token_id", -1)), eoi_id=int(config.get("eoi_token_id", -1)),
                   sliding_window=int(text.get("sliding_window") or 0))


def load_tokenizer(checkpoint: Path, config: CheckpointConfig) -> tuple[HFChatTokenizer, PreTrainedTokenizerFast]:
    """The checkpoint's tokenizer, loaded locally (templates are built here, whatever runs the
    model): (HFChatTokenizer, the transformers tokenizer under it)."""
    from transformers import AutoTokenizer

    from app.engine.tokenizer import HFChatTokenizer

    raw = AutoTokenizer.from_pretrained(str(checkpoint))
    return HFChatTokenizer(raw, vocab_size=config.vocab_size, image_token_id=config.image_id), raw
