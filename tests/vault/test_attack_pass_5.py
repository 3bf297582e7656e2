"""Attack pass 5 on the vault admin API: the real API over HTTP on a real vault (SQLite)."""
from __future__ import annotations

import os

import httpx
import pytest


def test_unseal_from_a_fifo_is_a_prompt_400_not_a_stuck_thread(api, tmp_path):
    """FINDING: `POST /v1/unseal {"key_file": ...}` opened the server path with a blocking
    open(2): a FIFO (mode 0600, so the mode check passed) blocked the call and an executor thread
    forever, and each retry took another (the daemon's default executor, shared with its other
    blocking work). Now the open does not block: not a regular file, 400 at once."""
    fifo = tmp_path / "key.fifo"
    os.mkfifo(fifo, 0o600)
    try:
        r = httpx.post(api.url + "/v1/unseal", headers={"Authorization": f"Bearer {api.admin}"},
                       json={"key_file": str(fifo)}, timeout=10)
        assert r.status_code == 400 and "not a regular file" in r.json()["message"], r.text
    except httpx.ReadTimeout:
        pytest.fail("unseal from a FIFO hung")
    finally:   # release a reader stuck in open(2), if any
        try:
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            pass
    assert not api.vault.sealed
