"""The core's death, by pidfd (supervisor/engine/process/corewatch.py), on a real child process:
reported once when it ends; a pidfd the daemon could not open for want of descriptors is
tried again at the next look, never taken as pidfds being unsupported here."""

from __future__ import annotations

import asyncio
import errno
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from supervisor.engine.process.corewatch import (
    CORE_TITLE,
    DYING_POLL_S,
    CoreWatch,
    exiting,
    exiting_at,
    open_stat,
)
from supervisor.engine.process.proctree import ProcInfo
from tests.harness import until


def test_a_pidfd_refused_for_want_of_descriptors_is_tried_again(
        monkeypatch: pytest.MonkeyPatch) -> None:
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                             stdin=subprocess.PIPE)
    info = ProcInfo(child.pid, psutil.Process(child.pid).create_time(), CORE_TITLE + "e")
    real = os.pidfd_open

    def out_of_descriptors(pid: int, flags: int = 0) -> int:
        raise OSError(errno.EMFILE, "Too many open files")

    async def main() -> list[int]:
        ended: list[int] = []
        watch = CoreWatch(ended.append)
        monkeypatch.setattr(os, "pidfd_open", out_of_descriptors)
        watch.add([info])
        assert watch.unsupported is None and ended == []
        monkeypatch.setattr(os, "pidfd_open", real)
        watch.add([info])  # the next look at the tree
        assert child.stdin is not None
        child.stdin.close()  # the "core" ends
        await until(lambda: ended, 5, "the core's end reported")
        watch.close()
        return ended

    try:
        assert asyncio.run(main()) == [child.pid]
    finally:
        child.kill()
        child.wait()


def test_a_core_the_kernel_is_shutting_down_has_ended_before_its_exit() -> None:
    """A killed core stops generating at the signal but may take seconds to end (the
    kernel frees its memory first: 3-4.6 s for an 8B engine that slept, on the H100).
    Here a real process whose leader thread has exited while another thread holds the
    process alive: the kernel marks the leader exiting, the pidfd does not fire (the
    process lives on), and the watch reports the core ended while it still exists."""
    script = ("import ctypes, sys, threading, time\n"
              "threading.Thread(target=time.sleep, args=(600,), daemon=True).start()\n"
              "sys.stdin.read()\n"
              "ctypes.CDLL(None).pthread_exit(None)\n")
    child = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE)
    info = ProcInfo(child.pid, psutil.Process(child.pid).create_time(), CORE_TITLE + "e")

    async def main() -> tuple[list[int], bool]:
        ended: list[int] = []
        watch = CoreWatch(ended.append)
        watch.add([info])
        await asyncio.sleep(3 * DYING_POLL_S)
        assert ended == [] and exiting(child.pid) is False  # (alive and well)
        assert child.stdin is not None
        child.stdin.close()  # its leader thread exits; the process lives on
        await until(lambda: ended, 10, "the exiting core reported ended")
        alive = psutil.pid_exists(child.pid) and child.poll() is None
        watch.close()
        return ended, alive

    try:
        ended, alive = asyncio.run(main())
        assert ended == [child.pid]
        assert alive  # reported while the process was still there
        assert exiting(child.pid) is True
    finally:
        child.kill()
        child.wait()


def test_a_live_process_is_not_exiting_and_one_gone_is() -> None:
    assert exiting(os.getpid()) is False
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert exiting(child.pid) is True  # (reaped: no /proc entry)


def test_a_stat_file_kept_open_reads_its_own_process_only() -> None:
    """The flags are read through the stat file opened when the core was first seen: it
    says live, then exiting (a zombie), then gone once reaped (its reads fail then: the
    kernel ties the open file to that process, not to its pid)."""
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                             stdin=subprocess.PIPE)
    stat = open_stat(child.pid)
    assert stat is not None
    try:
        assert exiting_at(stat) is False
        assert child.stdin is not None
        child.stdin.close()
        deadline = time.monotonic() + 10
        while not exiting_at(stat) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert exiting_at(stat) is True  # (exited, not yet reaped: a zombie)
        child.wait()
        assert exiting_at(stat) is True  # reaped: its file reads nothing any more
    finally:
        os.close(stat)
        child.kill()
        child.wait()


def test_a_watch_closes_the_descriptors_it_opened_for_each_core() -> None:
    """A pidfd and a stat file per core, closed when the core ends and at `close`."""
    children = [subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                                 stdin=subprocess.PIPE) for _ in range(2)]
    infos = [ProcInfo(c.pid, psutil.Process(c.pid).create_time(), CORE_TITLE + "e")
             for c in children]

    def fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    async def main() -> tuple[int, int, int, list[int]]:
        ended: list[int] = []
        watch = CoreWatch(ended.append)
        before = fds()
        watch.add(infos)
        watching = fds() - before
        os.kill(children[0].pid, signal.SIGKILL)  # (a zombie until the end: not reaped)
        await until(lambda: ended, 10, "the first core reported ended")
        one_left = fds() - before
        watch.close()
        return watching, one_left, fds() - before, ended

    try:
        watching, one_left, after, ended = asyncio.run(main())
        assert ended == [children[0].pid]
        assert (watching, one_left, after) == (4, 2, 0)
    finally:
        for c in children:
            c.kill()
            c.wait()
