"""What the E2B API does, on top of the SandboxManager and the process table (blocking calls:
the HTTP handlers run them in a thread pool). Errors are E2bError(status, message) for the
control plane and connect.ConnectError for envd; both messages are safe to show.
"""
from __future__ import annotations

import dataclasses
import logging
import posixpath
import secrets
import stat as statmod
import threading
import time

from sandbox_runtime.agent.client import AgentError
from sandbox_runtime.backend import Limits, NotSupported, SandboxError
from sandbox_runtime.capacity import CapacityError
from sandbox_runtime.manager import Conflict, CreateRequest, InvalidRequest, NotFound, SecretRefused, Unavailable
from sandbox_runtime.processes import NoSuchProcess, ProcessError, ProcessTable

from . import kernel as kern
from . import templates as tpl
from .connect import ConnectError
from .lanes import Gone, LaneFull
from .registry import E2bSandbox, Registry, expired, rfc3339

log = logging.getLogger("cubegate.e2b")

ENVD_VERSION = "0.5.7"        # what the SDK adapts to: default user, stdin, close-stdin, octet-stream uploads
HOME = "/home/user"
USER = "user"
CLIENT_ID = "cubegate"
SIGNALS = {"SIGNAL_SIGKILL": 9, "SIGNAL_SIGTERM": 15, 9: 9, 15: 15}
UNSUPPORTED_CREATE = {   # E2B create options cubegate does not offer (yet): refused, never ignored
    "mcp": "MCP servers are not available",
    "volumeMounts": "volume mounts are not available",
    "iam": "workload identity (iam) is not available",
    "autoResume": "auto-resume is not available",
}


ALL_TRAFFIC = ("0.0.0.0/0", "::/0")     # the SDK's ALL_TRAFFIC (and its IPv6 twin) in denyOut
NETWORK_KEYS = ("allowOut", "denyOut")


def network_options(network, allow_internet_access) -> dict | None:
    """E2B's `network` and `allow_internet_access` → cubegate's per-sandbox network options
    (pure). They only ever narrow what the tenant's egress policy allows:
      denyOut [ALL_TRAFFIC] + allowOut A → allow A (nothing else), or deny everything if A is empty;
      other denyOut entries → deny; allowOut without ALL_TRAFFIC → allow (narrows as well);
      allow_internet_access=False → as denyOut [ALL_TRAFFIC] (what E2B documents).
    E2B lets allowOut win over a denyOut entry that covers it; here a deny wins (stricter,
    never wider). Options cubegate has no equivalent for are refused, never ignored."""
    if network in (None, {}) and allow_internet_access in (None, True):
        return None
    if network is None:
        network = {}
    if not isinstance(network, dict):
        raise E2bError(400, "network must be an object")
    for key in network:
        if key not in NETWORK_KEYS:
            raise E2bError(400, f"network.{key}: not available here (cubegate offers allowOut and denyOut)")
    lists = {}
    for key in NETWORK_KEYS:
        items = network.get(key) or []
        if not isinstance(items, list) or not all(isinstance(x, str) for x in items):
            raise E2bError(400, f"network.{key} must be a list of strings")
        lists[key] = [x.strip() for x in items]
    everything = any(x in ALL_TRAFFIC for x in lists["denyOut"]) or allow_internet_access is False
    out = {"allow": [x for x in lists["allowOut"] if x not in ALL_TRAFFIC],
           "deny": [x for x in lists["denyOut"] if x not in ALL_TRAFFIC]}
    if everything and not out["allow"]:
        out["deny"].append("*")
    return out


class E2bError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


def control_error(e: BaseException) -> E2bError | None:
    """A runtime error as the control plane answers it (None: unexpected)."""
    for types, status in (((NotFound,), 404), ((Conflict,), 409), ((SecretRefused, InvalidRequest), 400),
                          ((CapacityError, LaneFull), 429), ((Gone,), 499), ((NotSupported,), 501),
                          ((Unavailable,), 503),
                          ((SandboxError,), 500)):
        if isinstance(e, types):
            return E2bError(status, str(e))
    return None


