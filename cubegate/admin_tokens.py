"""Who may use the policy API: the local admin token file, or a vault admin token.

The file (<state_dir>/admin.token, 0600, created at the daemon's first start)
is what `cubegate policy|access ...` on the host reads; its actor is "local".
Vault tokens keep their scopes: `read` may GET, `admin` may do everything; the
actor is the token's id. No new scope: a policy change is an admin action.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Actor:
    id: str
    scope: str      # admin | read


def ensure_token_file(path: Path, prefix: str = "cgat_") -> None:
    """A local token file: created once (0600) with a random token, never rewritten."""
    if path.exists():
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(prefix + secrets.token_urlsafe(32) + "\n")


class AdminTokens:
    """The token in `token_file` (actor "local", scope admin), else a vault token with its own scope."""

    def __init__(self, token_file: Path, vault_tokens=None):
        self._hash = hashlib.sha256(token_file.read_text().strip().encode()).hexdigest()
        self._vault_tokens = vault_tokens

    def verify(self, token: str) -> Actor | None:
        if hmac.compare_digest(self._hash, hashlib.sha256(token.encode()).hexdigest()):
            return Actor("local", "admin")
        if self._vault_tokens is not None:
            info = self._vault_tokens.verify(token)
            if info is not None:
                return Actor(info.id, info.scope)
        return None
