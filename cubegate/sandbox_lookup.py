"""Transparent mode: source address → sandbox identity, via the cubevs registry.

The switch owns the registry (it allocates the addresses); the gateway only
reads it. Labels come from the IdentityStore when the sandbox also has an
explicit-proxy identity there, so policies selected by label apply in both modes.
The same registry says which address a sandbox's explicit-proxy token is accepted from.
"""
from __future__ import annotations

from cubevs.registry import Registry
from egress.identity import Identity, IdentityStore
from walmark import WalChangeMark

ADDRESSES_MAX = 65536   # remembered sandbox addresses; cleared whole when full


class RegistryLookup:
    def __init__(self, registry: Registry, identities: IdentityStore):
        self.registry = registry
        self.identities = identities
        self._addresses: dict[str, str | None] = {}   # sandbox id -> its address, as of _mark_seen
        self._mark = WalChangeMark(registry.path)      # valid while the registry stays open
        self._mark_seen: bytes | None = None

    def lookup_by_ip(self, ip: str) -> Identity | None:
        sandbox_id = self.registry.lookup_by_ip(ip)
        if sandbox_id is None:
            return None  # not a sandbox address: the gate denies (unknown_source)
        return self.identity_of(sandbox_id, self.identities.get(sandbox_id))

    def address_of(self, sandbox_id: str) -> str | None:
        """The address the switch gave the sandbox (None: no sandbox of the switch's). Asked on every
        explicit authentication: answered from memory until the registry's next commit, any
        process's (its WAL-index mark, read before the query: a commit in between is never missed)."""
        mark = self._mark.read()
        if mark is None or mark != self._mark_seen or len(self._addresses) >= ADDRESSES_MAX:
            self._addresses.clear()
            self._mark_seen = mark
        if sandbox_id not in self._addresses:
            entry = self.registry.get(sandbox_id)
            self._addresses[sandbox_id] = entry.ip if entry is not None else None
        return self._addresses[sandbox_id]

    @staticmethod
    def identity_of(sandbox_id: str, known: Identity | None) -> Identity:
        """A transparent sandbox's identity, given its entry in the identity table (or None)."""
        return known if known is not None else Identity(sandbox_id, {})

    def close(self) -> None:
        self._mark.close()
        self.registry.close()
