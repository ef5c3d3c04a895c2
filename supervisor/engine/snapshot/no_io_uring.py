"""Run a command under a seccomp filter that answers io_uring_setup with ENOSYS (issue 49,
route 3: CRIU cannot dump an io_uring; the libraries that open one fall back without it:
vLLM's API server opened one, and started and served as usual without).

    python3 supervisor/engine/snapshot/no_io_uring.py COMMAND [ARGS...]

Standalone (nothing of the package imported): a Python without the daemon's site runs it
by its path, as the GPU probes do.
"""

from __future__ import annotations

import ctypes
import os
import struct
import sys

IO_URING_SETUP = 425  # x86-64
AUDIT_ARCH_X86_64 = 0xC000003E
ENOSYS = 38
LD_W_ABS, JEQ_K, RET_K = 0x20, 0x15, 0x06
RET_ERRNO, RET_ALLOW = 0x00050000, 0x7FFF0000
PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 38, 22, 2


def install() -> None:
    prog = [(LD_W_ABS, 0, 0, 4),                      # seccomp_data.arch
            (JEQ_K, 1, 0, AUDIT_ARCH_X86_64),         # not x86-64: allow
            (RET_K, 0, 0, RET_ALLOW),
            (LD_W_ABS, 0, 0, 0),                      # seccomp_data.nr
            (JEQ_K, 0, 1, IO_URING_SETUP),
            (RET_K, 0, 0, RET_ERRNO | ENOSYS),
            (RET_K, 0, 0, RET_ALLOW)]
    raw = b"".join(struct.pack("HBBI", *ins) for ins in prog)
    filters = ctypes.create_string_buffer(raw)
    fprog = struct.pack("HxxxxxxQ", len(prog), ctypes.addressof(filters))
    buf = ctypes.create_string_buffer(fprog)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 or \
            libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, buf, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "seccomp filter refused")


if __name__ == "__main__":
    install()
    os.execvp(sys.argv[1], sys.argv[1:])
