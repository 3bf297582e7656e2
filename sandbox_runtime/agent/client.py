"""Python side of the exec agent protocol (PROTOCOL.md).

`AgentClient(connect)`: `connect()` returns a fresh connected socket-like object
(unix socket: one request per connection) — or, for a serial stream such as a
virtio-serial port, the same object every time with `serial=True`, in which case
requests are serialised with a lock.
"""
from __future__ import annotations

import select
import socket
import struct
import threading
import time
from contextlib import contextmanager, suppress
from typing import Callable, Iterator

from sandbox_runtime.backend import ExecResult, SandboxError

MAX_FRAME = 16 << 20
STDIN_CHUNK = 64 << 10
MAX_STREAM = 16 << 20    # per stream kept by the host, whatever the agent sends (a guest may run its own)
FILE_CHUNK = 8 << 20     # chunked file transfer: one 'A'/'H' frame each
GRACE_S = 5.0            # every call's socket timeout = its own timeout + this


OutputHook = Callable[[str, bytes], None]


class AgentError(SandboxError):
    """The agent answered with an error ('F') or broke the protocol."""


def encode_frame(kind: bytes, payload: bytes = b"") -> bytes:
    if len(payload) > MAX_FRAME:
        raise AgentError(f"frame too large ({len(payload)} bytes)")
    return kind + struct.pack(">I", len(payload)) + payload


def _fields(*items: str | bytes) -> bytes:
    out = []
    for it in items:
        b = it.encode() if isinstance(it, str) else it
        if b"\0" in b:
            raise AgentError("NUL byte in a request field")
        out.append(b + b"\0")
    return b"".join(out)


def encode_exec(argv: list[str], timeout: float, env: dict[str, str], cwd: str) -> bytes:
    if not argv:
        raise AgentError("empty argv")
    envs = [f"{k}={v}" for k, v in env.items()]
    for k in env:
        if not k or "=" in k:
            raise AgentError(f"bad env name {k!r}")
    return _fields(str(max(1, int(timeout * 1000))), cwd, str(len(argv)), *argv, str(len(envs)), *envs)


