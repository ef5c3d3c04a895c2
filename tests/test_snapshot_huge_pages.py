"""A restored copy's memory collapsed into huge pages (supervisor/engine/snapshot/
huge_pages.py), with the real kernel and the real CRIU on the fake engine: its core holds
HOLD_MIB of anonymous memory in huge pages (MADV_HUGEPAGE, as vLLM's sleeping weights'
backup is held), CRIU's restore brings it back mostly in 4 KiB pages, and the collapse
(`process_madvise(MADV_COLLAPSE)`) makes it huge pages again, whatever the host's THP
setting (`madvise` on the machines this was measured on). `copies.spawn_copy` does it to
every copy, saying so in one line. What /proc/PID/maps says is read as the kernel writes
it, and what the kernel refuses is counted, the rest going on."""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import mmap
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from supervisor.engine.process import process as eng
from supervisor.engine.snapshot import copies, criu, huge_pages
from tests.test_snapshot_criu import GUARD_S, carried, free_port
from tests.test_snapshot_spawn import config, dumped

HOLD_MIB = 64
MIB = 1 << 20
THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")

MAPS = """\
55d0c0000000-55d0c0400000 r-xp 00000000 fd:01 1234     /usr/bin/python3.11
55d0c0600000-55d0c1600000 rw-p 00000000 00:00 0        [heap]
7f0000000000-7f0004000000 rw-p 00000000 00:00 0
7f0004100000-7f0004300000 rw-p 00000000 00:00 0
7f0004300000-7f00043ff000 rw-p 00000000 00:00 0
7f0004400000-7f0004800000 r--p 00000000 00:00 0
7f0004800000-7f0004c00000 rw-s 00000000 00:01 77       /dev/shm/psm_1
7f0004c00000-7f0005000000 rw-s 00000000 00:01 78       /dev/zero (deleted)
7f0005000000-7f0005400000 rw-p 00000000 fd:01 99       /usr/lib/libbig.so
7f0005400000-7f0005800000 rw-p 00000000 00:00 0        [anon:glibc.malloc]
7ffc00000000-7ffc00400000 rw-p 00000000 00:00 0        [stack]
7ffc00600000-7ffc00602000 r--p 00000000 00:00 0        [vvar]
7ffc00602000-7ffc00604000 r-xp 00000000 00:00 0        [vdso]
"""


def test_private_anonymous_writable_mappings_are_read_from_maps_cut_to_2_mib() -> None:
    assert huge_pages.parse_ranges(MAPS) == [
        (0x55d0c0600000, 0x55d0c1600000),  # the heap, 16 MiB
        (0x7f0000000000, 0x7f0004000000),  # 64 MiB, aligned
        # 0x7f0004100000-...4300000: 2 MiB long, but no whole huge page inside it
        # 0x7f0004300000-...43ff000: less than 2 MiB
        (0x7f0005400000, 0x7f0005800000),  # a named anonymous one (glibc's)
    ]
    # (read-only, shared, file-backed, the stack and the kernel's pages are left)
    assert huge_pages.parse_ranges(MAPS, least=32 * MIB) == [(0x7f0000000000, 0x7f0004000000)]
    assert huge_pages.parse_ranges("garbage\n\n") == []


class Scripted:
    """A kernel that refuses the ranges starting at `refuse` (EAGAIN), or every call
    (`all_with`); the calls it was asked, as (start, length)."""

    def __init__(self, refuse: frozenset[int] = frozenset(), all_with: int | None = None) -> None:
        self.refuse, self.all_with = refuse, all_with
        self.calls: list[tuple[int, int]] = []

    def opened(self) -> tuple[huge_pages.Advise, None]:
        return self.advise, None

    def advise(self, pidfd: int, start: int, length: int) -> int:
        self.calls.append((start, length))
        if self.all_with is not None:
            raise OSError(self.all_with, os.strerror(self.all_with))
        if start in self.refuse:
            raise OSError(errno.EAGAIN, "busy")
        return length


