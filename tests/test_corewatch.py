"""The core's death, by pidfd (supervisor/engine/corewatch.py), on a real child process:
reported once when it ends; a pidfd the daemon could not open for want of descriptors is
tried again at the next look, never taken as pidfds being unsupported here."""

from __future__ import annotations

import asyncio
import errno
import os
import subprocess
import sys

import psutil
import pytest

from supervisor.engine.corewatch import CORE_TITLE, CoreWatch
from supervisor.engine.proctree import ProcInfo


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
        for _ in range(500):
            if ended:
                break
            await asyncio.sleep(0.01)
        watch.close()
        return ended

    try:
        assert asyncio.run(main()) == [child.pid]
    finally:
        child.kill()
        child.wait()
