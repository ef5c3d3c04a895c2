"""Restart bookkeeping: backoff delays and the boot-failure limit. Pure: no I/O, no clock.

Two kinds of failure are kept apart, as EngineUnit's STARTING -> BACKOFF -> FATAL does:
a *boot failure* is an engine that never became healthy (bad flags, no memory, port
taken); a *crash* is an engine that served and then died. Both back off exponentially;
only boot failures, N of them within a window, make the state FATAL, since retrying a
configuration that cannot start only burns time. An engine that served for
`stable_uptime_s` resets the backoff to its first step.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from supervisor.settings.sections import RestartConfig


@dataclass(frozen=True)
class Verdict:
    delay_s: float  # wait this long before the next start (ignored when fatal)
    fatal: bool
    reason: str


class RestartTracker:
    def __init__(self, cfg: RestartConfig) -> None:
        self.cfg = cfg
        self.consecutive = 0  # failures since the last stable run, drives the delay
        self.boot_failures: deque[float] = deque()  # times of recent boot failures

    def backoff_delay(self, attempt: int) -> float:
        """Delay before retry number `attempt` (1-based): initial * multiplier^(n-1), capped."""
        c = self.cfg
        delay = c.backoff_initial_s * c.backoff_multiplier ** (attempt - 1)
        return float(min(c.backoff_max_s, delay))

    def record_failure(self, now: float, *, healthy_for_s: float | None, what: str) -> Verdict:
        """Count one failure at `now`. healthy_for_s is how long the engine served (None
        if it never became healthy: a boot failure)."""
        if healthy_for_s is not None and healthy_for_s >= self.cfg.stable_uptime_s:
            self.consecutive = 0
        self.consecutive += 1
        if healthy_for_s is None:
            self.boot_failures.append(now)
        while self.boot_failures and now - self.boot_failures[0] > self.cfg.boot_failure_window_s:
            self.boot_failures.popleft()
        if len(self.boot_failures) >= self.cfg.boot_failures_max:
            n = len(self.boot_failures)
            return Verdict(0.0, True, f"{n} boot failures within "
                                      f"{self.cfg.boot_failure_window_s:g} s; last: {what}")
        return Verdict(self.backoff_delay(self.consecutive), False, what)

    def reset(self) -> None:
        """An operator's restart: start afresh (used to leave FATAL)."""
        self.consecutive = 0
        self.boot_failures.clear()
