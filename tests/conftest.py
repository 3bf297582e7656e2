"""Lab fixture. Written to be moved as-is into tests/conftest.py."""

from __future__ import annotations

import os
import shutil

import pytest


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
