"""The CLIs' client of the daemon's loopback APIs (cubegate/api_client.py), against a real HTTP server."""
from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import click
import pytest

from cubegate.api_client import LocalApi, echo_rows

ANSWERS = {
    "/v1/ok": (200, "application/json", b'{"items": [1, 2]}'),
    "/v1/empty": (204, "application/json", b""),
    "/v1/invalid": (400, "application/json", json.dumps({
        "error": "invalid_policy", "message": "2 problem(s); nothing was changed",
        "errors": [{"pointer": "/rules/0/match", "message": "unknown field"}, {"pointer": "", "message": "x"}]}).encode()),
    "/v1/missing": (404, "application/json", b'{"error": "not_found", "message": "no sandbox sb-9"}'),
    "/v1/text": (502, "text/plain", b"E" * 2000),
}


class _Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        status, ctype, body = ANSWERS[self.path]
        self.server.seen.append(self.headers.get("Authorization"))
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def api(tmp_path, monkeypatch):
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    server.seen = []
    t = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)
    t.start()
    (tmp_path / "token").write_text("tok-123\n")
    monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:9")   # a dead proxy: never used for loopback APIs
    monkeypatch.setenv("ALL_PROXY", "http://127.0.0.1:9")
    yield LocalApi("test API", server.server_address[1], tmp_path / "token", timeout=5, hint="is it running?"), server
    server.shutdown()
    server.server_close()
    t.join(5)


def test_documents_and_the_token(api):
    client, server = api
    assert client.call("GET", "/ok") == {"items": [1, 2]}
    assert client.call("GET", "/empty") is None
    assert client.request("GET", "/ok").content == b'{"items": [1, 2]}'
    assert server.seen == ["Bearer tok-123"] * 3


def test_errors_are_one_message_with_each_problems_pointer(api):
    client, _ = api
    with pytest.raises(click.ClickException) as e:
        client.call("GET", "/invalid")
    assert e.value.message == ("400: 2 problem(s); nothing was changed\n"
                               "  /rules/0/match: unknown field\n  /: x")
    with pytest.raises(click.ClickException) as e:
        client.call("GET", "/missing")
    assert e.value.message == "404: no sandbox sb-9"
    with pytest.raises(click.ClickException) as e:
        client.call("GET", "/text")
    assert e.value.message == "502: " + "E" * 500         # bounded


def test_unreadable_token_and_unreachable_api(tmp_path):
    with pytest.raises(click.ClickException) as e:
        LocalApi("test API", 1, tmp_path / "nope", timeout=1, hint="is it running?")
    assert "cannot read the test API token" in e.value.message and "(is it running?)" in e.value.message
    (tmp_path / "t").write_text("x")
    with pytest.raises(click.ClickException) as e:
        LocalApi("test API", 1, tmp_path / "t", timeout=1, hint="").call("GET", "/ok")
    assert e.value.message.startswith("test API at http://127.0.0.1:1/v1: ")


def test_rows_as_lines_or_the_document(capsys):
    rows = [{"id": "a", "n": 1}, {"id": "b", "n": 2}]
    echo_rows(rows, lambda r: f"{r['id']} {r['n']}", header="ID N")
    assert capsys.readouterr().out == "ID N\na 1\nb 2\n"
    echo_rows(rows, lambda r: "unused", as_json=True, document={"rows": rows}, indent=1)
    assert json.loads(capsys.readouterr().out) == {"rows": rows}
    echo_rows(rows, lambda r: "unused", as_json=True)
    assert json.loads(capsys.readouterr().out) == rows
