"""Generic ctypes binding to Debian's libbpf.so.1 (1.1.x) and bpf(2): no cubevs knowledge.

Objects (open, load, pin a program), pinned objects on a bpffs, typed maps,
TC/tcx attachment, ring buffers and BPF_PROG_TEST_RUN.  Every call works in
the calling thread's network namespace; entering one is the caller's job.

libbpf 1.1 predates the tcx helpers, so tcx attach goes through
bpf_prog_attach() with the raw attach type (kernel >= 6.6).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

BPF_SK_SKB_STREAM_VERDICT = 5   # enum bpf_attach_type
BPF_TCX_INGRESS = 46          # enum bpf_attach_type (uapi 6.6); Debian 12 headers predate it
BPF_TC_INGRESS, BPF_TC_EGRESS = 1, 2   # enum bpf_tc_attach_point
BPF_TC_F_REPLACE = 1
BPF_FS_MAGIC = 0xCAFE4A11
BPF_ANY, BPF_NOEXIST = 0, 1
TC_ACT_OK, TC_ACT_SHOT = 0, 2  # <linux/pkt_cls.h>
EEXIST, ENOENT = 17, 2


class BpfError(OSError):
    pass


# ---------------------------------------------------------------- libbpf structs
class _OpenOpts(ctypes.Structure):  # struct bpf_object_open_opts, prefix up to pin_root_path
    _fields_ = [("sz", ctypes.c_size_t), ("object_name", ctypes.c_char_p),
                ("relaxed_maps", ctypes.c_bool), ("pin_root_path", ctypes.c_char_p)]


class _TcHook(ctypes.Structure):
    _fields_ = [("sz", ctypes.c_size_t), ("ifindex", ctypes.c_int),
                ("attach_point", ctypes.c_int), ("parent", ctypes.c_uint32)]


class _TcOpts(ctypes.Structure):
    _fields_ = [("sz", ctypes.c_size_t), ("prog_fd", ctypes.c_int), ("flags", ctypes.c_uint32),
                ("prog_id", ctypes.c_uint32), ("handle", ctypes.c_uint32),
                ("priority", ctypes.c_uint32)]


class _ProgInfo(ctypes.Structure):  # struct bpf_prog_info prefix: type, id
    _fields_ = [("type", ctypes.c_uint32), ("id", ctypes.c_uint32), ("rest", ctypes.c_uint8 * 240)]


class _TestRunOpts(ctypes.Structure):  # struct bpf_test_run_opts (libbpf 1.1, bpf.h)
    _fields_ = [("sz", ctypes.c_size_t), ("data_in", ctypes.c_void_p), ("data_out", ctypes.c_void_p),
                ("data_size_in", ctypes.c_uint32), ("data_size_out", ctypes.c_uint32),
                ("ctx_in", ctypes.c_void_p), ("ctx_out", ctypes.c_void_p),
                ("ctx_size_in", ctypes.c_uint32), ("ctx_size_out", ctypes.c_uint32),
                ("retval", ctypes.c_uint32), ("repeat", ctypes.c_int), ("duration", ctypes.c_uint32),
                ("flags", ctypes.c_uint32), ("cpu", ctypes.c_uint32), ("batch_size", ctypes.c_uint32)]


class SkBuffCtx(ctypes.Structure):
    """Prefix of uapi struct __sk_buff up to ifindex: the ctx of a tc test run.  Of these
    fields the kernel accepts only mark, priority, ingress_ifindex and ifindex as non-zero
    (EINVAL otherwise); an ifindex > 1 must name a device in the caller's netns (ENODEV)."""
    _fields_ = [("len", ctypes.c_uint32), ("pkt_type", ctypes.c_uint32), ("mark", ctypes.c_uint32),
                ("queue_mapping", ctypes.c_uint32), ("protocol", ctypes.c_uint32),
                ("vlan_present", ctypes.c_uint32), ("vlan_tci", ctypes.c_uint32),
                ("vlan_proto", ctypes.c_uint32), ("priority", ctypes.c_uint32),
                ("ingress_ifindex", ctypes.c_uint32), ("ifindex", ctypes.c_uint32)]


