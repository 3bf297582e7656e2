"""Vault: tenants, secrets (metadata, versions, states), bindings, tokens.

Secret values are write-only: the put and rotate forms send one, nothing ever
answers with one (not the page, not an error, not a refilled form). Calls go to
the vault core on the event loop, as the vault's admin API does (they are short).
"""
from __future__ import annotations

from vault.bindings import doc_from_options
from vault.core import PREVIOUS_VERSION_ACTIONS

from . import forms
from .base import ConsoleHandler

VERSION_ACTIONS = ("disable", "enable", "destroy")


class VaultPage(ConsoleHandler):
    action = "console.vault"
    template = "vault.html"

    async def page_context(self) -> dict:
        v = self.ctx.vault
        tenant = self.get_query_argument("tenant", "").strip() or None
        every = v.list_secrets(None)
        bindings = v.list_bindings(None)
        tenants = sorted({s.tenant for s in every} | {b.tenant for b in bindings})
        return {"status": v.status(), "tenants": tenants, "tenant": tenant,
                "secrets": [s for s in every if tenant is None or s.tenant == tenant],
                "bindings": [b.to_dict() for b in bindings if tenant is None or b.tenant == tenant],
                "tokens": v.tokens.list(), "previous_actions": PREVIOUS_VERSION_ACTIONS}

    async def get(self) -> None:
        await self.render_page(self.template)


class SecretPut(VaultPage):
    action = "console.secret.put"
    SUPPORTED_METHODS = ("POST",)

    def post(self) -> None:
        f = self.form("tenant", "id", "description", "value", secret=("value",))
        self.audit.update(tenant=f["tenant"], secret_id=f["id"])
        info = self.ctx.vault.put_secret(f["tenant"], f["id"], f["value"], description=f["description"])
        self.audit["version"] = info.current_version
        self.done("/vault", f"stored {info.tenant}/{info.id} v{info.current_version} "
                            f"(fingerprint {info.versions[-1].fingerprint})")


class SecretRotate(VaultPage):
    action = "console.secret.rotate"
    SUPPORTED_METHODS = ("POST",)

    def post(self, tenant: str, id: str) -> None:
        f = self.form("value", "previous", secret=("value",))
        self.audit.update(tenant=tenant, secret_id=id)
        previous = f["previous"] or "disable"
        if previous not in PREVIOUS_VERSION_ACTIONS:
            raise forms.invalid(f"previous: one of {', '.join(PREVIOUS_VERSION_ACTIONS)}")
        info = self.ctx.vault.rotate(tenant, id, f["value"], previous=previous)
        self.audit["version"] = info.current_version
        self.done("/vault", f"rotated {tenant}/{id}: v{info.current_version} is current")


class VersionState(VaultPage):
    action = "console.secret.version"
    SUPPORTED_METHODS = ("POST",)

    def post(self, tenant: str, id: str, version: str, op: str) -> None:
        self.audit.update(tenant=tenant, secret_id=id, version=int(version))
        method = {"disable": self.ctx.vault.disable_version, "enable": self.ctx.vault.enable_version,
                  "destroy": self.ctx.vault.destroy_version}[op]
        info = method(tenant, id, int(version))
        self.done("/vault", f"{tenant}/{id} v{version}: {op}d; current v{info.current_version}")


class BindingAdd(VaultPage):
    action = "console.binding.add"
    SUPPORTED_METHODS = ("POST",)

    def post(self) -> None:
        f = self.form("id", "tenant", "secret_id", "hosts", "ports", "methods", "path_prefixes", "allow_plaintext",
                      "inject", "header", "format", "query", "basic_user", "placeholder")
        self.audit.update(tenant=f["tenant"], secret_id=f["secret_id"], binding_id=f["id"])
        doc = doc_from_options(**forms.binding_options(f))     # the CLI's document, the vault's checks
        b = self.ctx.vault.add_binding(doc)
        self.done("/vault", f"binding {b.id} added: {b.tenant}/{b.secret_id} → {', '.join(b.match.hosts)}")


class BindingDelete(VaultPage):
    action = "console.binding.delete"
    SUPPORTED_METHODS = ("POST",)

    def post(self, id: str) -> None:
        self.audit["binding_id"] = id
        self.ctx.vault.remove_binding(id)
        self.done("/vault", f"binding {id} deleted")


class TokenRevoke(VaultPage):
    action = "console.token.revoke"
    SUPPORTED_METHODS = ("POST",)

    def post(self, id: str) -> None:
        self.audit["token_id"] = id
        self.ctx.vault.tokens.revoke(id)
        ended = self.sessions.end_where(lambda s: s.actor == id)
        if id == self.actor:       # revoked its own token: this session is over
            self.session = None
            self.clear_cookie(self.cookie_name, path="/")
            self.redirect("/login", status=303)
            return
        self.done("/vault", f"token {id} revoked ({ended} session(s) ended)")
