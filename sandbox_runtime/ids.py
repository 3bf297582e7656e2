"""The one definition of a runtime sandbox id, for the runtime, its backends and its API.

Lower-case letters, digits and '-', not starting with '-' (an id ends up in
interface, cgroup, netns and file names, and in argv), at most 40 characters
(interface names are short). `PATTERN` is unanchored for embedding in a route
or an OpenAPI document (anchor it there: ^...$).
"""
from __future__ import annotations

import re

MAX_LEN = 40
PATTERN = rf"[a-z0-9][a-z0-9-]{{0,{MAX_LEN - 1}}}"
SANDBOX_ID_RE = re.compile(f"^{PATTERN}$")   # anchored, for JSON schema / route use (.pattern)


def instance_name(state_dir) -> str:
    """A short name for one runtime's state dir. Host-wide names (cgroups, overlay mount
    points) live under it, so two daemons on one host — or two test runs — never collide
    on a sandbox id."""
    import hashlib
    from pathlib import Path
    return "i" + hashlib.sha256(str(Path(state_dir).resolve()).encode()).hexdigest()[:10]


def is_sandbox_id(value: object) -> bool:
    return isinstance(value, str) and SANDBOX_ID_RE.fullmatch(value) is not None
