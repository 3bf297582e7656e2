"""The sandbox's seccomp filter, assembled here as classic BPF (no libseccomp).

bwrap loads it (`--seccomp FD`, raw `struct sock_filter` array) just before it
execs the agent, so every process in the sandbox inherits it. Denied calls get
EPERM (not a kill: tools then fail with a clear error). x86_64 only; any other
syscall ABI (i386, x32) is refused wholesale so the table cannot be bypassed.
Pure: `build_filter()` returns bytes; no I/O.
"""
from __future__ import annotations

import errno
import platform
import struct

AUDIT_ARCH_X86_64 = 0xC000003E
X32_SYSCALL_BIT = 0x40000000

# BPF opcodes (linux/bpf_common.h)
_LD_W_ABS = 0x20
_JEQ_K = 0x15
_JGE_K = 0x35
_JSET_K = 0x45
_RET_K = 0x06

SECCOMP_RET_ALLOW = 0x7FFF0000
SECCOMP_RET_ERRNO = 0x00050000

# seccomp_data offsets
_OFF_NR, _OFF_ARCH, _OFF_ARG0_LO = 0, 4, 16

# x86_64 syscall numbers that the sandbox never needs; most are also covered by the
# dropped capabilities — the filter is the second wall (and closes user-ns tricks).
DENIED_X86_64: dict[str, int] = {
    "ptrace": 101, "process_vm_readv": 310, "process_vm_writev": 311, "pidfd_getfd": 438,
    "mount": 165, "umount2": 166, "pivot_root": 155, "chroot": 161,
    "open_tree": 428, "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433,
    "mount_setattr": 442,
    "unshare": 272, "setns": 308,
    "keyctl": 250, "add_key": 248, "request_key": 249,
    "bpf": 321, "perf_event_open": 298,
    "kexec_load": 246, "kexec_file_load": 320,
    "init_module": 175, "finit_module": 313, "delete_module": 176,
    "open_by_handle_at": 304, "name_to_handle_at": 303,
    "userfaultfd": 323, "reboot": 169, "swapon": 167, "swapoff": 168,
    "acct": 163, "syslog": 103, "quotactl": 179, "iopl": 172, "ioperm": 173,
    "settimeofday": 164, "clock_settime": 227, "clock_adjtime": 305, "adjtimex": 159,
    "uselib": 134, "lookup_dcookie": 212,
    "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427,
}
SYS_CLONE, SYS_CLONE3 = 56, 435
SYS_SOCKET = 41
# Socket families that no network namespace confines (so neither the sandbox's netns nor the
# switch sees them): AF_VSOCK reaches the hypervisor's services (CID 2) when the host is a VM,
# and local vsock listeners of every namespace.
DENIED_SOCKET_FAMILIES = {"AF_VSOCK": 40}
# clone() flags that create namespaces (same effect as unshare): NEWNS, NEWCGROUP, NEWUTS,
# NEWIPC, NEWUSER, NEWPID, NEWNET. (NEWTIME only exists for unshare/clone3; 0x80 would
# collide with the exit-signal byte of clone.)
CLONE_NS_FLAGS = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000


def _stmt(code: int, k: int) -> tuple[int, int, int, int]:
    return (code, 0, 0, k)


def _jump(code: int, k: int, jt: int, jf: int) -> tuple[int, int, int, int]:
    if not (0 <= jt < 256 and 0 <= jf < 256):
        raise ValueError("BPF jump out of range")
    return (code, jt, jf, k)


def supported() -> tuple[bool, str]:
    if platform.machine() != "x86_64":
        return False, f"seccomp filter only built for x86_64, not {platform.machine()}"
    return True, ""


def build_filter(denied: dict[str, int] | None = None, err: int = errno.EPERM) -> bytes:
    """The filter program as bytes for bwrap --seccomp."""
    nrs = sorted(set((denied or DENIED_X86_64).values()))
    deny = SECCOMP_RET_ERRNO | (err & 0xFFFF)
    enosys = SECCOMP_RET_ERRNO | errno.ENOSYS
    prog: list[tuple[int, int, int, int]] = []
    # Layout: [arch check][nr load][x32 check][deny table][clone3][clone -> arg check]
    #         [socket -> family check][ALLOW][DENY]
    n_table = len(nrs)
    families = sorted(set(DENIED_SOCKET_FAMILIES.values()))
    n_fam = len(families)
    prog.append(_stmt(_LD_W_ABS, _OFF_ARCH))
    body: list = []
    body.append(_stmt(_LD_W_ABS, _OFF_NR))
    # after this jump: table(n) + clone3(2) + clone(3) + socket(2 + families) + allow(1) -> deny
    sock = 2 + n_fam
    tail = n_table + 2 + 3 + sock + 1
    body.append(_jump(_JGE_K, X32_SYSCALL_BIT, tail, 0))          # x32 ABI -> DENY
    for i, nr in enumerate(nrs):
        body.append(_jump(_JEQ_K, nr, tail - 1 - i, 0))            # -> DENY
    body.append(_jump(_JEQ_K, SYS_CLONE3, 0, 1))
    body.append(_stmt(_RET_K, enosys))                               # glibc falls back to clone()
    body.append(_jump(_JEQ_K, SYS_CLONE, 0, 2))
    body.append(_stmt(_LD_W_ABS, _OFF_ARG0_LO))
    body.append(_jump(_JSET_K, CLONE_NS_FLAGS, sock + 1, sock))     # namespace flags -> DENY, else ALLOW
    body.append(_jump(_JEQ_K, SYS_SOCKET, 0, 1 + n_fam))            # not socket() -> ALLOW
    body.append(_stmt(_LD_W_ABS, _OFF_ARG0_LO))
    for i, fam in enumerate(families):
        body.append(_jump(_JEQ_K, fam, n_fam - i, 0))                # family -> DENY
    body.append(_stmt(_RET_K, SECCOMP_RET_ALLOW))
    body.append(_stmt(_RET_K, deny))
    # arch mismatch -> DENY (last instruction)
    prog.append(_jump(_JEQ_K, AUDIT_ARCH_X86_64, 0, len(body) - 1))
    prog.extend(body)
    return b"".join(struct.pack("<HBBI", *ins) for ins in prog)
