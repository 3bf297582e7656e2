"""The one registry of reasons (egress/reasons.py) against the code, the switch and the README.

The code is read, not run (tests/gateway/reason_scan.py): a reason literal added
anywhere in egress/, cubegate/ or vault/ without a registry entry fails here, and so
does an entry nothing writes any more."""
from __future__ import annotations

import fnmatch
import re
from pathlib import Path

import pytest

from cubevs import switch_schema
from egress import reasons
from egress.reasons import LAYERS, REASONS
from tests.gateway import reason_scan

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def found() -> reason_scan.Found:
    return reason_scan.scan(ROOT)


def _where(places) -> str:
    return ", ".join(sorted(places)[:3])


def test_every_reason_in_the_code_is_registered(found):
    missing = {r: _where(w) for r, w in found.literals.items() if r not in REASONS}
    assert not missing, f"reasons used but not in egress/reasons.py: {missing}"


def test_every_reason_pattern_matches_registered_reasons(found):
    empty = {p: _where(w) for p, w in found.patterns.items() if not fnmatch.filter(REASONS, p)}
    assert not empty, f"f-string reasons that match no entry of egress/reasons.py: {empty}"


def test_every_registered_reason_is_used(found):
    used = set(found.literals)
    for pattern in found.patterns:
        if pattern != "ssrf_*":   # the guard's reasons are found exactly (test below), not by this glob
            used.update(fnmatch.filter(REASONS, pattern))
    unused = sorted(set(REASONS) - used - reasons.of_layer("switch"))
    assert not unused, f"registry entries nothing writes: {unused}"


def test_ssrf_reasons_are_the_guards_reasons(found):
    guard = {r for r in found.literals if r.startswith("ssrf_")}
    assert reasons.of_layer("ssrf") == guard
    assert {r for r in REASONS if r.startswith("ssrf_")} == guard


def test_switch_reasons_are_the_datapath_enum():
    # REASON_CODES is checked against switch.o's BTF by tests/cubevs/test_switch_schema.py.
    assert reasons.of_layer("switch") == set(switch_schema.REASON_CODES)
    allowed = {n for n in reasons.of_layer("switch") if REASONS[n].outcome == "allow"}
    assert allowed == switch_schema.ALLOW_REASONS


def test_entries_are_well_formed():
    for name, r in REASONS.items():
        assert re.fullmatch(r"[a-z][a-z0-9_]*", name), name
        assert r.layer in LAYERS, name
        assert r.outcome in ("allow", "deny", "either"), name
        assert all(100 <= s <= 599 for s in r.status), name
        assert r.meaning and "\n" not in r.meaning and "|" not in r.meaning, name
        if r.outcome == "allow":
            assert not r.status, f"{name}: an allow reason answers with the upstream's status"


def test_readme_table_is_the_registry():
    text = (ROOT / "README.md").read_text()
    m = re.search(r"<!-- reasons:begin[^>]*-->\n(.*?)<!-- reasons:end -->", text, re.S)
    assert m, "README.md has no reasons:begin/reasons:end block"
    assert m.group(1) == reasons.markdown_table(), \
        "README's reason table differs from the registry: regenerate it with `python -m egress.reasons`"


def test_scanner_sees_each_shape(tmp_path):
    """The scan rules themselves: each shape a reason reaches a record through is found."""
    pkg = tmp_path / "egress"
    pkg.mkdir()
    (tmp_path / "cubegate").mkdir()
    (tmp_path / "vault").mkdir()
    (pkg / "m.py").write_text('''
from dataclasses import dataclass
@dataclass
class Refusal:
    status: int
    reason: str
def _deny(st, reason, *, stage): ...
def f(st, x, what):
    _deny(st, "by_slot", stage="s")
    Refusal(400, "by_dataclass")
    audit(reason="by_keyword")
    st.kind, st.denied_reason = "denied", "by_tuple_assign"
    reason = "by_if" if x else "by_else"
    st.denied_reason = st.denied_reason or "by_or"
    h = {"X-Cubegate-Reason": "by_header", "reason": str(x or "by_str")}
    Refusal(502, f"{what}_by_fstring")
    not_a_reason("ignored")
''')
    got = reason_scan.scan(tmp_path)
    assert set(got.literals) == {"by_slot", "by_dataclass", "by_keyword", "by_tuple_assign", "by_if", "by_else",
                                 "by_or", "by_header", "by_str"}
    assert set(got.patterns) == {"*_by_fstring"}
