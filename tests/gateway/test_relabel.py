"""A sandbox relabelled while it holds connections (policy by label): each open connection
is re-decided with the new labels, as on a policy change — the ones now denied are closed
(policy_revoked), the ones still allowed stay open. Real gateway; transparent mode through a
cubevs switch. The relabel is `cubegate identity add --replace` from another process, which
re-keys too: an explicit sandbox's open connections were opened with the token it revokes, so
they close (identity_changed) whatever the new labels allow, on the fast path and through
mitmproxy (an intercepted host)."""
from __future__ import annotations

import socket
import ssl
import time

import pytest

from testbed import netns
from tests.gateway import rawclient
from tests.gateway.harness import Gateway
from tests.gateway.switchlab import switch_lab

pytestmark = pytest.mark.netns

TPORT = 18069
API_IP = "198.18.0.10"       # api.allowed.test in the lab
PASS_IP = "198.18.0.11"      # passthrough.allowed.test
TEAM_A = """\
name: team-a
tenant: acme
applies_to: {labels: {team: a}}
default: deny
rules:
  - name: apis
    action: allow
    match: {hosts: [api.allowed.test, passthrough.allowed.test, echo.allowed.test], ports: [443]}
"""
TEAM_B = """\
name: team-b
tenant: acme
applies_to: {labels: {team: b}}
default: deny
rules:
  - name: passthrough-only
    action: allow
    match: {hosts: [passthrough.allowed.test], ports: [443]}
"""


