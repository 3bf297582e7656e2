"""The OpenAPI 3.1 document of an app, built from its routes and their `@operation`s.

Schemas come from the pydantic models (request models in validation mode,
replies in serialization mode). A handler method without `@operation` is an
error here, so an undocumented route cannot ship.
"""
from __future__ import annotations

import re
from typing import Any

import tornado.web
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from .app import PathParam, Routes
from .errors import ErrorBody, phrase
from .handler import JsonHandler
from .operation import Operation, operation, operation_of

METHODS = ("get", "post", "put", "patch", "delete")
_REF = "#/components/schemas/{model}"


def openapi_document(routes: Routes, params: dict[str, PathParam], *, title: str, version: str = "1",
                     description: str | None = None) -> dict:
    ops = [(path, method, handler, op) for path, handler in routes for method, op in _operations(path, handler)]
    models = {ErrorBody} | {op.body for *_, op in ops if op.body is not None}   # queries: inline parameters
    replies = {op.reply for *_, op in ops if op.reply is not None}
    keys = [(m, "validation") for m in models] + [(m, "serialization") for m in replies]
    refs, defs = models_json_schema(keys, ref_template=_REF)
    paths: dict[str, dict] = {}
    for path, method, handler, op in ops:
        paths.setdefault(path, {})[method] = _operation(path, method, handler, op, params, refs)
    info = {"title": title, "version": version, **({"description": description} if description else {})}
    return {"openapi": "3.1.0", "info": info, "paths": paths,
            "components": {"schemas": defs.get("$defs", {}),
                           "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}}}


def _operations(path: str, handler: type) -> list[tuple[str, Operation]]:
    out = []
    for method in METHODS:
        if method in vars(handler):
            op = operation_of(handler, method)
            if op is None:
                raise ValueError(f"{handler.__name__}.{method} ({path}) has no @operation")
            out.append((method, op))
    return out


def _operation(path: str, method: str, handler: Any, op: Operation, params: dict[str, PathParam], refs: dict) -> dict:
    error = {"content": {"application/json": {"schema": refs[(ErrorBody, "validation")]}}}
    codes = set(op.errors)
    if op.body is not None or op.query is not None:
        codes.add(400)
    if op.body is not None or op.raw_body is not None:
        codes.add(413)
    if not handler.public:
        codes.add(401)
    ok: dict[str, Any] = {"description": phrase(op.status)}
    if op.reply is not None:
        ok["content"] = {"application/json": {"schema": refs[(op.reply, "serialization")]}}
    elif op.reply_media is not None:
        ok["content"] = {op.reply_media: {}}
    doc: dict[str, Any] = {
        "summary": op.summary, "operationId": f"{handler.__name__}.{method}",
        "security": [] if handler.public else [{"bearer": []}],
        "responses": {str(op.status): ok, **{str(c): {"description": phrase(c), **error} for c in sorted(codes)}}}
    if op.description:
        doc["description"] = op.description
    parameters = [{"name": n, "in": "path", "required": True, "schema": params[n].schema}
                  for n in _path_names(path)]
    if op.query is not None:
        parameters += _query_parameters(op.query)
    if parameters:
        doc["parameters"] = parameters
    if op.body is not None:
        schema = refs[(op.body, "validation")]
        doc["requestBody"] = {"required": True, "content": {"application/json": {"schema": schema}}}
    elif op.raw_body is not None:
        doc["requestBody"] = {"required": True, "content": {op.raw_body: {}}}
    return doc


def _path_names(path: str) -> list[str]:
    return re.findall(r"\{(\w+)\}", path)


def _query_parameters(model: type[BaseModel]) -> list[dict]:
    schema = model.model_json_schema(ref_template=_REF)
    required = set(schema.get("required", []))
    return [{"name": name, "in": "query", "required": name in required, "schema": prop}
            for name, prop in schema.get("properties", {}).items()]


def document(app: tornado.web.Application) -> dict:
    """The app's document (built once): what its /openapi.json serves."""
    s = app.settings
    if "httpkit_document" not in s:
        s["httpkit_document"] = openapi_document(s["httpkit_routes"], s["httpkit_params"], **s["httpkit_info"])
    return s["httpkit_document"]


def openapi_handler(base: type[JsonHandler], *, public: bool) -> type[JsonHandler]:
    """The handler serving the app's document (public, or behind the app's auth like any GET)."""
    open_to_all = public

    class OpenApiHandler(base):
        action = "openapi"
        public = open_to_all

        @operation("This document (OpenAPI 3.1)", reply_media="application/json")
        def get(self) -> None:
            self.reply(200, document(self.application))
    return OpenApiHandler
