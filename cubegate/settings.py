"""Daemon settings: one typed declaration, loaded from YAML + environment, validated up front.

Every field has a default so `cubegate run` works with no file at all; a file
only overrides what it names. Precedence, lowest first: defaults, the YAML
file, CUBEGATE_* environment variables, command-line flags (--state-dir).

Environment form: ``CUBEGATE_<SECTION>__<KEY>`` for a key in a section, e.g.
``CUBEGATE_PROXY__EXPLICIT_PORT=8081``, and ``CUBEGATE_<KEY>`` for a top-level
key (``CUBEGATE_STATE_DIR``, ``CUBEGATE_POLICY_DIR``, ``CUBEGATE_POLICY_POLL_SECONDS``).
A value is read as a YAML scalar or flow list, like the file
(``CUBEGATE_UPSTREAM__NAMESERVERS='[192.0.2.53, "192.0.2.54:5353"]'``,
``CUBEGATE_DNS__LISTEN_HOST=null``). A ``CUBEGATE_X__Y`` that names no setting
is an error (a typo must not silently fall back to a default).

Unknown keys, wrong types, out-of-range numbers, unknown enum values, bad ports,
addresses and CIDRs are errors. Every error names where the bad value came
from: ``settings.yaml:7: proxy.header_timeout: must be > 0`` or
``CUBEGATE_PROXY__EXPLICIT_PORT: proxy.explicit_port: must be <= 65535``.
"""
from __future__ import annotations

import difflib
import ipaddress
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, Strict, ValidationError

ENV_PREFIX = "CUBEGATE_"
ENV_NESTED = "__"


class SettingsError(ValueError):
    pass


# ---------------------------------------------------------------- field types
def _seconds(gt: float = 0, le: float = 86400.0, ge: float | None = None):
    bounds = {"ge": ge} if ge is not None else {"gt": gt}
    return Annotated[float, Strict(), Field(le=le, **bounds)]


def _count(ge: int, le: int):
    return Annotated[int, Strict(), Field(ge=ge, le=le)]


def _check_path(v: str) -> str:
    if not v.strip() or "\0" in v:
        raise ValueError("must be a non-empty path")
    return v


def _check_existing_file(v: str) -> str:
    _check_path(v)
    if not Path(v).is_file():
        raise ValueError(f"no such file: {v}")
    return v


_HOSTNAME = re.compile(r"(?=.{1,253}$)[A-Za-z0-9_]([A-Za-z0-9_-]{0,62})(\.[A-Za-z0-9_]([A-Za-z0-9_-]{0,62}))*\.?")


def _check_host(v: str) -> str:
    try:
        ipaddress.ip_address(v)
        return v
    except ValueError:
        pass
    if not _HOSTNAME.fullmatch(v):
        raise ValueError(f"not an IP address or host name: {v!r}")
    return v


def _check_ip(v: str) -> str:
    try:
        ipaddress.ip_address(v)
    except ValueError:
        raise ValueError(f"not an IP address: {v!r}") from None
    return v


def _check_cidr(v: str) -> str:
    try:
        ipaddress.ip_network(v, strict=False)
    except ValueError as e:
        raise ValueError(f"bad CIDR {v!r}: {e}") from None
    return v


