"""Pure parts of the E2B API: Connect framing, routing, templates, expiry, the process table."""
from __future__ import annotations

import json
import time
import struct

import pytest

from cubegate.e2b import connect as cx
from cubegate.e2b import templates as tpl
from cubegate.e2b.envd import target_of
from cubegate.e2b.registry import E2bSandbox, expired
from sandbox_runtime import processes as pt


def test_envelopes_round_trip_and_end_of_stream_carries_the_error():
    env = cx.envelope({"event": {"start": {"pid": 7}}})
    assert env[0] == 0 and struct.unpack(">I", env[1:5])[0] == len(env) - 5
    assert cx.parse_envelope(env) == {"event": {"start": {"pid": 7}}}
    end = cx.end_of_stream(cx.ConnectError("not_found", "gone"))
    assert end[0] == cx.END_STREAM and json.loads(end[5:]) == {"error": {"code": "not_found", "message": "gone"}}
    assert json.loads(cx.end_of_stream()[5:]) == {}


@pytest.mark.parametrize("body", [b"", b"\x00\x00\x00\x00\x09{}", b"\x01\x00\x00\x00\x02{}", b"\x00\x00\x00\x00\x02[]"])
def test_bad_envelopes_are_refused(body):
    with pytest.raises(cx.ConnectError):
        cx.parse_envelope(body)


def test_timeout_header():
    assert cx.timeout_seconds(None, None) is None and cx.timeout_seconds("1500", None) == 1.5
    with pytest.raises(cx.ConnectError):
        cx.timeout_seconds("-1", None)


def test_target_from_headers_then_host_form_for_the_domain_only():
    assert target_of({"E2b-Sandbox-Id": "abc", "E2b-Sandbox-Port": "49999"}, "d.test") == ("abc", 49999)
    assert target_of({"E2b-Sandbox-Id": "abc"}, None) == ("abc", 49983)
    assert target_of({"Host": "49983-abc1.d.test:3000"}, "d.test") == ("abc1", 49983)
    assert target_of({"Host": "49983-abc1.evil.test"}, "d.test") is None
    assert target_of({"Host": "127.0.0.1:3000"}, "d.test") is None


def test_templates_builtin_settings_and_unknown():
    cat = tpl.catalogue({"big": {"memory_mb": 2048, "backend": "microvm"}})
    assert tpl.resolve(cat, "base").kind == "base"
    assert tpl.resolve(cat, "code-interpreter-v1:latest").kind == "code-interpreter"
    assert tpl.resolve(cat, "big").limits_override() == {"memory_mb": 2048}
    with pytest.raises(tpl.UnknownTemplate):
        tpl.resolve(cat, "nope")


def _sb(sid, end):
    return E2bSandbox(sid, "t", "base", "base", 0.0, end, "tok")


def test_expired_skips_paused_and_future():
    assert expired([_sb("a", 10), _sb("b", 30), _sb("c", 5)], 20, paused={"c"}) == ["a"]


def test_envd_token_is_compared_whole():
    s = _sb("a", 1)
    assert s.token_ok("tok") and not s.token_ok("to") and not s.token_ok(None) and not s.token_ok("")


def test_exit_codes_as_envd_reports_them():
    assert pt.exit_of(b"3\x000\x00") == pt.Exit(3, "exit status 3")
    assert pt.exit_of(b"-9\x000\x00") == pt.Exit(-1, "signal: killed")
    assert pt.exit_of(b"124\x001\x00").error


def test_replay_is_bounded_and_says_so_and_readers_see_everything_once():
    p = pt.Process(5, None, {}, None)
    seen = []
    replay, unsub = p.subscribe(lambda k, d: seen.append((k, d)))
    assert replay == []
    chunk = b"x" * (256 << 10)
    for _ in range(8):                      # 2 MiB written, 1 MiB kept
        p._emit("stdout", chunk)
    assert len(seen) == 8
    late, _ = p.subscribe(lambda k, d: None)
    assert late[0][0] == "stderr" and b"dropped" in late[0][1]
    assert sum(len(d) for k, d in late if k == "stdout") <= pt.REPLAY_BYTES
    p._finish(pt.Exit(0, "exit status 0"))
    assert seen[-1] == ("end", pt.Exit(0, "exit status 0"))
    after, _ = p.subscribe(lambda k, d: None)
    assert after[-1][0] == "end"
    unsub()


