"""The policy in force, from files (PolicyStore) and the policy API's versioned store (PolicyRepo).

An API policy with the same name as a file policy replaces it (the file's
comes back when the API's is deleted). Every change is checked as the whole
set it would produce, stored as a new version, then swapped in with one
assignment: the next decision sees all of it or none of it. A change that
does not compile is refused and changes nothing. Callbacks (the gate's
revocation) run after every swap, from files or from the API.
"""
from __future__ import annotations

import hashlib
import json
import logging
import threading
from collections.abc import Callable

import yaml

from .compiled import CompiledPolicySet
from .effective import EffectivePolicy
from .errors import ErrorItem, PolicyError
from .grants import Grant, GrantIndex, parse_grant
from .loader import parse_policy_document
from .model import GlobalDenies, Policy
from .network import SandboxNetwork, parse_network
from .reload import PolicyStore, ReloadResult
from .repo import PolicyRepo, Version
from .serialize import policy_to_doc

log = logging.getLogger(__name__)
ChangeCallback = Callable[[EffectivePolicy, EffectivePolicy], None]


class NotFound(KeyError):
    def __str__(self) -> str:
        return str(self.args[0])


class Refused(ValueError):
    """A change that is well-formed but not allowed (deleting a file policy, ...)."""


MAX_POLICY_BYTES = 256 * 1024   # a policy given through the API (YAML is parsed in pure Python: ~1 s per 50 KB)


def _source(kind: str, name: str) -> str:
    return f"api:{kind}:{name}"


