"""Send traffic from inside a sandbox netns: real sockets and crafted L2 frames."""
from __future__ import annotations

import socket
import struct

from cubevs import netns

ETH_P_IP, ETH_P_ARP, ETH_P_IPV6 = 0x0800, 0x0806, 0x86DD


def mac_bytes(mac: str) -> bytes:
    return bytes.fromhex(mac.replace(":", ""))


def _csum(b: bytes) -> int:
    if len(b) % 2:
        b += b"\0"
    s = sum(struct.unpack(f"!{len(b) // 2}H", b))
    while s >> 16:
        s = (s & 0xFFFF) + (s >> 16)
    return ~s & 0xFFFF


def eth(dst: str, src: str, ethertype: int) -> bytes:
    return mac_bytes(dst) + mac_bytes(src) + struct.pack("!H", ethertype)


def ipv4(src: str, dst: str, proto: int, l4: bytes, *, frag: int = 0, ver_ihl: int = 0x45) -> bytes:
    """IPv4 header (checksummed) + l4 bytes; `frag` = flags|fragment offset field."""
    hdr = struct.pack("!BBHHHBBH4s4s", ver_ihl, 0, 20 + len(l4), 1, frag, 64, proto, 0,
                      socket.inet_aton(src), socket.inet_aton(dst))
    hdr = hdr[:10] + struct.pack("!H", _csum(hdr)) + hdr[12:]
    return hdr + l4


def ipv4_udp(src: str, dst: str, sport: int, dport: int, payload: bytes, **kw) -> bytes:
    return ipv4(src, dst, 17, struct.pack("!HHHH", sport, dport, 8 + len(payload), 0) + payload, **kw)


def ipv4_tcp(src: str, dst: str, sport: int, dport: int, flags: int = 0x02, **kw) -> bytes:
    """A bare TCP segment (SYN by default); checksum left 0, the switch does not check it."""
    return ipv4(src, dst, 6, struct.pack("!HHIIBBHHH", sport, dport, 1, 0, 5 << 4, flags, 65535, 0, 0),
                **kw)


def ipv4_icmp_echo(src: str, dst: str) -> bytes:
    body = struct.pack("!BBHHH", 8, 0, 0, 1, 1) + b"ping"
    return ipv4(src, dst, 1, body[:2] + struct.pack("!H", _csum(body)) + body[4:])


def arp_request(sha: str, spa: str, tpa: str, *, htype: int = 1) -> bytes:
    return struct.pack("!HHBBH6s4s6s4s", htype, ETH_P_IP, 6, 4, 1, mac_bytes(sha),
                       socket.inet_aton(spa), b"\0" * 6, socket.inet_aton(tpa))


def ipv6_udp(payload: bytes = b"x" * 8) -> bytes:
    udp = struct.pack("!HHHH", 1234, 443, 8 + len(payload), 0) + payload
    return (struct.pack("!IHBB", 6 << 28, len(udp), 17, 64)
            + socket.inet_pton(socket.AF_INET6, "fe80::1") + socket.inet_pton(socket.AF_INET6, "2001:db8::1")
            + udp)


def send_frames(ns: str, frames: list[bytes], ifname: str = "eth0") -> None:
    with netns.entered(ns):
        s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW)
    try:
        s.bind((ifname, 0))
        for f in frames:
            s.send(f)
    finally:
        s.close()


def udp_exchange(ns: str, dst: tuple[str, int], payload: bytes = b"ping", *, count: int = 1,
                 src: str | None = None, timeout: float = 0.5) -> list[bytes]:
    """Send `count` datagrams, return the replies received within `timeout`."""
    with netns.entered(ns):
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        if src:
            s.bind((src, 0))
        for _ in range(count):
            s.sendto(payload, dst)
        s.settimeout(timeout)
        replies = []
        try:
            while len(replies) < count:
                replies.append(s.recvfrom(65535)[0])
        except (TimeoutError, socket.timeout):
            pass
        return replies
    finally:
        s.close()


def tcp_fetch(ns: str, dst: tuple[str, int], *, src: str | None = None,
              timeout: float = 0.6) -> bytes | None:
    """Connect and read the greeting; None if the connection fails/times out."""
    with netns.entered(ns):
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.settimeout(timeout)
        if src:
            s.bind((src, 0))
        s.connect(dst)
        data = b""
        while True:
            chunk = s.recv(4096)
            if not chunk:
                return data
            data += chunk
    except OSError:
        return None
    finally:
        s.close()
