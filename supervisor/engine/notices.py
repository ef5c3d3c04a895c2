"""What an engine's unit tells systemd (through `supervisor/ops/sdnotify.py`'s Notifier).

READY once: when the engine first serves, or when the daemon is up but its engine cannot
be (FATAL, a start refused by a busy GPU), so that `systemctl start` returns either way.
The status line with every state change, STOPPING, the watchdog keep-alive from the
unit's own loop (a stuck loop stops it, and systemd restarts the daemon), and the start
timeout pushed ahead while the first engine starts (a large model takes minutes).
"""

from __future__ import annotations

from supervisor.ops.sdnotify import Notifier

EXTEND_EVERY_S = 10.0  # while the first engine starts, push systemd's start timeout ...
EXTEND_BY_S = 30.0  # ... this far ahead each time


class SystemdNotices:
    def __init__(self, notifier: Notifier) -> None:
        self.notifier = notifier
        self.ready_sent = False
        self._last_watchdog = 0.0
        self._last_extend = -EXTEND_EVERY_S

    def tick_interval(self, interval_s: float) -> float:
        """The unit's tick: often enough for the watchdog keep-alive too."""
        wd = self.notifier.watchdog_interval_s
        return interval_s if wd is None else min(interval_s, wd)

    def ready_once(self, status: str) -> None:
        if not self.ready_sent:
            self.ready_sent = True
            self.notifier.ready(status[:200])

    def status(self, status: str) -> None:
        self.notifier.status(status[:200])

    def stopping(self, status: str) -> None:
        self.notifier.stopping(status)

    def tick(self, now: float, starting: bool) -> None:
        wd = self.notifier.watchdog_interval_s
        if wd is not None and now - self._last_watchdog >= wd:
            self._last_watchdog = now
            self.notifier.watchdog()
        if not self.ready_sent and starting and now - self._last_extend >= EXTEND_EVERY_S:
            self._last_extend = now
            self.notifier.extend_timeout(EXTEND_BY_S)
