"""The one error type the decision logic raises for bad input."""

from __future__ import annotations

from typing import Any


class RequestError(Exception):
    """A request the server refuses, with the field at fault.

    `loc` is the path of the offending field inside the body (FastAPI style, without the leading
    "body"), e.g. ("questions", "urgent", "criteria"). `status` is 422 for validation, 400 for
    Jev's documented limits, 413 for sizes. `kind` is the 422 detail's `type`: pydantic's error type
    where the rule is a pydantic one (`app.decisions.refusals`), as Jev's own server answers.
    `jev_detail`, when set, replaces the `detail` member of the error body (Jev answers some limits
    with a plain-string detail).
    """

    def __init__(
        self,
        message: str,
        loc: tuple[Any, ...] = (),
        *,
        status: int = 422,
        kind: str = "value_error",
        jev_detail: Any = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.loc = tuple(loc)
        self.status = status
        self.kind = kind
        self.jev_detail = jev_detail

    @property
    def param(self) -> str | None:
        return ".".join(str(part) for part in self.loc) or None
