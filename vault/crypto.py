"""Envelope encryption for secret values (AES-256-GCM) and master-key handling.

Layout of one secret version:
  data key  = 32 random bytes, fresh per version
  ciphertext = AES-GCM(data key, nonce, value, aad)
  wrapped_key = wrap_nonce || AES-GCM(wrap key, wrap_nonce, data key, aad)
  aad = "cubegate-vault/v1" | vault id | tenant | secret id | version
so a ciphertext or wrapped key moved to another row (tenant, id, version or
vault) fails authentication instead of decrypting to someone else's secret.

Every key used here is derived from the master key with HKDF under its own
label, so the master key itself never encrypts data directly.
"""
from __future__ import annotations

import base64
import hashlib
import hmac
import os
import stat

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from cryptography.hazmat.primitives.kdf.scrypt import Scrypt

from .errors import DecryptError, KeyFileError, WrongMasterKey

KEY_BYTES = 32
NONCE_BYTES = 12
ENV_VAR = "CUBEGATE_VAULT_KEY"
# scrypt cost: 2**15 * 8 * 128 B = 32 MiB, ~0.1 s; parameters are stored with the salt.
SCRYPT_N, SCRYPT_R, SCRYPT_P = 2**15, 8, 1
_KCV_PLAINTEXT = b"cubegate-vault key check v1"
_AAD_PREFIX = b"cubegate-vault/v1"


class MasterKey:
    """32 bytes of master key; its repr never shows them."""

    __slots__ = ("_key",)

    def __init__(self, key: bytes):
        if not isinstance(key, (bytes, bytearray)) or len(key) != KEY_BYTES:
            raise KeyFileError(f"master key must be exactly {KEY_BYTES} bytes")
        self._key = bytes(key)

    def __repr__(self) -> str:
        return "MasterKey(<hidden>)"

    __str__ = __repr__

    def raw(self) -> bytes:
        return self._key


def generate_master_key() -> MasterKey:
    return MasterKey(os.urandom(KEY_BYTES))


def create_key_file(path: str | os.PathLike) -> MasterKey:
    """Write a fresh random key to `path` (must not exist), mode 0600."""
    key = generate_master_key()
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise KeyFileError(f"key file {os.fspath(path)} exists already; refusing to overwrite") from None
    try:
        os.fchmod(fd, 0o600)  # umask may have removed bits but never adds; be explicit
        os.write(fd, key.raw())
        os.fsync(fd)
    finally:
        os.close(fd)
    return key


