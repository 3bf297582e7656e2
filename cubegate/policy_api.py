"""Policy and access-request admin API (host only, loopback; httpkit).

    GET    /v1/policies                         every policy in force (files and API), with its source
    GET    /v1/policies/{name}                  one policy's document (+ version for API policies)
    PUT    /v1/policies/{name}                  create or replace (body: the policy, JSON or YAML)
    DELETE /v1/policies/{name}                  delete an API policy (a file policy it replaced comes back)
    POST   /v1/policies/{name}/validate         check a body: {"ok": true} or the errors; changes nothing
    GET    /v1/policies/{name}/history          every version through the API (newest first)
    POST   /v1/policies/{name}/rollback         {"version": N}: version N becomes current (as a new version)
    POST   /v1/decide                           explain a decision (no traffic)
    GET    /v1/access-requests?state=pending    what sandboxes asked for
    POST   /v1/access-requests/{id}/approve     {"scope": sandbox|labels|tenant, "expires_in_seconds": S}
    POST   /v1/access-requests/{id}/deny        {"note": "..."}
    GET    /v1/grants                           approved grants in force
    DELETE /v1/grants/{name}                    revoke a grant now

A body that is not a valid policy is refused 400 with one {pointer, message}
per problem (the file loader's checks and messages; a JSON pointer instead of
file:line), and nothing changes. Every change is a new version (actor, time)
in <state_dir>/policies.db and an `admin` audit record. Tokens: see admin_tokens.
"""
from __future__ import annotations

import dataclasses
import ipaddress
import time

import httpkit
from httpkit import ApiError, AuditHook, JsonHandler, PathParam, operation

from cubegate import policy_api_models as m
from cubegate.policy_thread import off_loop   # bodies are parsed there, never on the loop
from egress.policy import PolicyError, RequestInfo
from egress.policy.hosts import parse_ip
from egress.policy.live import LivePolicies, NotFound, Refused

MAX_BODY = 1024 * 1024
_NAME = r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}"
_WRITE = (403,)


class _Base(JsonHandler):
    realm = "cubegate-policy"
    error_map = [(NotFound, 404, "not_found"), (Refused, 409, "conflict")]
    read_ok = False     # a POST that only reads (validate, decide) may use a read token

    def initialize(self, live: LivePolicies, access, tokens, audit_hook: AuditHook | None) -> None:
        super().initialize(audit_hook)
        self.live, self.access, self.tokens = live, access, tokens

    def authenticate(self, token: str):
        return self.tokens.verify(token)

    def authorize(self) -> None:
        if self.request.method not in ("GET", "HEAD") and not self.read_ok and self.actor.scope != "admin":
            raise ApiError(403, "forbidden", f"token scope {self.actor.scope!r} cannot {self.request.method}")

    def audit_record(self) -> dict | None:
        if self.request.method == "GET":
            return None
        return {"action": self.action, "actor": self.actor.id if self.actor else None, "status": self.get_status(),
                "outcome": self.outcome(), "reason": self.reason, "remote": self.request.remote_ip, **self.audit}

    def refuse_policy(self, e: PolicyError) -> None:
        errors = e.pointers()
        self.reason = "invalid policy"
        self.reply(400, {"error": "invalid_policy", "message": f"{len(errors)} problem(s); nothing was changed",
                         "errors": errors})

    def body_text(self) -> str:
        try:
            return self.request.body.decode("utf-8")
        except UnicodeDecodeError:
            raise ApiError(400, "invalid_policy", "body is not UTF-8") from None

    def changed(self, v, status: int = 200) -> None:
        self.audit.update(kind=v.kind, name=v.name, version=v.version, change=v.action)
        self.reply(status, v.public())


class PoliciesHandler(_Base):
    action = "policies"

    @operation("Every policy in force, files and API", reply=m.PolicyList)
    def get(self) -> None:
        self.reply(200, {"policies": self.live.list_policies(), "digest": self.live.digest})


