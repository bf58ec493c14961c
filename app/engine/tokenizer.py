"""The checkpoint's tokenizer and chat template, seen through `ChatTokenizer`."""

from __future__ import annotations

import re
from typing import Any, Sequence

from app.engine.base import ChatTokenizer

# Stand-ins for the caller's text while the chat template renders. They are cut out again and the
# caller's text is tokenized on its own with special-token strings kept as plain text, so a state
# that contains "<turn|>" cannot close the turn early.
_SYSTEM_SLOT = "\ue000djev-system\ue001"
_USER_SLOT = "\ue000djev-user\ue001"
_SLOTS = re.compile(f"({re.escape(_SYSTEM_SLOT)}|{re.escape(_USER_SLOT)})")


class HFChatTokenizer(ChatTokenizer):
    def __init__(self, tokenizer: Any, *, vocab_size: int, image_token_id: int) -> None:
        self._tok = tokenizer
        self.vocab_size = vocab_size
        self.image_placeholder_id = image_token_id
        self.pad_id = self._special_id("<pad>", tokenizer.pad_token_id)
        self.turn_close_id = self._special_id("<turn|>", None)
        self.thought_open = tuple(self._encode_special("<|channel>thought\n"))
        self.thought_close = tuple(self._encode_special("<channel|>"))
        if len(self.thought_close) != 1:
            raise ValueError("the tokenizer has no single <channel|> token: not a Gemma 4 chat tokenizer")

    def _special_id(self, token: str, fallback: int | None) -> int:
        token_id = self._tok.convert_tokens_to_ids(token)
        if isinstance(token_id, int) and token_id != self._tok.unk_token_id:
            return token_id
        if fallback is not None:
            return fallback
        raise ValueError(f"the tokenizer has no {token!r} token: not a Gemma 4 chat tokenizer")

    def _encode_special(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False))

    def encode(self, text: str) -> list[int]:
        if not text:
            return []
        return list(self._tok(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)

    def token_text(self, token_id: int) -> str:
        return self._tok.convert_ids_to_tokens(int(token_id))

    def render_chat(self, system: str, user: str, images: int, thinking: bool) -> list[int]:
        content: list[dict] = [{"type": "image"} for _ in range(images)]
        content.append({"type": "text", "text": _USER_SLOT})
        messages = [{"role": "system", "content": _SYSTEM_SLOT}, {"role": "user", "content": content}]
        rendered = self._tok.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, enable_thinking=thinking
        )
        ids: list[int] = []
        for piece in _SLOTS.split(rendered):
            if piece == _SYSTEM_SLOT:
                ids.extend(self.encode(system))
            elif piece == _USER_SLOT:
                ids.extend(self.encode(user))
            elif piece:
                ids.extend(self._encode_special(piece))
        found = ids.count(self.image_placeholder_id)
        if found != images:
            raise ValueError(f"the chat template rendered {found} image tokens for {images} images")
        return ids
