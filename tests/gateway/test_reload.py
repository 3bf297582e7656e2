"""Hot reload against the running gateway process: file change, SIGHUP, broken file."""
from __future__ import annotations

import re
import signal
import time

import pytest

from tests.gateway.harness import Gateway

pytestmark = pytest.mark.netns

BASE = """\
name: reload-test
default: deny
rules:
  - name: api
    action: allow
    match: {hosts: [api.allowed.test]}
"""
WITH_GITHUB = BASE + """\
  - name: github
    action: allow
    match: {hosts: ["*.github.test"]}
"""


def _eventually(fn, timeout=5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if fn():
            return True
        time.sleep(0.1)
    return False


def _metric(gw, pattern: str) -> float:
    import re
    m = re.search(pattern + r" ([0-9.e+]+)", gw.ops_status("/metrics")[1])
    return float(m.group(1)) if m else 0.0


def _ok_reloads(gw) -> float:
    return _metric(gw, r'cubegate_policy_reloads_total\{result="ok"\}')


def _workers(gw) -> int:
    return int(_metric(gw, r"cubegate_workers_ready"))


@pytest.fixture
def rgw(lab, tmp_path):
    gw = Gateway(lab, tmp_path, {"p.yaml": BASE}, settings_extra={"policy_poll_seconds": 60})
    yield gw
    gw.stop()


def test_readyz_is_never_200_before_the_gateway_is_up(rgw):
    rgw.start(wait_ready=False)
    codes = []
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        code, body = rgw.ops_status("/readyz")
        codes.append(code)
        if code == 200:
            break
        time.sleep(0.05)
    assert codes[-1] == 200, rgw.log()
    assert all(c in (0, 503) for c in codes[:-1]), codes
    # And the proxy really serves once ready.
    assert rgw.curl("https://api.allowed.test/").status == 200


def test_sighup_reload_broken_file_keeps_old_policy(rgw):
    rgw.start()
    assert rgw.curl("https://x.github.test/").connect_status == 403
    assert _workers(rgw) >= 1 and _ok_reloads(rgw) == 0
    (rgw.policy_dir / "p.yaml").write_text(WITH_GITHUB)
    rgw.proc.send_signal(signal.SIGHUP)
    # every process has reloaded it (the daemon and each worker count their reloads): one
    # worker's 200 alone would let a slower one read the broken file below as its first reload
    assert _eventually(lambda: _ok_reloads(rgw) >= 1 + _workers(rgw)), rgw.ops_status("/metrics")[1][-3000:]
    assert rgw.curl("https://x.github.test/").status == 200

    # Broken file: the old policy stays in force, the reason is visible.
    (rgw.policy_dir / "p.yaml").write_text(WITH_GITHUB + "  - name: [unclosed\n")
    rgw.proc.send_signal(signal.SIGHUP)
    assert _eventually(lambda: "last reload failed" in rgw.ops_status("/readyz")[1]), rgw.log()   # it was tried
    assert rgw.curl("https://x.github.test/").status == 200
    assert rgw.curl("https://denied.test/").connect_status == 403
    code, body = rgw.ops_status("/readyz")
    assert code == 200 and "last reload failed" in body and "p.yaml:" in body
    code, metrics = rgw.ops_status("/metrics")
    assert 'cubegate_policy_reloads_total{result="error"}' in metrics
    assert "p.yaml:" in rgw.log()


def test_file_change_is_picked_up_without_signal(lab, tmp_path):
    gw = Gateway(lab, tmp_path, {"p.yaml": BASE}, settings_extra={"policy_poll_seconds": 0.2})
    gw.start()
    try:
        assert gw.curl("https://x.github.test/").connect_status == 403
        (gw.policy_dir / "p.yaml").write_text(WITH_GITHUB)
        assert _eventually(lambda: gw.curl("https://x.github.test/").status == 200)
    finally:
        gw.stop()


def test_gateway_refuses_to_start_on_invalid_policy(lab, tmp_path):
    gw = Gateway(lab, tmp_path, {"p.yaml": "egress: {allowed_domains: ['api.*.test']}\n"})
    gw.start(wait_ready=False)
    gw.proc.wait(30)
    assert gw.proc.returncode != 0
    assert "p.yaml:1" in gw.log()


def _many_rules(n: int) -> str:
    return "name: reload-test\ndefault: deny\nrules:\n" + "".join(
        f"  - name: r{i}\n    action: allow\n    match: {{hosts: [h{i}.allowed.test], methods: [GET], paths: [/v{i}]}}\n"
        for i in range(n))


def _digest(gw) -> str:
    return re.search(r"digest ([0-9a-f]{12})", gw.ops_status("/readyz")[1]).group(1)


def test_a_large_policy_file_reloads_without_stalling_the_loop(rgw):
    """The daemon parses a reloaded file off its event loop: /healthz (answered by that loop)
    keeps answering quickly while 2,000 rules are parsed, and the new policy is then in force."""
    rgw.start()
    before = _digest(rgw)
    (rgw.policy_dir / "p.yaml").write_text(_many_rules(2000))
    healthz = f"http://127.0.0.1:{rgw.ops_port}/healthz"
    rgw.proc.send_signal(signal.SIGHUP)
    t0, answers = time.monotonic(), []
    while time.monotonic() - t0 < 60:
        # curl's own time: connect to answer, i.e. how long the loop took, not curl's start-up
        r = rgw.lab.curl("-s", "-o", "/dev/null", "-w", "%{http_code} %{time_total}", healthz,
                         cacert=False, lab_dns=False)
        code, seconds = r.stdout.split()
        answers.append((int(code), float(seconds)))
        if _digest(rgw) != before:
            break
    reload_seconds = time.monotonic() - t0
    assert _digest(rgw) != before, "the large policy never came into force"
    assert all(code == 200 for code, _ in answers), answers
    slowest = max(s for _, s in answers)
    # the parse is what a stalled loop would wait for: an answer must take a small part of it
    assert len(answers) >= 2 and slowest < max(0.25, reload_seconds / 4), (slowest, reload_seconds, answers)


def _connect_answer(gw, host: str) -> tuple[int, float]:
    """One explicit CONNECT (the workers' fast path): its status and how long the proxy took to
    answer it, measured from the connect to the status line (no client start-up in it)."""
    import base64
    import socket
    auth = base64.b64encode(f"sb-1:{gw.tokens['sb-1']}".encode()).decode()

    def probe():
        t0 = time.monotonic()
        with socket.create_connection(("127.0.0.1", gw.proxy_port), timeout=10) as s:
            s.sendall(f"CONNECT {host}:443 HTTP/1.1\r\nHost: {host}:443\r\n"
                      f"Proxy-Authorization: Basic {auth}\r\n\r\n".encode())
            head = b""
            while b"\r\n" not in head:
                chunk = s.recv(4096)
                if not chunk:
                    break
                head += chunk
            return int(head.split()[1]), time.monotonic() - t0
    return gw.lab.call_gw(probe, timeout=15)


def test_a_large_policy_file_reloads_without_stalling_the_workers(rgw):
    """Each worker parses a reloaded file off its event loop: CONNECTs (answered by the workers'
    loops) keep being answered quickly while 2,000 rules are parsed, and then the new policy
    (which allows x.github.test) is in force in every worker."""
    rgw.start()
    workers = _workers(rgw)
    assert workers >= 1 and _connect_answer(rgw, "x.github.test")[0] == 403
    (rgw.policy_dir / "p.yaml").write_text(WITH_GITHUB + _many_rules(2000).split("rules:\n", 1)[1])
    rgw.proc.send_signal(signal.SIGHUP)
    t0, answers = time.monotonic(), []
    while time.monotonic() - t0 < 60:
        answers.append(_connect_answer(rgw, "x.github.test"))
        if _ok_reloads(rgw) >= 1 + workers:   # the daemon's and every worker's
            break
    reload_seconds = time.monotonic() - t0
    assert _ok_reloads(rgw) >= 1 + workers, (rgw.log(), answers)
    assert all(code in (200, 403) for code, _ in answers), answers
    slowest = max(s for _, s in answers)
    # a stalled loop would hold a CONNECT for a whole parse: an answer must take a small part of it
    assert len(answers) >= 3 and slowest < max(0.25, reload_seconds / 4), (slowest, reload_seconds, answers)
    after = [_connect_answer(rgw, "x.github.test")[0] for _ in range(4 * workers)]
    assert after == [200] * len(after), after
