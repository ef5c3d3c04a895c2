"""The daemon's file descriptors: its limit, how many are open, and telling the daemon's
own shortage (EMFILE, ENFILE) apart from a fault of whatever it was talking to.

Every socket, pipe, pidfd and /proc read takes a descriptor from one table per process.
When the front proxy's clients take them all, a canary that cannot open its socket, a
scrape, a look at /proc or an audit write fails with EMFILE: that says nothing about the
engine, and must never be read as its sickness (no sample, not a failed one), nor stop a
take-down from proving the engine's tree gone (`supervisor/engine/process/proctree.py` falls back
to calls that need no descriptor).

`raise_soft_limit()` runs once at start; `soft_limit()` and `open_count()` size the
proxy's connection cap. Nothing here keeps state but `Shortage`, a job's own episode of
failures, which logs its start and end once each.
"""

from __future__ import annotations

import errno
import os
import resource
from typing import Any

import structlog

log = structlog.get_logger("supervisor")

_ERRNOS = (errno.EMFILE, errno.ENFILE)
_TEXTS = ("Too many open files", "[Errno 24]", "[Errno 23]")
_NR_OPEN = "/proc/sys/fs/nr_open"  # the kernel's ceiling for one process's limit


class OutOfDescriptors(Exception):
    """The daemon itself could not get a descriptor: nothing is known of the peer."""


def soft_limit() -> int:
    """RLIMIT_NOFILE's soft limit now: how many descriptors this process may hold."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return soft if soft != resource.RLIM_INFINITY else _kernel_ceiling()


def open_count() -> int | None:
    """How many descriptors this process holds now; None when that cannot be read (the
    read itself needs one)."""
    try:
        return len(os.listdir("/proc/self/fd")) - 1  # (less the one listdir held)
    except OSError:
        return None


def raise_soft_limit() -> tuple[int, int, int]:
    """Raise the soft RLIMIT_NOFILE to the hard limit (systemd's advice to daemons that
    need many: LimitNOFILE= sets the hard one, the program raises its soft one).
    Returns (soft before, soft now, hard); the soft limit stays as it was if refused."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else _kernel_ceiling()
    if soft == resource.RLIM_INFINITY or soft >= target:
        return soft, soft, hard
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError):
        return soft, soft, hard
    return soft, target, hard


def _kernel_ceiling() -> int:
    try:
        with open(_NR_OPEN) as f:
            return int(f.read())
    except (OSError, ValueError):
        return 1 << 20  # Linux's default nr_open


def exhausted(exc: BaseException | None) -> bool:
    """Whether `exc`, or an error it was raised from, is the daemon out of descriptors
    (an OSError with EMFILE or ENFILE, as is or wrapped by httpx, httpcore or anyio)."""
    seen: set[int] = set()
    todo: list[BaseException] = [exc] if exc is not None else []
    while todo:
        e = todo.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OutOfDescriptors):
            return True
        if isinstance(e, OSError) and e.errno in _ERRNOS:
            return True
        if not isinstance(e, OSError) or e.errno is None:
            # wrappers keep only the text of what they wrap, at times
            text = str(e)
            if any(t in text for t in _TEXTS):
                return True
        todo.extend(x for x in (e.__cause__, e.__context__) if x is not None)
        if isinstance(e, BaseExceptionGroup):
            todo.extend(e.exceptions)
    return False


def raise_if_exhausted(exc: BaseException) -> None:
    """Raise OutOfDescriptors (from `exc`) when `exc` is the daemon's own shortage."""
    if exhausted(exc):
        raise OutOfDescriptors(f"the daemon is out of file descriptors ({_short(exc)})") \
            from exc


def _short(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) <= 200 else text[:197] + "..."


class Shortage:
    """One job's run of failures for want of a descriptor: the first logged (as the
    daemon's own problem, never the engine's), the rest counted, the end logged with
    the count. Owned by the job that feeds it."""

    def __init__(self, what: str, **fields: Any) -> None:
        self.what = what
        self.fields = fields
        self.skipped = 0  # failures in the episode under way
        self.episodes = 0

    def failed(self, exc: BaseException) -> None:
        self.skipped += 1
        if self.skipped == 1:
            self.episodes += 1
            log.warning("the daemon is out of file descriptors: not the engine's fault; "
                        "no sample taken until it has some again", job=self.what,
                        error=_short(exc), soft_limit=soft_limit(), open=open_count(),
                        **self.fields)

    def ok(self) -> None:
        if self.skipped:
            log.info("the daemon has file descriptors again", job=self.what,
                     skipped=self.skipped, **self.fields)
            self.skipped = 0
