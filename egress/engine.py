"""mitmproxy as an embedded engine: a lean Master with only the addons we need.

About 40% less CPU per request than DumpMaster's default addon set (design.md).
connection_strategy MUST be lazy: eager opens the upstream before the
ClientHello and an SNI-based deny would come too late.
"""
from __future__ import annotations

import logging

from mitmproxy import options
from mitmproxy.addons import core, errorcheck, next_layer, proxyserver, tlsconfig
from mitmproxy.master import Master

from egress import hook_guard, log_redact, mitm_internals
from egress.drain import DrainAddon


def build_master(
    *,
    gate,
    listen_host: str,
    explicit_port: int | None,
    transparent_port: int | None,
    confdir: str,
    upstream_ca_bundle: str | None,
    idle_timeout: int | None = None,
    extra_addons: tuple = (),
    own_listeners: bool = True,
) -> Master:
    """own_listeners=False: mitmproxy binds nothing; the fast path (egress/fastpath/) accepts
    every connection and hands it the ones it must see (mitm_internals.hand_over)."""
    if not hook_guard.guarded(gate):
        raise TypeError("the gate's hooks must fail closed (egress.hook_guard.fail_closed)")
    mitm_internals.install_safe_error_pages()   # no error page quotes the bytes that failed
    mitm_internals.install_trailer_refusal()     # HTTP/1 trailers are refused, never a hung connection
    # request line + headers: bounded in size, and each head in time from its first byte
    mitm_internals.install_head_limit(gate.max_header_bytes + 16 * 1024, gate.header_timeout)
    mitm_internals.install_client_hello_bound(max(gate.max_header_bytes, 16 * 1024 + 5))   # the fast path's
    mitm_internals.install_hook_queue_bound()    # a client is not read while a hook holds too much of it
    mitm_internals.install_websocket_control_scrub()   # ping/pong payloads and close reasons cross empty
    mitm_internals.install_hpack_table_cap()     # a peer's huge HPACK table does not make us keep headers
    # one WebSocket message is held whole (its check needs it): at most what a sandbox may hold at once
    mitm_internals.install_websocket_message_bound(gate.body_limits.max_buffered_bytes_per_sandbox)
    log_redact.install()                         # no engine log line does either
    mitm_internals.install_fast_message_check()  # the same type check of each message, ~4x cheaper
    mitm_internals.install_cheap_option_reads()  # an option read copies only what is mutable
    mitm_internals.install_fast_header_lookups() # Headers get / in / get_all: same answers, no mixins
    mitm_internals.install_cached_hook_args()    # a hook's field names read once per hook class
    opts = options.Options()
    master = Master(opts, with_termlog=False)
    mitm_internals.install_hook_table(master)    # each hook's implementers found once, not per event
    # Order matters: our gate sees tls_clienthello before tlsconfig, and
    # next_layer after NextLayer has picked a layer.
    master.addons.add(
        core.Core(),
        proxyserver.Proxyserver(),
        next_layer.NextLayer(),
        gate,
        tlsconfig.TlsConfig(),
        DrainAddon(),                 # in-flight tracking for the SIGTERM drain (egress/drain.py)
        *extra_addons,
        errorcheck.ErrorCheck(),
    )
    modes = []
    if explicit_port is not None and own_listeners:
        modes.append(f"regular@{listen_host}:{explicit_port}")
    if transparent_port is not None and own_listeners:
        modes.append(f"transparent@{listen_host}:{transparent_port}")
    update = dict(
        mode=modes,
        connection_strategy="lazy",
        confdir=confdir,
        upstream_cert=False,          # never contact upstream before the decision
        ssl_insecure=False,           # upstream TLS is always verified
        http2=True,
        http3=False,
        rawtcp=True,
    )
    if idle_timeout:
        update["tcp_timeout"] = int(idle_timeout)   # inactivity only: a trickle resets it
    if upstream_ca_bundle:
        update["ssl_verify_upstream_trusted_ca"] = upstream_ca_bundle
    opts.update(**update)
    logging.getLogger("mitmproxy").setLevel(logging.WARNING)
    return master


def listeners_bound(master: Master) -> tuple[bool, str]:
    ps = master.addons.get("proxyserver")
    if ps is None:
        return False, "no proxyserver addon"
    servers = list(ps.servers)
    if not servers:
        return False, "no listeners configured"
    down = [str(s.mode.full_spec) for s in servers if not s.is_running]
    if down:
        return False, f"not listening: {', '.join(down)}"
    return True, ", ".join(f"{a[0]}:{a[1]}" for s in servers for a in s.listen_addrs)


LISTEN_BACKLOG = 4096


async def widen_listen_backlog(master: Master, backlog: int = LISTEN_BACKLOG, timeout: float = 30.0) -> int:
    """Raise the proxy listeners' accept backlog (asyncio's default is 100).

    With 100, a burst of connects overflows the accept queue: the kernel drops the
    handshake's last ACK, the client believes it is connected, and the gateway
    never sees the connection (measured: ~150 of 10k idle connects lost). listen()
    again on a listening socket only changes the backlog (capped by net.core.somaxconn).
    """
    import asyncio
    import os
    import socket

    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not listeners_bound(master)[0] and loop.time() < deadline:
        await asyncio.sleep(0.05)
    done = 0
    for tsock in mitm_internals.listening_sockets(master):
        dup = socket.socket(fileno=os.dup(tsock.fileno()))
        try:
            dup.listen(backlog)
            done += 1
        finally:
            dup.close()
    return done
