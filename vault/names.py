"""Validation of tenant/secret ids and host names (pure)."""
import re

from .errors import InvalidName

_NAME = re.compile(r"[a-z0-9][a-z0-9_.-]{0,63}")
_LABEL = re.compile(r"[a-z0-9_]([a-z0-9_-]{0,61}[a-z0-9_])?")


def check_name(kind: str, name: object) -> str:
    """Return `name` if it is a valid tenant/secret id, else raise InvalidName."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        shown = name if isinstance(name, str) and len(name) <= 80 else "<invalid>"
        raise InvalidName(f"invalid {kind} {shown!r}: must match [a-z0-9][a-z0-9_.-]{{0,63}}")
    return name


def normalize_host(host: str) -> str:
    """Lowercase and strip one trailing dot; no validation."""
    host = host.strip().lower()
    if host.endswith("."):
        host = host[:-1]
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host


def host_pattern_problem(pattern: str) -> str | None:
    """Return why `pattern` (already normalized) is not an exact host or `*.suffix`."""
    if not pattern:
        return "empty host"
    if not pattern.isascii():
        return f"host {pattern!r} is not ASCII (use its punycode form)"
    name = pattern[2:] if pattern.startswith("*.") else pattern
    if "*" in name:
        return f"host {pattern!r}: a wildcard is only allowed as the whole leftmost label ('*.example.com')"
    labels = name.split(".")
    if pattern.startswith("*.") and len(labels) < 2:
        return f"host {pattern!r}: wildcard needs at least two labels after '*.'"
    if len(name) > 253 or not all(_LABEL.fullmatch(label) for label in labels):
        return f"host {pattern!r} is not a valid host name"
    return None
