"""A stop of the unit (an operator's, a signal's, the host's), as steps: a decider, as
the restart decider is (`supervisor/engine/restarts.py`).

The first stop ends any backoff, says STOPPING (to systemd too), ends a relaunch under
way, retires the standby, and takes the serving engine down gracefully within one
deadline; with no engine to take down it ends at once, or when the spawn or take-down
in flight ends (the serving role finishes it: engine/pair/serving.py). A second stop while
the first runs skips to SIGKILL; a third does nothing more.
"""

from __future__ import annotations

from supervisor.engine import steps as do
from supervisor.engine.states import State
from supervisor.engine.steps import PairFacts, Step


def stop(f: PairFacts, reason: str, forced: bool) -> list[Step]:
    """The steps of a stop asked now. `forced`: a stop under way already skipped to
    SIGKILL."""
    if f.state is State.STOPPING:
        return [] if forced else [do.ForceStop(reason)]
    deadline = f.restart_deadline(proxy_drain=False)
    out: list[Step] = [
        do.EndBackoff(), do.SetState(State.STOPPING, reason),
        do.RelaunchFinish("abandoned", f"the daemon is stopping: {reason}"),
        do.Decide("stop", reason), do.NotifyStopping(f"STOPPING: {reason}"),
        do.StopDeadline(deadline), do.Abandon("the daemon is stopping", deadline)]
    if f.engine is not None and not f.slot.taking_down:
        return [*out, do.TakeDown(graceful=True)]
    # (a spawn or take-down in flight finishes the stop when it ends)
    return [*out, do.MaybeFinishStop()]
