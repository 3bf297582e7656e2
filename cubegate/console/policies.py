"""Policies: the set in force, one policy's document (edit, errors in place), history with diffs and
rollback, explain a decision; pending access requests (approve with scope and expiry, deny) and grants.

Everything goes through the live policy set (egress.policy.live.LivePolicies) the policy API
uses, with its checks: a broken edit is refused with one message per problem (a JSON pointer
and what is wrong), the text stays in the editor, nothing changes. Approving makes the grant
the policy API makes (cubegate.policy_api.grant_for: exactly the host and port asked for).
"""
from __future__ import annotations

import dataclasses
import difflib
import re
import time

import yaml

from httpkit import ApiError

from cubegate.policy_api import grant_for
from egress.policy import PolicyError, RequestInfo
from egress.policy.live import NotFound as PolicyNotFound, Refused

from . import forms
from .base import ConsoleHandler

NAME = r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}"
SCOPES = ("sandbox", "labels", "tenant")
EXPIRIES = (("", "never"), ("3600", "1 hour"), ("28800", "8 hours"), ("86400", "1 day"), ("604800", "7 days"))
NEW_POLICY = "name: {name}\ndefault: deny\nrules:\n  - name: example\n    action: allow\n    match: {{hosts: [example.com], ports: [443]}}\n"


def doc_text(doc: dict | None) -> str:
    return "" if doc is None else yaml.safe_dump(doc, sort_keys=False, allow_unicode=True)


def diff_lines(old: dict | None, new: dict | None, old_label: str, new_label: str) -> list[tuple[str, str]]:
    """(kind, line) for a unified diff: kind is add, del, hunk or same."""
    out = []
    for line in difflib.unified_diff(doc_text(old).splitlines(), doc_text(new).splitlines(), old_label, new_label,
                                     lineterm="", n=2):
        kind = ("hunk" if line.startswith(("@@", "---", "+++")) else "add" if line.startswith("+")
                else "del" if line.startswith("-") else "same")
        out.append((kind, line))
    return out


def history_with_diffs(versions: list) -> list[dict]:
    """Newest first, each with its diff to the version before it."""
    out = []
    for i, v in enumerate(versions):
        older = versions[i + 1] if i + 1 < len(versions) else None
        out.append({"v": v, "diff": diff_lines(older.doc if older else None, v.doc,
                                               f"v{older.version}" if older else "(none)", f"v{v.version}")})
    return out


class _Policies(ConsoleHandler):
    error_map = [(PolicyNotFound, 404, "not_found"), (Refused, 409, "conflict"), *ConsoleHandler.error_map]

    @property
    def live(self):
        return self.ctx.policies


class PoliciesPage(_Policies):
    action = "console.policies"
    template = "policies.html"

    async def page_context(self) -> dict:
        return {"policies": self.live.list_policies(), "digest": self.live.digest,
                "pending": self.ctx.access.list(state="pending"),
                "decided": self.ctx.access.list(state="approved")[:10] + self.ctx.access.list(state="denied")[:10],
                "grants": sorted(self.live.grants().items()), "scopes": SCOPES, "expiries": EXPIRIES,
                "explain": None, "explain_query": {}}

    async def get(self) -> None:
        await self.render_page(self.template)


class ExplainPage(PoliciesPage):
    """GET: what the policy in force decides for one request (no traffic), shown on the list page."""
    action = "console.policy.explain"

    async def get(self) -> None:
        q = {k: self.get_query_argument(k, "").strip() for k in ("sandbox", "labels", "host", "port", "method", "path")}
        self.form_values = dict(q)
        if not q["sandbox"] or not q["host"]:
            raise forms.invalid("explain: give a sandbox and a host")
        ports = forms.integers(q["port"] or "443", "port")
        if len(ports) != 1 or not 1 <= ports[0] <= 65535:
            raise forms.invalid("port: one port, 1-65535")
        labels = forms.pairs(q["labels"].replace(",", "\n"), "labels")
        d = self.live.current.decide(RequestInfo(sandbox_id=q["sandbox"], labels=labels, host=q["host"], port=ports[0],
                                                 method=q["method"] or None, path=q["path"] or None,
                                                 scheme="https" if ports[0] == 443 else None))
        await self.render_page(self.template, explain=dataclasses.asdict(d), explain_query=q)


class NewPolicy(_Policies):
    """The list page's "new policy" form: to the editor of that name."""
    action = "console.policy.new"

    def get(self) -> None:
        name = self.get_query_argument("name", "").strip()
        if not re.fullmatch(NAME, name) or name in ("new", "explain"):
            raise forms.invalid("name: letters, digits and . _ : - (not 'new' or 'explain')")
        self.redirect(f"/policies/{name}?new=1")


