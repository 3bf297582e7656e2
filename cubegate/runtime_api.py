"""Sandbox REST API (tornado, loopback only, bearer tokens), served by the daemon.

    GET    /v1/sandboxes                      list
    POST   /v1/sandboxes                      create (201 when the agent answered and the network is attached)
    GET    /v1/sandboxes/{id}                 get (+ measured usage)
    DELETE /v1/sandboxes/{id}                 destroy (204)
    POST   /v1/sandboxes/{id}/exec            {argv, timeout, env, stdin_b64, cwd}
    POST   /v1/sandboxes/{id}/init            {env, files, secret_env}  idempotent
    PUT    /v1/sandboxes/{id}/files?path=P    raw body → file
    GET    /v1/sandboxes/{id}/files?path=P    file → raw body
    POST   /v1/sandboxes/{id}/pause | resume
    POST   /v1/sandboxes/{id}/snapshot        {id?}  → 201 snapshot (files only, not processes)
    POST   /v1/sandboxes/{id}/rollback        {snapshot}  stop, restore the files, start again
    GET    /v1/snapshots                      list
    GET    /v1/snapshots/{snapshot}           get
    DELETE /v1/snapshots/{snapshot}           remove (204)
    POST   /v1/snapshots/{snapshot}/clone     {ids, labels, env, secret_env, limits?, network?} → 201 sandboxes
    GET    /v1/openapi.json

Bodies: cubegate/runtime_models.py (validation and the OpenAPI document). Every
string of a JSON body is checked for real secret values of the tenant before a
model sees it (a validation error may name a dict key or an unknown field: it
must never be a key's value); such a request is 400 naming secret ids only and
audited without what it claimed; a sealed vault makes these requests 503.
Tokens: the daemon's runtime token file (created 0600 at first start) or a vault
admin token. Blocking backend calls run in a dedicated thread pool so a long
exec never stalls the gateway's event loop.
"""
from __future__ import annotations

import asyncio
import base64
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpkit
from httpkit import AuditHook, JsonHandler, PathParam, operation

from cubegate import runtime_models as m
from cubegate.admin_tokens import AdminTokens, ensure_token_file
from sandbox_runtime.backend import Limits, NotSupported, SandboxError
from sandbox_runtime.capacity import CapacityError
from sandbox_runtime.snapshots import SNAPSHOT_ID_RE
from sandbox_runtime.manager import (SANDBOX_ID_RE, Conflict, CreateRequest, InvalidRequest, NotFound, SandboxManager,
                                     SecretRefused, Unavailable)

MAX_BODY = 48 * 1024 * 1024


RUNTIME_TOKEN_PREFIX = "cgrt_"   # the runtime token file's token (read by `cubegate sandbox ...`)


class TokenCheck:
    """Admin actors only: the runtime token file, or a vault token of scope admin (a read
    token may not run code in a sandbox)."""

    def __init__(self, token_file: Path, vault_tokens=None):
        self._tokens = AdminTokens(token_file, vault_tokens)

    def actor(self, token: str) -> str | None:
        found = self._tokens.verify(token)
        return found.id if found is not None and found.scope == "admin" else None


class _Base(JsonHandler):
    realm = "cubegate-runtime"
    error_map = [(NotFound, 404, "not_found"), (Conflict, 409, "conflict"), (InvalidRequest, 400, "invalid"),
                 (CapacityError, 429, "capacity"), (NotSupported, 501, "not_supported"),
                 (Unavailable, 503, "unavailable"), (SandboxError, 500, "sandbox_error")]

    def initialize(self, manager: SandboxManager, tokens: TokenCheck, pool: ThreadPoolExecutor,
                   audit_hook: AuditHook | None) -> None:
        super().initialize(audit_hook)
        self.manager, self.tokens, self.pool = manager, tokens, pool
        self.claimed: dict = {}          # audit fields taken from the request body/query:
        self.secret_refused = False      # dropped when the request carried a secret value

    def authenticate(self, token: str) -> str | None:
        return self.tokens.actor(token)

    def prepare(self):
        super().prepare()   # auth first
        op = httpkit.operation_of(type(self), self.request.method.lower())
        if op is not None and op.body is not None:
            return self._screen()   # awaited by tornado before the method (and its model) runs
        return None

    async def _screen(self) -> None:
        """The body's strings (keys too) checked for real secret values before validation."""
        sandbox_id, tenant = self.secret_owner()
        texts = json_strings(self.request.body)
        await self.run(self.manager.refuse_real_secrets, sandbox_id, texts, tenant=tenant)

    def secret_owner(self) -> tuple[str, str | None]:
        """(sandbox id, tenant) whose secrets the body is checked for; None: the sandbox's tenant."""
        return self.path_kwargs["id"], None

    def _handle_request_exception(self, e: BaseException) -> None:
        self.secret_refused = isinstance(e, SecretRefused)
        super()._handle_request_exception(e)

    def audit_record(self) -> dict | None:
        if self.request.method == "GET":
            return None
        return {"action": self.action, "actor": self.actor, "status": self.get_status(), "outcome": self.outcome(),
                "reason": self.reason, "remote": self.request.remote_ip,
                **({} if self.secret_refused else self.claimed), **self.audit}

    async def run(self, fn, *args, **kw):
        return await asyncio.get_running_loop().run_in_executor(self.pool, lambda: fn(*args, **kw))


