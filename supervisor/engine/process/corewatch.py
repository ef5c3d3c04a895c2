"""The death of an engine's core, the moment it happens.

vLLM's API server (the engine's main pid, which the daemon spawned and reaps) outlives
its `VLLM::EngineCore` by 1 s to 8 s when the core dies (measured on the H100 with vLLM
0.26: 8 s under 128 streams), answering 503 meanwhile: a failover that waits for the API
server's exit makes every client wait those seconds. `CoreWatch` holds a pidfd (Linux
5.3 and later) on each core process seen in the engine's tree and calls back once one
ends, from the event loop, without polling. Where pidfds are refused the API server's
exit remains the signal (nothing is lost but the head start).

A core that was killed may take seconds to end: the kernel tears its memory down
first, and an engine that ever slept holds its weights' pinned host buffers (16 GB for
an 8B model; on the H100 its core's exit came 3.0-4.6 s after the SIGKILL, against
0.3-0.6 s for one that never slept), while it has stopped generating at the signal.
The kernel marks it exiting (PF_EXITING, in /proc/PID/stat's flags) the moment it takes
the signal, so each watched core's flags are also read every `DYING_POLL_S`: a core
marked exiting has ended for the daemon, as if its pidfd had fired. The stat file is
opened once per core and read again in place (one `pread` per look: ~50 reads a second
per core cost next to nothing), and it stays the core's own: once that process is gone
its reads fail, even if another has taken its pid.

A pid is watched only if it is still the process that was seen (its start time
matches): a core that died between the look at the tree and the pidfd is reported at
once, never confused with a later process of the same pid.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
from collections.abc import Callable

import psutil

from supervisor.engine.process.proctree import ProcInfo

CORE_TITLE = "VLLM::EngineCor"  # vLLM's title (`VLLM::EngineCore`, `_DP0`...), as comm cuts it
# how often the watched cores' flags are read: a kill's failover begins up to this late
# (each client's gap with it; 0.1 s cost 50 ms on average on the H200)
DYING_POLL_S = 0.02
PF_EXITING = 0x4  # the kernel's task flag: "getting shut down" (set first in do_exit)


def is_core(info: ProcInfo) -> bool:
    return info.name.startswith(CORE_TITLE)


def exiting(pid: int) -> bool | None:
    """Whether the process (its thread-group leader) is shutting down or gone; None when
    that cannot be read now (the daemon short of descriptors)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return True
    except OSError:
        return None
    return _stat_exiting(stat)


def exiting_at(stat_fd: int) -> bool | None:
    """`exiting` through the process's stat file opened already (`open_stat`)."""
    try:
        stat = os.pread(stat_fd, 4096, 0)
    except ProcessLookupError:  # (ESRCH: the process it was opened for is gone)
        return True
    except OSError:
        return None
    return _stat_exiting(stat) if stat else True


def open_stat(pid: int) -> int | None:
    """A descriptor on `pid`'s /proc stat file, or None (gone, or none to spare)."""
    try:
        return os.open(f"/proc/{pid}/stat", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None


def _stat_exiting(stat: bytes) -> bool | None:
    # pid (comm) state ppid pgrp session tty_nr tpgid flags ...: comm may hold anything
    fields = stat[stat.rfind(b")") + 1:].split()
    try:
        return fields[0] in (b"Z", b"X", b"x") or bool(int(fields[6]) & PF_EXITING)
    except (IndexError, ValueError):
        return None


class CoreWatch:
    """Pidfds on the engine's core processes; `on_exit(pid)` once for each that ends."""

    def __init__(self, on_exit: Callable[[int], None]) -> None:
        self._on_exit = on_exit
        self._fds: dict[int, int] = {}  # pid -> pidfd, while watched
        self._stats: dict[int, int] = {}  # pid -> its /proc stat file, while watched
        self._seen: set[int] = set()  # every pid ever added (each reported at most once)
        self.unsupported: str | None = None  # why pidfds are refused here, once known
        self._poll: asyncio.TimerHandle | None = None

    def add(self, procs: list[ProcInfo]) -> None:
        """Watch the cores among `procs` not watched yet."""
        for info in procs:
            if is_core(info) and info.pid not in self._seen and self.unsupported is None:
                self._seen.add(info.pid)
                self._watch(info)

    def _watch(self, info: ProcInfo) -> None:
        try:
            fd = os.pidfd_open(info.pid)
        except ProcessLookupError:
            self._on_exit(info.pid)
            return
        except OSError as exc:
            if exc.errno in (errno.EMFILE, errno.ENFILE):  # the daemon's own shortage:
                self._seen.discard(info.pid)  # the next look at the tree tries again
                return
            self.unsupported = f"pidfd_open: {exc}"  # (an old kernel, a sandbox)
            return
        except AttributeError as exc:
            self.unsupported = f"pidfd_open: {exc}"
            return
        # (opened with the pidfd, before the check below: both are then the process seen)
        stat = open_stat(info.pid)
        try:
            same = psutil.Process(info.pid).create_time() == info.create_time
        except psutil.NoSuchProcess:
            same = False
        except (psutil.Error, OSError):  # (no descriptor to read it with: try again later)
            _close(fd, stat)
            self._seen.discard(info.pid)
            return
        if not same:  # it died after the look at the tree (its pid may be another's now)
            _close(fd, stat)
            self._on_exit(info.pid)
            return
        self._fds[info.pid] = fd
        if stat is not None:  # (else read by pid at each look)
            self._stats[info.pid] = stat
        loop = asyncio.get_running_loop()
        loop.add_reader(fd, self._fired, info.pid)
        if self._poll is None:
            self._poll = loop.call_later(DYING_POLL_S, self._read_flags)

    def _read_flags(self) -> None:
        """A watched core that the kernel is shutting down has ended (see above)."""
        self._poll = None
        for pid in [pid for pid in self._fds if self._exiting(pid)]:
            self._fired(pid)
        if self._fds:
            self._poll = asyncio.get_running_loop().call_later(DYING_POLL_S,
                                                               self._read_flags)

    def _exiting(self, pid: int) -> bool | None:
        stat = self._stats.get(pid)
        return exiting(pid) if stat is None else exiting_at(stat)

    def _fired(self, pid: int) -> None:
        self._forget(pid)
        self._on_exit(pid)

    def _forget(self, pid: int) -> None:
        _close(self._stats.pop(pid, None))
        fd = self._fds.pop(pid, None)
        if fd is not None:
            with contextlib.suppress(ValueError, OSError):
                asyncio.get_running_loop().remove_reader(fd)
            os.close(fd)

    def close(self) -> None:
        if self._poll is not None:
            self._poll.cancel()
            self._poll = None
        for pid in list(self._fds):
            self._forget(pid)


def _close(*fds: int | None) -> None:
    for fd in fds:
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)
