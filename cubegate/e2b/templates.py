"""E2B template ids -> what cubegate starts for them (pure).

`base` and `code-interpreter-v1` are built in; settings (`e2b.templates`) add ids or
override these. A `code-interpreter` template also runs the Python kernel of
kernel.py for `run_code`. Unknown ids are refused (404 the SDK understands).
"""
from __future__ import annotations

import dataclasses

KINDS = ("base", "code-interpreter")


@dataclasses.dataclass(frozen=True)
class Template:
    id: str
    kind: str = "base"             # "base" | "code-interpreter"
    backend: str | None = None     # None: the runtime's default backend
    memory_mb: int | None = None   # None: the runtime's default limits
    cpus: float | None = None
    disk_mb: int | None = None

    def limits_override(self) -> dict:
        return {k: v for k, v in (("memory_mb", self.memory_mb), ("cpus", self.cpus), ("disk_mb", self.disk_mb))
                if v is not None}


BUILTIN = {
    "base": Template("base"),
    "code-interpreter-v1": Template("code-interpreter-v1", kind="code-interpreter", memory_mb=512),
}


class UnknownTemplate(LookupError):
    pass


def catalogue(extra: dict[str, dict] | None = None) -> dict[str, Template]:
    out = dict(BUILTIN)
    for tid, spec in (extra or {}).items():
        out[tid] = Template(tid, **spec)
    return out


def resolve(catalogue: dict[str, Template], template_id: str) -> Template:
    """`name` or `name:tag` (E2B tags; the tag is ignored here) or an alias."""
    name = template_id.split(":", 1)[0] if isinstance(template_id, str) else ""
    if name not in catalogue:
        raise UnknownTemplate(f"template '{name}' not found")
    return catalogue[name]