def envd_error(e: BaseException) -> ConnectError | None:
    if isinstance(e, ConnectError):
        return e
    if isinstance(e, LaneFull):
        return ConnectError("resource_exhausted", str(e))
    if isinstance(e, (Gone, kern.Cancelled)):
        return ConnectError("canceled", str(e))
    if isinstance(e, NoSuchProcess):
        return ConnectError("not_found", str(e))
    if isinstance(e, ProcessError):
        return ConnectError("failed_precondition", str(e))
    if isinstance(e, AgentError):
        msg = str(e)
        for needle, code in (("No such file", "not_found"), ("File exists", "already_exists"),
                             ("Not a directory", "invalid_argument"), ("not a directory", "invalid_argument"),
                             ("Is a directory", "invalid_argument"), ("not a regular file", "invalid_argument"),
                             ("Permission denied", "permission_denied"), ("Directory not empty", "failed_precondition"),
                             ("unknown request", "unimplemented")):
            if needle in msg:
                return ConnectError(code, msg)
        return ConnectError("internal", msg)
    if isinstance(e, (SecretRefused, InvalidRequest)):
        return ConnectError("invalid_argument", str(e))
    if isinstance(e, NotFound):
        return ConnectError("not_found", str(e))
    if isinstance(e, (Conflict, NotSupported)):
        return ConnectError("failed_precondition", str(e))
    if isinstance(e, Unavailable):
        return ConnectError("unavailable", str(e))
    if isinstance(e, SandboxError):
        return ConnectError("internal", str(e))
    return None


def abs_path(path: str) -> str:
    """E2B paths: absolute, or relative to the user's home."""
    if not isinstance(path, str) or not path or "\0" in path:
        raise ConnectError("invalid_argument", "path must be a non-empty string without NUL")
    return posixpath.normpath(path if path.startswith("/") else posixpath.join(HOME, path))


def entry_info(path: str, e: dict) -> dict:
    """An agent entry record as envd's EntryInfo (proto3 JSON)."""
    kind = {"file": "FILE_TYPE_FILE", "dir": "FILE_TYPE_DIRECTORY", "symlink": "FILE_TYPE_SYMLINK"}.get(
        e["type"], "FILE_TYPE_UNSPECIFIED")
    ftype = {"file": statmod.S_IFREG, "dir": statmod.S_IFDIR}.get(e["type"], statmod.S_IFLNK)
    out = {"name": posixpath.basename(path) or "/", "type": kind, "path": path, "size": str(e["size"]),
           "mode": e["mode"], "permissions": statmod.filemode(ftype | e["mode"]),
           "owner": USER if e["uid"] == 1000 else str(e["uid"]), "group": USER if e["gid"] == 1000 else str(e["gid"]),
           "modifiedTime": rfc3339(e["mtime"])}
    if e["is_link"]:
        out["symlinkTarget"] = e["target"]
    return out


