"""`POST /v1/unseal {"key_file": PATH}` is no host file-existence oracle: every failure to use
the path — missing, a directory, a FIFO, a device, a file group/other may read, one of the wrong
size, one of the right shape holding another key — is the same answer (status, code, message);
the server's log says which. The right key file still unseals. Real API over HTTP, real vault."""
from __future__ import annotations

import os

import httpx

from vault.api import KEY_FILE_UNUSABLE


def _unseal(api, path: str) -> httpx.Response:
    return httpx.post(api.url + "/v1/unseal", headers={"Authorization": f"Bearer {api.admin}"},
                      json={"key_file": path}, timeout=10)


def test_every_unusable_key_file_is_one_answer(api, key_path, tmp_path, caplog):
    """FINDING: the answer named the cause ("not found", "is not a regular file", "has mode 0644",
    "must hold exactly 32 bytes", wrong_master_key): probing paths told an admin-token holder which
    files exist on the host, their type, mode and size."""
    def file(name: str, data: bytes, mode: int) -> str:
        p = tmp_path / name
        p.write_bytes(data)
        os.chmod(p, mode)
        return str(p)

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo, 0o600)
    probes = {
        "missing": str(tmp_path / "nothing-here"),
        "directory": str(tmp_path),
        "fifo": str(fifo),
        "device": "/dev/null",
        "readable by others": file("open.key", os.urandom(32), 0o644),
        "wrong size": file("short.key", b"x" * 7, 0o600),
        "another key": file("other.key", os.urandom(32), 0o600),
        "a host file": "/etc/hostname" if os.path.exists("/etc/hostname") else "/etc/passwd",
    }
    api.vault.seal()
    answers = {what: _unseal(api, path) for what, path in probes.items()}
    for what, r in answers.items():
        assert (r.status_code, r.json()) == (400, {"error": "key_error", "message": KEY_FILE_UNUSABLE}), (what, r.text)
    assert api.vault.sealed
    assert "not found" in caplog.text and "not a regular file" in caplog.text   # the log says which
    r = _unseal(api, str(key_path))
    assert r.status_code == 200 and r.json()["sealed"] is False, r.text