_RB_CB = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)


def _load_lib() -> ctypes.CDLL:
    lib = ctypes.CDLL("libbpf.so.1", use_errno=True)
    vp, ci, cu, cs = ctypes.c_void_p, ctypes.c_int, ctypes.c_uint, ctypes.c_char_p
    sig = {
        "bpf_object__open_file": (vp, [cs, vp]),
        "bpf_object__load": (ci, [vp]),
        "bpf_object__close": (None, [vp]),
        "bpf_object__find_program_by_name": (vp, [vp, cs]),
        "bpf_object__find_map_fd_by_name": (ci, [vp, cs]),
        "bpf_program__fd": (ci, [vp]),
        "bpf_program__pin": (ci, [vp, cs]),
        "bpf_obj_get": (ci, [cs]),
        "bpf_obj_pin": (ci, [ci, cs]),
        "bpf_obj_get_info_by_fd": (ci, [ci, vp, ctypes.POINTER(ctypes.c_uint32)]),
        "bpf_map_update_elem": (ci, [ci, vp, vp, ctypes.c_uint64]),
        "bpf_map_lookup_elem": (ci, [ci, vp, vp]),
        "bpf_map_delete_elem": (ci, [ci, vp]),
        "bpf_map_get_next_key": (ci, [ci, vp, vp]),
        "bpf_prog_attach": (ci, [ci, ci, ci, cu]),
        "bpf_prog_detach2": (ci, [ci, ci, ci]),
        "bpf_prog_query": (ci, [ci, ci, ctypes.c_uint32, ctypes.POINTER(ctypes.c_uint32),
                                ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint32)]),
        "bpf_prog_test_run_opts": (ci, [ci, vp]),
        "bpf_tc_hook_create": (ci, [vp]),
        "bpf_tc_hook_destroy": (ci, [vp]),
        "bpf_tc_attach": (ci, [vp, vp]),
        "bpf_tc_detach": (ci, [vp, vp]),
        "bpf_tc_query": (ci, [vp, vp]),
        "libbpf_num_possible_cpus": (ci, []),
        "libbpf_get_error": (ctypes.c_long, [vp]),
        "ring_buffer__new": (vp, [ci, _RB_CB, vp, vp]),
        "ring_buffer__consume": (ci, [vp]),
        "ring_buffer__free": (None, [vp]),
    }
    for name, (res, args) in sig.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = res, args
    return lib


_LIB: ctypes.CDLL | None = None


def lib() -> ctypes.CDLL:
    global _LIB
    if _LIB is None:
        _LIB = _load_lib()
    return _LIB


def _err(rc: int, what: str) -> BpfError:
    e = -rc if rc < 0 else ctypes.get_errno()
    return BpfError(e, f"{what}: {os.strerror(e)}")


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)


# ---------------------------------------------------------------- bpffs
def is_bpffs(path: str | os.PathLike) -> bool:
    """True if `path` is on a bpffs (statfs f_type; os.statvfs does not expose it)."""
    buf = ctypes.create_string_buffer(128)   # struct statfs; f_type is the first long
    if _libc().statfs(os.fsencode(path), buf) != 0:
        return False
    return struct.unpack_from("=q", buf, 0)[0] & 0xFFFFFFFF == BPF_FS_MAGIC


def ensure_bpffs(path: str | os.PathLike) -> None:
    """Mount a bpffs at `path` unless one is already there (or path is inside one)."""
    p = Path(path)
    if is_bpffs(p):
        return
    p.mkdir(parents=True, exist_ok=True)
    if _libc().mount(b"bpf", os.fsencode(p), b"bpf", 0, None) != 0:
        e = ctypes.get_errno()
        raise BpfError(e, f"mount bpffs at {p}: {os.strerror(e)}")


