"""Admin API bearer tokens: stored as sha256 hashes, compared in constant time.

Token format: "cgvt_<id>_<43 chars base64url of 32 random bytes>". The id is a
public handle (audit "actor", revocation); only the sha256 of the whole token
is stored.
"""
from __future__ import annotations

import base64
import hashlib
import hmac
import os
import re
from dataclasses import dataclass

from .errors import NotFound
from .store import Store, now

SCOPES = ("admin", "read")
_FORMAT = re.compile(r"cgvt_([a-z0-9]{12})_([A-Za-z0-9_-]{43})")


@dataclass(frozen=True)
class TokenInfo:
    id: str
    scope: str
    description: str
    created: float
    expires: float | None

    def expired(self, at: float | None = None) -> bool:
        return self.expires is not None and (at if at is not None else now()) >= self.expires


def _hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


class TokenStore:
    def __init__(self, store: Store):
        self._store = store

    def create(self, scope: str, ttl_seconds: float | None = None, description: str = "") -> tuple[TokenInfo, str]:
        """Return (info, token). The token is shown once and never stored."""
        if scope not in SCOPES:
            raise ValueError(f"scope must be one of {SCOPES}")
        if ttl_seconds is not None and ttl_seconds <= 0:
            raise ValueError("ttl must be positive")
        token_id = base64.b32encode(os.urandom(10)).decode().lower()[:12]
        secret = base64.urlsafe_b64encode(os.urandom(32)).decode().rstrip("=")
        token = f"cgvt_{token_id}_{secret}"
        created = now()
        expires = created + ttl_seconds if ttl_seconds is not None else None
        with self._store.write() as c:
            c.execute("INSERT INTO tokens (id, hash, scope, description, created, expires) VALUES (?,?,?,?,?,?)",
                      (token_id, _hash(token), scope, description, created, expires))
        return TokenInfo(token_id, scope, description, created, expires), token

    def verify(self, token: str | None) -> TokenInfo | None:
        """TokenInfo for a valid, unexpired token; None otherwise."""
        if not token:
            return None
        m = _FORMAT.fullmatch(token)
        # Compare against a dummy hash when the id is unknown, so timing does not tell.
        rows = self._store.query("SELECT id, hash, scope, description, created, expires FROM tokens WHERE id = ?",
                                 (m.group(1),)) if m else []
        stored = rows[0][1] if rows else "0" * 64
        ok = hmac.compare_digest(stored, _hash(token)) and bool(rows)
        if not ok:
            return None
        info = TokenInfo(rows[0][0], rows[0][2], rows[0][3], rows[0][4], rows[0][5])
        return None if info.expired() else info

    def list(self) -> list[TokenInfo]:
        return [TokenInfo(*r) for r in self._store.query(
            "SELECT id, scope, description, created, expires FROM tokens ORDER BY created")]

    def revoke(self, token_id: str) -> None:
        with self._store.write() as c:
            if c.execute("DELETE FROM tokens WHERE id = ?", (token_id,)).rowcount == 0:
                raise NotFound(f"no token {token_id!r}")
