"""Lab fixture. Written to be moved as-is into tests/conftest.py."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

# Load- and timing-sensitive tests (a soak's RSS and error bounds, the benches' figures, kill -9 and
# slow-client faults, rolling restarts, deadline asserts, microVMs booted under TCG with exec
# deadlines, an event stream read event by event): `make test` runs them after the parallel part,
# alone on the machine, so the other workers' load cannot be what fails them.
SERIAL = ("soak/", "bench/", "faults/", "gateway/test_workers.py", "gateway/test_sse_stream.py",
          "sandbox_runtime/test_microvm.py", "sandbox_runtime/test_microvm_templates.py")
_TESTS = Path(__file__).parent
_SHORT_BASETEMP = pytest.StashKey[str]()


@pytest.hookimpl(tryfirst=True)   # before the tmp_path factory reads --basetemp
def pytest_configure(config):
    """Under xdist a worker's tmp dirs are <basetemp>/popen-gwN: below pytest's own root
    (/tmp/pytest-of-root/pytest-NNNN) that is too long for a sandbox's agent socket (a unix socket
    path has 108 bytes). So a parallel run gets a short root of its own, removed when the run passes."""
    if config.getoption("numprocesses", None) and not hasattr(config, "workerinput") \
            and not config.option.basetemp:
        config.option.basetemp = config.stash[_SHORT_BASETEMP] = tempfile.mkdtemp(prefix="cgt-")


def pytest_sessionfinish(session, exitstatus):
    short = session.config.stash.get(_SHORT_BASETEMP, None)
    # a failed run keeps its dirs to look at, as pytest's own do; so does one that left a mount
    # inside them (removing through a leaked bind mount would remove what it shows)
    if short and exitstatus == 0 and not _mounts_under(short):
        shutil.rmtree(short, ignore_errors=True)


def _mounts_under(root: str) -> list[str]:
    with open("/proc/self/mountinfo") as f:
        points = [line.split()[4] for line in f]
    return [p for p in points if p.startswith(root.rstrip("/") + "/")]


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
