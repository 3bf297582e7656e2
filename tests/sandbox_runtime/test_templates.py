"""Sandbox templates: definitions and keys, the mmdebstrap build (cached between runs on one
machine in $CUBEGATE_TEMPLATE_CACHE, default /var/cache/cubegate/templates), the namespace
backend on a template overlay, and each template's default TLS stack through the real
transparent gateway on a cubevs switch in the lab.

Build times measured here (2 cores, warm .deb cache / cold): base 29 s / 104 s,
python 43 s, node and browser see the README. Only base is built unconditionally;
the others build once per machine and are then found in the cache."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import uuid
from contextlib import contextmanager
from pathlib import Path

import pytest

from sandbox_runtime.backend import Limits, SandboxError, SandboxSpec
from sandbox_runtime.templates import TemplateError, TemplateStore, definitions, trust
from sandbox_runtime.templates.build import parse_dpkg_status
from sandbox_runtime.templates.progress import Progress, phase_of
from sandbox_runtime.templates.store import held_open_under, overlay_lowerdirs

CACHE = Path(os.environ.get("CUBEGATE_TEMPLATE_CACHE", "/var/cache/cubegate/templates"))
TPORT = 18078            # differs from the other transparent tests (18074-18077)
HUB_IP = "10.200.0.1"


# ------------------------------------------------------------------ pure parts

def test_definition_keys_are_stable_and_follow_the_inputs(tmp_path):
    base, python = definitions.load("base"), definitions.load("python")
    assert base.key == definitions.load("base").key and len(base.key) == 64
    assert set(base.packages) == {"bash", "coreutils", "curl", "git", "ca-certificates"}
    assert set(base.packages) < set(python.packages) and python.key != base.key     # extends base
    assert python.env["PIP_BREAK_SYSTEM_PACKAGES"] == "1"
    for f in definitions.DEFS_DIR.glob("*.yaml"):
        shutil.copy(f, tmp_path / f.name)
    (tmp_path / "base.yaml").write_text("packages: [bash, coreutils, curl, git, ca-certificates, jq]\n")
    assert definitions.load("base", tmp_path).key != base.key
    assert definitions.load("python", tmp_path).key != python.key     # a parent's change moves the child
    assert set(definitions.names()) >= {"base", "python", "node", "browser"}


@pytest.mark.parametrize("text, error", [
    ("packages: [bash]\nrecipe: x\n", "unknown key"),
    ("packages: ['bash; rm -rf /']\n", "Debian package names"),
    ("packages: [bash]\nenv: {'BAD NAME': x}\n", "env must map"),
    ("extends: loop\npackages: [bash]\n", "extends loop"),
    ("- just a list\n", "must be a mapping"),
])
def test_bad_definitions_are_refused(tmp_path, text, error):
    (tmp_path / "loop.yaml").write_text(text)
    with pytest.raises(definitions.DefinitionError, match=error):
        definitions.load("loop", tmp_path)
    with pytest.raises(definitions.DefinitionError, match="must match"):
        definitions.load("../etc/passwd", tmp_path)


def test_progress_shows_each_phase_once_in_order():
    lines = ["I: chroot architecture amd64 is equal to the host's architecture", "I: running apt-get update...",
             "I: downloading packages with apt...", "I: running apt-get update...", "E: not info",
             "I: installing remaining packages inside the chroot...", "I: creating tarball..."]
    assert phase_of(lines[0]) is None and phase_of(lines[4]) is None
    assert phase_of(lines[2]) == (2, "downloading packages")

    class Out(list):
        def write(self, s): self.append(s)
        def flush(self): pass
    out, t = Out(), iter(range(100))
    p = Progress("base", out=out, clock=lambda: next(t))
    for line in lines:
        p.line(line)
    assert [s.split("] ")[1].split(" (")[0] for s in out] == \
        ["resolving packages", "downloading packages", "installing packages", "writing the image"]


def test_dpkg_status_lists_only_installed_packages():
    text = ("Package: bash\nStatus: install ok installed\nVersion: 5.2.15-2+b7\n\n"
            "Package: gone\nStatus: deinstall ok config-files\nVersion: 1\n\n"
            "Package: curl\nStatus: install ok installed\nVersion: 7.88.1-10\n")
    assert parse_dpkg_status(text) == {"bash": "5.2.15-2+b7", "curl": "7.88.1-10"}


def test_overlay_lower_dirs_are_read_from_mountinfo():
    info = ("36 25 0:32 / /run rw - tmpfs tmpfs rw\n"
            "90 36 0:50 / /s/a/root rw,nosuid - overlay cubegate-root rw,lowerdir=/c/k1/rootfs,upperdir=/s/a/rw/upper,"
            "workdir=/s/a/rw/work,volatile\n"
            "91 36 0:51 / /x rw - overlay overlay rw,lowerdir=/l1:/l\\0402,upperdir=/u,workdir=/w\n")
    assert overlay_lowerdirs(info) == {"/c/k1/rootfs", "/l1", "/l 2"}


def test_open_files_count_only_under_the_template_directory():
    held = {"/c/k1x/rootfs.1.ext4", "/c/k2/rootfs/etc/passwd", "socket:[123]"}
    assert not held_open_under(held, Path("/c/k1"))          # a sibling sharing the prefix is not it
    assert held_open_under(held, Path("/c/k2"))
    assert held_open_under({"/c/k1/rootfs.1.ext4"}, Path("/c/k1/"))


def test_a_template_whose_disk_image_a_process_holds_is_not_removed(tmp_path):
    """A microVM's qemu holds its template's disk image open (no mount on the host shows it):
    a real process holding the image stands for it; rm refuses until it is gone."""
    from sandbox_runtime import vmdisk
    key_dir = tmp_path / "k1"
    (key_dir / "rootfs").mkdir(parents=True)
    (key_dir / "manifest.json").write_text(json.dumps({"name": "vmtpl"}))
    img = vmdisk.image_path(key_dir)
    img.write_bytes(b"\0" * 4096)
    store = TemplateStore(tmp_path, defs_dir=tmp_path / "no-defs")
    with open(img, "rb") as disk:
        holder = subprocess.Popen(["sleep", "60"], stdin=disk)
    try:
        assert [r["in_use"] for r in store.list() if r["key"] == "k1"] == [True]
        with pytest.raises(TemplateError, match="in use"):
            store.remove("vmtpl")
        assert img.exists()
    finally:
        holder.kill()
        holder.wait(10)
    assert store.remove("vmtpl") == ["k1"] and not key_dir.exists()


def test_trust_stores_get_every_gateway_ca():
    ca1 = b"-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n"
    ca2 = b"-----BEGIN CERTIFICATE-----\nBBBB\n-----END CERTIFICATE-----\n"
    files = trust.trust_files(b"-----BEGIN CERTIFICATE-----\nROOT\n-----END CERTIFICATE-----", ca1 + b"junk\n" + ca2)
    assert files[trust.BUNDLE].count(b"BEGIN CERTIFICATE") == 3 and files[trust.BUNDLE].endswith(ca2)
    assert files[f"{trust.CA_DIR}/ca-0.pem"] == ca1 and files[f"{trust.CA_DIR}/ca-1.pem"] == ca2
    assert trust.trust_script({}, 2) is None
    script = trust.trust_script({"certutil": True}, 2)     # certutil -A takes only a file's first cert
    assert script.count("certutil -A") == 2 and "cubegate-ca-1" in script and "keytool" not in script
    env = trust.trust_env({"keytool": True})
    assert env["SSL_CERT_FILE"] == env["REQUESTS_CA_BUNDLE"] == env["NODE_EXTRA_CA_CERTS"] == trust.BUNDLE
    assert "trustStore=" in env["JAVA_TOOL_OPTIONS"] and "JAVA_TOOL_OPTIONS" not in trust.trust_env({})


def test_bwrap_template_argv_binds_the_overlay_read_only():
    from sandbox_runtime.namespace import bwrap_template_argv
    a = bwrap_template_argv(sandbox_id="sb", root_fds={"/": 8, "/workspace": 9, "/tmp": 10}, disk_mb=8,
                            seccomp_fd=5, agent_fd=6, listen_fd=7, env={"HOME": "/workspace"})
    j = " ".join(a)
    assert "--bind-fd 8 / " in j and "--bind-fd 9 /workspace" in j and "--bind-fd 10 /tmp" in j
    assert "--ro-bind /usr" not in j                                 # not the host's /usr
    assert a.index("--remount-ro") < a.index("--seccomp") and a[a.index("--remount-ro") + 1] == "/"


# ------------------------------------------------------------------ builds (root, mmdebstrap)

needs_build = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("mmdebstrap"),
                                 reason="needs root and mmdebstrap (apt)")


@pytest.fixture(scope="session")
def store():
    if os.geteuid() != 0 or not shutil.which("mmdebstrap"):
        pytest.skip("needs root and mmdebstrap (apt)")
    return TemplateStore(CACHE)


def built(store: TemplateStore, name: str):
    """Build once per machine (CI reuses the cache); the build itself is bounded by its timeout."""
    return store.build(name)


@needs_build
def test_base_template_builds_and_is_cached(store):
    t = built(store, "base")
    m = json.loads((t.rootfs.parent / "manifest.json").read_text())
    assert m["key"] == t.key == definitions.load("base").key
    assert {"bash", "coreutils", "curl", "git", "ca-certificates"} <= set(m["installed"])
    assert "python3" not in m["installed"] and len(m["image_sha256"]) == 64
    assert (t.rootfs / "usr/bin/git").exists() and (t.rootfs / "etc/ssl/certs/ca-certificates.crt").exists()
    assert not (t.rootfs / "var/cache/apt/archives").exists() or \
        not list((t.rootfs / "var/cache/apt/archives").glob("*.deb"))
    again = store.build("base")                # cached: same directory, the manifest untouched
    assert again.rootfs == t.rootfs and json.loads((t.rootfs.parent / "manifest.json").read_text()) == m
    row = next(r for r in store.list() if r["name"] == "base" and r["current"])
    assert row["built"] and row["packages"] == len(m["installed"]) and not row["in_use"]


# ------------------------------------------------------------------ sandboxes on a template

@pytest.fixture(scope="module")
def tbackend(store, tmp_path_factory, agent_binary):
    from sandbox_runtime.namespace import NamespaceBackend
    tmp = tmp_path_factory.mktemp("tpl")
    ca = tmp / "extra-ca.pem"
    ca.write_text("-----BEGIN CERTIFICATE-----\nY3ViZWdhdGUtdGVzdA==\n-----END CERTIFICATE-----\n")
    b = NamespaceBackend(tmp / "state", ca_bundle=ca, templates=store)
    ok, why = b.available()
    if not ok:
        pytest.skip(why)
    return b


def _sid(tag: str) -> str:
    return f"tt{tag}-{uuid.uuid4().hex[:8]}"


@contextmanager
def tsandbox(backend, netns, template, *, ip="10.0.0.2", gw="10.0.0.1", **spec):
    h = backend.create(SandboxSpec(sandbox_id=_sid(template[:3]), tenant="t", template=template, **spec),
                       netns, ip=ip, gateway_ip=gw)
    try:
        yield h
    finally:
        backend.destroy(h)


def _mounts() -> str:
    return Path("/proc/self/mountinfo").read_text()


@needs_build
def test_sandbox_runs_on_the_template_not_the_host(tbackend, store, bare_netns):
    t = built(store, "base")
    with tsandbox(tbackend, bare_netns, "base", limits=Limits(disk_mb=8), files={"in.txt": b"hi"}) as h:
        sh = lambda s: tbackend.exec(h, ["sh", "-c", s])     # noqa: E731
        r = sh("command -v git; command -v curl; command -v python3 || echo no-python; id -u; cat in.txt")
        assert r.stdout.decode().split() == ["/usr/bin/git", "/usr/bin/curl", "no-python", "1000", "hi"], r
        r = sh("for p in / /usr /usr/bin /etc /etc/passwd /etc/ssl/certs/ca-certificates.crt; do "
               "touch $p/x 2>/dev/null && echo W$p; done; touch /workspace/ok /tmp/ok && echo ok")
        assert r.stdout == b"ok\n", r
        r = sh("head -c 20M /dev/zero > /workspace/big")          # the writable layer is disk_mb
        assert r.exit_code != 0 and b"No space left" in r.stderr
        r = sh("tail -n 3 /etc/ssl/certs/ca-certificates.crt; grep -c BEGIN /etc/ssl/certs/ca-certificates.crt;"
               " cat /etc/hostname; echo $SSL_CERT_FILE")
        lines = r.stdout.decode().split("\n")
        assert lines[1] == "Y3ViZWdhdGUtdGVzdA==" and int(lines[3]) > 100 and lines[4] == h.sandbox_id, r
        # the template itself is untouched and shared; the mount is visible as in use
        assert not (t.rootfs / "workspace/ok").exists() and not (t.rootfs / "x").exists()
        assert str(t.rootfs) in overlay_lowerdirs(_mounts())
        with pytest.raises(TemplateError, match="in use"):
            store.remove("base")
        layer = tbackend.layer_dir(h)
        assert (layer / "workspace/ok").exists()
    assert str(t.rootfs) not in overlay_lowerdirs(_mounts())
    assert h.data["state_dir"] not in _mounts() and not Path(h.data["state_dir"]).exists()


@needs_build
def test_unknown_or_unbuilt_template_is_refused_and_leaves_nothing(tbackend, bare_netns, tmp_path):
    with pytest.raises(SandboxError, match="no template definition"):
        tbackend.create(SandboxSpec(sandbox_id=_sid("x"), tenant="t", template="nope"), bare_netns,
                        ip="10.0.0.2", gateway_ip="10.0.0.1")
    (tmp_path / "ghost.yaml").write_text("packages: [bash]\n")
    ghost = TemplateStore(CACHE, defs_dir=tmp_path)
    from sandbox_runtime.templates import TemplateNotBuilt
    with pytest.raises(TemplateNotBuilt, match="cubegate template build ghost"):
        ghost.resolve("ghost")
    assert not any(tbackend.state_dir.glob("tt*"))


# ------------------------------------------------------------------ through the gateway

POLICY = """\
name: templates
tenant: acme
default: deny
rules:
  - name: lab
    action: allow
    match: {hosts: [api.allowed.test, echo.allowed.test], ports: [443, 80]}