def _check_nameserver(v: str) -> str:
    """"ip", "ip:port", "[v6]:port" or bare "v6" (what egress.netguard.GuardedResolver takes)."""
    host, port = v.strip(), "53"
    if host.startswith("["):
        host, _, rest = host[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else ("53" if not rest else "x")
    elif host.count(":") == 1:
        host, _, port = host.partition(":")
    try:
        ipaddress.ip_address(host)
        if not port.isdigit() or not 1 <= int(port) <= 65535:
            raise ValueError
    except ValueError:
        raise ValueError(f"nameserver must be ip, ip:port or [v6]:port, got {v!r}") from None
    return v


_NETNS = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def _check_netns(v: str) -> str:
    if not _NETNS.fullmatch(v):
        raise ValueError(f"not a network namespace name: {v!r}")
    return v


Str = Annotated[str, Strict()]
PathStr = Annotated[str, Strict(), AfterValidator(_check_path)]
ExistingFile = Annotated[str, Strict(), AfterValidator(_check_existing_file)]
Host = Annotated[str, Strict(), AfterValidator(_check_host)]
IpAddr = Annotated[str, Strict(), AfterValidator(_check_ip)]
Cidr = Annotated[str, Strict(), AfterValidator(_check_cidr)]
Nameserver = Annotated[str, Strict(), AfterValidator(_check_nameserver)]
Port = Annotated[int, Strict(), Field(ge=1, le=65535)]
PortOrZero = Annotated[int, Strict(), Field(ge=0, le=65535)]   # 0: the kernel picks one
Bool = Annotated[bool, Strict()]
Backend = Literal["namespace", "microvm"]
TemplateName = Annotated[str, Strict(), Field(pattern=r"^[a-z0-9][a-z0-9_-]{0,31}$")]   # manager.TEMPLATE_NAME_RE
KiB, MiB, GiB = 1024, 1024 ** 2, 1024 ** 3


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# ------------------------------------------------------------------- sections
class ProxySettings(_Section):
    listen_host: Host = "127.0.0.1"
    explicit_port: PortOrZero = 8080
    transparent_port: Port | None = None        # set when cubevs steers traffic here
    connect_timeout: _seconds(le=3600) = 10.0
    idle_timeout: _count(1, 7 * 86400) = 300     # close a connection idle this long (mitmproxy tcp_timeout)
    header_timeout: _seconds(le=3600) = 15.0     # slowloris: request head / ClientHello complete this long after connect
    upstream_timeout: _seconds() = 300.0         # connect + response head (not body) from the upstream, else 502
    drain_seconds: _seconds(ge=0, le=3600) = 10.0  # SIGTERM: in-flight flows may finish this long
    max_header_bytes: _count(1 * KiB, 16 * MiB) = 32 * KiB
    max_header_count: _count(1, 10_000) = 100
    max_connections_per_sandbox: _count(1, 1_000_000) = 256   # open client connections one sandbox may hold
    max_body_bytes: _count(1, 1024 * GiB) = 64 * MiB           # decoded size of a body the gateway must inspect
    inspect_buffer_bytes: _count(0, 1 * GiB) = 1 * MiB         # inspected bodies up to this (known length) are
                                                               # buffered whole, so a refusal is a readable 403/502
    max_buffered_bytes_per_sandbox: _count(0, 64 * GiB) = 16 * MiB  # all of one sandbox's buffered bodies
    fast_path: Bool = True                      # our listeners decide and relay what needs no interception;
                                                # false: mitmproxy alone (the fallback)
    fast_plain_http: Bool = True                # plain HTTP parsed, decided and relayed by the fast path
                                                # (egress/fastpath/plain.py); false: mitmproxy decides it
    kernel_splice: Literal["off", "auto"] = "off"   # auto (experimental, unsafe on kernel 6.18: see
                                                # egress/fastpath/relay.py SpliceRelay): a passthrough's two
                                                # sockets are joined in the kernel (cubevs sockmap)
    workers: _count(1, 32) | None = None        # data-plane processes (fast path + mitmproxy + gate), each on
                                                # every proxy port; None: the CPUs available to the daemon
                                                # (1 with fast_path off: mitmproxy's listeners cannot share a port)
    event_loop: Literal["uvloop", "asyncio"] = "uvloop"   # the workers' loop (uvloop: every resolve still guarded,
                                                          # egress/guarded_uvloop.py); asyncio: the stdlib loop

    @property
    def worker_count(self) -> int:
        if self.workers is not None:
            return self.workers
        return min(32, len(os.sched_getaffinity(0))) if self.fast_path else 1


class OpsSettings(_Section):
    listen_host: Host = "127.0.0.1"
    port: PortOrZero = 9090                     # /healthz /readyz /metrics


class UpstreamSettings(_Section):
    ca_bundle: ExistingFile | None = None       # extra trusted CA for upstream TLS (tests)
    nameservers: tuple[Nameserver, ...] = ()    # empty = system resolver
    allow_cidrs: tuple[Cidr, ...] = ()          # exemptions from the private-range guard
    deny_cidrs: tuple[Cidr, ...] = ()


class AuditSettings(_Section):
    dir: PathStr | None = None                  # default: <state_dir>/audit
    fsync: Literal["always", "interval", "never"] = "interval"
    max_bytes: _count(4 * KiB, 1024 * GiB) = 64 * MiB
    keep_files: _count(1, 100_000) = 20
    retention_days: _count(1, 36_500) | None = None
    # refused connections/requests written one by one per sandbox (or unidentified client address)
    # and interval; the rest counted into one refusals_counted record per interval (egress.refusal_budget)
    refusals_written_per_interval: _count(0, 1_000_000) = 200
    refusal_interval_seconds: _seconds(le=3600) = 60.0


class VaultSettings(_Section):
    path: PathStr | None = None                 # default: <state_dir>/vault.db
    key_file: PathStr | None = None             # default: <state_dir>/vault.key
    api_port: Port = 9091                       # admin API, loopback only
    scrub_response_bodies: Bool = True          # also remove injected values echoed in bodies


class CubevsSettings(_Section):
    state_dir: PathStr | None = None            # cubevs registry; default: <state_dir>/cubevs


class DnsSettings(_Section):
    listen_host: IpAddr | None = None           # sandbox DNS resolver; None = disabled
    port: Port = 53
    audit_interval_seconds: _seconds(le=3600) = 60.0   # allowed answers: one aggregated record per sandbox+name per interval
    max_new_names_per_minute: _count(1, 1_000_000) = 120  # distinct new names one sandbox may resolve under one wildcard


class RuntimeSettings(_Section):
    enabled: Bool = False                       # sandbox runtime + its REST API (needs transparent mode)
    api_port: Port = 9092                       # loopback only
    backends: Annotated[tuple[Backend, ...], Field(min_length=1, max_length=2)] = ("namespace",)
    default_backend: Backend = "namespace"
    memory_mb: _count(64, 1 << 24) | None = None      # host budget; None = MemTotal - host_reserve_mb
    cpus: Annotated[float, Strict(), Field(gt=0, le=4096)] | None = None  # None = CPUs this process may use
    max_sandboxes: _count(1, 100_000) = 1000
    host_reserve_mb: _count(0, 1 << 24) = 512
    default_memory_mb: _count(16, 1 << 20) = 256      # per-sandbox limits when a request names none
    default_cpus: Annotated[float, Strict(), Field(gt=0, le=1024)] = 0.25
    default_pids: _count(1, 1 << 22) = 256
    default_disk_mb: _count(1, 1 << 20) = 256
    microvm_assets: PathStr | None = None       # default: <repo>/.cache/microvm (`make setup` builds it)
    hub_netns: Annotated[str, Strict(), AfterValidator(_check_netns)] | None = None  # None = the daemon's own
    template_cache: PathStr | None = None       # built templates; default <state_dir>/.cache/templates
    default_template: TemplateName | None = None  # template of sandboxes whose request names none (None: host /usr)
    pool_size: _count(0, 1024) = 0              # network slots (netns + veth + maps), and namespace launchers
                                                # (parked in their own cgroups), kept ready ahead of creates
    auto_pause_seconds: _seconds(le=7 * 86400) | None = None   # freeze a sandbox idle this long (no exec or other
                                                # call on it, no traffic); the next call resumes it. None: never
    paused_capacity: Literal["full", "memory"] = "full"   # what a paused sandbox keeps reserved: its whole
                                                # footprint, or its memory only (CPUs free; a resume may get 429)
    max_snapshots: _count(0, 100_000) = 100     # snapshots kept on disk (<state_dir>/runtime/snapshots)
    tenant_share: Annotated[float, Strict(), Field(gt=0, le=1)] | None = None   # of the budget (count, memory,
                                                # CPUs) one tenant's sandboxes may hold; None: 0.5 when the E2B
                                                # API names more than one tenant (e2b.token_tenants), else 1


def _check_webhook_url(v: str) -> str:
    from urllib.parse import urlsplit
    u = urlsplit(v)
    if u.scheme not in ("http", "https") or not u.hostname:
        raise ValueError(f"webhook URL must be http(s)://host[:port]/path, got {v!r}")
    return v


class PolicyApiSettings(_Section):
    enabled: Bool = True
    port: Port = 9093                            # policy + access-request admin API, loopback only


class AccessSettings(_Section):
    webhook_url: Annotated[str, Strict(), AfterValidator(_check_webhook_url)] | None = None  # POST per new request
    webhook_timeout_seconds: _seconds(le=60) = 5.0
    requests_per_minute: _count(1, 600) = 6            # access requests one sandbox may file (token bucket)
    max_pending_per_sandbox: _count(1, 1000) = 20
    max_reason_chars: _count(0, 2000) = 500
    denials_kept_per_sandbox: _count(1, 10_000) = 50   # cubegate.internal/v1/denials ring
    grant_sweep_seconds: _seconds(le=3600) = 5.0       # how often expired grants are removed


_TENANT = Annotated[str, Strict(), Field(pattern=r"^[a-z0-9][a-z0-9_.-]{0,63}$")]


class E2bTemplate(_Section):
    kind: Literal["base", "code-interpreter"] = "base"
    backend: Backend | None = None              # None: runtime.default_backend
    memory_mb: _count(16, 1 << 20) | None = None
    cpus: Annotated[float, Strict(), Field(gt=0, le=1024)] | None = None
    disk_mb: _count(1, 1 << 20) | None = None


class E2bSettings(_Section):
    enabled: Bool = False                       # the E2B-compatible API (needs runtime.enabled)
    port: Port = 3000                           # loopback only: E2B_API_URL and E2B_SANDBOX_URL point here
    domain: Str | None = None                   # also route Host <port>-<id>.<domain>; None: any domain
    tenant: _TENANT = "default"                 # the tenant of every API key not named below
    token_tenants: dict[Str, _TENANT] = {}      # token id ("local" = the runtime token file) -> tenant
    default_timeout_seconds: _count(1, 7 * 86400) = 300
    max_timeout_seconds: _count(1, 30 * 86400) = 86400
    max_upload_mb: _count(1, 4096) = 256
    templates: dict[Str, E2bTemplate] = {}      # more template ids (or overrides of base / code-interpreter-v1)


class ConsoleSettings(_Section):
    enabled: Bool = False                       # the web console (cubegate/console/), loopback only
    port: PortOrZero = 9094
    idle_timeout: _seconds(le=86400) = 900.0    # a session unused this long ends (polls and streams do not count)
    max_session: _seconds(le=7 * 86400) = 43200.0   # and every session ends this long after login
    tls_cert: ExistingFile | None = None        # both set: HTTPS (cookies then Secure, __Host- names)
    tls_key: ExistingFile | None = None
    sample_seconds: _seconds(ge=0.2, le=60) = 5.0   # chart sampling of the daemon's metrics (15 minutes kept)


class Settings(_Section):
    state_dir: PathStr = "/var/lib/cubegate"
    policy_dir: PathStr = "policies"
    policy_poll_seconds: _seconds(le=3600) = 1.0
    proxy: ProxySettings = ProxySettings()
    ops: OpsSettings = OpsSettings()
    upstream: UpstreamSettings = UpstreamSettings()
    audit: AuditSettings = AuditSettings()
    vault: VaultSettings = VaultSettings()
    cubevs: CubevsSettings = CubevsSettings()
    dns: DnsSettings = DnsSettings()
    runtime: RuntimeSettings = RuntimeSettings()
    policy_api: PolicyApiSettings = PolicyApiSettings()
    access: AccessSettings = AccessSettings()
    e2b: E2bSettings = E2bSettings()
    console: ConsoleSettings = ConsoleSettings()

    # Derived paths -------------------------------------------------------
    @property
    def audit_dir(self) -> Path:
        return Path(self.audit.dir or Path(self.state_dir) / "audit")

    @property
    def policy_db(self) -> Path:
        return Path(self.state_dir) / "policies.db"

    @property
    def admin_token_file(self) -> Path:
        return Path(self.state_dir) / "admin.token"

    @property
    def identity_db(self) -> Path:
        return Path(self.state_dir) / "identities.db"

    @property
    def ca_dir(self) -> Path:
        return Path(self.state_dir) / "ca"

    @property
    def vault_db(self) -> Path:
        return Path(self.vault.path or Path(self.state_dir) / "vault.db")

    @property
    def cubevs_state_dir(self) -> Path:
        return Path(self.cubevs.state_dir or Path(self.state_dir) / "cubevs")

    @property
    def runtime_dir(self) -> Path:
        return Path(self.state_dir) / "runtime"

    @property
    def template_cache_dir(self) -> Path:
        return Path(self.runtime.template_cache or Path(self.state_dir) / ".cache" / "templates")

    @property
    def microvm_assets_dir(self) -> Path:
        if self.runtime.microvm_assets:
            return Path(self.runtime.microvm_assets)
        from sandbox_runtime.microvm.assets import default_assets_dir   # built by `make setup`
        return Path(default_assets_dir())

    @property
    def vault_key_file(self) -> Path:
        return Path(self.vault.key_file or Path(self.state_dir) / "vault.key")


def _cross_checks(s: Settings) -> list[tuple[tuple, str]]:
    """Rules between fields: (key path to blame, message)."""
    out = []
    rt = s.runtime
    if rt.enabled and not s.proxy.transparent_port:
        out.append((("runtime", "enabled"), "needs proxy.transparent_port: sandbox traffic is steered there"))
    if rt.default_backend not in rt.backends:
        out.append((("runtime", "default_backend"), f"{rt.default_backend!r} is not in runtime.backends"))
    if s.e2b.enabled and not rt.enabled:
        out.append((("e2b", "enabled"), "needs runtime.enabled: E2B sandboxes are runtime sandboxes"))
    for tid, t in s.e2b.templates.items():
        if t.backend is not None and t.backend not in rt.backends:
            out.append((("e2b", "templates", tid, "backend"), f"{t.backend!r} is not in runtime.backends"))
    if len(set(rt.backends)) != len(rt.backends):
        out.append((("runtime", "backends"), "lists a backend twice"))
    if (s.proxy.workers or 1) > 1 and not s.proxy.fast_path:
        out.append((("proxy", "workers"), "more than one worker needs proxy.fast_path (mitmproxy alone cannot "
                                          "share its listening ports)"))
    c = s.console
    if (c.tls_cert is None) != (c.tls_key is None):
        out.append((("console", "tls_cert" if c.tls_cert is None else "tls_key"),
                    "console TLS needs both tls_cert and tls_key"))
    return out


# --------------------------------------------------------------------- sources
class _Origins:
    """Where each key path's value came from: a file line or an environment variable."""

    def __init__(self, file: str):
        self.file = file
        self.lines: dict[tuple, int] = {}
        self.env: dict[tuple, str] = {}

    def where(self, loc: tuple) -> str:
        for n in range(len(loc), 0, -1):   # the most precise known prefix
            if loc[:n] in self.env:
                return self.env[loc[:n]]
            if loc[:n] in self.lines:
                return f"{self.file}:{self.lines[loc[:n]]}"
        return self.file


def _map_lines(node, path: tuple, lines: dict[tuple, int], errors: list[str], file: str) -> None:
    if isinstance(node, yaml.MappingNode):
        seen = set()
        for key_node, value_node in node.value:
            key = key_node.value if isinstance(key_node, yaml.ScalarNode) else str(key_node.value)
            sub = (*path, key)
            line = key_node.start_mark.line + 1
            if key in seen:
                errors.append(f"{file}:{line}: {'.'.join(map(str, sub))}: duplicate key")
            seen.add(key)
            lines[sub] = line
            _map_lines(value_node, sub, lines, errors, file)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            lines[(*path, i)] = item.start_mark.line + 1
            _map_lines(item, (*path, i), lines, errors, file)


def _read_file(p: Path, origins: _Origins) -> dict:
    try:
        text = p.read_text()
    except OSError as e:
        raise SettingsError(f"{p}: cannot read: {e.strerror}") from None
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f"{p}:{mark.line + 1}" if mark is not None else str(p)
        raise SettingsError(f"{at}: invalid YAML: {getattr(e, 'problem', None) or e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise SettingsError(f"{p}:1: top level must be a mapping, got {type(data).__name__}")
    errors: list[str] = []
    _map_lines(node, (), origins.lines, errors, str(p))
    if errors:
        raise SettingsError("\n".join(errors))
    return data


def _env_overrides(environ: Mapping[str, str], origins: _Origins) -> dict:
    """CUBEGATE_<SECTION>__<KEY> and CUBEGATE_<TOP_LEVEL_KEY> → a nested mapping."""
    sections = {name for name, f in Settings.model_fields.items() if isinstance(f.default, BaseModel)}
    scalars = set(Settings.model_fields) - sections
    out: dict[str, Any] = {}
    errors = []
    for var in sorted(environ):
        if not var.startswith(ENV_PREFIX):
            continue
        rest = var[len(ENV_PREFIX):].lower()
        if ENV_NESTED in rest:
            section, _, key = rest.partition(ENV_NESTED)
            if section not in sections or key not in type(Settings.model_fields[section].default).model_fields:
                known = ", ".join(f"{ENV_PREFIX}{s.upper()}{ENV_NESTED}KEY" for s in sorted(sections))
                errors.append(f"{var}: names no setting ({section}.{key}); the form is {known}")
                continue
            path = (section, key)
        elif rest in scalars:
            path = (rest,)
        else:
            continue   # another CUBEGATE_* variable (CUBEGATE_CONFIG, CUBEGATE_VAULT_KEY, ...)
        raw = environ[var]
        try:
            value = yaml.safe_load(raw) if raw.strip() else raw
        except yaml.YAMLError:
            value = raw
        if isinstance(value, (int, float, bool)) and _is_text_field(path) and not isinstance(value, bool):
            value = raw   # a path or host that happens to look like a number
        target = out
        for part in path[:-1]:
            target = target.setdefault(part, {})
        target[path[-1]] = value
        origins.env[path] = var
    if errors:
        raise SettingsError("\n".join(errors))
    return out


def _is_text_field(path: tuple) -> bool:
    model: type[BaseModel] = Settings
    for part in path[:-1]:
        model = type(model.model_fields[part].default)
    return model.model_fields[path[-1]].annotation in (str, str | None)


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


# ---------------------------------------------------------------------- errors
def _message(err: dict) -> str:
    t = err["type"]
    ctx = {k: int(v) if isinstance(v, float) and v.is_integer() else v for k, v in (err.get("ctx") or {}).items()}
    simple = {
        "greater_than": "must be > {gt}", "greater_than_equal": "must be >= {ge}",
        "less_than": "must be < {lt}", "less_than_equal": "must be <= {le}",
        "int_type": "must be an integer", "float_type": "must be a number",
        "bool_type": "must be true or false", "string_type": "must be a string",
        "tuple_type": "must be a list", "model_type": "must be a mapping",
        "literal_error": "must be one of {expected}",
        "too_short": "must have at least {min_length} item(s)",
        "too_long": "must have at most {max_length} item(s)",
    }
    if t in simple:
        try:
            return simple[t].format(**ctx)
        except (KeyError, IndexError):
            pass
    if t == "value_error":
        return str(ctx.get("error", err["msg"]))
    return err["msg"]


def _unknown_key(loc: tuple) -> str:
    model: type[BaseModel] = Settings
    for part in loc[:-1]:
        f = model.model_fields.get(part) if isinstance(part, str) else None
        if f is None or not isinstance(f.default, BaseModel):
            break
        model = type(f.default)
    known = list(model.model_fields)
    close = difflib.get_close_matches(str(loc[-1]), known, n=1)
    return "unknown key" + (f" (did you mean {close[0]}?)" if close else "") + f"; known: {', '.join(known)}"


def _loc_text(loc: tuple) -> str:
    return ".".join(str(p) if isinstance(p, str) else f"[{p}]" for p in loc).replace(".[", "[")


def _clean_loc(loc: tuple) -> tuple:
    # pydantic adds the union member / validator name to a loc ("int", "function-after[...]"):
    # keep only the parts that are keys or list indexes of the input.
    out = []
    for part in loc:
        if isinstance(part, str) and ("[" in part or part in ("int", "float", "str", "bool", "none")):
            continue
        out.append(part)
    return tuple(out)


def _format(errors: list[dict], origins: _Origins) -> str:
    lines = []
    for err in errors:
        loc = _clean_loc(tuple(err["loc"]))
        msg = _unknown_key(loc) if err["type"] == "extra_forbidden" else _message(err)
        lines.append(f"{origins.where(loc)}: {_loc_text(loc)}: {msg}")
    return "\n".join(dict.fromkeys(lines))   # union members may repeat one error


# ------------------------------------------------------------------------ load
def load_settings(path: str | Path | None, *, environ: Mapping[str, str] | None = None,
                  **overrides: Any) -> Settings:
    """Defaults < YAML file (None = none) < CUBEGATE_* environment < overrides (top-level keys, None ignored)."""
    origins = _Origins(str(path) if path is not None else "<settings>")
    data = _read_file(Path(path), origins) if path is not None else {}
    for section, f in Settings.model_fields.items():   # `proxy:` with nothing under it = defaults
        if isinstance(f.default, BaseModel) and section in data and data[section] is None:
            data[section] = {}
    data = _merge(data, _env_overrides(os.environ if environ is None else environ, origins))
    for k, v in overrides.items():
        if v is not None:
            data[k] = v
            origins.env[(k,)] = f"--{k.replace('_', '-')}"
    try:
        settings = Settings.model_validate(data)
    except ValidationError as e:
        raise SettingsError(_format(e.errors(), origins)) from None
    problems = _cross_checks(settings)
    if problems:
        raise SettingsError("\n".join(f"{origins.where(loc)}: {_loc_text(loc)}: {msg}" for loc, msg in problems))
    return settings
