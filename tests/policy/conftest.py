import pytest

from egress.policy import CompiledPolicySet, load_policy_files
from policy_testlib import write


@pytest.fixture
def load(tmp_path):
    """load(text, name='p.yaml') -> CompiledPolicySet from one file."""

    def _load(text: str, name: str = "p.yaml") -> CompiledPolicySet:
        return load_policy_files([write(tmp_path, name, text)])

    return _load
