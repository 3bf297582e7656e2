"""Injection: what the gateway applies to one bound request.

It carries the secret value but never shows it: repr/str name only the
binding, secret id, version and fingerprint.
"""
from __future__ import annotations

import base64
import re
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Iterable

from . import forms as _forms
from .errors import SecretUnavailable
from .scan import ScrubForms

KINDS = ("header", "query", "basic")


@dataclass(frozen=True, eq=False)
class Injection:
    binding_id: str
    secret_id: str
    version: int
    fingerprint: str
    kind: str          # "header" | "query" | "basic"
    name: str          # header name ("Authorization" for basic) or query parameter name
    _wire_value: str = field(repr=False)           # exact value to set (formatted header, "Basic ...", raw)
    value_forms: frozenset = field(repr=False)     # every spelling of the secret, for scrub/leak checks

    def __repr__(self) -> str:
        return (f"Injection(binding_id={self.binding_id!r}, secret_id={self.secret_id!r}, "
                f"version={self.version}, fingerprint={self.fingerprint!r}, kind={self.kind!r}, "
                f"name={self.name!r})")

    __str__ = __repr__

    def __reduce__(self):  # no pickling of values into caches/queues by accident
        raise TypeError("Injection cannot be pickled")

    def apply_to_headers(self, headers: Any) -> None:
        """Remove every sandbox-supplied value of the header (any case, all duplicates), set one.

        Works with mitmproxy Headers (set_all), httpx/tornado-style case-insensitive
        mappings and plain dicts. No-op for query injections.
        """
        if self.kind == "query":
            return
        target = self.name.lower()
        if hasattr(headers, "set_all") and hasattr(headers, "get_all"):  # mitmproxy Headers
            headers.set_all(self.name, [self._wire_value])   # replaces every field of that name, any case
            return
        for _ in range(64):  # bounded: mappings whose keys() shows one casing at a time
            stale = [k for k in list(headers.keys())
                     if (k.decode("latin-1") if isinstance(k, bytes) else str(k)).lower() == target]
            if not stale:
                break
            for k in stale:
                del headers[k]
        else:
            raise RuntimeError(f"could not remove header {self.name!r} from {type(headers).__name__}")
        headers[self.name] = self._wire_value

    def apply_to_query(self, query_pairs: Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
        """Return the pairs without any sandbox-supplied parameter of that name (any case), plus ours."""
        pairs = list(query_pairs)
        if self.kind != "query":
            return pairs
        target = self.name.lower()
        kept = [(k, v) for k, v in pairs if str(k).lower() != target]
        kept.append((self.name, self._wire_value))
        return kept

    @cached_property
    def scrub_forms(self) -> ScrubForms:
        """The forms compiled for body scrubs and escape-aware checks, once per injection (the
        vault keeps an injection per binding and version, and drops it on any change)."""
        return ScrubForms(self.value_forms)

    def scrub(self, data: bytes | str) -> bytes:
        """Replace the value and its base64/urlencoded/hex forms with [REDACTED]."""
        return _forms.scrub(_forms.as_bytes(data), self.value_forms)

    def occurs_in(self, data: bytes | str) -> bool:
        return _forms.contains_any(_forms.as_bytes(data), self.value_forms)


# The write rule (vault.core._check_value) for every kind; a header's value as RFC 9110 field-value
# (VCHAR, obs-text, SP, HTAB): no other control byte.
_FRAMING_BYTES = re.compile(rb"[\r\n\x00]").search
_NOT_FIELD_VALUE = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]").search


def build_injection(*, binding_id: str, secret_id: str, version: int, fingerprint: str,
                    inject: dict, value: bytes) -> Injection:
    """Raises SecretUnavailable for a stored value that would break what it is put into: the store
    may hold one the write path never checked (an older version, a restore, a hand-written file)."""
    where = f"secret {secret_id} version {version} (binding {binding_id!r})"
    if _FRAMING_BYTES(value):
        raise SecretUnavailable(f"{where} holds CR, LF or NUL: never injected")
    text = value.decode("utf-8", "surrogateescape")
    kind = inject["type"]
    extra: tuple[bytes, ...] = ()
    if kind == "header":
        name, wire = inject["name"], inject["format"].replace("{secret}", text)
    elif kind == "basic":
        userpass = (inject["username"] + ":").encode() + value
        token = base64.b64encode(userpass)
        name, wire, extra = "Authorization", "Basic " + token.decode(), (token,)
    elif kind == "query":
        name, wire = inject["name"], text
    else:  # validated at creation; defensive
        raise ValueError(f"unknown injection type {kind!r}")
    if kind == "header" and _NOT_FIELD_VALUE(wire):
        raise SecretUnavailable(f"{where} holds a control byte a header value cannot carry: never injected")
    return Injection(binding_id=binding_id, secret_id=secret_id, version=version,
                     fingerprint=fingerprint, kind=kind, name=name, _wire_value=wire,
                     value_forms=_forms.value_forms(value, extra))
