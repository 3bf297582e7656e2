"""A tenant's E2B API key opens that tenant's E2B sandboxes and nothing else.

`e2b.token_tenants` hands a vault token to a tenant as its E2B API key. Vault tokens are
otherwise operator tokens: an admin one is admin on the vault admin API (every tenant's
secrets and bindings), the runtime API (exec in any sandbox), the policy API and the
console. So every API but the E2B one sees the vault's tokens through `OperatorTokens`,
which does not know the tenant keys. "local" (the runtime token file) is the host's own
token, root's to read: it stays an operator token wherever it is accepted.
"""
from __future__ import annotations

from collections.abc import Iterable


class OperatorTokens:
    """The vault's TokenStore minus the tokens given to tenants (same verify/list/create/revoke)."""

    def __init__(self, tokens, tenant_key_ids: Iterable[str]):
        self._tokens = tokens
        self._tenant_keys = frozenset(tenant_key_ids) - {"local"}

    def verify(self, token: str | None):
        info = self._tokens.verify(token)
        return None if info is None or info.id in self._tenant_keys else info

    def list(self):
        return [t for t in self._tokens.list() if t.id not in self._tenant_keys]

    def create(self, *args, **kw):
        return self._tokens.create(*args, **kw)

    def revoke(self, token_id: str) -> None:
        self._tokens.revoke(token_id)


def operator_tokens(settings, vault) -> OperatorTokens | None:
    """What the vault admin, runtime and policy APIs and the console accept of the vault's tokens."""
    if vault is None:
        return None
    return OperatorTokens(vault.tokens, settings.e2b.token_tenants)
