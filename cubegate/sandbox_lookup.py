"""Transparent mode: source address → sandbox identity, via the cubevs registry.

The switch owns the registry (it allocates the addresses); the gateway only
reads it. Labels come from the IdentityStore when the sandbox also has an
explicit-proxy identity there, so policies selected by label apply in both modes.
The same registry says which address a sandbox's explicit-proxy token is accepted from.
"""
from __future__ import annotations

from cubevs.registry import Registry
from egress.identity import Identity, IdentityStore


class RegistryLookup:
    def __init__(self, registry: Registry, identities: IdentityStore):
        self.registry = registry
        self.identities = identities

    def lookup_by_ip(self, ip: str) -> Identity | None:
        sandbox_id = self.registry.lookup_by_ip(ip)
        if sandbox_id is None:
            return None  # not a sandbox address: the gate denies (unknown_source)
        return self.identity_of(sandbox_id, self.identities.get(sandbox_id))

    def address_of(self, sandbox_id: str) -> str | None:
        """The address the switch gave the sandbox (None: no sandbox of the switch's)."""
        entry = self.registry.get(sandbox_id)
        return entry.ip if entry is not None else None

    @staticmethod
    def identity_of(sandbox_id: str, known: Identity | None) -> Identity:
        """A transparent sandbox's identity, given its entry in the identity table (or None)."""
        return known if known is not None else Identity(sandbox_id, {})

    def close(self) -> None:
        self.registry.close()
