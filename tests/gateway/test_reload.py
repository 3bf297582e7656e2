"""Hot reload against the running gateway process: file change, SIGHUP, broken file."""
from __future__ import annotations

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
    (rgw.policy_dir / "p.yaml").write_text(WITH_GITHUB)
    rgw.proc.send_signal(signal.SIGHUP)
    assert _eventually(lambda: rgw.curl("https://x.github.test/").status == 200)

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
