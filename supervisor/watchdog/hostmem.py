"""Whether the host is short of memory: Linux's pressure stall information (PSI); and
whether the kernel's OOM killer ran (`oom_kill` in /proc/vmstat) as an engine died.

`/proc/pressure/memory` (kernel 4.20+, `CONFIG_PSI`) says what share of recent time the
host's tasks spent stalled waiting for memory (reclaim, swap-in, refaults):

    some avg10=1.52 avg60=0.40 avg300=0.09 total=1234567
    full avg10=0.95 avg60=0.20 avg300=0.05 total=987654

`full` is the time in which every non-idle task stalled at once: no work got done for
want of memory. Its 10-second average is the signal `host_memory_stall_percent`, unknown
where the file is missing or unreadable (an old kernel, PSI off, some containers). An
engine whose counters stand still while the host is starved is not hung: restarting it
frees nothing that its own next start does not need again (`SignalWindow` excuses such a
stall from `engine_stalled_s` for a bounded time, docs/watchdog.md). Read in a worker
thread with each look at the engine's tree; never raises.
"""

from __future__ import annotations

import math

PSI_MEMORY = "/proc/pressure/memory"


def parse_full_avg10(text: str) -> float | None:
    """The `full avg10` percent of a PSI file's text; None when it does not say one."""
    for line in text.splitlines():
        kind, _, rest = line.partition(" ")
        if kind != "full":
            continue
        for field in rest.split():
            key, _, value = field.partition("=")
            if key == "avg10":
                try:
                    pct = float(value)
                except ValueError:
                    return None
                return pct if math.isfinite(pct) and 0.0 <= pct <= 100.0 else None
    return None


# the kernel's count of processes its OOM killer killed since boot (`oom_kill`, 4.13+)
VMSTAT = "/proc/vmstat"


def parse_oom_kills(text: str) -> int | None:
    """`oom_kill` of a /proc/vmstat text; None when it does not say one."""
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if key == "oom_kill":
            try:
                return int(value)
            except ValueError:
                return None
    return None


def oom_kills(path: str = VMSTAT) -> int | None:
    """The host's OOM kills since boot; None where /proc/vmstat does not say. A read of
    procfs (no disk): cheap enough for the moment an engine's death is seen."""
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            return parse_oom_kills(f.read())
    except OSError:
        return None


def oom_killed(before: int | None, after: int | None) -> bool | None:
    """Whether the kernel's OOM killer killed anything between two counts (None: one
    of them unknown). Around an engine's unasked death, most likely that engine: the
    killer takes the largest process, and an engine's core is."""
    return None if before is None or after is None else after > before


def memory_stall_pct(path: str = PSI_MEMORY) -> float | None:
    """The host's memory `full avg10` now (0..100); None where PSI cannot be read."""
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            return parse_full_avg10(f.read(4096))
    except OSError:
        return None
