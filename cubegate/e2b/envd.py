"""envd's protocol, served by the daemon for every E2B sandbox (the SDK talks to "envd" here).

Which sandbox: the `E2b-Sandbox-Id` / `E2b-Sandbox-Port` headers (a fixed E2B_SANDBOX_URL),
or the Host `<port>-<id>.<domain>` (what `get_host(port)` builds). Port 49983 is envd,
49999 the code interpreter. `X-Access-Token` must be the sandbox's envd token.

    POST /process.Process/{Start,Connect}        server streams (Connect, JSON)
    POST /process.Process/{List,SendInput,CloseStdin,SendSignal}   unary
    POST /filesystem.Filesystem/{Stat,ListDir,MakeDir,Move,Remove} unary
    GET  /files?path=  POST /files?path= (multipart or octet-stream)   GET /health
    POST /execute (NDJSON lines)                  code interpreter, port 49999

Processes outlive their stream: a stream that ends (client gone, Connect-Timeout-Ms)
leaves the process running; Connect by pid replays its buffered output.
"""
from __future__ import annotations

import asyncio
import base64
import binascii
import json
import logging
import re
import threading
import time

import tornado.web
from tornado.httputil import parse_body_arguments

from . import connect as cx
from .core import E2bError, envd_error

log = logging.getLogger("cubegate.e2b.envd")

ENVD_PORT, JUPYTER_PORT = 49983, 49999
KEEPALIVE_S = 30.0
MAX_QUEUED_BYTES = 8 << 20      # a reader this far behind is cut off (the process goes on)
READ_CHUNK = 4 << 20
_HOST_RE = re.compile(r"^(\d{1,5})-([a-z0-9][a-z0-9-]{0,39})\.")


def target_of(headers, domain: str | None) -> tuple[str, int] | None:
    """(sandbox id, port) from the E2B headers, else from the Host form (pure)."""
    sid, port = headers.get("E2b-Sandbox-Id"), headers.get("E2b-Sandbox-Port")
    if sid:
        return sid, int(port) if port and port.isdigit() else ENVD_PORT
    host = headers.get("Host", "").split(":")[0].lower()
    m = _HOST_RE.match(host)
    if m and (domain is None or host[m.end():] == domain.lower()):
        return m.group(2), int(m.group(1))
    return None


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def unb64(value, what: str) -> bytes:
    try:
        return base64.b64decode(value or "", validate=True)
    except (binascii.Error, TypeError, ValueError):
        raise cx.ConnectError("invalid_argument", f"{what} must be base64") from None


class SandboxHandler(tornado.web.RequestHandler):
    """Resolves and authorizes the sandbox; plain-HTTP errors as `{"code", "message"}`."""
    port = ENVD_PORT

    def initialize(self, core, lanes, domain: str | None = None, **_) -> None:
        self.core, self.lanes, self.domain = core, lanes, domain
        self.sandbox_id: str | None = None
        self.tenant: str | None = None
        self.gone = False
        self.closed = asyncio.Event()     # the client went away: waits for a slot end
        self.cancel = threading.Event()   # ... and so does a cell waiting in a worker thread

    def set_default_headers(self) -> None:
        self.set_header("Cache-Control", "no-store")
        self.clear_header("Server")

    async def run(self, fn, *args, **kw):
        """In the envd pool, at most ENVD_LIMITS calls per sandbox and per tenant (a sandbox
        whose code makes calls last cannot hold the workers every other sandbox needs)."""
        keys = [("sandbox", self.sandbox_id or "-"), ("tenant", self.tenant or "-")]
        return await self.lanes.run(keys, lambda: fn(*args, **kw), gone=self.closed)

    def resolve(self) -> str:
        t = target_of(self.request.headers, self.domain)
        if t is None:
            raise E2bError(400, "no sandbox named: send E2b-Sandbox-Id (or use the <port>-<id>.<domain> host)")
        sid, port = t
        if port != self.port:
            raise E2bError(502, f"The sandbox {sid} port is not open: {port} is not served here")
        rec = self.core.registry.get(sid)
        if rec is None:
            raise E2bError(502, f"The sandbox {sid} was not found")
        if not rec.token_ok(self.request.headers.get("X-Access-Token")):
            raise E2bError(401, "missing or wrong X-Access-Token for this sandbox")
        self.sandbox_id, self.tenant = sid, rec.tenant
        return sid

    def plain_error(self, status: int, message: str) -> None:
        if self._finished:
            return
        self.clear()
        self.set_default_headers()
        self.set_status(status)
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps({"code": status, "message": message}))

    def on_connection_close(self) -> None:
        self.gone = True
        self.closed.set()
        self.cancel.set()

    def log_exception(self, typ, value, tb) -> None:   # never a request's data in a log line
        log.error("e2b envd: internal error %s in %s", typ.__name__ if typ else "?", type(self).__name__)

    def write_error(self, status_code: int, **kwargs) -> None:
        exc = kwargs.get("exc_info", (None, None))[1]
        if isinstance(exc, E2bError):
            self.plain_error(exc.status, exc.message)
        else:
            self.plain_error(status_code, "internal error" if status_code >= 500 else "bad request")