class _Pairs(list):
    """A JSON object as its (key, value) pairs: a repeated key is kept too."""


def json_strings(raw: bytes) -> list[str]:
    """Every key and string value of a JSON document ([] if it is not JSON: the model refuses it)."""
    try:
        stack = [json.loads(raw or b"{}", object_pairs_hook=_Pairs)]
    except (ValueError, RecursionError):
        return []
    out: list[str] = []
    while stack:   # iterative: nesting depth is the sender's choice
        node = stack.pop()
        if isinstance(node, str):
            out.append(node)
        elif isinstance(node, _Pairs):
            for key, value in node:
                out.append(key)
                stack.append(value)
        elif isinstance(node, list):
            stack += node
    return out


def _utf8_or_none(data: bytes) -> str | None:
    """Text only when the bytes are valid UTF-8 (else use the *_b64 field): bounded size."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


class SandboxesHandler(_Base):
    action = "sandbox"

    def secret_owner(self) -> tuple[str, str | None]:
        owner = httpkit.parse_body(m.Owner, self.request.body)   # its errors name id/tenant only
        return owner.id, owner.tenant

    @operation("List sandboxes", reply=m.SandboxList)
    async def get(self) -> None:
        self.reply(200, {"sandboxes": await self.run(self.manager.list)})

    @operation("Create a sandbox; 201 once its agent answered and its network is attached", body=m.CreateSandbox,
               status=201, reply=m.Sandbox, errors=(409, 429, 500, 503))
    async def post(self, body: m.CreateSandbox) -> None:
        self.claimed.update(sandbox=body.id, tenant=body.tenant)
        default: Limits = self.settings["default_limits"]
        limits = Limits(**{**default.__dict__, **body.limits.model_dump(exclude_none=True)})
        req = CreateRequest(sandbox_id=body.id, tenant=body.tenant,
                            backend=body.backend or self.settings["default_backend"], labels=body.labels,
                            limits=limits, env=body.env, files=body.files, secret_env=body.secret_env,
                            template=body.template or self.settings["default_template"],
                            network=body.network.model_dump() if body.network is not None else None,
                            actor=str(self.actor))
        self.reply(201, await self.run(self.manager.create, req))


class SandboxHandler(_Base):
    action = "sandbox"

    @operation("Get one sandbox with measured usage", reply=m.Sandbox, errors=(404,))
    async def get(self, id: str) -> None:
        self.reply(200, await self.run(self.manager.get, id))

    @operation("Destroy", status=204, errors=(404, 409))
    async def delete(self, id: str) -> None:
        self.audit["sandbox"] = id
        await self.run(self.manager.destroy, id)
        self.reply(204)


class ExecHandler(_Base):
    action = "sandbox.exec"

    @operation("Run a command through the sandbox's agent", body=m.Exec, reply=m.ExecResult,
               errors=(404, 409, 503))
    async def post(self, id: str, body: m.Exec) -> None:
        self.audit["sandbox"] = id
        self.claimed["program"] = body.argv[0]   # not the arguments: they may carry data
        res = await self.run(self.manager.exec, id, body.argv, timeout=body.timeout, env=body.env,
                             stdin=body.stdin_b64, cwd=body.cwd)
        self.audit["exit_code"] = res.exit_code
        self.reply(200, {"exit_code": res.exit_code, "timed_out": res.timed_out,
                         "duration_s": round(res.duration_s, 4),
                         "stdout": _utf8_or_none(res.stdout), "stderr": _utf8_or_none(res.stderr),
                         "stdout_b64": base64.b64encode(res.stdout).decode(),
                         "stderr_b64": base64.b64encode(res.stderr).decode()}, compact=True)


class InitHandler(_Base):
    action = "sandbox.init"

    @operation("Idempotent: re-apply env (with the tenant's current placeholders) and files", body=m.Init,
               reply=m.InitResult, errors=(404, 409, 503))
    async def post(self, id: str, body: m.Init) -> None:
        self.audit["sandbox"] = id
        self.reply(200, await self.run(self.manager.init, id, env=body.env, files=body.files,
                                       secret_env=body.secret_env))


class FilesHandler(_Base):
    action = "sandbox.files"

    @operation("Read a file", query=m.FileQuery, reply_media="application/octet-stream", errors=(404, 409))
    async def get(self, id: str, query: m.FileQuery) -> None:
        data = await self.run(self.manager.read_file, id, query.path)
        self.set_header("Content-Type", "application/octet-stream")
        self.finish(data)

    @operation("Write a file (raw body)", query=m.FileQuery, raw_body="application/octet-stream", status=204,
               errors=(404, 409, 503))
    async def put(self, id: str, query: m.FileQuery) -> None:
        self.audit["sandbox"] = id
        self.claimed["path"] = query.path
        await self.run(self.manager.write_file, id, query.path, self.request.body)
        self.reply(204)


class SnapshotHandler(_Base):
    action = "sandbox.snapshot"

    @operation("Snapshot the sandbox's files (its writable layer; processes are not kept). The sandbox is "
               "frozen while they are copied", body=m.TakeSnapshot, status=201, reply=m.Snapshot,
               errors=(404, 409, 429, 501, 503))
    async def post(self, id: str, body: m.TakeSnapshot) -> None:
        self.audit["sandbox"] = id
        snap = await self.run(self.manager.snapshot, id, body.id)
        self.audit["snapshot"] = snap["id"]
        self.reply(201, snap)


class RollbackHandler(_Base):
    action = "sandbox.rollback"

    @operation("Stop the sandbox, replace its files by a snapshot's, start it again (same id, network, "
               "identity and env; new processes)", body=m.Rollback, reply=m.Sandbox,
               errors=(404, 409, 429, 500, 501, 503))
    async def post(self, id: str, body: m.Rollback) -> None:
        self.audit.update(sandbox=id, snapshot=body.snapshot)
        self.reply(200, await self.run(self.manager.rollback, id, body.snapshot))


class SnapshotsHandler(_Base):
    action = "snapshot"

    @operation("List snapshots", reply=m.SnapshotList)
    async def get(self) -> None:
        self.reply(200, {"snapshots": await self.run(self.manager.list_snapshots)})


class OneSnapshotHandler(_Base):
    action = "snapshot"

    @operation("Get one snapshot", reply=m.Snapshot, errors=(404,))
    async def get(self, snapshot: str) -> None:
        self.reply(200, await self.run(self.manager.get_snapshot, snapshot))

    @operation("Remove a snapshot", status=204, errors=(404,))
    async def delete(self, snapshot: str) -> None:
        self.audit["snapshot"] = snapshot
        await self.run(self.manager.delete_snapshot, snapshot)
        self.reply(204)


class CloneHandler(_Base):
    action = "snapshot.clone"

    def secret_owner(self) -> tuple[str, str | None]:
        snap = self.manager.get_snapshot(self.path_kwargs["snapshot"])   # NotFound: 404 before the body is read
        return snap["sandbox"], snap["tenant"]

    @operation("Start sandboxes from a snapshot (all or none); each its own identity, address, placeholders "
               "and policy", body=m.Clone, status=201, reply=m.SandboxList, errors=(404, 409, 429, 500, 501, 503))
    async def post(self, snapshot: str, body: m.Clone) -> None:
        self.audit["snapshot"] = snapshot
        self.claimed["clones"] = ",".join(body.ids)
        limits = None
        if body.limits is not None:
            base = self.manager.get_snapshot(snapshot)["limits"]
            limits = Limits(**{**base, **body.limits.model_dump(exclude_none=True)})
        network = body.network.model_dump() if body.network is not None else None
        made = await self.run(self.manager.clone, snapshot, body.ids, labels=body.labels, env=body.env,
                              secret_env=body.secret_env, limits=limits, network=network)
        self.reply(201, {"sandboxes": made})


class NetworkHandler(_Base):
    action = "sandbox.network"

    @operation("Replace the sandbox's network options (they only narrow the policy; open connections they "
               "refuse are closed)", body=m.Network, reply=m.Sandbox, errors=(404, 409))
    async def put(self, id: str, body: m.Network) -> None:
        self.audit["sandbox"] = id
        self.reply(200, await self.run(self.manager.set_network, id, body.model_dump(), str(self.actor)))


def _state_handler(op: str, summary: str, errors: tuple[int, ...]) -> type[_Base]:
    class StateHandler(_Base):
        action = f"sandbox.{op}"

        @operation(summary, reply=m.Sandbox, errors=errors)
        async def post(self, id: str) -> None:
            self.audit["sandbox"] = id
            self.reply(200, await self.run(getattr(self.manager, op), id))
    StateHandler.__name__ = f"{op.capitalize()}Handler"
    return StateHandler


ROUTES = [
    ("/v1/sandboxes", SandboxesHandler),
    ("/v1/sandboxes/{id}", SandboxHandler),
    ("/v1/sandboxes/{id}/exec", ExecHandler),
    ("/v1/sandboxes/{id}/init", InitHandler),
    ("/v1/sandboxes/{id}/files", FilesHandler),
    ("/v1/sandboxes/{id}/network", NetworkHandler),
    ("/v1/sandboxes/{id}/pause", _state_handler("pause", "Freeze all processes", (404, 409, 501))),
    ("/v1/sandboxes/{id}/resume", _state_handler("resume", "Thaw", (404, 409))),
    ("/v1/sandboxes/{id}/snapshot", SnapshotHandler),
    ("/v1/sandboxes/{id}/rollback", RollbackHandler),
    ("/v1/snapshots", SnapshotsHandler),
    ("/v1/snapshots/{snapshot}", OneSnapshotHandler),
    ("/v1/snapshots/{snapshot}/clone", CloneHandler),
    ("/v1/openapi.json", httpkit.openapi_handler(_Base, public=True)),   # public: it holds no data
]
PARAMS = {"id": PathParam(SANDBOX_ID_RE.pattern.strip("^$"), {"type": "string", "pattern": SANDBOX_ID_RE.pattern}),
          "snapshot": PathParam(SNAPSHOT_ID_RE.pattern.strip("^$"),
                                {"type": "string", "pattern": SNAPSHOT_ID_RE.pattern})}


def make_app(manager: SandboxManager | None, tokens: TokenCheck | None, pool: ThreadPoolExecutor | None, *,
             audit_hook: AuditHook | None = None, default_backend: str = "namespace",
             default_limits: Limits = Limits(), default_template: str | None = None):
    kw = {"manager": manager, "tokens": tokens, "pool": pool, "audit_hook": audit_hook}
    return httpkit.make_app(ROUTES, base=_Base, kwargs=kw, params=PARAMS, title="cubegate sandbox API",
                            public_not_found=True, log_name="cubegate.runtime_api",
                            default_backend=default_backend, default_limits=default_limits,
                            default_template=default_template)


class RuntimeServer:
    def __init__(self, server: httpkit.Server, pool: ThreadPoolExecutor):
        self.server, self.pool = server, pool

    @property
    def port(self) -> int:
        return self.server.port

    def stop(self) -> None:
        self.server.stop()
        self.pool.shutdown(wait=False, cancel_futures=True)


def serve(manager: SandboxManager, *, host: str, port: int, token_file: Path, vault_tokens=None,
          audit_hook=None, default_backend: str = "namespace", default_limits: Limits = Limits(),
          workers: int = 64, default_template: str | None = None) -> RuntimeServer:
    ensure_token_file(token_file, RUNTIME_TOKEN_PREFIX)
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="runtime")
    tokens = TokenCheck(token_file, vault_tokens)
    app = make_app(manager, tokens, pool, audit_hook=audit_hook,
                   default_backend=default_backend, default_limits=default_limits,
                   default_template=default_template)
    # loopback only: sandboxes must never reach it
    return RuntimeServer(httpkit.serve(app, max_body=MAX_BODY, host=host, port=port, what="the sandbox API",
                                       admit=httpkit.bearer_admit(tokens.actor)), pool)
