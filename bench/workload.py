"""What the benches send: the README's ticket and its questions, random ticket texts, states of a
given token count, the walk page's request and frames, and the engine-level reads (`Specs`) of the
GPU benches.

Only the standard library is imported at module level (the served bench's client processes import
this module); Pillow, torch and the app are imported where used.
"""

from __future__ import annotations

import io
import random
from typing import Any

# ---------------------------------------------------------------------------------------- decisions

# The README's ticket example: a noul, a 3-way choice, a 3-level score.
TICKET_QUESTIONS: dict[str, Any] = {
    "urgent": {"type": "noul", "instructions": "Does the customer need a reply within the hour?"},
    "team": {"type": "choice", "instructions": "Which team owns this?",
             "criteria": {"billing": None, "outage": "service down", "feature": None}},
    "tone": {"type": "score", "instructions": "How angry is the customer?", "criteria": ["calm", "annoyed", "furious"]},
}
WORDS = ("server", "invoice", "login", "refund", "outage", "demo", "password", "crash", "slow", "billing",
         "upgrade", "cancel", "error", "timeout", "urgent", "manager", "contract", "export", "report", "api")


def words(rng: random.Random, count: int) -> str:
    """`count` words drawn from WORDS."""
    return " ".join(rng.choice(WORDS) for _ in range(count))


def ticket(text: str, questions: dict[str, Any] = TICKET_QUESTIONS, **fields: Any) -> dict[str, Any]:
    """A decision on the ticket `text`, samples 1: the README's questions unless others are given;
    `fields` adds request fields (model, steps, seed, think, ...)."""
    return {"state": {"ticket": text}, "questions": questions, "samples": 1, **fields}


def ticket_request(rng: random.Random, uid: str | None = None) -> dict[str, Any]:
    """The README's ticket with a state of its own: 20 random words and `uid` (default: a random
    number)."""
    text = words(rng, 20)
    return ticket(f"{text} #{rng.randrange(10**9) if uid is None else uid}")


def noul_questions(count: int, tag: str = "") -> dict[str, Any]:
    """`count` yes/no questions, q0 to q{count-1}; a tag makes their instructions unique."""
    suffix = f" ({tag})" if tag else ""
    return {f"q{n}": {"type": "noul", "instructions": f"Does the ticket mention item {n}?{suffix}"}
            for n in range(count)}


def state_of(tokenizer: Any, tokens: int, rng: random.Random) -> str:
    """A text of random words that encodes to at most `tokens` tokens with `tokenizer`, as many
    words as fit (a bisection over the word count; every word is at least one token)."""
    drawn = [rng.choice(WORDS) for _ in range(max(1, tokens))]
    low, high = 1, len(drawn)
    while low < high:
        middle = (low + high + 1) // 2
        if len(tokenizer.encode(" ".join(drawn[:middle]))) <= tokens:
            low = middle
        else:
            high = middle - 1
    return " ".join(drawn[:low])


# ---------------------------------------------------------------------------------------- the walk page

DANGERS = ["danger: stairs", "danger: wall ahead", "danger: object ahead", "danger: pet ahead"]
# The walk page's request, think off (app/static/js/walk.js buildRequest; docs/behavior.md §7).
WALK_REQUEST: dict[str, Any] = {
    "model": "jev-latest",
    "samples": 1,
    "state": {"note": "one frame from a phone's back camera, pointed the way the person is walking; "
                      "only the center 30 degrees matters"},
    "questions": {
        "ahead": {
            "type": "choice",
            "instructions": (
                "You are the eyes of a person walking forward. Judge only the center of the image: a window "
                "about 30 degrees wide directly ahead. Ignore everything to the sides. If there is no obstacle "
                "within 2 meters in that window, say all clear ahead; otherwise name the nearest hazard."
            ),
            "criteria": {
                "all clear ahead": "the path straight ahead is free for at least 2 meters",
                "danger: stairs": "stairs, steps or a curb ahead, up or down",
                "danger: wall ahead": "a wall, fence or closed barrier ahead",
                "danger: object ahead": "furniture, a pole, a parked bike, a box or another object in the path",
                "danger: pet ahead": "a dog, cat or other animal in the path",
                "door ahead": "a door directly ahead, open or closed",
            },
        },
        "side": {
            "type": "choice",
            "instructions": "There is an obstacle ahead. Where is the nearest obstacle, stairs, wall or "
                            "obstruction in the frame?",
            "criteria": {"left half": None, "right half": None},
            "ask_if": {"ahead": DANGERS},
        },
    },
}
FRAME_SIZE = (512, 384)  # the walk page scales frames to 512 px wide (4:3 camera)
JPEG_QUALITY = 70  # the walk page encodes at 0.7