def _recv_exact(sock, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            raise AgentError("agent closed the connection")
        buf += chunk
    return bytes(buf)


def recv_frame(sock) -> tuple[bytes, bytes]:
    hdr = _recv_exact(sock, 5)
    (length,) = struct.unpack(">I", hdr[1:])
    if length > MAX_FRAME + 1024:
        raise AgentError("oversize frame from agent")
    return hdr[:1], _recv_exact(sock, length) if length else b""


class AgentClient:
    def __init__(self, connect: Callable[[], socket.socket], *, serial: bool = False,
                 ping_timeout: float = 5.0, io_timeout: float = 30.0):
        self._connect = connect
        self._serial = serial
        self._lock = threading.Lock()
        self.ping_timeout = ping_timeout
        self.io_timeout = io_timeout

    @contextmanager
    def _session(self, timeout: float) -> Iterator[socket.socket]:
        if self._serial:
            with self._lock:
                s = self._connect()
                s.settimeout(timeout)
                yield s
            return
        try:
            s = self._connect()
        except OSError as e:
            raise AgentError(f"cannot reach the agent: {e.strerror or e}") from None
        try:
            s.settimeout(timeout)
            yield s
        finally:
            s.close()

    def _simple(self, kind: bytes, payload: bytes, expect: bytes, timeout: float) -> bytes:
        try:
            with self._session(timeout) as s:
                s.sendall(encode_frame(kind, payload))
                rk, rp = recv_frame(s)
        except (OSError, TimeoutError) as e:
            raise AgentError(f"agent request failed: {e}") from None
        if rk == b"F":
            raise AgentError(rp.decode(errors="replace"))
        if rk != expect:
            raise AgentError(f"unexpected reply {rk!r}")
        return rp

    def ping(self, timeout: float | None = None) -> str:
        return self._simple(b"P", b"", b"p", timeout or self.ping_timeout).decode(errors="replace")

    def set_env(self, env: dict[str, str]) -> None:
        for k in env:
            if not k or "=" in k:
                raise AgentError(f"bad env name {k!r}")
        self._simple(b"V", _fields(*(f"{k}={v}" for k, v in env.items())), b"k", self.io_timeout)

    def set_env_when_up(self, env: dict[str, str], timeout: float, starting: Callable[[], bool],
                        watch_fd: int | None = None) -> None:
        """set_env as the first request to an agent that may not be accepting yet (the namespace
        backend makes its listening socket, so connect succeeds at once): one connection,
        waited on up to timeout while starting() says the sandbox is still coming up —
        asked when watch_fd (its stderr) is readable and every 0.25 s. It is the readiness
        probe too: no ping, no retries that leave the agent dead connections."""
        for k in env:
            if not k or "=" in k:
                raise AgentError(f"bad env name {k!r}")
        deadline = time.monotonic() + timeout
        try:
            with self._session(timeout) as s:
                s.sendall(encode_frame(b"V", _fields(*(f"{k}={v}" for k, v in env.items()))))
                watched = [s] if watch_fd is None else [s, watch_fd]
                while s not in select.select(watched, [], [], 0.25)[0]:
                    if not starting():
                        raise AgentError("the sandbox exited")
                    if time.monotonic() > deadline:
                        raise AgentError("no answer")
                s.settimeout(max(0.05, deadline - time.monotonic()))
                rk, rp = recv_frame(s)
        except (OSError, TimeoutError) as e:
            raise AgentError(f"agent request failed: {e}") from None
        if rk == b"F":
            raise AgentError(rp.decode(errors="replace"))
        if rk != b"k":
            raise AgentError(f"unexpected reply {rk!r}")

    def write_file(self, path: str, data: bytes, mode: int = 0o644) -> None:
        self._simple(b"W", _fields(path, format(mode, "o")) + data, b"k", self.io_timeout)

    def read_file(self, path: str, max_bytes: int = MAX_FRAME) -> bytes:
        return self._simple(b"G", _fields(path, str(max_bytes)), b"D", self.io_timeout)

    def exec(self, argv: list[str], timeout: float = 30.0, env: dict[str, str] | None = None,
             stdin: bytes = b"", cwd: str = "/workspace", on_output: OutputHook | None = None) -> ExecResult:
        """on_output("stdout"|"stderr", chunk) as each frame arrives (the result still holds it all)."""
        req = encode_frame(b"E", encode_exec(list(argv), timeout, env or {}, cwd))
        t0 = time.monotonic()
        out, err = bytearray(), bytearray()
        try:
            with self._session(timeout + GRACE_S) as s:
                s.sendall(req)
                # stdin from a thread: a child that writes before reading must not deadlock us
                sender = threading.Thread(target=self._send_stdin, args=(s, stdin), daemon=True)
                sender.start()
                deadline = t0 + timeout + GRACE_S
                try:
                    while True:
                        # per-recv socket timeouts alone would let a trickling agent hold us forever
                        if time.monotonic() > deadline:
                            raise AgentError(f"exec did not finish within {timeout + GRACE_S:.0f}s")
                        kind, payload = recv_frame(s)
                        if kind == b"O":
                            _append_capped(out, payload)
                            if on_output is not None:
                                on_output("stdout", payload)
                        elif kind == b"R":
                            _append_capped(err, payload)
                            if on_output is not None:
                                on_output("stderr", payload)
                        elif kind == b"X":
                            break
                        elif kind == b"S":
                            continue     # the child's pid (used by exec_stream)
                        elif kind == b"F":
                            raise AgentError(payload.decode(errors="replace"))
                        else:
                            raise AgentError(f"unexpected frame {kind!r}")
                finally:
                    sender.join(timeout=1.0)
        except (OSError, TimeoutError) as e:
            raise AgentError(f"exec failed: {e}") from None
        parts = payload.split(b"\0")
        try:
            code, timed_out = int(parts[0]), parts[1] == b"1"
        except (ValueError, IndexError):
            raise AgentError("malformed exit frame") from None
        return ExecResult(exit_code=code, stdout=bytes(out), stderr=bytes(err), timed_out=timed_out,
                          duration_s=time.monotonic() - t0)

    # -- agent 2: streamed execs, signals, filesystem (PROTOCOL.md) -------------------------
    def exec_stream(self, argv: list[str], timeout: float, env: dict[str, str] | None = None,
                    cwd: str = "/workspace") -> "ExecStream":
        """Start a command and return its live connection (pid, frames, stdin). Unix-socket
        agents only: on a serial agent the stream would hold the port for the command's life."""
        if self._serial:
            raise AgentError("streamed execs need a connection per request (not a serial agent)")
        payload = encode_exec(list(argv), timeout, env or {}, cwd)
        try:
            # 'e' (agent 3): no cap on the output over the command's life — a long-lived
            # process (the code interpreter's kernel) must not go deaf after 16 MiB; the
            # reader bounds what it keeps. An agent 2 refuses it: 'E', capped, as before.
            return self._open_stream(encode_frame(b"e", payload))
        except AgentError as e:
            if "unknown request" not in str(e):
                raise
        return self._open_stream(encode_frame(b"E", payload))

    def _open_stream(self, req: bytes) -> "ExecStream":
        try:
            s = self._connect()
        except OSError as e:
            raise AgentError(f"cannot reach the agent: {e.strerror or e}") from None
        try:
            s.settimeout(self.io_timeout)
            s.sendall(req)
            kind, payload = recv_frame(s)
            if kind == b"F":
                raise AgentError(payload.decode(errors="replace"))
            if kind != b"S":
                raise AgentError(f"agent sent {kind!r} before the pid: agent 2 needed (rebuild it)")
            pid = int(payload.split(b"\0")[0])
        except (OSError, ValueError) as e:
            s.close()
            raise AgentError(f"exec failed: {e}") from None
        except BaseException:
            s.close()
            raise
        s.settimeout(None)
        return ExecStream(s, pid)

    def signal(self, pid: int, signo: int) -> None:
        self._simple(b"K", _fields(str(int(pid)), str(int(signo))), b"k", self.io_timeout)

    def stat(self, path: str) -> dict:
        entries = parse_entries(self._simple(b"T", _fields(path), b"D", self.io_timeout))
        if len(entries) != 1:
            raise AgentError("malformed stat answer")
        return entries[0]

    def list_dir(self, path: str, depth: int = 1) -> list[dict]:
        return parse_entries(self._simple(b"L", _fields(path, str(int(depth))), b"D", self.io_timeout))

    def make_dir(self, path: str) -> bool:
        """True: created; False: it was a directory already."""
        return self._simple(b"M", _fields(path), b"k", self.io_timeout) == b"1"

    def rename(self, src: str, dst: str) -> None:
        self._simple(b"N", _fields(src, dst), b"k", self.io_timeout)

    def remove(self, path: str) -> None:
        self._simple(b"U", _fields(path), b"k", self.io_timeout)

    def write_at(self, path: str, offset: int, data: bytes) -> None:
        self._simple(b"A", _fields(path, str(int(offset))) + data, b"k", self.io_timeout)

    def read_at(self, path: str, offset: int, max_bytes: int = FILE_CHUNK) -> bytes:
        return self._simple(b"H", _fields(path, str(int(offset)), str(int(max_bytes))), b"D", self.io_timeout)

    def write_large(self, path: str, data: bytes, mode: int = 0o644) -> None:
        """Any size: the first chunk replaces the file (W), the rest is written at offsets (A)."""
        self.write_file(path, data[:FILE_CHUNK], mode)
        for off in range(FILE_CHUNK, len(data), FILE_CHUNK):
            self.write_at(path, off, data[off:off + FILE_CHUNK])

    def read_large(self, path: str, max_bytes: int) -> bytes:
        """Up to max_bytes in FILE_CHUNK reads; AgentError if the file is larger."""
        out = bytearray()
        while True:
            chunk = self.read_at(path, len(out), FILE_CHUNK)
            out += chunk
            if len(out) > max_bytes:
                raise AgentError(f"file larger than {max_bytes} bytes")
            if len(chunk) < FILE_CHUNK:
                return bytes(out)

    @staticmethod
    def _send_stdin(s, data: bytes) -> None:
        with suppress(OSError):
            for i in range(0, len(data), STDIN_CHUNK):
                s.sendall(encode_frame(b"I", data[i:i + STDIN_CHUNK]))
            s.sendall(encode_frame(b"i"))


ENTRY_FIELDS = ("name", "type", "is_link", "size", "mode", "mtime_s", "mtime_ns", "uid", "gid", "target")
_TYPES = {"f": "file", "d": "dir", "l": "symlink", "o": "other"}


def parse_entries(payload: bytes) -> list[dict]:
    """The entry records of a 'T'/'L' answer (10 NUL-terminated fields each)."""
    parts = payload.split(b"\0")
    if parts and parts[-1] == b"":
        parts.pop()
    n = len(ENTRY_FIELDS)
    if len(parts) % n:
        raise AgentError("malformed entry list")
    out = []
    for i in range(0, len(parts), n):
        f = dict(zip(ENTRY_FIELDS, (p.decode("utf-8", "surrogateescape") for p in parts[i:i + n])))
        try:
            out.append({"name": f["name"], "type": _TYPES.get(f["type"], "other"), "is_link": f["is_link"] == "1",
                        "size": int(f["size"]), "mode": int(f["mode"]),
                        "mtime": int(f["mtime_s"]) + int(f["mtime_ns"]) / 1e9,
                        "uid": int(f["uid"]), "gid": int(f["gid"]), "target": f["target"]})
        except ValueError:
            raise AgentError("malformed entry") from None
    return out


class ExecStream:
    """One running command's agent connection: read frames, send stdin, close. Sends are
    locked (stdin and close come from other threads than the reader)."""

    def __init__(self, sock: socket.socket, pid: int):
        self.sock, self.pid = sock, pid
        self._send_lock = threading.Lock()
        self._stdin_open = True

    def recv(self) -> tuple[bytes, bytes]:
        """The next frame: (b"O"|b"R", data) or (b"X", b"code\0timed_out\0"); AgentError when gone."""
        try:
            return recv_frame(self.sock)
        except (OSError, TimeoutError) as e:
            raise AgentError(f"exec stream broke: {e}") from None

    def send_stdin(self, data: bytes) -> None:
        with self._send_lock:
            if not self._stdin_open:
                raise AgentError("stdin is closed")
            try:
                for i in range(0, len(data), STDIN_CHUNK):
                    self.sock.sendall(encode_frame(b"I", data[i:i + STDIN_CHUNK]))
            except OSError as e:
                raise AgentError(f"stdin failed: {e}") from None

    def close_stdin(self) -> None:
        with self._send_lock:
            if self._stdin_open:
                self._stdin_open = False
                with suppress(OSError):
                    self.sock.sendall(encode_frame(b"i"))

    def close(self) -> None:
        """Closing the connection kills the command's process group (agent side)."""
        with suppress(OSError):
            self.sock.close()


def unix_connector(path: str) -> Callable[[], socket.socket]:
    def connect() -> socket.socket:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(5.0)
        try:
            s.connect(path)
        except OSError:
            s.close()
            raise
        return s
    return connect


def _append_capped(buf: bytearray, data: bytes) -> None:
    """Bound what the daemon holds per exec stream; the rest is dropped and said so once."""
    room = MAX_STREAM - len(buf)
    if room >= len(data):
        buf += data
    elif room > -1:
        buf += data[:max(0, room)]
        buf += b"\n[cubegate: output truncated at 16 MiB]\n"
