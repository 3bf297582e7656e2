"""cubevs/switch_schema.py against the BTF of the built switch object.

BTF is read with bpftool (`bpftool -j btf dump file switch.o`), independent of our
ctypes binding: a struct mirror, a reason code or a map's key/value type that drifts
from switch.c fails here, before any packet is misread."""
from __future__ import annotations

import ctypes
import json
import shutil
import subprocess

import pytest

from cubevs import build, switch_schema
from cubevs.switch_schema import MAPS, REASON_CODES, STRUCTS

if shutil.which("bpftool") is None:
    pytest.skip("bpftool not installed", allow_module_level=True)

_QUALIFIERS = ("TYPEDEF", "CONST", "VOLATILE", "RESTRICT", "TYPE_TAG")
_PERCPU_MAP_TYPES = {5, 6, 10}   # BPF_MAP_TYPE_PERCPU_HASH, PERCPU_ARRAY, LRU_PERCPU_HASH
BPF_MAP_TYPE_RINGBUF = 27


class Btf:
    def __init__(self, types: list[dict]):
        self.by_id = {t["id"]: t for t in types}

    @classmethod
    def of_object(cls, path) -> "Btf":
        out = subprocess.run(["bpftool", "-j", "btf", "dump", "file", str(path)], capture_output=True,
                             text=True, timeout=30, check=True).stdout
        return cls(json.loads(out)["types"])

    def named(self, kind: str, name: str) -> dict:
        found = [t for t in self.by_id.values() if t["kind"] == kind and t.get("name") == name]
        assert len(found) == 1, f"{kind} {name}: {len(found)} in the BTF"
        return found[0]

    def resolve(self, type_id: int) -> dict:
        t = self.by_id[type_id]
        while t["kind"] in _QUALIFIERS:
            t = self.by_id[t["type_id"]]
        return t

    def size(self, type_id: int) -> int:
        t = self.resolve(type_id)
        if t["kind"] == "ARRAY":
            return t["nr_elems"] * self.size(t["type_id"])
        if t["kind"] == "PTR":
            return 8
        return t["size"]

    def struct_layout(self, name: str) -> tuple[int, list[tuple[str, int, int]]]:
        """(size, [(member, byte offset, byte size)]) of struct `name`."""
        t = self.named("STRUCT", name)
        members = []
        for m in t["members"]:
            assert m["bits_offset"] % 8 == 0 and not m.get("bitfield_size"), f"{name}.{m['name']}: bitfield"
            members.append((m["name"], m["bits_offset"] // 8, self.size(m["type_id"])))
        return t["size"], members

    def maps(self) -> dict[str, dict[str, int]]:
        """{map name: {field: type id}} from the .maps section (BTF-defined map definitions)."""
        sec = self.named("DATASEC", ".maps")
        out = {}
        for v in sec["vars"]:
            var = self.by_id[v["type_id"]]
            out[var["name"]] = {m["name"]: m["type_id"] for m in self.resolve(var["type_id"])["members"]}
        return out

    def uint_field(self, type_id: int) -> int:
        """Value of a __uint(name, val) map field: int (*name)[val]."""
        return self.resolve(self.resolve(type_id)["type_id"])["nr_elems"]


def ctypes_layout(cls: type[ctypes.Structure]) -> tuple[int, list[tuple[str, int, int]]]:
    return ctypes.sizeof(cls), [(f, getattr(cls, f).offset, getattr(cls, f).size) for f, *_ in cls._fields_]


@pytest.fixture(scope="module")
def btf() -> Btf:
    return Btf.of_object(build.build())


@pytest.mark.parametrize("c_name", sorted(STRUCTS))
def test_struct_mirror_matches_btf(btf, c_name):
    assert ctypes_layout(STRUCTS[c_name]) == btf.struct_layout(c_name)


def test_layout_check_catches_a_drifted_mirror(btf):
    """The comparison above is not vacuous: swapped or resized members are caught."""
    class Swapped(ctypes.Structure):
        _fields_ = [("reason", ctypes.c_uint32), ("sandbox_no", ctypes.c_uint32)]

    class Narrow(ctypes.Structure):
        _fields_ = [("sandbox_no", ctypes.c_uint32), ("reason", ctypes.c_uint16)]
    assert ctypes_layout(Swapped) != btf.struct_layout("counter_key")
    assert ctypes_layout(Narrow) != btf.struct_layout("counter_key")


def test_reason_codes_match_the_c_enum(btf):
    enum = btf.named("ENUM", switch_schema.REASON_ENUM)
    values = {v["name"]: v["val"] for v in enum["values"]}
    sentinel = values.pop(switch_schema.REASON_C_SENTINEL)
    prefix = switch_schema.REASON_C_PREFIX
    assert all(n.startswith(prefix) for n in values)
    assert {n[len(prefix):].lower(): v for n, v in values.items()} == dict(REASON_CODES)
    assert sentinel == len(REASON_CODES) and sorted(REASON_CODES.values()) == list(range(sentinel))
    assert enum["size"] == switch_schema.CounterKey.reason.size == switch_schema.Event.reason.size


def test_reason_sets_partition_the_codes():
    assert switch_schema.ALLOW_REASONS | switch_schema.DROP_REASONS == set(REASON_CODES)
    assert not switch_schema.ALLOW_REASONS & switch_schema.DROP_REASONS
    assert "unknown_sandbox" in switch_schema.DROP_REASONS   # fail closed
    assert switch_schema.reason_name(REASON_CODES["quic"]) == "quic"
    assert switch_schema.reason_name(999) == "reason_999"


def test_map_names_and_key_value_types_match_btf(btf):
    maps = btf.maps()
    assert set(maps) == set(MAPS)
    by_struct = {cls: name for name, cls in STRUCTS.items()}
    for name, spec in MAPS.items():
        fields = maps[name]
        map_type = btf.uint_field(fields["type"])
        assert (map_type in _PERCPU_MAP_TYPES) == spec.percpu, name
        if spec.key is None:
            assert map_type == BPF_MAP_TYPE_RINGBUF and "key" not in fields and "value" not in fields
            continue
        for role, ctype in (("key", spec.key), ("value", spec.value)):
            pointee = btf.resolve(btf.resolve(fields[role])["type_id"])   # __type(role, T): T *role
            assert btf.size(pointee["id"]) == ctypes.sizeof(ctype), f"{name}.{role}"
            if pointee["kind"] == "STRUCT":
                assert by_struct.get(ctype) == pointee["name"], f"{name}.{role}"
            else:
                assert issubclass(ctype, ctypes._SimpleCData), f"{name}.{role}"


def test_program_is_in_the_object(btf):
    fn = btf.named("FUNC", switch_schema.PROG_NAME)
    assert fn["linkage"] == "global"
