"""Exceptions of the vault. No message ever contains a secret value."""


class VaultError(Exception):
    """Base class of every vault error."""


class VaultSealed(VaultError):
    """The vault holds no master key; values cannot be read or written."""


class VaultCorrupt(VaultError):
    """The store file is damaged or not a vault; nothing is served from it."""


class VaultNotFound(VaultError):
    """No vault file at the given path (run `vault init`)."""


class WrongMasterKey(VaultError):
    """The master key does not open this vault."""


class KeyFileError(VaultError):
    """The key file is missing, malformed or readable by group/other."""


class DecryptError(VaultError):
    """A stored ciphertext failed authentication (tampered or swapped)."""


class InvalidName(VaultError, ValueError):
    """A tenant or secret id does not match [a-z0-9][a-z0-9_.-]{0,63}."""


class InvalidValue(VaultError, ValueError):
    """A secret value cannot be stored (empty, too short, CR/LF/NUL)."""


class NotFound(VaultError, KeyError):
    """Unknown secret, version, binding or token."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else "not found"


class Conflict(VaultError):
    """The change contradicts the current state (exists already, still bound, destroyed)."""


class InvalidBinding(VaultError, ValueError):
    """A binding is refused at creation; `.reasons` lists every problem."""

    def __init__(self, reasons: list[str] | str):
        self.reasons = [reasons] if isinstance(reasons, str) else list(reasons)
        super().__init__("; ".join(self.reasons))


class AmbiguousBinding(VaultError):
    """Two bindings match one request equally well; nothing is injected."""


class PlaintextNotAllowed(VaultError):
    """A bound request uses http:// and the binding does not allow plaintext."""


class SecretUnavailable(VaultError):
    """A binding matched but its secret has no active version (fail closed)."""