def umount_bpffs(path: str | os.PathLike) -> None:
    _libc().umount2(os.fsencode(path), 2)   # MNT_DETACH


# ---------------------------------------------------------------- objects and pins
def load_and_pin_program(obj_path: str | os.PathLike, pin_root: str | os.PathLike,
                         prog_name: str, prog_pin: str | os.PathLike) -> None:
    """Open and load an object (maps created in, or reused from, pin_root when declared
    LIBBPF_PIN_BY_NAME) and pin program `prog_name` at prog_pin.  The pins keep program
    and maps alive after the object is closed."""
    L = lib()
    opts = _OpenOpts(sz=ctypes.sizeof(_OpenOpts), pin_root_path=os.fsencode(pin_root))
    obj = L.bpf_object__open_file(os.fsencode(obj_path), ctypes.byref(opts))
    if not obj or L.libbpf_get_error(obj):
        raise BpfError(ctypes.get_errno() or 22, f"bpf_object__open_file({obj_path}) failed")
    try:
        rc = L.bpf_object__load(obj)
        if rc != 0:
            raise _err(rc, "bpf_object__load (verifier log on stderr)")
        prog = L.bpf_object__find_program_by_name(obj, prog_name.encode())
        if not prog:
            raise BpfError(ENOENT, f"program {prog_name} not in {obj_path}")
        rc = L.bpf_program__pin(prog, os.fsencode(prog_pin))
        if rc != 0:
            raise _err(rc, "bpf_program__pin")
    finally:
        L.bpf_object__close(obj)


class LoadedObject:
    """An object loaded and kept open (no pins): its programs and maps live while it does.
    For per-process datapaths (one per worker) that nothing else needs to find."""

    def __init__(self, obj_path: str | os.PathLike):
        L = lib()
        obj = L.bpf_object__open_file(os.fsencode(obj_path), None)
        if not obj or L.libbpf_get_error(obj):
            raise BpfError(ctypes.get_errno() or 22, f"bpf_object__open_file({obj_path}) failed")
        rc = L.bpf_object__load(obj)
        if rc != 0:
            L.bpf_object__close(obj)
            raise _err(rc, "bpf_object__load (verifier log on stderr)")
        self._obj = obj

    def prog_fd(self, name: str) -> int:
        prog = lib().bpf_object__find_program_by_name(self._obj, name.encode())
        if not prog:
            raise BpfError(ENOENT, f"program {name} not in object")
        return lib().bpf_program__fd(prog)

    def map_fd(self, name: str) -> int:
        fd = lib().bpf_object__find_map_fd_by_name(self._obj, name.encode())
        if fd < 0:
            raise _err(fd, f"map {name}")
        return fd

    def close(self) -> None:
        if self._obj is not None:
            lib().bpf_object__close(self._obj)
            self._obj = None


def prog_attach(prog_fd: int, target_fd: int, attach_type: int) -> None:
    """Attach a program to a target fd (a sockmap/sockhash for sk_skb/sk_msg programs)."""
    rc = lib().bpf_prog_attach(prog_fd, target_fd, attach_type, 0)
    if rc != 0:
        raise _err(rc, f"bpf_prog_attach(type {attach_type})")


def obj_get(path: str | os.PathLike) -> int:
    """fd of a pinned program or map."""
    fd = lib().bpf_obj_get(os.fsencode(path))
    if fd < 0:
        raise _err(fd, f"bpf_obj_get({path})")
    return fd


def prog_id(fd: int) -> int:
    info = _ProgInfo()
    ln = ctypes.c_uint32(ctypes.sizeof(info))
    rc = lib().bpf_obj_get_info_by_fd(fd, ctypes.byref(info), ctypes.byref(ln))
    if rc != 0:
        raise _err(rc, "bpf_obj_get_info_by_fd")
    return info.id


