"""Sandbox lifecycle: admission, network attachment, backend, state, metrics.

    create: validate → admit (budget + kernel) → claim id → identity → cubevs attach
            → backend.create (returns when the agent answered) → env/files → running
    destroy: backend.destroy → cubevs detach → identity removed → record deleted

Anything that fails half-way is undone in reverse order, and the caller gets a
SandboxError with the reason. What the composition root knows (identities,
policies, the vault) comes in through `RuntimeHooks`, so this package imports
only cubevs.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import re
import threading
import time
from collections import Counter as _Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Protocol

from . import ids, phases
from .ids import SANDBOX_ID_RE  # noqa: F401 - re-exported (cubegate.runtime_api/runtime_models use it)
from .backend import Backend, ExecResult, Handle, Limits, NotSupported, SandboxError, SandboxSpec
from .capacity import Budget, CapacityError, admit, meminfo_mb, reserved
from .idle import Activity
from .metrics import RuntimeMetrics
from .snapshots import SNAPSHOT_ID_RE, Snapshot, SnapshotNotFound, SnapshotStore, new_id, tree_size
from .state import SandboxRecord, StateStore

log = logging.getLogger("cubegate.runtime")

ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
TEMPLATE_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_-]{0,31}$")
MAX_ENV_BYTES = 256 * 1024
MAX_FILES_BYTES = 32 * 1024 * 1024
MAX_CLONES = 32              # per clone call
PAUSED_CAPACITY = ("full", "memory")    # what a paused sandbox keeps reserved (settings.runtime.paused_capacity)
NO_TRAFFIC_REASONS = frozenset({"arp"})  # the kernel's neighbour upkeep is no sign of use


class NotFound(SandboxError):
    pass


class Conflict(SandboxError):
    pass


class InvalidRequest(SandboxError):
    pass


class SecretRefused(InvalidRequest):
    """A request carried the real value of a secret. Its message names secret ids only, and
    nothing else of the request may be echoed or audited."""


class Unavailable(SandboxError):
    """What the request needs is not available now (the vault is sealed): retry later."""


class RuntimeHooks(Protocol):
    def register(self, sandbox_id: str, tenant: str, labels: dict[str, str]) -> None:
        """Make the gateway know the sandbox (identity + labels); raise SandboxError if the
        policy that applies to it belongs to another tenant."""

    def forget(self, sandbox_id: str) -> None: ...

    def set_network(self, sandbox_id: str, network: dict, actor: str) -> None:
        """Per-sandbox network options ({allow, deny}): they only narrow what the policy allows."""

    def network_of(self, sandbox_id: str) -> dict | None:
        """The sandbox's network options now (None: it has none)."""

    def narrow_network(self, inherited: dict | None, requested: dict | None) -> dict | None:
        """Options of a sandbox started under `inherited` that asks for `requested`: never wider
        than `inherited`; InvalidRequest when the request would widen them."""

    def l4_allow(self, sandbox_id: str, labels: dict[str, str]) -> list: ...

    def placeholders(self, tenant: str, sandbox_id: str) -> dict[str, str]:
        """{secret_id: placeholder} for the tenant's placeholder bindings ({} without a vault)."""

    def real_secrets_in(self, tenant: str, sandbox_id: str, data: str) -> list[str]:
        """Secret ids whose real value occurs in `data` (placeholders are fine).
        Both raise Unavailable when they cannot tell (sealed vault): the caller refuses."""

    def audit(self, record: dict) -> None:
        """An admin audit record of something the runtime did by itself (auto-pause)."""


class NoHooks:
    def register(self, sandbox_id, tenant, labels): pass
    def forget(self, sandbox_id): pass
    def set_network(self, sandbox_id, network, actor): pass
    def network_of(self, sandbox_id): return None
    def narrow_network(self, inherited, requested): return requested   # network_of gives None: nothing inherited
    def l4_allow(self, sandbox_id, labels): return []
    def placeholders(self, tenant, sandbox_id): return {}
    def real_secrets_in(self, tenant, sandbox_id, data): return []
    def audit(self, record): pass


@dataclasses.dataclass(frozen=True)
class CreateRequest:
    sandbox_id: str
    tenant: str
    backend: str = "namespace"
    labels: dict = dataclasses.field(default_factory=dict)
    limits: Limits = dataclasses.field(default_factory=Limits)
    env: dict = dataclasses.field(default_factory=dict)
    files: dict = dataclasses.field(default_factory=dict)        # path under /workspace -> bytes
    secret_env: dict = dataclasses.field(default_factory=dict)   # ENV_NAME -> secret_id (gets its placeholder)
    template: str | None = None     # root filesystem template (sandbox_runtime/templates); None: host /usr
    network: dict | None = None      # {allow: [...], deny: [...]} (set before the sandbox can send a packet)
    actor: str = "runtime"


def placeholder_env(placeholders: dict[str, str], secret_env: dict[str, str]) -> dict[str, str]:
    """CUBEGATE_PLACEHOLDER_<ID> for every placeholder, plus the names the caller asked for."""
    env = {"CUBEGATE_PLACEHOLDER_" + re.sub(r"[^A-Z0-9]", "_", sid.upper()): ph for sid, ph in placeholders.items()}
    for name, sid in secret_env.items():
        if sid not in placeholders:
            raise InvalidRequest(f"secret_env {name}: the tenant has no placeholder binding for secret {sid!r}")
        env[name] = placeholders[sid]
    return env


