"""`cubegate demo`: a lab network, the gateway with the example policy, real requests.

Everything runs inside network namespaces the demo creates (a "gw" namespace
for the gateway and the sandbox client, a "net" namespace standing in for the
internet with a DNS server and HTTPS upstreams signed by a lab CA). Nothing
touches the root namespace; everything is removed at the end.
"""
from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
PROXY_PORT, OPS_PORT, VAULT_PORT, TRANSPARENT_PORT, RUNTIME_PORT = 8080, 9090, 9091, 8081, 9092
HUB_IP = "10.200.0.1"   # the cubevs switch's gateway address (sandbox default route and DNS)


def _say(text: str) -> None:
    print(f"\n\033[1m== {text}\033[0m", flush=True)


def _curl(lab, proxy: str, url: str, *extra: str) -> str:
    r = lab.curl("-x", proxy, "-o", "/dev/null", "-w", "%{http_connect} %{http_code}", *extra, url,
                 lab_dns=False, timeout=10)
    connect, status = (r.stdout.split() + ["000", "000"])[:2]
    if connect not in ("000", "200"):
        return f"refused at CONNECT: {connect}"
    return f"HTTP {status}" + (f" ({r.stderr.strip()})" if r.returncode and r.stderr.strip() else "")


def run_demo(keep: bool = False) -> int:
    from testbed.lab import Lab

    work = Path(tempfile.mkdtemp(prefix="cubegate-demo-"))
    gw_proc = None
    try:
        _say("starting the lab network (namespaces, DNS server, HTTPS upstreams)")
        with Lab(workdir=work / "lab") as lab:
            print(f"gateway namespace {lab.gw_ns}, internet namespace {lab.net_ns}, DNS {lab.dns_addr}")
            settings = {
                "state_dir": str(work / "state"),
                "policy_dir": str(REPO / "policies"),
                # 0.0.0.0: the switch steers sandbox traffic to the transparent port on the hub address
                "proxy": {"listen_host": "0.0.0.0", "explicit_port": PROXY_PORT,
                          "transparent_port": TRANSPARENT_PORT},
                "dns": {"listen_host": HUB_IP, "port": 53},
                "runtime": {"enabled": True, "api_port": RUNTIME_PORT},
                "ops": {"listen_host": "127.0.0.1", "port": OPS_PORT},
                "upstream": {"ca_bundle": str(lab.ca.bundle_path), "nameservers": [lab.dns_addr],
                             "allow_cidrs": ["198.18.0.0/24"]},
                "vault": {"api_port": VAULT_PORT},
            }
            cfg = work / "settings.yaml"
            cfg.write_text(yaml.safe_dump(settings))
            cli = [sys.executable, "-m", "cubegate.cli", "-c", str(cfg)]
            token = subprocess.run([*cli, "identity", "add", "demo-sandbox", "--label", "team=demo"],
                                   check=True, capture_output=True, text=True).stdout.strip()
            proxy = f"http://demo-sandbox:{token}@127.0.0.1:{PROXY_PORT}"
            _setup_demo_vault(cli)
            _say(f"starting the gateway with policies/ (proxy 127.0.0.1:{PROXY_PORT}, ops :{OPS_PORT})")
            log = open(work / "gateway.log", "wb")
            gw_proc = lab.spawn_gw([*cli, "run"], stdout=log, stderr=log, cwd=REPO, lab_dns=False)
            for _ in range(150):
                r = lab.curl("-s", "-o", "/dev/null", "-w", "%{http_code}", f"http://127.0.0.1:{OPS_PORT}/readyz",
                             cacert=False, lab_dns=False)
                if r.stdout.strip() == "200":
                    break
                if gw_proc.poll() is not None:
                    print((work / "gateway.log").read_text())
                    return 1
                time.sleep(0.2)
            else:
                print("gateway did not become ready:\n" + (work / "gateway.log").read_text())
                return 1
            print(lab.curl("-s", f"http://127.0.0.1:{OPS_PORT}/readyz", cacert=False, lab_dns=False).stdout)

            ca = str(Path(settings["state_dir"]) / "ca" / "mitmproxy-ca-cert.pem")
            placeholder = subprocess.run([*cli, "identity", "placeholders", "demo-sandbox"], check=True,
                                         capture_output=True, text=True).stdout.strip()
            print(f"the sandbox's environment holds only a placeholder: {placeholder}")
            ph_value = placeholder.split("=", 1)[1]
            cases = [
                ("allowed, TLS passed through untouched", "https://api.allowed.test/v1/models", ()),
                ("allowed by wildcard *.github.test", "https://x.github.test/", ()),
                ("denied by policy (decided at CONNECT, upstream never contacted)", "https://denied.test/", ()),
                ("denied: name resolves to cloud metadata 169.254.169.254 (SSRF guard)", "https://metadata.evil.test/", ()),
                ("plain HTTP through the same policy", "http://api.allowed.test/plain", ()),
                ("credential injected by the gateway (sandbox sends only its placeholder)",
                 "https://echo.allowed.test/v1/chat", ("--cacert", ca, "-H", f"Authorization: Bearer {ph_value}")),
                ("placeholder sent to a host it is not bound to: blocked and alerted",
                 f"http://passthrough.allowed.test/upload?token={ph_value}", ()),
            ]
            for title, url, extra in cases:
                _say(title)
                print(f"$ curl -x http://demo-sandbox:***@127.0.0.1:{PROXY_PORT} {url}")
                print("  ->", _curl(lab, proxy, url, *extra))
            r = lab.curl("-s", "-x", proxy, "--cacert", ca, "-H", f"Authorization: Bearer {ph_value}",
                         "https://echo.allowed.test/v1/chat", lab_dns=False)
            try:
                seen = [v for k, v in json.loads(r.stdout)["header_list"] if k.lower() == "authorization"]
                print(f"  the upstream echoes the Authorization it received: {seen}")
                print("  (the real key was injected; the gateway scrubs it from the echo before the sandbox sees it)")
            except (ValueError, KeyError):
                pass

            _sandbox_demo(lab, cli, work, ca)

            time.sleep(1.2)
            _say("audit records (cubegate audit query)")
            subprocess.run([*cli, "audit", "query", "--dir", str(Path(settings["state_dir"]) / "audit"),
                            "--limit", "30"], cwd=REPO)
            if keep:
                _say("gateway running; Ctrl-C to stop and clean up")
                try:
                    gw_proc.wait()
                except KeyboardInterrupt:
                    pass
            gw_proc.send_signal(signal.SIGTERM)
            gw_proc.wait(10)
        _say("done: namespaces and processes removed")
        return 0
    finally:
        if gw_proc and gw_proc.poll() is None:
            gw_proc.kill()
        _remove_switch(work / "state" / "cubevs")
        shutil.rmtree(work, ignore_errors=True)


