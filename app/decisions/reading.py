"""How decisions are read: the canvas, the prompt budget and where the empty thought block goes."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ReadSettings:
    """How decisions are read; built from `Settings` by `app.build.read_settings` (the defaults live in `app.config`)."""

    canvas_length: int  # the widest canvas a read may use
    canvas_step: int  # canvas widths are rounded up to a multiple of this
    thought_in_prompt: bool  # the empty thought block ends the prompt instead of opening the canvas
    max_prompt_tokens: int  # a prompt past this is refused before any template work
    max_thought_tokens: int  # think x the groups that think, per request
