"""`pip install .` without extras gives a working daemon (issue #12).

A fresh venv (no system site packages), the package installed from a copy of
the sources (PyPI for the dependencies), then from a directory where the
sources are not importable: `cubegate --help`, `cubegate init`, and
`cubegate run` with every feature that needs no root (explicit proxy, ops,
vault API, audit, the sandbox DNS resolver on a high loopback port) until
/readyz answers 200. Slow (a minute or two, most of it pip).
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

from tests.ports import free_ports

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
SOURCES = ["pyproject.toml", "README.md", "httpkit", "walmark", "egress", "vault", "cubevs", "sandbox_runtime", "cubegate", "testbed"]


def _run(argv, **kw):
    kw.setdefault("timeout", 900)
    r = subprocess.run(argv, capture_output=True, text=True, **kw)
    assert r.returncode == 0, f"{' '.join(map(str, argv))} -> {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r


def test_plain_pip_install_runs_the_daemon(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for name in SOURCES:   # a copy: the build must not leave build/ or *.egg-info in the checkout
        p = REPO / name
        if p.is_dir():
            shutil.copytree(p, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.o", "cubegate-agent"))
        else:
            shutil.copy2(p, src / name)
    venv = tmp_path / "venv"
    # No pip of its own (ensurepip costs ~10 s): our pip installs into it (--python), with the same
    # resolution. No byte-compiling of every installed module: the daemon compiles what it imports.
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    py, bin_ = venv / "bin" / "python", venv / "bin"
    clean_env = {"PATH": f"{bin_}:/usr/sbin:/usr/bin:/sbin:/bin", "HOME": str(tmp_path), "LANG": "C.UTF-8",
                 "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    pip = [sys.executable, "-m", "pip", "--python", str(py)]
    cache = Path.home() / ".cache" / "pip"   # share pip's download cache: PyPI is slow enough
    _run([*pip, "install", "-q", "--no-compile", "--cache-dir", str(cache), str(src)], env=clean_env, cwd=tmp_path)
    _run([*pip, "check"], env=clean_env, cwd=tmp_path)
    shutil.rmtree(src)   # from here on only the installed package exists

    work = tmp_path / "work"
    work.mkdir()
    run = dict(env=clean_env, cwd=work, timeout=120)
    assert "run" in _run([bin_ / "cubegate", "--help"], **run).stdout
    state = tmp_path / "state"
    _run([bin_ / "cubegate", "init", "--state-dir", str(state)], **run)
    cfg = state / "settings.yaml"
    proxy, ops, vault_api, dns, policy_api = free_ports(5)   # every listener: no default port (9093…) in the root namespace
    doc = yaml.safe_load(cfg.read_text())
    doc.update(proxy={"listen_host": "127.0.0.1", "explicit_port": proxy},
               ops={"listen_host": "127.0.0.1", "port": ops}, vault={"api_port": vault_api},
               policy_api={"port": policy_api},
               audit={"fsync": "interval"}, dns={"listen_host": "127.0.0.1", "port": dns})
    cfg.write_text(yaml.safe_dump(doc))
    _run([bin_ / "cubegate", "-c", str(cfg), "identity", "add", "agent-1"], **run)

    log = open(tmp_path / "daemon.log", "wb")
    daemon = subprocess.Popen([bin_ / "cubegate", "-c", str(cfg), "run"], env=clean_env, cwd=work,
                              stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline, last = time.monotonic() + 60, None
        while True:
            assert daemon.poll() is None, (tmp_path / "daemon.log").read_text()[-4000:]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{ops}/readyz", timeout=2) as r:
                    body = json.loads(r.read())
                    break
            except urllib.error.HTTPError as e:
                last = e.read().decode(errors="replace")
            except OSError as e:
                last = str(e)
            assert time.monotonic() < deadline, f"/readyz never 200: {last}\n" + \
                (tmp_path / "daemon.log").read_text()[-4000:]
            time.sleep(0.3)
        assert body["ready"] and body["checks"]["vault"]["detail"] == "unsealed", body
        assert "sandbox-dns" in body["checks"]["tasks"]["detail"], body
        with urllib.request.urlopen(f"http://127.0.0.1:{ops}/metrics", timeout=5) as r:
            assert b"cubegate_" in r.read()
    finally:
        daemon.terminate()
        try:
            daemon.wait(20)
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.wait(5)
        log.close()
    assert daemon.returncode == 0, (tmp_path / "daemon.log").read_text()[-4000:]
    assert any((state / "audit").iterdir())   # the audit log was opened there
