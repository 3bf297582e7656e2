"""`@operation(...)`: one declaration per handler method, used twice.

At request time it validates the body (and query) with the given models and
passes them as `body=` / `query=`; the OpenAPI document is built from the same
declarations (httpkit.openapi), so the two cannot drift apart.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

from pydantic import BaseModel

from .validation import parse_body, parse_query


@dataclasses.dataclass(frozen=True)
class Operation:
    summary: str
    status: int = 200                              # the success status
    reply: type[BaseModel] | None = None           # JSON success body
    reply_media: str | None = None                 # a non-JSON success body (bytes, metrics text)
    body: type[BaseModel] | None = None            # JSON request body, validated
    raw_body: str | None = None                    # a non-JSON request body (media type), not validated
    query: type[BaseModel] | None = None
    errors: tuple[int, ...] = ()                   # besides 400 (bodies), 401 (auth) and 413 (bodies)
    description: str | None = None


def operation(summary: str, **kw: Any) -> Callable:
    """Declare a handler method: `@operation("Create a secret", body=NewSecret, status=201, reply=Secret)`."""
    op = Operation(summary, **kw)

    def wrap(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def method(self, **path: str):
            if op.body is not None:
                path["body"] = parse_body(op.body, self.request.body)
            if op.query is not None:
                path["query"] = parse_query(op.query, self.request.query_arguments)
            return fn(self, **path)   # a coroutine when fn is async: tornado awaits it
        method.operation = op
        return method
    return wrap


def operation_of(handler: type, method: str) -> Operation | None:
    return getattr(vars(handler).get(method), "operation", None)
