"""Attach/detach from worker threads (the daemon runs them in a thread pool): everything
must land in the hub and sandbox namespaces, nothing in the caller's namespace.

Regression: with IPRoute() opened after setns() in the main thread, pyroute2 0.9 made a
new socket in the worker thread, in the root namespace: the veth was created there."""
from __future__ import annotations

import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest


def _ns_read(ns: str, *paths: str) -> list[str]:
    r = subprocess.run(["nsenter", f"--net=/run/netns/{ns}", "cat", *paths], capture_output=True, text=True,
                       timeout=10)
    assert r.returncode == 0, r.stderr
    return r.stdout.split()


@pytest.mark.parametrize("fresh_lab", ["ebpf"], indirect=True)
def test_attach_from_worker_threads_stays_in_its_namespaces(fresh_lab):
    sw = fresh_lab.sw
    root_links_before = subprocess.run(["ip", "-br", "link"], capture_output=True, text=True).stdout
    with ThreadPoolExecutor(4) as ex:
        nets = list(ex.map(lambda i: sw.attach_sandbox(f"thr-{i}"), range(4)))
    try:
        assert subprocess.run(["ip", "-br", "link"], capture_output=True, text=True).stdout == root_links_before
        for net in nets:
            hub = subprocess.run(["ip", "-n", fresh_lab.hub, "-br", "link", "show", net.host_ifname],
                                 capture_output=True, text=True)
            assert hub.returncode == 0 and net.host_ifname in hub.stdout
            assert _ns_read(fresh_lab.hub, f"/proc/sys/net/ipv4/conf/{net.host_ifname}/rp_filter",
                            f"/proc/sys/net/ipv6/conf/{net.host_ifname}/disable_ipv6") == ["1", "1"]
            assert _ns_read(net.netns, "/proc/sys/net/ipv6/conf/all/disable_ipv6",
                            "/proc/sys/net/ipv4/ip_forward") == ["1", "0"]
            addr = subprocess.run(["ip", "-n", net.netns, "-br", "addr", "show", "eth0"], capture_output=True,
                                  text=True).stdout
            assert f"{net.ip}/32" in addr
    finally:
        with ThreadPoolExecutor(4) as ex:
            list(ex.map(lambda n: sw.detach_sandbox(n.sandbox_id), nets))
    assert subprocess.run(["ip", "-br", "link"], capture_output=True, text=True).stdout == root_links_before
