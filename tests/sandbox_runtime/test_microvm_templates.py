"""microVM sandboxes on a rootfs template, and their snapshots, clones and rollback, through the
real daemon: QEMU microVMs booting the `base` template's read-only disk image, on a cubevs
switch with the transparent gateway, sandbox DNS and the vault (placeholder binding).

Slow parts are cached on the machine: the `base` template (built here if missing, as
test_templates does), its disk image (mkfs.ext4, ~1 s) and the boot snapshot per template
(one TCG cold boot, ~11 s, in .cache/microvm/templates). With those warm the module runs
in well under a minute on 2 cores."""
from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path

import httpx
import pytest

from sandbox_runtime.microvm import snapshot as vmsnap
from sandbox_runtime import vmdisk
from tests.sandbox_runtime.daemonlab import (lab_policy, put_placeholder_secret, runtime_api, runtime_daemon,
                                             runtime_settings)
from tests.sandbox_runtime.daemonlab import sandbox_cli as cli

CACHE = Path(os.environ.get("CUBEGATE_TEMPLATE_CACHE", "/var/cache/cubegate/templates"))
TPORT, API_PORT = 18088, 18089
SECRET = "sk-live-microvm-9f8e7d6c5b4a3928"
POLICY = lab_policy("vm-agents")


# ------------------------------------------------------------------ pure parts (fast)

def test_disk_image_size_leaves_room_and_mkfs_copies_the_tree_read_only(tmp_path):
    size, inodes = vmdisk.image_size(100 << 20, 5000)
    assert size >= (100 << 20) * 1.2 and size % (1 << 20) == 0 and inodes > 5000
    argv = vmdisk.mkfs_argv(Path("/t/rootfs"), Path("/t/img"), size, inodes)
    assert argv[:2] == ["mkfs.ext4", "-q"] and argv[argv.index("-d") + 1] == "/t/rootfs"
    assert "^has_journal,^resize_inode" in argv and argv[-1] == f"{size // 1024}k"
    (tmp_path / "rootfs" / "etc").mkdir(parents=True)
    (tmp_path / "rootfs" / "etc" / "os-release").write_text("NAME=test\n")
    if shutil.which("mkfs.ext4") and shutil.which("debugfs"):
        img = vmdisk.ensure_image(tmp_path, tmp_path / "rootfs")
        assert img == vmdisk.image_path(tmp_path) and oct(img.stat().st_mode & 0o777) == "0o444"
        assert vmdisk.ensure_image(tmp_path, tmp_path / "rootfs") == img          # cached
        first = vmdisk.image_id(img)
        assert first and vmdisk.image_id(img) == first and vmdisk.image_id(tmp_path / "none") is None
        img.unlink()
        assert vmdisk.image_id(vmdisk.ensure_image(tmp_path, tmp_path / "rootfs")) != first    # a new build
        import subprocess
        out = subprocess.run(["debugfs", "-R", "cat /etc/os-release", str(img)], capture_output=True, text=True)
        assert out.stdout == "NAME=test\n"


def test_a_template_vm_boots_the_read_only_disk():
    from sandbox_runtime.microvm import template, vm
    t = template.Template(snapshot="/s", accel="tcg", memory_mb=256, cpus=1, tsc_khz=2_000_000, disk="/t/img")
    argv = vm.qemu_argv(template.restore_config(Path("/a"), t, "/r", tap="cgtap0", mac="02:00:00:00:00:09"))
    drive = argv[argv.index("-drive") + 1]
    assert drive.startswith("file=/t/img,") and "readonly=on" in drive and "virtio-blk-device,drive=root" in argv
    cmdline = argv[argv.index("-append") + 1]
    assert "cubegate.root=vda" in cmdline and "init_on_free=1" in cmdline
    plain = vm.qemu_argv(template.vm_config(Path("/a"), "/r", memory_mb=256, cpus=1, accel="tcg", tsc=1))
    assert "-drive" not in plain and "cubegate.root" not in plain[plain.index("-append") + 1]


def test_a_changed_guest_script_makes_the_assets_stale(monkeypatch):
    from sandbox_runtime.microvm import assets
    before = assets.layout_hash()
    monkeypatch.setitem(assets.SCRIPTS, "cg-fresh", assets.SCRIPTS["cg-fresh"] + "# changed\n")
    assert assets.layout_hash() != before
    assert "kill -9 -1" in assets.script("cg-fresh")      # one sweep: a fork cannot escape it


