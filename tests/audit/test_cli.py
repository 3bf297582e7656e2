import json

import pytest
from click.testing import CliRunner

from egress.audit.cli import audit
from egress.audit.log import AuditLog

from ._util import rec


@pytest.fixture
def logged(audit_dir):
    records = [
        rec(sandbox="sb-alpha", host="api.openai.com", port=443, method="POST",
            path="/v1/chat/completions", rule="openai", decision="allow", reason="rule_match"),
        rec(sandbox="sb-b", host="evil.example", port=80, method=None, path=None, rule=None,
            decision="deny", reason="no_rule"),
        rec("connection_closed", sandbox="sb-alpha", host="api.openai.com", port=443,
            decision=None, reason=None, method=None, path=None, rule=None),
    ]
    with AuditLog(audit_dir, fsync="never") as log:
        for r in records:
            log.append(r)
    return audit_dir, records


def run(*args, env=None):
    return CliRunner().invoke(audit, list(args), env=env, catch_exceptions=False)


def test_query_table_is_aligned(logged):
    d, R = logged
    res = run("query", "--dir", str(d), "--order", "asc")
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    assert len(lines) == 4
    header = lines[0]
    for col in ("TS", "SANDBOX", "EVENT", "DECISION", "REASON", "HOST:PORT", "REQUEST", "RULE"):
        assert col in header
    # Every column starts at the same offset on every line.
    for col, value in [("SANDBOX", "sb-alpha"), ("HOST:PORT", "api.openai.com:443"),
                       ("REQUEST", "POST /v1/chat/completions"), ("RULE", "openai")]:
        assert lines[1].rindex(value) == header.index(col)
    assert lines[2].index("evil.example:80") == header.index("HOST:PORT")
    assert lines[2].index("deny") == header.index("DECISION")
    assert "connection_closed" in lines[3]


def test_query_json_and_filters(logged):
    d, R = logged
    res = run("query", "--dir", str(d), "--json", "--sandbox", "sb-alpha", "--order", "asc")
    assert res.exit_code == 0, res.output
    assert [json.loads(x) for x in res.output.splitlines()] == [R[0], R[2]]
    res = run("query", "--dir", str(d), "--json", "--decision", "deny", "--since", "1h")
    assert [json.loads(x)["id"] for x in res.output.splitlines()] == [R[1]["id"]]
    res = run("query", "--dir", str(d), "--json", "--host", "*.openai.com", "--event", "request")
    assert res.output == ""
    res = run("query", "--dir", str(d), "--json", "--limit", "1")
    assert [json.loads(x)["id"] for x in res.output.splitlines()] == [R[2]["id"]]
    res = run("query", "--json", "--reason", "no_rule", env={"CUBEGATE_AUDIT_DIR": str(d)})
    assert [json.loads(x)["id"] for x in res.output.splitlines()] == [R[1]["id"]]


def test_query_read_only_dir_uses_memory_index(logged, monkeypatch):
    d, R = logged
    import egress.audit.cli as cli
    monkeypatch.setattr(cli.os, "access", lambda *a, **k: False)
    res = run("query", "--dir", str(d), "--json")
    assert res.exit_code == 0 and len(res.output.splitlines()) == 3
    assert not (d / cli.INDEX_NAME).exists()


def test_missing_dir_and_bad_time_fail_clearly(tmp_path, monkeypatch):
    res = run("query", "--dir", str(tmp_path / "nope"))
    assert res.exit_code != 0 and "audit directory not found" in res.output
    monkeypatch.delenv("CUBEGATE_AUDIT_DIR", raising=False)
    res = run("tail", env={"CUBEGATE_AUDIT_DIR": str(tmp_path / "gone")})
    assert res.exit_code != 0 and "gone" in res.output
    res = run("query", "--dir", str(tmp_path), "--since", "yesterday")
    assert res.exit_code != 0 and "bad time" in res.output


def test_tail_last_n_with_filters(logged):
    d, R = logged
    res = run("tail", "--dir", str(d), "-n", "2", "--json")
    assert [json.loads(x)["id"] for x in res.output.splitlines()] == [R[1]["id"], R[2]["id"]]
    res = run("tail", "--dir", str(d), "--sandbox", "sb-alpha")
    lines = res.output.splitlines()
    assert res.exit_code == 0 and len(lines) == 3 and lines[0].startswith("TS")


def test_table_escapes_terminal_control_characters_json_stays_exact(audit_dir):
    # A sandbox controls paths, hosts (SNI) and more: none of it may drive the terminal.
    hostile = rec(sandbox="sb-x", host="a\x1b]0;owned\x07.test", sni="s\x9bni", port=443, method="GET",
                  path="/p\x1b[2J\rx\nn\x7f\x85\u202e\u2028\\x1b", rule="r\x00",
                  decision="deny", reason="why\x1b[31m")
    with AuditLog(audit_dir, fsync="never") as log:
        log.append(hostile)
    res = run("query", "--dir", str(audit_dir))
    assert res.exit_code == 0, res.output
    out = res.output
    for raw in ("\x1b", "\r", "\x07", "\x7f", "\x85", "\x9b", "\u202e", "\u2028", "\x00"):
        assert raw not in out, repr(raw)
    lines = out.splitlines()
    assert len(lines) == 2                       # the embedded \n did not start a row
    assert "GET /p\\x1b[2J\\rx\\nn\\x7f\\x85\\u202e\\u2028\\\\x1b" in lines[1]
    assert "a\\x1b]0;owned\\x07.test:443" in lines[1] and "why\\x1b[31m" in lines[1] and "r\\x00" in lines[1]
    # JSON output: valid JSON, ASCII-only escapes, decodes to exactly the stored record.
    res = run("query", "--dir", str(audit_dir), "--json")
    assert "\x1b" not in res.output and "\r" not in res.output
    assert [json.loads(x) for x in res.output.splitlines()] == [hostile]
    # tail prints through the same table code.
    res = run("tail", "--dir", str(audit_dir))
    assert "\x1b" not in res.output and "\\x1b[2J" in res.output


def test_table_keeps_readable_unicode(audit_dir):
    r = rec(host="bücher.example", path="/ünïcode path")
    with AuditLog(audit_dir, fsync="never") as log:
        log.append(r)
    out = run("query", "--dir", str(audit_dir)).output
    assert "bücher.example:443" in out and "/ünïcode path" in out
