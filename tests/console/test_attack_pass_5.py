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


def test_the_33rd_command_in_ten_minutes_still_runs():
    """FINDING: the console kept finished exec jobs for 10 minutes and refused a new one once 32
    were kept, running or not: an operator's 33rd command in ten minutes got 429 "busy". A new job
    now replaces the oldest finished one; only 32 jobs actually running are refused."""
    import asyncio

    from cubegate.console import exec_jobs

    async def scenario():
        jobs = exec_jobs.ExecJobs(lambda e: "failed")

        async def quick(job):
            return {"exit_code": 0}
        first = [jobs.start("sb-1", "tok", quick) for _ in range(exec_jobs.MAX_JOBS)]
        await asyncio.gather(*(j.task for j in first))
        later = jobs.start("sb-1", "tok", quick)        # the 33rd: runs
        await later.task
        assert later.result == {"exit_code": 0} and jobs.get(first[0].id, "tok") is None
        assert jobs.get(first[-1].id, "tok") is not None      # the newer finished ones are kept

        gate = asyncio.Event()

        async def slow(job):
            await gate.wait()
        running = [jobs.start("sb-1", "tok", slow) for _ in range(exec_jobs.MAX_JOBS)]
        with pytest.raises(OverflowError):
            jobs.start("sb-1", "tok", slow)              # 32 running: refused
        gate.set()
        await asyncio.gather(*(j.task for j in running))
    asyncio.run(scenario())


def test_one_token_logging_in_again_and_again_cannot_log_the_others_out(daemon):
    """FINDING: the console keeps at most 256 sessions and drops the least recently used: a
    read-scope token logging in 256 times ended every operator's session. One actor now holds
    at most 16 sessions (its own oldest goes first); the others' sessions stay."""
    admin = daemon.login()
    for _ in range(300):
        b = Browserish(daemon)
        b.get("/login")
        r = b.post("/login", {"token": daemon.tokens["read"]})
        assert r.status_code == 303, r.status_code
    r = admin.get("/")
    assert r.status_code == 200 and "Overview" in r.text, (r.status_code, r.headers.get("location"))
