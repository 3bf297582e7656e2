"""Admin HTTP API (tornado, via httpkit) for remote administration of a Vault.

Bearer tokens (TokenStore) with scopes: `read` for GET, `admin` for everything
else. Responses carry metadata only, never a value. Every request, allowed or
not, is reported to `audit_hook(record)`; records never contain a value.
Bodies: vault/api_models.py (validation and the OpenAPI document).
"""
from __future__ import annotations

import asyncio
import logging

import tornado.web
from httpkit import ApiError, AuditHook, JsonHandler, PathParam, Server, check_bind_address, openapi_handler, operation
from httpkit import bearer_admit, make_app as build_app, serve as serve_app

from . import api_models as m
from .core import Vault
from .errors import (Conflict, InvalidBinding, InvalidName, InvalidValue, KeyFileError, NotFound,
                     VaultCorrupt, VaultError, VaultSealed, WrongMasterKey)
from .names import _NAME
from .tokens import TokenInfo, TokenStore

__all__ = ["DEFAULT_PORT", "MAX_BODY", "ROUTES", "AdminServer", "check_bind_address", "make_app", "serve"]
DEFAULT_PORT = 8474
MAX_BODY = 1024 * 1024
# Every failure to use a key file is this one answer: what failed (missing, not a regular file,
# its mode, its size, not this vault's key) would tell a token holder what exists on the host.
KEY_FILE_UNUSABLE = ("the key file cannot be used: it must be a regular file (mode 0600) holding this vault's "
                     "master key; the server's log says what failed")
log = logging.getLogger("vault.api")
AdminServer = Server
_ADMIN = (403,)   # what every write may answer besides 400/401


class _Base(JsonHandler):
    realm = "cubegate-vault"
    error_map = [
        (NotFound, 404, "not_found"), (Conflict, 409, "conflict"), (InvalidBinding, 400, "invalid_binding"),
        (InvalidName, 400, "invalid_name"), (InvalidValue, 400, "invalid_value"),
        (WrongMasterKey, 400, "wrong_master_key"), (KeyFileError, 400, "key_error"),
        (VaultSealed, 503, "sealed"), (VaultCorrupt, 500, "vault_corrupt"), (VaultError, 500, "vault_error"),
        (ValueError, 400, "invalid"),
    ]

    def initialize(self, vault: Vault, tokens: TokenStore, audit_hook: AuditHook | None) -> None:
        super().initialize(audit_hook)
        self.vault, self.tokens = vault, tokens

    def authenticate(self, token: str) -> TokenInfo | None:
        return self.tokens.verify(token)

    def authorize(self) -> None:
        if self.request.method not in ("GET", "HEAD") and self.actor.scope != "admin":
            raise ApiError(403, "forbidden", f"token scope {self.actor.scope!r} cannot {self.request.method}")

    def audit_record(self) -> dict:
        a = self.audit
        return {"event": "admin", "action": self.action, "tenant": a.get("tenant"), "secret_id": a.get("secret_id"),
                "version": a.get("version"), "binding_id": a.get("binding_id"),
                "actor": self.actor.id if self.actor else None, "status": self.get_status(),
                "outcome": self.outcome(), "reason": self.reason, "remote": self.request.remote_ip}


class SecretsHandler(_Base):
    action = "secrets"

    @operation("List secrets (metadata)", query=m.TenantQuery, reply=m.SecretList)
    def get(self, query: m.TenantQuery) -> None:
        self.audit["tenant"] = query.tenant
        self.reply(200, {"secrets": [s.to_dict() for s in self.vault.list_secrets(query.tenant)]})

    @operation("Create a secret (version 1)", body=m.NewSecret, status=201, reply=m.Secret,
               errors=(*_ADMIN, 409, 503))
    def post(self, body: m.NewSecret) -> None:
        self.audit.update(tenant=body.tenant, secret_id=body.id)
        info = self.vault.put_secret(body.tenant, body.id, body.value.get_secret_value(), description=body.description)
        self.audit["version"] = info.current_version
        self.reply(201, info.to_dict())


class SecretHandler(_Base):
    action = "secret"

    @operation("Get secret metadata", reply=m.Secret, errors=(404,))
    def get(self, tenant: str, id: str) -> None:
        self.audit.update(tenant=tenant, secret_id=id)
        self.reply(200, self.vault.get_secret(tenant, id).to_dict())

    @operation("Delete a secret and all versions (refused while bound)", status=204, errors=(*_ADMIN, 404, 409))
    def delete(self, tenant: str, id: str) -> None:
        self.audit.update(tenant=tenant, secret_id=id)
        self.vault.delete_secret(tenant, id)
        self.reply(204)


class RotateHandler(_Base):
    action = "secret.rotate"

    @operation("Add a new version; it becomes current on the next request", body=m.Rotate, reply=m.Secret,
               errors=(*_ADMIN, 404, 503))
    def post(self, tenant: str, id: str, body: m.Rotate) -> None:
        self.audit.update(tenant=tenant, secret_id=id)
        info = self.vault.rotate(tenant, id, body.value.get_secret_value(), previous=body.previous)
        self.audit["version"] = info.current_version
        self.reply(200, info.to_dict())


def _version_handler(state: str) -> type[_Base]:
    op = {"disable": Vault.disable_version, "enable": Vault.enable_version, "destroy": Vault.destroy_version}[state]
    note = " (wipes its ciphertext, irreversible)" if state == "destroy" else ""

    class VersionHandler(_Base):
        action = f"version.{state}"

        @operation(f"{state.capitalize()} one version{note}", reply=m.Secret, errors=(*_ADMIN, 404, 409))
        def post(self, tenant: str, id: str, version: str) -> None:
            self.audit.update(tenant=tenant, secret_id=id, version=int(version))
            self.reply(200, op(self.vault, tenant, id, int(version)).to_dict())

    VersionHandler.__name__ = f"Version{state.capitalize()}Handler"
    return VersionHandler


