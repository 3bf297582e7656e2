"""nginx (apt: nginx-light) as the bench's upstream, in the lab's "internet" namespace.

One server on <ip>:80 and <ip>:443 (certificate from the lab's test CA)
answers every path with 200 "ok". Two things the bench reads from it:

  accepted()   stub_status "accepts" (every TCP connection nginx accepted,
               also tunnels that never carried a request), on 127.0.0.1 of
               the net namespace, so it is off the proxies' path
  log lines    one per request: connection serial, host, and whether the
               request carried the injected credential ("injected"), an
               other Authorization ("other") or none ("none"); never the value
"""
from __future__ import annotations

import socket
import subprocess
import time
from pathlib import Path

from testbed import netns

__all__ = ["NginxUpstream"]

STUB_PORT = 18099

CONF = """\
worker_processes 1;
pid {dir}/nginx.pid;
error_log {dir}/error.log warn;
events {{ worker_connections 4096; }}
http {{
    client_body_temp_path {dir}/tmp-body;
    proxy_temp_path {dir}/tmp-proxy;
    fastcgi_temp_path {dir}/tmp-fastcgi;
    uwsgi_temp_path {dir}/tmp-uwsgi;
    scgi_temp_path {dir}/tmp-scgi;
    keepalive_requests 1000000;
    keepalive_timeout 60s;
    map $http_authorization $credential {{
        ""                       none;
        "{expected_auth}"        injected;
        default                  other;
    }}
    log_format bench '$connection $host $credential $status';
    server {{
        listen {ip}:80;
        listen {ip}:443 ssl;
        ssl_certificate {cert};
        ssl_certificate_key {key};
        access_log {dir}/access.log bench;
        location / {{ default_type text/plain; return 200 "ok\\n"; }}
    }}
    server {{
        listen 127.0.0.1:{stub_port};
        access_log off;
        location / {{ stub_status; }}
    }}
}}
"""


class NginxUpstream:
    def __init__(self, lab, workdir: Path, ip: str, names: list[str], expected_auth: str) -> None:
        self.lab = lab
        self.dir = Path(workdir)
        self.ip = ip
        self.names = names
        self.expected_auth = expected_auth
        self.proc: subprocess.Popen | None = None
        self._status_queries = 0

    @property
    def access_log(self) -> Path:
        return self.dir / "access.log"

    def start(self) -> "NginxUpstream":
        self.dir.mkdir(parents=True, exist_ok=True)
        for name in self.names:
            self.lab.add_host(name, self.ip)
        cert, key = self.lab.ca.issue(self.names, [self.ip], stem="bench-nginx")
        conf = self.dir / "nginx.conf"
        conf.write_text(CONF.format(dir=self.dir, ip=self.ip, cert=cert, key=key, stub_port=STUB_PORT,
                                    expected_auth=self.expected_auth))
        self.access_log.touch()
        log = open(self.dir / "stdout.log", "ab")
        self.proc = self.lab.spawn_net(["nginx", "-e", str(self.dir / "error.log"), "-p", str(self.dir),
                                        "-c", str(conf), "-g", "daemon off;"],
                                       stdout=log, stderr=log, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"nginx exited {self.proc.returncode}: {self._errors()}")
            try:
                self.accepted()
                return self
            except OSError:
                time.sleep(0.1)
        raise RuntimeError(f"nginx did not listen within 10 s: {self._errors()}")

    def _errors(self) -> str:
        parts = [p.read_text(errors="replace")[-2000:] for p in (self.dir / "error.log", self.dir / "stdout.log")
                 if p.exists()]
        return "\n".join(parts)

    def accepted(self) -> int:
        """Connections accepted so far, not counting the status queries (this one included)."""
        def query() -> bytes:
            with socket.create_connection(("127.0.0.1", STUB_PORT), timeout=5) as s:
                s.sendall(b"GET / HTTP/1.0\r\n\r\n")
                chunks = []
                while chunk := s.recv(4096):
                    chunks.append(chunk)
                return b"".join(chunks)
        body = netns.call_in_netns(self.lab.net_ns, query, timeout=10).decode()
        self._status_queries += 1
        # "...\nserver accepts handled requests\n N N N\n..."
        numbers = body.split("server accepts handled requests", 1)[1].split()
        return int(numbers[0]) - self._status_queries

    def log_offset(self) -> int:
        return self.access_log.stat().st_size

    def log_lines(self, since: int) -> list[list[str]]:
        with open(self.access_log, "rb") as f:
            f.seek(since)
            return [l.split() for l in f.read().decode(errors="replace").splitlines() if l.strip()]

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()  # nginx: SIGTERM = fast shutdown
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
