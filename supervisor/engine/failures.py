"""An engine's failures, for one engine unit: the backoff after one, and giving up.

`Failures` owns the restart bookkeeping (`RestartTracker`, `supervisor/engine/lifecycle.py`:
the delays and the boot-failure limit), the backoff under way (its end and its timer), a
start refused because another program holds the GPUs, an operator's restart waiting for
the failed engine's tree to be gone, and the reason and last errors of giving up (FATAL).
The unit (`supervisor/engine/unit.py`) owns the lifecycle and its state; it calls in when
an engine fails, is refused, is down or the backoff ends, and `Failures` acts on it only
through `FailingUnit`: the steps of the lifecycle a failure takes (BACKOFF, FATAL, the
take-down of what is left, the next start). Runs on the unit's task; never blocks.

Invariants:
- a boot failure (never healthy) and a crash (served, then died) are told apart: only
  boot failures, enough of them within the window, give up;
- a start refused for a busy GPU is not a failure: nothing of ours ran or is killed;
- the next start waits for the backoff and for the failed engine's tree to be gone.
"""

from __future__ import annotations

from typing import Protocol

import structlog

from supervisor.config import Config, RestartConfig
from supervisor.engine import process as eng
from supervisor.engine.effects import Effects, Timer
from supervisor.engine.events import BackoffElapsed
from supervisor.engine.intents import RelaunchLog
from supervisor.engine.lifecycle import RestartTracker
from supervisor.engine.notices import SystemdNotices
from supervisor.engine.slot import EngineSlot
from supervisor.engine.states import State
from supervisor.loop import Clock

log = structlog.get_logger("supervisor")


class Standby(Protocol):
    def abandon(self, why: str, deadline: float) -> None: ...


class FailingUnit(Protocol):
    """What a failure reads and asks of its engine's unit."""

    @property
    def config(self) -> Config: ...
    @property
    def clock(self) -> Clock: ...
    @property
    def act(self) -> Effects: ...
    @property
    def state(self) -> State: ...
    @property
    def engine(self) -> eng.EngineProcess | None: ...
    @property
    def generation(self) -> int: ...
    @property
    def slot(self) -> EngineSlot: ...
    @property
    def notices(self) -> SystemdNotices: ...
    @property
    def relaunch(self) -> RelaunchLog: ...
    @property
    def handover(self) -> Standby: ...
    @property
    def restart_reason(self) -> str: ...

    def set_state(self, new: State, reason: str) -> None: ...
    def decide(self, action: str, reason: str) -> None: ...
    def count_restart(self, reason: str) -> None: ...
    def take_down(self, graceful: bool) -> None: ...
    def standby_deadline(self) -> float: ...
    def start_engine(self, reason: str) -> None: ...


class Failures:
    def __init__(self, unit: FailingUnit, cfg: RestartConfig) -> None:
        self.u = unit
        self.tracker = RestartTracker(cfg)
        self.backoff_until: float | None = None
        self.start_blocked: str | None = None  # why the last start was refused (GPU busy)
        self.fatal_reason: str | None = None
        self.fatal_errors: list[str] = []
        self._backoff: Timer | None = None
        self._restart_when_down = False  # an operator's restart, once the tree is gone

    def reconfigure(self, cfg: RestartConfig) -> None:
        self.tracker.cfg = cfg

    def fail(self, reason: str, healthy_for: float | None) -> None:
        """The engine failed (crash, boot failure, startup timeout): back off or give up,
        and take down whatever is left of its tree."""
        u = self.u
        verdict = self.tracker.record_failure(u.clock.monotonic(), healthy_for_s=healthy_for,
                                              what=reason)
        u.count_restart("crash" if healthy_for is not None else "boot_failure")
        if verdict.fatal:
            self.give_up(verdict.reason)
        else:
            self.backoff_until = u.clock.monotonic() + verdict.delay_s
            u.set_state(State.BACKOFF, f"{reason}; retrying in {verdict.delay_s:g} s")
            u.decide("backoff", reason)
        if u.engine is not None:
            u.take_down(graceful=False)
        elif u.state is State.BACKOFF:
            self._arm_backoff()

    def start_refused(self, why: str) -> None:
        """Another program holds the engine's GPUs: not a boot failure (the engine never
        ran), nothing to kill (not ours). Wait in BACKOFF, saying why, and look again
        every backoff_max_s; `restart` looks at once."""
        u = self.u
        self.start_blocked = why
        delay = u.config.restart.backoff_max_s
        self.backoff_until = u.clock.monotonic() + delay
        u.set_state(State.BACKOFF, f"start refused: {why}; checking again in {delay:g} s")
        u.decide("backoff", f"start refused: {why}")
        # systemd's start must not wait on someone else's job: say so, and stay up
        u.notices.ready_once(f"BACKOFF: start refused: {why}")
        self._arm_backoff()

    def started(self) -> None:
        """An engine was spawned: its GPUs were free."""
        self.start_blocked = None

    def give_up(self, reason: str, engine: eng.EngineProcess | None = None) -> None:
        """FATAL, with the last error lines of `engine` (default: the current one)."""
        u = self.u
        engine = engine or u.engine
        errors = list(engine.recent_errors) if engine else []
        self.fatal_reason = reason
        u.set_state(State.FATAL, reason)
        # (on the same GPUs and arguments: a standby cannot help an engine held down)
        u.handover.abandon(reason, u.standby_deadline())
        u.relaunch.finish("failed", reason)
        u.decide("give_up", reason)
        log.error("giving up on the engine", reason=reason, last_engine_errors=errors[-10:])
        self.fatal_errors = errors[-10:]
        # The daemon is up and answering even though the engine is not: tell systemd, so
        # that `systemctl start` returns and `status` shows FATAL with the reason.
        u.notices.ready_once(f"FATAL: {reason}")

    def restart(self, reason: str) -> None:
        """An operator's restart out of BACKOFF or FATAL: the counts start afresh, and the
        engine starts now, or once the failed one's tree is gone."""
        u = self.u
        self.tracker.reset()
        self.fatal_reason = None
        self.cancel_backoff()
        u.decide("restart", reason)
        if u.engine is None and not u.slot.spawning:
            u.start_engine(reason)
        else:
            self._restart_when_down = True

    def down(self, engine: eng.EngineProcess, problem: str | None) -> None:
        """The failed engine's tree is gone (in BACKOFF or FATAL): wait out the backoff,
        or start now when the operator restarted meanwhile."""
        u = self.u
        if u.state is State.FATAL:
            self.fatal_errors = list(engine.recent_errors)[-10:]  # now complete
            if self._restart_when_down and problem is None:
                self._restart_when_down = False
                u.start_engine(u.restart_reason)
        elif self._restart_when_down:
            self._restart_when_down = False
            self.cancel_backoff()
            u.start_engine(u.restart_reason)
        else:
            self._arm_backoff()

    def _arm_backoff(self) -> None:
        u = self.u
        delay = max(0.0, (self.backoff_until or 0.0) - u.clock.monotonic())
        self._backoff = u.act.after(delay, BackoffElapsed(u.generation))

    def cancel_backoff(self) -> None:
        if self._backoff is not None:
            self._backoff.cancel()
            self._backoff = None
        self.backoff_until = None

    def backoff_elapsed(self, ev: BackoffElapsed) -> None:
        u = self.u
        self._backoff = None
        if (u.state is State.BACKOFF and ev.generation == u.generation
                and u.engine is None and not u.slot.spawning):
            u.start_engine("backoff elapsed")
