"""Admin API bodies validated by their models (vault/api_models.py): clear pointer messages, never a value."""
import json
import logging
import time

import httpx
import pytest

from vaulttest_helpers import SECRET2, header_binding


def post(api, path, body, token=None):
    return httpx.post(api.url + path, json=body, headers={"Authorization": f"Bearer {token or api.admin}"},
                      timeout=10)


@pytest.mark.parametrize("body,message", [
    ({"tenant": "acme", "id": "k", "value": [SECRET2]}, "/value: Input should be a valid string"),
    ({"tenant": "acme", "id": "k", "value": {"v": SECRET2}}, "/value: Input should be a valid string"),
    ({"tenant": "acme", "id": "k", "value": 98765432109876}, "/value: Input should be a valid string"),
    ({"tenant": "acme", "id": "k"}, "/value: required"),
    ({"tenant": "acme", "id": "k", "value": SECRET2, "descripton": "typo"}, "/descripton: unknown field"),
    ({"tenant": "acme", "id": "k", "value": SECRET2, "description": [SECRET2]},
     "/description: Input should be a valid string"),
    ({"tenant": "acme", "id": SECRET2.upper(), "value": SECRET2}, "/id: String should match pattern"),
])
def test_secret_put_errors_name_the_field_never_the_value(api, caplog, body, message):
    caplog.set_level(logging.DEBUG)
    r = post(api, "/v1/secrets", body)
    assert r.status_code == 400 and r.json()["error"] == "invalid", r.text
    assert r.json()["message"].startswith(message), r.json()
    deadline = time.monotonic() + 5
    while not api.records and time.monotonic() < deadline:
        time.sleep(0.01)
    seen = r.text + json.dumps(api.records) + caplog.text
    for form in (SECRET2, SECRET2.upper(), "98765432109876"):
        assert form not in seen
    assert api.records[-1]["status"] == 400 and api.records[-1]["reason"].startswith(message)
    assert "k" not in [s.id for s in api.vault.list_secrets("acme")]


def test_rotate_and_unseal_bodies(api):
    r = post(api, "/v1/secrets/acme/openai/rotate", {"value": SECRET2, "previous": "forget"})
    assert r.status_code == 400 and r.json()["message"].startswith("/previous: Input should be 'keep', 'disable'")
    r = post(api, "/v1/secrets/acme/openai/rotate", {"value": True})
    assert r.status_code == 400 and r.json()["message"] == "/value: Input should be a valid string"
    assert api.vault.get_secret("acme", "openai").current_version == 1
    r = post(api, "/v1/unseal", {"passphrase": ["correct horse battery staple"]})
    assert r.status_code == 400 and "correct horse" not in r.text and r.json()["message"].startswith("/passphrase:")


def test_binding_shape_errors_point_into_the_document(api):
    b = header_binding(bid="shape", hosts=["x.example"])
    b["match"]["hosts"] = ["ok.example", 7]
    b["inject"] = {"type": "cookie", "name": "c"}
    r = post(api, "/v1/bindings", b)
    assert r.status_code == 400 and r.json()["error"] == "invalid"
    assert r.json()["reasons"] == ["/match/hosts/1: Input should be a valid string",
                                   "/inject: must be one of 'header', 'query', 'basic'"]
    b = header_binding(bid="shape", hosts=["x.example"])
    b["match"]["ports"] = ["443"]
    r = post(api, "/v1/bindings", b)
    assert r.json()["message"] == "/match/ports/0: Input should be a valid integer"
    # Meaning is still the vault's: a framing header is refused with its reasons.
    b = header_binding(bid="shape", hosts=["x.example"])
    b["inject"] = {"type": "header", "name": "Content-Length", "format": "{secret}"}
    r = post(api, "/v1/bindings", b)
    assert r.json()["error"] == "invalid_binding" and "framing" in r.json()["message"]
    assert post(api, "/v1/bindings", header_binding(bid="shape", hosts=["x.example"])).status_code == 201


def test_replies_match_their_models(api):
    from vault import api_models as m
    h = {"Authorization": f"Bearer {api.read}"}
    for path, model in (("/v1/secrets", m.SecretList), ("/v1/secrets/acme/openai", m.Secret),
                        ("/v1/bindings", m.BindingList), ("/v1/bindings/b-openai", m.Binding),
                        ("/v1/status", m.Status)):
        model.model_validate(httpx.get(api.url + path, headers=h, timeout=10).json())
