"""Attack pass 7 on the E2B API: a tenant with a valid key against the other tenants.

FINDING: admission checked the host's budget only. With tenants of their own (e2b.token_tenants),
one tenant's key could create sandboxes until the host was full (runtime.max_sandboxes, its
memory and CPU budget), and every other tenant's create was 429 until it let go. Now one
tenant holds at most runtime.tenant_share of the budget (by default half, when the E2B API
names more than one tenant)."""
from __future__ import annotations

import httpx
import pytest
import yaml

from sandbox_runtime.backend import Limits
from sandbox_runtime.capacity import Budget, CapacityError, Usage, admit
from testbed.netns import call_in_netns
from tests.gateway.switchlab import HUB_IP, switch_lab

TPORT, API_PORT, E2B_PORT = 18494, 18493, 18495
BASE = f"http://127.0.0.1:{E2B_PORT}"
POLICY = "name: p\ntenant: acme\napplies_to: {labels: {tenant: acme}}\ndefault: deny\nrules: []\n"


# ------------------------------------------------------------------ the decision (pure)

BUDGET = Budget(memory_mb=1024, cpus=4.0, max_sandboxes=8, host_reserve_mb=0)
ONE = Limits(memory_mb=128, cpus=0.5)


@pytest.mark.parametrize("held,want,ok", [
    (Usage(3, 384, 1.5), ONE, True),                      # the 4th of a tenant: its half of 8
    (Usage(4, 512, 2.0), ONE, False),                     # the 5th: over its share of the count
    (Usage(1, 448, 0.5), ONE, False),                     # memory: 448 + 128 > 512
    (Usage(1, 128, 1.75), ONE, False),                    # CPUs: 1.75 + 0.5 > 2
])
def test_one_tenant_holds_at_most_its_share_of_the_budget(held, want, ok):
    host_used = Usage(held.sandboxes, held.memory_mb, held.cpus)     # the host itself has room
    call = lambda: admit(BUDGET, host_used, want, None, tenant="acme", tenant_used=held,  # noqa: E731
                         tenant_share=0.5)
    if ok:
        call()
    else:
        with pytest.raises(CapacityError, match="tenant 'acme' holds"):
            call()
    admit(BUDGET, host_used, want, None)      # without a share: only the host's budget counts


# ------------------------------------------------------------------ the daemon

@pytest.fixture(scope="module")
def e2b(lab, tmp_path_factory):
    settings = {"dns": {"listen_host": HUB_IP, "port": 53},
                "runtime": {"enabled": True, "api_port": API_PORT, "memory_mb": 2048, "cpus": 2.0,
                            "max_sandboxes": 4, "host_reserve_mb": 256, "default_memory_mb": 128},
                "e2b": {"enabled": True, "port": E2B_PORT, "tenant": "acme"}}
    keys = {}

    def vault_and_tenant_key(gw):
        gw.cli("vault", "init")
        for name in ("acme", "globex"):
            keys[name] = gw.cli("vault", "token", "create", "--scope", "admin", "--description", name).strip()
        doc = yaml.safe_load(gw.settings_path.read_text())
        doc["e2b"]["token_tenants"] = {keys["globex"].split("_")[1]: "globex"}
        gw.settings_path.write_text(yaml.safe_dump(doc))

    with switch_lab(lab, tmp_path_factory.mktemp("e2b-attack7"), POLICY, sandbox=None, tport=TPORT, prefix="a7",
                    settings_extra=settings, before_start=vault_and_tenant_key) as (gw, sw, _):
        gw.keys = keys
        yield gw


def test_one_tenants_key_cannot_fill_the_host_for_the_others(e2b, lab):
    def scenario():
        out, made = [], []
        with httpx.Client(timeout=120, trust_env=False) as c:
            try:
                for tenant in ("acme", "acme", "acme", "acme", "globex"):
                    r = c.post(f"{BASE}/v2/sandboxes", headers={"X-API-Key": e2b.keys[tenant]},
                               json={"templateID": "base", "timeout": 120})
                    out.append((tenant, r.status_code, r.json().get("message", "") if r.status_code != 201 else ""))
                    if r.status_code == 201:
                        made.append((tenant, r.json()["sandboxID"]))
            finally:
                for tenant, sid in made:
                    c.delete(f"{BASE}/sandboxes/{sid}", headers={"X-API-Key": e2b.keys[tenant]})
        return out
    out = call_in_netns(lab.gw_ns, scenario, timeout=300)
    codes = [(t, code) for t, code, _ in out]
    # before: acme's 3rd and 4th were created (the host's 4), and globex got 429 "host is full"
    assert codes == [("acme", 201), ("acme", 201), ("acme", 429), ("acme", 429), ("globex", 201)], out
    assert "tenant 'acme' holds 2 of its 2 sandboxes" in out[2][2], out