def load_key_file(path: str | os.PathLike) -> MasterKey:
    """Read a key file; refuse one that group or other can read or write."""
    try:
        # O_NONBLOCK: a FIFO (or a device) must not block the open; it is refused just below
        fd = os.open(path, os.O_RDONLY | os.O_NOCTTY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
    except FileNotFoundError:
        raise KeyFileError(f"key file {os.fspath(path)} not found") from None
    except OSError as e:
        raise KeyFileError(f"cannot open key file {os.fspath(path)}: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise KeyFileError(f"key file {os.fspath(path)} is not a regular file")
        if st.st_mode & 0o077:
            raise KeyFileError(
                f"key file {os.fspath(path)} has mode {stat.S_IMODE(st.st_mode):04o}; "
                "it must not be accessible by group or other (chmod 600)")
        data = os.read(fd, KEY_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) != KEY_BYTES:
        raise KeyFileError(f"key file {os.fspath(path)} must hold exactly {KEY_BYTES} bytes")
    return MasterKey(data)


def key_from_env(environ=os.environ, var: str = ENV_VAR) -> MasterKey | None:
    """Master key from base64 in CUBEGATE_VAULT_KEY, or None when unset."""
    raw = environ.get(var)
    if raw is None:
        return None
    try:
        key = base64.b64decode(raw.strip(), validate=True)
    except (ValueError, TypeError):
        raise KeyFileError(f"{var} is not valid base64") from None
    if len(key) != KEY_BYTES:
        raise KeyFileError(f"{var} must decode to exactly {KEY_BYTES} bytes")
    return MasterKey(key)


def key_from_passphrase(passphrase: str | bytes, salt: bytes,
                        n: int = SCRYPT_N, r: int = SCRYPT_R, p: int = SCRYPT_P) -> MasterKey:
    if isinstance(passphrase, str):
        passphrase = passphrase.encode()
    if not passphrase:
        raise KeyFileError("empty passphrase")
    return MasterKey(Scrypt(salt=salt, length=KEY_BYTES, n=n, r=r, p=p).derive(passphrase))


class KeyRing:
    """Purpose-specific keys derived from one master key."""

    __slots__ = ("wrap", "kcv", "fingerprint", "placeholder", "_aead_wrap", "_aead_kcv")

    def __init__(self, master: MasterKey, vault_id: bytes):
        def derive(label: bytes) -> bytes:
            return HKDF(hashes.SHA256(), KEY_BYTES, salt=vault_id,
                        info=b"cubegate-vault " + label).derive(master.raw())
        self.wrap = derive(b"wrap")
        self.kcv = derive(b"key-check")
        self.fingerprint = derive(b"fingerprint")
        self.placeholder = derive(b"placeholder")
        self._aead_wrap = AESGCM(self.wrap)
        self._aead_kcv = AESGCM(self.kcv)

    def __repr__(self) -> str:
        return "KeyRing(<hidden>)"

    # key check value -------------------------------------------------------
    def make_kcv(self) -> bytes:
        nonce = os.urandom(NONCE_BYTES)
        return nonce + self._aead_kcv.encrypt(nonce, _KCV_PLAINTEXT, _AAD_PREFIX + b"|kcv")

    def check_kcv(self, blob: bytes) -> None:
        try:
            ok = self._aead_kcv.decrypt(blob[:NONCE_BYTES], blob[NONCE_BYTES:], _AAD_PREFIX + b"|kcv")
        except (InvalidTag, ValueError):
            ok = None
        if ok != _KCV_PLAINTEXT:
            raise WrongMasterKey("wrong master key: it does not open this vault")

    # secret versions -------------------------------------------------------
    def encrypt(self, aad: bytes, value: bytes) -> tuple[bytes, bytes, bytes]:
        """Return (wrapped_key, nonce, ciphertext) for a new version."""
        data_key = AESGCM.generate_key(bit_length=256)
        nonce = os.urandom(NONCE_BYTES)
        ciphertext = AESGCM(data_key).encrypt(nonce, value, aad)
        wrap_nonce = os.urandom(NONCE_BYTES)
        wrapped = wrap_nonce + self._aead_wrap.encrypt(wrap_nonce, data_key, aad)
        return wrapped, nonce, ciphertext

    def decrypt(self, aad: bytes, wrapped: bytes, nonce: bytes, ciphertext: bytes, what: str) -> bytes:
        try:
            data_key = self._aead_wrap.decrypt(wrapped[:NONCE_BYTES], wrapped[NONCE_BYTES:], aad)
            return AESGCM(data_key).decrypt(nonce, ciphertext, aad)
        except (InvalidTag, ValueError, TypeError):
            raise DecryptError(f"{what}: ciphertext failed authentication "
                               "(tampered, truncated or moved from another row)") from None

    # derived identifiers ---------------------------------------------------
    def fingerprint_of(self, value: bytes) -> str:
        return hmac.new(self.fingerprint, value, hashlib.sha256).hexdigest()[:12]

    def placeholder_of(self, tenant: str, sandbox_id: str, secret_id: str) -> str:
        msg = b"\0".join(s.encode() for s in (tenant, sandbox_id, secret_id))
        digest = hmac.new(self.placeholder, msg, hashlib.sha256).digest()[:20]
        return "cgph_" + base64.b32encode(digest).decode().lower()


def version_aad(vault_id: bytes, tenant: str, secret_id: str, version: int) -> bytes:
    parts = [_AAD_PREFIX, vault_id, tenant.encode(), secret_id.encode(), str(int(version)).encode()]
    # length-prefix every part so no two tuples share an encoding
    return b"".join(len(p).to_bytes(2, "big") + p for p in parts)
