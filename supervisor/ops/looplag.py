"""How late the daemon's event loop runs, and whose fault a stall is.

Every timer of the daemon (a canary's deadline, a scrape's timeout, the exporter's wait
for a view) is only as punctual as its event loop. A watch sleeps a short period and
measures how much later than asked it woke: that lateness is the loop's lag. A stall of
`warn_s` or more is logged once per streak, and once a minute at most ("event loop
stalled"; the line after a quiet minute counts those not logged), with the daemon's own
CPU time over it: most of the stall spent in the daemon's threads means the daemon was
busy (a defect to report); little means the host gave it no CPU (a machine short of
cores, an engine's API server at 100 %) or it waited in a blocking call, and then every
timeout the daemon saw meanwhile says as much about the daemon's host as about the
engine.

`status` has `loop` (the largest lag over the last minute, and the stalls since the
start); the exporter has `vllm_supervisor_event_loop_lag_seconds` (the same largest
lag) and `vllm_supervisor_event_loop_stalls_total`.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import structlog

log = structlog.get_logger("supervisor")

PERIOD_S = 0.25  # the watch's own sleep
WARN_S = 1.0  # a lag at least this long is a stall: logged, counted
WINDOW_S = 60.0  # the largest lag reported is over this long


class LoopLag:
    def __init__(self, period_s: float = PERIOD_S, warn_s: float = WARN_S,
                 window_s: float = WINDOW_S,
                 clock: Callable[[], float] = time.monotonic,
                 cpu: Callable[[], float] = time.process_time) -> None:
        self.period_s, self.warn_s, self.window_s = period_s, warn_s, window_s
        self._clock, self._cpu = clock, cpu
        self._lags: deque[tuple[float, float]] = deque()  # (when, lag) of late wakes
        self.stalls = 0
        self._stalled = False  # in a streak of stalls
        self._logged: float | None = None  # when a streak was last logged
        self._unlogged = 0  # streaks since then not logged (one line a window at most)

    def note(self, now: float, lag_s: float, cpu_s: float) -> None:
        """One wake `lag_s` late, the daemon's threads having used `cpu_s` of CPU
        over the sleep and the lag."""
        self._expire(now)
        # (a deque of the window's maxima: a later, larger lag makes the earlier
        # smaller ones irrelevant)
        while self._lags and self._lags[-1][1] <= lag_s:
            self._lags.pop()
        self._lags.append((now, lag_s))
        if lag_s < self.warn_s:
            if self._stalled and self._logged is not None and self._unlogged == 0:
                log.info("event loop on time again")
            self._stalled = False
            return
        self.stalls += 1
        if self._stalled:
            return
        self._stalled = True
        if self._logged is not None and now - self._logged < self.window_s:
            self._unlogged += 1  # (a host short of CPU stalls every few seconds)
            return
        busy = cpu_s >= 0.5 * (lag_s + self.period_s)
        log.warning("event loop stalled", lag_s=round(lag_s, 3), own_cpu_s=round(cpu_s, 3),
                    why="the daemon was busy" if busy
                    else "the daemon got little CPU (a host short of cores) or waited in "
                         "a blocking call",
                    **({"stalls_not_logged": self._unlogged} if self._unlogged else {}))
        self._logged, self._unlogged = now, 0

    def max_s(self, now: float | None = None) -> float:
        """The largest lag over the last `window_s` (0 before any)."""
        self._expire(self._clock() if now is None else now)
        return self._lags[0][1] if self._lags else 0.0

    def _expire(self, now: float) -> None:
        while self._lags and self._lags[0][0] < now - self.window_s:
            self._lags.popleft()

    def status(self) -> dict[str, Any]:
        return {"lag_s": round(self.max_s(), 3), "stalls": self.stalls}

    async def run(self) -> None:
        """Forever (cancelled with the daemon)."""
        while True:
            t0, c0 = self._clock(), self._cpu()
            await asyncio.sleep(self.period_s)
            now = self._clock()
            self.note(now, max(0.0, now - t0 - self.period_s), self._cpu() - c0)
