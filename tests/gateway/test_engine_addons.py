"""The embedded mitmproxy loads exactly the addons the gateway needs (egress/engine.py).

Each addon in the chain costs on every hook of every flow; mitmproxy's default set
(what mitmdump loads) brings ~30, many of which rewrite or record flows. These pin the
set: a needed one dropped (the options it declares, the hooks it serves) or an
unneeded one back fails here. Driven without a network: the master is built, not run.
"""
from __future__ import annotations

import asyncio

import pytest
from mitmproxy.addons import default_addons
from mitmproxy.proxy.layers.http import HttpRequestHeadersHook
from mitmproxy.test import tflow

from egress import mitm_internals
from egress.drain import DrainAddon
from egress.engine import build_master
from egress.gate import PolicyGate

# In hook order: the gate sees tls_clienthello before TlsConfig and next_layer after NextLayer.
PINNED = ["Core", "Proxyserver", "NextLayer", "PolicyGate", "TlsConfig", "DrainAddon", "ErrorCheck"]


def _gate() -> PolicyGate:
    # The real gate class; nothing it holds is used while the master is only built.
    return PolicyGate(policies=None, identities=None, guard=None, resolver=None, audit=None, metrics=None)


@pytest.fixture
def loop():
    lp = asyncio.new_event_loop()
    yield lp
    lp.close()


@pytest.fixture
def master(tmp_path, loop):
    async def build():
        return build_master(gate=_gate(), listen_host="127.0.0.1", explicit_port=None, transparent_port=None,
                            confdir=str(tmp_path), upstream_ca_bundle=None, own_listeners=False)
    m = loop.run_until_complete(build())
    yield m
    m.addons.clear()


def test_the_chain_is_exactly_the_pinned_set(master):
    assert [type(a).__name__ for a in master.addons.chain] == PINNED


def test_no_default_addon_beyond_the_pinned_ones_is_loaded(master):
    loaded = {type(a) for a in master.addons.chain}
    unneeded = {type(a) for a in default_addons() if type(a).__name__ not in PINNED}
    # the per-flow ones a gateway must not run: they record, replay or rewrite flows
    names = {t.__name__ for t in unneeded}
    assert {"Save", "StickyCookie", "AntiCache", "AntiComp", "ClientPlayback", "ServerPlayback",
            "ModifyHeaders", "MapRemote", "BlockList"} <= names
    assert not loaded & unneeded


def test_the_options_the_gateway_relies_on_are_declared_and_in_force(master, tmp_path):
    o = master.options
    assert o.connection_strategy == "lazy"      # an SNI deny must come before any upstream connection
    assert o.upstream_cert is False and o.ssl_insecure is False    # upstream TLS verified, never pre-contacted
    assert o.http3 is False and o.mode == []    # the fast path owns the listeners here
    assert "body_size_limit" in o and "tcp_timeout" in o     # declared by Proxyserver: it is loaded
    assert o.confdir == str(tmp_path)
    assert (tmp_path / "mitmproxy-ca.pem").exists()   # TlsConfig loaded and made its CA (leaf certs: CertStore)


def test_each_hook_the_gateway_depends_on_reaches_its_addons_in_order(master):
    def who(name):
        return [type(top).__name__ for top, _ in master.addons.implementers(name)]
    assert who("next_layer") == ["NextLayer", "PolicyGate"]
    assert who("tls_clienthello") == ["PolicyGate", "TlsConfig"]
    assert who("tls_start_client")[-1] == "TlsConfig" and "TlsConfig" in who("tls_start_server")
    assert who("server_connect") == ["Proxyserver", "PolicyGate"]   # Proxyserver refuses proxy loops
    assert who("requestheaders") == ["PolicyGate", "DrainAddon"]
    assert who("response") == ["PolicyGate", "DrainAddon"]
    assert who("update") == []                  # no addon keeps a flow list (mitmdump's View does)


def test_the_hook_table_dispatches_like_mitmproxys_own(master):
    assert mitm_internals.hook_dispatch_installed(master)
    from mitmproxy import addonmanager, hooks
    names = sorted(hooks.all_hooks)
    stock = addonmanager.AddonManager.__new__(addonmanager.AddonManager)
    stock.chain = master.addons.chain
    for name in names:
        event = hooks.all_hooks[name]
        probe = event.__new__(event)
        want = [(top, func) for top in stock.chain for _, func in stock._iter_hooks(top, probe)]
        got = [(top, func) for top, funcs in master.addons.implementers(name) for func in funcs]
        assert got == want, name


def test_the_hook_table_follows_a_change_of_the_addon_set(master, loop):
    seen = []

    class Late:
        def requestheaders(self, flow):
            seen.append(flow)

    f = tflow.tflow()
    loop.run_until_complete(master.addons.handle_lifecycle(HttpRequestHeadersHook(f)))  # builds the table
    master.addons.add(Late())
    loop.run_until_complete(master.addons.handle_lifecycle(HttpRequestHeadersHook(f)))
    assert seen == [f]
    master.addons.remove(master.addons.get("late"))
    loop.run_until_complete(master.addons.handle_lifecycle(HttpRequestHeadersHook(f)))
    assert seen == [f]


def test_an_addon_error_is_logged_and_the_next_addon_still_runs(master, loop, caplog):
    order = []

    class Boom:
        def requestheaders(self, flow):
            order.append("boom")
            raise ValueError("boom")

    class After:
        def requestheaders(self, flow):
            order.append("after")

    master.addons.add(Boom(), After())
    loop.run_until_complete(master.addons.handle_lifecycle(HttpRequestHeadersHook(tflow.tflow())))
    assert order == ["boom", "after"]
    # logged by type only: an exception's text may quote what was sent (egress/log_redact.py)
    assert any(r.getMessage() == "Addon error [ValueError]" for r in caplog.records), \
        [r.getMessage() for r in caplog.records]


def test_drain_addon_is_the_gateways_own(master):
    assert isinstance(master.addons.get("cubegate_drain"), DrainAddon)


def test_the_engine_runs_with_the_cheaper_message_check_option_reads_and_header_lookups(master):
    """build_master installs them (egress/mitm_internals.py: same answers, measured cuts)."""
    assert mitm_internals.fast_message_check_installed()
    assert mitm_internals.cheap_option_reads_installed()
    assert mitm_internals.fast_header_lookups_installed()
    assert mitm_internals.cached_hook_args_installed()
    assert master.options.connection_strategy == "lazy"      # read through the cheaper path
