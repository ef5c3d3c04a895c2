"""The one deadline a client connection's reading is under (`Wait`), kept lazily, as
nginx keeps its timers: the deadline is a field, and its timer one that is due no later
than it. A timer that fires finds where the deadline is then: moved on (it is set again
for the rest), gone (nothing), or due (the connection is told which wait ran out). A
request on a kept-alive connection moves the deadline three times (head, answer, idle)
and sets no timer. Owns only the clock; what a wait running out means is the
connection's (`supervisor/front/connection.py`).
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Callable


class Wait(enum.Enum):
    """The one deadline a connection's reading is under, if any."""

    IDLE = "idle"  # kept alive, waiting for a request: closed without a word
    HEADER = "header"  # a head under way (or the first one awaited): 408
    BODY = "body"  # a body under way: 408


class Deadline:
    """One connection's deadline: `arm` (a wait, due in so long), `disarm`, `cancel`
    (the connection is gone); `expired` is called with the wait once it is due."""

    __slots__ = ("_at", "_expired", "_loop", "_timer", "_timer_at", "wait")

    def __init__(self, loop: asyncio.AbstractEventLoop,
                 expired: Callable[[Wait], None]) -> None:
        self._loop = loop
        self._expired = expired
        self.wait: Wait | None = None
        self._at = 0.0  # (the loop's clock) when the wait runs out
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0

    def arm(self, wait: Wait, after_s: float) -> None:
        self.wait = wait
        self._at = at = self._loop.time() + after_s
        if self._timer is not None:
            if self._timer_at <= at:
                return  # (it fires first, and looks again then)
            self._timer.cancel()
        self._set(at)

    def disarm(self) -> None:
        self.wait = None  # (its timer, if set, finds nothing to do)

    def cancel(self) -> None:
        self.wait = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _set(self, at: float) -> None:
        self._timer_at = at
        self._timer = self._loop.call_at(at, self._fired)

    def _fired(self) -> None:
        self._timer = None
        wait = self.wait
        if wait is None:
            return
        if self._at > self._loop.time():  # moved on since this timer was set
            self._set(self._at)
            return
        self.wait = None
        self._expired(wait)
