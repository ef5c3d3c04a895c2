"""Protection back now (`vllm-supervisorctl rearm`, or the quiet window
`engine.rearm_window`, docs/standby.md): a standby waiting out its backoff starts at
once; one with no room beside the serving engine comes back through a drained restart
that starts it first. A decider over the handover (`pair/handover.py`): what it reads
and asks of it is `Handover` below; the unit carries the steps out.
"""

from __future__ import annotations

from datetime import datetime
from typing import Protocol

import structlog

from supervisor.engine import steps as do
from supervisor.engine.pair.pair_states import Phase, Role
from supervisor.engine.pair.standby import Standby
from supervisor.engine.states import State
from supervisor.engine.steps import PairFacts, Step
from supervisor.settings import engine_checks

log = structlog.get_logger("supervisor")


class Handover(Protocol):
    """What of `pair.handover.Handover` a re-arm reads and asks."""

    standby: Standby
    phase: Phase
    rearmed_on: str | None  # the quiet window used (the day it began)

    def arm(self, f: PairFacts, due: bool = False) -> list[Step]: ...


def rearm(h: Handover, f: PairFacts, reason: str) -> tuple[str, list[Step]]:
    """Protection back now (an operator's `rearm`, or the quiet window): a standby
    waiting out its backoff starts at once; one with no room beside the serving
    engine comes back through a drained restart that starts it first (clients held
    through both starts: never done unasked outside the window). What is done, and
    its steps; a refusal raises ValueError, saying why."""
    st = h.standby
    if f.config.engine.standby == "none":
        raise ValueError('no standby is configured (engine.standby = "none")')
    if f.state is not State.RUNNING or h.phase is not Phase.IDLE:
        raise ValueError(f"the engine is {f.state.value}"
                         + (f", a handover under way ({h.phase.value})"
                            if h.phase is not Phase.IDLE else "")
                         + ": a standby is armed once it serves")
    if st.ready:
        raise ValueError("already protected: the standby is ready")
    if st.on_its_way:
        raise ValueError(f"already re-arming: the standby is {st.state.value}")
    if st.state is Role.FAILED:
        raise ValueError(f"the standby's place is not free ({st.why}): only a "
                         f"restart of the daemon clears it")
    if st.state is Role.RETIRING:
        raise ValueError("the engine in the standby's place is being taken down: "
                         "a standby starts there once it is gone")
    if st.state is Role.RETURNING:
        raise ValueError("already re-arming: the thin engine is the standby again "
                         "once its requests end")
    no_sleep = st.no_sleep(f.engine_config(st.slot.bay))
    if st.state is Role.NO_ROOM and no_sleep is not None:
        raise ValueError(f"the engine cannot sleep ({no_sleep}), and an awake standby "
                         f"does not fit beside it: no standby until that changes")
    if st.state is Role.NO_ROOM:
        log.warning("re-arm: a drained restart, the standby first", reason=reason)
        return ("drained restart: the standby starts first, then the engine beside "
                "it (requests held meanwhile)",
                [do.Audit("rearm", {"reason": reason, "how": "restart"}),
                 do.CountRestart("rearm"), do.RestartEngine(f"re-arm: {reason}")])
    out = st.cancel_timer()
    st.due()  # (a backoff under way is cut short)
    out += h.arm(f, due=True)
    return (f"the standby is {st.state.value}",
            [*out, do.Audit("rearm", {"reason": reason, "how": "start"})])


def in_window(h: Handover, f: PairFacts, local: datetime) -> list[Step]:
    """At a tick: a standby with no room beside the serving engine is re-armed once per
    quiet window (`engine.rearm_window`), while the engine serves and nothing is handed
    over."""
    text = f.config.engine.rearm_window
    if not text or h.standby.state is not Role.NO_ROOM:
        return []
    day = engine_checks.DailyWindow.parse(text).occurrence(local)
    if day is None or day == h.rearmed_on or f.state is not State.RUNNING \
            or h.phase is not Phase.IDLE:
        return []
    h.rearmed_on = day
    return rearm(h, f, f"the quiet window {text}")[1]
