"""The reference's chat form of a decision: an OpenAI chat body whose system message is the question
schema as JSON and whose user message is the state (JSON text, or image parts).
It becomes the Jev body `parse_decision` reads; every refusal here is a 400, as in the reference.
"""

from __future__ import annotations

import json
from typing import Any

from app.decisions.errors import RequestError
from app.decisions.models import extension_keys, question_pass_through_keys

SHAPE = "a structured request is exactly two messages: the schema (system) and the state JSON (user)"
NOT_JSON = "system must be a JSON question schema and user must be JSON state or image parts"
TYPE_ALIASES = {"bool": "noul", "boolean": "noul"}
# Both from the one request model, so a new request key reaches the chat form without another list.
EXTENSION_KEYS = extension_keys()
QUESTION_PASS_THROUGH = question_pass_through_keys()


def _refuse(message: str, *loc: Any) -> RequestError:
    return RequestError(message, tuple(loc), status=400, kind="invalid_request_error")


def message_text(content: Any) -> str:
    """A message's text: the string, or its text parts joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, dict) and part.get("type") == "text")
    return ""


def chat_to_body(chat: Any) -> dict:
    """The Jev body (with `images` as data URLs) for a chat-form decision request."""
    if not isinstance(chat, dict):
        raise _refuse("body: must be a JSON object with messages")
    messages = chat.get("messages")
    if (not isinstance(messages, list) or len(messages) != 2 or not all(isinstance(m, dict) for m in messages)
            or messages[0].get("role") not in ("system", "developer") or messages[1].get("role") != "user"):
        raise _refuse(SHAPE, "messages")
    try:
        schema = json.loads(message_text(messages[0].get("content")))
    except ValueError as exc:
        raise _refuse(f"{NOT_JSON}: {exc}", "messages", 0) from None
    if not isinstance(schema, dict) or not isinstance(schema.get("questions"), list) or not schema["questions"]:
        raise _refuse("schema: needs a non-empty questions array", "messages", 0)
    body: dict[str, Any] = {"questions": _questions(schema["questions"])}
    body.update({key: schema[key] for key in EXTENSION_KEYS if key in schema})
    body.update(_state(messages[1].get("content")))
    if "seed" in chat:
        body["seed"] = chat["seed"]
    return body


def _questions(raw: list) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for index, entry in enumerate(raw):
        if not isinstance(entry, dict):
            raise _refuse(f"questions[{index}]: must be an object", "questions", index)
        qid = str(entry.get("id", "")).strip()
        if not qid:
            raise _refuse(f"question id '{qid}' must be non-empty", "questions", index, "id")
        if qid in out:
            raise _refuse(f"duplicate question id '{qid}'", "questions", index, "id")
        kind = entry.get("type")
        kind = TYPE_ALIASES.get(kind, kind) if isinstance(kind, str) else kind
        question: dict[str, Any] = {"type": kind}
        question.update({key: entry[key] for key in QUESTION_PASS_THROUGH if key in entry})
        if kind == "noul" and "criteria" in entry:
            question["criteria"] = entry["criteria"]
        elif kind == "choice":
            question["criteria"] = _options(qid, entry.get("options", entry.get("criteria")))
        elif kind == "score":
            question["criteria"] = entry.get("levels", entry.get("criteria"))
        out[qid] = question
    return out


def _options(qid: str, options: Any) -> Any:
    """Options as a list of {name, description} objects or plain values, to Jev's name -> description."""
    if isinstance(options, dict) or options is None:
        return options
    if not isinstance(options, list):
        raise _refuse(f"question '{qid}': options must be a list", "questions", qid, "options")
    criteria: dict[str, Any] = {}
    for option in options:
        if isinstance(option, dict):
            if "name" not in option:
                raise _refuse(f"question '{qid}': an option object needs a name", "questions", qid, "options")
            name, description = str(option["name"]), option.get("description")
        else:
            name, description = str(option), None
        if name in criteria:
            raise _refuse(f"question '{qid}': duplicate option '{name}'", "questions", qid, "options")
        criteria[name] = description
    return criteria


def _state(content: Any) -> dict[str, Any]:
    """The user message: image parts (kept, as data URLs) with their text as the state, or JSON text."""
    if isinstance(content, list) and any(isinstance(p, dict) and p.get("type") in ("image_url", "image") for p in content):
        images = []
        for part in content:
            if isinstance(part, dict) and part.get("type") in ("image_url", "image"):
                url = part.get("image_url", {}).get("url") if isinstance(part.get("image_url"), dict) else part.get("url")
                images.append(url)
        return {"state": message_text(content), "images": images}
    text = message_text(content).strip()
    try:
        json.loads(text)
    except ValueError as exc:
        raise _refuse(f"{NOT_JSON}: {exc}", "messages", 1) from None
    return {"state": text}
