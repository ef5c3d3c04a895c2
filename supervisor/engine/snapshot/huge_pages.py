"""A restored copy's large anonymous memory collapsed into transparent huge pages (2 MiB),
through `process_madvise(pidfd, ..., MADV_COLLAPSE)` (Linux 6.1+), whatever the host's
THP setting.

Why: CRIU's restorer fills a process's memory in 4 KiB pages before it gives a mapping
back its MADV_HUGEPAGE, so with THP `madvise` a copy's core holds its ~18 GiB (the
sleeping engine's weights' backup, which CUDA registers) in 4 KiB pages, and its exit,
where Linux unpins and unmaps them before the GPU memory comes back, takes 2.4 s on the
H200 where a spawned engine's takes 0.66 s. Collapsed before CUDA pins that memory again
(`cuda.bring_back`), the copy's exit is the spawned one's (0.69 s, measured with THP
`always`).

- `parse_ranges` / `ranges`: a process's private, anonymous, writable mappings of 2 MiB
  or more (`/proc/PID/maps`), each cut inward to 2 MiB boundaries.
- `collapse`: those ranges of each process asked to be collapsed, one range (at most
  `CHUNK`) a call, so that one the kernel refuses leaves the others collapsed; what was
  asked, what the kernel said it did, and why it could do nothing when it could not
  (`Collapsed`). The syscall is a seam (`open_process_madvise`): tests can script it.
- `anon_huge_bytes`: how much of a process's anonymous memory is in huge pages
  (`/proc/PID/smaps_rollup`), to see it worked.

A partly filled 2 MiB range is filled with zeroes by the collapse (the kernel's
`max_ptes_none` is not applied to MADV_COLLAPSE), so a copy may hold up to 2 MiB more per
such range (a thread's stack, a malloc arena). Every call blocks (the kernel copies the
pages into new huge ones): the daemon makes them through `asyncio.to_thread`, never on its
loop. Nothing here changes what a process's memory holds, only how it is mapped.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import platform
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

HUGE = 2 << 20  # a transparent huge page on x86_64
# one call's range at most: the kernel advises no more than MAX_RW_COUNT (2 GiB less a
# page) of a call's iovecs, and says so only by the bytes it returns
CHUNK = 1 << 30
MADV_COLLAPSE = 25
SYS_PROCESS_MADVISE = 440  # x86_64
WITHIN_S = 60.0  # no new range is asked after this long (one range takes well under it)
# what the kernel answers for one range it would not collapse, the others going on:
# EINVAL (not anonymous after all, or VM_NOHUGEPAGE), EAGAIN (a page it could not take
# then), ENOMEM (no huge page free, or part of the range no longer mapped)
REFUSED = (errno.EINVAL, errno.EAGAIN, errno.ENOMEM)
# bracketed names of anonymous mappings that are not a process's data
SPECIAL = ("[stack", "[vdso", "[vvar", "[vsyscall", "[uprobes")

# (pidfd, start, length) -> the bytes the kernel advised; OSError with its errno
Advise = Callable[[int, int, int], int]


@dataclass(frozen=True)
class Collapsed:
    """What `collapse` did: bytes asked (ranges' sizes), bytes the kernel said it advised,
    ranges it refused (left as they were), seconds; per pid, why one could not be done
    (`errors`); or why nothing could (`why_not`: no such syscall, no permission)."""

    asked: int = 0
    advised: int = 0
    refused: int = 0
    seconds: float = 0.0
    errors: Mapping[int, str] = field(default_factory=dict)
    why_not: str | None = None


def parse_ranges(maps: str, least: int = HUGE) -> list[tuple[int, int]]:
    """The private, anonymous, writable mappings of `/proc/PID/maps` text, as (start, end)
    cut inward to 2 MiB boundaries, those `least` bytes or longer (after the cut)."""
    out = []
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) < 5:
            continue
        span, perms, inode = fields[0], fields[1], fields[4]
        name = fields[5].strip() if len(fields) > 5 else ""
        if len(perms) < 4 or perms[1] != "w" or perms[3] != "p" or inode != "0":
            continue
        if name and (not name.startswith("[") or name.startswith(SPECIAL)):
            continue  # (a file's, shared memory's, a stack's or the kernel's)
        lo, _, hi = span.partition("-")
        start = -(-int(lo, 16) // HUGE) * HUGE
        end = int(hi, 16) // HUGE * HUGE
        if end - start >= max(least, HUGE):
            out.append((start, end))
    return out


def ranges(pid: int, least: int = HUGE) -> list[tuple[int, int]]:
    """`parse_ranges` of process `pid`'s maps; OSError when they cannot be read."""
    return parse_ranges(Path(f"/proc/{pid}/maps").read_text(), least)


def anon_huge_bytes(pid: int) -> int | None:
    """Bytes of the process's anonymous memory in huge pages (smaps_rollup's
    AnonHugePages); None when it cannot be read."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1]) * 1024
    return None


class _Iovec(ctypes.Structure):
    _fields_ = (("base", ctypes.c_void_p), ("len", ctypes.c_size_t))


def open_process_madvise() -> tuple[Advise | None, str | None]:
    """The real `process_madvise(pidfd, [range], MADV_COLLAPSE, 0)`, or None and why not."""
    if platform.system() != "Linux" or platform.machine() != "x86_64":
        return None, (f"huge pages are collapsed only on Linux x86_64 "
                      f"(this is {platform.system()} {platform.machine()})")
    libc = ctypes.CDLL(None, use_errno=True)
    syscall = libc.syscall
    syscall.restype = ctypes.c_long

    def advise(pidfd: int, start: int, length: int) -> int:
        iov = _Iovec(start, length)
        rc = int(syscall(ctypes.c_long(SYS_PROCESS_MADVISE), ctypes.c_int(pidfd),
                         ctypes.byref(iov), ctypes.c_size_t(1), ctypes.c_int(MADV_COLLAPSE),
                         ctypes.c_uint(0)))
        if rc < 0:
            e = ctypes.get_errno()
            raise OSError(e, os.strerror(e))
        return rc

    return advise, None


def _why_not(e: OSError) -> str | None:
    """Why no process's memory can be collapsed, from what one call said; None when it
    concerns that process alone."""
    if e.errno == errno.ENOSYS:
        return "the kernel has no process_madvise (Linux 5.10; MADV_COLLAPSE needs 6.1)"
    if e.errno == errno.EPERM:
        return "the daemon may not advise another process's memory (CAP_SYS_NICE)"
    return None


def collapse(pids: Iterable[int],
             opened: Callable[[], tuple[Advise | None, str | None]] = open_process_madvise,
             within_s: float = WITHIN_S) -> Collapsed:
    """Each process's `ranges` asked to be collapsed into huge pages (module docstring).
    Never raises for what the kernel or /proc says: it is in the answer."""
    t0 = time.monotonic()
    advise, why = opened()
    if advise is None:
        return Collapsed(why_not=why)
    asked = advised = refused = 0
    errors: dict[int, str] = {}
    for pid in pids:
        try:
            pidfd = os.pidfd_open(pid)
        except OSError as e:
            errors[pid] = f"pidfd_open: {e.strerror or e}"
            continue
        try:
            for start, end in ranges(pid):
                for at in range(start, end, CHUNK):
                    if time.monotonic() - t0 > within_s:
                        raise TimeoutError(f"not done within {within_s:g} s")
                    length = min(CHUNK, end - at)
                    asked += length
                    try:
                        advised += advise(pidfd, at, length)
                    except OSError as e:
                        if e.errno not in REFUSED:
                            raise
                        refused += 1
        except TimeoutError as e:
            errors[pid] = str(e)
            break
        except OSError as e:
            if (why := _why_not(e)) is not None:
                return Collapsed(asked, advised, refused, round(time.monotonic() - t0, 3),
                                 errors, why)
            errors[pid] = e.strerror or str(e)  # (gone, most likely: ESRCH, or no maps)
        finally:
            os.close(pidfd)
    return Collapsed(asked, advised, refused, round(time.monotonic() - t0, 3), errors)
