"""A worker's reloads (cubegate/worker_policy.py): parsed on the policy thread, swapped on the
loop, coalesced, and an invalid file keeps the old set. Real files, a real store."""
from __future__ import annotations

import asyncio
import threading

from cubegate.worker_policy import PolicyFollower
from egress.policy.live import LivePolicies
from egress.policy.reload import PolicyStore
from egress.policy.repo import PolicyRepo


def _policy(host: str, n: int = 0) -> str:
    return "name: p\ndefault: deny\nrules:\n" + "".join(
        f"  - name: r{i}\n    action: allow\n    match: {{hosts: [{h}]}}\n"
        for i, h in enumerate([host] + [f"h{i}.test" for i in range(n)]))


def _hosts(policies: LivePolicies) -> set[str]:
    return {h.name for cp in policies.current.policies for r in cp.policy.rules for h in r.match.hosts}



def test_reloads_parse_off_the_loop_swap_on_it_and_coalesce(tmp_path):
    (tmp_path / "p.yaml").write_text(_policy("a.test"))
    policies = LivePolicies(PolicyStore(tmp_path), PolicyRepo(tmp_path / "policies.db"))
    swaps, results, parses = [], [], []
    policies.on_change(lambda old, new: swaps.append(threading.get_ident()))
    load = policies.files._load

    def counted_load():
        parses.append(threading.get_ident())
        return load()
    policies.files._load = counted_load

    async def main():
        follower = PolicyFollower(policies, 0, results.append)
        (tmp_path / "p.yaml").write_text(_policy("b.test", 300))
        done = [follower.request(files_now=True) for _ in range(50)]   # a storm of SIGHUPs
        ticks = 0
        while not all(d.done() for d in done):
            ticks += 1              # the loop keeps running while the file is parsed
            await asyncio.sleep(0.001)
        follower.close()
        return threading.get_ident(), ticks

    loop_thread, ticks = asyncio.run(main())
    assert ticks > 1
    assert 1 <= len(parses) <= 2 and loop_thread not in parses   # coalesced, on the policy thread
    assert len(results) == len(parses) and all(r.ok for r in results)
    assert swaps and set(swaps) == {loop_thread}                  # the swap and its callbacks: the loop's
    assert "b.test" in _hosts(policies)


def test_an_invalid_file_keeps_the_old_set(tmp_path):
    (tmp_path / "p.yaml").write_text(_policy("a.test"))
    policies = LivePolicies(PolicyStore(tmp_path), PolicyRepo(tmp_path / "policies.db"))
    before, results = policies.digest, []

    async def main():
        follower = PolicyFollower(policies, 0, results.append)
        (tmp_path / "p.yaml").write_text(_policy("b.test") + "  - name: [unclosed\n")
        await follower.request(files_now=True)
        follower.close()

    asyncio.run(main())
    assert [r.ok for r in results] == [False] and policies.digest == before
    assert _hosts(policies) == {"a.test"}