# ---------------------------------------------------------------- maps
class Map:
    """A BPF map accessed by fd, with ctypes key and value types."""

    def __init__(self, fd: int, key_type, value_type, percpu: bool = False):
        self.fd, self.key_type, self.value_type, self.percpu = fd, key_type, value_type, percpu
        self.ncpu = lib().libbpf_num_possible_cpus() if percpu else 1

    def _vbuf(self):
        return (self.value_type * self.ncpu)() if self.percpu else self.value_type()

    def update(self, key, value, flags: int = BPF_ANY) -> None:
        rc = lib().bpf_map_update_elem(self.fd, ctypes.byref(key), ctypes.byref(value), flags)
        if rc != 0:
            raise _err(rc, "bpf_map_update_elem")

    def lookup(self, key):
        """The value (an array of ncpu values for a per-CPU map), or None."""
        v = self._vbuf()
        rc = lib().bpf_map_lookup_elem(self.fd, ctypes.byref(key), ctypes.byref(v))
        if rc != 0:
            if -rc == ENOENT or ctypes.get_errno() == ENOENT:
                return None
            raise _err(rc, "bpf_map_lookup_elem")
        return v

    def delete(self, key) -> bool:
        return lib().bpf_map_delete_elem(self.fd, ctypes.byref(key)) == 0

    def keys(self) -> Iterator:
        prev = None
        while True:
            nk = self.key_type()
            rc = lib().bpf_map_get_next_key(self.fd, ctypes.byref(prev) if prev is not None else None,
                                            ctypes.byref(nk))
            if rc != 0:
                return
            yield nk
            prev = nk

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


# ---------------------------------------------------------------- TC / tcx attachment
def tcx_attach(prog_fd: int, ifindex: int) -> None:
    """tcx ingress (kernel >= 6.6); idempotent."""
    rc = lib().bpf_prog_attach(prog_fd, ifindex, BPF_TCX_INGRESS, 0)
    if rc != 0 and -rc != EEXIST:
        raise _err(rc, f"tcx attach to ifindex {ifindex}")


def tcx_detach(prog_fd: int, ifindex: int) -> bool:
    return lib().bpf_prog_detach2(prog_fd, ifindex, BPF_TCX_INGRESS) == 0


def tcx_prog_ids(ifindex: int, max_progs: int = 16) -> list[int]:
    """Program ids on tcx ingress of ifindex (tc-clsact filters are not listed)."""
    ids = (ctypes.c_uint32 * max_progs)()
    cnt = ctypes.c_uint32(max_progs)
    flags = ctypes.c_uint32(0)
    rc = lib().bpf_prog_query(ifindex, BPF_TCX_INGRESS, 0, ctypes.byref(flags), ids, ctypes.byref(cnt))
    return list(ids[: cnt.value]) if rc == 0 else []


def tc_attach(prog_fd: int, ifindex: int, *, handle: int = 1, priority: int = 1) -> None:
    """clsact qdisc + direct-action ingress filter; idempotent (replaces the filter)."""
    L = lib()
    hook = _TcHook(sz=ctypes.sizeof(_TcHook), ifindex=ifindex, attach_point=BPF_TC_INGRESS)
    rc = L.bpf_tc_hook_create(ctypes.byref(hook))
    if rc != 0 and -rc != EEXIST:   # clsact already there is fine
        raise _err(rc, f"clsact on ifindex {ifindex}")
    opts = _TcOpts(sz=ctypes.sizeof(_TcOpts), prog_fd=prog_fd, handle=handle, priority=priority,
                   flags=BPF_TC_F_REPLACE)
    rc = L.bpf_tc_attach(ctypes.byref(hook), ctypes.byref(opts))
    if rc != 0:
        raise _err(rc, f"bpf_tc_attach ifindex {ifindex}")