def test_boot_snapshots_of_a_rebuilt_or_removed_disk_are_pruned(tmp_path):
    from sandbox_runtime.microvm import template
    root = tmp_path / "templates"
    root.mkdir()
    img = tmp_path / "img"
    img.write_text("x")

    def mk(name, disk):
        (root / name).mkdir()
        (root / name / "template.json").write_text(json.dumps({"disk": disk}))
        return root / name
    mk("h-q7-tcg-256m-1c-tOLD", str(img))                  # same VM shape, older image build: gone
    mk("h-q7-tcg-512m-1c-tOLD", str(img))                  # another memory size: kept
    mk("h-q7-tcg-256m-1c-tGONE", str(tmp_path / "nope"))   # its disk removed: gone
    mk("h-q7-tcg-256m-1c", None)                           # no disk: kept
    mk("z-q7-tcg-256m-1c", None)                           # other assets: gone
    template._prune(mk("h-q7-tcg-256m-1c-tNEW", str(img)), "h-q7-")
    assert sorted(p.name for p in root.iterdir()) == ["h-q7-tcg-256m-1c", "h-q7-tcg-256m-1c-tNEW",
                                                      "h-q7-tcg-512m-1c-tOLD"]


def test_a_snapshot_restores_only_into_the_guest_that_wrote_it():
    s = vmsnap.VmSnapshot(sandbox="a", assets_hash="h", qemu="7.2", accel="tcg", memory_mb=256, cpus=1,
                          tsc_khz=1, template="base", template_key="k1", disk="/img", disk_id="i1")
    ok = dict(assets_hash="h", qemu="7.2", memory_mb=256, cpus=1.0, template_key="k1", disk_id="i1")
    assert vmsnap.incompatibility(s, **ok) is None
    assert vmsnap.incompatibility(s, **{**ok, "cpus": 0.5}) is None                # one vCPU either way
    assert "256 MB" in vmsnap.incompatibility(s, **{**ok, "memory_mb": 512})
    assert "rebuilt" in vmsnap.incompatibility(s, **{**ok, "template_key": "k2"})
    assert "assets or QEMU" in vmsnap.incompatibility(s, **{**ok, "qemu": "8.0"})
    assert "gone" in vmsnap.incompatibility(s, **{**ok, "disk_id": None})
    assert "disk" in vmsnap.incompatibility(s, **{**ok, "disk_id": "i2"})    # same key, rebuilt image
    a, b = "cgph_" + "A" * 32, "cgph_" + "B" * 32
    assert vmsnap.token_pairs({a: b, b: b}) == [a, b]
    for bad in ({a: "cgph_x"}, {a: "cgph_" + "B" * 31 + "/"}, {"x$(id)xxxx": "yyyyyyyyyy"}):
        with pytest.raises(ValueError):
            vmsnap.token_pairs(bad)


# ------------------------------------------------------------------ the daemon, microVMs on `base`

@pytest.fixture(scope="module")
def rt(lab, tmp_path_factory, agent_binary):
    from sandbox_runtime.microvm import assets, vm
    from sandbox_runtime.templates import TemplateStore
    if os.geteuid() != 0 or shutil.which(vm.QEMU) is None or not shutil.which("mmdebstrap"):
        pytest.skip("needs root, qemu-system-x86 and mmdebstrap (apt)")
    TemplateStore(CACHE).build("base")          # cached on this machine: returns at once
    if not assets.assets_ready(assets.DEFAULT_ASSETS_DIR, agent_binary)[0]:
        assets.build(assets.DEFAULT_ASSETS_DIR, agent=agent_binary, force=True)
    # the disk image and the boot snapshot of `base` (cached: at once when warm; cold: the
    # accelerator probe and one boot, longer than an API call may take)
    from sandbox_runtime.backend import Limits
    from sandbox_runtime.microvm import MicrovmBackend
    warm = MicrovmBackend(tmp_path_factory.mktemp("warm"), assets.DEFAULT_ASSETS_DIR, agent_binary=agent_binary,
                          templates=TemplateStore(CACHE))
    warm.template_for(Limits(), warm._rootfs("base"))
    settings = runtime_settings(API_PORT, memory_mb=3072, cpus=2.0, max_sandboxes=6, host_reserve_mb=256,
                                backends=["microvm"], default_backend="microvm",
                                microvm_assets=str(assets.DEFAULT_ASSETS_DIR),
                                template_cache=str(CACHE), default_template="base")
    with runtime_daemon(lab, tmp_path_factory.mktemp("vmt"), POLICY, tport=TPORT, prefix="cv",
                        settings=settings, before_start=lambda gw: put_placeholder_secret(gw, SECRET)) as (gw, sw):
        yield gw, sw


def api(lab, gw, method: str, path: str, **kw) -> httpx.Response:
    kw.setdefault("timeout", 180)       # the first create boots the template (TCG: ~11 s)
    return runtime_api(lab, gw, API_PORT, method, path, **kw)


