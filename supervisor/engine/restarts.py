"""A restart of the serving engine (an operator's, a remedy's, an upgrade's, a re-arm's),
as steps: a decider, as `Failures` and `Handover` are (`supervisor/engine/steps.py`).

From RUNNING the unit drains: new requests are held, and with `drain = "continue"` the
streams at the engine are paused to go on on the next one.
Then, in the first of these that applies:
- an awake, up-to-date standby takes the new requests at once, and the requests at the
  old engine finish there behind it (`FailOver(drain_behind=True)`);
- the requests at the engine finish there first, within the drain's deadline (`Drain`);
- the standby takes over, or the engine is taken down for a cold start (`SwapOrTakeDown`).
From STARTING there is nothing to drain: the standby takes over or the starting engine
is taken down. An engine still spawning is taken down once its spawn ends; none at all (a
standby starting first) is started. From BACKOFF or FATAL the failure decider restarts it. A
restart during one, or while the daemon stops, is refused, saying why.
"""

from __future__ import annotations

import structlog

from supervisor.engine import steps as do
from supervisor.engine.states import State
from supervisor.engine.steps import PairFacts, Step

log = structlog.get_logger("supervisor")


class RestartRefused(Exception):
    """Why a restart cannot begin now (the operator is told)."""


def restart(f: PairFacts, reason: str, graceful: bool, in_flight: int,
            swaps_at_once: bool) -> list[Step]:
    """The steps of a restart beginning now. `in_flight`: requests at the engine now
    (the gate's); `swaps_at_once`: the standby is ready, up to date and awake
    (`Handover.swaps_at_once`). RestartRefused: it cannot begin."""
    if f.state in (State.BACKOFF, State.FATAL):
        return [do.RestartReason(reason), do.RestartFailed(reason)]
    if f.state is State.DRAINING:
        raise RestartRefused("a restart is already in progress")
    if f.state not in (State.STARTING, State.RUNNING):
        raise RestartRefused(f"the daemon is {f.state.value}")
    out: list[Step] = [do.RestartReason(reason), do.SetState(State.DRAINING, reason),
                       do.Decide("restart", reason)]
    e = f.engine
    if e is None or f.slot.taking_down:
        # none spawned yet (its standby was starting first): started now; one spawning is
        # taken down when its spawn ends, and a take-down already running (a crash being
        # reaped) ends in the serving role's `Gone` (engine/pair/serving.py)
        return [*out, do.StartEngine(reason)] if e is None and not f.slot.spawning else out
    if f.state is State.STARTING:
        # (no request is at an engine that never served: nothing to drain or pause, even
        # with requests in flight at the proxy for the one before it)
        return [*out, do.SwapOrTakeDown(graceful)]
    if f.fronted:
        log.info("restart: new requests held", in_flight=in_flight)
    drain = graceful and f.fronted
    if drain and e.config.drain == "continue":
        out.append(do.PauseStreams(e, "restart"))
    if drain and in_flight and swaps_at_once:
        # an awake standby takes the new requests now; the ones at the old engine finish
        # there before its SIGTERM
        return [*out, do.FailOver(reason, graceful, drain_behind=True)]
    if drain and in_flight:
        # the gate holds new requests now; the ones at the engine finish before SIGTERM
        # (vLLM's own drain aborts streams), bounded
        deadline = f.restart_deadline(proxy_drain=True)
        return [*out, do.StopDeadline(deadline), do.Drain(e, deadline)]
    return [*out, do.SwapOrTakeDown(graceful)]
