"""The web page of the capacity bench, served by nginx in the lab's "internet" namespace.

One HTML page on www.shop.test referencing 40 resources on three hosts (HTTPS,
HTTP/2, `Cache-Control: no-store` so every load fetches them all again):

    www.shop.test   the page, 3 stylesheets, 8 images          TLS passthrough
    cdn.shop.test   2 stylesheets, 16 images                   TLS passthrough
    api.shop.test   11 scripts                                 intercepted, credential injected

The page measures itself with the browser's own clock: after its load event
it reads the PerformanceNavigationTiming entry (navigation start → end of the
load event, every resource fetched, parsed and run) and counts what really
loaded (images decoded, scripts run, stylesheets attached, no resource with a
non-200 status), sends that as a beacon (`/beacon?...` on www, through the
gateway like everything else) and navigates to the next round until `n`. The
bench reads the beacons from nginx's access log: nothing of the measurement
runs outside the sandbox. nginx logs, per request, the host, the path, the
status and whether it carried the injected credential (never the value).
"""
from __future__ import annotations

import random
import struct
import subprocess
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

__all__ = ["HOSTS", "INTERCEPTED", "Site", "Beacon", "build_site", "parse_beacons"]

HOSTS = {"www.shop.test": "198.18.0.40", "cdn.shop.test": "198.18.0.41", "api.shop.test": "198.18.0.42"}
INTERCEPTED = "api.shop.test"
LAYOUT = {"www.shop.test": {"css": 3, "img": 8}, "cdn.shop.test": {"css": 2, "img": 16},
          "api.shop.test": {"js": 11}}
RESOURCES = sum(sum(kinds.values()) for kinds in LAYOUT.values())   # 40

PAGE_SCRIPT = """
window.addEventListener('load', () => setTimeout(() => {
  const q = new URLSearchParams(location.search);
  const round = +q.get('r') || 1, rounds = +q.get('n') || 1;
  const nav = performance.getEntriesByType('navigation')[0];
  const res = performance.getEntriesByType('resource');
  const bad = res.filter((e) => e.responseStatus && e.responseStatus !== 200).length;
  const imgs = [...document.images].filter((i) => i.complete && i.naturalWidth > 0).length;
  const ok = imgs + (window.__js || 0) + document.styleSheets.length;
  const b = new URLSearchParams({sb: q.get('sb'), r: round, load: nav.loadEventEnd.toFixed(1),
    dcl: nav.domContentLoadedEventEnd.toFixed(1), ok: ok, want: %(want)d, res: res.length, bad: bad});
  navigator.sendBeacon('/beacon?' + b.toString());
  if (round < rounds) { q.set('r', round + 1); setTimeout(() => location.replace('?' + q.toString()), 50); }
}, 0));
"""


def _png(width: int, height: int, rng: random.Random) -> bytes:
    """An RGB PNG of noise (incompressible: its size is about width*height*3 bytes)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    rows = b"".join(b"\0" + rng.randbytes(width * 3) for _ in range(height))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(rows, 6)) + chunk(b"IEND", b""))


def build_site(root: Path, seed: int = 16) -> tuple[str, int]:
    """Write every host's files under root/<host>/; returns (page path, total bytes of one load)."""
    rng = random.Random(seed)
    refs: list[str] = []
    total = 0
    for host, kinds in LAYOUT.items():
        d = root / host
        d.mkdir(parents=True, exist_ok=True)
        for i in range(kinds.get("css", 0)):
            body = "".join(f".c{i}-{j} {{ margin: {j % 7}px; color: #{rng.randrange(1 << 24):06x}; }}\n"
                           for j in range(150)).encode()
            (d / f"s{i}.css").write_bytes(body)
            refs.append(f'<link rel="stylesheet" href="https://{host}/s{i}.css">')
            total += len(body)
        for i in range(kinds.get("img", 0)):
            side = rng.choice((24, 32, 48, 64, 96))
            body = _png(side, side, rng)
            (d / f"i{i}.png").write_bytes(body)
            refs.append(f'<img src="https://{host}/i{i}.png" width="{side}" height="{side}">')
            total += len(body)
        for i in range(kinds.get("js", 0)):
            pad = "".join(f"function f{i}_{j}(x) {{ return x * {j} + {rng.randrange(1000)}; }}\n" for j in range(200))
            body = f"window.__js = (window.__js || 0) + 1;\n{pad}".encode()
            (d / f"a{i}.js").write_bytes(body)
            refs.append(f'<script src="https://{host}/a{i}.js"></script>')
            total += len(body)
    assert len(refs) == RESOURCES
    page = ("<!doctype html><html><head><meta charset=utf-8><title>shop</title><link rel=icon href=\"data:,\">"
            + "".join(r for r in refs if r.startswith("<link"))
            + f"<script>{PAGE_SCRIPT % {'want': RESOURCES}}</script></head><body><h1>shop</h1>"
            + "".join(r for r in refs if not r.startswith("<link")) + "</body></html>\n").encode()
    (root / "www.shop.test" / "index.html").write_bytes(page)
    return "/index.html", total + len(page)