def test_table_keeps_a_bounded_number_of_ended_processes():
    t = pt.ProcessTable()
    for pid in range(pt.KEEP_EXITED + 10):
        t.add_finished("sb", pid + 2, {}, b"", b"", pt.Exit(0, "exit status 0"))
    assert len(t._by_sandbox["sb"]) == pt.KEEP_EXITED and t.running("sb") == []
    with pytest.raises(pt.NoSuchProcess):
        t.get("sb", pid=2)
    assert t.get("sb", pid=pt.KEEP_EXITED + 11).exit.exit_code == 0


# ---------------------------------------------------------------- network options (attack pass 2)

from cubegate.e2b.core import E2bError, network_options  # noqa: E402


@pytest.mark.parametrize("network,internet,expected", [
    (None, None, None),
    (None, True, None),
    ({}, None, None),
    (None, False, {"allow": [], "deny": ["*"]}),
    ({"denyOut": ["0.0.0.0/0"]}, None, {"allow": [], "deny": ["*"]}),
    ({"allowOut": ["api.allowed.test"], "denyOut": ["0.0.0.0/0"]}, None, {"allow": ["api.allowed.test"], "deny": []}),
    ({"allowOut": ["api.allowed.test"]}, False, {"allow": ["api.allowed.test"], "deny": []}),
    ({"denyOut": ["198.18.0.0/24", "echo.allowed.test"]}, None,
     {"allow": [], "deny": ["198.18.0.0/24", "echo.allowed.test"]}),
    ({"allowOut": ["1.1.1.1"]}, None, {"allow": ["1.1.1.1"], "deny": []}),      # narrows too
    ({"allowOut": ["0.0.0.0/0"]}, None, {"allow": [], "deny": []}),            # "everything": no narrowing
])
def test_e2b_network_maps_onto_the_narrowing_options(network, internet, expected):
    assert network_options(network, internet) == expected


@pytest.mark.parametrize("network", [{"dnsServers": []}, {"egressProxy": {"address": "p:1080"}},
                                     {"maskRequestHost": "x"}, {"rules": {}}, {"allowOut": "x"}, {"denyOut": [1]}, []])
def test_e2b_network_options_cubegate_cannot_honour_are_refused(network):
    with pytest.raises(E2bError) as e:
        network_options(network, None)
    assert e.value.status == 400


def test_mapped_options_never_widen_the_tenant_policy(tmp_path):
    """What the mapping produces goes through the same narrowing as the runtime API's `network`."""
    from egress.policy import RequestInfo, load_policy_files
    from egress.policy.effective import EffectivePolicy
    from egress.policy.network import parse_network
    p = tmp_path / "p.yaml"
    p.write_text("name: p\ndefault: deny\nrules:\n  - {name: a, action: allow, match: {hosts: [api.allowed.test, "
                 "echo.allowed.test]}}\n")
    admin = load_policy_files([p])

    def allowed(opts, host):
        eff = EffectivePolicy(admin, networks={"sb": parse_network(opts)} if opts else {})
        return eff.decide(RequestInfo("sb", {}, host, 443)).allowed
    only_api = network_options({"allowOut": ["api.allowed.test", "evil.test"], "denyOut": ["0.0.0.0/0"]}, None)
    assert allowed(only_api, "api.allowed.test") and not allowed(only_api, "echo.allowed.test")
    assert not allowed(only_api, "evil.test")                       # named, but the policy denies it
    nothing = network_options(None, False)
    assert not allowed(nothing, "api.allowed.test")
    assert not EffectivePolicy(admin, networks={"sb": parse_network(nothing)}).name_may_resolve(
        "sb", {}, "api.allowed.test")


