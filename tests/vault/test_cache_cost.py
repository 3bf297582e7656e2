"""What resolve() keeps between requests costs nothing per request when nothing changed,
and stays small whatever paths a sandbox sends."""
from __future__ import annotations

import os
import tracemalloc

from vault import Vault

from vaulttest_helpers import SECRET2


def _resolve(v, path="/v1/models", method="GET"):
    return v.resolve("acme", scheme="https", host="api.openai.com", port=443, method=method, path=path)


def _statements(v, fn) -> list[str]:
    seen: list[str] = []
    conn = v._store._conn
    conn.set_trace_callback(seen.append)
    try:
        fn()
    finally:
        conn.set_trace_callback(None)
    return seen


def test_a_warm_resolve_runs_no_sql(bound_vault):
    _resolve(bound_vault)
    assert _statements(bound_vault, lambda: [_resolve(bound_vault) for _ in range(5)]) == []
    assert _statements(bound_vault, lambda: bound_vault.needs_interception("acme", "api.openai.com", 443)) == []


def test_a_change_by_another_process_is_still_seen_on_the_next_request(bound_vault, vault_path, key_path):
    first = _resolve(bound_vault)
    other = Vault.open(vault_path)
    other.unseal_with_key_file(key_path)
    try:
        for i in range(3):    # several commits in a row, none of them missed
            other.rotate("acme", "openai", SECRET2 + str(i))
            assert _resolve(bound_vault).version == first.version + 1 + i
        other._store.checkpoint()      # the WAL restarts from its first frame
        other.rotate("acme", "openai", SECRET2 + "x")
        assert _resolve(bound_vault).version == first.version + 4
    finally:
        other.close()
    bound_vault.rotate("acme", "openai", SECRET2 + "own")   # and this process's own writes
    assert _resolve(bound_vault).version == first.version + 5


def test_selection_cache_stays_small_against_endless_long_paths(bound_vault):
    _resolve(bound_vault)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(6000):
            _resolve(bound_vault, path=f"/v1/models/{i}/" + "a" * 8192)
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert held < 4 << 20, f"the selection cache holds {held >> 20} MiB after 6000 distinct long paths"
    assert _resolve(bound_vault, path="/v1/models/" + "b" * 8192).binding_id == "b-openai"



def test_an_unlinked_wal_index_file_gives_no_mark(bound_vault, vault_path):
    """Fail closed: a -shm file nobody writes any more (unlinked) never says "unchanged"."""
    store = bound_vault._store
    assert store.change_mark() is not None
    os.unlink(str(vault_path) + "-shm")
    assert store.change_mark() is None


def test_the_fast_paths_per_request_vault_calls_run_no_sql_when_warm(bound_vault):
    """What a plain-HTTP request to an unbound host asks (egress/credentials.py): interception,
    the header leak check and the body's needles: SQL only on the first request."""
    def one_request():
        assert not bound_vault.needs_interception("acme", "example.com", 80)
        assert bound_vault.find_leaks("acme", "sb-1", b"GET /x HTTP/1.1\r\nHost: example.com\r\n") == []
        assert bound_vault.leak_needles("acme", "sb-1", exclude=None).find(b"nothing here") == set()

    assert _statements(bound_vault, one_request) != []     # cold: the store is read
    assert _statements(bound_vault, lambda: [one_request() for _ in range(5)]) == []
