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
        self._gone_listeners: list = []

    def on_forget(self, fn) -> None:
        """fn(sandbox_id) when a sandbox is gone (destroyed, failed, or its create undone)."""
        self._gone_listeners.append(fn)

    def register(self, sandbox_id: str, tenant: str, labels: dict[str, str]) -> None:
        policy = self.d.policies.current.policy_for(sandbox_id, labels)
        if policy is not None and policy.tenant is not None and policy.tenant != tenant:
            raise InvalidRequest(f"policy {policy.name!r} applies to this sandbox and belongs to tenant "
                                 f"{policy.tenant!r}, not {tenant!r}")
        # Whatever a sandbox of this id left behind (grants, requests, ...) is stale by
        # definition now that the id is new again: a reused id inherits nothing.
        self._drop_state(sandbox_id)
        # The runtime owns the identity of the sandboxes it creates; the proxy token is
        # not needed in transparent mode and is discarded.
        try:
            self.d.identities.add(sandbox_id, labels, replace=True)
        except IdentityError:   # its message quotes the label value: say what is wrong, not what was sent
            raise InvalidRequest("labels: keys and values must match [A-Za-z0-9_./-], at most 63 chars") from None

    def forget(self, sandbox_id: str) -> None:
        self.d.identities.remove(sandbox_id)
        self._drop_state(sandbox_id)

    def _drop_state(self, sandbox_id: str) -> None:
        """Everything keyed by the sandbox id that must not outlive the sandbox: network
        options, grants scoped to the id, its access requests, its recent denials, its
        filing budget, its DNS new-name windows, and what other services keep (E2B)."""
        d = self.d
        d.policies.remove_network(sandbox_id, actor="runtime")
        d.policies.drop_sandbox_grants(sandbox_id, actor="runtime")
        d.access.forget_sandbox(sandbox_id)
        d.denials.forget(sandbox_id)
        d.agent_endpoint.forget(sandbox_id)
        dns = getattr(d, "_dns", None)
        if dns is not None:   # its state lives on the event loop
            d._loop.call_soon_threadsafe(dns.limiter.forget, sandbox_id)
        for fn in list(self._gone_listeners):
            fn(sandbox_id)

    def set_network(self, sandbox_id: str, network: dict, actor: str) -> None:
        """Per-sandbox network options (narrow only); versioned in the policy store."""
        from egress.policy import PolicyError
        try:
            self.d.policies.set_network(sandbox_id, network, actor=actor)
        except PolicyError as e:
            raise InvalidRequest("network: " + "; ".join(f"{p['pointer'] or '/'}: {p['message']}"
                                                         for p in e.pointers())) from None

    def network_of(self, sandbox_id: str) -> dict | None:
        net = self.d.policies.network(sandbox_id)
        return net.to_doc() if net is not None else None

    def narrow_network(self, inherited: dict | None, requested: dict | None) -> dict | None:
        """A clone's options: its snapshotted sandbox's, narrowed further by the request, never widened."""
        from egress.policy import PolicyError
        from egress.policy.network import SandboxNetwork, narrow_further, parse_network
        if inherited is None:
            return requested
        try:
            asked = parse_network(requested) if requested is not None else SandboxNetwork()
            return narrow_further(parse_network(inherited), asked).to_doc()
        except PolicyError as e:
            raise InvalidRequest("network: " + "; ".join(f"{p['pointer'] or '/'}: {p['message']}"
                                                         for p in e.pointers())) from None

    def l4_allow(self, sandbox_id: str, labels: dict[str, str]) -> list:
        return l4_allow_for(self.d.policies.current, sandbox_id, labels, guard=self.d.guard)

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