class Health(SandboxHandler):
    async def get(self) -> None:
        if target_of(self.request.headers, self.domain) is None:     # the control plane's own health
            self.set_status(200)
            self.finish(b"ok")
            return
        sid = self.resolve()
        await self.run(self.core.running_record, sid)
        self.set_status(204)
        self.finish()


class Rpc(SandboxHandler):
    """/<service>/<method>: unary (application/json) and server streams (application/connect+json)."""
    unary: dict[str, str] = {}
    streams: dict[str, str] = {}

    async def post(self, method: str) -> None:
        ctype = self.request.headers.get("Content-Type", "").split(";")[0].strip()
        streaming = method in self.streams
        try:
            sid = self.resolve()
            if streaming:
                if ctype != "application/connect+json":
                    raise cx.ConnectError("invalid_argument", "server streams take application/connect+json")
                msg = cx.parse_envelope(self.request.body)
            elif method in self.unary:
                if ctype != "application/json":
                    raise cx.ConnectError("invalid_argument", "unary calls take application/json (JSON codec)")
                msg = cx.parse_json(self.request.body)
            else:
                raise cx.ConnectError("unimplemented", f"{method} is not implemented")
            deadline = cx.timeout_seconds(self.request.headers.get("Connect-Timeout-Ms"), None)
        except (cx.ConnectError, E2bError) as e:
            return self._error(e, streaming)
        if streaming:
            return await getattr(self, self.streams[method])(sid, msg, deadline)
        try:
            out = await self.run(getattr(self, self.unary[method]), sid, msg)
        except BaseException as e:  # noqa: BLE001 - mapped below; unexpected ones are internal
            return self._error(e, False)
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps(out or {}))

    def _error(self, e: BaseException, streaming: bool) -> None:
        if isinstance(e, E2bError):
            return self.plain_error(e.status, e.message)
        err = envd_error(e)
        if err is None:
            log.error("e2b envd: internal error %s in %s", type(e).__name__, type(self).__name__)
            err = cx.ConnectError("internal", "internal error")
        if streaming:
            self.set_status(200)
            self.set_header("Content-Type", "application/connect+json")
            self.finish(cx.end_of_stream(err))
        else:
            self.set_status(cx.HTTP_STATUS[err.code])
            self.set_header("Content-Type", "application/json")
            self.finish(json.dumps(err.body()))


def _user_ok(headers) -> None:
    auth = headers.get("Authorization", "")
    if not auth.lower().startswith("basic "):
        return
    try:
        user = base64.b64decode(auth[6:]).decode().split(":", 1)[0]
    except (binascii.Error, UnicodeDecodeError):
        raise cx.ConnectError("invalid_argument", "bad Authorization header") from None
    if user not in ("", "user"):
        raise cx.ConnectError("permission_denied", "cubegate sandboxes have one user, 'user' (no root)")


