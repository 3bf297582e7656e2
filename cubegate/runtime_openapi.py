"""OpenAPI 3.1 description of the sandbox REST API (cubegate/runtime_api.py)."""
from __future__ import annotations

_ID = {"name": "id", "in": "path", "required": True, "schema": {"type": "string", "pattern": "^[a-z0-9][a-z0-9-]{0,39}$"}}
_ERR = {"description": "error", "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
_STR_MAP = {"type": "object", "additionalProperties": {"type": "string"}}


def _json(ref: str) -> dict:
    return {"content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{ref}"}}}}


def openapi_document() -> dict:
    errors = {"400": _ERR, "401": _ERR, "404": _ERR, "409": _ERR, "500": _ERR,
              "503": {**_ERR, "description": "vault sealed: the request cannot be checked for secrets"}}
    return {
        "openapi": "3.1.0",
        "info": {"title": "cubegate sandbox API", "version": "1"},
        "components": {
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
            "schemas": {
                "Error": {"type": "object", "required": ["error", "message"],
                          "properties": {"error": {"type": "string"}, "message": {"type": "string"}}},
                "Limits": {"type": "object", "additionalProperties": False, "properties": {
                    "memory_mb": {"type": "integer", "minimum": 1}, "cpus": {"type": "number", "exclusiveMinimum": 0},
                    "pids": {"type": "integer", "minimum": 1}, "disk_mb": {"type": "integer", "minimum": 1}}},
                "CreateSandbox": {"type": "object", "required": ["id", "tenant"], "properties": {
                    "id": {"type": "string"}, "tenant": {"type": "string"},
                    "backend": {"type": "string", "enum": ["namespace", "microvm"]},
                    "labels": _STR_MAP, "limits": {"$ref": "#/components/schemas/Limits"},
                    "env": _STR_MAP, "files": {**_STR_MAP, "description": "path under /workspace -> base64"},
                    "secret_env": {**_STR_MAP, "description": "ENV_NAME -> vault secret id (gets its placeholder)"}}},
                "Sandbox": {"type": "object", "properties": {
                    "id": {"type": "string"}, "tenant": {"type": "string"}, "backend": {"type": "string"},
                    "labels": _STR_MAP, "limits": {"$ref": "#/components/schemas/Limits"},
                    "state": {"type": "string", "enum": ["creating", "running", "paused", "failed"]},
                    "ip": {"type": ["string", "null"]}, "created": {"type": "number"},
                    "start_ms": {"type": ["number", "null"]}, "error": {"type": ["string", "null"]},
                    "usage": {"type": "object"}}},
                "Exec": {"type": "object", "required": ["argv"], "properties": {
                    "argv": {"type": "array", "items": {"type": "string"}, "minItems": 1},
                    "timeout": {"type": "number"}, "env": _STR_MAP, "stdin_b64": {"type": "string"},
                    "cwd": {"type": "string"}}},
                "ExecResult": {"type": "object", "properties": {
                    "exit_code": {"type": "integer"}, "timed_out": {"type": "boolean"},
                    "duration_s": {"type": "number"},
                    "stdout": {"type": ["string", "null"], "description": "null unless valid UTF-8 (see stdout_b64)"},
                    "stderr": {"type": ["string", "null"], "description": "null unless valid UTF-8"},
                    "stdout_b64": {"type": "string"}, "stderr_b64": {"type": "string"}}},
                "Init": {"type": "object", "properties": {"env": _STR_MAP, "files": _STR_MAP, "secret_env": _STR_MAP}},
            },
        },
        "security": [{"bearer": []}],
        "paths": {
            "/v1/sandboxes": {
                "get": {"summary": "List sandboxes", "responses": {"200": {"description": "list"}, **errors}},
                "post": {"summary": "Create a sandbox; 201 once its agent answered and its network is attached",
                         "requestBody": {"required": True, **_json("CreateSandbox")},
                         "responses": {"201": {"description": "created", **_json("Sandbox")},
                                       "429": {**_ERR, "description": "host capacity exceeded"}, **errors}},
            },
            "/v1/sandboxes/{id}": {
                "parameters": [_ID],
                "get": {"summary": "Get one sandbox with measured usage",
                        "responses": {"200": {"description": "sandbox", **_json("Sandbox")}, **errors}},
                "delete": {"summary": "Destroy", "responses": {"204": {"description": "destroyed"}, **errors}},
            },
            "/v1/sandboxes/{id}/exec": {
                "parameters": [_ID],
                "post": {"summary": "Run a command through the sandbox's agent",
                         "requestBody": {"required": True, **_json("Exec")},
                         "responses": {"200": {"description": "result", **_json("ExecResult")}, **errors}},
            },
            "/v1/sandboxes/{id}/init": {
                "parameters": [_ID],
                "post": {"summary": "Idempotent: re-apply env (with the tenant's current placeholders) and files",
                         "requestBody": {"required": False, **_json("Init")},
                         "responses": {"200": {"description": "applied"}, **errors}},
            },
            "/v1/sandboxes/{id}/files": {
                "parameters": [_ID, {"name": "path", "in": "query", "required": True, "schema": {"type": "string"}}],
                "get": {"summary": "Read a file", "responses": {"200": {"description": "bytes"}, **errors}},
                "put": {"summary": "Write a file (raw body)", "responses": {"204": {"description": "written"}, **errors}},
            },
            "/v1/sandboxes/{id}/pause": {"parameters": [_ID], "post": {
                "summary": "Freeze all processes", "responses": {"200": {"description": "paused"}, "501": _ERR, **errors}}},
            "/v1/sandboxes/{id}/resume": {"parameters": [_ID], "post": {
                "summary": "Thaw", "responses": {"200": {"description": "running"}, **errors}}},
            "/v1/openapi.json": {"get": {"summary": "This document", "security": [],
                                         "responses": {"200": {"description": "OpenAPI"}}}},
        },
    }
