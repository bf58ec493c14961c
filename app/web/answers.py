"""Response bodies built from a decision's Outcome, at the web edge: Jev's `/v1/systemone` body and
the reference's chat-form content. The decision core returns typed estimates; the wire shapes live
here."""

from __future__ import annotations

import json

from app.decisions.outcome import Outcome


def jev_body(model: str, outcome: Outcome) -> dict:
    """Jev's response: model, answers (asked questions, request order), integer usage, diagnostics."""
    return {
        "model": model,
        "answers": outcome.answers,
        "usage": {"input_tokens": int(outcome.input_tokens), "output_tokens": int(outcome.output_tokens)},
        "diagnostics": outcome.diagnostics,
    }


def chat_content(outcome: Outcome) -> str:
    """The chat form's reply content: the reference's answer shape and the diagnostics, as JSON text."""
    return json.dumps({"answers": outcome.internal_answers, "diagnostics": outcome.diagnostics},
                      indent=2, ensure_ascii=False, allow_nan=False)
