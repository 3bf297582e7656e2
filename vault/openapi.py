"""Hand-written OpenAPI 3.1 document of the admin API (vault/api.py).

tests/vault checks that it lists exactly the routes and methods the app serves.
"""
from __future__ import annotations

import copy


def _ref(name: str) -> dict:
    return {"$ref": f"#/components/schemas/{name}"}


def _json(schema: dict, description: str) -> dict:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


_ERR = {code: {"$ref": f"#/components/responses/{name}"} for code, name in
        (("400", "BadRequest"), ("401", "Unauthorized"), ("403", "Forbidden"), ("404", "NotFound"),
         ("409", "Conflict"), ("503", "Sealed"))}


def _op(summary: str, scope: str, ok: dict, *, body: dict | None = None, errors=("401", "403"),
        params: list[str] = (), query: list[dict] = ()) -> dict:
    op = {"summary": summary, "description": f"Requires a token with scope `{scope}`.",
          "security": [{"bearer": []}],
          "responses": {**ok, **{c: _ERR[c] for c in errors}}}
    parameters = [{"name": p, "in": "path", "required": True,
                   "schema": {"type": "integer", "minimum": 1} if p == "version" else _ref("Name")}
                  for p in params] + list(query)
    if parameters:
        op["parameters"] = parameters
    if body is not None:
        op["requestBody"] = {"required": True, "content": {"application/json": {"schema": body}}}
    return op


_TENANT_Q = {"name": "tenant", "in": "query", "required": False, "schema": _ref("Name")}
_SECRET_OK = {"200": _json(_ref("Secret"), "Secret metadata (never the value)")}
_VERSION_PATH = "/v1/secrets/{tenant}/{id}/versions/{version}/"

