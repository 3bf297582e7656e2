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
from egress.metrics import LabelCache

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
        self._injections = LabelCache(metrics.injections) if metrics is not None else None   # one per request
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
    def on_request(self, flow: http.HTTPFlow, conn, scheme: str,
                   override: str | None = None) -> Refusal | dict | None:
        """`override`: the other method the request names (egress.http_checks.method_override)."""
        decision = conn.decision
        tenant = _tenant(decision.tenant if decision else None)
        sandbox = conn.identity.sandbox_id
        req = flow.request
        injection = self._resolve(tenant, scheme, conn, req.method, req.path)
        if isinstance(injection, Refusal):
            return injection
        if injection is not None and override is not None:
            # an upstream that honours the override runs that method with the key: the same
            # binding must cover it
            other = self._resolve(tenant, scheme, conn, override, req.path)
            if isinstance(other, Refusal):
                return other
            if other is None or other.binding_id != injection.binding_id:
                return Refusal(403, "method_override_binding",
                               f"binding {injection.binding_id!r} does not cover the override method {override}")
        refusal = self._leak_check(flow, conn, tenant, sandbox, _header_blob(req), injection, "headers")
        if refusal is not None:
            return refusal
        if injection is None:
            return None
        if injection.kind == "query":
            req.query = injection.apply_to_query(list(req.query.items(multi=True)))
        else:
            injection.apply_to_headers(req.headers)
        # A ranged answer hands the sandbox the body in pieces no single scrub pass sees
        # whole (8-byte Range requests reassemble the key): ask for the whole body.
        if any(k.lower() in (b"range", b"if-range") for k, _ in req.headers.fields):
            req.headers.pop("range", None)
            req.headers.pop("if-range", None)
        flow.metadata[_INJECTION_KEY] = injection
        if self._injections is not None:
            self._injections(sandbox, injection.secret_id).inc()
        return {"secret": injection.secret_id, "version": injection.version,
                "fingerprint": injection.fingerprint, "binding": injection.binding_id}

    def _resolve(self, tenant: str, scheme: str, conn, method: str, path: str):
        """The injection for one request, None, or the Refusal a vault failure means (fail closed)."""
        try:
            return self.vault.resolve(tenant, scheme=scheme, host=conn.host, port=conn.port,
                                      method=method, path=path)
        except vaultlib.VaultSealed:
            return Refusal(503, "vault_sealed", "the credential vault is sealed; bound requests are refused")
        except vaultlib.AmbiguousBinding as e:
            return Refusal(503, "binding_ambiguous", str(e))
        except vaultlib.PlaintextNotAllowed as e:
            return Refusal(403, "plaintext_injection_refused", str(e))
        except vaultlib.VaultError as e:
            return Refusal(503, "vault_error", f"{type(e).__name__}: {e}")

    # -- the fast path's plain-HTTP requests (egress/fastpath/plain.py): no flow, never injected --
    def check_unbound_request(self, conn, *, url: str, fields) -> Refusal | None:
        """on_request's check for a request the fast path forwards itself, to a host with no binding
        (needs_interception said so): a leak in the URL or headers, or a vault that cannot tell, refuses it."""
        tenant = _tenant(conn.decision.tenant if conn.decision else None)
        return self._leak_check(None, conn, tenant, conn.identity.sandbox_id, header_blob(url, fields), None,
                                "headers")

    def unbound_needles(self, conn) -> "vaultlib.Needles | Refusal":
        """request_needles for a request nothing was injected into."""
        return self._needles(conn, None)

    # -- request body stage ----------------------------------------------------
    def request_needles(self, flow: http.HTTPFlow, conn) -> "vaultlib.Needles | Refusal":
        """What the request body must not carry: the sandbox's placeholders and its tenant's
        secret values, except the one injected into this request."""
        injection = flow.metadata.get(_INJECTION_KEY)
        return self._needles(conn, injection.secret_id if injection else None)

    def _needles(self, conn, exclude: str | None) -> "vaultlib.Needles | Refusal":
        decision = conn.decision
        tenant = _tenant(decision.tenant if decision else None)
        try:
            return self.vault.leak_needles(tenant, conn.identity.sandbox_id, exclude=exclude)
        except vaultlib.VaultSealed:
            return Refusal(503, "vault_sealed", "the credential vault is sealed; request bodies cannot be checked")
        except vaultlib.VaultError as e:
            return Refusal(503, "vault_error", f"vault lookup failed ({type(e).__name__})")

    def report_leak(self, conn, secret_ids, where: str) -> None:
        sandbox = conn.identity.sandbox_id if conn.identity else "-"
        if self.metrics is not None:
            self.metrics.leaks_blocked.labels(sandbox).inc()
        log.warning("ALERT credential leak blocked: sandbox %s sent secret(s) %s in %s to %s",
                    sandbox, ",".join(sorted(secret_ids)), where, conn.host)
        self.alert({"sandbox": sandbox, "secrets": sorted(secret_ids), "where": where, "host": conn.host})

    def _leak_check(self, flow, conn, tenant, sandbox, data, injection, where) -> Refusal | None:
        try:
            leaks = self.vault.find_leaks(tenant, sandbox, data)
        except vaultlib.VaultSealed:
            if not self.vault.list_secrets(tenant):
                return None   # nothing this tenant could leak
            return Refusal(503, "vault_sealed", "the credential vault is sealed; requests cannot be checked")
        except vaultlib.VaultError as e:
            return Refusal(503, "vault_error", f"vault lookup failed ({type(e).__name__})")
        if injection is not None:
            leaks = [s for s in leaks if s != injection.secret_id]
        if not leaks:
            return None
        self.report_leak(conn, leaks, where)
        return Refusal(403, "credential_leak",
                       f"request {where} carry secret(s) {', '.join(sorted(leaks))} to {conn.host}, "
                       "which they are not bound to")

    # -- response stage ----------------------------------------------------------
    def injected_forms(self, flow: http.HTTPFlow) -> "vaultlib.ScrubForms | None":
        """Spellings of the value injected into this flow's request, compiled once per
        injection (None: nothing injected)."""
        injection = flow.metadata.get(_INJECTION_KEY)
        return injection.scrub_forms if injection is not None else None

    def on_response_headers(self, flow: http.HTTPFlow, conn) -> Refusal | None:
        """Scrub the injected value from response headers; refuse what cannot be made safe."""
        injection = flow.metadata.get(_INJECTION_KEY)
        if injection is None or flow.response is None:
            return None
        resp = flow.response
        if resp.status_code == 206 or "content-range" in resp.headers:
            return Refusal(502, "range_on_injected_flow",
                           "a partial response on a flow that carried a credential cannot be scrubbed whole")
        # The reason phrase is free text the upstream chooses: the standard one goes to the sandbox.
        resp.reason = http.status_codes.RESPONSES.get(resp.status_code, "")
        fields = resp.headers.fields
        joined = b"".join(n + v for n, v in fields)
        if injection.scrub_forms.occurs_in(joined):   # (no form in the whole: none in any one header)
            fields = tuple((injection.scrub(name), injection.scrub(value)) for name, value in fields)
            resp.headers.fields = fields
            joined = b"".join(n + v for n, v in fields)
        # The value split over several headers, or spelled with escapes, survives a per-header scrub.
        if _visible(injection, joined) or _visible(injection, b"".join(v for _, v in fields)):
            return Refusal(502, "response_unscrubbable",
                           "response headers carry the injected credential in a form that cannot be removed")
        return None

    def scrub_trailers(self, flow: http.HTTPFlow, trailers):
        """Response trailers on an injected flow: scrubbed; one still carrying the value is dropped."""
        injection = flow.metadata.get(_INJECTION_KEY)
        if injection is None:
            return trailers
        kept = []
        for name, value in trailers.fields:
            name, value = injection.scrub(name), injection.scrub(value)
            if not _visible(injection, name + value):
                kept.append((name, value))
        trailers.fields = tuple(kept)
        return trailers if kept else None

    @property
    def scrubs_bodies(self) -> bool:
        return self.scrub_bodies


def _visible(injection, data: bytes) -> bool:
    """The injected value in `data` in any spelling a receiver could undo (every escape view)."""
    return injection.scrub_forms.visible(data)


def _header_blob(req: http.Request) -> bytes:
    return header_blob(req.url, req.headers.fields)


def header_blob(url: str, fields) -> bytes:
    """What the header leak check scans: the URL, every header, and all values concatenated."""
    # The value split across two headers is only whole in their concatenation (the last part).
    return b"\n".join([url.encode("utf-8", "replace"), *[k + b": " + v for k, v in fields],
                       b"".join([v for _, v in fields])])


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