class BindingsHandler(_Base):
    action = "bindings"

    @operation("List bindings", query=m.TenantQuery, reply=m.BindingList)
    def get(self, query: m.TenantQuery) -> None:
        self.audit["tenant"] = query.tenant
        self.reply(200, {"bindings": [b.to_dict() for b in self.vault.list_bindings(query.tenant)]})

    @operation("Create a binding (checked: framing headers, overlaps, host policy)", body=m.NewBinding,
               status=201, reply=m.Binding, errors=_ADMIN)
    def post(self, body: m.NewBinding) -> None:
        self.audit.update(tenant=body.tenant, secret_id=body.secret_id, binding_id=body.id)
        self.reply(201, self.vault.add_binding(body.model_dump(exclude_unset=True)).to_dict())


class BindingHandler(_Base):
    action = "binding"

    @operation("Get a binding", reply=m.Binding, errors=(404,))
    def get(self, id: str) -> None:
        self.audit["binding_id"] = id
        self.reply(200, self.vault.get_binding(id).to_dict())

    @operation("Delete a binding", status=204, errors=(*_ADMIN, 404))
    def delete(self, id: str) -> None:
        self.audit["binding_id"] = id
        self.vault.remove_binding(id)
        self.reply(204)


class SealHandler(_Base):
    action = "seal"

    @operation("Seal: drop the master key from memory", reply=m.Status, errors=_ADMIN)
    def post(self) -> None:
        self.vault.seal()
        self.reply(200, self.vault.status())


class UnsealHandler(_Base):
    action = "unseal"

    @operation("Unseal with a key file on the server or a passphrase", body=m.Unseal, reply=m.Status,
               errors=_ADMIN)
    async def post(self, body: m.Unseal) -> None:
        loop = asyncio.get_running_loop()
        if body.key_file is not None:
            try:
                await loop.run_in_executor(None, self.vault.unseal_with_key_file, body.key_file)
            except (KeyFileError, WrongMasterKey, OSError) as e:
                log.warning("unseal with a key file failed: %s: %s", type(e).__name__, e)   # a path, never a key
                raise ApiError(400, "key_error", KEY_FILE_UNUSABLE) from None
        elif body.passphrase is not None:   # scrypt takes ~0.1 s
            await loop.run_in_executor(None, self.vault.unseal_with_passphrase, body.passphrase.get_secret_value())
        else:
            raise ApiError(400, "invalid", "give 'key_file' (server path) or 'passphrase'")
        self.reply(200, self.vault.status())


class StatusHandler(_Base):
    action = "status"

    @operation("Vault status", reply=m.Status)
    def get(self) -> None:
        self.reply(200, self.vault.status())


# (OpenAPI path, handler): the single source of the routes
ROUTES: list[tuple[str, type[_Base]]] = [
    ("/v1/secrets", SecretsHandler),
    ("/v1/secrets/{tenant}/{id}", SecretHandler),
    ("/v1/secrets/{tenant}/{id}/rotate", RotateHandler),
    *[(f"/v1/secrets/{{tenant}}/{{id}}/versions/{{version}}/{s}", _version_handler(s))
      for s in ("disable", "enable", "destroy")],
    ("/v1/bindings", BindingsHandler),
    ("/v1/bindings/{id}", BindingHandler),
    ("/v1/seal", SealHandler),
    ("/v1/unseal", UnsealHandler),
    ("/v1/status", StatusHandler),
    ("/v1/openapi.json", openapi_handler(_Base, public=False)),
]
_NAME_PARAM = PathParam(_NAME.pattern, {"type": "string", "pattern": m.NAME_PATTERN})
PARAMS = {"tenant": _NAME_PARAM, "id": _NAME_PARAM,
          "version": PathParam(r"[0-9]{1,9}", {"type": "integer", "minimum": 1})}
DESCRIPTION = ("Secrets are write-only: no endpoint ever returns a secret value, only ids, versions, states "
               "and fingerprints. Every request is audited. Listens on loopback or a unix socket only. "
               "Tokens: `read` scope for GET, `admin` for everything else.")


def make_app(vault: Vault, tokens: TokenStore | None = None, *,
             audit_hook: AuditHook | None = None) -> tornado.web.Application:
    """The admin API as a tornado Application (not yet listening)."""
    kw = {"vault": vault, "tokens": tokens if tokens is not None else vault.tokens, "audit_hook": audit_hook}
    return build_app(ROUTES, base=_Base, kwargs=kw, params=PARAMS, title="cubegate vault admin API",
                     description=DESCRIPTION, log_name="vault.api")


def serve(vault: Vault, host: str = "127.0.0.1", port: int = DEFAULT_PORT, unix_socket: str | None = None, *,
          tokens: TokenStore | None = None, audit_hook: AuditHook | None = None,
          allow_non_loopback: bool = False) -> AdminServer:
    """Start listening on the current asyncio loop (call from inside it); returns the server.

    With `unix_socket` only that socket (mode 0600) is bound; otherwise host:port,
    which must be loopback unless allow_non_loopback=True. port=0 picks a free port.
    """
    app = make_app(vault, tokens, audit_hook=audit_hook)
    tokens = tokens if tokens is not None else vault.tokens
    return serve_app(app, max_body=MAX_BODY, host=host, port=port, unix_socket=unix_socket,
                     loopback_only=not allow_non_loopback, what="the vault admin API",
                     admit=bearer_admit(tokens.verify))