class PolicyHandler(_Base):
    action = "policy"

    @operation("One policy: its document, source and version", errors=(404,))
    def get(self, name: str) -> None:
        self.reply(200, self.live.describe(name))

    @operation("Create or replace a policy (body: the policy document, JSON or YAML)", raw_body="application/json",
               reply=m.Change, errors=_WRITE)
    async def put(self, name: str) -> None:
        self.audit["name"] = name
        try:
            v = await off_loop(self.live.put_policy, name, self.body_text(), actor=self.actor.id)
        except PolicyError as e:
            return self.refuse_policy(e)
        self.changed(v, 201 if v.action == "create" else 200)

    @operation("Delete an API policy (the file policy it replaced, if any, is in force again)", reply=m.Change,
               errors=(*_WRITE, 404, 409))
    def delete(self, name: str) -> None:
        self.audit["name"] = name
        self.changed(self.live.delete_policy(name, actor=self.actor.id))


class ValidateHandler(_Base):
    action = "policy.validate"
    read_ok = True

    @operation("Check a policy body as PUT would; changes nothing", raw_body="application/json")
    async def post(self, name: str) -> None:
        try:
            await off_loop(self.live.parse, name, self.body_text())
        except PolicyError as e:
            return self.refuse_policy(e)
        self.reply(200, {"ok": True, "name": name})


class HistoryHandler(_Base):
    action = "policy.history"

    @operation("Every version changed through the API, newest first", reply=m.History, errors=(404,))
    def get(self, name: str) -> None:
        versions = self.live.history("policy", name)
        self.reply(200, {"name": name, "versions": [{**v.public(), "policy": v.doc} for v in versions]})


class RollbackHandler(_Base):
    action = "policy.rollback"

    @operation("Make an earlier version current again (stored as a new version)", body=m.Rollback,
               reply=m.Change, errors=(*_WRITE, 404))
    def post(self, name: str, body: m.Rollback) -> None:
        self.audit.update(name=name, to_version=body.version)
        try:
            v = self.live.rollback(name, body.version, actor=self.actor.id)
        except PolicyError as e:   # an old version no longer fits the set (e.g. a file took its sandbox)
            return self.refuse_policy(e)
        self.changed(v)


class DecideHandler(_Base):
    action = "decide"
    read_ok = True

    @operation("Explain what the policy in force decides for one request (no traffic)", body=m.DecideQuery,
               reply=m.Decision)
    def post(self, body: m.DecideQuery) -> None:
        d = self.live.current.decide(RequestInfo(sandbox_id=body.sandbox, labels=body.labels, host=body.host,
                                                 port=body.port, scheme=body.scheme, method=body.method,
                                                 path=body.path))
        self.reply(200, dataclasses.asdict(d))


class AccessRequestsHandler(_Base):
    action = "access"

    @operation("Access requests filed by sandboxes", query=m.StateQuery, reply=m.AccessList)
    def get(self, query: m.StateQuery) -> None:
        self.reply(200, {"requests": self.access.list(state=query.state, sandbox=query.sandbox)})


def grant_for(req: dict, scope: str, expires: float | None) -> dict:
    """The grant an approval creates: exactly the host and port asked for, for the chosen scope."""
    labels = {k: v for k, v in req["labels"].items()}
    if scope == "sandbox":
        applies = {"sandboxes": [req["sandbox"]]}
    elif scope == "labels":
        if not labels:
            raise ApiError(400, "invalid", "the sandbox had no labels when it asked; approve for the sandbox")
        applies = {"labels": labels}
    else:
        if "tenant" not in labels:
            raise ApiError(400, "invalid", "the sandbox has no tenant label; approve for the sandbox or its labels")
        applies = {"labels": {"tenant": labels["tenant"]}}
    # an IP literal (normalised when filed) is granted as its own /32 or /128, never as a host name
    addr = parse_ip(req["host"])
    what = {"cidrs": [str(ipaddress.ip_network(addr))]} if addr is not None else {"hosts": [req["host"]]}
    doc = {"applies_to": applies, **what, "ports": [req["port"]], "request": req["id"]}
    if expires is not None:
        doc["expires"] = expires
    return doc