class FrameMaker:
    """Walk-page-like 512x384 JPEG frames, each one unique: a camera-noise background (made once), a
    floor, an obstacle whose place and colour move with the frame number, and the frame's stamp
    (`tag` and number; a tag of its own per process keeps frames unique across processes)."""

    def __init__(self, tag: str) -> None:
        from PIL import Image

        self.tag = tag
        self.made = 0
        noise = Image.effect_noise(FRAME_SIZE, 24).convert("RGB")
        self.base = Image.blend(Image.new("RGB", FRAME_SIZE, (165, 165, 160)), noise, 0.15)

    def make(self, count: int) -> list[bytes]:
        from PIL import ImageDraw

        out = []
        for index in range(self.made, self.made + count):
            image = self.base.copy()
            draw = ImageDraw.Draw(image)
            draw.rectangle((0, 192, 512, 384), fill=(115, 108, 100))
            x = (index * 53) % 400
            draw.rectangle((x, 110, x + 110, 330), fill=(40 + index % 50, 40 + index // 50 % 150, 60))
            draw.text((8, 8), f"{self.tag} #{index}", fill=(255, 255, 255))
            buffer = io.BytesIO()
            image.save(buffer, "JPEG", quality=JPEG_QUALITY)
            out.append(buffer.getvalue())
        self.made += count
        return out


_FRAMES: list[FrameMaker] = []  # this process's maker for `frames`, made on first use


def frames(count: int) -> list[bytes]:
    """`count` new walk frames, none equal to any frame `frames` drew before in this process (so
    neither the prompt KV cache nor the vision cache can serve a frame as new): a live camera never
    repeats one."""
    if not _FRAMES:
        _FRAMES.append(FrameMaker("frames"))
    return _FRAMES[0].make(count)


# ---------------------------------------------------------------------------------------- engine reads

CANVAS_WIDTH = 32
SLOTS = (4, 12, 20)  # where the three answers sit on the canvas
LABELS_PER_SLOT = (2, 3, 3)  # noul, a 3-way choice, a 3-level score: the README's ticket example
FIRST_ID = 100  # prompt ids start here: clear of the special tokens
LAST_ID = 250_000  # and end before this: ids >= 255999 are image tokens in the real vocabulary


def id_range(vocab_size: int) -> tuple[int, int]:
    """The ids random prompts and canvases draw from (high end exclusive)."""
    return FIRST_ID, min(vocab_size, LAST_ID)


class Specs:
    """Real-shaped reads: random prompt ids (clear of the special and image ids) and a random canvas."""

    def __init__(self, vocab_size: int, prompt_tokens: int, seed: int = 0) -> None:
        import torch

        self.generator = torch.Generator().manual_seed(seed)
        self.low, self.high = id_range(vocab_size)
        self.prompt_tokens = prompt_tokens
        # Label ids are arbitrary ordinary ids; only their count per slot matters for the cost.
        self.labels = tuple(tuple(range(self.low + 10 * slot, self.low + 10 * slot + n))
                            for slot, n in enumerate(LABELS_PER_SLOT))

    def ids(self, count: int) -> tuple[int, ...]:
        import torch

        return tuple(torch.randint(self.low, self.high, (count,), generator=self.generator).tolist())

    def read(self, canvases: int = 1) -> Any:
        from app.engine.base import Prompt, ReadSpec

        base = list(self.ids(CANVAS_WIDTH))
        rows = []
        for _ in range(canvases):  # the noise draws differ only at the slots
            row = list(base)
            for slot, noise in zip(SLOTS, self.ids(len(SLOTS))):
                row[slot] = noise
            rows.append(tuple(row))
        return ReadSpec(Prompt(self.ids(self.prompt_tokens)), tuple(rows), SLOTS, self.labels, steps=1, seed=0)
