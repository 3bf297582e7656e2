import os
import socket
import subprocess

import pytest

from testbed import netns

pytestmark = pytest.mark.netns


@pytest.fixture
def root_only():
    if os.geteuid() != 0:
        pytest.skip("needs root")


def test_prefix_shape():
    p = netns.unique_prefix()
    assert len(p) == 8 and p.startswith("cg") and int(p[2:], 16) >= 0
    assert netns.unique_prefix() != p


def test_netns_lifecycle_and_veth(root_only):
    prefix = netns.unique_prefix()
    with netns.Netns(f"{prefix}-a") as a, netns.Netns(f"{prefix}-b") as b:
        assert netns.exists(a.name)
        netns.veth_pair(a, b, f"{prefix}a", f"{prefix}b", ["10.99.0.1/24"], ["10.99.0.2/24"])
        # a socket belongs to the namespace of the thread that created it
        listener = b.call(lambda: socket.create_server(("10.99.0.2", 0)))
        port = listener.getsockname()[1]
        peer = a.call(lambda: socket.create_connection(("10.99.0.2", port), timeout=3).getsockname()[0])
        assert peer == "10.99.0.1"
        listener.close()
        # the root namespace never sees the veth
        assert f"{prefix}a" not in subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
        sleeper = b.spawn(["sh", "-c", "echo up; exec sleep 60"], stdout=subprocess.PIPE, text=True)
        assert sleeper.stdout.readline() == "up\n"  # nsenter has entered and exec'd by now
        assert sleeper.pid in netns.pids_in(b.name)
    assert not netns.exists(a.name) and not netns.exists(b.name)
    assert sleeper.wait(5) != 0  # killed with the namespace
    sleeper.stdout.close()
    netns.Netns(f"{prefix}-a").delete()  # idempotent


def test_call_in_netns_switches_only_its_thread(root_only):
    with netns.Netns() as ns:
        target = f"net:[{os.stat(ns.path).st_ino}]"
        assert ns.call(lambda: os.readlink("/proc/thread-self/ns/net")) == target
        assert os.readlink("/proc/thread-self/ns/net") != target
        inside = ns.run(["ip", "-o", "link"], capture_output=True).stdout
        assert inside.count("\n") == 1 and ": lo:" in inside  # only lo inside
        with pytest.raises(ZeroDivisionError):
            ns.call(lambda: 1 / 0)


def test_delete_removes_a_stale_entry(root_only):
    ns = netns.Netns()
    os.makedirs(netns.NETNS_DIR, exist_ok=True)
    open(ns.path, "w").close()  # what a crashed run can leave behind
    ns.delete()
    assert not os.path.exists(ns.path)
