"""What the sandbox runtime needs from the rest of cubegate, wired by the daemon:
identities (so the gateway knows the sandbox and its labels), the policy (tenant
check, L4 allow list) and the vault (placeholders; real values refused)."""
from __future__ import annotations

import vault as vaultlib
from cubegate.l4sync import l4_allow_for
from egress.identity import IdentityError
from sandbox_runtime.manager import InvalidRequest, Unavailable


class DaemonHooks:
    def __init__(self, daemon):
        self.d = daemon

    def register(self, sandbox_id: str, tenant: str, labels: dict[str, str]) -> None:
        policy = self.d.policies.current.policy_for(sandbox_id, labels)
        if policy is not None and policy.tenant is not None and policy.tenant != tenant:
            raise InvalidRequest(f"policy {policy.name!r} applies to this sandbox and belongs to tenant "
                                 f"{policy.tenant!r}, not {tenant!r}")
        # The runtime owns the identity of the sandboxes it creates; the proxy token is
        # not needed in transparent mode and is discarded.
        try:
            self.d.identities.add(sandbox_id, labels, replace=True)
        except IdentityError:   # its message quotes the label value: say what is wrong, not what was sent
            raise InvalidRequest("labels: keys and values must match [A-Za-z0-9_./-], at most 63 chars") from None

    def forget(self, sandbox_id: str) -> None:
        self.d.identities.remove(sandbox_id)
        self.d.policies.remove_network(sandbox_id, actor="runtime")   # network options go with the sandbox
        self.d.denials.forget(sandbox_id)

    def set_network(self, sandbox_id: str, network: dict, actor: str) -> None:
        """Per-sandbox network options (narrow only); versioned in the policy store."""
        from egress.policy import PolicyError
        try:
            self.d.policies.set_network(sandbox_id, network, actor=actor)
        except PolicyError as e:
            raise InvalidRequest("network: " + "; ".join(f"{p['pointer'] or '/'}: {p['message']}"
                                                         for p in e.pointers())) from None

    def l4_allow(self, sandbox_id: str, labels: dict[str, str]) -> list:
        return l4_allow_for(self.d.policies.current, sandbox_id, labels)

    def placeholders(self, tenant: str, sandbox_id: str) -> dict[str, str]:
        v = self.d.vault
        if v is None:
            return {}
        try:
            return v.placeholders_for_sandbox(tenant, sandbox_id)
        except vaultlib.VaultError as e:   # sealed/corrupt: cannot check, so refuse (fail closed)
            raise Unavailable(f"vault unavailable, cannot check the request for secrets: {e}") from None

    def real_secrets_in(self, tenant: str, sandbox_id: str, data: str) -> list[str]:
        v = self.d.vault
        if v is None or not data:
            return []
        try:
            return v.find_leaks(tenant, sandbox_id, data)
        except vaultlib.VaultError as e:
            raise Unavailable(f"vault unavailable, cannot check the request for secrets: {e}") from None

    def audit(self, record: dict) -> None:
        self.d._admin_audit(record)