def validate_owner(req: CreateRequest) -> None:
    """Id and tenant first: the secret check needs them, and these messages echo nothing."""
    if not isinstance(req.sandbox_id, str) or not ids.is_sandbox_id(req.sandbox_id):
        raise InvalidRequest(f"id must match {ids.PATTERN}")
    if not isinstance(req.tenant, str) or not re.fullmatch(r"[a-z0-9][a-z0-9_.-]{0,63}", req.tenant):
        raise InvalidRequest("tenant must match [a-z0-9][a-z0-9_.-]{0,63}")


def request_strings(req: CreateRequest) -> list[str]:
    """Every string a create request carries into the sandbox, its records or an error message."""
    out = [req.sandbox_id, req.tenant, str(req.backend), str(req.template or "")]
    for mapping in (req.labels, req.env, req.secret_env):
        for k, v in mapping.items():
            out += [str(k), str(v)]
    out += [str(p) for p in req.files]
    return out


def validate_request(req: CreateRequest) -> None:
    """The rest, after the secret check (these messages may quote names)."""
    validate_env(req.env)
    validate_files(req.files)
    validate_secret_env(req.secret_env)
    if req.template is not None and (not isinstance(req.template, str)
                                     or not TEMPLATE_NAME_RE.fullmatch(req.template)):
        raise InvalidRequest(f"template must match {TEMPLATE_NAME_RE.pattern}")


def validate_secret_env(secret_env: dict) -> None:
    for name in secret_env:
        if not ENV_NAME_RE.fullmatch(name):
            raise InvalidRequest(f"secret_env: bad variable name {name!r}")


def validate_env(env: dict) -> None:
    size = 0
    for k, v in env.items():
        if not isinstance(k, str) or not ENV_NAME_RE.fullmatch(k):
            raise InvalidRequest(f"env: bad variable name {k!r}")
        if not isinstance(v, str) or "\0" in v:
            raise InvalidRequest(f"env {k}: value must be a string without NUL")
        size += len(k) + len(v)
    if size > MAX_ENV_BYTES:
        raise InvalidRequest(f"env: {size} bytes, limit {MAX_ENV_BYTES}")


def validate_files(files: dict) -> None:
    size = 0
    for path, data in files.items():
        if not isinstance(path, str) or not path or path.startswith("/") or "\0" in path \
                or any(p in ("", ".", "..") for p in path.split("/")):
            raise InvalidRequest(f"files: path {path!r} must be relative to /workspace, without . or ..")
        size += len(data)
    if size > MAX_FILES_BYTES:
        raise InvalidRequest(f"files: {size} bytes, limit {MAX_FILES_BYTES}")


