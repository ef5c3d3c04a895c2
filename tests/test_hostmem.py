"""The host's memory pressure (supervisor/watchdog/hostmem.py): Linux's PSI file as a
kernel writes it, one that says nothing usable, and this host's own file read for real."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from supervisor.watchdog import hostmem

# /proc/pressure/memory of a host thrashing (a 6.x kernel's format)
STARVED = ("some avg10=61.03 avg60=40.12 avg300=12.50 total=98765432\n"
           "full avg10=42.50 avg60=30.01 avg300=9.75 total=87654321\n")


def test_the_full_ten_second_average_is_the_share_of_time_nothing_ran_for_memory() -> None:
    assert hostmem.parse_full_avg10(STARVED) == 42.5
    # an old kernel's file has no `full` line (4.20-5.x write it for memory: still so)
    assert hostmem.parse_full_avg10(STARVED.splitlines()[0]) is None


@pytest.mark.parametrize("text", [
    "", "garbage", "full avg10=lots avg60=1 total=2",
    "full avg10=nan avg60=0 total=0", "full avg10=250.0 avg60=0 total=0",
    "full avg60=1.00 total=2",
])
def test_a_file_that_says_nothing_usable_is_unknown_never_an_error(text: str) -> None:
    assert hostmem.parse_full_avg10(text) is None


def test_a_host_without_psi_is_unknown(tmp_path: Path) -> None:
    assert hostmem.memory_stall_pct(str(tmp_path / "missing")) is None
    (tmp_path / "memory").write_text(STARVED)
    assert hostmem.memory_stall_pct(str(tmp_path / "memory")) == 42.5


@pytest.mark.skipif(not os.path.exists(hostmem.PSI_MEMORY), reason="no PSI on this kernel")
def test_this_hosts_own_pressure_reads_as_a_percent() -> None:
    pct = hostmem.memory_stall_pct()
    assert pct is not None and 0.0 <= pct <= 100.0


# ---- the kernel's OOM killer ------------------------------------------------------------

VMSTAT = "nr_free_pages 123\nnr_zone_inactive_anon 5\noom_kill 7\nnuma_hit 99\n"


def test_the_oom_kills_since_boot_are_read_from_vmstat(tmp_path: Path) -> None:
    assert hostmem.parse_oom_kills(VMSTAT) == 7
    assert hostmem.parse_oom_kills("nr_free_pages 1\n") is None  # (a kernel before 4.13)
    assert hostmem.parse_oom_kills("oom_kill many\n") is None
    f = tmp_path / "vmstat"
    f.write_text(VMSTAT)
    assert hostmem.oom_kills(str(f)) == 7
    assert hostmem.oom_kills(str(tmp_path / "none")) is None


def test_this_hosts_own_oom_kills_read_as_a_count() -> None:
    if not os.path.exists(hostmem.VMSTAT):
        pytest.skip("no /proc/vmstat on this host")
    n = hostmem.oom_kills()
    assert n is not None and n >= 0


@pytest.mark.parametrize(("before", "after", "killed"), [
    (3, 4, True), (3, 3, False), (None, 4, None), (3, None, None)])
def test_an_oom_kill_between_two_counts(before: int | None, after: int | None,
                                        killed: bool | None) -> None:
    assert hostmem.oom_killed(before, after) is killed
