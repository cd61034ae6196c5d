"""Errors the router answers itself, mapped to HTTP in one place.

Every refusal is an OpenAI-style body ``{"error": {"message", "type", "code"}}`` with
the status it names; handlers raise :class:`Refused` and the app turns it into a
response, so no handler builds error bodies of its own.
"""

from __future__ import annotations

from starlette.responses import JSONResponse

KINDS = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
         404: "NotFoundError", 409: "conflict", 413: "request_too_large",
         429: "rate_limit_error", 502: "upstream_error", 503: "unavailable",
         504: "upstream_timeout"}


def error_response(status: int, message: str, kind: str | None = None,
                   headers: dict[str, str] | None = None,
                   code: str | None = None) -> JSONResponse:
    """An OpenAI-style error body (``kind`` defaults to the status's usual type, ``code``
    to the status; OpenAI's string codes, e.g. ``context_length_exceeded``, where one
    applies)."""
    return JSONResponse({"error": {"message": message, "type": kind or KINDS.get(status, "error"),
                                   "code": code or status}}, status_code=status, headers=headers)


class Refused(Exception):
    """A request the router answers with ``status`` and ``message`` (plus ``headers``,
    e.g. ``Retry-After`` or ``WWW-Authenticate``, and an OpenAI error ``code``)."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = headers
        self.code = code

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, headers=self.headers, code=self.code)
