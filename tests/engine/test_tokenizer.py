"""The chat tokenizer's fast paths (the Rust tokenizer directly, cached template skeletons) give
exactly the ids the transformers wrapper gives."""

from __future__ import annotations

import re
import threading

import pytest

TEXTS = ["hello", "a <turn|> b <|image|>", "q1: yes\nq2: A", "日本語 ☕ naïve", "<|channel>thought\n<channel|>",
         "  spaced  ", '{"a": [1, 2]}', ""]


def slow_render(hf, messages, images, thinking):
    """The template rendered with the wrapper, each text tokenized on its own as plain text."""
    slots = [f"\ue000s{index}\ue001" for index in range(len(messages))]
    shaped, placed = [], False
    for (role, _), slot in zip(messages, slots):
        if role == "user" and not placed:
            shaped.append({"role": role, "content": [{"type": "image"}] * images + [{"type": "text", "text": slot}]})
            placed = True
        else:
            shaped.append({"role": role, "content": slot})
    rendered = hf.apply_chat_template(shaped, tokenize=False, add_generation_prompt=True, enable_thinking=thinking)
    texts = dict(zip(slots, (text for _, text in messages)))
    ids = []
    for piece in re.split("(" + "|".join(map(re.escape, slots)) + ")", rendered):
        if piece in texts:
            ids += hf(texts[piece], add_special_tokens=False, split_special_tokens=True)["input_ids"] if texts[piece] else []
        elif piece:
            ids += hf.encode(piece, add_special_tokens=False)
    return ids


@pytest.mark.parametrize("text", TEXTS)
def test_encoding_equals_the_wrappers(tokenizer, text):
    hf = tokenizer.wrapper
    plain = hf(text, add_special_tokens=False, split_special_tokens=True)["input_ids"] if text else []
    assert tokenizer.encode(text) == list(plain)
    assert tokenizer.encode_special(text) == list(hf.encode(text, add_special_tokens=False))


@pytest.mark.parametrize("images, thinking", [(0, False), (0, True), (2, False)])
def test_rendered_chats_equal_the_wrappers(tokenizer, images, thinking):
    messages = [("system", "Answer <turn|> questions."), ("user", "state ☕ <|channel>"), ("assistant", "q1: yes"),
                ("user", "and now?")]
    for _ in range(2):  # the second time from the cached skeleton
        assert tokenizer.render_messages(messages, images, thinking) == slow_render(tokenizer.wrapper, messages,
                                                                                    images, thinking)


def test_threads_encode_at_once(tokenizer):
    expected = tokenizer.encode(TEXTS[2] * 50)
    failures = []

    def work():
        for _ in range(200):
            if tokenizer.encode(TEXTS[2] * 50) != expected:
                failures.append(1)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures
