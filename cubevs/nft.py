"""Run nftables scripts inside a network namespace via libnftables (ctypes).

The netlink socket is opened by nft_ctx_new in the calling thread's netns,
so the whole context lives inside `netns.entered(ns)`.
Falls back to `nsenter --net=... nft -f -` if libnftables.so.1 is missing.
"""
from __future__ import annotations

import ctypes
import json
import shutil
import subprocess

from . import netns

NFT_CTX_OUTPUT_JSON = 1 << 4


class NftError(RuntimeError):
    pass


def _load():
    try:
        lib = ctypes.CDLL("libnftables.so.1")
    except OSError:
        return None
    lib.nft_ctx_new.restype = ctypes.c_void_p
    lib.nft_ctx_new.argtypes = [ctypes.c_uint32]
    lib.nft_ctx_free.argtypes = [ctypes.c_void_p]
    lib.nft_ctx_buffer_output.argtypes = [ctypes.c_void_p]
    lib.nft_ctx_buffer_error.argtypes = [ctypes.c_void_p]
    lib.nft_ctx_get_output_buffer.restype = ctypes.c_char_p
    lib.nft_ctx_get_output_buffer.argtypes = [ctypes.c_void_p]
    lib.nft_ctx_get_error_buffer.restype = ctypes.c_char_p
    lib.nft_ctx_get_error_buffer.argtypes = [ctypes.c_void_p]
    lib.nft_ctx_output_set_flags.argtypes = [ctypes.c_void_p, ctypes.c_uint]
    lib.nft_run_cmd_from_buffer.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    lib.nft_run_cmd_from_buffer.restype = ctypes.c_int
    return lib


_LIB = _load()


def run(ns: str | None, script: str, *, as_json: bool = False):
    """Execute `script` atomically in netns `ns`; return output (parsed if as_json)."""
    if _LIB is not None:
        with netns.entered(ns):
            ctx = _LIB.nft_ctx_new(0)
            try:
                _LIB.nft_ctx_buffer_output(ctx)
                _LIB.nft_ctx_buffer_error(ctx)
                if as_json:
                    _LIB.nft_ctx_output_set_flags(ctx, NFT_CTX_OUTPUT_JSON)
                rc = _LIB.nft_run_cmd_from_buffer(ctx, script.encode())
                out = (_LIB.nft_ctx_get_output_buffer(ctx) or b"").decode()
                err = (_LIB.nft_ctx_get_error_buffer(ctx) or b"").decode()
            finally:
                _LIB.nft_ctx_free(ctx)
        if rc != 0:
            raise NftError(f"nft failed: {err.strip()}\n--- script ---\n{script}")
    else:
        nft = shutil.which("nft") or "/usr/sbin/nft"
        cmd = ([nft] if ns is None else ["nsenter", f"--net={netns.path(ns)}", nft])
        cmd += (["-j"] if as_json else []) + ["-f", "-"]
        p = subprocess.run(cmd, input=script, capture_output=True, text=True)
        if p.returncode != 0:
            raise NftError(f"nft failed: {p.stderr.strip()}\n--- script ---\n{script}")
        out = p.stdout
    return json.loads(out) if as_json and out.strip() else out
