"""Daemon settings: one YAML file, validated up front with clear errors.

Every field has a default so `cubegate run` works with no file at all; a file
only overrides what it names. Unknown keys are errors (a typo must not silently
fall back to a default that opens something).
"""
from __future__ import annotations

import dataclasses
import ipaddress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml


class SettingsError(ValueError):
    pass


@dataclass(frozen=True)
class ProxySettings:
    listen_host: str = "127.0.0.1"
    explicit_port: int = 8080
    transparent_port: int | None = None      # set when cubevs steers traffic here
    connect_timeout: float = 10.0
    idle_timeout: int = 300                  # close a connection idle this long (mitmproxy tcp_timeout)
    header_timeout: float = 15.0             # slowloris: request head / ClientHello complete this long after connect
    upstream_timeout: float = 300.0          # connect + response head (not body) from the upstream, else 502
    drain_seconds: float = 10.0              # SIGTERM: in-flight flows may finish this long
    max_header_bytes: int = 32 * 1024
    max_header_count: int = 100
    max_connections_per_sandbox: int = 256   # open client connections one sandbox may hold (beyond: refused, audited)
    max_body_bytes: int = 64 * 1024 * 1024   # decoded size of a body the gateway must inspect (beyond: refused)
    inspect_buffer_bytes: int = 1024 * 1024  # inspected bodies up to this (known length) are buffered whole,
                                             # so a refusal is a readable 403/502; larger ones are inspected as a stream
    max_buffered_bytes_per_sandbox: int = 16 * 1024 * 1024  # all of one sandbox's buffered bodies; beyond: streamed


@dataclass(frozen=True)
class OpsSettings:
    listen_host: str = "127.0.0.1"
    port: int = 9090                         # /healthz /readyz /metrics


@dataclass(frozen=True)
class UpstreamSettings:
    ca_bundle: str | None = None             # extra trusted CA for upstream TLS (tests)
    nameservers: tuple[str, ...] = ()        # empty = system resolver
    allow_cidrs: tuple[str, ...] = ()        # exemptions from the private-range guard
    deny_cidrs: tuple[str, ...] = ()


@dataclass(frozen=True)
class AuditSettings:
    dir: str | None = None                   # default: <state_dir>/audit
    fsync: str = "interval"                  # always | interval | never
    max_bytes: int = 64 * 1024 * 1024
    keep_files: int = 20
    retention_days: int | None = None


@dataclass(frozen=True)
class VaultSettings:
    path: str | None = None                  # default: <state_dir>/vault.db
    key_file: str | None = None              # default: <state_dir>/vault.key
    api_port: int = 9091                     # admin API, loopback only
    scrub_response_bodies: bool = True       # also remove injected values echoed in bodies


@dataclass(frozen=True)
class CubevsSettings:
    state_dir: str | None = None             # cubevs registry; default: <state_dir>/cubevs


@dataclass(frozen=True)
class DnsSettings:
    listen_host: str | None = None           # sandbox DNS resolver; None = disabled
    port: int = 53
    audit_interval_seconds: float = 60.0     # allowed answers: one aggregated record per sandbox+name per interval
    max_new_names_per_minute: int = 120      # distinct new names one sandbox may resolve under one wildcard


@dataclass(frozen=True)
class RuntimeSettings:
    enabled: bool = False                    # sandbox runtime + its REST API (needs transparent mode)
    api_port: int = 9092                     # loopback only
    backends: tuple[str, ...] = ("namespace",)   # namespace | microvm
    default_backend: str = "namespace"
    memory_mb: int | None = None             # host budget; None = MemTotal - host_reserve_mb
    cpus: float | None = None                # host budget; None = CPUs this process may use
    max_sandboxes: int = 1000
    host_reserve_mb: int = 512
    default_memory_mb: int = 256             # per-sandbox limits when a request names none
    default_cpus: float = 0.25
    default_pids: int = 256
    default_disk_mb: int = 256
    microvm_assets: str | None = None        # default: <repo>/.cache/microvm (`make setup` builds it)
    hub_netns: str | None = None             # cubevs hub namespace (None = the daemon's own)
    template_cache: str | None = None        # built templates; default <state_dir>/.cache/templates
    default_template: str | None = None      # template of sandboxes whose request names none (None: host /usr)
    pool_size: int = 0                       # network slots (netns + veth + maps) kept ready ahead of creates


