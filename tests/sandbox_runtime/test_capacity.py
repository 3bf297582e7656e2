"""Admission: the budget is never exceeded, and the kernel's MemAvailable has the last word."""
import pytest

from sandbox_runtime.backend import Limits
from sandbox_runtime.capacity import Budget, CapacityError, Usage, admit, default_budget, meminfo_mb, reserved

B = Budget(memory_mb=1024, cpus=2.0, max_sandboxes=3, host_reserve_mb=256)


def test_admits_within_budget():
    admit(B, Usage(1, 512, 1.0), Limits(memory_mb=512, cpus=1.0), mem_available_mb=4096)


@pytest.mark.parametrize("used,want,words", [
    (Usage(1, 768, 0.5), Limits(memory_mb=512, cpus=0.5), "not enough memory: 512 MB asked, 256 MB"),
    (Usage(1, 0, 1.75), Limits(memory_mb=64, cpus=0.5), "not enough CPU: 0.5 asked, 0.25"),
    (Usage(3, 0, 0.0), Limits(memory_mb=64, cpus=0.1), "host is full: 3 of 3"),
])
def test_refuses_beyond_budget_with_the_shortfall(used, want, words):
    with pytest.raises(CapacityError, match=words.replace(".", r"\.")):
        admit(B, used, want, mem_available_mb=1 << 20)


def test_kernel_memory_has_the_last_word_over_a_generous_budget():
    generous = Budget(memory_mb=1 << 20, cpus=64, host_reserve_mb=512)
    with pytest.raises(CapacityError, match="not enough free memory on the host: 600 MB available"):
        admit(generous, Usage(), Limits(memory_mb=256), mem_available_mb=600)
    admit(generous, Usage(), Limits(memory_mb=88), mem_available_mb=600)


@pytest.mark.parametrize("bad", [Limits(memory_mb=0), Limits(cpus=0), Limits(pids=0), Limits(disk_mb=-1)])
def test_non_positive_limits_are_refused(bad):
    with pytest.raises(CapacityError, match="positive"):
        admit(B, Usage(), bad, None)


def test_reserved_sums_limits_and_exact_fill_is_allowed():
    u = reserved([Limits(memory_mb=512, cpus=1.0), Limits(memory_mb=256, cpus=0.5)])
    assert (u.sandboxes, u.memory_mb, u.cpus) == (2, 768, 1.5)
    admit(B, u, Limits(memory_mb=256, cpus=0.5), None)       # exactly full: allowed
    with pytest.raises(CapacityError):
        admit(B, reserved([Limits(memory_mb=512, cpus=1.0)] * 2), Limits(memory_mb=1, cpus=0.01), None)


def test_default_budget_comes_from_the_machine():
    mi = meminfo_mb()
    b = default_budget(host_reserve_mb=512)
    assert b.memory_mb == mi["MemTotal"] - 512 and b.cpus >= 1
    assert default_budget(memory_mb=100, cpus=0.5, pids=4096) == Budget(100, 0.5, 1000, 512, 4096)