class ProcessRpc(Rpc):
    unary = {"List": "list", "SendInput": "send_input", "CloseStdin": "close_stdin", "SendSignal": "send_signal"}
    streams = {"Start": "start", "Connect": "connect"}

    def list(self, sid, msg):
        return {"processes": self.core.list_processes(sid)}

    def send_input(self, sid, msg):
        inp = msg.get("input") or {}
        if "pty" in inp:
            raise cx.ConnectError("unimplemented", "no PTY here")
        self.core.send_input(sid, msg.get("process"), unb64(inp.get("stdin"), "input.stdin"))

    def close_stdin(self, sid, msg):
        self.core.close_stdin(sid, msg.get("process"))

    def send_signal(self, sid, msg):
        self.core.signal(sid, msg.get("process"), msg.get("signal"))

    async def start(self, sid, msg, deadline):
        def begin():
            _user_ok(self.request.headers)
            if msg.get("pty"):
                raise cx.ConnectError("unimplemented", "PTY sessions are not available")
            tag = msg.get("tag")
            if tag is not None and not isinstance(tag, str):
                raise cx.ConnectError("invalid_argument", "tag must be a string")
            return self.core.start_process(sid, msg.get("process") or {}, stdin=bool(msg.get("stdin")), tag=tag)
        await self._stream(sid, begin, deadline)

    async def connect(self, sid, msg, deadline):
        await self._stream(sid, lambda: self.core.process(sid, msg.get("process")), deadline)

    async def _stream(self, sid, find_process, deadline) -> None:
        """Start event, then what the process wrote (buffered, then live), then its end."""
        loop = asyncio.get_running_loop()
        try:
            proc = await self.run(find_process)
        except BaseException as e:  # noqa: BLE001
            return self._error(e, True)
        queue: asyncio.Queue = asyncio.Queue()
        queued = [0]

        def on_event(kind, data):
            loop.call_soon_threadsafe(_put, kind, data)

        def _put(kind, data):
            # bounded while a write is blocked on a client that does not read: past the
            # limit the stream is cut (the process goes on; reconnect by pid)
            if kind != "end" and queued[0] > MAX_QUEUED_BYTES:
                return
            queued[0] += len(data) if isinstance(data, bytes) else 0
            queue.put_nowait((kind, data))

        # a client reading a command's output is a call in flight: the sandbox is not auto-paused under it
        release = self.core.manager.hold_awake(sid)
        replay, unsubscribe = proc.subscribe(on_event)
        for kind, data in replay:
            queue.put_nowait((kind, data))
        self.set_status(200)
        self.set_header("Content-Type", "application/connect+json")
        end_at = None if deadline is None else loop.time() + deadline
        error = None
        try:
            self.write(cx.envelope({"event": {"start": {"pid": proc.pid}}}))
            await self.flush()
            while not self.gone:
                wait = KEEPALIVE_S if end_at is None else min(KEEPALIVE_S, end_at - loop.time())
                if wait <= 0:
                    error = cx.ConnectError("deadline_exceeded", "the stream reached its timeout (the process goes on)")
                    break
                try:
                    kind, data = await asyncio.wait_for(queue.get(), wait)
                except asyncio.TimeoutError:
                    self.write(cx.envelope({"event": {"keepalive": {}}}))
                    await self.flush()
                    continue
                if kind == "end":
                    end = {"exitCode": data.exit_code, "exited": data.error is None, "status": data.status}
                    if data.error:
                        end["error"] = data.error
                    self.write(cx.envelope({"event": {"end": end}}))
                    break
                over = queued[0] > MAX_QUEUED_BYTES
                queued[0] -= len(data)
                self.write(cx.envelope({"event": {"data": {kind: b64(data)}}}))
                if over:
                    error = cx.ConnectError("resource_exhausted", "reader too slow: reconnect to the process by pid")
                    break
                await self.flush()
            if not self.gone:
                self.finish(cx.end_of_stream(error))
        except tornado.iostream.StreamClosedError:
            pass
        finally:
            unsubscribe()
            release()


class FilesystemRpc(Rpc):
    unary = {"Stat": "stat", "ListDir": "list_dir", "MakeDir": "make_dir", "Move": "move", "Remove": "remove"}

    def stat(self, sid, msg):
        return {"entry": self.core.stat(sid, msg.get("path"))}

    def list_dir(self, sid, msg):
        return {"entries": self.core.list_dir(sid, msg.get("path"), msg.get("depth", 1))}

    def make_dir(self, sid, msg):
        return {"entry": self.core.make_dir(sid, msg.get("path"))}

    def move(self, sid, msg):
        return {"entry": self.core.move(sid, msg.get("source"), msg.get("destination"))}

    def remove(self, sid, msg):
        self.core.remove(sid, msg.get("path"))
        return {}


FILES_ERRORS = {"not_found": 404, "invalid_argument": 400, "permission_denied": 401, "already_exists": 409}


