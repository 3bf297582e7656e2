"""httpkit through a real server on loopback: bodies, limits, errors, audit, logs."""
import json
import logging
import socket
import time

import httpx
import pytest

import httpkit
from httpkit import parse_body

from toyapp import TOKEN, Key, Thing, make

SECRET = "sk-toy-5ecret-value-9f8e7d"
LIMIT = 4096


@pytest.fixture
def toy(serve_in_thread):
    store, records = {"k": SECRET}, []
    with serve_in_thread(lambda: httpkit.serve(make(store, records), max_body=LIMIT)) as srv:
        yield srv, store, records


def call(srv, method, path, token=TOKEN, **kw):
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.request(method, f"http://127.0.0.1:{srv.port}{path}", headers=headers, timeout=10, **kw)


def raw(srv, data: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as s:
        s.sendall(data)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
        return out


def settled(records: list, n: int) -> list:
    """on_finish runs after the reply is sent: wait (bounded) for the server thread's records."""
    deadline = time.monotonic() + 5
    while len(records) < n and time.monotonic() < deadline:
        time.sleep(0.01)
    return records


def test_validation_errors_are_json_pointers_naming_the_field():
    with pytest.raises(httpkit.ApiError) as e:
        parse_body(Thing, b'{"match": {"hosts": ["a", 7], "port": 1}, "kind": {"type": "a", "x": "1"}}')
    assert e.value.status == 400 and e.value.code == "invalid"
    assert e.value.reasons == ["/match/hosts/1: Input should be a valid string", "/match/port: unknown field",
                               "/kind/a/x: Input should be a valid integer"]
    assert e.value.message == "/match/hosts/1: Input should be a valid string (and 2 more)"
    with pytest.raises(httpkit.ApiError) as e:
        parse_body(Thing, b'{"match": {"hosts": []}, "kind": {"type": "zzz-unknown"}, "timeout": NaN}')
    assert e.value.reasons[0].startswith("/match/hosts: List should have at least 1 item")
    assert "/kind: must be one of 'a', 'b'" in e.value.reasons and "zzz-unknown" not in json.dumps(e.value.body())
    assert any(r.startswith("/timeout: ") for r in e.value.reasons)
    with pytest.raises(httpkit.ApiError) as e:
        parse_body(Thing, b"{}")
    assert e.value.reasons == ["/match: required", "/kind: required"]


@pytest.mark.parametrize("body", [
    {"name": "ok", "value": 12345678901234},                   # wrong type
    {"name": "ok", "value": [SECRET]},                         # the value inside a wrong shape
    {"name": "ok", "value": {"v": SECRET}},
    {"name": SECRET, "value": "x"},                           # in a field with a pattern
    {"name": "ok", "value": "x", "tags": SECRET},             # in a field of another type
    {"name": "ok", "value": "x", "tags": [1, SECRET, {"a": SECRET}]},
])
def test_validation_never_quotes_a_value(body):
    with pytest.raises(httpkit.ApiError) as e:
        parse_body(Key, json.dumps(body).encode())
    text = json.dumps(e.value.body())
    for v in (SECRET, "12345678901234"):
        assert v not in text
    assert e.value.message.startswith("/")


@pytest.mark.parametrize("data,message", [
    (b"{not json", "request body is not valid JSON"), (b"\xff\xfe{}", "request body is not valid JSON"),
    (b"[1, 2]", "request body must be a JSON object"), (b'"text"', "request body must be a JSON object"),
    (b"null", "request body must be a JSON object"), (b"[" * 5000 + b"]" * 5000, None),
])
def test_non_json_or_non_object_bodies_get_400(data, message):
    with pytest.raises(httpkit.ApiError) as e:
        parse_body(Key, data)
    assert e.value.status == 400
    if message:
        assert (e.value.code, e.value.message) == ("bad_json", message)


def test_roundtrip_and_audit(toy):
    srv, store, records = toy
    r = call(srv, "POST", "/keys", json={"name": "gh", "value": SECRET + "2"})
    assert r.status_code == 201 and r.json() == {"name": "gh"} and store["gh"] == SECRET + "2"
    assert r.headers["Cache-Control"] == "no-store" and "Server" not in r.headers
    assert call(srv, "GET", "/keys/gh").json() == {"name": "gh"}
    r = call(srv, "GET", "/keys/nope")
    assert (r.status_code, r.json()) == (404, {"error": "not_found", "message": "'nope'"})
    r = call(srv, "POST", "/keys", content=b"[1]")
    assert (r.status_code, r.json()["error"]) == (400, "bad_json")
    assert [(x["action"], x["status"]) for x in settled(records, 4)] == [("keys.post", 201), ("key.get", 200),
                                                              ("key.get", 404), ("keys.post", 400)]
    assert records[0]["name"] == "gh" and records[3]["reason"] == "request body must be a JSON object"
    assert SECRET not in json.dumps(records)


def test_auth_405_404_are_json(toy):
    srv, _, records = toy
    for token in (None, "wrong"):
        r = call(srv, "POST", "/keys", token=token, json={"name": "x", "value": SECRET})
        assert r.status_code == 401 and r.json()["error"] == "unauthorized"
        assert r.headers["WWW-Authenticate"] == 'Bearer realm="toy"'
    r = call(srv, "GET", "/nowhere", token=None)
    assert r.status_code == 401          # unknown paths: after auth, callers learn nothing of routes
    r = call(srv, "GET", "/nowhere")
    assert (r.status_code, r.json()["error"]) == (404, "not_found")
    r = call(srv, "DELETE", "/keys")
    assert (r.status_code, r.json()) == (405, {"error": "http_error", "message": "Method Not Allowed"})
    r = call(srv, "GET", "/crash")
    assert (r.status_code, r.json()) == (409, {"error": "conflict", "message": "busy"})
    assert call(srv, "GET", "/openapi.json", token=None).json()["info"]["title"] == "toy"
    assert settled(records, 1)[0]["actor"] is None and records[0]["status"] == 401


def test_an_unexpected_exception_is_a_500_without_its_text(toy, caplog):
    srv, _, records = toy
    caplog.set_level(logging.DEBUG)
    r = call(srv, "POST", "/crash")
    assert (r.status_code, r.json()) == (500, {"error": "internal", "message": "internal error"})
    settled(records, 1)
    assert SECRET not in r.text and SECRET not in caplog.text and SECRET not in json.dumps(records)
    assert "internal error Boom in crash.post at " in caplog.text and "toyapp.py" in caplog.text


def test_body_over_the_limit_is_413_before_it_is_read(toy):
    srv, store, records = toy
    big = {"name": "big", "value": "v" * (LIMIT + 1)}
    r = call(srv, "POST", "/keys", json=big)
    assert r.status_code == 413 and r.json()["error"] == "too_large"
    assert str(LIMIT) in r.json()["message"] and "big" not in store
    # Declared but never sent: answered at once, the body is not waited for.
    out = raw(srv, b"POST /keys HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + TOKEN.encode()
              + b"\r\nContent-Length: 999999999\r\nExpect: 100-continue\r\n\r\n")
    assert out.startswith(b"HTTP/1.1 413 ") and b"100" not in out.split(b"\r\n")[0]
    # Chunked past the limit: tornado cuts it off (400, closed), nothing stored.
    chunk = b"x" * (LIMIT + 10)
    out = raw(srv, b"POST /keys HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + TOKEN.encode()
              + b"\r\nTransfer-Encoding: chunked\r\n\r\n" + b"%x\r\n" % len(chunk) + chunk + b"\r\n0\r\n\r\n")
    assert out.startswith(b"HTTP/1.1 400 ") and "big" not in store
    assert call(srv, "POST", "/keys", json={"name": "small", "value": SECRET}).status_code == 201  # still serving
    assert [x["status"] for x in settled(records, 1)] == [201]   # the 413s were refused before any handler ran


def test_bind_is_loopback_only_unless_asked():
    with pytest.raises(ValueError, match="loopback"):
        httpkit.serve(make({}, []), max_body=LIMIT, host="0.0.0.0")


@pytest.mark.parametrize("value", [b"\xb2", b"1\xb3", b"\xb9"])   # "²", "1³", "¹": str.isdigit() says yes
def test_a_content_length_of_non_ascii_digits_is_a_400_not_a_dropped_connection(toy, value):
    srv, store, _ = toy
    out = raw(srv, b"POST /keys HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + TOKEN.encode()
              + b"\r\nContent-Length: " + value + b"\r\n\r\n")
    assert out.startswith(b"HTTP/1.1 400 ") and b"Content-Length is not a number" in out, out[:200]
