"""The Vault: sealed/unsealed state, secrets, bindings and the gateway-facing calls."""
from __future__ import annotations

import json
import os
import sqlite3
import threading
from dataclasses import dataclass
from typing import Any

from . import crypto, forms, scan
from .bindings import Binding, HostPolicyCheck, admission_problems, match_host_port, parse_binding, select
from .crypto import KeyRing, MasterKey
from .errors import (Conflict, InvalidBinding, InvalidValue, NotFound, PlaintextNotAllowed,
                     SecretUnavailable, VaultCorrupt, VaultError, VaultSealed)
from .injection import Injection, build_injection
from .names import check_name
from .store import Store, now
from .tokens import TokenStore

MIN_VALUE_BYTES = 8
MAX_VALUE_BYTES = 64 * 1024
SECURE_SCHEMES = ("https", "wss")
# resolve()'s selection cache: a sandbox picks the paths, so both the entries and the size
# of each key are bounded; a longer request line is selected afresh every time
_SELECTED_ENTRIES = 4096
_SELECTED_KEY_CHARS = 1024
PREVIOUS_VERSION_ACTIONS = ("keep", "disable", "destroy")


@dataclass(frozen=True)
class VersionInfo:
    version: int
    state: str          # active | disabled | destroyed
    fingerprint: str
    created: float

    def to_dict(self) -> dict:
        return {"version": self.version, "state": self.state, "fingerprint": self.fingerprint,
                "created": self.created}


@dataclass(frozen=True)
class SecretInfo:
    """Metadata of one secret; never the value."""
    tenant: str
    id: str
    description: str
    created: float
    current_version: int | None     # highest active version, the one injected
    versions: tuple[VersionInfo, ...]

    def to_dict(self) -> dict:
        return {"tenant": self.tenant, "id": self.id, "description": self.description,
                "created": self.created, "current_version": self.current_version,
                "versions": [v.to_dict() for v in self.versions]}


def _check_value(value: bytes | str) -> bytes:
    if isinstance(value, str):
        value = value.encode("utf-8")
    if not isinstance(value, (bytes, bytearray)):
        raise InvalidValue("secret value must be bytes or str")
    value = bytes(value)
    if len(value) < MIN_VALUE_BYTES:
        raise InvalidValue(f"secret value too short (minimum {MIN_VALUE_BYTES} bytes, "
                           "needed to detect leaks reliably)")
    if len(value) > MAX_VALUE_BYTES:
        raise InvalidValue(f"secret value too long (maximum {MAX_VALUE_BYTES} bytes)")
    if any(b in value for b in (b"\r", b"\n", b"\0")):
        raise InvalidValue("secret value contains CR, LF or NUL (would break HTTP framing)")
    return value