def test_resume_checks_ownership_before_state(tmp_path):
    """Another tenant's sandbox, paused or running, and a missing id: the same 404."""
    from cubegate.e2b.core import E2bCore
    from cubegate.e2b.registry import Registry
    from sandbox_runtime.backend import Limits
    from sandbox_runtime.capacity import default_budget
    from sandbox_runtime.manager import SandboxManager
    from sandbox_runtime.state import SandboxRecord, StateStore
    state = StateStore(tmp_path / "s.db")
    manager = SandboxManager(switch=None, backends={}, state=state, budget=default_budget(1024, 1.0, 4, 0))
    core = E2bCore(manager, Registry(tmp_path / "e2b"), templates={}, default_backend="namespace",
                   default_limits=Limits(), default_timeout=60, max_timeout=600, domain=None)
    for sid, st in (("a-paused", "paused"), ("a-running", "running")):
        state.put(SandboxRecord(sid, "acme", "namespace", state=st))
        core.registry.put(E2bSandbox(sid, "acme", "base", "base", 0.0, 1e12, "tok"))
    answers = {}
    for sid in ("a-paused", "a-running", "missing"):
        with pytest.raises(E2bError) as e:
            core.resume("beta", sid, None)
        answers[sid] = (e.value.status, e.value.message.replace(sid, "<id>"))
    assert len(set(answers.values())) == 1 and answers["missing"][0] == 404, answers
    with pytest.raises(E2bError) as e:
        core.resume("acme", "a-running", None)
    assert e.value.status == 409
    state.close()


# ---------------------------------------------------------------- daemon-wide bounds (attack pass 2)

def test_the_process_table_holds_bounded_replay_across_all_sandboxes():
    t = pt.ProcessTable(max_total_replay=4 << 20, max_processes=64)
    chunk = b"y" * (256 << 10)
    for sb in range(12):                        # 12 sandboxes x 1 MiB each: 3x the daemon-wide budget
        for pid in range(2):
            p = t.add_finished(f"sb{sb}", pid + 2, {}, b"", b"", pt.Exit(0, "exit status 0"))
            for _ in range(2):
                p._emit("stdout", chunk)
    held = sum(p._bytes for table in t._by_sandbox.values() for p in table.values())
    assert held == t.budget.used
    assert held <= (4 << 20) + 24 * pt.REPLAY_FLOOR + len(chunk)
    t.drop_sandbox("sb0")
    assert t.budget.used == sum(p._bytes for table in t._by_sandbox.values() for p in table.values())


def test_the_process_table_forgets_the_oldest_ended_processes_past_its_daemon_wide_count():
    t = pt.ProcessTable(max_processes=10)
    for sb in range(4):
        for pid in range(3):
            t.add_finished(f"sb{sb}", pid + 2, {}, b"out", b"", pt.Exit(0, "exit status 0"))
    assert sum(len(x) for x in t._by_sandbox.values()) == 10
    assert t.budget.used == 10 * 3
    with pytest.raises(pt.NoSuchProcess):
        t.get("sb0", pid=2)                    # the oldest went first
    assert t.get("sb3", pid=4).exit is not None


def test_lanes_bound_calls_per_key_and_stop_waiting_for_a_gone_client():
    import asyncio
    import threading
    from concurrent.futures import ThreadPoolExecutor
    from cubegate.e2b.lanes import Gone, LaneFull, Lanes

    async def scenario():
        pool = ThreadPoolExecutor(8)
        lanes = Lanes(pool, {"sandbox": 2, "tenant": 6}, max_waiting=3, max_wait=5)
        release = threading.Event()
        stuck = [asyncio.ensure_future(lanes.run([("sandbox", "a"), ("tenant", "t")], release.wait))
                 for _ in range(5)]           # 2 run, 3 wait (no thread held)
        await asyncio.sleep(0.2)
        assert lanes.in_flight("sandbox", "a") == 5
        with pytest.raises(LaneFull):         # waiting room full: answered at once
            await lanes.run([("sandbox", "a"), ("tenant", "t")], lambda: 1)
        # another sandbox of the same tenant is not held up by the stuck one
        assert await asyncio.wait_for(lanes.run([("sandbox", "b"), ("tenant", "t")], lambda: "b"), 2) == "b"
        gone = asyncio.Event()
        waiter = asyncio.ensure_future(lanes.run([("sandbox", "c"), ("tenant", "t")], lambda: 1, gone=gone))
        await asyncio.sleep(0.1)   # sandbox c is free, tenant t has 2 of 6 slots used: it ran
        assert waiter.done()
        release.set()
        await asyncio.gather(*stuck)
        # a client that goes away while its call waits for a slot
        hold = threading.Event()
        first = [asyncio.ensure_future(lanes.run([("sandbox", "d"), ("tenant", "t")], hold.wait)) for _ in range(2)]
        await asyncio.sleep(0.1)
        gone2 = asyncio.Event()
        late = asyncio.ensure_future(lanes.run([("sandbox", "d"), ("tenant", "t")], lambda: 1, gone=gone2))
        await asyncio.sleep(0.1)
        gone2.set()
        with pytest.raises(Gone):
            await asyncio.wait_for(late, 2)
        hold.set()
        await asyncio.gather(*first)
        assert lanes._lanes == {}               # idle lanes are dropped
        pool.shutdown()
    asyncio.run(scenario())


