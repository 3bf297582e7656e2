"""Byte-level proxy clients for attack shapes curl will not produce.

Run them inside the lab's gw namespace with lab.call_gw(fn, ...).
"""
from __future__ import annotations

import base64
import socket
import ssl
import time


def auth_header(sandbox: str, token: str) -> str:
    return "Proxy-Authorization: Basic " + base64.b64encode(f"{sandbox}:{token}".encode()).decode()


def recv_all(sock: socket.socket, timeout: float = 5.0, limit: int = 1 << 20) -> bytes:
    sock.settimeout(timeout)
    chunks = []
    total = 0
    try:
        while total < limit:
            data = sock.recv(65536)
            if not data:
                break
            chunks.append(data)
            total += len(data)
    except (socket.timeout, ConnectionResetError):
        pass
    return b"".join(chunks)


def send_raw(port: int, payload: bytes, timeout: float = 5.0) -> bytes:
    """Send bytes to the proxy, return everything it answers until it closes or goes quiet."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(payload)
        return recv_all(s, timeout)


def connect_tunnel(port: int, target: str, auth: str, timeout: float = 5.0) -> tuple[socket.socket, bytes]:
    s = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    s.sendall(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n{auth}\r\n\r\n".encode())
    s.settimeout(timeout)
    return s, read_head(s)


def read_head(sock: socket.socket, limit: int = 65536) -> bytes:
    """Bytes up to the end of an HTTP response head (or EOF / limit)."""
    head = b""
    while b"\r\n\r\n" not in head and len(head) <= limit:
        data = sock.recv(4096)
        if not data:
            break
        head += data
    return head


def connect_status(head: bytes) -> int:
    try:
        return int(head.split(b" ", 2)[1])
    except (IndexError, ValueError):
        return 0


def tls_through_tunnel(port: int, target: str, auth: str, *, sni: str | None, cafile: str | None,
                       request: bytes | None = None, timeout: float = 5.0) -> dict:
    """CONNECT, then a TLS handshake with the given SNI; returns what happened."""
    s, head = connect_tunnel(port, target, auth, timeout)
    out: dict = {"connect_status": connect_status(head)}
    if out["connect_status"] != 200:
        s.close()
        return out
    ctx = ssl.create_default_context(cafile=cafile) if cafile else ssl._create_unverified_context()
    if not cafile:
        ctx.check_hostname = False
    try:
        with ctx.wrap_socket(s, server_hostname=sni) as tls:
            out["handshake"] = "ok"
            cert = tls.getpeercert(binary_form=True)
            out["peer_cert_der"] = cert
            if request:
                tls.sendall(request)
                out["response"] = recv_all(tls, timeout)
    except (ssl.SSLError, OSError) as e:
        out["handshake"] = f"failed: {type(e).__name__}: {e}"
    finally:
        s.close()
    return out


def slow_clients(port: int, n: int, hold_seconds: float) -> int:
    """Open n connections that send a partial request line and stall; return how many opened."""
    socks = []
    try:
        for _ in range(n):
            s = socket.create_connection(("127.0.0.1", port), timeout=2)
            s.sendall(b"GET http://api.allowed.test/ HTTP/1.1\r\nHost: api.al")
            socks.append(s)
        time.sleep(hold_seconds)
        return len(socks)
    finally:
        for s in socks:
            s.close()


def h2_request(sock, headers: list[tuple[str, str]], body: bytes = b"", timeout: float = 5.0) -> dict:
    """One HTTP/2 request on an already negotiated h2 socket, headers sent exactly as given
    (pseudo-headers included, no validation: for :authority/host attacks).

    Returns {"status", "headers", "data", "informational", "wire", "reset", "goaway", "all_headers"}
    (headers: the final response's, without pseudo-headers, then its trailers; all_headers: every
    header block decoded, 1xx and trailers included); status 0 if no final response arrived
    (reset, GOAWAY, close or timeout).
    """
    out = h2_session(sock, [{"headers": headers, "body": body}], timeout)
    st = next(iter(out["streams"].values()))
    return {"status": st["status"], "headers": [h for h in st["headers"] if not h[0].startswith(":")] + st["trailers"],
            "data": st["data"], "informational": st["informational"], "wire": out["wire"], "reset": st["reset"],
            "goaway": out["goaway"], "all_headers": st["all_headers"]}


def h2_session(sock, streams: list[dict], timeout: float = 5.0, pace: float = 0.0) -> dict:
    """Open every stream on an already negotiated h2 socket (its "headers" sent exactly as given,
    an optional "body", optional "trailers"; `pace` seconds apart) and collect the answers until
    every stream ended, was reset or the connection went away (bounded by `timeout`).

    Returns {"streams": {sid: {"status", "headers", "trailers", "data", "reset", "informational",
    "all_headers"}}, "goaway", "wire"}: headers of the final response (pseudo-headers included),
    informational 1xx statuses, all_headers every header block decoded (1xx and trailers too).
    """
    import h2.config
    import h2.connection
    import h2.events
    import h2.exceptions

    conn = h2.connection.H2Connection(h2.config.H2Configuration(
        client_side=True, header_encoding="utf-8", validate_outbound_headers=False,
        normalize_outbound_headers=False, validate_inbound_headers=False))
    conn.initiate_connection()
    sock.sendall(conn.data_to_send())
    out: dict = {"streams": {}, "goaway": None, "wire": b""}
    for spec in streams:
        sid = conn.get_next_available_stream_id()
        body, trailers = spec.get("body", b""), spec.get("trailers")
        conn.send_headers(sid, spec["headers"], end_stream=not body and not trailers)
        if body:
            conn.send_data(sid, body, end_stream=not trailers)
        if trailers:
            conn.send_headers(sid, trailers, end_stream=True)
        out["streams"][sid] = {"status": 0, "headers": [], "trailers": [], "data": b"", "reset": None, "done": False,
                               "informational": [], "all_headers": []}
        if pace:
            sock.sendall(conn.data_to_send())
            time.sleep(pace)
    sock.sendall(conn.data_to_send())
    wire = bytearray()
    sock.settimeout(0.5)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not all(s["done"] for s in out["streams"].values()):
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            continue
        except OSError:
            break
        if not chunk:
            break
        wire += chunk
        try:
            events = conn.receive_data(chunk)
        except h2.exceptions.ProtocolError:
            break
        for ev in events:
            st = out["streams"].get(getattr(ev, "stream_id", None))
            if isinstance(ev, h2.events.ConnectionTerminated):
                out["goaway"] = ev.error_code
                for s in out["streams"].values():
                    s["done"] = True
            elif st is None:
                continue
            elif isinstance(ev, (h2.events.ResponseReceived, h2.events.InformationalResponseReceived)):
                hdrs = list(ev.headers)
                st["all_headers"] += hdrs
                status = int(dict(hdrs).get(":status", "0"))
                if isinstance(ev, h2.events.InformationalResponseReceived):
                    st["informational"].append(status)
                else:
                    st["headers"], st["status"] = hdrs, status
            elif isinstance(ev, h2.events.TrailersReceived):
                st["trailers"] = list(ev.headers)
                st["all_headers"] += list(ev.headers)
            elif isinstance(ev, h2.events.DataReceived):
                st["data"] += ev.data
                conn.acknowledge_received_data(ev.flow_controlled_length, ev.stream_id)
            elif isinstance(ev, h2.events.StreamEnded):
                st["done"] = True
            elif isinstance(ev, h2.events.StreamReset):
                st["reset"], st["done"] = ev.error_code, True
        pending = conn.data_to_send()
        if pending:
            try:
                sock.sendall(pending)
            except OSError:
                break
    out["wire"] = bytes(wire)
    return out


class WebSocketClient:
    """A WebSocket client (wsproto) over an already connected (TLS) socket."""

    def __init__(self, sock, host: str, path: str, timeout: float = 5.0):
        from wsproto import WSConnection
        from wsproto.connection import ConnectionType
        from wsproto.events import Request

        self.sock, self.timeout = sock, timeout
        self.ws = WSConnection(ConnectionType.CLIENT)
        self.wire = bytearray()            # every byte received (handshake included)
        self.closed = False
        self.close_code = None
        self.accepted = False
        self.rejected_status = None
        self.messages: list[bytes | str] = []
        sock.settimeout(timeout)
        sock.sendall(self.ws.send(Request(host=host, target=path)))
        self._pump(until=lambda: self.accepted or self.closed or self.rejected_status is not None)

    def _pump(self, until) -> None:
        from wsproto.events import (AcceptConnection, BytesMessage, CloseConnection, Ping, RejectConnection,
                                    TextMessage)

        deadline = time.monotonic() + self.timeout
        partial: dict[type, list] = {TextMessage: [], BytesMessage: []}
        while not until() and time.monotonic() < deadline:
            try:
                data = self.sock.recv(65536)
            except (socket.timeout, OSError):
                data = b""
            if not data:
                self.closed = True
                break
            self.wire += data
            try:
                self.ws.receive_data(data)
                events = list(self.ws.events())
            except Exception:  # noqa: BLE001 - a protocol error ends the connection for us
                self.closed = True
                break
            for ev in events:
                if isinstance(ev, AcceptConnection):
                    self.accepted = True
                elif isinstance(ev, RejectConnection):
                    self.rejected_status = ev.status_code
                elif isinstance(ev, (TextMessage, BytesMessage)):
                    partial[type(ev)].append(ev.data)
                    if ev.message_finished:
                        parts = partial[type(ev)]
                        self.messages.append("".join(parts) if isinstance(ev, TextMessage) else b"".join(parts))
                        parts.clear()
                elif isinstance(ev, Ping):
                    self.sock.sendall(self.ws.send(ev.response()))
                elif isinstance(ev, CloseConnection):
                    self.closed, self.close_code = True, ev.code

    def receive(self, count: int) -> list:
        self._pump(until=lambda: len(self.messages) >= count or self.closed)
        return self.messages

    def send(self, message: bytes | str) -> bool:
        from wsproto.events import BytesMessage, TextMessage

        event = TextMessage(data=message) if isinstance(message, str) else BytesMessage(data=message)
        try:
            self.sock.sendall(self.ws.send(event))
            return True
        except OSError:
            self.closed = True
            return False

    def wait_closed(self) -> bool:
        self._pump(until=lambda: self.closed)
        return self.closed