class Vault:
    """Encrypted secret store + bindings. See the package docstring for the gateway API."""

    def __init__(self, store: Store, host_policy_check: HostPolicyCheck | None = None):
        self._store = store
        self._host_policy_check = host_policy_check
        self._vault_id: bytes = store.meta("vault_id")
        self._keys: KeyRing | None = None
        self._lock = threading.RLock()
        self._gen = -1
        self._mark: bytes | None = None        # the store's change_mark() when _gen was read
        self._bindings: dict[str, list[Binding]] = {}
        self._injections: dict[tuple[str, int], Injection] = {}
        self._active: dict[tuple[str, str], list[tuple]] = {}   # (tenant, secret) -> active version rows
        self._selected: dict[tuple, Binding | None] = {}        # (tenant, host, port, method, path) -> binding
        self._leak_forms: dict[tuple[str, str], list[tuple[str, frozenset]]] = {}
        self._needles: dict[tuple, tuple[list, "scan.Needles"]] = {}   # built from the _leak_forms entry it holds
        self.tokens = TokenStore(store)

    # -- lifecycle ---------------------------------------------------------
    @classmethod
    def open(cls, path: str | os.PathLike, *, host_policy_check: HostPolicyCheck | None = None) -> "Vault":
        """Open an existing vault file, sealed. Raises VaultNotFound / VaultCorrupt."""
        return cls(Store.open(path), host_policy_check)

    @classmethod
    def init(cls, path: str | os.PathLike, master_key: MasterKey | None = None, *,
             passphrase: str | None = None, key_source: str = "keyfile",
             host_policy_check: HostPolicyCheck | None = None) -> "Vault":
        """Create a new vault file (0600) for `master_key` or `passphrase`; returns it unsealed."""
        if (master_key is None) == (passphrase is None):
            raise ValueError("give exactly one of master_key or passphrase")
        vault_id, salt = os.urandom(16), os.urandom(16)
        if passphrase is not None:
            master_key, key_source = crypto.key_from_passphrase(passphrase, salt), "passphrase"
        keys = KeyRing(master_key, vault_id)
        store = Store.create(path, {
            "vault_id": vault_id, "kcv": keys.make_kcv(), "kdf_salt": salt,
            "kdf": f"scrypt:{crypto.SCRYPT_N}:{crypto.SCRYPT_R}:{crypto.SCRYPT_P}",
            "key_source": key_source, "created": now()})
        vault = cls(store, host_policy_check)
        vault._keys = keys
        return vault

    @property
    def path(self) -> str:
        return self._store.path

    @property
    def sealed(self) -> bool:
        return self._keys is None

    @property
    def key_source(self) -> str:
        """How this vault was initialised: "keyfile", "env" or "passphrase" (a hint for unsealing)."""
        return self._store.meta("key_source")

    def unseal(self, master_key: MasterKey | bytes) -> None:
        """Check the key against the stored key check value and keep it in memory."""
        if not isinstance(master_key, MasterKey):
            master_key = MasterKey(master_key)
        keys = KeyRing(master_key, self._vault_id)
        keys.check_kcv(self._store.meta("kcv"))  # WrongMasterKey
        with self._lock:
            self._keys = keys
            self._gen = -1

    def unseal_with_passphrase(self, passphrase: str) -> None:
        _, n, r, p = self._store.meta("kdf").split(":")
        self.unseal(crypto.key_from_passphrase(passphrase, self._store.meta("kdf_salt"), int(n), int(r), int(p)))

    def unseal_with_key_file(self, path: str | os.PathLike) -> None:
        self.unseal(crypto.load_key_file(path))

    def seal(self) -> None:
        """Drop the keys and every decrypted value from memory."""
        with self._lock:
            self._keys = None
            self._injections.clear()
            self._leak_forms.clear()
            self._needles.clear()

    def close(self) -> None:
        self.seal()
        self._store.close()

    def _require_keys(self) -> KeyRing:
        keys = self._keys
        if keys is None:
            raise VaultSealed("vault is sealed")
        return keys

    # -- secrets -------------------------------------------------------------
    def put_secret(self, tenant: str, secret_id: str, value: bytes | str, *, description: str = "") -> SecretInfo:
        """Create a secret with version 1. Conflict if it exists (use rotate)."""
        check_name("tenant", tenant), check_name("secret id", secret_id)
        value = _check_value(value)
        keys = self._require_keys()
        with self._store.write() as c:
            if c.execute("SELECT 1 FROM secrets WHERE tenant=? AND id=?", (tenant, secret_id)).fetchone():
                raise Conflict(f"secret {tenant}/{secret_id} exists already; rotate it instead")
            c.execute("INSERT INTO secrets (tenant, id, created, description) VALUES (?,?,?,?)",
                      (tenant, secret_id, now(), str(description)[:500]))
            self._insert_version(c, keys, tenant, secret_id, 1, value)
        return self.get_secret(tenant, secret_id)

    def rotate(self, tenant: str, secret_id: str, value: bytes | str, *, previous: str = "disable") -> SecretInfo:
        """Add a new version, which becomes current at once; older active versions are
        kept, disabled (default) or destroyed according to `previous`."""
        check_name("tenant", tenant), check_name("secret id", secret_id)
        if previous not in PREVIOUS_VERSION_ACTIONS:
            raise ValueError(f"previous must be one of {PREVIOUS_VERSION_ACTIONS}")
        value = _check_value(value)
        keys = self._require_keys()
        with self._store.write() as c:
            if not c.execute("SELECT 1 FROM secrets WHERE tenant=? AND id=?", (tenant, secret_id)).fetchone():
                raise NotFound(f"no secret {tenant}/{secret_id}")
            last = c.execute("SELECT MAX(version) FROM versions WHERE tenant=? AND id=?",
                             (tenant, secret_id)).fetchone()[0] or 0
            if previous == "disable":
                c.execute("UPDATE versions SET state='disabled' WHERE tenant=? AND id=? AND state='active'",
                          (tenant, secret_id))
            elif previous == "destroy":
                self._destroy_where(c, "tenant=? AND id=? AND state!='destroyed'", (tenant, secret_id))
            self._insert_version(c, keys, tenant, secret_id, last + 1, value)
        if previous == "destroy":
            self._store.checkpoint()
        return self.get_secret(tenant, secret_id)

    def _insert_version(self, c: sqlite3.Connection, keys: KeyRing, tenant: str, secret_id: str,
                        version: int, value: bytes) -> None:
        aad = crypto.version_aad(self._vault_id, tenant, secret_id, version)
        wrapped, nonce, ct = keys.encrypt(aad, value)
        c.execute("INSERT INTO versions (tenant, id, version, state, wrapped_key, nonce, ciphertext, "
                  "fingerprint, created) VALUES (?,?,?,'active',?,?,?,?,?)",
                  (tenant, secret_id, version, wrapped, nonce, ct, keys.fingerprint_of(value), now()))

    @staticmethod
    def _destroy_where(c: sqlite3.Connection, where: str, args: tuple) -> int:
        # secure_delete=ON overwrites the freed cells; callers checkpoint the WAL afterwards
        return c.execute(f"UPDATE versions SET state='destroyed', wrapped_key=NULL, nonce=NULL, "
                         f"ciphertext=NULL WHERE {where}", args).rowcount

    def _set_state(self, tenant: str, secret_id: str, version: int, state: str) -> SecretInfo:
        check_name("tenant", tenant), check_name("secret id", secret_id)
        with self._store.write() as c:
            row = c.execute("SELECT state FROM versions WHERE tenant=? AND id=? AND version=?",
                            (tenant, secret_id, int(version))).fetchone()
            if row is None:
                raise NotFound(f"no version {version} of secret {tenant}/{secret_id}")
            if row[0] == "destroyed" and state != "destroyed":
                raise Conflict(f"version {version} of {tenant}/{secret_id} is destroyed")
            if state == "destroyed":
                self._destroy_where(c, "tenant=? AND id=? AND version=?", (tenant, secret_id, int(version)))
            else:
                c.execute("UPDATE versions SET state=? WHERE tenant=? AND id=? AND version=?",
                          (state, tenant, secret_id, int(version)))
        if state == "destroyed":
            self._store.checkpoint()
        return self.get_secret(tenant, secret_id)

    def disable_version(self, tenant: str, secret_id: str, version: int) -> SecretInfo:
        return self._set_state(tenant, secret_id, version, "disabled")

    def enable_version(self, tenant: str, secret_id: str, version: int) -> SecretInfo:
        return self._set_state(tenant, secret_id, version, "active")

    def destroy_version(self, tenant: str, secret_id: str, version: int) -> SecretInfo:
        """Irreversibly wipe the ciphertext of one version (metadata and fingerprint stay)."""
        return self._set_state(tenant, secret_id, version, "destroyed")

    def delete_secret(self, tenant: str, secret_id: str) -> None:
        """Delete a secret and all its versions. Conflict while a binding uses it."""
        check_name("tenant", tenant), check_name("secret id", secret_id)
        with self._store.write() as c:
            bound = [r[0] for r in c.execute("SELECT id FROM bindings WHERE tenant=? AND secret_id=?",
                                             (tenant, secret_id))]
            if bound:
                raise Conflict(f"secret {tenant}/{secret_id} is used by bindings {sorted(bound)}; remove them first")
            self._destroy_where(c, "tenant=? AND id=?", (tenant, secret_id))
            c.execute("DELETE FROM versions WHERE tenant=? AND id=?", (tenant, secret_id))
            if c.execute("DELETE FROM secrets WHERE tenant=? AND id=?", (tenant, secret_id)).rowcount == 0:
                raise NotFound(f"no secret {tenant}/{secret_id}")
        self._store.checkpoint()

    def get_secret(self, tenant: str, secret_id: str) -> SecretInfo:
        check_name("tenant", tenant), check_name("secret id", secret_id)
        found = self.list_secrets(tenant, _only=secret_id)
        if not found:
            raise NotFound(f"no secret {tenant}/{secret_id}")
        return found[0]

    def list_secrets(self, tenant: str | None = None, *, _only: str | None = None) -> list[SecretInfo]:
        if tenant is not None:
            check_name("tenant", tenant)
        where, args = [], []
        if tenant is not None:
            where.append("s.tenant = ?"), args.append(tenant)
        if _only is not None:
            where.append("s.id = ?"), args.append(_only)
        sql = ("SELECT s.tenant, s.id, s.description, s.created, v.version, v.state, v.fingerprint, v.created "
               "FROM secrets s LEFT JOIN versions v ON v.tenant = s.tenant AND v.id = s.id "
               + ("WHERE " + " AND ".join(where) if where else "")
               + " ORDER BY s.tenant, s.id, v.version")
        out: dict[tuple[str, str], tuple[list, list[VersionInfo]]] = {}
        for t, i, d, cr, ver, st, fp, vcr in self._store.query(sql, tuple(args)):
            entry = out.setdefault((t, i), ([d, cr], []))
            if ver is not None:
                entry[1].append(VersionInfo(ver, st, fp, vcr))
        result = []
        for (t, i), ((d, cr), versions) in out.items():
            active = [v.version for v in versions if v.state == "active"]
            result.append(SecretInfo(t, i, d, cr, max(active) if active else None, tuple(versions)))
        return result

    # -- bindings ------------------------------------------------------------
    def add_binding(self, doc: dict) -> Binding:
        """Validate and store a binding. Raises InvalidBinding with every reason."""
        binding = parse_binding(doc)
        with self._store.write() as c:
            if not c.execute("SELECT 1 FROM secrets WHERE tenant=? AND id=?",
                             (binding.tenant, binding.secret_id)).fetchone():
                raise InvalidBinding(f"secret {binding.tenant}/{binding.secret_id} does not exist")
            existing = [self._row_to_binding(r) for r in c.execute("SELECT spec FROM bindings")]
            problems = admission_problems(binding, existing, self._safe_policy_check)
            if problems:
                raise InvalidBinding(problems)
            c.execute("INSERT INTO bindings (id, tenant, secret_id, spec, created) VALUES (?,?,?,?,?)",
                      (binding.id, binding.tenant, binding.secret_id, json.dumps(binding.to_dict()), now()))
        return binding

    def _safe_policy_check(self, tenant: str, host: str) -> str | None:
        if self._host_policy_check is None:
            return None
        try:
            return self._host_policy_check(tenant, host)
        except Exception as e:  # fail closed: a broken hook refuses
            return f"host policy check failed ({type(e).__name__})"

    @staticmethod
    def _row_to_binding(row: tuple) -> Binding:
        return parse_binding(json.loads(row[0]))

    def list_bindings(self, tenant: str | None = None) -> list[Binding]:
        if tenant is None:
            rows = self._store.query("SELECT spec FROM bindings ORDER BY tenant, id")
        else:
            rows = self._store.query("SELECT spec FROM bindings WHERE tenant=? ORDER BY id", (check_name("tenant", tenant),))
        return [self._row_to_binding(r) for r in rows]

    def get_binding(self, binding_id: str) -> Binding:
        rows = self._store.query("SELECT spec FROM bindings WHERE id=?", (binding_id,))
        if not rows:
            raise NotFound(f"no binding {binding_id!r}")
        return self._row_to_binding(rows[0])

    def remove_binding(self, binding_id: str) -> None:
        with self._store.write() as c:
            if c.execute("DELETE FROM bindings WHERE id=?", (binding_id,)).rowcount == 0:
                raise NotFound(f"no binding {binding_id!r}")

    # -- caches ----------------------------------------------------------------
    def _refresh(self) -> None:
        """Reload bindings and drop derived caches when any process changed the store."""
        mark = self._store.change_mark()      # read before the generation: a commit in between
        if mark is not None and mark == self._mark:   # makes the next mark differ, never missed
            return
        try:
            gen = self._store.generation()
            if gen == self._gen:
                self._mark = mark
                return
            by_tenant: dict[str, list[Binding]] = {}
            for b in self.list_bindings():
                by_tenant.setdefault(b.tenant, []).append(b)
        except sqlite3.Error as e:
            raise VaultCorrupt(f"vault store unreadable: {e}") from None
        except InvalidBinding as e:
            raise VaultCorrupt(f"vault store holds an invalid binding: {e}") from None
        self._bindings = by_tenant
        self._injections.clear()
        self._active.clear()
        self._selected.clear()
        self._leak_forms.clear()
        self._needles.clear()
        self._gen, self._mark = gen, mark

    def _versions_rows(self, tenant: str, secret_id: str, states: tuple[str, ...]) -> list[tuple]:
        marks = ",".join("?" * len(states))
        return self._store.query(
            f"SELECT version, fingerprint, wrapped_key, nonce, ciphertext FROM versions "
            f"WHERE tenant=? AND id=? AND state IN ({marks}) ORDER BY version DESC",
            (tenant, secret_id, *states))

    def _decrypt(self, keys: KeyRing, tenant: str, secret_id: str, row: tuple) -> bytes:
        version, _fp, wrapped, nonce, ct = row
        if wrapped is None or nonce is None or ct is None:
            raise VaultCorrupt(f"version {version} of {tenant}/{secret_id} has no ciphertext")
        aad = crypto.version_aad(self._vault_id, tenant, secret_id, version)
        return keys.decrypt(aad, bytes(wrapped), bytes(nonce), bytes(ct),
                            f"secret {tenant}/{secret_id} version {version}")

    # -- gateway API ---------------------------------------------------------------
    def needs_interception(self, tenant: str | None, host: str, port: int) -> bool:
        """True if any binding of `tenant` covers host:port (any scheme, method, path)."""
        if tenant is None:
            return False
        with self._lock:
            self._refresh()
            return bool(match_host_port(self._bindings.get(tenant, ()), host, port))

    def resolve(self, tenant: str | None, *, scheme: str, host: str, port: int, method: str,
                path: str) -> Injection | None:
        """The injection for one request, or None when no binding matches.

        Raises AmbiguousBinding, PlaintextNotAllowed (binding matched over http
        without allow_plaintext), VaultSealed and SecretUnavailable (binding
        matched but no usable version) — the gateway must then fail closed.
        """
        if tenant is None:
            return None
        with self._lock:
            self._refresh()
            # select() reads the path without its query (clean_path): the query is not in the key, so
            # no query string (where a placeholder may travel) is kept here; a '#' before it is
            key = (tenant, host, port, method, path.split("?", 1)[0])
            binding = self._selected.get(key, False)
            if binding is False:    # the same request line on a keep-alive connection: selected once
                binding = select(self._bindings.get(tenant, ()), host=host, port=port, method=method, path=path)
                if len(method) + len(key[4]) <= _SELECTED_KEY_CHARS:   # at most ~4 MiB of keys
                    if len(self._selected) >= _SELECTED_ENTRIES:
                        self._selected.clear()
                    self._selected[key] = binding
            if binding is None:
                return None
            if scheme.lower() not in SECURE_SCHEMES and not binding.match.allow_plaintext:
                raise PlaintextNotAllowed(f"binding {binding.id!r} injects only over https; "
                                          f"request used {scheme!r}")
            keys = self._require_keys()
            rows = self._active.get((tenant, binding.secret_id))
            if rows is None:      # one query per secret and store generation, not per request
                if len(self._active) > 4096:
                    self._active.clear()
                rows = self._active[(tenant, binding.secret_id)] = self._versions_rows(
                    tenant, binding.secret_id, ("active",))
            if not rows:
                raise SecretUnavailable(f"secret {tenant}/{binding.secret_id} (binding {binding.id!r}) "
                                        "has no active version")
            version = rows[0][0]
            cached = self._injections.get((binding.id, version))
            if cached is not None:
                return cached
            value = self._decrypt(keys, tenant, binding.secret_id, rows[0])
            inj = build_injection(binding_id=binding.id, secret_id=binding.secret_id, version=version,
                                  fingerprint=rows[0][1], inject=binding.inject, value=value)
            self._injections[(binding.id, version)] = inj
            return inj

    def placeholder_for(self, tenant: str, sandbox_id: str, secret_id: str) -> str:
        """Harmless stand-in the sandbox may hold ("cgph_" + 32 base32 chars), deterministic per
        (vault, master key, tenant, sandbox, secret)."""
        check_name("tenant", tenant), check_name("secret id", secret_id)
        if not isinstance(sandbox_id, str) or not sandbox_id or "\0" in sandbox_id:
            raise ValueError("sandbox_id must be a non-empty string")
        return self._require_keys().placeholder_of(tenant, sandbox_id, secret_id)

    def placeholders_for_sandbox(self, tenant: str, sandbox_id: str) -> dict[str, str]:
        """{secret_id: placeholder} for every secret of `tenant` used by a placeholder binding
        (what the runtime puts into the sandbox's environment)."""
        with self._lock:
            self._refresh()
            ids = sorted({b.secret_id for b in self._bindings.get(tenant, ()) if b.placeholder})
        return {sid: self.placeholder_for(tenant, sandbox_id, sid) for sid in ids}

    def find_leaks(self, tenant: str | None, sandbox_id: str, data: bytes | str) -> list[str]:
        """Secret ids of `tenant` whose placeholder (for this sandbox) or whose value (any
        non-destroyed version) occurs in `data`, raw or base64/url-encoded/hex.

        Call it on header, query and body bytes of a request headed where the
        secret is not bound; on a bound request, ignore the injected secret id.
        Raises VaultSealed when sealed (fail closed).
        """
        if tenant is None:
            return []
        return sorted(self.leak_needles(tenant, sandbox_id).find(forms.as_bytes(data)))

    def leak_needles(self, tenant: str | None, sandbox_id: str, *, exclude: str | None = None) -> "scan.Needles":
        """A matcher for every placeholder (of this sandbox) and value of `tenant`'s secrets, except
        the secret `exclude` (the one injected into this very request). For stream checks of bodies.
        Raises VaultSealed when sealed (the caller fails closed)."""
        if tenant is None:
            return scan.Needles(())
        with self._lock:
            self._refresh()
            entries = self._leak_forms.get((tenant, sandbox_id))
            if entries is None:
                # A tenant without secrets has nothing to leak, sealed or not.
                entries = (self._build_leak_forms(self._require_keys(), tenant, sandbox_id)
                           if self.list_secrets(tenant) else [])
                self._leak_forms[(tenant, sandbox_id)] = entries
            key = (tenant, sandbox_id, exclude)
            needles = self._needles.get(key)
            if needles is None or needles[0] is not entries:
                if len(self._needles) > 4096:
                    self._needles.clear()
                needles = (entries, scan.Needles((sid, fs) for sid, fs in entries if sid != exclude))
                self._needles[key] = needles
            return needles[1]

    def _build_leak_forms(self, keys: KeyRing, tenant: str, sandbox_id: str) -> list[tuple[str, frozenset]]:
        out = []
        for info in self.list_secrets(tenant):
            placeholder = keys.placeholder_of(tenant, sandbox_id, info.id).encode()
            out.append((info.id, forms.value_forms(placeholder)))
            for row in self._versions_rows(tenant, info.id, ("active", "disabled")):
                out.append((info.id, forms.value_forms(self._decrypt(keys, tenant, info.id, row))))
        if len(self._leak_forms) > 4096:  # bounded: many short-lived sandboxes
            self._leak_forms.clear()
        return out

    # -- introspection -----------------------------------------------------------
    def status(self) -> dict[str, Any]:
        counts = {t: self._store.query(f"SELECT COUNT(*) FROM {t}")[0][0]
                  for t in ("secrets", "versions", "bindings", "tokens")}
        return {"sealed": self.sealed, "path": self.path, "vault_id": self._vault_id.hex(),
                "key_source": self.key_source, "generation": self._store.generation(), **counts}

    def verify(self) -> list[str]:
        """Decrypt every non-destroyed version and check its fingerprint; return problems
        (without values). Needs the vault unsealed."""
        keys = self._require_keys()
        problems = []
        for info in self.list_secrets():
            for row in self._versions_rows(info.tenant, info.id, ("active", "disabled")):
                try:
                    value = self._decrypt(keys, info.tenant, info.id, row)
                except VaultError as e:
                    problems.append(str(e))
                    continue
                if keys.fingerprint_of(value) != row[1]:
                    problems.append(f"secret {info.tenant}/{info.id} version {row[0]}: fingerprint mismatch")
        return problems
