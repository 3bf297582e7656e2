"""Credential injection: the vault's side of the gate (egress → vault public API only).

On every intercepted or plain-HTTP request:
  1. the sandbox's own placeholders and any secret value headed to a host the
     secret is not bound to → 403 credential_leak (headers, URL, and body);
  2. a matching binding → remove whatever the sandbox sent in the target header,
     set exactly one real value (HTTPS only unless the binding allows plaintext);
  3. responses: the value and its encodings are scrubbed from headers (and
     bodies, unless disabled) before they reach the sandbox.
Vault sealed, ambiguous bindings or any vault error → fail closed with a reason.
A redirect never carries an injected credential: the client's follow-up request
is a new request, decided and bound on its own host.
"""
from __future__ import annotations

import logging
from typing import Any, Callable

from mitmproxy import http

import vault as vaultlib
from egress.http_checks import Refusal

log = logging.getLogger("cubegate.credentials")

DEFAULT_TENANT = "default"
_INJECTION_KEY = "cubegate_injection"


def _tenant(tenant: str | None) -> str:
    return tenant or DEFAULT_TENANT


class VaultCredentials:
    def __init__(self, vault: vaultlib.Vault, *, metrics=None, alert: Callable[[dict], None] | None = None,
                 scrub_bodies: bool = True):
        self.vault = vault
        self.metrics = metrics
        self.alert = alert or (lambda rec: None)
        self.scrub_bodies = scrub_bodies

    # -- CONNECT / ClientHello stage ------------------------------------------
    def needs_interception(self, tenant: str | None, host: str, port: int) -> bool:
        try:
            return self.vault.needs_interception(_tenant(tenant), host, port)
        except vaultlib.VaultError as e:
            # Cannot tell → intercept, so the request stage can fail closed with a reason.
            log.error("vault lookup failed for %s:%s: %s", host, port, type(e).__name__)
            return True

    # -- request headers stage -----------------------------------------------
    def on_request(self, flow: http.HTTPFlow, conn, scheme: str) -> Refusal | dict | None:
        decision = conn.decision
        tenant = _tenant(decision.tenant if decision else None)
        sandbox = conn.identity.sandbox_id
        req = flow.request
        try:
            injection = self.vault.resolve(tenant, scheme=scheme, host=conn.host, port=conn.port,
                                           method=req.method, path=req.path)
        except vaultlib.VaultSealed:
            return Refusal(503, "vault_sealed", "the credential vault is sealed; bound requests are refused")
        except vaultlib.AmbiguousBinding as e:
            return Refusal(503, "binding_ambiguous", str(e))
        except vaultlib.PlaintextNotAllowed as e:
            return Refusal(403, "plaintext_injection_refused", str(e))
        except vaultlib.VaultError as e:
            return Refusal(503, "vault_error", f"{type(e).__name__}: {e}")
        refusal = self._leak_check(flow, conn, tenant, sandbox, _header_blob(req), injection, "headers")
        if refusal is not None:
            return refusal
        if injection is None:
            return None
        if injection.kind == "query":
            req.query = injection.apply_to_query(list(req.query.items(multi=True)))
        else:
            injection.apply_to_headers(req.headers)
        flow.metadata[_INJECTION_KEY] = injection
        if self.metrics is not None:
            self.metrics.injections.labels(sandbox, injection.secret_id).inc()
        return {"secret": injection.secret_id, "version": injection.version,
                "fingerprint": injection.fingerprint, "binding": injection.binding_id}

    # -- request body stage ----------------------------------------------------
    def on_request_body(self, flow: http.HTTPFlow, conn) -> Refusal | None:
        body = flow.request.raw_content
        if not body:
            return None
        decision = conn.decision
        tenant = _tenant(decision.tenant if decision else None)
        return self._leak_check(flow, conn, tenant, conn.identity.sandbox_id, body,
                                flow.metadata.get(_INJECTION_KEY), "body")

    def _leak_check(self, flow, conn, tenant, sandbox, data, injection, where) -> Refusal | None:
        try:
            leaks = self.vault.find_leaks(tenant, sandbox, data)
        except vaultlib.VaultSealed:
            return None  # nothing to compare against; bound requests already fail on resolve
        except vaultlib.VaultError as e:
            return Refusal(503, "vault_error", f"{type(e).__name__}: {e}")
        if injection is not None:
            leaks = [s for s in leaks if s != injection.secret_id]
        if not leaks:
            return None
        if self.metrics is not None:
            self.metrics.leaks_blocked.labels(sandbox).inc()
        log.warning("ALERT credential leak blocked: sandbox %s sent secret(s) %s in %s to %s",
                    sandbox, ",".join(sorted(leaks)), where, conn.host)
        self.alert({"sandbox": sandbox, "secrets": sorted(leaks), "where": where, "host": conn.host})
        return Refusal(403, "credential_leak",
                       f"request {where} carry secret(s) {', '.join(sorted(leaks))} to {conn.host}, "
                       "which they are not bound to")

    # -- response stage ----------------------------------------------------------
    def on_response(self, flow: http.HTTPFlow, conn) -> None:
        injection = flow.metadata.get(_INJECTION_KEY)
        if injection is None or flow.response is None:
            return
        headers = flow.response.headers
        for name, value in list(headers.items(multi=True)):
            if injection.occurs_in(value) or injection.occurs_in(name):
                values = headers.get_all(name)
                headers.set_all(name, [injection.scrub(v).decode("latin-1") for v in values])
        if self.scrub_bodies and flow.response.raw_content:
            content = flow.response.content  # decoded (gzip etc.) so encodings cannot hide it
            if content and injection.occurs_in(content):
                flow.response.content = injection.scrub(content)


def _header_blob(req: http.Request) -> bytes:
    parts = [req.url.encode("utf-8", "replace")]
    for k, v in req.headers.fields:
        parts.append(k + b": " + v)
    return b"\n".join(parts)


def host_policy_check_for(policies_current: Callable[[], Any]) -> Callable[[str, str], str | None]:
    """Binding validation hook: refuse bindings to hosts no policy of that tenant allows."""
    from egress.policy import normalize_host

    def check(tenant: str, host: str) -> str | None:
        cps = policies_current()
        probe = host
        if host.startswith("*."):
            probe = "cubegate-probe." + host[2:]
        try:
            name = normalize_host(probe)
        except ValueError as e:
            return f"invalid host {host!r}: {e}"
        tenant_policies = [p for p in cps.policies if _tenant(p.tenant) == tenant]
        if not tenant_policies:
            return f"no policy uses tenant {tenant!r}"
        for p in tenant_policies:
            _, outcome = p.evaluate(name, None, 443, "https", None, None)
            if not outcome.deny or outcome.inspect:
                return None
        return f"no policy of tenant {tenant!r} allows {host}"

    return check
