"""Request bodies and query strings through pydantic models, errors as JSON pointers.

A message names the field (`/match/hosts/0: Input should be a valid string`)
and never quotes the value that was sent: secrets travel in these bodies.
"""
from __future__ import annotations

from typing import TypeVar

from pydantic import BaseModel, ValidationError

from .errors import ApiError

M = TypeVar("M", bound=BaseModel)
MAX_REASONS = 20
_MIN_ECHO = 4   # an input this long found in a message means pydantic quoted it: say less


def parse_body(model: type[M], raw: bytes) -> M:
    """Validate a JSON body (an empty body is `{}`); 400 with one reason per problem."""
    try:
        return model.model_validate_json(raw or b"{}", strict=True)
    except ValidationError as e:
        errors = e.errors(include_url=False)
        if any(err["type"] == "json_invalid" for err in errors):
            raise ApiError(400, "bad_json", "request body is not valid JSON") from None
        if any(err["loc"] == () and err["type"] == "model_type" for err in errors):
            raise ApiError(400, "bad_json", "request body must be a JSON object") from None
        raise invalid(errors, prefix="") from None


def parse_query(model: type[M], arguments: dict[str, list[bytes]]) -> M:
    """Validate query arguments (the last of repeated ones, as tornado does); unknown ones are ignored."""
    args = {k: v[-1].decode("utf-8", "surrogateescape") for k, v in arguments.items() if v}
    try:
        return model.model_validate(args)
    except ValidationError as e:
        raise invalid(e.errors(include_url=False), prefix="?") from None


def invalid(errors: list[dict], prefix: str) -> ApiError:
    reasons = [f"{_where(err['loc'], prefix)}: {_what(err)}" for err in errors[:MAX_REASONS]]
    more = len(errors) - 1
    message = reasons[0] + (f" (and {more} more)" if more > 0 else "")
    return ApiError(400, "invalid", message, reasons)


def _where(loc: tuple, prefix: str) -> str:
    if prefix == "?":
        return "query parameter " + ".".join(str(p) for p in loc)
    # RFC 6901 pointer; a key is shown at most 64 chars long
    return "/" + "/".join(str(p)[:64].replace("~", "~0").replace("/", "~1") for p in loc)


def _what(err: dict) -> str:
    kind = err["type"]
    if kind == "missing":
        return "required"
    if kind == "extra_forbidden":
        return "unknown field"
    if kind == "union_tag_invalid":   # pydantic's text quotes the tag that was sent
        return f"must be one of {err.get('ctx', {}).get('expected_tags', '?')}"
    msg = str(err["msg"])
    value = err.get("input")
    if isinstance(value, (str, bytes, int, float)) and not isinstance(value, bool):
        text = value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
        if len(text) >= _MIN_ECHO and text in msg:
            return "invalid value"
    return msg
