import asyncio
import os

import pytest

from egress.policy import PolicyError, PolicyStore
from policy_testlib import req, write

GOOD = "name: p\nrules:\n  - {name: a, action: allow, match: {hosts: [a.test]}}\n"
GOOD2 = "name: p\nrules:\n  - {name: b, action: allow, match: {hosts: [b.test]}}\n"
BROKEN = "name: p\nrules:\n  - {name: a, action: allow, match: {hosts: ['api.*.x.com']}}\n"


def _bump_mtime(path, seconds=5):
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + seconds * 1_000_000_000))


def test_reload_swaps_on_success(tmp_path):
    f = write(tmp_path, "p.yaml", GOOD)
    store = PolicyStore(tmp_path)
    seen = []
    store.on_change(lambda old, new: seen.append((old.digest, new.digest)))
    old = store.current
    assert old.decide(req("a.test")).action == "allow"
    write(tmp_path, "p.yaml", GOOD2)
    res = store.reload()
    assert res.ok and res.changed and res.error is None and res.digest == store.digest != old.digest
    assert store.current.decide(req("b.test")).action == "allow"
    assert store.current.decide(req("a.test")).action == "deny"
    assert old.decide(req("a.test")).action == "allow"  # old object is immutable
    assert seen == [(old.digest, res.digest)]
    # unchanged content: ok, no swap, no callback
    res2 = store.reload()
    assert res2.ok and not res2.changed and len(seen) == 1
    del f


def test_broken_file_keeps_old_policy(tmp_path):
    write(tmp_path, "p.yaml", GOOD)
    store = PolicyStore(tmp_path)
    before = store.current
    seen = []
    store.on_change(lambda old, new: seen.append(new))
    write(tmp_path, "p.yaml", BROKEN)
    res = store.reload()
    assert not res.ok and not res.changed
    assert "p.yaml:3: rules[0].match.hosts[0]:" in res.error and "leftmost label" in res.error
    assert res.digest == before.digest
    assert store.current is before
    assert store.current.decide(req("a.test")).action == "allow"
    assert store.last_error == res.error
    assert seen == []
    # a new invalid file added next to a good one also keeps the old policy
    write(tmp_path, "p.yaml", GOOD)
    write(tmp_path, "q.yaml", "name: q\nmode: sometimes\napplies_to: {sandboxes: [x]}\n")
    res = store.reload()
    assert not res.ok and "q.yaml:2: mode:" in res.error and store.current is before
    (tmp_path / "q.yaml").unlink()
    assert store.reload().ok and store.last_error is None


def test_deleted_directory_keeps_old_policy(tmp_path):
    d = tmp_path / "pol"
    d.mkdir()
    write(d, "p.yaml", GOOD)
    store = PolicyStore(d)
    before = store.current
    (d / "p.yaml").unlink()
    res = store.reload()
    assert not res.ok and "no policy files" in res.error and store.current is before


def test_initial_load_failure_raises(tmp_path):
    write(tmp_path, "p.yaml", BROKEN)
    with pytest.raises(PolicyError, match=r"p\.yaml:3: "):
        PolicyStore(tmp_path)


def test_single_file_source(tmp_path):
    f = write(tmp_path, "only.yaml", GOOD)
    write(tmp_path, "other.yaml", "this is not: [valid")  # not part of the source
    store = PolicyStore(f)
    assert store.current.sources == (str(f),)
    write(tmp_path, "only.yaml", GOOD2)
    assert store.reload().changed


def test_callback_failure_does_not_undo_reload(tmp_path):
    write(tmp_path, "p.yaml", GOOD)
    store = PolicyStore(tmp_path)

    def boom(old, new):
        raise RuntimeError("listener bug")

    store.on_change(boom)
    write(tmp_path, "p.yaml", GOOD2)
    res = store.reload()
    assert res.ok and res.changed and store.current.decide(req("b.test")).action == "allow"


def test_check_for_changes_uses_stats(tmp_path):
    f = write(tmp_path, "p.yaml", GOOD)
    store = PolicyStore(tmp_path)
    assert store.check_for_changes() is None
    write(tmp_path, "p.yaml", GOOD2)
    _bump_mtime(f)
    res = store.check_for_changes()
    assert res is not None and res.changed
    assert store.check_for_changes() is None
    write(tmp_path, "new.yaml", "global: {denied_domains: [b.test]}\n")
    res = store.check_for_changes()
    assert res is not None and res.changed
    assert store.current.decide(req("b.test")).reason == "global_deny"


def test_watch_picks_up_changes_and_survives_broken_files(tmp_path):
    f = write(tmp_path, "p.yaml", GOOD)
    store = PolicyStore(tmp_path)
    changed = []
    store.on_change(lambda old, new: changed.append(new.digest))

    async def scenario():
        task = asyncio.create_task(store.watch(interval=0.01))
        try:
            write(tmp_path, "p.yaml", BROKEN)
            _bump_mtime(f, 5)
            for _ in range(200):
                await asyncio.sleep(0.01)
                if store.last_error:
                    break
            assert store.last_error and "leftmost label" in store.last_error
            assert store.current.decide(req("a.test")).action == "allow"
            write(tmp_path, "p.yaml", GOOD2)
            _bump_mtime(f, 10)
            for _ in range(200):
                await asyncio.sleep(0.01)
                if changed:
                    break
            assert changed and store.current.decide(req("b.test")).action == "allow"
            assert not task.done()
        finally:
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    asyncio.run(asyncio.wait_for(scenario(), timeout=10))
