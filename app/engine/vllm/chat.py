"""Prompts with images, for vLLM's chat route.

vLLM's `/v1/completions` takes token ids but no images, and its `/v1/chat/completions` takes images
but renders the prompt itself from messages with the checkpoint's chat template. So an image read
is sent as the conversation djev rendered: the prompt ids are cut back into turns (every djev prompt
is the checkpoint's chat template rendered over a system and a user turn, images ahead of the user
text), and the model turn's opening, where djev's prompt goes past what the template adds, is sent
as an assistant message vLLM continues. Before anything is sent, the same messages are rendered
here with the same template and must give exactly djev's ids; and vLLM's answer carries the prompt
ids it used (`return_token_ids`), which the engine checks again, so a read means the same on both
routes.
"""

from __future__ import annotations

import base64
import re
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

from app.engine.base import EngineInputError, ImageInput, Prompt

if TYPE_CHECKING:
    from app.engine.tokenizer import HFChatTokenizer

IMAGE_PART = "image"  # a content part that stands for the next image of the prompt

# Conversation shapes whose rendered template is kept (shapes are few; the bound keeps odd callers
# from growing it).
SKELETON_SHAPES = 256


@dataclass(frozen=True)
class ChatForm:
    """A prompt as chat messages: `messages` hold text parts and IMAGE_PART markers in place of
    the images; `continue_final` says the last message is an assistant message to continue."""

    messages: tuple[dict, ...]
    thinking: bool
    continue_final: bool

    def request_fields(self, images: Sequence[ImageInput]) -> dict[str, Any]:
        """messages (images as data URLs), the template switches, for a chat completions body."""
        queue = list(images)
        messages = []
        for message in self.messages:
            content = message["content"]
            if isinstance(content, list):
                parts = []
                for part in content:
                    if part == IMAGE_PART:
                        parts.append({"type": "image_url", "image_url": {"url": data_url(queue.pop(0))}})
                    else:
                        parts.append({"type": "text", "text": part})
                content = parts
            messages.append({"role": message["role"], "content": content})
        fields: dict[str, Any] = {"messages": messages, "chat_template_kwargs": {"enable_thinking": self.thinking}}
        if self.continue_final:
            fields.update(add_generation_prompt=False, continue_final_message=True)
        return fields


def data_url(image: ImageInput) -> str:
    content_type = image.content_type if image.content_type.startswith("image/") else "image/png"
    return f"data:{content_type};base64,{base64.b64encode(image.data).decode('ascii')}"


