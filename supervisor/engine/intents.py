"""What the watchdog half of a unit asks its unit to do, and the record of a relaunch.

`EngineWatch` (`supervisor/engine/watch.py`) never changes the unit's lifecycle: it
returns these intents, and its unit's `Remedies` (`supervisor/engine/remedies.py`)
carries them out on the unit's task, in order. Frozen values; this module imports no lifecycle code.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import structlog

from supervisor.engine.events import DecisionRecord

log = structlog.get_logger("supervisor")

# (rule, reason): the engine's next take-down captures evidence first
EvidenceFor = tuple[str, str]


@dataclass(frozen=True)
class Restart:
    """A drained restart (or, not graceful, an immediate one)."""

    reason: str
    graceful: bool = True
    rung: str | None = None  # a remedy relaunch, audited once when it ends (`Relaunch`)
    evidence: EvidenceFor | None = None


@dataclass(frozen=True)
class HoldDown:
    """Take the engine down and keep it down (FATAL) until the operator restarts it."""

    reason: str
    evidence: EvidenceFor | None = None


@dataclass(frozen=True)
class BeginRemedy:
    """An in-place remedy on the serving engine (a prefix-cache reset, a KV reset)."""

    rung: str
    reason: str
    # a KV reset's ways of emptying the cache, in the order tried: "pause", "sleep"
    ways: tuple[str, ...] = ()


@dataclass(frozen=True)
class Throttled:
    """The throttle level changed at the proxy: in force at once, audited as a remedy."""

    rule: str
    level: int


@dataclass(frozen=True)
class Decided:
    """The policy decided: the unit's last decision (for `status`)."""

    record: DecisionRecord


Intent = Restart | HoldDown | BeginRemedy | Throttled | Decided


@dataclass
class Relaunch:
    """A relaunch the policy chose (a restart rung, a reduced batch, a hang's restart,
    a failed in-place remedy's fallback): one `remedy` audit entry once the new engine
    serves again, or once it cannot. Marks are monotonic times; the unit sets them."""

    rung: str
    reason: str
    started: float
    # through a standby (a relaunch with new arguments): one running them was proven and
    # the swap's drain began; before it, the engine served while that standby started
    standby_at: float | None = None
    taken_down_at: float | None = None  # the take-down began (the drain ended)
    down_at: float | None = None  # the old tree was proven gone
    starts: int = 0  # engine starts it took (a failed boot backs off and tries again)

    def steps(self, now: float) -> dict[str, float]:
        marks = [("drain", self.taken_down_at), ("take_down", self.down_at), ("start", now)]
        if self.standby_at is not None:
            marks.insert(0, ("standby", self.standby_at))
        out: dict[str, float] = {}
        last = self.started
        for name, at in marks:
            if at is None:
                break
            out[name] = round(at - last, 3)
            last = at
        return out


class RelaunchLog:
    """The relaunch in progress, if any: marked as it goes (taken down, down, each
    start), audited once as a `remedy` when it ends. `held`: requests waiting at the
    proxy now (None without one)."""

    def __init__(self, audit: Callable[..., None], monotonic: Callable[[], float],
                 held: Callable[[], int | None]) -> None:
        self._audit, self._monotonic, self._held = audit, monotonic, held
        self.current: Relaunch | None = None

    def begin(self, rung: str, reason: str) -> None:
        # one entry per rung tried: a relaunch still waiting for its engine ends here
        self.finish("superseded", f"superseded by {rung}: {reason}")
        self.current = Relaunch(rung, reason, self._monotonic())

    def starting(self) -> None:
        if self.current is not None:
            self.current.starts += 1

    def standby_ready(self) -> None:
        if self.current is not None and self.current.standby_at is None:
            self.current.standby_at = self._monotonic()

    def taken_down(self) -> None:
        if self.current is not None and self.current.taken_down_at is None:
            self.current.taken_down_at = self._monotonic()

    def down(self) -> None:
        if self.current is not None and self.current.down_at is None:
            self.current.down_at = self._monotonic()

    def finish(self, outcome: str, error: str | None) -> None:
        r, self.current = self.current, None
        if r is None:
            return
        now = self._monotonic()
        remedy_ended(self._audit, {
            "rung": r.rung, "outcome": outcome, "duration_s": round(now - r.started, 3),
            "steps_s": r.steps(now), "error": error, "starts": r.starts,
            "held": self._held(), "reason": r.reason})


def remedy_ended(audit: Callable[..., None], fields: dict[str, Any]) -> None:
    """Every rung tried ends in one `remedy` audit entry and one log line: rung,
    outcome, duration."""
    audit("remedy", **fields)
    (log.info if fields["outcome"] in ("ok", "alerted") else log.warning)(
        "remedy ended", **fields)
