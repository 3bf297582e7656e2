"""Bodies of the E2B control plane (the fields of the SDK's NewSandboxV2 & co.). Unknown
fields are refused: a new SDK option is an error here, never silently ignored."""
from __future__ import annotations

from typing import Any

from pydantic import ConfigDict, Field

from httpkit import Body, Reply


class NewSandbox(Body):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, hide_input_in_errors=True, populate_by_name=True)
    templateID: str = Field(min_length=1, max_length=256)
    timeout: int | None = None
    autoPause: bool | None = None
    autoPauseMemory: Any = None
    autoResume: Any = None
    secure: bool | None = None
    allow_internet_access: bool | None = None
    network: Any = None
    metadata: dict[str, str] | None = None
    envVars: dict[str, str] | None = None
    mcp: Any = None
    iam: Any = None
    volumeMounts: Any = None


class Timeout(Body):
    timeout: int


class ConnectBody(Body):
    timeout: int | None = None
    memory: Any = None


class PauseBody(Body):
    memory: Any = None
    requireHealthyGuest: bool | None = None


class Created(Reply):
    model_config = ConfigDict(extra="allow")
    templateID: str
    sandboxID: str
    clientID: str
    envdVersion: str
    envdAccessToken: str | None = None


class Detail(Reply):
    model_config = ConfigDict(extra="allow")
    templateID: str
    sandboxID: str
    clientID: str
    startedAt: str
    endAt: str
    envdVersion: str
    cpuCount: int
    memoryMB: int
    diskSizeMB: int
    state: str


class DetailList(Reply):
    items: list[Detail]


class Metric(Reply):
    timestamp: str
    timestampUnix: int
    cpuCount: int
    cpuUsedPct: float
    memUsed: int
    memTotal: int
    memCache: int
    diskUsed: int
    diskTotal: int


class Metrics(Reply):
    items: list[Metric]


class ListQuery(Body):
    model_config = ConfigDict(extra="ignore")
    state: str | None = None
    metadata: str | None = None
    limit: int | None = Field(default=None, ge=1, le=1000)
    nextToken: str | None = Field(default=None, max_length=200)