"""
SECRET = "sk-live-template-8a7b6c5d4e3f"
NET_SANDBOX = f"sb-tpl-{uuid.uuid4().hex[:6]}"


def _vault(gw) -> None:
    gw.cli("vault", "init")
    gw.cli("vault", "secret", "put", "acme", "openai", input=SECRET + "\n")
    gw.cli("vault", "binding", "add", "--id", "b-echo", "--tenant", "acme", "--secret", "openai",
           "--host", "echo.allowed.test", "--port", "443", "--header", "Authorization",
           "--format", "Bearer {secret}")


@pytest.fixture(scope="module")
def tlab(lab, store, tmp_path_factory, agent_binary):
    from sandbox_runtime.namespace import NamespaceBackend
    from tests.gateway.switchlab import switch_lab
    tmp = tmp_path_factory.mktemp("tlab")
    with switch_lab(lab, tmp, POLICY, sandbox=NET_SANDBOX, tport=TPORT, prefix="ct",
                    settings_extra={"dns": {"listen_host": HUB_IP, "port": 53}}, before_start=_vault) as (gw, sw, net):
        # what a deployment trusts: the gateway's interception CA; plus the lab's own "public" CA,
        # which in real life is in the template's bundle already
        ca = tmp / "sandbox-ca.pem"
        ca.write_text(Path(lab.ca.bundle_path).read_text() + gw.ca_cert.read_text())
        b = NamespaceBackend(tmp / "state", ca_bundle=ca, templates=store)
        ok, why = b.available()
        if not ok:
            pytest.skip(why)
        yield gw, net, b


@contextmanager
def on_switch(tlab, template):
    gw, net, b = tlab
    h = b.create(SandboxSpec(sandbox_id=NET_SANDBOX, tenant="acme", template=template,
                             limits=Limits(memory_mb=1024, cpus=1.0, pids=512, disk_mb=256)),
                 net.netns, ip=net.ip, gateway_ip=HUB_IP)
    try:
        yield h
    finally:
        b.destroy(h)


def _injected(gw, path: str) -> dict:
    rec = gw.wait_record(lambda x: x["event"] == "request" and x.get("path") == path, timeout=10)
    assert rec["sandbox"] == NET_SANDBOX and rec["extra"]["secret"] == "openai", rec
    return rec


PY_CLIENTS = """
import json, sys, urllib.request, requests, httpx
out = {}
out["urllib"] = urllib.request.urlopen("https://api.allowed.test/tpl-py-urllib", timeout=10).status
out["requests"] = requests.get("https://api.allowed.test/tpl-py-requests", timeout=10).status_code
r = httpx.get("https://echo.allowed.test/tpl-py-httpx", timeout=10)
out["httpx"] = r.status_code
out["auth"] = [v for k, v in r.json()["header_list"] if k.lower() == "authorization"]
try:
    urllib.request.urlopen("https://denied.test/tpl-py-denied", timeout=5)
    out["denied"] = "reached"
