"""Attack pass 5 on the console: a real `cubegate run` with the console on, plain HTTP as a browser sends it."""
from __future__ import annotations

import pytest

from tests.console.consolekit import Browserish, ConsoleDaemon


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = ConsoleDaemon(tmp_path_factory.mktemp("console-attack5")).start()
    try:
        yield d
    finally:
        d.stop()


def test_failed_logins_by_anyone_do_not_lock_out_a_valid_token(daemon):
    """FINDING: the console counts failed logins for everyone together (all clients are loopback)
    and refused every login, valid tokens included, after 20 in a minute: anyone who can reach the
    port, with no token at all, kept the operators out by sending 20 wrong tokens a minute. The
    limit now slows only wrong tokens (429); a valid one still logs in."""
    b = Browserish(daemon)
    assert b.get("/login").status_code == 200
    statuses = [b.post("/login", {"token": f"cgvt_aaaaaaaaaaaa_{'A' * 42}{i % 10}"}).status_code for i in range(25)]
    assert statuses[:20] == [401] * 20 and set(statuses[20:]) == {429}, statuses
    daemon.login()                                   # the operator's token: 303 and a session
    daemon.login(daemon.tokens["read"])
    r = b.post("/login", {"token": "wrong"})
    assert r.status_code == 429, r.status_code       # wrong tokens are still held off
