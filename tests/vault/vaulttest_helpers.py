"""Shared constants and builders for tests/vault (imported absolutely; no package here)."""

SECRET = "sk-live-TOPSECRET-0123456789abcdef"
SECRET2 = "sk-live-ROTATED-fedcba9876543210"


def header_binding(bid="b-openai", tenant="acme", secret_id="openai", hosts=("api.openai.com",), **match):
    return {"id": bid, "tenant": tenant, "secret_id": secret_id,
            "match": {"hosts": list(hosts), **match},
            "inject": {"type": "header", "name": "Authorization", "format": "Bearer {secret}"}}
