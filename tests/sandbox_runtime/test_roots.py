"""Per-instance roots directories: claimed by a live backend, removed when it closes with no
sandbox left, and those of dead instances pruned at the next start (sandbox_runtime/roots.py)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sandbox_runtime import roots

REPO = Path(__file__).resolve().parents[2]


def test_mounts_count_only_at_or_below_the_directory():
    info = ("36 25 0:32 / /run rw - tmpfs tmpfs rw\n"
            "90 36 0:50 / /r/i1/sb/root rw - overlay cubegate-root rw,lowerdir=/c/k/rootfs\n"
            "91 36 0:51 / /r/i2x rw - tmpfs tmpfs rw\n")
    assert roots.mounted_under(info, Path("/r/i1"))
    assert not roots.mounted_under(info, Path("/r/i2"))      # a sibling sharing the prefix is not it
    assert roots.mounted_under(info, Path("/r/i2x/"))


def _die_holding(d: Path, state: Path) -> None:
    """A real process claims `d` and exits without releasing it (a crashed daemon)."""
    code = "import sys; from pathlib import Path; from sandbox_runtime import roots; " \
           "roots.claim(Path(sys.argv[1]), Path(sys.argv[2])); import os; os._exit(0)"
    subprocess.run([sys.executable, "-c", code, str(d), str(state)], cwd=REPO, check=True, timeout=30,
                   env={**os.environ, "PYTHONPATH": str(REPO)})


def test_only_directories_of_dead_instances_without_sandboxes_are_pruned(tmp_path):
    parent = tmp_path / "roots"
    live = parent / "ilive"
    lock = roots.claim(live, tmp_path / "s-live")
    other_live = parent / "iother"
    other_lock = roots.claim(other_live, tmp_path / "s-other")     # alive, not the pruner's own
    dead = parent / "idead"
    _die_holding(dead, tmp_path / "s-gone")                          # its state dir is gone (a test's tmp)
    (dead / "_etc" / "abc").mkdir(parents=True)
    (dead / "_etc" / "abc" / "hosts").write_text("x")
    adopted = parent / "iadopt"
    (tmp_path / "s-adopt" / "sb1").mkdir(parents=True)
    (tmp_path / "s-adopt" / "sb1" / "handle.json").write_text("{}")  # a sandbox the next daemon adopts
    _die_holding(adopted, tmp_path / "s-adopt")
    old_legacy, new_legacy = parent / "iold", parent / "inew"         # made before instance locks
    (old_legacy / "_etc").mkdir(parents=True)
    new_legacy.mkdir()
    week_ago = time.time() - 7 * 86400
    os.utime(old_legacy, (week_ago, week_ago))
    try:
        removed = roots.prune_orphans(parent, keep=live)
        assert sorted(removed) == ["idead", "iold"]
        assert not dead.exists() and not old_legacy.exists()
        assert live.is_dir() and other_live.is_dir() and adopted.is_dir() and new_legacy.is_dir()
        assert (live / roots.LOCK_NAME).read_text() == str(tmp_path / "s-live")
        # the live one releases with nothing left: removed; a second prune finds nothing more
        assert roots.release(other_live, other_lock, sandboxes_left=False) and not other_live.exists()
        assert roots.prune_orphans(parent, keep=live) == []
    finally:
        lock.close()


def test_release_keeps_the_directory_while_sandboxes_are_left_or_another_holder_shares_it(tmp_path):
    d = tmp_path / "roots" / "i1"
    a = roots.claim(d, tmp_path / "s")
    b = roots.claim(d, tmp_path / "s")             # two backends of one state dir in one process
    assert not roots.release(d, a, sandboxes_left=False) and d.is_dir()
    assert not roots.release(d, b, sandboxes_left=True) and d.is_dir()
    c = roots.claim(d, tmp_path / "s")
    assert roots.release(d, c, sandboxes_left=False) and not d.exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="the namespace backend's roots dir is under /run (root)")
def test_a_namespace_backend_removes_its_roots_dir_on_close_and_prunes_a_dead_ones(tmp_path):
    from sandbox_runtime.namespace import NamespaceBackend
    from sandbox_runtime.templates.rootfs import ROOTS_DIR
    crashed_state = tmp_path / "crashed" / "state"
    code = "import sys; from pathlib import Path; from sandbox_runtime.namespace import NamespaceBackend; " \
           "NamespaceBackend(Path(sys.argv[1])); import os; os._exit(0)"
    subprocess.run([sys.executable, "-c", code, str(crashed_state)], cwd=REPO, check=True, timeout=60,
                   env={**os.environ, "PYTHONPATH": str(REPO)})
    from sandbox_runtime import ids
    crashed = ROOTS_DIR / ids.instance_name(crashed_state)
    assert crashed.is_dir()                                   # left behind by a daemon that died
    b = NamespaceBackend(tmp_path / "a" / "state")
    try:
        assert not crashed.exists()                           # pruned when the next one started
        assert (b.roots_dir / roots.LOCK_NAME).is_file()
        # a sandbox left (it outlives the daemon): the directory stays for the next daemon
        sdir = b.state_dir / "sb-left"
        sdir.mkdir(parents=True)
        (sdir / "handle.json").write_text(json.dumps({"sandbox_id": "sb-left", "netns": "x", "data": {}}))
        b.close()
        assert b.roots_dir.is_dir()
        (sdir / "handle.json").unlink()
        b2 = NamespaceBackend(b.state_dir)                    # the next daemon of that state dir
        b2.close()
        assert not b.roots_dir.exists()                       # nothing left: removed
    finally:
        b.close()
        import shutil
        shutil.rmtree(b.roots_dir, ignore_errors=True)
        shutil.rmtree(crashed, ignore_errors=True)