class SandboxManager:
    def __init__(self, *, switch, backends: dict[str, Backend], state: StateStore, budget: Budget,
                 metrics: RuntimeMetrics | None = None, hooks: RuntimeHooks | None = None,
                 meminfo: Callable[[], dict] = meminfo_mb, pool=None, snapshots: SnapshotStore | None = None,
                 max_snapshots: int = 100, auto_pause_seconds: float | None = None,
                 paused_capacity: str = "full", activity: Activity | None = None,
                 tenant_share: float | None = None):
        """tenant_share: the fraction of the budget one tenant's sandboxes may hold (None: all)."""
        if paused_capacity not in PAUSED_CAPACITY:
            raise ValueError(f"paused_capacity must be one of {PAUSED_CAPACITY}")
        self.switch = switch
        self.pool = pool            # netpool.SlotPool of prepared network slots (None: attach at create)
        self.snapshots = snapshots  # None: snapshots, clones and rollback are refused (501)
        self.max_snapshots = max_snapshots
        self.auto_pause_seconds = auto_pause_seconds   # None: never paused for idleness
        self.paused_capacity = paused_capacity
        self.activity = activity or Activity()
        self._wake_lock = threading.Lock()   # auto-pause vs. a call that uses the sandbox: one at a time
        self._removing: set[str] = set()     # being destroyed (under _wake_lock): never paused, woken or used
        self._copying: set[str] = set()      # its layer is being snapshotted (under _wake_lock): the copy
                                             # thaws it at the end, so no pause, destroy or rollback meanwhile
        self.backends = backends
        self.state = state
        self.budget = budget
        if tenant_share is not None and not 0 < tenant_share <= 1:
            raise ValueError("tenant_share must be in (0, 1]")
        self.tenant_share = tenant_share
        self.metrics = metrics or RuntimeMetrics()
        self.hooks = hooks or NoHooks()
        self._meminfo = meminfo
        self._admit_lock = threading.Lock()
        self._usage_cache: dict[str, tuple[float, dict]] = {}
        self.metrics.bind(self)
        self._prepare_backends()

    def _prepare_backends(self) -> None:
        """Work a backend can do once for all its sandboxes (the namespace backend's shared
        /etc) is done now, not in the first start."""
        gateway_ip = getattr(self.switch, "gateway_ip", None)
        for name, b in self.backends.items() if gateway_ip else ():
            prepare = getattr(b, "prepare", None)
            if prepare is None or not b.available()[0]:
                continue
            try:
                prepare(gateway_ip)
            except Exception as e:  # noqa: BLE001 - the first start does it (and reports) instead
                log.warning("runtime: preparing backend %s failed: %s", name, e)

    # ------------------------------------------------------------------ create
    def create(self, req: CreateRequest, *, seed: dict | None = None) -> dict:
        """`seed`: SandboxSpec seed_* fields (a clone starts from a snapshot's layer)."""
        with phases.trace(req.sandbox_id):
            return self._create(req, seed)

    def _create(self, req: CreateRequest, seed: dict | None) -> dict:
        validate_owner(req)
        with phases.phase("validate"):
            placeholders = self.hooks.placeholders(req.tenant, req.sandbox_id)
            self._refuse_real_secrets(req.tenant, req.sandbox_id, request_strings(req),
                                      b"\n".join(req.files.values()), placeholders)
            validate_request(req)
            backend = self._backend(req.backend)
        rec = SandboxRecord(req.sandbox_id, req.tenant, req.backend, dict(req.labels), req.limits,
                            template=req.template)
        with phases.phase("admit"), self._admit_lock:   # admission and claiming the id are one step
            try:
                with phases.phase("admit.locked"):
                    charges = self._charges()
                    admit(self.budget, reserved([c for _, c in charges]), self._footprint(req.backend, req.limits),
                          self._meminfo().get("MemAvailable"), **self._share_of(req.tenant, charges))
            except CapacityError:
                self.metrics.creations.labels(req.backend, "capacity").inc()
                raise
            with phases.phase("admit.locked"):
                claimed = self.state.insert_new(rec)
            if not claimed:
                raise Conflict(f"sandbox {req.sandbox_id!r} already exists")
        t0 = time.monotonic()
        handle = None
        attached = registered = pool_started = False
        try:
            labels = {**req.labels, "tenant": req.tenant}
            with phases.phase("identity"):
                self.hooks.register(req.sandbox_id, req.tenant, labels)
                registered = True
                if req.network is not None:
                    self.hooks.set_network(req.sandbox_id, req.network, req.actor)
                env = {**req.env, **placeholder_env(placeholders, req.secret_env)}
                l4 = self.hooks.l4_allow(req.sandbox_id, labels)
            attach = self.pool.take if self.pool is not None else self.switch.attach_sandbox
            with phases.phase("network"):
                net = attach(req.sandbox_id, l4_allow=l4)
            pool_started = self.pool is not None
            attached = True
            spec = SandboxSpec(req.sandbox_id, req.tenant, req.backend, req.limits, env, dict(req.files),
                               template=req.template, **(seed or {}))
            handle = backend.create(spec, net.netns, ip=net.ip, gateway_ip=self.switch.gateway_ip)
            rec.handle, rec.ip, rec.state = handle, net.ip, "running"
            rec.start_ms = round((time.monotonic() - t0) * 1000, 1)
            with phases.phase("record"):
                finished = self.state.finish_create(rec)
            if not finished:
                raise SandboxError(f"sandbox {req.sandbox_id!r} was removed while it was being created")
        except BaseException as e:
            self._undo(rec, backend, handle, attached, registered)
            self.metrics.creations.labels(req.backend, "error").inc()
            if isinstance(e, SandboxError):
                raise
            log.warning("sandbox %s: create failed: %s", req.sandbox_id, e)
            raise SandboxError(f"create failed: {e}") from e
        finally:
            if pool_started:
                self.pool.start_done()      # the pool's refill waits while starts are under way
        self.metrics.creations.labels(req.backend, "ok").inc()
        self.metrics.start_seconds.labels(req.backend).observe(time.monotonic() - t0)
        self.activity.touch(req.sandbox_id)
        return rec.public()

    def _undo(self, rec, backend, handle, attached, registered) -> None:
        for what, step in (("backend", lambda: handle and backend.destroy(handle)),
                           ("network", lambda: attached and self.switch.detach_sandbox(rec.id)),
                           ("identity", lambda: registered and self.hooks.forget(rec.id)),
                           ("record", lambda: self.state.delete(rec.id))):
            try:
                step()
            except Exception as e:  # noqa: BLE001 - keep undoing; report what is left
                log.error("sandbox %s: undo %s failed: %s", rec.id, what, e)

    def refuse_real_secrets(self, sandbox_id: str, texts: list[str], *, tenant: str | None = None) -> None:
        """The same check for a caller that sees request data before the manager does (an API
        whose validation errors could quote it): the tenant's secrets, or the sandbox's tenant's
        when none is given (NotFound without that sandbox)."""
        if tenant is None:
            tenant = self.get_record(sandbox_id).tenant
        self._refuse_real_secrets(tenant, sandbox_id, texts)

    def _refuse_real_secrets(self, tenant: str, sandbox_id: str, texts: list[str], data: bytes = b"",
                             placeholders: dict[str, str] | None = None) -> None:
        """Every way in (create/init fields, files, exec argv/cwd/env/stdin, uploads) is checked:
        a real key never enters a sandbox. Placeholders are fine. A sealed vault cannot tell:
        Unavailable (fail closed) whenever there is anything to check."""
        texts = [t for t in texts if t]
        if not texts and not data:
            return
        # Fields joined by NUL (never inside a secret): a value split across two fields is no match.
        blob = "\0".join(texts) + "\0" + data.decode("latin-1")
        if placeholders is None:
            placeholders = self.hooks.placeholders(tenant, sandbox_id)
        for ph in placeholders.values():
            blob = blob.replace(ph, "")
        leaked = self.hooks.real_secrets_in(tenant, sandbox_id, blob)
        if leaked:
            raise SecretRefused(f"request contains the real value of secret(s) {', '.join(sorted(leaked))}; "
                                "sandboxes get placeholders only (use secret_env)")

    # ------------------------------------------------------------------ init (idempotent)
    def init(self, sandbox_id: str, *, env: dict | None = None, files: dict | None = None,
             secret_env: dict | None = None) -> dict:
        """Re-apply runtime state after start: the tenant's current placeholders (+ the given env)
        become the base env of later execs, the given files are (re)written. Same call, same result."""
        with self._use(sandbox_id) as rec:
            return self._init(rec, env or {}, files or {}, secret_env or {})

    def _init(self, rec: SandboxRecord, env: dict, files: dict, secret_env: dict) -> dict:
        sandbox_id = rec.id
        placeholders = self.hooks.placeholders(rec.tenant, sandbox_id)
        texts = [str(x) for m in (env, secret_env) for kv in m.items() for x in kv] + [str(p) for p in files]
        self._refuse_real_secrets(rec.tenant, sandbox_id, texts, b"\n".join(files.values()), placeholders)
        validate_env(env)
        validate_files(files)
        validate_secret_env(secret_env)
        full = {**env, **placeholder_env(placeholders, secret_env)}
        b = self._backend(rec.backend)
        b.set_env(rec.handle, full)
        self.state.put_handle(rec.id, rec.handle)   # the backend may keep the env there (rollback restores it)
        for path, data in files.items():
            b.write_file(rec.handle, "/workspace/" + path, data)
        return {"id": sandbox_id, "env": sorted(full), "files": sorted(files)}

    # ------------------------------------------------------------------ use
    def exec(self, sandbox_id: str, argv: list[str], *, timeout: float = 30.0, env: dict | None = None,
             stdin: bytes = b"", cwd: str = "/workspace", on_output=None) -> ExecResult:
        """on_output(stream, chunk): output as it arrives (the exec console streams it)."""
        if not argv or not all(isinstance(a, str) and "\0" not in a for a in argv):
            raise InvalidRequest("argv must be a non-empty list of strings")
        if not 0 < timeout <= 3600:
            raise InvalidRequest("timeout must be in (0, 3600] seconds")
        if not isinstance(cwd, str) or "\0" in cwd:
            raise InvalidRequest("cwd must be a string without NUL")
        with self._use(sandbox_id) as rec:
            return self._exec(rec, argv, timeout, env or {}, stdin, cwd, on_output)

    def _exec(self, rec: SandboxRecord, argv, timeout, env, stdin, cwd, on_output=None) -> ExecResult:
        # argv and cwd too: `sh -c 'echo <key> > f'` would put the key into the sandbox.
        self._refuse_real_secrets(rec.tenant, rec.id, [*argv, cwd, *(str(x) for kv in env.items() for x in kv)],
                                  stdin)
        validate_env(env)
        try:
            res = self._backend(rec.backend).exec(rec.handle, argv, timeout=timeout, env=env, stdin=stdin, cwd=cwd,
                                                  **({"on_output": on_output} if on_output is not None else {}))
        except SandboxError:
            self.metrics.execs.labels(rec.backend, "error").inc()
            raise
        self.metrics.execs.labels(rec.backend, "timeout" if res.timed_out else "ok").inc()
        return res

    def write_file(self, sandbox_id: str, path: str, data: bytes, mode: int = 0o644) -> None:
        with self._use(sandbox_id) as rec:
            self._refuse_real_secrets(rec.tenant, rec.id, [path], data)
            self._backend(rec.backend).write_file(rec.handle, path, data, mode)

    def read_file(self, sandbox_id: str, path: str) -> bytes:
        with self._use(sandbox_id) as rec:
            return self._backend(rec.backend).read_file(rec.handle, path)

    def agent_call(self, sandbox_id: str, fn: Callable, *, texts: list[str] = (), data: bytes = b""):
        """fn(AgentClient) on a running sandbox (agent 2 requests: streamed execs, signals,
        filesystem). `texts`/`data`: what the request carries into the sandbox, checked for
        real secret values first like every other way in."""
        with self._use(sandbox_id) as rec:    # resumes an auto-paused sandbox; never paused mid-call
            self._refuse_real_secrets(rec.tenant, rec.id, [str(t) for t in texts], data)
            b = self._backend(rec.backend)
            if not hasattr(b, "agent_call"):
                raise NotSupported(f"backend {rec.backend} offers no direct agent calls")
            return b.agent_call(rec.handle, fn)

    # ------------------------------------------------------------------ pause (by API or when idle)
    def pause(self, sandbox_id: str) -> dict:
        with self._wake_lock:
            rec = self.get_record(sandbox_id)
            if sandbox_id in self._removing:
                raise Conflict(f"sandbox {sandbox_id!r} is being removed")
            self._refuse_while_copying(sandbox_id)
            if rec.state == "paused" and rec.paused_by == "idle":
                rec.paused_by = "api"       # stays paused until resumed by API, not by the next call
                self.state.put(rec)
                return rec.public()
            rec = self._running(sandbox_id)
            self._pause(rec, "api")
            return rec.public()

    def resume(self, sandbox_id: str) -> dict:
        with self._wake_lock:
            rec = self.get_record(sandbox_id)
            if sandbox_id in self._removing:
                raise Conflict(f"sandbox {sandbox_id!r} is being removed")
            if rec.state != "paused":
                raise Conflict(f"sandbox {sandbox_id!r} is {rec.state}, not paused")
            self._resume(rec)
        self.activity.touch(sandbox_id)
        return rec.public()

    def _refuse_while_copying(self, sandbox_id: str) -> None:
        if sandbox_id in self._copying:
            raise Conflict(f"sandbox {sandbox_id!r} is being snapshotted; try again when the snapshot returns")

    def _pause(self, rec: SandboxRecord, by: str) -> None:
        self._backend(rec.backend).pause(rec.handle)
        rec.state, rec.paused_by = "paused", by
        self.state.put(rec)

    def _resume(self, rec: SandboxRecord) -> None:
        if self.paused_capacity == "memory":    # its CPUs were free for others while it slept
            with self._admit_lock:
                others = [(r, c) for r, c in self._charges() if r.id != rec.id]
                admit(self.budget, reserved([c for _, c in others]), self._footprint(rec.backend, rec.limits), None,
                      **self._share_of(rec.tenant, others))
        self._backend(rec.backend).resume(rec.handle)
        rec.state, rec.paused_by = "running", None
        self.state.put(rec)

    @contextlib.contextmanager
    def _use(self, sandbox_id: str):
        """A call that uses a running sandbox: wakes it if it was paused for idleness (audited),
        and it is never paused while the call runs."""
        with self._wake_lock:
            rec = self.get_record(sandbox_id)
            if sandbox_id in self._removing:
                raise Conflict(f"sandbox {sandbox_id!r} is being removed")
            if rec.state == "paused" and rec.paused_by == "idle" and rec.handle is not None:
                idle = self.activity.idle_for(sandbox_id)
                self._resume(rec)
                self.metrics.auto_resumes.labels(rec.backend).inc()
                self._audit_auto("sandbox.auto_resume", rec, f"resumed by a call after {idle:.0f}s idle")
            if rec.state != "running" or rec.handle is None:
                raise Conflict(f"sandbox {sandbox_id!r} is {rec.state}")
            self.activity.begin(sandbox_id)
        try:
            yield rec
        finally:
            self.activity.end(sandbox_id)

    def hold_awake(self, sandbox_id: str) -> Callable[[], None]:
        """A use that outlasts its call (a client reading a command's output as it comes): counted
        as a call in flight, so never auto-paused, until the returned release() is called."""
        self.activity.begin(sandbox_id)
        released = [False]

        def release() -> None:
            if not released[0]:
                released[0] = True
                self.activity.end(sandbox_id)
        return release

    def paused_by(self, sandbox_id: str) -> str | None:
        """"idle" or "api" for a paused sandbox, else None (gone too)."""
        try:
            rec = self.get_record(sandbox_id)
        except NotFound:
            return None
        return rec.paused_by if rec.state == "paused" else None

    def auto_pause_tick(self) -> list[str]:
        """Freeze every running sandbox idle for auto_pause_seconds (no call, no traffic).
        Returns the ids paused now."""
        if self.auto_pause_seconds is None:
            return []
        self.activity.traffic(self._traffic_totals())
        running = [r.id for r in self.state.all() if r.state == "running" and r.handle is not None]
        paused = []
        for sid in self.activity.due(running, self.auto_pause_seconds):
            with self._wake_lock:
                rec = self.state.get(sid)
                idle = self.activity.idle_for(sid)
                if (rec is None or rec.state != "running" or rec.handle is None or sid in self._removing
                        or idle < self.auto_pause_seconds):
                    continue            # used, paused, being removed or gone since the look above
                try:
                    self._pause(rec, "idle")
                except Exception as e:  # noqa: BLE001 - NotSupported, a dead VM, a vanished cgroup: it
                    # stays running (counted in full), and one sandbox never stops the others' pauses
                    log.warning("sandbox %s: auto-pause failed: %s: %s", sid, type(e).__name__, e)
                    self.activity.touch(sid)    # not retried at every tick
                    continue
            self.metrics.auto_pauses.labels(rec.backend).inc()
            self._audit_auto("sandbox.auto_pause", rec, f"idle {idle:.0f}s (no call, no traffic)")
            paused.append(sid)
        return paused

    def _traffic_totals(self) -> dict[str, int]:
        """Bytes each sandbox sent (every switch verdict but ARP), from the switch's counters."""
        totals: dict[str, int] = {}
        try:
            counters = self.switch.counters()
        except Exception as e:  # noqa: BLE001 - no traffic reading: nobody is paused for it
            log.warning("auto-pause: cannot read the switch counters: %s", e)
            raise SandboxError(f"switch counters unreadable: {e}") from None
        for (sid, reason, _verdict), (_packets, nbytes) in counters.items():
            if sid is not None and reason not in NO_TRAFFIC_REASONS:
                totals[sid] = totals.get(sid, 0) + int(nbytes)
        return totals

    def _audit_auto(self, action: str, rec: SandboxRecord, reason: str) -> None:
        try:
            self.hooks.audit({"action": action, "actor": "runtime", "sandbox": rec.id, "tenant": rec.tenant,
                              "outcome": "ok", "reason": reason})
        except Exception as e:  # noqa: BLE001 - the pause itself happened; say so in the log
            log.error("sandbox %s: cannot audit %s: %s", rec.id, action, e)

    # ------------------------------------------------------------------ snapshots, clones, rollback
    def _snapshot_store(self) -> SnapshotStore:
        if self.snapshots is None:
            raise NotSupported("snapshots are not configured")
        return self.snapshots

    def snapshot(self, sandbox_id: str, snapshot_id: str | None = None) -> dict:
        """A copy of the sandbox's files (its writable layer); its processes are not kept."""
        store = self._snapshot_store()
        snapshot_id = snapshot_id or new_id(sandbox_id)
        if not isinstance(snapshot_id, str) or not SNAPSHOT_ID_RE.fullmatch(snapshot_id):
            raise InvalidRequest(f"snapshot id must match {SNAPSHOT_ID_RE.pattern}")
        if len(store.list()) >= self.max_snapshots:
            raise CapacityError(f"{self.max_snapshots} snapshots kept already (runtime.max_snapshots): "
                                "remove some first")
        with self._use(sandbox_id) as rec, self._copying_layer(sandbox_id):
            b = self._backend(rec.backend)
            if not hasattr(b, "snapshot_layer"):
                raise NotSupported(f"backend {rec.backend} has no snapshots")
            tmp = store.begin(snapshot_id)
            try:
                info = b.snapshot_layer(rec.handle, tmp / "layer")
                snap = Snapshot(id=snapshot_id, sandbox=rec.id, tenant=rec.tenant, backend=rec.backend,
                                template=info["template"], template_key=info["template_key"], limits=rec.limits,
                                layer_uid=info["layer_uid"], size_bytes=tree_size(tmp / "layer"),
                                created=time.time(), network=self.hooks.network_of(rec.id))
                store.commit(tmp, snap)
            except BaseException:
                store.abort(tmp)
                raise
        self.metrics.snapshots.labels(rec.backend).inc()
        return snap.public()

    @contextlib.contextmanager
    def _copying_layer(self, sandbox_id: str):
        with self._wake_lock:
            if sandbox_id in self._removing:
                raise Conflict(f"sandbox {sandbox_id!r} is being removed")
            self._refuse_while_copying(sandbox_id)
            self._copying.add(sandbox_id)
        try:
            yield
        finally:
            with self._wake_lock:
                self._copying.discard(sandbox_id)

    def get_snapshot(self, snapshot_id: str) -> dict:
        return self._get_snapshot(snapshot_id).public()

    def _get_snapshot(self, snapshot_id: str) -> Snapshot:
        try:
            return self._snapshot_store().get(snapshot_id)
        except SnapshotNotFound as e:
            raise NotFound(str(e)) from None

    def list_snapshots(self) -> list[dict]:
        return [s.public() for s in self._snapshot_store().list()] if self.snapshots is not None else []

    def delete_snapshot(self, snapshot_id: str) -> None:
        self._get_snapshot(snapshot_id)
        self._snapshot_store().remove(snapshot_id)

    def _seed(self, snap: Snapshot, sandbox_id: str) -> dict:
        """What a sandbox started from `snap` gets: its layer, with the snapshotted sandbox's
        placeholders replaced by this sandbox's own (the files then work for it, and it never
        holds another sandbox's)."""
        theirs = self.hooks.placeholders(snap.tenant, snap.sandbox)
        ours = self.hooks.placeholders(snap.tenant, sandbox_id)
        return {"seed_layer": str(self._snapshot_store().layer(snap.id)), "seed_uid": snap.layer_uid,
                "seed_template_key": snap.template_key,
                "seed_tokens": {theirs[s]: ours[s] for s in theirs if s in ours}}

    def clone(self, snapshot_id: str, sandbox_ids: list[str], *, labels: dict | None = None,
              env: dict | None = None, secret_env: dict | None = None, limits: Limits | None = None,
              network: dict | None = None) -> list[dict]:
        """Start one sandbox per id from the snapshot: each its own identity, address, placeholders
        and policy (from its own id and labels), the snapshot's files and tenant, and the
        snapshotted sandbox's network options, which `network` can only narrow. All or none."""
        snap = self._get_snapshot(snapshot_id)
        if not sandbox_ids or len(sandbox_ids) > MAX_CLONES or len(set(sandbox_ids)) != len(sandbox_ids):
            raise InvalidRequest(f"ids: 1 to {MAX_CLONES} distinct sandbox ids")
        network = self.hooks.narrow_network(snap.network, network)
        made: list[str] = []
        try:
            for sid in sandbox_ids:
                req = CreateRequest(sandbox_id=sid, tenant=snap.tenant, backend=snap.backend, labels=dict(labels or {}),
                                    limits=limits or snap.limits, env=dict(env or {}),
                                    secret_env=dict(secret_env or {}), template=snap.template, network=network)
                made.append(self.create(req, seed=self._seed(snap, sid))["id"])
        except BaseException:
            for sid in made:
                try:
                    self.destroy(sid)
                except Exception as e:  # noqa: BLE001
                    log.error("clone of %s: cannot remove clone %s after a failure: %s", snapshot_id, sid, e)
            raise
        return [self.get_record(sid).public() for sid in made]

    def rollback(self, sandbox_id: str, snapshot_id: str) -> dict:
        """Stop the sandbox, replace its files by the snapshot's, start it again (same id, network,
        identity and env; new processes)."""
        snap = self._get_snapshot(snapshot_id)
        with self._wake_lock:
            rec = self.get_record(sandbox_id)
            if rec.state not in ("running", "paused") or rec.handle is None:
                raise Conflict(f"sandbox {sandbox_id!r} is {rec.state}")
            if sandbox_id in self._removing:
                raise Conflict(f"sandbox {sandbox_id!r} is being removed")
            self._refuse_while_copying(sandbox_id)
            if snap.tenant != rec.tenant:
                raise InvalidRequest(f"snapshot {snapshot_id!r} belongs to another tenant")
            if (snap.backend, snap.template) != (rec.backend, rec.template):
                raise InvalidRequest(f"snapshot {snapshot_id!r} is of a {snap.backend} sandbox on template "
                                     f"{snap.template!r}, not {rec.template!r}")
            b = self._backend(rec.backend)
            if not hasattr(b, "rollback"):
                raise NotSupported(f"backend {rec.backend} has no rollback")
            if rec.state == "paused":
                self._resume(rec)           # it restarts anyway; and with paused_capacity "memory" its CPUs
                                            # must be there again (429 otherwise), as for a resume
            seed = self._seed(snap, rec.id)
            before = rec.state
            rec.state = "creating"          # meanwhile calls and destroy get 409; a crash: recover() cleans up
            self.state.put(rec)
            self.activity.begin(sandbox_id)
        try:
            handle = b.rollback(rec.handle, limits=rec.limits, **seed)
        except BaseException as e:
            if self._alive_with_retries(b, rec.handle, tries=1):
                rec.state = before          # refused before anything was stopped (e.g. template rebuilt)
                self.state.put(rec)
            else:
                self._fail(rec, f"rollback failed: {e}")
            raise
        finally:
            self.activity.end(sandbox_id)
        rec.handle, rec.state, rec.paused_by, rec.error = handle, "running", None, None
        self.state.put(rec)
        return rec.public()

    def _fail(self, rec: SandboxRecord, reason: str) -> None:
        """The sandbox is gone (its backend cleaned up): release the rest, keep the record saying why."""
        self._undo(rec, None, None, self.switch.sandbox(rec.id) is not None, True)
        rec.state, rec.error, rec.handle, rec.paused_by = "failed", reason, None, None
        self.state.put(rec)

    def set_network(self, sandbox_id: str, network: dict, actor: str) -> dict:
        """Replace a running or paused sandbox's network options; open connections they now refuse
        are closed. They are the gateway's state, not the sandbox's: a paused sandbox is not woken
        (no use of it), and resumes under the new options."""
        rec = self.get_record(sandbox_id)
        if rec.state not in ("running", "paused") or rec.handle is None:
            raise Conflict(f"sandbox {sandbox_id!r} is {rec.state}")
        self.hooks.set_network(sandbox_id, network, actor)
        return rec.public()

    # ------------------------------------------------------------------ destroy
    def destroy(self, sandbox_id: str) -> None:
        # Marked under the wake lock: an auto-pause (or a wake, a pause, a resume) already under
        # way finishes first, and none starts while the backend tears the sandbox down (a freeze
        # between its kill and its wait would leave killed tasks that never die).
        with self._wake_lock:
            rec = self.get_record(sandbox_id)
            if rec.state == "creating":
                # its create() is still running and undoes everything itself if it fails
                raise Conflict(f"sandbox {sandbox_id!r} is being created; destroy it when the create returns")
            if sandbox_id in self._removing:
                raise Conflict(f"sandbox {sandbox_id!r} is being removed already")
            self._refuse_while_copying(sandbox_id)
            self._removing.add(sandbox_id)
        try:
            b = self.backends.get(rec.backend)
            if rec.handle is not None and b is not None:
                b.destroy(rec.handle)
            self.switch.detach_sandbox(sandbox_id)
            self.hooks.forget(sandbox_id)
            self.state.delete(sandbox_id)
            self._usage_cache.pop(sandbox_id, None)
            self.activity.forget(sandbox_id)
        finally:
            with self._wake_lock:
                self._removing.discard(sandbox_id)

    # ------------------------------------------------------------------ read
    def get_record(self, sandbox_id: str) -> SandboxRecord:
        rec = self.state.get(sandbox_id)
        if rec is None:
            raise NotFound(f"no sandbox {sandbox_id!r}")
        return rec

    def get(self, sandbox_id: str) -> dict:
        rec = self.get_record(sandbox_id)
        out = rec.public()
        if rec.handle is not None and rec.state in ("running", "paused"):
            try:
                out["usage"] = self._backend(rec.backend).usage(rec.handle)
            except SandboxError as e:
                out["usage_error"] = str(e)
        return out

    def list(self) -> list[dict]:
        return [r.public() for r in self.state.all()]

    def _running(self, sandbox_id: str) -> SandboxRecord:
        rec = self.get_record(sandbox_id)
        if rec.state != "running" or rec.handle is None:
            raise Conflict(f"sandbox {sandbox_id!r} is {rec.state}")
        return rec

    def _backend(self, name: str) -> Backend:
        b = self.backends.get(name)
        if b is None:
            raise InvalidRequest(f"unknown backend {name!r}; configured: {', '.join(sorted(self.backends)) or 'none'}")
        ok, why = b.available()
        if not ok:
            raise SandboxError(f"backend {name} is not available: {why}")
        return b

    def _footprint(self, backend: str, limits: Limits) -> Limits:
        """What a sandbox really takes from the host: its limit + the backend's own overhead
        (a microVM's qemu), so admission never overcommits."""
        extra = int(getattr(self.backends.get(backend), "memory_overhead_mb", 0))
        return dataclasses.replace(limits, memory_mb=limits.memory_mb + extra) if extra else limits

    def _charge(self, r: SandboxRecord) -> Limits:
        """What a sandbox holds of the budget: its footprint; paused with paused_capacity
        "memory", no CPUs (its frozen processes still hold their memory)."""
        fp = self._footprint(r.backend, r.limits)
        if r.state == "paused" and self.paused_capacity == "memory":
            return dataclasses.replace(fp, cpus=0.0)
        return fp

    def _charges(self) -> list[tuple[SandboxRecord, Limits]]:
        """Every live record (id, tenant, backend, limits, state) and what it holds of the budget."""
        return [(r, self._charge(r)) for r in self.state.charges() if r.state != "failed"]

    def _share_of(self, tenant: str, charges: list[tuple[SandboxRecord, Limits]]) -> dict:
        """admit()'s tenant arguments: what `tenant` holds, and its share."""
        if self.tenant_share is None:
            return {}
        return {"tenant": tenant, "tenant_share": self.tenant_share,
                "tenant_used": reserved([c for r, c in charges if r.tenant == tenant])}

    # ------------------------------------------------------------------ restart
    def recover(self) -> dict:
        """After a daemon restart: keep sandboxes whose agent answers, mark the others failed
        (their resources are released; the record stays so the caller sees why). Whatever a
        backend still holds for a sandbox not kept (an interrupted create's half-made sandbox,
        a record-less orphan) is destroyed: nothing unaccounted for stays on the host."""
        kept = failed = 0
        records = self.state.all()

        def check(rec: SandboxRecord) -> bool:
            b = self.backends.get(rec.backend)
            if rec.state not in ("running", "paused") or rec.handle is None or b is None:
                return False
            return rec.state == "paused" or self._alive_with_retries(b, rec.handle)

        with ThreadPoolExecutor(16, thread_name_prefix="recover") as pool:   # thousands after a reboot
            alive = list(pool.map(check, records))
        kept_ids = {rec.id for rec, ok in zip(records, alive) if ok}
        for rec, ok in zip(records, alive):
            b = self.backends.get(rec.backend)
            if ok:
                kept += 1
                continue
            failed += 1
            reason = "creation interrupted by a daemon restart" if rec.state == "creating" else "sandbox died"
            if rec.state != "failed":
                self._audit_auto("sandbox.failed", rec, reason)
            self._undo(rec, b, rec.handle if b else None, self.switch.sandbox(rec.id) is not None, True)
            if rec.state != "failed":
                rec.state, rec.error = "failed", reason
            rec.handle, rec.paused_by = None, None
            self.state.put(rec)
        reaped = 0
        for name, b in self.backends.items():
            for h in getattr(b, "list", lambda: [])():
                # not kept: a create the daemon did not live to finish or record, or one that failed
                if h.sandbox_id not in kept_ids:
                    try:
                        b.destroy(h)
                        reaped += 1
                    except Exception as e:  # noqa: BLE001
                        log.error("runtime: cannot reap orphan %s sandbox %s: %s", name, h.sandbox_id, e)
        return {"kept": kept, "failed": failed, "reaped": reaped}

    @staticmethod
    def _alive_with_retries(b: Backend, h: Handle, tries: int = 3) -> bool:
        """A sandbox busy at its CPU quota may miss one ping: never tear down a live one for that."""
        for i in range(tries):
            try:
                if b.alive(h):
                    return True
            except Exception:  # noqa: BLE001
                pass
            if i + 1 < tries:
                time.sleep(1.0)
        return False

    # ------------------------------------------------------------------ metrics
    def snapshot_for_metrics(self) -> dict:
        recs = self.state.all()
        counts = _Counter((r.backend, r.state) for r in recs)
        memory = []
        now = time.monotonic()
        for r in recs:
            if r.handle is None or r.state not in ("running", "paused") or r.backend not in self.backends:
                continue
            cached = self._usage_cache.get(r.id)
            if cached is None or now - cached[0] > 2.0:     # scrapes must stay cheap at 1000 sandboxes
                try:
                    cached = (now, self.backends[r.backend].usage(r.handle))
                except Exception:  # noqa: BLE001
                    continue
                self._usage_cache[r.id] = cached
            memory.append((r.id, r.backend, int(cached[1].get("memory_bytes", 0))))
        try:
            avail = self._meminfo().get("MemAvailable")
        except OSError:
            avail = None
        return {"counts": counts, "memory": memory, "budget": self.budget,
                "reserved": reserved([self._charge(r) for r in recs if r.state != "failed"]),
                "paused_by": _Counter((r.backend, r.paused_by or "api") for r in recs if r.state == "paused"),
                "mem_available_mb": avail}


__all__ = ["SandboxManager", "CreateRequest", "RuntimeHooks", "NoHooks", "NotFound", "Conflict",
           "InvalidRequest", "SecretRefused", "Unavailable", "SandboxError", "CapacityError", "NotSupported", "Handle"]