class ApproveHandler(_Base):
    action = "access.approve"

    @operation("Approve: a grant for exactly this host and port (versioned, revocable)", body=m.Approve,
               reply=m.AccessRequest, errors=(*_WRITE, 400, 404, 409))
    def post(self, id: str, body: m.Approve) -> None:
        self.audit["request_id"] = id
        req = self.access.get(id)
        if req is None or req["state"] != "pending":
            raise ApiError(404, "not_found", f"no pending access request {id!r}")
        expires = time.time() + body.expires_in_seconds if body.expires_in_seconds else None
        name = f"grant.{id}"
        try:
            v = self.live.put_grant(name, grant_for(req, body.scope, expires), actor=self.actor.id,
                                    note=body.note)
        except PolicyError as e:     # nothing was stored: the request stays pending, the admin is told why
            raise ApiError(400, "invalid", "this request cannot be granted: " + "; ".join(
                f"{p['pointer'] or '/'}: {p['message']}" for p in e.pointers())) from None
        self.audit.update(kind="grant", name=name, version=v.version, scope=body.scope)
        done = self.access.decide(id, "approved", actor=self.actor.id, scope=body.scope, grant=name,
                                  expires=expires, note=body.note)
        if done is None:     # decided (or removed with its sandbox) meanwhile: take the grant back, all or none
            if name in self.live.grants():     # (a destroy already took it with the sandbox)
                self.live.delete_grant(name, actor=self.actor.id)
            raise ApiError(409, "conflict", f"access request {id!r} is no longer pending")
        self.reply(200, done)


class DenyHandler(_Base):
    action = "access.deny"

    @operation("Deny a pending access request", body=m.DenyRequest, reply=m.AccessRequest, errors=(*_WRITE, 404))
    def post(self, id: str, body: m.DenyRequest) -> None:
        self.audit["request_id"] = id
        done = self.access.decide(id, "denied", actor=self.actor.id, note=body.note)
        if done is None:
            raise ApiError(404, "not_found", f"no pending access request {id!r}")
        self.reply(200, done)


class GrantsHandler(_Base):
    action = "grants"

    @operation("Grants in force")
    def get(self) -> None:
        self.reply(200, {"grants": [{"name": n, **g.to_doc()} for n, g in sorted(self.live.grants().items())]})


class GrantHandler(_Base):
    action = "grant"

    @operation("Revoke a grant now (open connections it allowed are closed)", reply=m.Change,
               errors=(*_WRITE, 404))
    def delete(self, name: str) -> None:
        self.changed(self.live.delete_grant(name, actor=self.actor.id))


ROUTES = [
    ("/v1/policies", PoliciesHandler),
    ("/v1/policies/{name}", PolicyHandler),
    ("/v1/policies/{name}/validate", ValidateHandler),
    ("/v1/policies/{name}/history", HistoryHandler),
    ("/v1/policies/{name}/rollback", RollbackHandler),
    ("/v1/decide", DecideHandler),
    ("/v1/access-requests", AccessRequestsHandler),
    ("/v1/access-requests/{id}/approve", ApproveHandler),
    ("/v1/access-requests/{id}/deny", DenyHandler),
    ("/v1/grants", GrantsHandler),
    ("/v1/grants/{name}", GrantHandler),
    ("/v1/openapi.json", httpkit.openapi_handler(_Base, public=True)),
]
PARAMS = {"name": PathParam(_NAME, {"type": "string", "pattern": f"^{_NAME}$"}),
          "id": PathParam(r"ar_[0-9a-f]{16}", {"type": "string", "pattern": "^ar_[0-9a-f]{16}$"})}


def make_app(live: LivePolicies, access, tokens, *, audit_hook: AuditHook | None = None):
    kw = {"live": live, "access": access, "tokens": tokens, "audit_hook": audit_hook}
    return httpkit.make_app(ROUTES, base=_Base, kwargs=kw, params=PARAMS, title="cubegate policy API",
                            log_name="cubegate.policy_api")


def serve(live: LivePolicies, access, tokens, *, port: int, audit_hook: AuditHook | None = None) -> httpkit.Server:
    app = make_app(live, access, tokens, audit_hook=audit_hook)
    return httpkit.serve(app, max_body=MAX_BODY, host="127.0.0.1", port=port, what="the policy API",
                         admit=httpkit.bearer_admit(tokens.verify))
