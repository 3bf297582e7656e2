"""Where the master key comes from: one precedence for the daemon, every CLI and their tests.

1. ``CUBEGATE_VAULT_KEY`` (base64 master key), when set;
2. the key file, when it exists;
3. a passphrase, for a vault initialised with one: ``CUBEGATE_VAULT_PASSPHRASE``,
   else ``prompt()`` when the caller is interactive.

A source that is there but wrong (bad base64, a key file readable by others,
the wrong key or passphrase) raises: it never falls through to the next one,
so what unsealed a vault is always the first source present. No source at all
raises NoKeySource (a KeyFileError).
"""
from __future__ import annotations

import os
from collections.abc import Callable, Mapping

from . import crypto
from .core import Vault
from .errors import KeyFileError

KEY_ENV = crypto.ENV_VAR                       # CUBEGATE_VAULT_KEY
PASSPHRASE_ENV = "CUBEGATE_VAULT_PASSPHRASE"
KEY_ENV_VARS = (KEY_ENV, PASSPHRASE_ENV)    # a daemon drops these from its environment once read


class NoKeySource(KeyFileError):
    """None of the key sources is there."""


def unseal_from(vault: Vault, key_file: str | os.PathLike, *, environ: Mapping[str, str] | None = None,
                prompt: Callable[[], str] | None = None) -> str:
    """Unseal `vault` from the first source present; returns its name ("env", "key_file", "passphrase")."""
    environ = os.environ if environ is None else environ
    key = crypto.key_from_env(environ, KEY_ENV)
    if key is not None:
        vault.unseal(key)
        return "env"
    if os.path.lexists(key_file):
        vault.unseal_with_key_file(key_file)
        return "key_file"
    if vault.key_source == "passphrase":
        passphrase = environ.get(PASSPHRASE_ENV) or (prompt() if prompt is not None else None)
        if passphrase:
            vault.unseal_with_passphrase(passphrase)
            return "passphrase"
    raise NoKeySource(f"no master key: {KEY_ENV} is not set and there is no key file {os.fspath(key_file)}"
                      + (f" (passphrase vault: set {PASSPHRASE_ENV})" if vault.key_source == "passphrase" else ""))
