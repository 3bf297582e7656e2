from egress.audit.record import make_record


def rec(event="decision", **fields):
    """A valid record with sensible defaults, overridable per field."""
    base = dict(sandbox="sb1", host="api.example.com", port=443, decision="allow",
                reason="rule_match", rule="r1", method="GET", path="/v1")
    base.update(fields)
    return make_record(event, **base)