def _hold_then(connect, host: str, cafile: str, change, window: float = 4.0) -> dict:
    """A TLS keep-alive connection to `host` (raw socket from connect()), one answer read,
    then change(); whether the gateway closes it within `window` seconds afterwards."""
    tls = ssl.create_default_context(cafile=cafile).wrap_socket(connect(), server_hostname=host)
    tls.settimeout(5)
    tls.sendall(f"GET /held HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
    first = tls.recv(65536)
    assert first.startswith(b"HTTP/1.1 200"), first[:200]
    change()
    t0 = time.monotonic()
    tls.settimeout(0.5)
    closed = False
    while time.monotonic() - t0 < window and not closed:
        try:
            closed = tls.recv(65536) == b""
        except socket.timeout:
            pass
        except (OSError, ssl.SSLError):      # revoked connections are reset
            closed = True
    tls.close()
    return {"closed": closed, "after_s": round(time.monotonic() - t0, 2)}


def _relabel(gw, sandbox: str, team: str) -> str:
    token = gw.cli("identity", "add", sandbox, "--replace", f"--label=team={team}").strip()
    gw.tokens[sandbox] = token
    return token


def _revoked(gw, sandbox: str, host: str) -> dict:
    return gw.wait_record(lambda r: r.get("reason") == "policy_revoked" and r.get("sandbox") == sandbox
                          and r.get("host") == host)


@pytest.fixture(scope="module")
def egw(lab, tmp_path_factory):
    gw = Gateway(lab, tmp_path_factory.mktemp("relabel"), {"a.yaml": TEAM_A, "b.yaml": TEAM_B},
                 sandboxes={"sb-r1": {"team": "a"}, "sb-r2": {"team": "a"}, "sb-r3": {"team": "a"},
                            "sb-r4": {"team": "a"}})
    gw.cli("vault", "init")
    gw.cli("vault", "secret", "put", "acme", "k", input="relabel-key-5f6e7d8c\n")
    gw.cli("vault", "binding", "add", "--id", "b-echo", "--tenant", "acme", "--secret", "k",
           "--host", "echo.allowed.test", "--port", "443", "--header", "X-Api-Key", "--format", "{secret}")
    gw.start()
    yield gw
    gw.stop()


def _explicit(gw, sandbox: str, host: str):
    def connect():
        s, head = rawclient.connect_tunnel(gw.proxy_port, f"{host}:443", rawclient.auth_header(sandbox, gw.tokens[sandbox]))
        assert rawclient.connect_status(head) == 200, head
        return s
    return connect


def test_explicit_tunnel_the_new_labels_deny_is_closed(egw, lab):
    """An explicit sandbox is relabelled by re-keying it (`identity add --replace`): the token the
    tunnel was opened with is revoked, so the tunnel closes (identity_changed) whatever the labels."""
    out = lab.call_gw(_hold_then, _explicit(egw, "sb-r1", "api.allowed.test"), "api.allowed.test",
                      str(lab.ca.bundle_path), lambda: _relabel(egw, "sb-r1", "b"))
    assert out["closed"] and out["after_s"] < 2.5, out
    rev = _revoked(egw, "sb-r1", "api.allowed.test")
    assert rev["extra"]["denied_by"] == "identity_changed", rev
    r = egw.curl("https://api.allowed.test/", sandbox="sb-r1")
    assert r.connect_status == 403, r           # the new token, the new labels: team b denies it


def test_explicit_tunnel_the_new_labels_allow_is_closed_too_its_token_was_revoked(egw, lab):
    out = lab.call_gw(_hold_then, _explicit(egw, "sb-r2", "passthrough.allowed.test"), "passthrough.allowed.test",
                      str(lab.ca.bundle_path), lambda: _relabel(egw, "sb-r2", "b"))
    assert out["closed"], out
    assert _revoked(egw, "sb-r2", "passthrough.allowed.test")["extra"]["denied_by"] == "identity_changed"
    r = egw.curl("https://passthrough.allowed.test/", sandbox="sb-r2")
    assert r.connect_status == 200, r           # the new token works at once


def test_intercepted_connection_the_new_labels_deny_is_closed(egw, lab):
    out = lab.call_gw(_hold_then, _explicit(egw, "sb-r3", "echo.allowed.test"), "echo.allowed.test",
                      str(egw.ca_cert), lambda: _relabel(egw, "sb-r3", "b"))
    assert out["closed"] and out["after_s"] < 2.5, out
    assert _revoked(egw, "sb-r3", "echo.allowed.test")["extra"]["kind"] == "intercept"


def test_transparent_connection_the_new_labels_deny_is_closed(lab, tmp_path_factory):
    def team_b_too(gw):
        (gw.policy_dir / "b.yaml").write_text(TEAM_B)

    # switch_lab labels its sandbox team=t
    with switch_lab(lab, tmp_path_factory.mktemp("relabel-t"), TEAM_A.replace("team: a}", "team: t}", 1),
                    sandbox="sb-rt", tport=TPORT, prefix="rl", before_start=team_b_too) as (gw, _sw, net):
        def connect():
            return socket.create_connection((API_IP, 443), timeout=5)    # steered to the gateway
        out = netns.call_in_netns(net.netns, _hold_then, connect, "api.allowed.test", str(lab.ca.bundle_path),
                                  lambda: _relabel(gw, "sb-rt", "b"), timeout=30)
        assert out["closed"] and out["after_s"] < 2.5, out
        rev = _revoked(gw, "sb-rt", "api.allowed.test")
        assert rev["extra"]["denied_by"] == "default_deny", rev


def test_transparent_kept_connection_is_decided_with_its_new_labels_on_the_next_policy_change(lab, tmp_path_factory):
    """Kept open on relabel (team b allows it too), then team b's policy stops allowing it: the
    policy change must see the connection's new labels (with the old ones, team t's policy would
    keep it open)."""
    def team_b_too(gw):
        (gw.policy_dir / "b.yaml").write_text(TEAM_B)

    with switch_lab(lab, tmp_path_factory.mktemp("relabel-k"), TEAM_A.replace("team: a}", "team: t}", 1),
                    sandbox="sb-rk", tport=TPORT, prefix="rk", before_start=team_b_too) as (gw, _sw, net):
        b_file = gw.policy_dir / "b.yaml"

        def relabel_then_narrow_team_b():
            _relabel(gw, "sb-rk", "b")
            time.sleep(1.0)                       # the label watch polls every policy_poll_seconds
            b_file.write_text(TEAM_B.replace("[passthrough.allowed.test]", "[api.allowed.test]"))

        def connect():
            return socket.create_connection((PASS_IP, 443), timeout=5)    # steered to the gateway
        out = netns.call_in_netns(net.netns, _hold_then, connect, "passthrough.allowed.test", str(lab.ca.bundle_path),
                                  relabel_then_narrow_team_b, window=6.0, timeout=40)
        assert out["closed"], out
        revoked = [r for r in gw.audit_records() if r.get("sandbox") == "sb-rk" and r.get("reason") == "policy_revoked"
                   and r.get("event") == "decision"]
        # one close, by the narrowing (team b's policy now denies it), none by the relabel itself
        assert len(revoked) == 1 and revoked[0]["extra"]["denied_by"] == "default_deny", revoked