DEMO_SECRET = "sk-demo-0123456789abcdef"  # stands in for a real API key; never shown below


def _setup_demo_vault(cli: list[str]) -> None:
    """Store a demo secret and bind it to echo.allowed.test (tenant "demo" from policies/example.yaml)."""
    run = lambda *a, **kw: subprocess.run([*cli, "vault", *a], check=True, capture_output=True, text=True, **kw)
    run("init")
    run("secret", "put", "demo", "openai", input=DEMO_SECRET + "\n")
    run("binding", "add", "--id", "openai-echo", "--tenant", "demo", "--secret", "openai",
        "--host", "echo.allowed.test", "--port", "443", "--header", "Authorization",
        "--format", "Bearer {secret}", "--placeholder")
    print("vault: secret demo/openai stored encrypted; bound to https://echo.allowed.test (Authorization: Bearer ...)")


def _sandbox_demo(lab, cli: list[str], work: Path, gateway_ca: str) -> None:
    """A real sandbox (bubblewrap, on the cubevs switch, no proxy settings at all)."""
    sb = [*cli, "sandbox"]

    def run(*a: str) -> subprocess.CompletedProcess:
        return lab.run_gw([*sb, *a], lab_dns=False, cwd=REPO, timeout=60)

    ca = work / "sandbox-ca.pem"   # the lab's upstream CA + the gateway's interception CA
    ca.write_text(Path(lab.ca.bundle_path).read_text() + Path(gateway_ca).read_text())
    _say("a sandbox: bubblewrap namespaces + cgroups + seccomp, on the eBPF switch (transparent mode)")
    print("$ cubegate sandbox create demo-agent --tenant demo --secret-env OPENAI_API_KEY=openai --file ca.pem=...")
    r = run("create", "demo-agent", "--tenant", "demo", "--secret-env", "OPENAI_API_KEY=openai",
            "--file", f"ca.pem={ca}")
    print("  ->", (r.stdout or r.stderr).strip())
    if r.returncode != 0:
        return
    try:
        curl = ["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", "--max-time", "5",
                "--cacert", "/workspace/ca.pem"]
        for title, argv in [
            ("inside the sandbox: env holds a placeholder, not the key", ["sh", "-c", "echo OPENAI_API_KEY=$OPENAI_API_KEY"]),
            ("inside: allowed host (no proxy configured: the switch steers it)", [*curl, "https://api.allowed.test/v1/models"]),
            ("inside: denied host (NXDOMAIN from the sandbox resolver)", [*curl, "https://denied.test/"]),
            ("inside: straight to an IP, bypassing DNS and the gateway (dropped by the switch)",
             ["curl", "-s", "--max-time", "3", "http://198.18.0.10:8443/"]),
            ("inside: credential injected on the way out",
             ["sh", "-c", 'curl -s --cacert /workspace/ca.pem -H "Authorization: Bearer $OPENAI_API_KEY" '
              "https://echo.allowed.test/v1/chat | grep -o '\"[Aa]uthorization\", \"[^\"]*\"'"]),
        ]:
            _say(title)
            print(f"$ cubegate sandbox exec demo-agent -- {' '.join(argv)}")
            r = run("exec", "demo-agent", "--", *argv)
            out = (r.stdout.strip() or r.stderr.strip() or "(no output)")
            print(f"  -> exit {r.returncode}: {out}")
        print(run("ls").stdout)
    finally:
        r = run("rm", "demo-agent")
        print((r.stdout or r.stderr).strip())


def _remove_switch(state_dir: Path) -> None:
    """The eBPF pins live on a bpffs mounted in the state dir: unmount it before the dir goes."""
    from contextlib import suppress
    bpffs = state_dir / "bpf"
    if bpffs.is_dir():
        from cubevs import datapath, libbpf
        with suppress(Exception):
            datapath.remove_pins(bpffs)
        with suppress(Exception):
            libbpf.umount_bpffs(bpffs)
