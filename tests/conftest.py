"""Lab fixture. Written to be moved as-is into tests/conftest.py."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

# Load- and timing-sensitive tests (a soak's RSS and error bounds, the benches' figures, kill -9 and
# slow-client faults, rolling restarts, deadline asserts): `make test` runs them after the parallel
# part, alone on the machine, so the other workers' load cannot be what fails them.
SERIAL = ("soak/", "bench/", "faults/", "gateway/test_workers.py")
_TESTS = Path(__file__).parent


@pytest.hookimpl(tryfirst=True)   # before -m deselects by marker
def pytest_collection_modifyitems(config, items):
    for item in items:
        rel = Path(item.fspath).relative_to(_TESTS).as_posix()
        if rel.startswith(SERIAL):
            item.add_marker(pytest.mark.serial)


def _lab_unavailable() -> str | None:
    if os.geteuid() != 0:
        return "the lab needs root (network namespaces)"
    for tool in ("ip", "nsenter", "unshare", "curl"):
        if shutil.which(tool) is None:
            return f"the lab needs {tool}"
    return None


@pytest.fixture(scope="session")
def lab(tmp_path_factory):
    """The standard lab (testbed.lab.Lab), one per test session.

    Tests that change DNS answers with ``lab.set_zone`` must restore them.
    """
    reason = _lab_unavailable()
    if reason:
        pytest.skip(reason)
    from testbed.lab import Lab

    with Lab(workdir=tmp_path_factory.mktemp("lab")) as the_lab:
        yield the_lab
