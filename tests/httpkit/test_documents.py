"""Every route each app serves is in its OpenAPI document, and every documented route is served.

Walks the tornado app's own rules (what is really routed), not the route lists."""
import json

import pytest
from openapi_spec_validator import validate

import httpkit
from httpkit.openapi import METHODS


def _vault_app():
    from vault.api import make_app

    class NoVault:
        tokens = None
    return make_app(NoVault())


def _runtime_app():
    from cubegate.runtime_api import make_app
    return make_app(None, None, None)


def _ops_app():
    from egress.ops_server import Readiness, make_app
    return make_app(Readiness(), lambda: b"")


def _toy_app():
    from toyapp import make
    return make({}, [])


APPS = {"vault": _vault_app, "runtime": _runtime_app, "ops": _ops_app, "toy": _toy_app}


def served(app) -> dict[str, set[str]]:
    out = {}
    for rule in app.wildcard_router.rules:
        path = httpkit.template_of(rule.matcher.regex.pattern)
        assert path not in out, f"two rules for {path}"
        out[path] = {m for m in METHODS if m in vars(rule.target)}
    return out


@pytest.mark.parametrize("name", APPS)
def test_document_lists_exactly_the_served_routes_and_methods(name):
    app = APPS[name]()
    doc = httpkit.document(app)
    documented = {p: set(ops) for p, ops in doc["paths"].items()}
    assert served(app) == documented
    assert all(documented.values())


@pytest.mark.parametrize("name", APPS)
def test_document_is_valid_openapi_and_every_ref_resolves(name):
    doc = httpkit.document(APPS[name]())
    validate(doc)
    text = json.dumps(doc)
    for ref in {part.split('"')[0] for part in text.split('"$ref": "#/components/schemas/')[1:]}:
        assert ref in doc["components"]["schemas"], ref
    ids = [op["operationId"] for ops in doc["paths"].values() for op in ops.values()]
    assert len(ids) == len(set(ids))


@pytest.mark.parametrize("name", APPS)
def test_each_template_param_is_documented_and_routed_with_its_pattern(name):
    app = APPS[name]()
    doc = httpkit.document(app)
    for path, ops in doc["paths"].items():
        names = {seg[1:-1] for seg in path.split("/") if seg.startswith("{")}
        for op in ops.values():
            assert {p["name"] for p in op.get("parameters", []) if p["in"] == "path"} == names
            if op["security"]:
                assert "401" in op["responses"]
            if "requestBody" in op:
                assert {"400", "413"} <= set(op["responses"]) or "application/json" not in op["requestBody"]["content"]


def test_a_method_without_operation_cannot_be_documented():
    from toyapp import _Base

    class Undeclared(_Base):
        def get(self):
            pass
    app = httpkit.make_app([("/x", Undeclared)], base=_Base, kwargs={"store": {}, "records": []}, title="t",
                           log_name="t")
    with pytest.raises(ValueError, match="Undeclared.get .*has no @operation"):
        httpkit.document(app)


def test_secret_fields_are_write_only_in_the_vault_document():
    schemas = httpkit.document(_vault_app())["components"]["schemas"]
    assert schemas["NewSecret"]["properties"]["value"]["writeOnly"] is True
    assert schemas["Rotate"]["properties"]["value"]["writeOnly"] is True
    for name in ("Secret", "Version", "Binding", "Status"):
        assert "value" not in schemas[name]["properties"]