class Files(SandboxHandler):
    """GET streams the file in READ_CHUNK reads; POST takes multipart parts (their filename
    is the path when ?path is absent) or one octet-stream body."""

    async def get(self) -> None:
        try:
            sid = self.resolve()
            path = self.get_query_argument("path", "")
            first = await self.run(self.core.read_chunk, sid, path, 0, READ_CHUNK)
        except BaseException as e:  # noqa: BLE001
            return self._fail(e)
        self.set_header("Content-Type", "application/octet-stream")
        chunk, offset = first, 0
        try:
            while True:
                self.write(chunk)
                await self.flush()
                offset += len(chunk)
                if len(chunk) < READ_CHUNK or self.gone:
                    break
                chunk = await self.run(self.core.read_chunk, sid, path, offset, READ_CHUNK)
            self.finish()
        except tornado.iostream.StreamClosedError:
            pass

    async def post(self) -> None:
        try:
            sid = self.resolve()
            path = self.get_query_argument("path", None)
            ctype = self.request.headers.get("Content-Type", "")
            if self.request.headers.get("Content-Encoding", "identity") != "identity":
                raise E2bError(400, "compressed uploads are not supported")
            uploads: list[tuple[str, bytes]] = []
            if ctype.startswith("multipart/form-data"):
                args, files = {}, {}
                parse_body_arguments(ctype, self.request.body, args, files)
                for part in files.get("file", []):
                    uploads.append((path if path and len(files["file"]) == 1 else part.filename, part.body))
            else:
                if not path:
                    raise E2bError(400, "path is required")
                uploads.append((path, self.request.body))
            if not uploads:
                raise E2bError(400, "no file in the request")
            out = [await self.run(self.core.write_file, sid, p, data) for p, data in uploads]
        except BaseException as e:  # noqa: BLE001
            return self._fail(e)
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps(out))

    def _fail(self, e: BaseException) -> None:
        if isinstance(e, E2bError):
            return self.plain_error(e.status, e.message)
        err = envd_error(e)
        if err is None:
            log.error("e2b envd: internal error %s in /files", type(e).__name__)
            return self.plain_error(500, "internal error")
        self.plain_error(FILES_ERRORS.get(err.code, 500), err.message)


class Execute(SandboxHandler):
    """The code interpreter: one cell, NDJSON lines as the kernel produces them."""
    port = JUPYTER_PORT

    async def post(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            sid = self.resolve()
            body = cx.parse_json(self.request.body)
            code, lang = body.get("code"), body.get("language")
            if not isinstance(code, str):
                raise E2bError(400, "code must be a string")
            if lang not in (None, "python") or body.get("context_id") not in (None, "default"):
                raise E2bError(400, "only the default Python context is available")
            env = body.get("env_vars") or {}
            if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
                raise E2bError(400, "env_vars must be an object of strings")
        except BaseException as e:  # noqa: BLE001
            return self._fail(e)
        queue: asyncio.Queue = asyncio.Queue()

        def emit(item):
            item.setdefault("timestamp", time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
            loop.call_soon_threadsafe(queue.put_nowait, item)

        task = asyncio.ensure_future(self.run(self.core.execute, sid, code, env, emit, None, self.cancel))
        self.set_header("Content-Type", "application/x-ndjson")
        started = False
        try:
            while True:
                getter = asyncio.ensure_future(queue.get())
                done, _ = await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
                if getter in done:
                    self.write(json.dumps(getter.result()) + "\n")
                    await self.flush()
                    started = True
                    continue
                getter.cancel()
                while not queue.empty():
                    self.write(json.dumps(queue.get_nowait()) + "\n")
                exc = task.exception()
                if exc is not None and not started:
                    return self._fail(exc)
                if exc is not None:
                    self.write(json.dumps({"type": "error", "name": "CubegateError", "value": "execution failed",
                                           "traceback": ""}) + "\n")
                self.finish()
                return
        except tornado.iostream.StreamClosedError:
            pass

    def _fail(self, e: BaseException) -> None:
        if isinstance(e, E2bError):
            return self.plain_error(e.status, e.message)
        err = envd_error(e)
        self.plain_error(500 if err is None else cx.HTTP_STATUS[err.code], "internal error" if err is None else err.message)


ROUTES = [
    (r"/health", Health),
    (r"/process\.Process/(\w+)", ProcessRpc),
    (r"/filesystem\.Filesystem/(\w+)", FilesystemRpc),
    (r"/files", Files),
    (r"/execute", Execute),
]
