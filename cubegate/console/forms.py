"""Form fields → the documents the vault, the sandbox manager and the audit index take (pure).

Errors name the field and the line, never what was typed: an env value, a
label or a header format may hold something an operator did not mean to show.
"""
from __future__ import annotations

import re
from typing import Mapping

from httpkit import ApiError

_SPLIT = re.compile(r"[\s,]+")
MAX_LINES = 500


def invalid(message: str) -> ApiError:
    return ApiError(400, "invalid", message)


def pairs(text: str, field: str) -> dict[str, str]:
    """`NAME=VALUE` per line (blank lines skipped); a repeated name is an error."""
    out: dict[str, str] = {}
    lines = text.splitlines()
    if len(lines) > MAX_LINES:
        raise invalid(f"{field}: at most {MAX_LINES} lines")
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        name, eq, value = line.partition("=")
        name = name.strip()
        if not eq or not name:
            raise invalid(f"{field} line {n}: expected NAME=VALUE")
        if name in out:
            raise invalid(f"{field} line {n}: a name given twice")
        out[name] = value.strip()
    return out


def words(text: str) -> list[str]:
    """Items separated by commas or white space."""
    return [w for w in _SPLIT.split(text.strip()) if w]


def integers(text: str, field: str) -> list[int]:
    out = []
    for w in words(text):
        if not w.isdigit():
            raise invalid(f"{field}: whole numbers only")
        out.append(int(w))
    return out


def optional_number(text: str, field: str, kind: type = int) -> int | float | None:
    text = text.strip()
    if not text:
        return None
    try:
        value = kind(text)
    except ValueError:
        raise invalid(f"{field}: must be a {'whole ' if kind is int else ''}number") from None
    if not value > 0 or value != value:
        raise invalid(f"{field}: must be > 0")
    return value


def checkbox(form: Mapping[str, str], name: str) -> bool:
    return form.get(name, "") in ("on", "1", "true", "yes")


def binding_options(form: Mapping[str, str]) -> dict:
    """The binding form's fields as the keyword arguments of vault.bindings.doc_from_options (the CLI's)."""
    kind = form.get("inject", "header")
    if kind not in ("header", "query", "basic"):
        raise invalid("inject: header, query or basic")
    return {"binding_id": form.get("id", "").strip(), "tenant": form.get("tenant", "").strip(),
            "secret_id": form.get("secret_id", "").strip(), "hosts": words(form.get("hosts", "")),
            "ports": integers(form.get("ports", ""), "ports"), "methods": words(form.get("methods", "")),
            "path_prefixes": words(form.get("path_prefixes", "")),
            "allow_plaintext": checkbox(form, "allow_plaintext"), "placeholder": checkbox(form, "placeholder"),
            "header": form.get("header", "").strip() if kind == "header" else None,
            "fmt": form.get("format", "") or "Bearer {secret}",
            "query": form.get("query", "").strip() if kind == "query" else None,
            "basic_user": form.get("basic_user", "").strip() if kind == "basic" else None}


def sandbox_document(form: Mapping[str, str]) -> dict:
    """The create form as a sandbox API body (cubegate.runtime_models.CreateSandbox validates it)."""
    limits = {k: optional_number(form.get(k, ""), k, float if k == "cpus" else int)
              for k in ("memory_mb", "cpus", "pids", "disk_mb")}
    doc = {"id": form.get("id", "").strip(), "tenant": form.get("tenant", "").strip(),
           "labels": pairs(form.get("labels", ""), "labels"), "env": pairs(form.get("env", ""), "env"),
           "secret_env": pairs(form.get("secret_env", ""), "secret env"),
           "limits": {k: v for k, v in limits.items() if v is not None}}
    backend = form.get("backend", "").strip()
    if backend:
        doc["backend"] = backend
    return doc


AUDIT_FILTERS = ("sandbox", "host", "decision", "reason", "event", "since", "until")


def audit_filters(args: Mapping[str, str]) -> dict[str, str]:
    """The audit page's filters that are set (the index validates them)."""
    return {k: args[k].strip() for k in AUDIT_FILTERS if args.get(k, "").strip()}


def audit_limit(text: str, default: int = 200, most: int = 1000) -> int:
    n = optional_number(text, "limit") if text.strip() else default
    return min(int(n), most)