# user root: the files sit in the bench's private (0700) temporary directory
NGINX_CONF = """\
user root;
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
    include /etc/nginx/mime.types;
    keepalive_requests 100000;
    keepalive_timeout 120s;
    map $http_authorization $credential {{
        ""                       none;
        "{expected_auth}"        injected;
        default                  other;
    }}
    log_format cap '$host $uri $status $credential $request_uri';
    server {{
        {listen}
        ssl_certificate {cert};
        ssl_certificate_key {key};
        access_log {dir}/access.log cap;
        root {site}/$host;
        add_header Cache-Control "no-store" always;
        location = /beacon {{ return 204; }}
        location / {{ try_files $uri =404; }}
    }}
}}
"""


class Site:
    """nginx serving build_site()'s files for HOSTS; add_host() puts the names in the lab's DNS."""

    def __init__(self, lab, workdir: Path, expected_auth: str):
        self.lab, self.dir, self.expected_auth = lab, Path(workdir), expected_auth
        self.proc: subprocess.Popen | None = None
        self.page = "/index.html"
        self.bytes_per_load = 0

    @property
    def access_log(self) -> Path:
        return self.dir / "access.log"

    def start(self) -> "Site":
        self.dir.mkdir(parents=True, exist_ok=True)
        self.page, self.bytes_per_load = build_site(self.dir / "site")
        for name, ip in HOSTS.items():
            self.lab.add_host(name, ip)
        cert, key = self.lab.ca.issue(list(HOSTS), list(HOSTS.values()), stem="capacity-site")
        # nginx 1.22 (Debian 12): HTTP/2 is switched on on the listen line
        listen = " ".join(f"listen {ip}:443 ssl http2;" for ip in HOSTS.values())
        conf = self.dir / "nginx.conf"
        conf.write_text(NGINX_CONF.format(dir=self.dir, site=self.dir / "site", listen=listen, cert=cert, key=key,
                                          expected_auth=self.expected_auth))
        self.access_log.touch()
        log = open(self.dir / "stdout.log", "ab")
        self.proc = self.lab.spawn_net(["nginx", "-e", str(self.dir / "error.log"), "-p", str(self.dir),
                                        "-c", str(conf), "-g", "daemon off;"],
                                       stdout=log, stderr=log, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"nginx exited {self.proc.returncode}: {self.errors()}")
            if (self.dir / "nginx.pid").exists():
                return self
            time.sleep(0.1)
        raise RuntimeError(f"nginx did not start within 10 s: {self.errors()}")

    def errors(self) -> str:
        return "\n".join(p.read_text(errors="replace")[-2000:] for p in (self.dir / "error.log",
                                                                         self.dir / "stdout.log") if p.exists())

    def log_lines(self, since: int = 0) -> tuple[list[list[str]], int]:
        """Access log lines from byte offset `since` (whole lines only), and the next offset."""
        with open(self.access_log, "rb") as f:
            f.seek(since)
            data = f.read()
        end = data.rfind(b"\n") + 1
        return [line.split() for line in data[:end].decode(errors="replace").splitlines() if line.strip()], since + end

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


@dataclass(frozen=True)
class Beacon:
    sandbox: str
    round: int
    load_ms: float      # navigation start → end of the load event (the page's own clock)
    dcl_ms: float       # navigation start → end of DOMContentLoaded
    ok: int             # resources that really loaded (decoded, run, attached)
    want: int
    bad: int            # resources with a non-200 status


def parse_beacons(lines: list[list[str]]) -> list[Beacon]:
    """From access log lines ($host $uri $status $credential $request_uri)."""
    out = []
    for f in lines:
        if len(f) < 5 or f[1] != "/beacon":
            continue
        q = {k: v[0] for k, v in parse_qs(urlsplit(f[4]).query).items()}
        try:
            out.append(Beacon(q["sb"], int(q["r"]), float(q["load"]), float(q["dcl"]), int(q["ok"]),
                              int(q["want"]), int(q["bad"])))
        except (KeyError, ValueError):
            continue
    return out
