"""No body, however malformed, makes the parser fail with anything but a RequestError that names a
field (the server turns those into 4xx; anything else would be a 500)."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from app.decisions.errors import RequestError
from app.decisions.request import parse_decision
from tests.conftest import LIMITS

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4),
    max_leaves=20,
)
question = st.fixed_dictionaries(
    {"type": st.sampled_from(["noul", "choice", "score", "rank", 3, None])},
    optional={
        "instructions": json_values,
        "criteria": json_values | st.dictionaries(st.text(max_size=8), st.none() | st.text(max_size=8), max_size=5)
        | st.lists(st.text(max_size=8), max_size=5),
        "depends_on": json_values | st.lists(st.sampled_from(["a", "b", "c"]), max_size=3),
        "ask_if": json_values | st.dictionaries(st.sampled_from(["a", "b", "c"]), st.lists(st.text(max_size=5), max_size=3)),
        "alone": json_values,
        "bogus": json_values,  # an unknown key inside a question: refused
    },
)
bodies = st.fixed_dictionaries(
    {},
    optional={
        "state": json_values,
        "questions": st.dictionaries(st.sampled_from(["a", "b", "c", "d"]), question | json_values, max_size=4) | json_values,
        "seed": json_values, "samples": json_values, "auto_max": json_values, "auto_threshold": json_values,
        "steps": json_values, "think": json_values, "ask": json_values, "chunk_rows": json_values,
        "chunk_prompt": json_values, "sequential": json_values, "isolate": json_values, "confidence": json_values,
        "images": json_values, "assets": json_values, "model": json_values, "instructions": json_values,
        "x_trace_id": json_values,  # an unknown top-level key: ignored
    },
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(bodies)
def test_any_body_parses_or_is_refused_with_a_named_field(body):
    try:
        decision = parse_decision(body, LIMITS)
    except RequestError as error:
        assert error.status in (400, 413, 422)
        assert error.message and _ours(error.message)
    else:
        assert decision.questions and isinstance(decision.state_text, str)
        assert decision.ignored == (("x_trace_id",) if "x_trace_id" in body else ())


def _ours(message: str) -> bool:
    """Every refusal has its own message; pydantic's English would mean a row missing from the table."""
    return not any(text in message for text in ("Input should", "Field required", "Extra inputs"))


@settings(max_examples=200, deadline=None)
@given(json_values)
def test_any_json_value_as_a_body(value):
    try:
        parse_decision(value, LIMITS)
    except RequestError as error:
        assert error.status in (400, 413, 422) and _ours(error.message)
