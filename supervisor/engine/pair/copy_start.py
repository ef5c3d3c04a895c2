"""A copy of the standby's images serves in place of a cold start (`standby = "snapshot"`,
issue 49's "new rung between a wake and a cold start").

A cold start that follows the failure of an engine of this unit that served already
waits for a copy of the images being restored in the standby's place (a crash with no
standby ready: the next copy not restored yet; `Handover.start_first`), or finds one
ready there. That copy then serves: woken (0.5 s for an 8B engine on an H200) and
proven as after a failover, where the engine's own cold start takes minutes (the copy's
restore, 20-33 s on the H200, is under way already). Another copy is restored as the
standby once the handover is done. With `standby_weights = "gpu"` its weights wake
first and their pinned host backup is let go before the rest wakes, as a copy whose
weights went ahead before a fault has (on the H200 a copy that served without it gave
the card back 0.73 s after its death, the others 0.24-0.30 s: a 1.94 s gap at the next
failover). The daemon's first start is not one of these: its
engine starts as before, beside the copy. Where the standby's place holds a tree not
proven gone (a failover refused), no copy can be there: the engine starts cold.

A decider only: `Handover` asks `serves(...)` where a cold start would spawn the engine.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import structlog

from supervisor.engine import steps as do
from supervisor.engine.pair.standby import Standby
from supervisor.engine.process import host_cache
from supervisor.engine.states import State
from supervisor.engine.steps import PairFacts, Step

log = structlog.get_logger("supervisor")

REASON = "a copy of the images serves in place of a cold start"


class Handover(Protocol):
    """What of `pair.handover.Handover` this decider reads and asks."""

    standby: Standby
    served: bool

    def fits(self, f: PairFacts) -> bool: ...

    def fail_over(self, f: PairFacts, reason: str, graceful: bool,
                  drain_behind: bool = False, let_go: bool = False) -> list[Step]: ...


def serves(h: Handover, f: PairFacts) -> list[Step] | None:
    """The steps by which the ready copy in the standby's place serves now, in place of
    the cold start beginning (the unit STARTING, nothing in the serving place); None
    where it cannot: no engine of the unit served yet, no ready copy, or one that does
    not run what the start would."""
    st = h.standby
    copy = st.slot.engine
    if not (h.served and f.state is State.STARTING and f.engine is None
            and not f.slot.spawning and not f.slot.taking_down and st.ready
            and copy is not None and copy.spec.restore is not None and h.fits(f)):
        return None
    log.warning(REASON, pid=copy.pid, port=copy.config.port)
    # RUNNING once the copy's place is the serving one (`ServeFrom`, which counts no
    # second start while the unit is STARTING: the cold start counted this one)
    # with `standby_weights = "gpu"` it serves as a copy whose weights went ahead does:
    # their pinned host backup let go before the rest wakes (0.52 s more on the H200,
    # on a wait that is mostly the restore's), else its own death gives the card back
    # ~0.5 s later, on the next failover's critical path (docs/standby.md)
    let_go = (f.config.engine.standby_weights == "gpu"
              and host_cache.why_not(copy.spec.argv) is None)
    return [*h.fail_over(dataclasses.replace(f, state=State.RUNNING), REASON,
                         graceful=False, let_go=let_go),
            do.SetState(State.RUNNING, f"{REASON} (pid {copy.pid})")]

