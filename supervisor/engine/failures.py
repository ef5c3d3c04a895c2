"""An engine's failures, for one engine unit: the backoff after one, and giving up.

`Failures` owns the restart bookkeeping (`RestartTracker`, `supervisor/engine/lifecycle.py`:
the delays and the boot-failure limit), the backoff under way (its end and its timer), a
start refused because another program holds the GPUs, an operator's restart waiting for
the failed engine's tree to be gone, and the reason and last errors of giving up (FATAL).
A decider: the unit (`supervisor/engine/unit.py`) calls in when an engine fails, is
refused, is down or the backoff ends, with its state as `PairFacts`, and carries out the
steps returned (`supervisor/engine/steps.py`: BACKOFF, FATAL, the take-down of what is
left, the next start, the backoff's timer). Runs on the unit's task; never blocks.

Invariants:
- a boot failure (never healthy) and a crash (served, then died) are told apart: only
  boot failures, enough of them within the window, give up;
- a start refused for a busy GPU is not a failure: nothing of ours ran or is killed;
- the next start waits for the backoff and for the failed engine's tree to be gone.
"""

from __future__ import annotations

import structlog

from supervisor.engine import steps as do
from supervisor.engine.events import BackoffElapsed
from supervisor.engine.lifecycle import RestartTracker
from supervisor.engine.process import process as eng
from supervisor.engine.states import State
from supervisor.engine.steps import PairFacts, Step
from supervisor.settings.sections import RestartConfig

log = structlog.get_logger("supervisor")

# the key of the backoff's timer, held by the unit's executor
TIMER = "backoff"


class Failures:
    def __init__(self, cfg: RestartConfig) -> None:
        self.tracker = RestartTracker(cfg)
        self.backoff_until: float | None = None
        self.start_blocked: str | None = None  # why the last start was refused (GPU busy)
        self.fatal_reason: str | None = None
        self.fatal_errors: list[str] = []
        self._restart_when_down = False  # an operator's restart, once the tree is gone

    def reconfigure(self, cfg: RestartConfig) -> None:
        self.tracker.cfg = cfg

    def fail(self, f: PairFacts, reason: str, healthy_for: float | None) -> list[Step]:
        """The engine failed (crash, boot failure, startup timeout): back off or give up,
        and take down whatever is left of its tree."""
        verdict = self.tracker.record_failure(f.now, healthy_for_s=healthy_for, what=reason)
        out: list[Step] = [do.CountRestart("crash" if healthy_for is not None
                                           else "boot_failure")]
        if verdict.fatal:
            out += self.give_up(f, verdict.reason)
        else:
            self.backoff_until = f.now + verdict.delay_s
            out += [do.SetState(State.BACKOFF,
                                f"{reason}; retrying in {verdict.delay_s:g} s"),
                    do.Decide("backoff", reason)]
        if f.engine is not None:
            out.append(do.TakeDown(graceful=False))
        elif not verdict.fatal:
            out.append(self._arm_backoff(f))
        return out

    def start_refused(self, f: PairFacts, why: str) -> list[Step]:
        """Another program holds the engine's GPUs: not a boot failure (the engine never
        ran), nothing to kill (not ours). Wait in BACKOFF, saying why, and look again
        every backoff_max_s; `restart` looks at once."""
        self.start_blocked = why
        delay = f.config.restart.backoff_max_s
        self.backoff_until = f.now + delay
        return [do.SetState(State.BACKOFF,
                            f"start refused: {why}; checking again in {delay:g} s"),
                do.Decide("backoff", f"start refused: {why}"),
                # systemd's start must not wait on someone else's job: say so, stay up
                do.NotifyReady(f"BACKOFF: start refused: {why}"),
                self._arm_backoff(f)]

    def started(self) -> None:
        """An engine was spawned: its GPUs were free."""
        self.start_blocked = None

    def give_up(self, f: PairFacts, reason: str,
                engine: eng.EngineProcess | None = None) -> list[Step]:
        """FATAL, with the last error lines of `engine` (default: the current one)."""
        engine = engine or f.engine
        errors = list(engine.recent_errors) if engine else []
        self.fatal_reason = reason
        log.error("giving up on the engine", reason=reason, last_engine_errors=errors[-10:])
        self.fatal_errors = errors[-10:]
        return [do.SetState(State.FATAL, reason),
                # (on the same GPUs and arguments: a standby cannot help an engine held down)
                do.Abandon(reason, f.standby_deadline()),
                do.RelaunchFinish("failed", reason),
                do.Decide("give_up", reason),
                # The daemon is up and answering even though the engine is not: tell
                # systemd, so that `systemctl start` returns and `status` shows FATAL.
                do.NotifyReady(f"FATAL: {reason}")]

    def restart(self, f: PairFacts, reason: str) -> list[Step]:
        """An operator's restart out of BACKOFF or FATAL: the counts start afresh, and the
        engine starts now, or once the failed one's tree is gone."""
        self.tracker.reset()
        self.fatal_reason = None
        out: list[Step] = [*self.cancel_backoff(), do.Decide("restart", reason)]
        if f.engine is None and not f.slot.spawning:
            out.append(do.StartEngine(reason))
        else:
            self._restart_when_down = True
        return out

    def down(self, f: PairFacts, engine: eng.EngineProcess,
             problem: str | None) -> list[Step]:
        """The failed engine's tree is gone (in BACKOFF or FATAL): wait out the backoff,
        or start now when the operator restarted meanwhile."""
        if f.state is State.FATAL:
            self.fatal_errors = list(engine.recent_errors)[-10:]  # now complete
            if self._restart_when_down and problem is None:
                self._restart_when_down = False
                return [do.StartEngine(f.restart_reason)]
            return []
        if self._restart_when_down:
            self._restart_when_down = False
            return [*self.cancel_backoff(), do.StartEngine(f.restart_reason)]
        return [self._arm_backoff(f)]

    def _arm_backoff(self, f: PairFacts) -> Step:
        """A BackoffElapsed for this engine's generation when the backoff ends (on the
        executor's timer of that name: one under way is replaced)."""
        return do.ArmTimer(TIMER, max(0.0, (self.backoff_until or 0.0) - f.now),
                           BackoffElapsed(f.generation))

    def cancel_backoff(self) -> list[Step]:
        self.backoff_until = None
        return [do.CancelTimer(TIMER)]

    def backoff_elapsed(self, f: PairFacts, ev: BackoffElapsed) -> list[Step]:
        if (f.state is State.BACKOFF and ev.generation == f.generation
                and f.engine is None and not f.slot.spawning):
            return [do.StartEngine("backoff elapsed")]
        return []