def tc_prog_id(ifindex: int, *, handle: int = 1, priority: int = 1) -> int | None:
    """Id of the program in the ingress filter (handle, priority), or None."""
    hook = _TcHook(sz=ctypes.sizeof(_TcHook), ifindex=ifindex, attach_point=BPF_TC_INGRESS)
    opts = _TcOpts(sz=ctypes.sizeof(_TcOpts), handle=handle, priority=priority)
    rc = lib().bpf_tc_query(ctypes.byref(hook), ctypes.byref(opts))
    return opts.prog_id if rc == 0 else None


def tc_destroy_clsact(ifindex: int) -> None:
    """Remove the clsact qdisc (and with it every tc filter) of ifindex."""
    hook = _TcHook(sz=ctypes.sizeof(_TcHook), ifindex=ifindex,
                   attach_point=BPF_TC_INGRESS | BPF_TC_EGRESS)
    lib().bpf_tc_hook_destroy(ctypes.byref(hook))


# ---------------------------------------------------------------- ring buffer
class RingBuffer:
    """Consumer of a BPF_MAP_TYPE_RINGBUF map: records as bytes, bounded per drain."""

    def __init__(self, map_fd: int):
        self._sink: list[bytes] = []
        self._max = 0

        def _cb(_ctx, data, size):
            self._sink.append(ctypes.string_at(data, size))
            return -1 if len(self._sink) >= self._max else 0   # <0 stops after this record

        self._cb = _RB_CB(_cb)   # keep a reference: libbpf holds only the C pointer
        rb = lib().ring_buffer__new(map_fd, self._cb, None, None)
        if not rb or lib().libbpf_get_error(rb):
            raise BpfError(ctypes.get_errno() or 22, "ring_buffer__new failed")
        self._rb = rb

    def drain(self, max_records: int) -> list[bytes]:
        if max_records <= 0 or self._rb is None:
            return []
        self._sink, self._max = [], max_records
        lib().ring_buffer__consume(self._rb)
        out, self._sink = self._sink, []
        return out

    def close(self) -> None:
        if self._rb is not None:
            lib().ring_buffer__free(self._rb)
            self._rb = None


# ---------------------------------------------------------------- BPF_PROG_TEST_RUN
@dataclass(frozen=True)
class ProgRun:
    retval: int
    data_out: bytes
    duration_ns: int


def prog_test_run(prog_fd: int, data: bytes, *, ctx: ctypes.Structure | None = None,
                  data_out_size: int | None = None, repeat: int = 1) -> ProgRun:
    """Run a program once (or `repeat` times) on `data` in the kernel (BPF_PROG_TEST_RUN).

    data_out_size None = room for the input again plus 256 bytes (a program may grow the
    packet); 0 = do not copy the packet back.  A data_out too small fails with ENOSPC.
    For tc (sched_cls) programs the kernel wants data >= 14 bytes (an Ethernet header)
    and at most a page minus head/tailroom; `ctx` is an SkBuffCtx (or None)."""
    size_out = len(data) + 256 if data_out_size is None else data_out_size
    din = ctypes.create_string_buffer(data, len(data))
    dout = ctypes.create_string_buffer(size_out) if size_out else None
    opts = _TestRunOpts(sz=ctypes.sizeof(_TestRunOpts), data_in=ctypes.cast(din, ctypes.c_void_p),
                        data_size_in=len(data), repeat=repeat)
    if dout is not None:
        opts.data_out, opts.data_size_out = ctypes.cast(dout, ctypes.c_void_p), size_out
    if ctx is not None:
        opts.ctx_in, opts.ctx_size_in = ctypes.cast(ctypes.byref(ctx), ctypes.c_void_p), ctypes.sizeof(ctx)
    rc = lib().bpf_prog_test_run_opts(prog_fd, ctypes.byref(opts))
    if rc != 0:
        raise _err(rc, "bpf_prog_test_run_opts")
    out = dout.raw[: opts.data_size_out] if dout is not None else b""
    return ProgRun(opts.retval, out, opts.duration)