@dataclass(frozen=True)
class Settings:
    state_dir: str = "/var/lib/cubegate"
    policy_dir: str = "policies"
    policy_poll_seconds: float = 1.0
    proxy: ProxySettings = field(default_factory=ProxySettings)
    ops: OpsSettings = field(default_factory=OpsSettings)
    upstream: UpstreamSettings = field(default_factory=UpstreamSettings)
    audit: AuditSettings = field(default_factory=AuditSettings)
    vault: VaultSettings = field(default_factory=VaultSettings)
    cubevs: CubevsSettings = field(default_factory=CubevsSettings)
    dns: DnsSettings = field(default_factory=DnsSettings)
    runtime: RuntimeSettings = field(default_factory=RuntimeSettings)

    # Derived paths -------------------------------------------------------
    @property
    def audit_dir(self) -> Path:
        return Path(self.audit.dir or Path(self.state_dir) / "audit")

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


def _build(cls, data: Any, where: str):
    if data is None:
        return cls()
    if not isinstance(data, dict):
        raise SettingsError(f"{where}: expected a mapping, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise SettingsError(f"{where}: unknown key(s) {', '.join(unknown)}; known: {', '.join(fields)}")
    kwargs = {}
    for name, value in data.items():
        f = fields[name]
        path = f"{where}.{name}" if where else name
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(default):
            kwargs[name] = _build(type(default), value, path)
        elif isinstance(default, tuple):
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise SettingsError(f"{path}: expected a list of strings")
            kwargs[name] = tuple(value)
        elif isinstance(default, bool):
            if not isinstance(value, bool):
                raise SettingsError(f"{path}: expected true/false")
            kwargs[name] = value
        elif isinstance(default, (int, float)) or default is None:
            if value is not None and not isinstance(value, (int, float, str)) or isinstance(value, bool):
                raise SettingsError(f"{path}: wrong type {type(value).__name__}")
            kwargs[name] = value
        else:
            if not isinstance(value, str):
                raise SettingsError(f"{path}: expected a string")
            kwargs[name] = value
    return cls(**kwargs)


def _validate(s: Settings) -> Settings:
    for port_name, port in (("proxy.explicit_port", s.proxy.explicit_port), ("ops.port", s.ops.port)):
        if not isinstance(port, int) or not 0 <= port <= 65535:
            raise SettingsError(f"{port_name}: must be a port number 0-65535, got {port!r}")
    tp = s.proxy.transparent_port
    if tp is not None and (not isinstance(tp, int) or not 1 <= tp <= 65535):
        raise SettingsError(f"proxy.transparent_port: must be a port number 1-65535, got {tp!r}")
    dp = s.dns.port
    if not isinstance(dp, int) or isinstance(dp, bool) or not 1 <= dp <= 65535:
        raise SettingsError(f"dns.port: must be a port number 1-65535, got {dp!r}")
    if s.dns.listen_host is not None and not isinstance(s.dns.listen_host, str):
        raise SettingsError(f"dns.listen_host: expected a string, got {s.dns.listen_host!r}")
    rt = s.runtime
    if rt.enabled and not tp:
        raise SettingsError("runtime.enabled needs proxy.transparent_port: sandbox traffic is steered there")
    for b in rt.backends:
        if b not in ("namespace", "microvm"):
            raise SettingsError(f"runtime.backends: unknown backend {b!r} (namespace, microvm)")
    if rt.default_backend not in rt.backends:
        raise SettingsError(f"runtime.default_backend {rt.default_backend!r} is not in runtime.backends")
    if not isinstance(rt.api_port, int) or not 1 <= rt.api_port <= 65535:
        raise SettingsError(f"runtime.api_port: must be a port number 1-65535, got {rt.api_port!r}")
    for name in ("connect_timeout", "idle_timeout", "header_timeout", "upstream_timeout"):
        v = getattr(s.proxy, name)
        if not isinstance(v, (int, float)) or isinstance(v, bool) or v <= 0:
            raise SettingsError(f"proxy.{name}: must be a number of seconds > 0, got {v!r}")
    if s.audit.fsync not in ("always", "interval", "never"):
        raise SettingsError(f"audit.fsync: must be always, interval or never, got {s.audit.fsync!r}")
    for cidr in (*s.upstream.allow_cidrs, *s.upstream.deny_cidrs):
        try:
            ipaddress.ip_network(cidr, strict=False)
        except ValueError as e:
            raise SettingsError(f"upstream: bad CIDR {cidr!r}: {e}") from None
    return s


def load_settings(path: str | Path | None, **overrides: Any) -> Settings:
    """Load settings from a YAML file (None = defaults); overrides are top-level keys."""
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        try:
            loaded = yaml.safe_load(p.read_text())
        except OSError as e:
            raise SettingsError(f"{p}: cannot read: {e.strerror}") from None
        except yaml.YAMLError as e:
            raise SettingsError(f"{p}: invalid YAML: {e}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise SettingsError(f"{p}: top level must be a mapping")
        data = loaded or {}
    data.update({k: v for k, v in overrides.items() if v is not None})
    try:
        return _validate(_build(Settings, data, ""))
    except SettingsError as e:
        raise SettingsError(f"{path or '<settings>'}: {str(e).lstrip('.')}") from None
