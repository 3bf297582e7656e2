"""The shared /etc directory of template-less namespace sandboxes (sandbox_runtime/etcdir.py)."""
from __future__ import annotations

import os
import stat

from sandbox_runtime import etcdir
from sandbox_runtime.etcdir import Symlink


def test_builds_exactly_the_content_with_safe_modes(tmp_path):
    content = {"passwd": b"root:x:0:0::/:/bin/sh\n", "ssl/certs/ca.crt": b"PEM", "localtime": Symlink("/usr/x"),
               "hosts": b""}
    d = etcdir.ensure(tmp_path / "etc", content, mode=0o711)
    got = {}
    for dirpath, _dirs, files in os.walk(d):
        for f in files:
            p = os.path.join(dirpath, f)
            rel = os.path.relpath(p, d)
            got[rel] = Symlink(os.readlink(p)) if os.path.islink(p) else open(p, "rb").read()
            if not os.path.islink(p):
                assert stat.S_IMODE(os.lstat(p).st_mode) == 0o644
    assert got == content
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o755
    assert stat.S_IMODE(os.stat(d / "ssl").st_mode) == 0o755
    assert stat.S_IMODE(os.stat(tmp_path / "etc").st_mode) == 0o711
    assert [p.name for p in (tmp_path / "etc").iterdir()] == [d.name]      # no build leftovers


def test_content_addressed(tmp_path):
    a = etcdir.ensure(tmp_path, {"f": b"1"})
    assert etcdir.ensure(tmp_path, {"f": b"1"}) == a
    b = etcdir.ensure(tmp_path, {"f": b"2"})
    assert b != a and (a / "f").read_bytes() == b"1" and (b / "f").read_bytes() == b"2"
    # a file and a symlink with the same bytes, or a path split differently, are different content
    assert etcdir.key({"f": b"x"}) != etcdir.key({"f": Symlink("x")})
    assert etcdir.key({"a": b"bc"}) != etcdir.key({"ab": b"c"})


def test_signature_changes_with_a_source(tmp_path):
    f, d = tmp_path / "f", tmp_path / "d"
    f.write_bytes(b"1")
    d.mkdir()
    (d / "x.conf").write_bytes(b"a")
    s0 = etcdir.signature([f, d, tmp_path / "missing"])
    assert etcdir.signature([f, d, tmp_path / "missing"]) == s0
    (d / "x.conf").write_bytes(b"ab")          # a file inside a directory
    s1 = etcdir.signature([f, d, tmp_path / "missing"])
    assert s1 != s0
    os.replace(tmp_path / "f", tmp_path / "g")
    (tmp_path / "g").rename(f)
    f.write_bytes(b"22")
    assert etcdir.signature([f, d, tmp_path / "missing"]) != s1


def test_read_host_entries_keeps_symlinks_and_directories(tmp_path):
    (tmp_path / "conf.d").mkdir()
    (tmp_path / "conf.d" / "a.conf").write_bytes(b"A")
    (tmp_path / "file").write_bytes(b"F")
    os.symlink("/usr/share/zoneinfo/UTC", tmp_path / "localtime")
    got = etcdir.read_host_entries(("conf.d", "file", "localtime", "absent"), etc=tmp_path)
    assert got == {"conf.d/a.conf": b"A", "file": b"F", "localtime": Symlink("/usr/share/zoneinfo/UTC")}