def sh(lab, gw, sid: str, script: str) -> str:
    r = api(lab, gw, "POST", f"/sandboxes/{sid}/exec", json={"argv": ["sh", "-c", script], "timeout": 30})
    assert r.status_code == 200 and r.json()["exit_code"] == 0, (script, r.text)
    return r.json()["stdout"]


def _sid(tag: str) -> str:
    return f"vt{tag}-{uuid.uuid4().hex[:6]}"


def create(lab, gw, sid: str) -> dict:
    r = api(lab, gw, "POST", "/sandboxes", json={"id": sid, "tenant": "acme", "template": "base",
                                                  "secret_env": {"OPENAI_API_KEY": "openai"}})
    assert r.status_code == 201, r.text
    return r.json()


def rm(lab, gw, *sids: str) -> None:
    cli(lab, gw, "rm", *sids, check=False)


def procs(lab, gw, sid: str) -> str:
    return sh(lab, gw, sid, "cat /proc/[0-9]*/cmdline | tr '\\0' ' '")


@pytest.fixture(scope="module")
def vmsb(rt, lab):
    """One sandbox on `base` for the boot and the rollback tests (a start is seconds under TCG)."""
    gw, _ = rt
    sid = _sid("b")
    sb = create(lab, gw, sid)
    try:
        yield sb
    finally:
        rm(lab, gw, sid)


def test_a_microvm_boots_the_base_template_and_goes_out_through_the_gateway(rt, lab, vmsb):
    gw, sw = rt
    sid = vmsb["id"]
    assert vmsb["template"] == "base" and vmsb["backend"] == "microvm"
    out = sh(lab, gw, sid, "uname -r; . /etc/os-release; echo $VERSION_CODENAME; command -v git; command -v curl; "
                           "test -e /usr/bin/qemu-system-x86_64 || echo no-host-usr; cat /etc/hostname; "
                           "grep -c ' / overlay ' /proc/mounts; touch /usr/x && echo writable; echo $SSL_CERT_FILE")
    kernel, codename, git, curl, host_usr, hostname, overlay, writable, cafile = out.split()
    assert kernel.endswith("cloud-amd64") and codename == "bookworm"        # the template, in a guest kernel
    assert (git, curl) == ("/usr/bin/git", "/usr/bin/curl") and host_usr == "no-host-usr"
    assert hostname == sid and overlay == "1" and writable == "writable"   # a writable layer over the image
    assert cafile == "/etc/ssl/certs/ca-certificates.crt"
    # the gateway's CA is in the template's system bundle: an intercepted request verifies, and
    # gets the credential injected; audited under its id
    seen = json.loads(sh(lab, gw, sid, "curl -sS --max-time 15 -H \"Authorization: Bearer $OPENAI_API_KEY\" "
                                       f"https://echo.allowed.test/vm-{sid}"))
    assert [v for k, v in seen["header_list"] if k.lower() == "authorization"] == ["Bearer [REDACTED]"]
    rec = gw.wait_record(lambda x: x["event"] == "request" and x.get("path") == f"/vm-{sid}")
    assert rec["sandbox"] == sid and rec["extra"]["secret"] == "openai", rec
    # denied: refused, audited under its id
    code = sh(lab, gw, sid, "curl -s -o /dev/null -w '%{http_code}' --max-time 10 https://denied.test/x; true")
    assert code != "200", code
    rec = gw.wait_record(lambda x: x.get("host") == "denied.test" and x.get("sandbox") == sid)
    assert rec["decision"] == "deny", rec
    assert SECRET not in gw.log_path.read_text(errors="replace")


