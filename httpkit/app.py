"""Routes written as OpenAPI path templates, turned into one tornado Application.

`/v1/secrets/{tenant}/{id}` with params {"tenant": NAME, "id": NAME} becomes
the rule `/v1/secrets/(?P<tenant>...)/(?P<id>...)$`; the handler's methods get
the parts as keyword arguments. The same list feeds the OpenAPI document.
"""
from __future__ import annotations

import dataclasses
import logging
import re
from typing import Any, Sequence

import tornado.web

from .handler import JsonHandler, NotFoundHandler

_PARAM = re.compile(r"\{(\w+)\}")
_TEMPLATE = re.compile(r"(/([\w.-]+|\{\w+\}))+")


@dataclasses.dataclass(frozen=True)
class PathParam:
    regex: str          # what one path segment may be (no groups)
    schema: dict        # its JSON schema in the document


Routes = Sequence[tuple[str, type[JsonHandler]]]


def rule_regex(template: str, params: dict[str, PathParam]) -> str:
    def group(m: re.Match) -> str:
        name = m.group(1)
        if name not in params:
            raise ValueError(f"route {template}: no PathParam for {{{name}}}")
        return f"(?P<{name}>{params[name].regex})"
    if not _TEMPLATE.fullmatch(template):
        raise ValueError(f"route {template}: only letters, digits, / . _ - and {{params}}")
    # '.' is left unescaped (it matches itself too): the rule then reads back as its template
    return _PARAM.sub(group, template) + "$"


def template_of(regex: str) -> str:
    """The inverse of rule_regex (used to check the document against what is served)."""
    return re.sub(r"\(\?P<(\w+)>[^)]*\)", r"{\1}", regex.rstrip("$"))


def make_app(routes: Routes, *, base: type[JsonHandler], kwargs: dict[str, Any],
             params: dict[str, PathParam] | None = None, title: str, description: str | None = None,
             log_name: str, log_level: int = logging.INFO, public_not_found: bool = False,
             **settings: Any) -> tornado.web.Application:
    """The Application serving `routes` (handlers get `kwargs` in initialize).

    Unknown paths answer a JSON 404, after the app's auth unless public_not_found."""
    params = params or {}
    attrs = {"public": True} if public_not_found else {}
    not_found = type(f"{base.__name__}NotFound", (NotFoundHandler, base), attrs)
    rules = [(rule_regex(p, params), h, kwargs) for p, h in routes]
    logger = logging.getLogger(log_name)

    def log_request(handler: tornado.web.RequestHandler) -> None:
        # Not tornado's default (5xx at ERROR: mitmproxy's errorcheck treats an ERROR at startup
        # as fatal). Method, path and status only: never a body or query (values live there).
        logger.log(log_level, "%s %s %s", handler.get_status(), handler.request.method, handler.request.path)

    return tornado.web.Application(rules, default_handler_class=not_found, default_handler_args=kwargs,
                                   log_function=log_request, compress_response=False, xsrf_cookies=False,
                                   httpkit_routes=list(routes), httpkit_params=params,
                                   httpkit_info={"title": title, "description": description}, **settings)
