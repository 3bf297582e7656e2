"""Pure parts of the E2B API: Connect framing, routing, templates, expiry, the process table."""
from __future__ import annotations

import json
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
