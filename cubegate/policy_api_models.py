"""Bodies of the policy API (cubegate/policy_api.py). A policy body itself is the policy
document (JSON or YAML, the same schema as a file): the policy loader validates it."""
from __future__ import annotations

from typing import Literal

from pydantic import Field

from httpkit import Body, Reply


class Rollback(Body):
    version: int = Field(ge=1)


class DecideQuery(Body):
    sandbox: str = Field(min_length=1, max_length=64)
    host: str = Field(min_length=1, max_length=255)
    port: int = Field(443, ge=1, le=65535)
    labels: dict[str, str] = {}
    scheme: Literal["http", "https"] | None = None
    method: str | None = Field(None, max_length=16)
    path: str | None = Field(None, max_length=2048)


class Approve(Body):
    scope: Literal["sandbox", "labels", "tenant"] = "sandbox"
    expires_in_seconds: float | None = Field(None, gt=0, le=366 * 86400)
    note: str | None = Field(None, max_length=500)


class DenyRequest(Body):
    note: str | None = Field(None, max_length=500)


class StateQuery(Body):
    state: Literal["pending", "approved", "denied"] | None = None
    sandbox: str | None = None


class Change(Reply):
    kind: str
    name: str
    version: int
    action: str
    actor: str
    ts: float
    note: str | None
    deleted: bool


class History(Reply):
    name: str
    versions: list[dict]


class PolicyList(Reply):
    policies: list[dict]
    digest: str


class Decision(Reply):
    action: str
    reason: str
    rule: str | None
    policy: str | None
    mode: str
    would_deny: bool
    needs_inspection: bool
    tenant: str | None


class AccessRequest(Reply):
    id: str
    sandbox: str
    labels: dict[str, str]
    host: str
    port: int
    reason: str
    state: str
    created: float
    decided: float | None
    decided_by: str | None
    scope: str | None
    grant: str | None
    expires: float | None
    note: str | None


class AccessList(Reply):
    requests: list[AccessRequest]
