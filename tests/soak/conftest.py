"""One loaded gateway per session, shared by the load test and the secret sweep (CI time budget)."""
from __future__ import annotations

import pytest

from tests.soak import soakkit

N_SANDBOXES = 50
WARMUP_SECONDS = 8.0     # long enough for the allocators' high-water mark to settle (RSS then flat)
LOAD_SECONDS = 20.0
MAX_REQUESTS = 20_000       # count bound (the time bound ends it first on this machine)
CONCURRENCY = 16            # sessions in flight at once, across the 50 sandboxes


@pytest.fixture(scope="session")
def soak_run(lab, tmp_path_factory):
    """Warm-up, then the measured run. Returns figures, client logs and the (still running) gateway."""
    secret = soakkit.new_secret()
    base = tmp_path_factory.mktemp("soak")
    spool = tmp_path_factory.mktemp("soak-spool")   # holds the secret (client checks): never swept
    gw = soakkit.make_gateway(lab, base / "gw", N_SANDBOXES, secret)
    try:
        start = soakkit.proc_stats(gw.proc.pid)
        warm = soakkit.run_load(lab, soakkit.spec_for(
            gw, lab, duration=WARMUP_SECONDS, max_requests=MAX_REQUESTS, concurrency=CONCURRENCY,
            run_tag="warm", ip_base=1 << 16, secrets=[secret], seed=7), spool)
        soakkit.settle(gw)
        warmed = soakkit.proc_stats(gw.proc.pid)
        load = soakkit.run_load(lab, soakkit.spec_for(
            gw, lab, duration=LOAD_SECONDS, max_requests=MAX_REQUESTS, concurrency=CONCURRENCY,
            run_tag="load", ip_base=2 << 16, secrets=[secret], seed=11), spool)
        records = soakkit.settle(gw)
        end = soakkit.proc_stats(gw.proc.pid)
        yield {"gw": gw, "secret": secret, "warm": warm, "load": load, "records": records,
               "stats": {"start": start, "warmed": warmed, "end": end}}
    finally:
        gw.stop()
