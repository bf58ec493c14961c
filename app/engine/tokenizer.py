"""The checkpoint's tokenizer and chat template, seen through `ChatTokenizer`."""

from __future__ import annotations

import re
import threading
from typing import Any, Sequence

from app.engine.base import ChatTokenizer

# While the chat template renders, private-use stand-ins hold the place of the caller's text. They
# are cut out again and the caller's text is tokenized on its own with special-token strings kept as
# plain text, so a state that contains "<turn|>" cannot close the turn early.


class HFChatTokenizer(ChatTokenizer):
    def __init__(self, tokenizer: Any, *, vocab_size: int, image_token_id: int) -> None:
        self._tok = tokenizer
        # A fast tokenizer's call sets its truncation and padding state on the shared Rust object,
        # which fails ("Already borrowed") when two threads encode at once: planning runs in worker
        # threads, so calls are serialised here.
        self._lock = threading.RLock()
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
        with self._lock:
            return list(self._tok.encode(text, add_special_tokens=False))

    def encode(self, text: str) -> list[int]:
        if not text:
            return []
        with self._lock:
            return list(self._tok(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])

    def decode(self, ids: Sequence[int]) -> str:
        with self._lock:
            return self._tok.decode(list(ids), skip_special_tokens=False)

    def token_text(self, token_id: int) -> str:
        return self._tok.convert_ids_to_tokens(int(token_id))

    def render_chat(self, system: str, user: str, images: int, thinking: bool) -> list[int]:
        return self.render_messages([("system", system), ("user", user)], images, thinking)

    def render_messages(self, messages: Sequence[tuple[str, str]], images: int, thinking: bool) -> list[int]:
        """A conversation (role, text) up to the model's turn. The images go ahead of the text of the
        first user message. Every text is tokenized on its own, special-token strings as plain text."""
        slots = [f"\ue000djev-{index}\ue001" for index in range(len(messages))]
        rendered_messages = []
        images_placed = False
        for (role, _), slot in zip(messages, slots):
            if role == "user" and not images_placed:
                content: list[dict] = [{"type": "image"} for _ in range(images)]
                content.append({"type": "text", "text": slot})
                rendered_messages.append({"role": role, "content": content})
                images_placed = True
            else:
                rendered_messages.append({"role": role, "content": slot})
        with self._lock:
            rendered = self._tok.apply_chat_template(
                rendered_messages, tokenize=False, add_generation_prompt=True, enable_thinking=thinking
            )
        texts = {slot: text for slot, (_, text) in zip(slots, messages)}
        ids: list[int] = []
        for piece in re.split("(" + "|".join(re.escape(slot) for slot in slots) + ")", rendered):
            if piece in texts:
                ids.extend(self.encode(texts[piece]))
            elif piece:
                ids.extend(self._encode_special(piece))
        found = ids.count(self.image_placeholder_id)
        if found != images:
            raise ValueError(f"the chat template rendered {found} image tokens for {images} images")
        return ids