def test_snapshot_then_clones_each_with_its_own_identity_and_no_parent_state(rt, lab):
    gw, sw = rt
    parent, clones = _sid("p"), [_sid("c1"), _sid("c2")]
    try:
        p = create(lab, gw, parent)
        p_ph = sh(lab, gw, parent, "echo $OPENAI_API_KEY > key.txt; echo kept > /etc/mark; "
                                   "(OPENAI_API_KEY=$OPENAI_API_KEY sleep 301 >/dev/null 2>&1 &); cat key.txt").strip()
        assert p_ph.startswith("cgph_")
        assert "sleep 301" in procs(lab, gw, parent)
        snap = json.loads(cli(lab, gw, "snapshot", parent, "--json").stdout)
        assert snap["sandbox"] == parent and snap["backend"] == "microvm" and snap["template"] == "base"
        assert snap["size_bytes"] > 1 << 20                                   # guest memory, not a stub
        out = json.loads(cli(lab, gw, "clone", snap["id"], *clones, "--secret-env", "OPENAI_API_KEY=openai",
                             "--json").stdout)
        assert [c["id"] for c in out] == clones and all(c["state"] == "running" for c in out)
        assert len({p["ip"], *(c["ip"] for c in out)}) == 3                  # each its own address
        seen = {p_ph}
        for c in clones:
            r = sh(lab, gw, c, "cat /etc/mark /etc/hostname /proc/sys/kernel/hostname; echo $HOSTNAME; "
                               "echo $OPENAI_API_KEY; cat key.txt; /run/cubegate/bin/ip -4 addr show eth0 | "
                               "sed -n 's/.*inet \\([0-9.]*\\).*/\\1/p'; echo SEP$((6*7)); "
                               # all it wrote is in its writable layer (the template cannot hold it)
                               f"grep -rl {p_ph} /run/cubegate/rw/upper; echo SEP$((6*7)); "
                               "cat /proc/[0-9]*/cmdline | tr '\\0' ' '")
            ident, found, ps = r.split("SEP42")
            mark, hostname, uts, env_host, env_ph, file_ph, addr = ident.split()
            assert mark == "kept"                                              # the snapshot's disk state
            assert hostname == uts == env_host == c                            # its own identity
            assert addr == next(x["ip"] for x in out if x["id"] == c)           # re-addressed
            assert env_ph.startswith("cgph_") and env_ph not in seen and file_ph == env_ph
            seen.add(env_ph)
            assert found.strip() == ""                   # no file holds the parent's placeholder
            assert "sleep 301" not in ps                 # nor does a process (theirs did not come along)
            # the parent's placeholder is nobody's leak here and names nobody: a clone sending it is
            # itself to the gateway (identity is its address, which the switch pins); its own
            # placeholder headed to an unbound host is its own leak
            codes = sh(lab, gw, c, "for h in 'X-Key: " + p_ph + "' \"Authorization: Bearer $OPENAI_API_KEY\"; do "
                                   "curl -s -o /dev/null -w '%{http_code} ' --max-time 10 -H \"$h\" "
                                   f"http://api.allowed.test/ph-$((i=i+1))-{c}; done").split()
            assert codes == ["200", "403"], codes
            rec = gw.wait_record(lambda x: x["event"] == "request" and x.get("path") == f"/ph-1-{c}")
            assert rec["sandbox"] == c and rec["decision"] == "allow", rec
            rec = gw.wait_record(lambda x: x.get("path") == f"/ph-2-{c}" and x["decision"] == "deny")
            assert rec["sandbox"] == c and rec["reason"] == "credential_leak", rec
        assert "sleep 301" in procs(lab, gw, parent)                           # the parent untouched
        # a clone must restore into the snapshot's memory size: refused, clearly, nothing left
        bad = _sid("m")
        r = api(lab, gw, "POST", f"/snapshots/{snap['id']}/clone",
                json={"ids": [bad], "limits": {"memory_mb": 512}})
        assert r.status_code == 501 and "256 MB" in r.json()["message"], r.text
        assert api(lab, gw, "GET", f"/sandboxes/{bad}").status_code == 404
        assert SECRET not in gw.log_path.read_text(errors="replace")
    finally:
        rm(lab, gw, parent, *clones)


def test_rollback_restores_memory_and_disk_and_keeps_identity(rt, lab, vmsb):
    gw, sw = rt
    sid, sb = vmsb["id"], vmsb
    ph = sh(lab, gw, sid, "echo one > a; echo one > /etc/state; (sleep 301 >/dev/null 2>&1 &); "
                          "echo $OPENAI_API_KEY").strip()
    snap = json.loads(cli(lab, gw, "snapshot", sid, "--json").stdout)
    sh(lab, gw, sid, "echo two > a; echo two > /etc/state; echo new > b; (sleep 302 >/dev/null 2>&1 &)")
    cli(lab, gw, "rollback", sid, snap["id"])
    r = sh(lab, gw, sid, "cat a /etc/state; test -e b && echo b-exists; echo $OPENAI_API_KEY; "
                         "cat /proc/sys/kernel/hostname; curl -s -o /dev/null -w '%{http_code}\\n' --max-time 10 "
                         f"http://api.allowed.test/after-rollback-{sid}; echo SEP$((6*7)); "
                         "cat /proc/[0-9]*/cmdline | tr '\\0' ' '")
    state, ps = r.split("SEP42")
    assert state.split() == ["one", "one", ph, sid, "200"], r       # disk back, same env, identity, network
    assert "sleep 301" in ps and "sleep 302" not in ps              # a memory snapshot: processes too
    got = api(lab, gw, "GET", f"/sandboxes/{sid}").json()
    assert got["state"] == "running" and got["ip"] == sb["ip"] and sw.lookup_by_ip(sb["ip"]) == sid
    rec = gw.wait_record(lambda x: x.get("path") == f"/after-rollback-{sid}")
    assert rec["sandbox"] == sid, rec
