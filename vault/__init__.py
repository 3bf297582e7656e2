"""cubegate credential vault: encrypted secrets, bindings, injection, admin API.

Imports nothing else of cubegate. The gateway uses only what is listed here.

Opening and unsealing::

    vault = Vault.open(path, host_policy_check=None)   # sealed; VaultNotFound / VaultCorrupt
    vault.unseal(load_key_file(key_path))                # or key_from_env(), or:
    vault.unseal_with_passphrase(passphrase)             # WrongMasterKey on a wrong key
    unseal_from(vault, key_file)   # what the daemon and CLIs use: CUBEGATE_VAULT_KEY, else the key
                                   # file, else CUBEGATE_VAULT_PASSPHRASE (vault.keysource)
    vault.sealed -> bool ; vault.seal()                  # seal drops keys and cached values

Gateway calls (thread-safe; every call sees changes made by any process
writing the same file, via a generation counter, so rotation is hot)::

    vault.needs_interception(tenant, host, port) -> bool
        Any binding of `tenant` for host:port (any scheme/method/path): MITM it.
        Works while sealed (so a sealed vault leads to resolve() -> VaultSealed -> 503).
    vault.resolve(tenant, *, scheme, host, port, method, path) -> Injection | None
        None: no binding matches (forward untouched). Raises AmbiguousBinding,
        PlaintextNotAllowed, VaultSealed, SecretUnavailable, VaultCorrupt — all
        VaultError subclasses: fail closed (503/403 with str(exc) as reason).
    vault.placeholder_for(tenant, sandbox_id, secret_id) -> str     # "cgph_..." (needs unsealed)
    vault.placeholders_for_sandbox(tenant, sandbox_id) -> {secret_id: placeholder}
        for secrets used by bindings with placeholder=true (for the sandbox env).
    vault.find_leaks(tenant, sandbox_id, data: bytes | str) -> list[str]
        Secret ids whose placeholder or value (any non-destroyed version; raw,
        base64 at any alignment, url-encoded, hex) occurs in `data`. On a bound
        request drop the injected secret id from the result.

Injection (frozen; repr/str never show the value)::

    binding_id, secret_id, version, fingerprint, kind ("header"|"query"|"basic"), name
    apply_to_headers(headers)   # removes all sandbox values of `name` (any case, duplicates), sets one
    apply_to_query(pairs) -> list[(k, v)]   # for kind "query"; else returns pairs unchanged
    scrub(data) -> bytes        # value and its encodings -> b"[REDACTED]"
    occurs_in(data) -> bool
    value_forms: frozenset[bytes]   (not in repr)

Administration (also through `vault.cli` and `vault.api`): put_secret, rotate,
disable_version, enable_version, destroy_version, delete_secret, get_secret,
list_secrets, add_binding, list_bindings, get_binding, remove_binding, status,
verify, tokens (TokenStore). Metadata objects never carry a value.

Admin HTTP API: `vault.api.make_app(vault, tokens=None, *, audit_hook=None)` and
`vault.api.serve(vault, host="127.0.0.1", port=8474, unix_socket=None, *, tokens=None,
audit_hook=None, allow_non_loopback=False) -> AdminServer` (.port, .stop()).
CLI: `vault.cli.vault_cli` (click group "vault").
"""
from .bindings import FORBIDDEN_HEADERS, Binding, Match, parse_binding
from .core import SecretInfo, Vault, VersionInfo
from .crypto import MasterKey, create_key_file, generate_master_key, key_from_env, key_from_passphrase, load_key_file
from .errors import (AmbiguousBinding, Conflict, DecryptError, InvalidBinding, InvalidName, InvalidValue,
                     KeyFileError, NotFound, PlaintextNotAllowed, SecretUnavailable, VaultCorrupt, VaultError,
                     VaultNotFound, VaultSealed, WrongMasterKey)
from .injection import Injection
from .forms import normalize
from .keysource import KEY_ENV_VARS, NoKeySource, unseal_from
from .scan import LeakFound, Needles, ScrubForms, StreamLeakScanner, StreamScrubber, Unscrubbable
from .tokens import TokenInfo, TokenStore

__all__ = [
    "Vault", "Injection", "Binding", "Match", "SecretInfo", "VersionInfo", "TokenInfo", "TokenStore",
    "MasterKey", "create_key_file", "load_key_file", "key_from_env", "key_from_passphrase",
    "generate_master_key", "parse_binding", "FORBIDDEN_HEADERS", "unseal_from", "NoKeySource", "KEY_ENV_VARS",
    "VaultError", "VaultSealed", "VaultCorrupt", "VaultNotFound", "WrongMasterKey", "KeyFileError",
    "DecryptError", "InvalidName", "InvalidValue", "NotFound", "Conflict", "InvalidBinding",
    "AmbiguousBinding", "PlaintextNotAllowed", "SecretUnavailable",
    "normalize", "Needles", "ScrubForms", "LeakFound", "StreamLeakScanner", "StreamScrubber", "Unscrubbable",
]
