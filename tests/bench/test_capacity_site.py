"""The capacity bench's page and readings (pure parts; the bench itself runs under the bench lock)."""
from __future__ import annotations

import os
import re
import signal
import struct
import subprocess
import sys
import time
import zlib

from bench.capacity_site import HOSTS, INTERCEPTED, RESOURCES, build_site, parse_beacons
from bench.proctree import tree_pids


def test_the_page_references_every_resource_once_on_three_hosts(tmp_path):
    page, total = build_site(tmp_path)
    html = (tmp_path / "www.shop.test" / page.lstrip("/")).read_text()
    refs = re.findall(r'(?:src|href)="https://([a-z.]+)(/[^"]+)"', html)
    assert len(refs) == len(set(refs)) == RESOURCES == 40
    assert {h for h, _ in refs} == set(HOSTS) and INTERCEPTED in HOSTS
    assert all(h == INTERCEPTED for h, p in refs if p.endswith(".js"))      # the scripts go through MITM
    for host, path in refs:                                                 # every one is served
        assert (tmp_path / host / path.lstrip("/")).is_file(), (host, path)
    assert total == sum(f.stat().st_size for f in tmp_path.rglob("*") if f.is_file())
    assert "sendBeacon('/beacon?'" in html and "loadEventEnd" in html
    assert build_site(tmp_path / "again")[1] == total                       # the same page every run


def test_the_images_are_valid_pngs(tmp_path):
    build_site(tmp_path)
    for f in (tmp_path / "cdn.shop.test").glob("*.png"):
        data = f.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n"
        n, kind = struct.unpack(">I4s", data[8:16])
        w, h = struct.unpack(">II", data[16:24])
        assert kind == b"IHDR" and struct.unpack(">I", data[16 + n:20 + n])[0] == zlib.crc32(data[12:16 + n])
        idat = data.index(b"IDAT")
        size = struct.unpack(">I", data[idat - 4:idat])[0]
        assert len(zlib.decompress(data[idat + 4:idat + 4 + size])) == h * (1 + 3 * w)


def test_beacons_are_read_from_the_access_log():
    lines = [l.split() for l in [
        "www.shop.test /index.html 200 none /index.html?sb=a&r=1&n=2",
        "www.shop.test /beacon 204 none /beacon?sb=cap00-1&r=2&load=812.5&dcl=800.1&ok=40&want=40&res=40&bad=0",
        "www.shop.test /beacon 204 none /beacon?sb=cap00-1&r=x&load=1",        # malformed: skipped
        "api.shop.test /a0.js 200 injected /a0.js",
    ]]
    (b,) = parse_beacons(lines)
    assert (b.sandbox, b.round, b.load_ms, b.dcl_ms, b.ok, b.want, b.bad) == ("cap00-1", 2, 812.5, 800.1, 40, 40, 0)


def test_a_skipped_process_takes_its_subtree_out_of_the_tree():
    child = subprocess.Popen([sys.executable, "-c", "import subprocess, sys; "
                              "subprocess.run([sys.executable, '-c', 'import time; time.sleep(30)'])"],
                             start_new_session=True)
    try:
        deadline = time.monotonic() + 10
        while len(tree_pids(child.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        below = tree_pids(child.pid)
        assert len(below) == 2 and set(below) <= set(tree_pids(os.getpid()))
        left = tree_pids(os.getpid(), skip=lambda pid: pid == child.pid)
        assert os.getpid() in left and not set(below) & set(left)
    finally:
        os.killpg(child.pid, signal.SIGKILL)
        child.wait()