class ChatFormer:
    """Cuts djev prompt ids into chat messages with the checkpoint's own tokenizer and template."""

    def __init__(self, tokenizer: HFChatTokenizer, image_id: int) -> None:
        # The transformers wrapper is not safe to share between threads, and forms are made in worker
        # threads: decoding goes through the HFChatTokenizer, and the template runs under its lock.
        self.tokenizer = tokenizer
        self.raw = tokenizer.wrapper
        self.image_id = image_id
        self.turn_open = self._single_id("<|turn>")
        self.turn_close = self._single_id("<turn|>")
        self.think_marker = "<|think|>"
        # Per shape: the template rendered over stand-ins, as its text and the stand-ins' indices
        # (None: the template does not copy stand-ins through, so that shape is rendered in full).
        self._skeletons: dict[tuple, tuple[str | int, ...] | None] = {}

    @property
    def lock(self) -> threading.RLock:
        """The HFChatTokenizer's lock, which serialises the wrapper they share."""
        return self.tokenizer.lock

    def _single_id(self, token: str) -> int:
        ids = self.raw.encode(token, add_special_tokens=False)
        if len(ids) != 1:
            raise ValueError(f"the tokenizer has no single {token!r} token: not a Gemma 4 chat tokenizer")
        return int(ids[0])

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids)

    def form(self, prompt: Prompt) -> ChatForm:
        ids = list(prompt.ids)
        turns: list[tuple[tuple[str, list], bool]] = []  # ((role, parts), closed)
        opens = [i for i, token in enumerate(ids) if token == self.turn_open]
        if not opens:
            raise self._refuse("it has no chat turns")
        for index, start in enumerate(opens):
            end = opens[index + 1] if index + 1 < len(opens) else len(ids)
            body = ids[start + 1:end]
            closed = self.turn_close in body
            if closed:
                body = body[:body.index(self.turn_close)]
            elif index + 1 < len(opens):
                raise self._refuse("a turn is never closed")
            turns.append((self._role_and_parts(body), closed))
        (last_role, last_parts), last_closed = turns[-1]
        if last_closed or last_role != "model":
            raise self._refuse("it does not end in the model's turn")
        thinking = False
        messages: list[dict] = []
        for (role, parts), _ in turns[:-1]:
            if role == "system" and parts and isinstance(parts[0], str) and parts[0].startswith(self.think_marker):
                thinking = True
                parts = [parts[0][len(self.think_marker):], *parts[1:]]
            if IMAGE_PART in parts:
                content: str | list[str] = [part for part in parts if part != ""]
            else:
                content = "".join(parts)
            if role == "system" and content == "" and thinking:
                continue  # the template writes a system turn of its own for the think marker
            messages.append({"role": "assistant" if role == "model" else role, "content": content})
        opening = "".join(part for part in last_parts if part != IMAGE_PART)
        expected = self._decode(ids)
        plain = ChatForm(tuple(messages), thinking, continue_final=False)
        if self.render(plain) == expected:
            return plain
        if opening:
            continued = ChatForm(tuple(messages) + ({"role": "assistant", "content": opening},), thinking, True)
            if self.render(continued) == expected:
                return continued
        raise self._refuse("the chat template does not render it back exactly")

    def _role_and_parts(self, body: Sequence[int]) -> tuple[str, list]:
        """'role\\n' then text and image placeholders."""
        parts: list = []
        run: list[int] = []
        for token in body:
            if token == self.image_id:
                parts.append(self._decode(run))
                parts.append(IMAGE_PART)
                run = []
            else:
                run.append(token)
        parts.append(self._decode(run))
        head = parts[0]
        if "\n" not in head:
            raise self._refuse("a turn has no role line")
        role, parts[0] = head.split("\n", 1)
        return role, parts

    def render(self, form: ChatForm) -> str:
        """The text the checkpoint's template makes of `form` (vLLM renders the same template).

        Image reads repeat a few conversation shapes with new texts, so the template is rendered
        once per shape (roles, where the images and the empty texts are, the switches) over
        stand-ins for the texts, and the texts are put in place of the stand-ins, as djev's prompt
        ids were built (`HFChatTokenizer`). The stand-ins are padded with spaces: a template that
        changes a text (trims it, say) does not copy them through, and its shapes are rendered in
        full every time."""
        texts: list[str] = []

        def stand_in(text: str) -> str:
            if not text:
                return text  # an empty text stays empty: a template may test for it
            texts.append(text)
            return f" \ue000djev-{len(texts) - 1}\ue001 "

        messages: list[dict] = []
        shape: list[tuple] = []
        for message in form.messages:
            content = message["content"]
            if isinstance(content, list):
                content = [part if part == IMAGE_PART else stand_in(part) for part in content]
                shape.append((message["role"], tuple(content)))
            else:
                content = stand_in(content)
                shape.append((message["role"], content))
            messages.append({"role": message["role"], "content": content})
        key = (tuple(shape), form.thinking, form.continue_final)
        if key in self._skeletons:
            skeleton = self._skeletons[key]
        else:
            skeleton = self._skeleton(ChatForm(tuple(messages), form.thinking, form.continue_final), len(texts))
            if len(self._skeletons) < SKELETON_SHAPES:
                self._skeletons[key] = skeleton
        return self._render_template(form) if skeleton is None else _filled(skeleton, texts)

    def _skeleton(self, blank: ChatForm, texts: int) -> tuple[str | int, ...] | None:
        """`blank` (texts as stand-ins 0..texts-1) rendered, each stand-in as its index; None where
        a stand-in does not come through exactly once."""
        rendered = self._render_template(blank)
        stand_ins = {f" \ue000djev-{index}\ue001 ": index for index in range(texts)}
        if any(rendered.count(stand_in) != 1 for stand_in in stand_ins):
            return None
        if not stand_ins:
            return (rendered,)
        pattern = "(" + "|".join(re.escape(stand_in) for stand_in in stand_ins) + ")"
        return tuple(stand_ins.get(piece, piece) for piece in re.split(pattern, rendered) if piece)

    def _render_template(self, form: ChatForm) -> str:
        """`form` through the checkpoint's chat template."""
        messages = []
        for message in form.messages:
            content = message["content"]
            if isinstance(content, list):
                content = [{"type": "image"} if part == IMAGE_PART else {"type": "text", "text": part}
                           for part in content]
            messages.append({"role": message["role"], "content": content})
        with self.lock:
            rendered = self.raw.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=not form.continue_final,
                continue_final_message=form.continue_final, enable_thinking=form.thinking,
            )
        assert isinstance(rendered, str)  # tokenize=False renders text (the declared type covers ids too)
        return rendered

    @staticmethod
    def _refuse(why: str) -> EngineInputError:
        return EngineInputError(
            f"this prompt cannot go through vLLM's chat route (needed for images): {why}", status=422, param="images")


def _filled(skeleton: tuple[str | int, ...], texts: Sequence[str]) -> str:
    return "".join(texts[piece] if isinstance(piece, int) else piece for piece in skeleton)
