"""When an engine's gate at the proxy opens, holds or closes: one owner, one rule.

The unit (`supervisor/engine/unit.py`) calls `sync` after every event it handles, with its
state; nothing else opens or closes the gate (`supervisor/front/admission.py` is the gate
itself: the waiting requests and the limits). Closed while FATAL, STOPPING or STOPPED
(no engine is coming: waiting requests fail at once); held while the engine is not
RUNNING, until its first canary passed, while the operator drains it, and during a KV
reset; open otherwise. The watchdog's throttle level is applied here too.

It also says whether a router should count the engine healthy (`Gate.unhealthy`, what the
proxy's `/health` answers; docs/fleet.md): healthy while it serves or holds requests for
a short wait only (its first canary after a handover to the standby, a KV reset, a swap
with a ready standby); unhealthy while a cold start, a backoff, an operator's drain, a
stop or FATAL keeps it from serving, and while its canaries fail with no progress (a
frozen engine, whose own `/health` still says 200).
"""

from __future__ import annotations

from collections.abc import Callable

import structlog

from supervisor.engine.states import State
from supervisor.front.admission import Gate

log = structlog.get_logger("supervisor")
CLOSED = (State.FATAL, State.STOPPING, State.STOPPED)


class GateKeeper:
    def __init__(self, gate: Gate, audit: Callable[..., None]) -> None:
        self.gate, self._audit = gate, audit
        self._admitting = False  # the engine's first canary passed: held requests may go
        self.drained_by_operator = False  # `drain` until `resume`

    @property
    def admitting(self) -> bool:
        return self._admitting

    def hold_until_proven(self) -> None:
        """A new engine serves (a start, a failover): held requests wait for its proof."""
        self._admitting = False

    def admit(self) -> None:
        """The engine was proven (or there is nothing to prove it with): held requests go
        at the next `sync`, unless the operator holds them."""
        self._admitting = True
        if self.drained_by_operator:
            log.info("engine ready; requests stay held until `resume`",
                     waiting=self.gate.waiting)

    def sync(self, state: State, reason: str, remedy_hold: str | None, level: int,
             ended: bool = False, suspect: str | None = None, swap: bool = False) -> None:
        """`suspect`: why the engine may be frozen; `swap`: a restart under way hands over
        to a ready standby."""
        g = self.gate
        if g.level != level:
            g.set_level(level)
        g.unhealthy = self._unhealthy(state, reason, ended, suspect, swap)
        if ended or state in CLOSED:
            why = "the engine is stopped" if ended and state is not State.STOPPED \
                else f"the engine is {state.value}: {reason}"
            if g.closed_reason != why:
                g.close(why)
            return
        want: str | None
        if state is not State.RUNNING:
            want = f"the engine is {state.value}: {reason}"
        else:
            want = remedy_hold or (
                "drain requested by operator" if self.drained_by_operator else None)
            if want is None and not self._admitting:
                want = g.held_reason or "the engine's first canary has not passed yet"
        if want is not None:
            if g.held_reason != want or g.closed_reason is not None:
                g.hold(want)  # new requests wait
        elif g.held_reason is not None:
            waiting = g.waiting
            g.release()
            if waiting:
                log.info("held requests released", count=waiting)
                self._audit("released", count=waiting)

    def _unhealthy(self, state: State, reason: str, ended: bool, suspect: str | None,
                   swap: bool) -> str | None:
        if ended:
            return "the engine is stopped"
        if state is State.DRAINING and swap:
            return None  # (the standby takes over within about a second)
        if state is not State.RUNNING:
            return f"the engine is {state.value}: {reason}"
        if self.drained_by_operator:
            return "drain requested by operator"
        return suspect