@pytest.fixture
def mapped() -> Iterator[tuple[int, int]]:
    """2.5 GiB of our own anonymous address space (never touched: nothing allocated), its
    inward 2 MiB range."""
    held = mmap.mmap(-1, (5 << 29) + 2 * MIB, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        import ctypes

        at = ctypes.addressof(ctypes.c_char.from_buffer(held))
        start = -(-at // huge_pages.HUGE) * huge_pages.HUGE
        yield start, (at + len(held)) // huge_pages.HUGE * huge_pages.HUGE
    finally:
        held.close()


def test_a_range_the_kernel_refuses_is_counted_and_the_others_go_on(
        mapped: tuple[int, int]) -> None:
    start, end = mapped
    mine = [r for r in huge_pages.ranges(os.getpid()) if r[0] <= start and end <= r[1]]
    assert len(mine) == 1, huge_pages.ranges(os.getpid())
    lo, hi = mine[0]
    kernel = Scripted(refuse=frozenset({lo + huge_pages.CHUNK}))
    done = huge_pages.collapse([os.getpid()], kernel.opened)
    ours = [c for c in kernel.calls if lo <= c[0] < hi]
    # at most CHUNK a call (the kernel advises no more than 2 GiB of one, and says so only
    # by what it returns), the chunk after the refused one asked all the same
    assert [c[0] for c in ours] == list(range(lo, hi, huge_pages.CHUNK))
    assert all(length <= huge_pages.CHUNK for _, length in kernel.calls)
    assert done.refused == 1 and done.errors == {} and done.why_not is None
    assert done.asked == sum(length for _, length in kernel.calls)
    assert done.advised == done.asked - huge_pages.CHUNK


def test_no_permission_or_no_syscall_says_why_not_and_a_process_gone_says_so() -> None:
    denied = huge_pages.collapse([os.getpid()], Scripted(all_with=errno.EPERM).opened)
    assert denied.why_not is not None and "CAP_SYS_NICE" in denied.why_not
    absent = huge_pages.collapse([os.getpid()], Scripted(all_with=errno.ENOSYS).opened)
    assert absent.why_not is not None and "process_madvise" in absent.why_not
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait(GUARD_S)
    done = huge_pages.collapse([gone.pid, os.getpid()], Scripted().opened)
    assert list(done.errors) == [gone.pid] and done.advised > 0  # (the next one done)
    elsewhere = huge_pages.collapse([os.getpid()], lambda: (None, "not Linux x86_64"))
    assert elsewhere == huge_pages.Collapsed(why_not="not Linux x86_64")


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The fake engine, its core holding HOLD_MIB in huge pages, dumped (its stdout and
    stderr two pipes of ours, as the daemon's)."""
    def held_huge(pid: int) -> None:
        held = huge_pages.anon_huge_bytes(core_of(pid))
        # (THP `never` would leave even the fake's own memory in 4 KiB pages)
        assert held is not None and held >= HOLD_MIB * MIB * 3 // 4, (
            f"the fake engine's core holds {held} bytes in huge pages before the dump "
            f"(THP: {THP.read_text().strip()})")

    return dumped(tmp_path_factory.mktemp("huge"), free_port(), carried(),
                  ("--hold-mib", str(HOLD_MIB)), held_huge)


def core_of(root: int) -> int:
    """The fake engine's core: its API server's one child."""
    children = Path(f"/proc/{root}/task/{root}/children").read_text().split()
    assert len(children) == 1, children
    return int(children[0])


def test_a_restored_copys_memory_comes_back_in_small_pages_and_is_collapsed_to_huge(
        images: Path) -> None:
    async def main() -> tuple[int | None, int | None, huge_pages.Collapsed]:
        copy = await criu.restore(carried(), images, "a", GUARD_S)
        try:
            assert len(copy.pids) == 2  # (the API server, its core)
            core = copy.pids[1]
            before = huge_pages.anon_huge_bytes(core)
            done = await asyncio.to_thread(huge_pages.collapse, copy.pids)
            return before, huge_pages.anon_huge_bytes(core), done
        finally:
            await copy.end(GUARD_S)

    before, after, done = asyncio.run(main())
    print(f"\ncore's AnonHugePages: {before} bytes restored, {after} collapsed; {done}")
    assert before is not None and after is not None
    assert done.why_not is None and done.errors == {}, done
    assert done.asked >= HOLD_MIB * MIB * 3 // 4 and done.advised > 0
    assert after >= HOLD_MIB * MIB * 3 // 4, f"{after} bytes in huge pages after: {done}"
    assert before <= after // 2, (
        f"this kernel's CRIU restore left {before} bytes of the core's memory in huge pages "
        f"already (THP: {THP.read_text().strip()}): nothing was left to collapse, so this "
        f"test proves only that the collapse does no harm")


def test_spawn_copy_collapses_the_copys_memory_before_handing_it_over(
        images: Path, tmp_path: Path) -> None:
    cfg = config(tmp_path, free_port())
    (tmp_path / "run").mkdir()
    spec = dataclasses.replace(eng.build_spawn_spec(cfg.engine, os.environ),
                               restore=eng.Restore(str(images), carried().argv[0]))

    async def main() -> int | None:
        engine = await copies.spawn_copy(spec, 4, 0.0, cfg.engine, str(tmp_path / "run"))
        try:
            return huge_pages.anon_huge_bytes(core_of(engine.pid))
        finally:
            os.killpg(engine.proc.pid, signal.SIGKILL)
            await asyncio.wait_for(engine.proc.wait(), GUARD_S)
            await copies.forget(engine)

    with capture_logs() as logs:
        huge = asyncio.run(main())
    said = [e for e in logs if e["event"] == "copy's memory collapsed into huge pages"]
    assert len(said) == 1, logs
    line = said[0]
    print(f"\n{line}")
    assert line["log_level"] == "info" and line["errors"] is None
    assert line["asked_mib"] >= HOLD_MIB * 3 // 4
    assert line["anon_huge_mib"] >= HOLD_MIB * 3 // 4 and line["seconds"] >= 0
    assert huge is not None and huge >= HOLD_MIB * MIB * 3 // 4
    # (said before the copy was said restored: before its GPU state would come back)
    events = [e["event"] for e in logs]
    assert events.index(line["event"]) < events.index("engine restored from its snapshot")