except Exception as e:
    out["denied"] = type(e).__name__
print(json.dumps(out))
"""


@needs_build
def test_python_template_default_tls_through_the_gateway(tlab):
    gw, _, b = tlab
    built(b.templates, "python")
    with on_switch(tlab, "python") as h:
        r = b.exec(h, ["python3", "-c", PY_CLIENTS], timeout=60)
        assert r.exit_code == 0, (r, gw.log()[-2000:])
        out = json.loads(r.stdout)
        # passthrough (lab CA) and intercepted (gateway CA) both verify with the default stacks
        assert out["urllib"] == out["requests"] == out["httpx"] == 200, out
        assert out["auth"] == ["Bearer [REDACTED]"] and out["denied"] != "reached", out
        _injected(gw, "/tpl-py-httpx")


NODE_CLIENT = """
const https = require('https');
function get(url) {
  return new Promise((ok) => https.get(url, {timeout: 10000}, (res) => {
    let body = ''; res.on('data', (c) => body += c); res.on('end', () => ok([res.statusCode, body]));
  }).on('error', (e) => ok([e.code || String(e), ''])));
}
(async () => {
  const a = await get('https://api.allowed.test/tpl-node');
  const b = await get('https://echo.allowed.test/tpl-node-inject');
  const d = await get('https://denied.test/tpl-node-denied');
  const auth = b[1] ? JSON.parse(b[1]).header_list.filter((h) => h[0].toLowerCase() === 'authorization') : [];
  console.log(JSON.stringify({allowed: a[0], intercepted: b[0], auth: auth.map((h) => h[1]), denied: d[0]}));
})();
"""


@needs_build
def test_node_template_default_tls_through_the_gateway(tlab):
    gw, _, b = tlab
    built(b.templates, "node")
    with on_switch(tlab, "node") as h:
        r = b.exec(h, ["node", "-e", NODE_CLIENT], timeout=60)
        assert r.exit_code == 0, (r, gw.log()[-2000:])
        out = json.loads(r.stdout)
        assert out["allowed"] == 200 and out["intercepted"] == 200, out
        assert out["auth"] == ["Bearer [REDACTED]"] and out["denied"] != 200, out
        _injected(gw, "/tpl-node-inject")


CHROMIUM = ["/usr/lib/chromium/chromium", "--headless=new", "--no-sandbox", "--disable-gpu",
            "--no-first-run", "--disable-dev-shm-usage", "--virtual-time-budget=5000", "--timeout=15000"]


@needs_build
def test_browser_template_chromium_through_the_gateway(tlab, lab):
    gw, _, b = tlab
    built(b.templates, "browser")
    with on_switch(tlab, "browser") as h:
        # NSS database made at start with the gateway's CA(s): chromium does not read the PEM bundle
        r = b.exec(h, ["certutil", "-L", "-d", "sql:/workspace/.pki/nssdb"], timeout=20)
        assert r.exit_code == 0 and b"cubegate-ca-0" in r.stdout and b"cubegate-ca-1" in r.stdout, r
        # intercepted + credential injected (HTTP/2 to the gateway), the key never reaches the page
        r = b.exec(h, [*CHROMIUM, "--dump-dom", "https://echo.allowed.test/tpl-chromium-inject"], timeout=90)
        assert r.exit_code == 0 and b"tpl-chromium-inject" in r.stdout, (r.stdout[-500:], r.stderr[-1500:])
        assert b"Bearer [REDACTED]" in r.stdout and SECRET.encode() not in r.stdout
        _injected(gw, "/tpl-chromium-inject")
        # passthrough to an allowed host
        r = b.exec(h, [*CHROMIUM, "--dump-dom", "https://api.allowed.test/tpl-chromium"], timeout=90)
        assert b'"path": "/tpl-chromium"' in r.stdout, (r.stdout[-500:], r.stderr[-1500:])
        # a denied host: the resolver refuses the name; dialled by address, the gateway refuses the SNI
        r = b.exec(h, [*CHROMIUM, "--host-resolver-rules=MAP denied.test 198.18.0.12",
                       "--dump-dom", "https://denied.test/tpl-chromium-denied"], timeout=90)
        assert b'"path": "/tpl-chromium-denied"' not in r.stdout      # chromium's own error page instead
        assert b"ERR_CONNECTION_CLOSED" in r.stdout or b"unexpectedly closed" in r.stdout, r.stdout[-800:]
        rec = gw.wait_record(lambda x: x["event"] == "decision" and x.get("sandbox") == NET_SANDBOX
                             and x.get("host") == "denied.test", timeout=10)
        assert rec["decision"] == "deny"
        assert "tpl-chromium-denied" not in lab.logs("upstream")
