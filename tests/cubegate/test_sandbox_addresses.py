"""RegistryLookup.address_of (where a sandbox's explicit-proxy token is accepted from): answered
from memory, yet every commit to the registry by another connection (the switch, another
process) is seen on the next call — an address given, changed (a slot renamed) or taken away."""
from cubegate.sandbox_lookup import RegistryLookup
from cubevs.registry import Entry, Registry


def _entry(sandbox_id: str, no: int, ip: str) -> Entry:
    return Entry(sandbox_id, no, ip, "02:cb:0a:09:00:02", 5, f"ns{no}", f"veth{no}", ())


def test_another_connections_commits_are_seen_at_once(tmp_path):
    lookup = RegistryLookup(Registry(tmp_path), None)
    switch = Registry(tmp_path)        # the writer: another connection, as the switch's process has
    try:
        assert lookup.address_of("sb-a") is None
        assert lookup.address_of("sb-a") is None                 # remembered: no sandbox
        switch.add(_entry("slot-1", 1, "10.9.0.2"))
        assert switch.rename("slot-1", "sb-a")
        assert lookup.address_of("sb-a") == "10.9.0.2"
        switch.remove("sb-a")
        switch.add(_entry("sb-a", 2, "10.9.0.3"))                # the id again, another address
        assert lookup.address_of("sb-a") == "10.9.0.3"
        switch.remove("sb-a")
        assert lookup.address_of("sb-a") is None
    finally:
        switch.close()
        lookup.close()
