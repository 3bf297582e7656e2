"""httpkit: the small JSON-over-HTTP kit every API of ours is built with (tornado + pydantic).

A leaf package: it imports nothing of ours, so every package may use it
(vault included). One app = a JsonHandler subclass (auth, error map, audit
record) + routes of small handler classes whose methods carry `@operation`;
`make_app` makes the tornado Application, `serve` listens, `document` is its
OpenAPI 3.1 document, generated from the same declarations. Browser apps use
SessionHandler instead (cookie sessions from SessionStore, CSRF, strict CSP).

    class Things(MyApiHandler):
        action = "things"

        @operation("Create a thing", body=NewThing, status=201, reply=Thing, errors=(409,))
        def post(self, body: NewThing) -> None:
            self.reply(201, self.store.add(body))
"""
from .app import PathParam, make_app, rule_regex, template_of
from .errors import ApiError, ErrorBody, ErrorMap
from .handler import AuditHook, JsonHandler
from .models import Body, Reply
from .openapi import document, openapi_document, openapi_handler
from .operation import Operation, operation, operation_of
from .pages import STRICT_CSP, PublicStaticHandler, SessionHandler
from .session import Session, SessionStore
from .server import Server, bearer_admit, check_bind_address, serve, session_admit
from .validation import parse_body, parse_query

__all__ = ["ApiError", "AuditHook", "Body", "ErrorBody", "ErrorMap", "JsonHandler", "Operation", "PathParam",
           "PublicStaticHandler", "Reply", "STRICT_CSP", "Server", "bearer_admit", "Session", "SessionHandler", "SessionStore", "check_bind_address", "document", "make_app", "openapi_document", "openapi_handler",
           "operation", "operation_of", "parse_body", "parse_query", "rule_regex", "serve", "session_admit", "template_of"]
