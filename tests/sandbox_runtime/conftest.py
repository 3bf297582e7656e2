"""Fixtures shared by the sandbox_runtime tests (namespace and microvm backends)."""
from __future__ import annotations

import os
import shutil
import subprocess
import uuid

import pytest


@pytest.fixture(scope="session")
def agent_binary():
    """The static exec agent, built once per session (gcc -static)."""
    if shutil.which("gcc") is None:
        pytest.skip("gcc needed to build the agent")
    from sandbox_runtime.build_agent import build

    return build()


@pytest.fixture
def bare_netns():
    """An empty network namespace (only lo, down) for tests that need no network."""
    if os.geteuid() != 0:
        pytest.skip("needs root")
    name = f"cgsr{uuid.uuid4().hex[:8]}"
    subprocess.run(["ip", "netns", "add", name], check=True, capture_output=True, timeout=10)
    try:
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=10)
