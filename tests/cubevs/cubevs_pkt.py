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


def ipv4_udp(src: str, dst: str, sport: int, dport: int, payload: bytes) -> bytes:
    udp = struct.pack("!HHHH", sport, dport, 8 + len(payload), 0) + payload
    hdr = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(udp), 1, 0, 64, 17, 0,
                      socket.inet_aton(src), socket.inet_aton(dst))
    hdr = hdr[:10] + struct.pack("!H", _csum(hdr)) + hdr[12:]
    return hdr + udp


def arp_request(sha: str, spa: str, tpa: str) -> bytes:
    return struct.pack("!HHBBH6s4s6s4s", 1, ETH_P_IP, 6, 4, 1, mac_bytes(sha),
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
