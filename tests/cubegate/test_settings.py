"""Settings: one typed declaration; every refusal names file:line (or the variable) and the key."""
from __future__ import annotations

import textwrap

import pytest

from cubegate.settings import Settings, SettingsError, load_settings


def _load(tmp_path, text: str, environ=None, **overrides):
    p = tmp_path / "settings.yaml"
    p.write_text(textwrap.dedent(text))
    return load_settings(p, environ=environ or {}, **overrides)


# (file text, expected error line: "settings.yaml:LINE: key: message part")
FILE_ERRORS = [
    ("policy_poll_seconds: fast\n", "settings.yaml:1: policy_poll_seconds: must be a number"),
    ("policy_poll_seconds: 0\n", "settings.yaml:1: policy_poll_seconds: must be > 0"),
    ("policy_poll_seconds: true\n", "settings.yaml:1: policy_poll_seconds: must be a number"),
    ("state_dir: /x\nproxy:\n  idle_timeout: 30\n  header_timeout: 0\n",
     "settings.yaml:4: proxy.header_timeout: must be > 0"),
    ("proxy:\n  explicit_port: 70000\n", "settings.yaml:2: proxy.explicit_port: must be <= 65535"),
    ("proxy:\n  explicit_port: '8080'\n", "settings.yaml:2: proxy.explicit_port: must be an integer"),
    ("proxy:\n  transparent_port: 0\n", "settings.yaml:2: proxy.transparent_port: must be >= 1"),
    ("proxy:\n  listen_host: 'not a host'\n", "settings.yaml:2: proxy.listen_host: not an IP address or host name"),
    ("proxy:\n  header_timout: 5\n", "settings.yaml:2: proxy.header_timout: unknown key (did you mean header_timeout?)"),
    ("proxy:\n  max_connections_per_sandbox: 0\n", "settings.yaml:2: proxy.max_connections_per_sandbox: must be >= 1"),
    ("proxy:\n  max_body_bytes: -1\n", "settings.yaml:2: proxy.max_body_bytes: must be >= 1"),
    ("proxy:\n  inspect_buffer_bytes: 1.5\n", "settings.yaml:2: proxy.inspect_buffer_bytes: must be an integer"),
    ("proxy:\n  max_buffered_bytes_per_sandbox: -5\n",
     "settings.yaml:2: proxy.max_buffered_bytes_per_sandbox: must be >= 0"),
    ("proxy: 5\n", "settings.yaml:1: proxy: must be a mapping"),
    ("prxy: {}\n", "settings.yaml:1: prxy: unknown key (did you mean proxy?)"),
    ("ops:\n  port: -1\n", "settings.yaml:2: ops.port: must be >= 0"),
    ("upstream:\n  allow_cidrs:\n    - 10.0.0.0/8\n    - 10.0.0.300/8\n",
     "settings.yaml:4: upstream.allow_cidrs[1]: bad CIDR '10.0.0.300/8'"),
    ("upstream:\n  deny_cidrs: 10.0.0.0/8\n", "settings.yaml:2: upstream.deny_cidrs: must be a list"),
    ("upstream:\n  nameservers: [dns.example]\n", "settings.yaml:2: upstream.nameservers[0]: nameserver must be ip"),
    ("upstream:\n  ca_bundle: /no/such/ca.pem\n", "settings.yaml:2: upstream.ca_bundle: no such file: /no/such/ca.pem"),
    ("audit:\n  fsync: sometimes\n", "settings.yaml:2: audit.fsync: must be one of 'always', 'interval' or 'never'"),
    ("audit:\n  max_bytes: 10\n", "settings.yaml:2: audit.max_bytes: must be >= 4096"),
    ("audit:\n  keep_files: 0\n", "settings.yaml:2: audit.keep_files: must be >= 1"),
    ("audit:\n  retention_days: 0\n", "settings.yaml:2: audit.retention_days: must be >= 1"),
    ("vault:\n  scrub_response_bodies: 'yes'\n", "settings.yaml:2: vault.scrub_response_bodies: must be true or false"),
    ("vault:\n  key_file: ''\n", "settings.yaml:2: vault.key_file: must be a non-empty path"),
    ("dns:\n  listen_host: localhost\n", "settings.yaml:2: dns.listen_host: not an IP address"),
    ("dns:\n  audit_interval_seconds: 0\n", "settings.yaml:2: dns.audit_interval_seconds: must be > 0"),
    ("dns:\n  max_new_names_per_minute: 0\n", "settings.yaml:2: dns.max_new_names_per_minute: must be >= 1"),
    ("runtime:\n  max_sandboxes: 0\n", "settings.yaml:2: runtime.max_sandboxes: must be >= 1"),
    ("runtime:\n  backends: [namespace, kvm]\n", "settings.yaml:2: runtime.backends[1]: must be one of 'namespace' or 'microvm'"),
    ("runtime:\n  backends: []\n", "settings.yaml:2: runtime.backends: must have at least 1 item(s)"),
    ("runtime:\n  hub_netns: 'a b'\n", "settings.yaml:2: runtime.hub_netns: not a network namespace name"),
    ("runtime:\n  enabled: true\n", "settings.yaml:2: runtime.enabled: needs proxy.transparent_port"),
    ("runtime:\n  backends: [microvm]\n", "settings.yaml:1: runtime.default_backend: 'namespace' is not in runtime.backends"),
    ("proxy: {connect_timeout: 1}\nproxy: {connect_timeout: 2}\n", "settings.yaml:2: proxy: duplicate key"),
    ("proxy: [1\n", "settings.yaml:2: invalid YAML"),
    ("- a\n- b\n", "settings.yaml:1: top level must be a mapping"),
]