class PolicyPage(_Policies):
    action = "console.policy"
    template = "policy.html"

    async def page_context(self) -> dict:
        name = self.path_kwargs["name"]
        try:
            info = self.live.describe(name)
        except PolicyNotFound:
            if self.get_query_argument("new", "") != "1" and self.request.method == "GET":
                raise
            info = {"name": name, "source": "new", "policy": None}
        try:
            versions = self.live.history("policy", name)
        except PolicyNotFound:
            versions = []
        text = self.form_values.get("text")
        if text is None:
            text = doc_text(info["policy"]) if info["policy"] is not None else NEW_POLICY.format(name=name)
        return {"name": name, "info": info, "text": text, "history": history_with_diffs(versions),
                "problems": getattr(self, "problems", [])}

    async def get(self, name: str) -> None:
        await self.render_page(self.template)


class PolicySave(PolicyPage):
    """Create or replace (an API policy of a file policy's name takes its place). GET: the page."""
    action = "console.policy.put"

    async def post(self, name: str) -> None:
        f = self.form("text")
        self.audit["name"] = name
        try:
            v = await self.run(self.live.put_policy, name, f["text"], actor=self.actor)   # seconds at its limit
        except PolicyError as e:
            self.problems = e.pointers()
            raise ApiError(400, "invalid_policy", f"{len(self.problems)} problem(s) in the policy; nothing was "
                                                  "changed") from None
        self.audit.update(kind=v.kind, version=v.version, change=v.action)
        self.done(f"/policies/{name}", f"policy {name}: version {v.version} ({v.action}) is in force")


class PolicyDelete(PolicyPage):
    action = "console.policy.delete"
    SUPPORTED_METHODS = ("POST",)

    def post(self, name: str) -> None:
        self.audit["name"] = name
        v = self.live.delete_policy(name, actor=self.actor)
        self.audit.update(kind=v.kind, version=v.version, change=v.action)
        self.done("/policies", f"policy {name} deleted through the API (version {v.version})")


class PolicyRollback(PolicyPage):
    action = "console.policy.rollback"
    SUPPORTED_METHODS = ("POST",)

    def post(self, name: str) -> None:
        f = self.form("version")
        self.audit["name"] = name
        if not f["version"].isdigit():
            raise forms.invalid("version: a version number")
        self.audit["to_version"] = int(f["version"])
        try:
            v = self.live.rollback(name, int(f["version"]), actor=self.actor)
        except PolicyError as e:
            self.problems = e.pointers()
            raise ApiError(400, "invalid_policy", "that version no longer fits the policy set") from None
        self.audit.update(kind=v.kind, version=v.version, change=v.action)
        self.done(f"/policies/{name}", f"policy {name}: back to version {f['version']} (now version {v.version})")


class AccessApprove(PoliciesPage):
    action = "console.access.approve"
    SUPPORTED_METHODS = ("POST",)

    def post(self, id: str) -> None:
        f = self.form("scope", "expires_in", "note")
        self.audit["request_id"] = id
        if f["scope"] not in SCOPES:
            raise forms.invalid(f"scope: one of {', '.join(SCOPES)}")
        expires_in = forms.optional_number(f["expires_in"], "expires", float)
        req = self.ctx.access.get(id)
        if req is None or req["state"] != "pending":
            raise ApiError(404, "not_found", f"no pending access request {id}")
        expires = time.time() + expires_in if expires_in else None
        name = f"grant.{id}"
        v = self.live.put_grant(name, grant_for(req, f["scope"], expires), actor=self.actor, note=f["note"] or None)
        self.audit.update(kind="grant", name=name, version=v.version, scope=f["scope"])
        self.ctx.access.decide(id, "approved", actor=self.actor, scope=f["scope"], grant=name, expires=expires,
                               note=f["note"] or None)
        self.done("/policies", f"approved {req['host']}:{req['port']} for {req['sandbox']} (scope {f['scope']})")


class AccessDeny(PoliciesPage):
    action = "console.access.deny"
    SUPPORTED_METHODS = ("POST",)

    def post(self, id: str) -> None:
        f = self.form("note")
        self.audit["request_id"] = id
        if self.ctx.access.decide(id, "denied", actor=self.actor, note=f["note"] or None) is None:
            raise ApiError(404, "not_found", f"no pending access request {id}")
        self.done("/policies", f"access request {id} denied")


class GrantRevoke(PoliciesPage):
    action = "console.grant.revoke"
    SUPPORTED_METHODS = ("POST",)

    def post(self, name: str) -> None:
        self.audit.update(kind="grant", name=name)
        v = self.live.delete_grant(name, actor=self.actor)
        self.audit.update(version=v.version, change=v.action)
        self.done("/policies", f"grant {name} revoked")