_DOC = {
    "openapi": "3.1.0",
    "info": {"title": "cubegate vault admin API", "version": "1",
             "description": "Secrets are write-only: no endpoint ever returns a secret value, only ids, "
                            "versions, states and fingerprints. Every request is audited. Listens on "
                            "loopback or a unix socket only."},
    "paths": {
        "/v1/secrets": {
            "get": _op("List secrets (metadata)", "read",
                       {"200": _json({"type": "object", "properties": {"secrets": {"type": "array", "items": _ref("Secret")}}},
                                     "Secrets")}, query=[_TENANT_Q], errors=("400", "401")),
            "post": _op("Create a secret (version 1)", "admin", {"201": _json(_ref("Secret"), "Created")},
                        body=_ref("NewSecret"), errors=("400", "401", "403", "409", "503")),
        },
        "/v1/secrets/{tenant}/{id}": {
            "get": _op("Get secret metadata", "read", _SECRET_OK, params=["tenant", "id"],
                       errors=("400", "401", "404")),
            "delete": _op("Delete a secret and all versions (refused while bound)", "admin",
                          {"204": {"description": "Deleted"}}, params=["tenant", "id"],
                          errors=("400", "401", "403", "404", "409")),
        },
        "/v1/secrets/{tenant}/{id}/rotate": {
            "post": _op("Add a new version; it becomes current on the next request", "admin", _SECRET_OK,
                        params=["tenant", "id"], body=_ref("Rotate"),
                        errors=("400", "401", "403", "404", "503")),
        },
        **{_VERSION_PATH + action: {
            "post": _op(f"{action.capitalize()} one version" + (" (wipes its ciphertext, irreversible)"
                                                                if action == "destroy" else ""),
                        "admin", _SECRET_OK, params=["tenant", "id", "version"],
                        errors=("400", "401", "403", "404", "409"))}
           for action in ("disable", "enable", "destroy")},
        "/v1/bindings": {
            "get": _op("List bindings", "read",
                       {"200": _json({"type": "object", "properties": {"bindings": {"type": "array", "items": _ref("Binding")}}},
                                     "Bindings")}, query=[_TENANT_Q], errors=("400", "401")),
            "post": _op("Create a binding (validated: framing headers, overlaps, host policy)", "admin",
                        {"201": _json(_ref("Binding"), "Created")}, body=_ref("Binding"),
                        errors=("400", "401", "403")),
        },
        "/v1/bindings/{id}": {
            "get": _op("Get a binding", "read", {"200": _json(_ref("Binding"), "Binding")}, params=["id"],
                       errors=("401", "404")),
            "delete": _op("Delete a binding", "admin", {"204": {"description": "Deleted"}}, params=["id"],
                          errors=("401", "403", "404")),
        },
        "/v1/seal": {
            "post": _op("Seal: drop the master key from memory", "admin", {"200": _json(_ref("Status"), "Sealed")}),
        },
        "/v1/unseal": {
            "post": _op("Unseal with a key file on the server or a passphrase", "admin",
                        {"200": _json(_ref("Status"), "Unsealed")}, body=_ref("Unseal"),
                        errors=("400", "401", "403")),
        },
        "/v1/status": {
            "get": _op("Vault status", "read", {"200": _json(_ref("Status"), "Status")}, errors=("401",)),
        },
        "/v1/openapi.json": {
            "get": _op("This document", "read", {"200": {"description": "OpenAPI 3.1 document",
                                                          "content": {"application/json": {}}}},
                       errors=("401",)),
        },
    },
    "components": {
        "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer",
                                       "description": "Token from `cubegate vault token create`"}},
        "responses": {name: _json(_ref("Error"), desc) for name, desc in (
            ("BadRequest", "Invalid input"), ("Unauthorized", "No, wrong or expired token"),
            ("Forbidden", "Token scope does not allow this"), ("NotFound", "No such object"),
            ("Conflict", "Conflicts with current state"), ("Sealed", "Vault is sealed"))},
        "schemas": {
            "Name": {"type": "string", "pattern": "^[a-z0-9][a-z0-9_.-]{0,63}$"},
            "Error": {"type": "object", "required": ["error", "message"],
                      "properties": {"error": {"type": "string"}, "message": {"type": "string"},
                                     "reasons": {"type": "array", "items": {"type": "string"}}}},
            "Version": {"type": "object", "properties": {
                "version": {"type": "integer"}, "state": {"enum": ["active", "disabled", "destroyed"]},
                "fingerprint": {"type": "string", "description": "first 12 hex of HMAC-SHA256 (vault key, value)"},
                "created": {"type": "number"}}},
            "Secret": {"type": "object", "properties": {
                "tenant": _ref("Name"), "id": _ref("Name"), "description": {"type": "string"},
                "created": {"type": "number"}, "current_version": {"type": ["integer", "null"]},
                "versions": {"type": "array", "items": _ref("Version")}}},
            "NewSecret": {"type": "object", "required": ["tenant", "id", "value"], "properties": {
                "tenant": _ref("Name"), "id": _ref("Name"), "description": {"type": "string"},
                "value": {"type": "string", "writeOnly": True, "minLength": 8}}},
            "Rotate": {"type": "object", "required": ["value"], "properties": {
                "value": {"type": "string", "writeOnly": True, "minLength": 8},
                "previous": {"enum": ["keep", "disable", "destroy"], "default": "disable"}}},
            "Binding": {"type": "object", "required": ["id", "tenant", "secret_id", "match", "inject"],
                        "properties": {
                "id": _ref("Name"), "tenant": _ref("Name"), "secret_id": _ref("Name"),
                "placeholder": {"type": "boolean", "default": False},
                "match": {"type": "object", "required": ["hosts"], "properties": {
                    "hosts": {"type": "array", "items": {"type": "string"}, "minItems": 1},
                    "ports": {"type": "array", "items": {"type": "integer"}, "default": [443]},
                    "methods": {"type": ["array", "null"], "items": {"type": "string"}},
                    "path_prefixes": {"type": ["array", "null"], "items": {"type": "string"}},
                    "allow_plaintext": {"type": "boolean", "default": False}}},
                "inject": {"oneOf": [
                    {"type": "object", "required": ["type", "name", "format"], "properties": {
                        "type": {"const": "header"}, "name": {"type": "string"},
                        "format": {"type": "string", "description": "exactly one {secret}"}}},
                    {"type": "object", "required": ["type", "name"], "properties": {
                        "type": {"const": "query"}, "name": {"type": "string"}}},
                    {"type": "object", "required": ["type", "username"], "properties": {
                        "type": {"const": "basic"}, "username": {"type": "string"}}}]}}},
            "Unseal": {"type": "object", "properties": {
                "key_file": {"type": "string", "description": "path on the server, mode 0600"},
                "passphrase": {"type": "string", "writeOnly": True}},
                "oneOf": [{"required": ["key_file"]}, {"required": ["passphrase"]}]},
            "Status": {"type": "object", "properties": {
                "sealed": {"type": "boolean"}, "vault_id": {"type": "string"}, "key_source": {"type": "string"},
                "generation": {"type": "integer"}, "secrets": {"type": "integer"},
                "versions": {"type": "integer"}, "bindings": {"type": "integer"}, "tokens": {"type": "integer"}}},
        },
    },
}


def openapi_document() -> dict:
    return copy.deepcopy(_DOC)
