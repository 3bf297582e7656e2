"""Request and reply bodies of the sandbox API (cubegate/runtime_api.py), declared once.

The API validates with these and its OpenAPI document is generated from them;
the manager still checks meaning (env names and sizes, file paths, real
secrets, timeouts) for every caller.
"""
from __future__ import annotations

import base64
import binascii
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, PlainValidator, WithJsonSchema
from pydantic_core import PydanticCustomError

from httpkit import Body, Reply
from sandbox_runtime.manager import MAX_CLONES, SANDBOX_ID_RE, TEMPLATE_NAME_RE
from sandbox_runtime.snapshots import SNAPSHOT_ID_RE
from vault.api_models import Name


def _b64(value: object) -> bytes:
    if not isinstance(value, str):
        raise PydanticCustomError("base64", "must be a base64 string")
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise PydanticCustomError("base64", "must be base64") from None


def _absolute(value: object) -> str:
    if not isinstance(value, str) or not value.startswith("/") or "\0" in value:
        raise PydanticCustomError("path", "must be an absolute path inside the sandbox")
    return value


Base64 = Annotated[bytes, PlainValidator(_b64), WithJsonSchema({"type": "string", "contentEncoding": "base64"})]
SandboxId = Annotated[str, Field(pattern=SANDBOX_ID_RE.pattern)]
TemplateName = Annotated[str, Field(pattern=TEMPLATE_NAME_RE.pattern)]
SnapshotId = Annotated[str, Field(pattern=SNAPSHOT_ID_RE.pattern)]
StrMap = dict[str, str]
Positive = Field(None, gt=0)


# -- requests ------------------------------------------------------------------
class LimitsIn(Body):
    """Any omitted limit takes the daemon's default (settings.runtime)."""
    memory_mb: int | None = Positive
    cpus: float | None = Positive
    pids: int | None = Positive
    disk_mb: int | None = Positive


class Network(Body):
    """Only narrows what the admin policies allow: entries are hosts, *.wildcards or CIDRs, each
    optionally with :PORT (api.x.com:443, 10.0.0.0/8:5432, [2001:db8::/32]:443)."""
    allow: list[str] = Field([], max_length=256, description="empty: everything the policies allow")
    deny: list[str] = Field([], max_length=256)


class CreateSandbox(Body):
    id: SandboxId
    tenant: Name
    backend: str | None = Field(None, description="namespace or microvm; default: settings.runtime.default_backend")
    labels: StrMap = {}
    limits: LimitsIn = LimitsIn()
    env: StrMap = {}
    files: dict[str, Base64] = Field({}, description="path under /workspace -> base64 content")
    secret_env: StrMap = Field({}, description="ENV_NAME -> vault secret id (gets its placeholder)")
    template: TemplateName | None = Field(None, description="root filesystem template (`cubegate template ls`); "
                                          "default: settings.runtime.default_template, else the host's /usr")
    network: Network | None = None


class Owner(BaseModel):
    """The id and tenant of a create, validated first: the secret check of the whole body needs
    them. Its errors name these two fields only (never a key of the body)."""
    model_config = ConfigDict(extra="ignore", hide_input_in_errors=True)
    id: SandboxId
    tenant: Name


class Exec(Body):
    argv: list[str] = Field(min_length=1)
    timeout: float = Field(30, gt=0, le=3600, description="seconds")
    env: StrMap = {}
    stdin_b64: Base64 = b""
    cwd: str = "/workspace"


class Init(Body):
    env: StrMap = {}
    files: dict[str, Base64] = Field({}, description="path under /workspace -> base64 content")
    secret_env: StrMap = {}


class TakeSnapshot(Body):
    id: SnapshotId | None = Field(None, description="default: <sandbox id>-<8 hex>")


class Clone(Body):
    """Each clone gets its own identity, address, placeholders and policy (from its own id and
    labels): nothing of the snapshotted sandbox's but its files, its tenant and its network
    options, which the clone request can only narrow further."""
    ids: list[SandboxId] = Field(min_length=1, max_length=MAX_CLONES)
    labels: StrMap = {}
    env: StrMap = {}
    secret_env: StrMap = Field({}, description="ENV_NAME -> vault secret id (gets the clone's own placeholder)")
    limits: LimitsIn | None = Field(None, description="default: the snapshotted sandbox's limits")
    network: Network | None = Field(None, description="narrows the snapshotted sandbox's network options "
                                    "further (deny entries add up; allow entries must lie within its allow "
                                    "list, else 400); default: exactly its options")


class Rollback(Body):
    snapshot: SnapshotId


class FileQuery(Body):
    path: Annotated[str, PlainValidator(_absolute), WithJsonSchema({"type": "string", "pattern": "^/"})]


# -- replies -----------------------------------------------------------------------
class Limits(Reply):
    memory_mb: int
    cpus: float
    pids: int
    disk_mb: int


class Sandbox(Reply):
    id: str
    tenant: str
    backend: str
    labels: StrMap
    limits: Limits
    state: Literal["creating", "running", "paused", "failed"]
    paused_by: Literal["api", "idle"] | None = Field(None, description="idle: auto-paused, the next call resumes it")
    ip: str | None
    created: float
    start_ms: float | None
    error: str | None
    template: str | None = Field(None, description="root filesystem template (null: the host's /usr)")
    usage: dict[str, float] | None = Field(None, description="measured (GET of one sandbox)")
    usage_error: str | None = None


class SandboxList(Reply):
    sandboxes: list[Sandbox]


class Snapshot(Reply):
    """A copy of a sandbox's files (namespace: its template's writable layer); processes are not kept."""
    id: str
    sandbox: str = Field(description="the sandbox it was taken from (may be gone since)")
    tenant: str
    backend: str
    template: str | None
    template_key: str | None
    limits: Limits
    size_bytes: int
    created: float
    network: dict[str, list[str]] | None = Field(None, description="the sandbox's network options "
                                                 "({allow, deny}) when it was taken: every clone starts under them")


class SnapshotList(Reply):
    snapshots: list[Snapshot]


class ExecResult(Reply):
    exit_code: int
    timed_out: bool
    duration_s: float
    stdout: str | None = Field(description="null unless valid UTF-8 (see stdout_b64)")
    stderr: str | None = Field(description="null unless valid UTF-8 (see stderr_b64)")
    stdout_b64: str
    stderr_b64: str


class InitResult(Reply):
    id: str
    env: list[str] = Field(description="names of the variables later execs get")
    files: list[str]
