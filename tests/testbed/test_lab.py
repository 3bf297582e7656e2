import json
import subprocess
import time

import dns.resolver
import pytest

from testbed import netns
from testbed.lab import HOSTS, Lab

pytestmark = pytest.mark.netns


def test_startup_is_fast(lab):
    assert lab.startup_seconds is not None and lab.startup_seconds < 3.0


def test_namespaces_and_addresses(lab):
    assert netns.exists(lab.gw_ns) and netns.exists(lab.net_ns)
    assert lab.dns_addr == "198.18.0.2:53"
    route = lab.run_gw(["ip", "route", "show", "default"], lab_dns=False).stdout
    assert "via 198.18.0.2" in route
    addrs = netns.run(lab.net_ns, ["ip", "-o", "-4", "addr"], capture_output=True).stdout
    for ip in ["198.18.0.2", *HOSTS.values()]:
        assert f" {ip}/" in addrs
    assert lab.gw_ns not in subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout


@pytest.mark.parametrize("name, expected", [
    ("api.allowed.test", ["198.18.0.10"]), ("github.test", ["198.18.0.17"]),
    ("evil-github.test", ["198.18.0.18"]), ("a.b.github.test", ["198.18.0.16"]),
    ("loopback.evil.test", ["127.0.0.1"]), ("metadata.evil.test", ["169.254.169.254"]),
    ("private.evil.test", ["10.0.0.1"]), ("cgnat.evil.test", ["100.64.0.1"]),
])
def test_dig_from_the_gw_namespace(lab, name, expected):
    r = lab.run_gw(["dig", "+short", "+time=2", "+tries=1", "@198.18.0.2", name, "A"])
    assert r.stdout.split() == expected, r.stderr


@pytest.mark.parametrize("name, expected", [("mapped.evil.test", "::ffff:127.0.0.1"),
                                            ("ula.evil.test", "fd00::1")])
def test_aaaa_answers(lab, name, expected):
    import ipaddress
    r = lab.run_gw(["dig", "+short", "+time=2", "+tries=1", "@198.18.0.2", name, "AAAA"])
    assert ipaddress.ip_address(r.stdout.strip()) == ipaddress.ip_address(expected)


def test_nxdomain_and_tcp(lab):
    r = lab.run_gw(["dig", "+time=2", "+tries=1", "@198.18.0.2", "nope.test", "A"])
    assert "status: NXDOMAIN" in r.stdout
    r = lab.run_gw(["dig", "+tcp", "+short", "+time=2", "@198.18.0.2", "denied.test", "A"])
    assert r.stdout.split() == ["198.18.0.12"]


def test_rebind_name_alternates_with_ttl_zero(lab):
    def ask():
        res = dns.resolver.Resolver(configure=False)
        res.nameservers = ["198.18.0.2"]
        res.cache = None
        answers = []
        for _ in range(4):
            a = res.resolve("rebind.allowed.test", "A")
            assert a.rrset.ttl == 0
            answers.append(a[0].address)
        return answers

    answers = lab.call_gw(ask)
    assert set(answers) == {"198.18.0.10", "127.0.0.1"}
    assert answers[0] != answers[1] and answers[0] == answers[2]


def test_set_zone_is_picked_up(lab):
    try:
        lab.set_zone("new.test", ["198.18.0.19"])
        r = lab.run_gw(["dig", "+short", "+time=2", "@198.18.0.2", "new.test"])
        assert r.stdout.split() == ["198.18.0.19"]
    finally:
        lab.set_zone("new.test", None)
    r = lab.run_gw(["dig", "+time=2", "@198.18.0.2", "new.test"])
    assert "NXDOMAIN" in r.stdout
    lab.wait_logs("dns", lambda out: "query A new.test" in out)


def test_system_resolver_in_gw_processes_uses_lab_dns(lab):
    r = lab.run_gw(["getent", "ahostsv4", "echo.allowed.test"])
    assert r.returncode == 0 and "198.18.0.13" in r.stdout


def test_curl_https_with_lab_ca(lab):
    r = lab.curl("https://api.allowed.test/some/path?q=1")
    assert r.returncode == 0, r.stderr
    body = json.loads(r.stdout)
    assert body["server"] == "api.allowed.test"
    assert body["tls"] is True and body["path"] == "/some/path?q=1"
    assert body["client"] == "198.18.0.1"


def test_curl_without_ca_fails_verification(lab):
    r = lab.curl("https://api.allowed.test/", cacert=False)
    assert r.returncode == 60, (r.returncode, r.stderr)  # peer certificate cannot be authenticated


def test_every_host_serves_its_own_name(lab):
    for name in HOSTS:
        r = lab.curl("-f", f"https://{name}/")
        assert r.returncode == 0, (name, r.stderr)
        assert json.loads(r.stdout)["server"] == name


def test_upstream_endpoints(lab):
    r = lab.curl("-si", "-H", "X-Secret-Probe: abc", "http://echo.allowed.test/echo-headers")
    assert "X-Echo-X-Secret-Probe: abc" in r.stdout
    r = lab.curl("-si", "https://redirect.allowed.test/redirect?to=https://denied.test/&code=307")
    assert r.stdout.startswith("HTTP/1.1 307") and "Location: https://denied.test/" in r.stdout
    r = lab.curl("-s", "-o", "/dev/null", "-w", "%{size_download}", "https://api.allowed.test/bytes?n=123456")
    assert r.stdout == "123456"
    r = lab.curl("-s", "-X", "PUT", "--data-binary", "hello", "https://api.allowed.test/put")
    body = json.loads(r.stdout)
    assert (body["method"], body["body_len"], body["body"]) == ("PUT", 5, "hello")
    r = lab.curl("-s", "-H", "Transfer-Encoding: chunked", "--data-binary", "chunky", "http://api.allowed.test/")
    assert json.loads(r.stdout)["body"] == "chunky"
    r = lab.curl("-sI", "https://api.allowed.test/")
    assert r.stdout.startswith("HTTP/1.1 200")
    r = lab.curl("-s", "-X", "DELETE", "-o", "/dev/null", "-w", "%{http_code}", "https://api.allowed.test/status?code=204")
    assert r.stdout == "204"
    t = time.monotonic()
    r = lab.curl("-s", "http://api.allowed.test/slow?ms=300")
    assert json.loads(r.stdout)["path"] == "/slow?ms=300" and time.monotonic() - t >= 0.3


def test_lab_cleans_up_even_when_the_body_fails(tmp_path):
    with pytest.raises(RuntimeError):
        with Lab(workdir=tmp_path) as lab:
            gw, net = lab.gw_ns, lab.net_ns
            extra = lab.spawn_gw(["sleep", "60"])
            pids = [m.popen.pid for m in lab.procs.values()]
            raise RuntimeError("test body failed")
    assert not netns.exists(gw) and not netns.exists(net)
    assert extra.poll() is not None
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            import os
            os.kill(pid, 0)


def test_bad_query_is_a_400_not_a_dropped_connection(lab):
    r = lab.curl("-s", "-o", "/dev/null", "-w", "%{http_code}", "http://api.allowed.test/bytes?n=lots")
    assert r.stdout == "400"
