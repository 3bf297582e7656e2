"""The one JSON error shape of every API, and how exceptions become it (pure).

Body: {"error": code, "message": text, "reasons": [text, ...]?}. Messages come
from our own exceptions and validation (which never quote a value); anything
unexpected becomes 500 "internal error" without its text.
"""
from __future__ import annotations

from typing import Sequence

import tornado.httputil
import tornado.web
from pydantic import BaseModel

# (exception type, status, code), first match wins; each app declares its own
ErrorMap = Sequence[tuple[type[BaseException], int, str]]


class ApiError(Exception):
    """An error answered as-is: status, machine code, message a person understands."""

    def __init__(self, status: int, code: str, message: str, reasons: list[str] | None = None):
        super().__init__(message)
        self.status, self.code, self.message, self.reasons = status, code, message, reasons

    def body(self) -> dict:
        doc = {"error": self.code, "message": self.message}
        if self.reasons:
            doc["reasons"] = list(self.reasons)
        return doc


class ErrorBody(BaseModel):
    """Every error response."""
    error: str
    message: str
    reasons: list[str] | None = None


def phrase(status: int) -> str:
    return tornado.httputil.responses.get(status, "error")


def to_api_error(e: BaseException, error_map: ErrorMap) -> ApiError | None:
    """The ApiError for `e`, or None when it is unexpected (an internal error)."""
    if isinstance(e, ApiError):
        return e
    if isinstance(e, tornado.web.HTTPError):   # 405 and friends: the standard phrase, never log_message
        return ApiError(e.status_code, "http_error", phrase(e.status_code))
    for exc_type, status, code in error_map:
        if isinstance(e, exc_type):
            reasons = getattr(e, "reasons", None)
            return ApiError(status, code, str(e), list(reasons) if reasons else None)
    return None
