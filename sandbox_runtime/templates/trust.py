"""Make a template trust the gateway's CA in every store its tools read — at sandbox
start, not at build time, so one built template serves any gateway.

    system bundle   /etc/ssl/certs/ca-certificates.crt = the template's bundle + the CA(s)
                    (OpenSSL, curl, git, Python's ssl and Debian's certifi, Node with
                    NODE_EXTRA_CA_CERTS, Go)
    env             SSL_CERT_FILE, REQUESTS_CA_BUNDLE, CURL_CA_BUNDLE, NODE_EXTRA_CA_CERTS,
                    GIT_SSL_CAINFO -> that bundle (pip's vendored certifi, requests, httpx)
    NSS             $HOME/.pki/nssdb with each CA imported (chromium, firefox) — certutil
                    imports only the first certificate of a PEM file, so one file per CA
    Java            (no shipped template has it) with keytool present: the JDK's cacerts + the
                    CA(s) in a PKCS#12 store in $HOME, named by JAVA_TOOL_OPTIONS
Pure: returns file contents, env and the shell script the agent runs.
"""
from __future__ import annotations

import re

from sandbox_runtime.backend import SandboxError

BUNDLE = "/etc/ssl/certs/ca-certificates.crt"
CA_DIR = "/etc/ssl/certs/cubegate"            # one PEM per gateway CA (for certutil / keytool)
NSS_DB = "$HOME/.pki/nssdb"
JAVA_STORE = "$HOME/.cubegate-java-cacerts.p12"
_PEM_RE = re.compile(rb"-----BEGIN CERTIFICATE-----\r?\n.+?-----END CERTIFICATE-----", re.S)


def split_pem(data: bytes) -> list[bytes]:
    return [m.group(0) + b"\n" for m in _PEM_RE.finditer(data)]


def trust_files(template_bundle: bytes, extra_pem: bytes) -> dict[str, bytes]:
    """Absolute path in the sandbox -> content (written root-owned, read-only to the sandbox)."""
    certs = split_pem(extra_pem)
    bundle = template_bundle if template_bundle.endswith(b"\n") or not template_bundle else template_bundle + b"\n"
    files = {BUNDLE: bundle + b"".join(certs)}
    for i, c in enumerate(certs):
        files[f"{CA_DIR}/ca-{i}.pem"] = c
    return files


def trust_env(tools: dict) -> dict[str, str]:
    env = {"SSL_CERT_FILE": BUNDLE, "REQUESTS_CA_BUNDLE": BUNDLE, "CURL_CA_BUNDLE": BUNDLE,
           "NODE_EXTRA_CA_CERTS": BUNDLE, "GIT_SSL_CAINFO": BUNDLE}
    if tools.get("keytool"):
        env["JAVA_TOOL_OPTIONS"] = ("-Djavax.net.ssl.trustStore=/workspace/.cubegate-java-cacerts.p12 "
                                    "-Djavax.net.ssl.trustStoreType=PKCS12 -Djavax.net.ssl.trustStorePassword=changeit")
    return env


def trust_script(tools: dict, n_certs: int) -> str | None:
    """Shell run by the agent (as the sandbox user) once after start; None when nothing to do."""
    steps = []
    if tools.get("certutil"):
        steps.append(f'mkdir -p "{NSS_DB}" && certutil -N -d "sql:{NSS_DB}" --empty-password')
        for i in range(n_certs):
            steps.append(f'certutil -A -d "sql:{NSS_DB}" -n cubegate-ca-{i} -t C,, -i {CA_DIR}/ca-{i}.pem')
    if tools.get("keytool"):
        steps.append(f'cp /etc/ssl/certs/java/cacerts "{JAVA_STORE}" 2>/dev/null; true')
        for i in range(n_certs):
            steps.append(f'keytool -importcert -noprompt -storetype PKCS12 -keystore "{JAVA_STORE}" '
                         f'-storepass changeit -alias cubegate-ca-{i} -file {CA_DIR}/ca-{i}.pem >/dev/null')
    if not steps:
        return None
    return "set -e\n" + "\n".join(steps) + "\n"



def sandbox_env(base: dict[str, str], template: dict | None, env: dict[str, str]) -> dict[str, str]:
    """A sandbox's environment: the backend's base, then a template's trust variables and its
    own env, then the caller's (each later one wins)."""
    if not template:
        return {**base, **env}
    return {**base, **trust_env(template["tools"]), **template["env"], **env}


def read_extra_ca(path) -> bytes:
    """The gateway CA bundle to add to a sandbox's stores (none configured: nothing)."""
    if not path:
        return b""
    try:
        return path.read_bytes()
    except OSError as e:
        raise SandboxError(f"cannot read CA bundle: {e.strerror}") from None