class LivePolicies:
    def __init__(self, files: PolicyStore, repo: PolicyRepo):
        self.files = files
        self.repo = repo
        self._lock = threading.RLock()
        self._callbacks: list[ChangeCallback] = []
        self._run_swap: Callable[[Callable[[], None]], None] = lambda swap: swap()
        self._conflict: str | None = None    # files that load alone but clash with API policies
        self._api: dict[str, Policy] = {}
        for name, v in repo.current("policy").items():
            self._api[name] = parse_policy_document(json.dumps(v.doc), _source("policy", name), name=name)
        self._grants = {n: parse_grant(n, v.doc) for n, v in repo.current("grant").items()}
        self._networks = {n: parse_network(v.doc, source=_source("network", n))
                          for n, v in repo.current("network").items()}
        self._base_key = None
        self._base: CompiledPolicySet | None = None
        self._head = repo.head()             # the store's last change this set was built from
        self._current = self._build(self._api, self._grants, self._networks)   # raises PolicyError: fail closed
        files.on_change(self._files_changed)

    # ------------------------------------------------------------- what is in force
    @property
    def current(self) -> EffectivePolicy:
        return self._current

    @property
    def digest(self) -> str:
        return self._current.digest

    @property
    def last_error(self) -> str | None:
        """Why the last file reload was not taken (shown on /readyz), else None."""
        return self.files.last_error or self._conflict

    def on_change(self, callback: ChangeCallback) -> ChangeCallback:
        self._callbacks.append(callback)
        return callback

    def swap_through(self, run: Callable[[Callable[[], None]], None]) -> None:
        """Every swap (the assignment and the callbacks) runs as run(swap), which returns once it
        ran: a worker builds on a thread and swaps on its event loop, where its decisions are made."""
        self._run_swap = run

    # file reloads keep working as before (the daemon's watch loop and SIGHUP)
    def reload(self) -> ReloadResult:
        res = self.files.reload()
        return self._with_error(res)

    def check_for_changes(self, **kw) -> ReloadResult | None:
        res = self.files.check_for_changes(**kw)
        return self._with_error(res) if res is not None else None

    def _with_error(self, res: ReloadResult) -> ReloadResult:
        if res.ok and self._conflict is not None:
            return ReloadResult(False, self._conflict, self.digest, False)
        return res

    def refresh(self, *, settle: bool = False) -> bool:
        """Follow changes another process made (the daemon's policy API, runtime, grant expiry
        write the store; a worker process reads it): files first, then the store, each taken
        whole in one swap. True when the store's change was swapped in."""
        self.check_for_changes(settle=settle)
        with self._lock:
            head = self.repo.head()
            if head == self._head:
                return False
            try:
                api = {name: parse_policy_document(json.dumps(v.doc), _source("policy", name), name=name)
                       for name, v in self.repo.current("policy").items()}
                grants = {n: parse_grant(n, v.doc) for n, v in self.repo.current("grant").items()}
                networks = {n: parse_network(v.doc, source=_source("network", n))
                            for n, v in self.repo.current("network").items()}
                new = self._build(api, grants, networks)
            except PolicyError as e:   # the writer checked it; if it does not build here, keep the old set
                log.error("policy store change %s not taken, keeping the old set: %s", head, e)
                return False
            self._api, self._grants, self._networks, self._head = api, grants, networks, head
            self._swap(new)
            return True

    def _files_changed(self, old_files, new_files) -> None:
        with self._lock:
            try:
                self._swap(self._build(self._api, self._grants, self._networks))
                self._conflict = None
            except PolicyError as e:
                self._conflict = f"policy files conflict with API policies, keeping the old set: {e}"
                log.error("%s", self._conflict)

    # ------------------------------------------------------------------ building
    def _build(self, api: dict[str, Policy], grants: dict[str, Grant],
               networks: dict[str, SandboxNetwork]) -> EffectivePolicy:
        files = self.files.current
        key = (files.digest, tuple(sorted((n, id(p)) for n, p in api.items())))
        if key != self._base_key:
            policies = [cp.policy for cp in files.policies if cp.name not in api] + list(api.values())
            base = CompiledPolicySet(policies, GlobalDenies(domains=files.global_denied_domains,
                                                            cidrs=files.global_denied_cidrs),
                                     digest="", sources=(*files.sources, "api"))
        else:
            base = self._base
        eff = EffectivePolicy(base, GrantIndex(grants.values()), networks, digest=self._digest(files, self.repo.head()))
        eff._key = key
        return eff

    @staticmethod
    def _digest(files, seq: int) -> str:
        """Files' digest + the store's last change: every swap gets a new one."""
        return hashlib.sha256(f"{files.digest}\0{seq}".encode()).hexdigest()

    def _swap(self, new: EffectivePolicy) -> None:
        self._run_swap(lambda: self._swap_now(new))

    def _swap_now(self, new: EffectivePolicy) -> None:
        old, self._current = self._current, new
        self._base_key, self._base = new._key, new.base
        for cb in list(self._callbacks):
            try:
                cb(old, new)
            except Exception:   # a listener must not undo a good change
                log.exception("policy change callback failed")

    def _change(self, kind: str, name: str, parsed, doc: dict | None, *, action: str, actor: str,
                note: str | None = None) -> Version:
        """Check the whole resulting set, store the version, swap. PolicyError: nothing changed."""
        with self._lock:
            maps = {"policy": dict(self._api), "grant": dict(self._grants), "network": dict(self._networks)}
            if parsed is None:
                maps[kind].pop(name, None)
            else:
                maps[kind][name] = parsed
            new = self._build(maps["policy"], maps["grant"], maps["network"])
            version = self.repo.commit(kind, name, doc, action=action, actor=actor, note=note)
            self._head = version.seq
            new.digest = new.base.digest = self._digest(self.files.current, version.seq)
            self._api, self._grants, self._networks = maps["policy"], maps["grant"], maps["network"]
            self._swap(new)
            return version

    # ------------------------------------------------------------------ policies
    def parse(self, name: str, text: str) -> tuple[Policy, dict]:
        """Parse one policy body (JSON or YAML) and check the set it would make; (policy, doc)."""
        size = len(text.encode("utf-8", "surrogatepass"))
        if size > MAX_POLICY_BYTES:
            raise PolicyError(ErrorItem(_source("policy", name), 1, "",
                                        f"policy is {size} bytes; at most {MAX_POLICY_BYTES // 1024} KiB"))
        policy = parse_policy_document(text, _source("policy", name), name=name)
        with self._lock:
            api = {**self._api, name: policy}
            self._build(api, self._grants, self._networks)   # cross-policy checks (raises PolicyError)
        doc = yaml.safe_load(text)
        doc["name"] = name
        return policy, doc

    def put_policy(self, name: str, text: str, *, actor: str) -> Version:
        policy, doc = self.parse(name, text)
        action = "replace" if name in self._api else "create"
        return self._change("policy", name, policy, doc, action=action, actor=actor)

    def delete_policy(self, name: str, *, actor: str) -> Version:
        if name not in self._api:
            if self.files.current.policy(name) is not None:
                cp = self.files.current.policy(name)
                raise Refused(f"policy {name!r} is defined in {cp.file}; remove it there")
            raise NotFound(f"no policy {name!r}")
        return self._change("policy", name, None, None, action="delete", actor=actor)

    def rollback(self, name: str, version: int, *, actor: str) -> Version:
        """Make version `version` of an API policy current again (as a new version)."""
        v = self.repo.get("policy", name, version)
        if v is None:
            raise NotFound(f"policy {name!r} has no version {version}")
        if v.doc is None:
            return self.delete_policy(name, actor=actor) if name in self._api else self.repo.latest("policy", name)
        text = json.dumps(v.doc)
        policy = parse_policy_document(text, _source("policy", name), name=name)
        return self._change("policy", name, policy, v.doc, action="rollback", actor=actor, note=f"to version {version}")

    def describe(self, name: str) -> dict:
        """A policy in force: its document, where it comes from, its version (API)."""
        cp = self._current.policy(name)
        if cp is None:
            raise NotFound(f"no policy {name!r}")
        out = {"name": name, "source": "api" if name in self._api else "file", "policy": policy_to_doc(cp.policy)}
        if name in self._api:
            latest = self.repo.latest("policy", name)
            out.update(version=latest.version, policy=latest.doc, actor=latest.actor, ts=latest.ts)
            shadowed = self.files.current.policy(name)
            if shadowed is not None:
                out["overrides_file"] = shadowed.file
        else:
            out["file"] = cp.file
        return out

    def list_policies(self) -> list[dict]:
        out = []
        for cp in self._current.policies:
            api = self.repo.latest("policy", cp.name) if cp.name in self._api else None
            out.append({"name": cp.name, "source": "api" if api else "file", "version": api.version if api else None,
                        "file": None if api else cp.file, "mode": cp.mode, "rules": len(cp.rules),
                        "default_policy": cp.applies_to is None})
        return out

    def history(self, kind: str, name: str) -> list[Version]:
        versions = self.repo.history(kind, name)
        if not versions:
            raise NotFound(f"no {kind} {name!r} was ever changed through the API")
        return versions

    # ------------------------------------------------------------------ grants
    def put_grant(self, name: str, doc: dict, *, actor: str, note: str | None = None) -> Version:
        grant = parse_grant(name, doc)
        return self._change("grant", name, grant, doc, action="replace" if name in self._grants else "create",
                            actor=actor, note=note)

    def delete_grant(self, name: str, *, actor: str, action: str = "delete") -> Version:
        if name not in self._grants:
            raise NotFound(f"no grant {name!r}")
        return self._change("grant", name, None, None, action=action, actor=actor)

    def grants(self) -> dict[str, Grant]:
        return dict(self._grants)

    def expire_grants(self, now: float, *, actor: str = "expiry") -> list[str]:
        gone = [n for n, g in self._grants.items() if g.expires is not None and g.expires <= now]
        for n in gone:
            self.delete_grant(n, actor=actor, action="expire")
        return gone

    def drop_sandbox_grants(self, sandbox_id: str, *, actor: str) -> list[str]:
        """A sandbox that is gone takes the grants scoped to its id with it (ids are reused:
        the next sandbox of that name must inherit nothing). A grant that also names other
        sandboxes or a label selector loses only this id. Names of the grants changed."""
        changed = []
        with self._lock:
            for name, g in sorted(self._grants.items()):
                if sandbox_id not in g.sandboxes:
                    continue
                rest = sorted(g.sandboxes - {sandbox_id})
                if not rest and not g.labels:
                    self._change("grant", name, None, None, action="delete", actor=actor,
                                 note=f"sandbox {sandbox_id} destroyed")
                else:
                    doc = g.to_doc()
                    doc["applies_to"].pop("sandboxes", None)
                    if rest:
                        doc["applies_to"]["sandboxes"] = rest
                    self._change("grant", name, parse_grant(name, doc), doc, action="replace", actor=actor,
                                 note=f"sandbox {sandbox_id} destroyed")
                changed.append(name)
        return changed

    # ------------------------------------------------------------------ networks
    def set_network(self, sandbox_id: str, doc: dict, *, actor: str) -> Version:
        net = parse_network(doc, source=_source("network", sandbox_id))
        return self._change("network", sandbox_id, net, net.to_doc(),
                            action="replace" if sandbox_id in self._networks else "create", actor=actor)

    def remove_network(self, sandbox_id: str, *, actor: str) -> Version | None:
        if sandbox_id not in self._networks:
            return None
        return self._change("network", sandbox_id, None, None, action="delete", actor=actor)

    def network(self, sandbox_id: str) -> SandboxNetwork | None:
        return self._networks.get(sandbox_id)


def refusal_items(e: PolicyError) -> list[dict]:
    """PolicyError → [{pointer, message}] for an API body."""
    return e.pointers()


__all__ = ["LivePolicies", "NotFound", "Refused", "refusal_items", "ErrorItem"]
