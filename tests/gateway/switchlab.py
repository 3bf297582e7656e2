"""A cubevs switch in the lab's gw namespace + one sandbox + the real gateway in transparent mode."""
from __future__ import annotations

import shutil
import subprocess
import uuid
from contextlib import contextmanager, suppress

from tests.gateway.harness import Gateway

HUB_IP = "10.200.0.1"


def nft_delete(ns: str, family: str, table: str) -> None:
    subprocess.run(["nsenter", f"--net=/run/netns/{ns}", "nft", "delete", "table", family, table],
                   capture_output=True, timeout=10)


@contextmanager
def switch_lab(lab, tmp, policy: str, *, sandbox: str | None, tport: int, prefix: str, settings_extra=None,
               before_start=None):
    """sandbox=None: attach none (the runtime attaches its own); before_start(gw) runs after the
    switch exists and before the gateway starts (vault set-up)."""
    from cubevs import datapath, libbpf, steering
    from cubevs.switch import Switch

    cubevs_state, bpffs = tmp / "cubevs", tmp / "bpf"
    extra = {"proxy": {"listen_host": "0.0.0.0", "transparent_port": tport},
             "cubevs": {"state_dir": str(cubevs_state)}}
    for key, value in (settings_extra or {}).items():   # one level deep: a caller's proxy keys add to ours
        if isinstance(value, dict) and isinstance(extra.get(key), dict):
            extra[key] = {**extra[key], **value}
        else:
            extra[key] = value
    gw = Gateway(lab, tmp / "gw", {"main.yaml": policy}, sandboxes={sandbox: {"team": "t"}} if sandbox else None,
                 settings_extra=extra)
    sw = None
    try:
        sw = Switch(hub_netns=lab.gw_ns, state_dir=cubevs_state, bpffs_dir=bpffs,
                    transparent_port=tport, gateway_ports=(tport, gw.proxy_port, 80),   # 80: cubegate.internal
                    hub_addrs=(lab.gw_addr,), netns_prefix=prefix + uuid.uuid4().hex[:4])
        net = sw.attach_sandbox(sandbox) if sandbox else None
        if before_start is not None:
            before_start(gw)
        gw.start()
        yield gw, sw, net
    finally:
        gw.stop()
        if sw is not None:
            for sb in sw.sandboxes():
                with suppress(Exception):
                    sw.detach_sandbox(sb.sandbox_id)
            with suppress(Exception):
                sw.close()
        # The gw namespace is shared by the whole session: leave nothing of cubevs in it.
        with suppress(Exception):
            steering.remove(lab.gw_ns)
        nft_delete(lab.gw_ns, "netdev", "cubegate")
        subprocess.run(["ip", "-n", lab.gw_ns, "addr", "del", f"{HUB_IP}/32", "dev", "lo"],
                       capture_output=True, timeout=10)
        if bpffs.is_dir():
            with suppress(Exception):
                datapath.remove_pins(bpffs)
            with suppress(Exception):
                libbpf.umount_bpffs(bpffs)
        shutil.rmtree(bpffs, ignore_errors=True)
