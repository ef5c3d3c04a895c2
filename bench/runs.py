"""What a bench run keeps track of: its global deadline, and every process it has seen, so
that it can say at the end whether any of them outlived it."""

from __future__ import annotations

import time

import psutil


class OutOfTime(Exception):
    """A bench run's global deadline has passed."""


class Clock:
    """A bench run's global deadline: every wait is bounded by what is left of it."""

    def __init__(self, minutes: float) -> None:
        self.deadline = time.monotonic() + minutes * 60

    def left(self, cap: float) -> float:
        rest = self.deadline - time.monotonic()
        if rest <= 0:
            raise OutOfTime("the run's deadline has passed")
        return min(cap, rest)


class TreeLedger:
    """Every process of the trees a run started (the daemon's engines), by pid."""

    def __init__(self) -> None:
        self.procs: dict[int, psutil.Process] = {}

    def remember(self, pid: int | None) -> None:
        """The process and its descendants now (a gone one is skipped)."""
        if not pid:
            return
        try:
            root = psutil.Process(pid)
            for p in [root, *root.children(recursive=True)]:
                self.procs.setdefault(p.pid, p)
        except psutil.Error:
            pass

    def leftovers(self) -> list[psutil.Process]:
        """Those still alive (not zombies)."""
        out = []
        for p in self.procs.values():
            try:
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    out.append(p)
            except psutil.Error:
                pass
        return out
