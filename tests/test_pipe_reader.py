"""`pipe_reader`, the daemon's reader of an engine's output pipe (with `standby =
"snapshot"` every engine's, and a restored copy's always), on both event loops.

uvloop's pipe transport closes the descriptor itself (libuv's `uv_close`) and then
closes the file object it was handed: the same number twice (uvloop#763). A descriptor
that another thread opened between the two closes (a /proc file the take-down reads, an
NVML call's) was closed from under it. On the H200 that was a take-down failing with
`OSError(9, 'Bad file descriptor')` as a copy's core died: the failover refused, the
standby taken down, a cold start of 52 s instead of a wake of 0.5 s.

The probe (the issue's): the file object, when closed, first opens a pipe, which takes
the lowest free number (the one libuv has just freed, if it has), then closes as it
would; the pipe it opened must still be open after.
"""

from __future__ import annotations

import asyncio
import io
import os
from collections.abc import Callable
from typing import ClassVar

import pytest
import uvloop

from supervisor.engine.process import process

LOOPS: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {
    "uvloop": uvloop.new_event_loop, "asyncio": asyncio.new_event_loop}


def is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


class Probe(io.FileIO):
    """A pipe's read end that, as it is closed, opens a pipe of its own first."""

    opened: ClassVar[list[tuple[int, int]]] = []

    def close(self) -> None:
        if not self.closed:
            Probe.opened.append(os.pipe())
        super().close()


async def read_to_the_end() -> tuple[bool, bytes, list[tuple[bool, bool]]]:
    """A pipe written, its write end closed, read to its end: whether its descriptor was
    closed by then (the transport's end, not the loop's nor a collection), what was read,
    and whether each pipe the probe opened meanwhile is still open; all seen while the
    loop runs."""
    Probe.opened = []
    r, w = os.pipe()
    reader = await process.pipe_reader(r)
    os.write(w, b"INFO the engine's last words\n")
    os.close(w)
    said = await reader.read()
    for _ in range(20):
        if not is_open(r) or Probe.opened:
            break
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.01)
    mine = {fd for pair in Probe.opened for fd in pair}
    closed = not is_open(r) or r in mine
    still = [(is_open(a), is_open(b)) for a, b in Probe.opened]
    for fd in mine:
        if is_open(fd):
            os.close(fd)
    return closed, said, still


@pytest.mark.parametrize("loop", LOOPS)
def test_a_pipe_read_to_its_end_closes_its_descriptor_once(loop: str, monkeypatch) -> None:
    def fdopen(fd: int, mode: str = "rb", buffering: int = -1, *, closefd: bool = True
               ) -> Probe:
        assert (mode, buffering) == ("rb", 0)
        return Probe(fd, "rb", closefd=closefd)

    monkeypatch.setattr(process.os, "fdopen", fdopen)
    with asyncio.Runner(loop_factory=LOOPS[loop]) as runner:
        closed, said, still = runner.run(read_to_the_end())
    assert said == b"INFO the engine's last words\n"
    assert closed, "the pipe's descriptor left open after its end of file"
    # whatever the probe opened as the pipe was closed is still its own
    assert still == [(True, True)] * len(still), still


@pytest.mark.parametrize("loop", LOOPS)
def test_no_descriptor_is_left_open_by_the_pipes_read(loop: str) -> None:
    before = set(os.listdir("/proc/self/fd"))
    with asyncio.Runner(loop_factory=LOOPS[loop]) as runner:
        for _ in range(50):
            closed, _, _ = runner.run(read_to_the_end())
            assert closed
    left = set(os.listdir("/proc/self/fd")) - before
    assert not left, sorted(left)
