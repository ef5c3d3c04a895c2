"""The serving bay's role: what each event of the serving engine's process asks, as steps.

The serving bay is read like every bay (`EngineSlot.on` turns its process's events into
outcomes, `supervisor/engine/pair/outcomes.py`); this decider says what the unit does with
each outcome, from the unit's state at that moment (`PairFacts`) and nothing else: it holds
no state and acts on nothing. The unit's executor carries the steps out
(`supervisor/engine/executor.py`), asking another decider where a step is its
(`Fail`, `FailOver`, `GiveUp`, `FailedDown`, `StartRefused`).

| outcome | the unit's state | steps |
|---|---|---|
| SpawnFailed | STOPPING | `MaybeFinishStop` |
| | another program holds the GPUs | `StartRefused` (BACKOFF, not a failure) |
| | DRAINING (a restart's spawn) | `StartEngine` again |
| | otherwise | `Fail` |
| Up | | `Started`, `Follow` (fronted); `TakeDown` if a stop or restart came meanwhile |
| Healthy | | `EngineHealthy`, RUNNING, systemd told, `Serve`, `ArmStandby`, proof |
| Unhealthy | | `Fail` |
| Died | RUNNING, the standby fits | `CountRestart`, `FailOver` (not graceful) |
| | DRAINING (a restart's drain) | `SwapOrTakeDown` (not graceful): the restart goes on now |
| | otherwise | `ServingFailed`, `Fail` |
| Gone | (always first) | `EndStopDeadline`, the relaunch's `down` |
| | STOPPING | `MaybeFinishStop` (failed when not proven gone) |
| | not proven gone | `GiveUp` |
| | DRAINING | `StartEngine` |
| | BACKOFF, FATAL | `FailedDown` |

`Seen` is the watchdog's (the tree's memory and CPU, into its signal window), not a step.

Its proof (`proved`: the first generation a new engine answered, `GateProbe`), once the
handover has said whether it was a woken standby's that failed (`Handover.proof_failed`):

| the proof | steps |
|---|---|
| a wake broke the engine | `Fail` (no engine of the unit sleeps again) |
| not the answer it gave before (golden check) | `Fail`; the second in a row `GiveUp` |
| silent past its warm-up's budget | `Fail` |
| passed, or the canary failed (said) | `GoldenPassed`, `RelaunchFinish`, `Admit`, `HandoverDone` |
"""

from __future__ import annotations

import structlog

from supervisor.engine import steps as do
from supervisor.engine.events import GateProbe
from supervisor.engine.pair import outcomes as out
from supervisor.engine.states import State
from supervisor.engine.steps import PairFacts

log = structlog.get_logger("supervisor")


def on_process(f: PairFacts, outcome: out.Outcome, *, standby_fits: bool,
               warm: bool) -> list[do.Step]:
    """The steps that follow from one outcome of the serving engine's process.
    `standby_fits`: a standby could take over now (`Handover.fits`); `warm`: a proof
    may sleep and wake the engine first (no wake broke one of this unit's)."""
    match outcome:
        case out.SpawnFailed(error, gpu_busy):
            if f.state is State.STOPPING:
                return [do.MaybeFinishStop()]
            if gpu_busy:
                return [do.StartRefused(error or "GPU busy")]
            if f.state is State.DRAINING:
                return [do.StartEngine(f.restart_reason)]
            return [do.Fail(f"engine could not be started: {error}", None)]
        case out.Up(engine):
            # the proxy's route for this engine goes to it now; a stop or restart that
            # came while it spawned takes it down
            steps: list[do.Step] = [do.Started()]
            if f.fronted:
                steps.append(do.Follow(engine))
            if f.state in (State.STOPPING, State.DRAINING):
                steps.append(do.TakeDown(graceful=True))
            return steps
        case out.Healthy(engine):
            start_s = (engine.healthy_at or f.now) - engine.started_at
            # held requests go once one canary passed, after one sleep and wake of an
            # engine with sleep mode (its first KV reset then pays no first sleep); with
            # no canary to wait for, healthy is all we know, and nothing more is waited for
            return [do.EngineHealthy(engine),
                    do.SetState(State.RUNNING, f"/health answered 200 after {start_s:.1f} s"),
                    do.NotifyReady(f"RUNNING: engine pid {engine.pid} serving"),
                    do.Serve(engine), do.ArmStandby(),
                    *do.proof(engine, prove=f.fronted and f.config.canary.enabled,
                              warm=warm)]
        case out.Unhealthy(_, why, timed_out):
            return [do.Fail(f"engine {why}" if timed_out else why, None)]
        case out.Died(engine):
            # (vLLM may exit 0 after its core died: any unasked exit is a crash, and a
            # core's death while the API server is still up is one now, not at its exit)
            why = f"engine {engine.describe_exit()} without being asked"
            if f.state is State.RUNNING and standby_fits:
                return [do.CountRestart("crash"), do.FailOver(why, graceful=False)]
            # a drain's requests can no longer finish at a dead engine: waiting for them
            # would hold every client up to the drain's timeout for nothing
            if f.state is State.DRAINING:
                return [do.SwapOrTakeDown(graceful=False)]
            healthy_for = f.now - engine.healthy_at if engine.healthy_at is not None \
                else None
            return [do.ServingFailed(), do.Fail(why, healthy_for)]
        case out.Gone(engine, problem):
            steps = [do.EndStopDeadline(), do.Relaunch("down")]
            if f.state is State.STOPPING:
                steps.append(do.MaybeFinishStop(failed=bool(problem)))
            elif problem is not None and f.state is not State.FATAL:
                steps.append(do.GiveUp(problem, engine))
            elif f.state is State.DRAINING:
                steps.append(do.StartEngine(f.restart_reason))
            elif f.state in (State.BACKOFF, State.FATAL):
                steps.append(do.FailedDown(engine, problem))
            return steps
    return []


def proved(ev: GateProbe, golden_failures: int) -> list[do.Step]:
    """The steps that follow from the serving engine's proof; `golden_failures`: its
    proofs in a row that the golden check failed before this one."""
    if ev.broken_by_wake:
        # (no request may reach it) restarted; its successors neither warm up nor reset
        # their KV cache: a wake breaks this engine
        why = f"after its warm-up sleep and wake: {ev.error}"
        log.error("a wake broke the engine: restarted, and no engine of this unit "
                  "sleeps again until the daemon restarts", why=why)
        return [do.Fail(why, None)]
    if ev.golden_mismatch:
        # started, but not answering as it did: restarted once more, then held down
        why = ev.error or "golden check failed"
        if golden_failures + 1 >= 2:
            return [do.GoldenFailed(), do.GiveUp(f"{why} (twice in a row: held down)")]
        return [do.GoldenFailed(), do.Fail(why, None)]
    if ev.warmed is not None and not ev.warmed.ok:
        # silent past its whole warm-up budget: not a slow first step, a failed start
        return [do.Fail(ev.error or "warm-up failed", None)]
    steps: list[do.Step] = [do.GoldenPassed()] if ev.ok and ev.golden is not None else []
    if not ev.ok:
        log.warning("the first canary failed; releasing held requests anyway",
                    error=ev.error)
    return [*steps, do.RelaunchFinish("ok", None if ev.ok
                                      else f"the first canary failed: {ev.error}"),
            do.Admit(), do.HandoverDone()]
