"""A Policy as the document the loader reads (the API's GET, rollback, `policy get`). Pure."""
from __future__ import annotations

from .model import ENFORCE, Match, Policy


def match_to_doc(m: Match) -> dict:
    doc: dict = {}
    if m.hosts:
        doc["hosts"] = [str(h) for h in m.hosts]
    if m.cidrs:
        doc["cidrs"] = [str(c) for c in m.cidrs]
    if m.ports is not None:
        doc["ports"] = sorted(m.ports)
    if m.schemes is not None:
        doc["schemes"] = sorted(m.schemes)
    if m.methods is not None:
        doc["methods"] = sorted(m.methods)
    if m.paths is not None:
        doc["paths"] = list(m.paths)
    return doc


def policy_to_doc(p: Policy) -> dict:
    """Rich form (a seed-form file comes back as the rules it means)."""
    doc: dict = {"name": p.name}
    if p.applies_to is not None:
        applies: dict = {}
        if p.applies_to.sandboxes:
            applies["sandboxes"] = sorted(p.applies_to.sandboxes)
        if p.applies_to.labels:
            applies["labels"] = dict(p.applies_to.labels)
        doc["applies_to"] = applies
    if p.mode != ENFORCE:
        doc["mode"] = p.mode
    doc["default"] = p.default
    if p.tenant is not None:
        doc["tenant"] = p.tenant
    doc["rules"] = [{"name": r.name, "action": r.action, "match": match_to_doc(r.match)} for r in p.rules]
    return doc