class _FakeKernelProcess:
    """A Process whose 'kernel' is this test: lines in, a request list out (the real kernel
    runs in the lab tests; here the routing of its lines is what is checked)."""

    def __init__(self):
        self.sent, self.fn = [], None

    def subscribe(self, fn):
        self.fn = fn
        return [], lambda: None

    def send_stdin(self, data):
        self.sent.append(data)


def test_a_cell_given_up_on_is_interrupted_and_its_late_output_never_reaches_the_next_cell():
    import threading
    from cubegate.e2b import kernel as kern
    proc, interrupts = _FakeKernelProcess(), []
    s = kern.KernelSession(proc, "\x1eM:", interrupt=lambda: interrupts.append(1))

    def line(doc):
        proc.fn("stdout", ("\x1eM:" + json.dumps(doc) + "\n").encode())
    with pytest.raises(TimeoutError):
        s.execute("while True: pass", {}, lambda i: None, 0.3)
    assert interrupts == [1]
    got = []
    t = threading.Thread(target=lambda: s.execute("40 + 2", {}, got.append, 5))
    t.start()
    time.sleep(0.3)
    assert len(proc.sent) == 1           # the second cell waits until the first one ended
    line({"type": "stdout", "text": "late output of cell 1\n"})
    line({"type": "done", "execution_count": 1})
    deadline = time.monotonic() + 3
    while len(proc.sent) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    line({"type": "result", "text": "42"})
    line({"type": "done", "execution_count": 2})
    t.join(5)
    assert [i["type"] for i in got] == ["result", "number_of_executions"] and got[0]["text"] == "42"


def test_a_cell_over_its_output_bound_answers_an_error(monkeypatch):
    import threading
    from cubegate.e2b import kernel as kern
    monkeypatch.setattr(kern, "MAX_CELL_OUTPUT", 1000)
    proc, interrupts = _FakeKernelProcess(), []
    s = kern.KernelSession(proc, "\x1eM:", interrupt=lambda: interrupts.append(1))
    got = []
    t = threading.Thread(target=lambda: pytest.raises(kern.OutputLimit, s.execute, "spam", {}, got.append, 5))
    t.start()
    time.sleep(0.2)
    for _ in range(5):
        proc.fn("stdout", b"x" * 300 + b"\n")        # raw output (a subprocess on fd 1) counts too
    t.join(5)
    assert not t.is_alive() and interrupts == [1]
    assert got[-1]["type"] == "error" and got[-1]["name"] == "OutputLimitExceeded"
    assert sum(len(i.get("text", "")) for i in got if i["type"] == "stdout") <= 1000
    # an endless line without a newline is passed on in bounded pieces, never buffered whole
    monkeypatch.setattr(kern, "MAX_LINE", 100)
    proc.fn("stdout", b"z" * 450)
    assert len(s._buf) <= 100


def test_a_cell_stops_waiting_for_the_kernel_when_its_client_goes():
    import threading
    from cubegate.e2b import kernel as kern
    proc = _FakeKernelProcess()
    s = kern.KernelSession(proc, "\x1eM:")
    first_cancel, second_cancel = threading.Event(), threading.Event()
    errors = []

    def run(cancel):
        try:
            s.execute("x", {}, lambda i: None, 30, cancel)
        except Exception as e:  # noqa: BLE001
            errors.append(type(e).__name__)
    a = threading.Thread(target=run, args=(first_cancel,))
    a.start()
    time.sleep(0.2)
    b = threading.Thread(target=run, args=(second_cancel,))   # waits on the kernel's lock
    b.start()
    time.sleep(0.2)
    second_cancel.set()
    b.join(2)
    assert not b.is_alive() and errors == ["Cancelled"]
    first_cancel.set()
    a.join(2)
    assert not a.is_alive() and errors == ["Cancelled", "Cancelled"]
