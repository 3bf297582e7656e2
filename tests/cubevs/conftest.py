"""Fixtures for cubevs tests (see cubevs_lab.py)."""
from __future__ import annotations

import os

import pytest

if os.geteuid() != 0:
    pytest.skip("cubevs tests need root", allow_module_level=True)

from cubevs_lab import Lab  # noqa: E402

BACKENDS = ["ebpf", "nftables"]


@pytest.fixture(scope="module", params=BACKENDS)
def lab(request):
    lab = Lab(request.param)
    try:
        lab.setup()
        yield lab
    finally:
        lab.teardown()


@pytest.fixture
def fresh_lab(request):
    """A lab per test (for restart/teardown tests); backend from parametrize."""
    lab = Lab(getattr(request, "param", "ebpf"))
    try:
        lab.setup()
        yield lab
    finally:
        lab.teardown()
