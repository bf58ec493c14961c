"""The checkpoint's tokenizer and chat template, seen through `ChatTokenizer`."""

from __future__ import annotations

import functools
import re
import threading
from typing import TYPE_CHECKING, Sequence

from app.engine.base import ChatTokenizer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

# While the chat template renders, private-use stand-ins hold the place of the caller's text. They
# are cut out again and the caller's text is tokenized on its own with special-token strings kept as
# plain text, so a state that contains "<turn|>" cannot close the turn early.


# Texts up to this many characters keep their ids in a per-tokenizer LRU of this many entries (at most
# ENTRIES x CHARS of text and its ids, typically a few MiB): a decision's questions, labels and template
# rows repeat from one request to the next.
ENCODE_CACHE_CHARS = 4096
ENCODE_CACHE_ENTRIES = 4096

# A rendered chat template: its constant pieces as ids, each message's text as the message's index.
Skeleton = tuple[int | tuple[int, ...], ...]


class HFChatTokenizer(ChatTokenizer):
    """Encoding goes straight to the Rust tokenizer (the transformers wrapper costs ~80 us a call,
    several calls a decision): one copy reads special-token strings as special tokens (the chat
    template's own text), another as plain text (the caller's text). Neither is ever mutated, so
    worker threads encode concurrently. The chat template is rendered once per conversation shape
    (roles, images, thinking) and its constant pieces' ids are kept."""

    def __init__(self, tokenizer: PreTrainedTokenizerFast, *, vocab_size: int, image_token_id: int) -> None:
        from tokenizers import Tokenizer

        self._tok = tokenizer
        serialized = tokenizer.backend_tokenizer.to_str()
        self._special = Tokenizer.from_str(serialized)
        self._special.encode_special_tokens = False
        self._plain = Tokenizer.from_str(serialized)
        self._plain.encode_special_tokens = True
        # Rendering the template and decoding go through the transformers wrapper, which is not safe
        # to share between threads; they are serialised here.
        self._lock = threading.RLock()
        self._skeletons: dict[tuple[tuple[str, ...], int, bool], Skeleton] = {}
        # A decision encodes its questions' text, labels and template rows again for every state;
        # only the state changes between tickets. functools' cache is thread-safe.
        self._encode_cached = functools.lru_cache(maxsize=ENCODE_CACHE_ENTRIES)(self._encode_uncached)
        self.vocab_size = vocab_size
        self.image_placeholder_id = image_token_id
        pad = tokenizer.pad_token_id  # typed loosely by transformers: any special token's value
        self.pad_id = self._special_id("<pad>", pad if isinstance(pad, int) else None)
        self.turn_close_id = self._special_id("<turn|>", None)
        self.thought_open = tuple(self.encode_special("<|channel>thought\n"))
        self.thought_close = tuple(self.encode_special("<channel|>"))
        if len(self.thought_close) != 1:
            raise ValueError("the tokenizer has no single <channel|> token: not a Gemma 4 chat tokenizer")

    def _special_id(self, token: str, fallback: int | None) -> int:
        token_id = self._tok.convert_tokens_to_ids(token)
        if isinstance(token_id, int) and token_id != self._tok.unk_token_id:
            return token_id
        if fallback is not None:
            return fallback
        raise ValueError(f"the tokenizer has no {token!r} token: not a Gemma 4 chat tokenizer")

    def encode_special(self, text: str) -> list[int]:
        """Text to ids with special-token strings read as the special tokens they name: for the chat
        template's own text (`<|channel>thought\n`), never for a caller's text (`encode`)."""
        return list(self._special.encode(text, add_special_tokens=False).ids) if text else []

    def encode(self, text: str) -> list[int]:
        if len(text) <= ENCODE_CACHE_CHARS:
            return list(self._encode_cached(text))
        return list(self._plain.encode(text, add_special_tokens=False).ids)  # long: copied once, not cached

    def _encode_uncached(self, text: str) -> tuple[int, ...]:
        return tuple(self._plain.encode(text, add_special_tokens=False).ids) if text else ()

    @property
    def wrapper(self) -> PreTrainedTokenizerFast:
        """The transformers tokenizer itself, for others that render its chat template (ChatFormer):
        they call it under `lock`."""
        return self._tok

    @property
    def lock(self) -> threading.RLock:
        """The lock that serialises the transformers wrapper, for others that call it too (ChatFormer)."""
        return self._lock

    def decode(self, ids: Sequence[int]) -> str:
        with self._lock:
            text = self._tok.decode(list(ids), skip_special_tokens=False)
        assert isinstance(text, str)  # one id sequence decodes to one text (the declared type covers batches)
        return text

    def render_chat(self, system: str, user: str, images: int, thinking: bool) -> list[int]:
        return self.render_messages([("system", system), ("user", user)], images, thinking)

    def render_messages(self, messages: Sequence[tuple[str, str]], images: int, thinking: bool) -> list[int]:
        """A conversation (role, text) up to the model's turn. The images go ahead of the text of the
        first user message. Every text is tokenized on its own, special-token strings as plain text."""
        pieces = self._skeleton(tuple(role for role, _ in messages), images, thinking)
        ids: list[int] = []
        for piece in pieces:
            if isinstance(piece, int):
                ids.extend(self.encode(messages[piece][1]))
            else:
                ids.extend(piece)
        return ids

    def _skeleton(self, roles: tuple[str, ...], images: int, thinking: bool) -> Skeleton:
        """The rendered template for this shape: constant pieces as ids, message texts as their index."""
        key = (roles, images, thinking)
        found = self._skeletons.get(key)
        if found is not None:
            return found
        slots = [f"\ue000djev-{index}\ue001" for index in range(len(roles))]
        rendered_messages = []
        images_placed = False
        for role, slot in zip(roles, slots):
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
        assert isinstance(rendered, str)  # tokenize=False renders text (the declared type covers ids too)
        index = {slot: number for number, slot in enumerate(slots)}
        pieces: list[int | tuple[int, ...]] = []
        for piece in re.split("(" + "|".join(re.escape(slot) for slot in slots) + ")", rendered):
            if piece in index:
                pieces.append(index[piece])
            elif piece:
                pieces.append(tuple(self.encode_special(piece)))
        found_images = sum(piece.count(self.image_placeholder_id) for piece in pieces if isinstance(piece, tuple))
        if found_images != images:
            raise ValueError(f"the chat template rendered {found_images} image tokens for {images} images")
        skeleton = tuple(pieces)
        if len(self._skeletons) < 256:  # shapes are few; a bound keeps odd callers from growing it
            self._skeletons[key] = skeleton
        return skeleton
