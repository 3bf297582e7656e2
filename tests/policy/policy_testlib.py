"""Helpers shared by the policy tests (imported by module name; no package)."""

import textwrap
from pathlib import Path

from egress.policy import RequestInfo


def write(dirpath: Path, name: str, text: str) -> Path:
    path = dirpath / name
    path.write_text(textwrap.dedent(text).lstrip("\n"))
    return path


def req(host, port=443, *, sb="sb-1", labels=None, scheme=None, method=None, path=None, ip=False):
    return RequestInfo(sandbox_id=sb, labels=labels or {}, host=host, port=port,
                       scheme=scheme, method=method, path=path, is_ip_literal=ip)
