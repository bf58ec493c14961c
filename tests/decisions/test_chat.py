"""The chat form's keys come from the one request model: every extension key of a decision body, and
every shared question key, reaches the decision; nothing else from the schema does."""

from __future__ import annotations

import json

from app.decisions.chat import EXTENSION_KEYS, QUESTION_PASS_THROUGH, chat_to_body
from app.decisions.models import DecisionBody, QuestionFields
from app.decisions.request import parse_decision
from tests.conftest import LIMITS

EXTENSIONS = {
    "instructions": "context", "samples": 2, "auto_max": 3, "auto_threshold": 0.2, "steps": 2, "think": 16,
    "ask": ["a", "b"], "chunk_rows": 16, "chunk_prompt": "shared", "sequential": True, "isolate": True,
    "confidence": "jev", "debias": "rotate+prior",
}


def chat(schema: dict) -> dict:
    return {"messages": [{"role": "system", "content": json.dumps(schema)}, {"role": "user", "content": '{"x": 1}'}]}


def test_the_extension_keys_are_the_models():
    assert set(EXTENSION_KEYS) == set(EXTENSIONS)
    assert set(EXTENSION_KEYS) < set(DecisionBody.model_fields)
    assert set(QUESTION_PASS_THROUGH) == set(QuestionFields.model_fields) - {"type", "criteria"}


def test_every_extension_and_question_key_reaches_the_decision():
    schema = {
        "questions": [
            {"id": "a", "type": "bool", "instructions": "A?", "alone": True},
            {"id": "b", "type": "choice", "options": ["x", "y"], "depends_on": ["a"], "ask_if": {"a": ["yes"]}},
        ],
        **EXTENSIONS,
        "x_not_a_key": 1,
        "model": "ignored here: the chat body's own model is the model",
    }
    body = chat_to_body(chat(schema))
    assert {key: body[key] for key in EXTENSIONS} == EXTENSIONS
    assert "x_not_a_key" not in body and "model" not in body
    decision = parse_decision(body, LIMITS)
    assert decision.samples.count == 2 and decision.think == 16 and decision.chunk_prompt == "shared"
    assert decision.debias.mode == "rotate+prior"
    a, b = decision.questions
    assert a.alone and a.instructions == "A?"
    assert b.depends_on == ("a",) and b.ask_if == (("a", ("yes",)),)