class E2bCore:
    def __init__(self, manager, registry: Registry, *, templates: dict, default_backend: str,
                 default_limits: Limits, default_timeout: int, max_timeout: int, domain: str | None):
        self.manager, self.registry, self.templates = manager, registry, templates
        self.default_backend, self.default_limits = default_backend, default_limits
        self.default_timeout, self.max_timeout, self.domain = default_timeout, max_timeout, domain
        self.processes = ProcessTable()
        self._kernels: dict[str, kern.KernelSession] = {}
        self._cpu_samples: dict[str, tuple[float, float]] = {}
        self._lock = threading.Lock()

    # ================================================================ control plane
    def create(self, tenant: str, body: dict) -> dict:
        for key, why in UNSUPPORTED_CREATE.items():
            if body.get(key) not in (None, {}, []):
                raise E2bError(400, f"{key}: {why}")
        network = network_options(body.get("network"), body.get("allow_internet_access"))
        if body.get("autoPause") is True:
            raise E2bError(400, "autoPause: pausing on timeout is not available; the sandbox is killed at its end time")
        template_id = body.get("templateID")
        if not isinstance(template_id, str):
            raise E2bError(400, "templateID must be a string")
        try:
            t = tpl.resolve(self.templates, template_id)
        except tpl.UnknownTemplate as e:
            raise E2bError(404, str(e)) from None
        timeout = self._timeout(body.get("timeout", self.default_timeout))
        metadata, env_vars = self._str_map(body.get("metadata"), "metadata"), self._str_map(body.get("envVars"), "envVars")
        sid = secrets.token_hex(10)
        limits = Limits(**{**dataclasses.asdict(self.default_limits), **t.limits_override()})
        env = {"HOME": HOME, "USER": USER, "E2B_SANDBOX": "true", "E2B_SANDBOX_ID": sid, "E2B_TEMPLATE_ID": t.id,
               **env_vars}
        self.manager.create(CreateRequest(sandbox_id=sid, tenant=tenant, backend=t.backend or self.default_backend,
                                          limits=limits, env=env, network=network))
        now = time.time()
        rec = E2bSandbox(sandbox_id=sid, tenant=tenant, template_id=t.id, alias=t.id, started_at=now,
                         end_at=now + timeout, envd_token=secrets.token_urlsafe(32), metadata=metadata,
                         cpus=limits.cpus, memory_mb=limits.memory_mb, disk_mb=limits.disk_mb, kind=t.kind)
        self.registry.put(rec)
        if t.kind == "code-interpreter":
            try:
                self._start_kernel(sid)
            except BaseException:
                self.kill(tenant, sid)
                raise
        return self.created(rec)

    def created(self, rec: E2bSandbox) -> dict:
        out = {"templateID": rec.template_id, "sandboxID": rec.sandbox_id, "clientID": CLIENT_ID,
               "envdVersion": ENVD_VERSION, "alias": rec.alias, "envdAccessToken": rec.envd_token}
        if self.domain:
            out["domain"] = self.domain
        return out

    def _timeout(self, value) -> int:
        if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= self.max_timeout:
            raise E2bError(400, f"timeout must be whole seconds in [1, {self.max_timeout}]")
        return value

    @staticmethod
    def _str_map(value, what: str) -> dict:
        if value is None:
            return {}
        if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
            raise E2bError(400, f"{what} must be an object of strings")
        if len(value) > 256:
            raise E2bError(400, f"{what}: at most 256 entries")
        return dict(value)

    def owned(self, tenant: str, sandbox_id: str) -> E2bSandbox:
        rec = self.registry.get(sandbox_id)
        if rec is None or rec.tenant != tenant:
            raise E2bError(404, f"sandbox {sandbox_id} not found")
        return rec

    def state_of(self, sandbox_id: str) -> str | None:
        try:
            return self.manager.get_record(sandbox_id).state
        except NotFound:
            return None

    def detail(self, rec: E2bSandbox) -> dict:
        state = "paused" if self.state_of(rec.sandbox_id) == "paused" else "running"
        out = {"templateID": rec.template_id, "alias": rec.alias, "sandboxID": rec.sandbox_id, "clientID": CLIENT_ID,
               "startedAt": rfc3339(rec.started_at), "endAt": rfc3339(rec.end_at), "envdVersion": ENVD_VERSION,
               "cpuCount": max(1, round(rec.cpus)), "memoryMB": rec.memory_mb, "diskSizeMB": rec.disk_mb,
               "state": state, "metadata": rec.metadata}
        if self.domain:
            out["domain"] = self.domain
        return out

    def list(self, tenant: str, *, states: set[str], metadata: dict[str, str], limit: int,
             next_token: str | None) -> tuple[list[dict], str | None]:
        """One page, ordered by (start time, id); the token is the last item's key."""
        items = sorted((r for r in self.registry.all() if r.tenant == tenant),
                       key=lambda r: (r.started_at, r.sandbox_id))
        after = _key(next_token) if next_token else None
        out = []
        for r in items:
            d = self.detail(r)
            if d["state"] not in states or any(r.metadata.get(k) != v for k, v in metadata.items()):
                continue
            if after is not None and (r.started_at, r.sandbox_id) <= after:
                continue
            out.append((r, d))
        page, more = out[:limit], len(out) > limit
        token = f"{page[-1][0].started_at!r}:{page[-1][0].sandbox_id}" if more and page else None
        return [d for _, d in page], token

    def kill(self, tenant: str, sandbox_id: str) -> None:
        self.owned(tenant, sandbox_id)
        self._destroy(sandbox_id)

    def _destroy(self, sandbox_id: str) -> None:
        self.processes.drop_sandbox(sandbox_id)
        try:
            self.manager.destroy(sandbox_id)      # its hooks call forget_sandbox
        except NotFound:
            pass
        self.forget_sandbox(sandbox_id)

    def forget_sandbox(self, sandbox_id: str) -> None:
        """The sandbox is gone, however it went (this API, cubegate's own, a failure): its E2B
        record (envd token), processes, kernel and samples go at once — a reused id inherits none."""
        self.processes.drop_sandbox(sandbox_id)
        with self._lock:
            session = self._kernels.pop(sandbox_id, None)
            self._cpu_samples.pop(sandbox_id, None)
        if session is not None:
            session.close()
        self.registry.delete(sandbox_id)

    def set_timeout(self, tenant: str, sandbox_id: str, timeout) -> None:
        self.owned(tenant, sandbox_id)
        self.registry.set_end(sandbox_id, time.time() + self._timeout(timeout))

    def pause(self, tenant: str, sandbox_id: str) -> None:
        self.owned(tenant, sandbox_id)
        if self.state_of(sandbox_id) == "paused":
            raise E2bError(409, f"sandbox {sandbox_id} is already paused")
        self.manager.pause(sandbox_id)

    def resume(self, tenant: str, sandbox_id: str, timeout) -> dict:
        """Older SDKs' resume: ownership first (every foreign or missing id is the same 404),
        then the state (409 when it is not paused)."""
        self.owned(tenant, sandbox_id)
        if self.state_of(sandbox_id) != "paused":
            raise E2bError(409, f"sandbox {sandbox_id} is not paused")
        return self.connect(tenant, sandbox_id, timeout)[1]

    def connect(self, tenant: str, sandbox_id: str, timeout) -> tuple[int, dict]:
        """Resume a paused sandbox (201) or extend a running one's end time (200)."""
        rec = self.owned(tenant, sandbox_id)
        status = 200
        if self.state_of(sandbox_id) == "paused":
            self.manager.resume(sandbox_id)
            status = 201
        if timeout is not None:
            end = time.time() + self._timeout(timeout)
            if end > rec.end_at:
                self.registry.set_end(sandbox_id, end)
        return status, self.created(self.registry.get(sandbox_id) or rec)

    def metrics(self, tenant: str, sandbox_id: str) -> list[dict]:
        rec = self.owned(tenant, sandbox_id)
        usage = self.manager.get(sandbox_id).get("usage") or {}
        now, cpu = time.time(), float(usage.get("cpu_seconds", 0.0))
        with self._lock:
            prev = self._cpu_samples.get(sandbox_id, (rec.started_at, 0.0))
            self._cpu_samples[sandbox_id] = (now, cpu)
        pct = max(0.0, (cpu - prev[1]) / max(1e-3, now - prev[0]) / max(rec.cpus, 1e-3) * 100)
        return [{"timestamp": rfc3339(now), "timestampUnix": int(now), "cpuCount": max(1, round(rec.cpus)),
                 "cpuUsedPct": round(min(pct, 100.0), 2), "memUsed": int(usage.get("memory_bytes", 0)),
                 "memTotal": rec.memory_mb << 20, "memCache": 0, "diskUsed": 0, "diskTotal": rec.disk_mb << 20}]

    def reap_expired(self) -> list[str]:
        # kept past its end time: a sandbox the client paused (as E2B does), never one the runtime
        # froze for idleness — that one would otherwise live (and hold its reservation) forever
        paused = {r.sandbox_id for r in self.registry.all() if self.manager.paused_by(r.sandbox_id) == "api"}
        gone = []
        for sid in expired(self.registry.all(), time.time(), paused):
            try:
                self._destroy(sid)
                gone.append(sid)
            except Exception as e:  # noqa: BLE001 - try again next round
                log.warning("e2b: cannot kill expired sandbox %s: %s", sid, type(e).__name__)
        for r in self.registry.all():       # destroyed through cubegate's own API
            try:
                if self.state_of(r.sandbox_id) is None:
                    self._destroy(r.sandbox_id)
            except Exception as e:  # noqa: BLE001 - try again next round; the others still go
                log.warning("e2b: cannot forget removed sandbox %s: %s", r.sandbox_id, type(e).__name__)
        return gone

    # ================================================================ envd: processes
    def running_record(self, sandbox_id: str) -> E2bSandbox:
        rec = self.registry.get(sandbox_id)
        if rec is None or self.state_of(sandbox_id) is None:
            raise E2bError(502, f"The sandbox {sandbox_id} was not found")
        if self.state_of(sandbox_id) == "paused":
            raise E2bError(502, f"The sandbox {sandbox_id} is paused: connect to it to resume it")
        return rec

    def start_process(self, sandbox_id: str, config: dict, *, stdin: bool, tag: str | None):
        rec = self.running_record(sandbox_id)
        cmd, args = config.get("cmd"), config.get("args") or []
        envs = config.get("envs") or {}
        if not isinstance(cmd, str) or not cmd or not isinstance(args, list) or not all(isinstance(a, str) for a in args):
            raise ConnectError("invalid_argument", "process.cmd must be a string, args a list of strings")
        if not isinstance(envs, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in envs.items()):
            raise ConnectError("invalid_argument", "process.envs must be an object of strings")
        cwd = abs_path(config.get("cwd") or HOME)
        argv = [cmd, *args]
        lifetime = max(60.0, rec.end_at - time.time() + 60)
        texts = [*argv, cwd, *(x for kv in envs.items() for x in kv), tag or ""]

        def open_stream():
            # PWD: shells keep the logical path (/home/user is a symlink in namespace sandboxes)
            return self.manager.agent_call(sandbox_id, lambda c: c.exec_stream(argv, lifetime, {"PWD": cwd, **envs},
                                                                               cwd),
                                           texts=texts)
        cfg = {"cmd": cmd, "args": args, "envs": envs, "cwd": cwd}
        try:
            return self.processes.start(sandbox_id, open_stream, cfg, tag=tag, stdin=stdin)
        except AgentError as e:
            if "not a serial agent" not in str(e):
                raise
        return self._run_buffered(sandbox_id, argv, envs, cwd, cfg, lifetime)

    def _run_buffered(self, sandbox_id, argv, envs, cwd, cfg, lifetime):
        """A serial agent (microVM): the command runs to its end, then its output is one event."""
        from sandbox_runtime.processes import Exit
        res = self.manager.exec(sandbox_id, argv, timeout=min(lifetime, 3600), env=envs, cwd=cwd)
        code = res.exit_code
        ex = Exit(code, f"exit status {code}" if code >= 0 else f"signal: {-code}")
        with self._lock:
            self._synthetic = getattr(self, "_synthetic", 1_000_000) + 1
            pid = self._synthetic
        return self.processes.add_finished(sandbox_id, pid, cfg, res.stdout, res.stderr, ex)

    def process(self, sandbox_id: str, selector: dict):
        self.running_record(sandbox_id)
        pid, tag = (selector or {}).get("pid"), (selector or {}).get("tag")
        if pid is None and tag is None:
            raise ConnectError("invalid_argument", "process selector needs pid or tag")
        if pid is not None and (not isinstance(pid, int) or isinstance(pid, bool)):
            raise ConnectError("invalid_argument", "pid must be a number")
        return self.processes.get(sandbox_id, pid=pid, tag=tag)

    def list_processes(self, sandbox_id: str) -> list[dict]:
        self.running_record(sandbox_id)
        out = []
        for p in self.processes.running(sandbox_id):
            if p.tag == kern.KERNEL_TAG:
                continue
            d = {"config": p.config, "pid": p.pid}
            if p.tag:
                d["tag"] = p.tag
            out.append(d)
        return out

    def send_input(self, sandbox_id: str, selector: dict, data: bytes) -> None:
        proc = self.process(sandbox_id, selector)
        self.manager.agent_call(sandbox_id, lambda c: None, data=data)   # the secret check, as for exec stdin
        proc.send_stdin(data)

    def close_stdin(self, sandbox_id: str, selector: dict) -> None:
        self.process(sandbox_id, selector).close_stdin()

    def signal(self, sandbox_id: str, selector: dict, signal) -> None:
        proc = self.process(sandbox_id, selector)
        if signal not in SIGNALS:
            raise ConnectError("invalid_argument", "signal must be SIGNAL_SIGKILL or SIGNAL_SIGTERM")
        if proc.exit is not None:
            raise ConnectError("not_found", f"process with pid {proc.pid} not found")
        if proc.pid >= 1_000_000:
            raise ConnectError("unimplemented", "this backend runs commands to their end (no signals)")
        self.manager.agent_call(sandbox_id, lambda c: c.signal(proc.pid, SIGNALS[signal]))

    # ================================================================ envd: filesystem
    def fs(self, sandbox_id: str, fn, *, texts=(), data: bytes = b""):
        self.running_record(sandbox_id)
        return self.manager.agent_call(sandbox_id, fn, texts=list(texts), data=data)

    def stat(self, sandbox_id: str, path: str) -> dict:
        p = abs_path(path)
        return entry_info(p, self.fs(sandbox_id, lambda c: c.stat(p)))

    def list_dir(self, sandbox_id: str, path: str, depth: int) -> list[dict]:
        p = abs_path(path)
        if not isinstance(depth, int) or not 0 <= depth <= 64:
            raise ConnectError("invalid_argument", "depth must be in [0, 64]")
        entries = self.fs(sandbox_id, lambda c: c.list_dir(p, max(1, depth)))
        return [entry_info(posixpath.join(p, e["name"]), e) for e in entries]

    def make_dir(self, sandbox_id: str, path: str) -> dict:
        p = abs_path(path)
        created = self.fs(sandbox_id, lambda c: c.make_dir(p), texts=[p])
        if not created:
            raise ConnectError("already_exists", "directory already exists")
        return self.stat(sandbox_id, p)

    def move(self, sandbox_id: str, src: str, dst: str) -> dict:
        s, d = abs_path(src), abs_path(dst)
        self.fs(sandbox_id, lambda c: c.rename(s, d), texts=[s, d])
        return self.stat(sandbox_id, d)

    def remove(self, sandbox_id: str, path: str) -> None:
        p = abs_path(path)
        self.fs(sandbox_id, lambda c: c.remove(p))

    def write_file(self, sandbox_id: str, path: str, data: bytes) -> dict:
        p = abs_path(path)
        self.fs(sandbox_id, lambda c: c.write_large(p, data), texts=[p], data=data)
        return {"name": posixpath.basename(p), "type": "file", "path": p}

    def read_chunk(self, sandbox_id: str, path: str, offset: int, size: int) -> bytes:
        p = abs_path(path)
        return self.fs(sandbox_id, lambda c: c.read_at(p, offset, size))

    # ================================================================ code interpreter
    def _start_kernel(self, sandbox_id: str) -> None:
        marker = kern.new_marker()
        self.manager.agent_call(sandbox_id, lambda c: c.write_file(kern.KERNEL_PATH, kern.KERNEL_SOURCE.encode()))
        proc = self.start_process(sandbox_id, {"cmd": "python3", "args": ["-u", kern.KERNEL_PATH, marker],
                                               "cwd": HOME}, stdin=True, tag=kern.KERNEL_TAG)
        def interrupt():   # SIGINT: the kernel ends the cell it runs (and ignores it between cells)
            try:
                self.manager.agent_call(sandbox_id, lambda c: c.signal(proc.pid, 2))
            except Exception as e:  # noqa: BLE001 - gone already; the next cell says so
                log.info("e2b: interrupting the kernel of %s failed: %s", sandbox_id, type(e).__name__)
        with self._lock:
            self._kernels[sandbox_id] = kern.KernelSession(proc, marker, interrupt)

    def execute(self, sandbox_id: str, code: str, env: dict, emit, timeout: float | None,
                cancel: threading.Event | None = None) -> None:
        rec = self.running_record(sandbox_id)
        with self._lock:
            session = self._kernels.get(sandbox_id)
        if session is None or rec.kind != "code-interpreter":
            raise E2bError(502, f"The sandbox {sandbox_id} port is not open: no code interpreter in this template")
        if session.proc.exit is not None:
            raise E2bError(500, "the code interpreter's kernel has exited")
        self.manager.agent_call(sandbox_id, lambda c: None, texts=[code, *(x for kv in env.items() for x in kv)])
        # never longer than the sandbox lives (a stuck cell must not hold a thread forever)
        limit = max(1.0, rec.end_at - time.time())
        try:
            session.execute(code, env, emit, limit if timeout is None else min(timeout, limit), cancel)
        except kern.KernelBusy as e:
            raise E2bError(409, str(e)) from None
        except kern.OutputLimit:
            pass          # the cell answered its error item; the kernel lives on for the next one


def _key(token: str) -> tuple[float, str]:
    started, _, sid = token.partition(":")
    try:
        return float(started), sid
    except ValueError:
        raise E2bError(400, "bad nextToken") from None