@pytest.mark.parametrize("text,expected", FILE_ERRORS, ids=[e.split(": ")[1] for _, e in FILE_ERRORS])
def test_file_errors_name_file_line_and_key(tmp_path, text, expected):
    with pytest.raises(SettingsError) as exc:
        _load(tmp_path, text)
    lines = [l.replace(str(tmp_path) + "/", "") for l in str(exc.value).splitlines()]
    assert any(l.startswith(expected) for l in lines), lines


ENV_ERRORS = [
    ({"CUBEGATE_PROXY__EXPLICIT_PORT": "99999"}, "CUBEGATE_PROXY__EXPLICIT_PORT: proxy.explicit_port: must be <= 65535"),
    ({"CUBEGATE_POLICY_POLL_SECONDS": "fast"}, "CUBEGATE_POLICY_POLL_SECONDS: policy_poll_seconds: must be a number"),
    ({"CUBEGATE_PROXY__EXPLCIT_PORT": "8081"}, "CUBEGATE_PROXY__EXPLCIT_PORT: names no setting (proxy.explcit_port)"),
    ({"CUBEGATE_NOPE__X": "1"}, "CUBEGATE_NOPE__X: names no setting (nope.x)"),
    ({"CUBEGATE_AUDIT__FSYNC": "sometimes"}, "CUBEGATE_AUDIT__FSYNC: audit.fsync: must be one of"),
    ({"CUBEGATE_UPSTREAM__ALLOW_CIDRS": "[1.2.3.0/24, bad]"},
     "CUBEGATE_UPSTREAM__ALLOW_CIDRS: upstream.allow_cidrs[1]: bad CIDR 'bad'"),
]


@pytest.mark.parametrize("environ,expected", ENV_ERRORS, ids=[e.split(":")[0] for _, e in ENV_ERRORS])
def test_env_errors_name_the_variable(tmp_path, environ, expected):
    with pytest.raises(SettingsError) as exc:
        _load(tmp_path, "proxy:\n  explicit_port: 8080\n", environ)
    assert any(l.startswith(expected) for l in str(exc.value).splitlines()), str(exc.value)


def test_every_error_is_reported_not_only_the_first(tmp_path):
    with pytest.raises(SettingsError) as exc:
        _load(tmp_path, "policy_poll_seconds: fast\nproxy:\n  header_timeout: -1\naudit: {fsync: x}\n")
    assert [l.split(": ")[0].rsplit(":", 1)[1] for l in str(exc.value).splitlines()] == ["1", "3", "4"]


def test_env_overrides_file_and_flags_override_env(tmp_path):
    s = _load(tmp_path, "state_dir: /from/file\nproxy:\n  explicit_port: 8080\n  header_timeout: 5\n",
              {"CUBEGATE_PROXY__EXPLICIT_PORT": "8081", "CUBEGATE_STATE_DIR": "/from/env",
               "CUBEGATE_UPSTREAM__NAMESERVERS": "[192.0.2.53, '192.0.2.54:5353']",
               "CUBEGATE_DNS__LISTEN_HOST": "null", "CUBEGATE_POLICY_DIR": "1234",
               "CUBEGATE_VAULT_KEY": "not a setting: ignored", "CUBEGATE_CONFIG": "ignored"},
              state_dir="/from/flag")
    assert s.proxy.explicit_port == 8081 and s.proxy.header_timeout == 5.0
    assert s.upstream.nameservers == ("192.0.2.53", "192.0.2.54:5353")
    assert s.dns.listen_host is None and s.policy_dir == "1234"   # a path that looks like a number stays text
    assert s.state_dir == "/from/flag" and s.audit_dir.as_posix() == "/from/flag/audit"


def test_defaults_keep_their_names_and_values():
    s = load_settings(None, environ={})
    assert s == Settings()
    assert (s.state_dir, s.policy_dir, s.policy_poll_seconds) == ("/var/lib/cubegate", "policies", 1.0)
    p = s.proxy
    assert (p.listen_host, p.explicit_port, p.transparent_port, p.connect_timeout, p.idle_timeout,
            p.header_timeout, p.upstream_timeout, p.drain_seconds, p.max_header_bytes, p.max_header_count,
            p.max_connections_per_sandbox, p.max_body_bytes, p.inspect_buffer_bytes,
            p.max_buffered_bytes_per_sandbox) == ("127.0.0.1", 8080, None, 10.0, 300, 15.0, 300.0, 10.0,
                                                  32 * 1024, 100, 256, 64 * 2**20, 2**20, 16 * 2**20)
    assert (s.ops.port, s.vault.api_port, s.runtime.api_port, s.dns.port) == (9090, 9091, 9092, 53)
    assert (s.dns.audit_interval_seconds, s.dns.max_new_names_per_minute) == (60.0, 120)
    assert (s.audit.fsync, s.audit.max_bytes, s.audit.keep_files) == ("interval", 64 * 2**20, 20)
    assert s.runtime.backends == ("namespace",) and s.runtime.max_sandboxes == 1000
    assert str(s.vault_key_file) == "/var/lib/cubegate/vault.key"


def test_settings_are_frozen():
    s = load_settings(None, environ={})
    with pytest.raises(Exception):
        s.proxy.header_timeout = 1   # type: ignore[misc]


def test_empty_section_means_defaults(tmp_path):
    assert _load(tmp_path, "proxy:\nops:\n").proxy.explicit_port == 8080
