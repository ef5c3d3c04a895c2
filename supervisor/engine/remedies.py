"""Carrying out what the watchdog asks, for one engine unit.

`EngineWatch` (`supervisor/engine/watch.py`) decides and returns intents
(`supervisor/engine/intents.py`); `Remedies` carries them out, in order, on the unit's
task: a drained restart, a relaunch with new arguments (through the standby when there is
one), a hold-down (FATAL, the engine taken down), an in-place remedy behind a hold of new
requests, a live throttle at the gate. It owns the operators' requests for an in-place
remedy (`kv-reset`) waiting for its end, and answers them then. The unit
(`supervisor/engine/unit.py`) owns the lifecycle and its state; `Remedies` acts on it
only through `RemedyingUnit`: the steps a remedy takes. Never blocks; never decides.
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

from supervisor.engine import process as eng
from supervisor.engine.effects import Effects
from supervisor.engine.events import DecisionRecord, RemedyDone
from supervisor.engine.failures import Failures
from supervisor.engine.handover import Handover
from supervisor.engine.intents import (
    BeginRemedy,
    Decided,
    HoldDown,
    Intent,
    RelaunchLog,
    Restart,
    Throttled,
    remedy_ended,
)
from supervisor.engine.slot import EngineSlot
from supervisor.engine.watch import EngineWatch, UnitFacts
from supervisor.front.admission import Gate


class RemedyingUnit(Protocol):
    """What carrying out an intent reads and asks of the engine's unit."""

    @property
    def slot(self) -> EngineSlot: ...
    @property
    def engine(self) -> eng.EngineProcess | None: ...
    @property
    def act(self) -> Effects: ...
    @property
    def gate(self) -> Gate: ...
    @property
    def watch(self) -> EngineWatch: ...
    @property
    def relaunch(self) -> RelaunchLog: ...
    @property
    def handover(self) -> Handover: ...
    @property
    def failures(self) -> Failures: ...

    def facts(self) -> UnitFacts: ...
    def decided(self, record: DecisionRecord) -> None: ...
    def count_restart(self, reason: str) -> None: ...
    def restart_engine(self, reason: str, graceful: bool = True) -> None: ...
    def take_down(self, graceful: bool) -> None: ...
    def sync_gate(self) -> None: ...
    def audit(self, event: str, **fields: Any) -> None: ...


class Remedies:
    def __init__(self, unit: RemedyingUnit) -> None:
        self.u = unit
        # operators' in-place remedies, answered when the one under way ends
        self._replies: list[asyncio.Future[dict[str, Any]]] = []

    def carry_out(self, intents: list[Intent]) -> None:
        u = self.u
        for intent in intents:
            if isinstance(intent, Decided):
                u.decided(intent.record)
            elif isinstance(intent, Restart):
                if intent.rung is not None:
                    u.relaunch.begin(intent.rung, intent.reason)
                if (intent.graceful and intent.rung is not None and intent.evidence is None
                        and u.handover.begin_upgrade(intent.reason, "policy")):
                    continue  # a relaunch with new arguments: through the standby
                u.count_restart("policy")
                if intent.evidence is not None:
                    u.slot.capture_at_take_down(intent.evidence)
                u.restart_engine(intent.reason, graceful=intent.graceful)
            elif isinstance(intent, HoldDown):
                if intent.evidence is not None:
                    u.slot.capture_at_take_down(intent.evidence)
                u.failures.give_up(intent.reason)
                if u.engine is not None and not u.slot.taking_down:
                    u.take_down(graceful=True)
            elif isinstance(intent, BeginRemedy):
                assert u.engine is not None
                u.sync_gate()  # (a KV reset holds new requests from now on)
                u.act.remedy(u.engine, intent.rung)
            elif isinstance(intent, Throttled):
                u.sync_gate()  # live at the proxy: in force at once
                remedy_ended(u.audit, {"rung": "throttle", "outcome": "ok",
                                       "duration_s": 0.0, "rule": intent.rule,
                                       "throttle_level": intent.level,
                                       "max_concurrency": u.gate.concurrency_limit})

    def begin(self, rung: str, reason: str,
              reply: asyncio.Future[dict[str, Any]] | None = None) -> None:
        """An in-place remedy on the serving engine, as the policy begins one (an
        operator's KV reset is answered by `reply` when it ends)."""
        if reply is not None:
            self._replies.append(reply)
        self.carry_out([self.u.watch.begin_remedy(rung, reason, self.u.facts())])

    def done(self, ev: RemedyDone) -> None:
        """The remedy under way ended (whichever engine it was about): its operators are
        answered, and what the watchdog asks next is carried out."""
        u = self.u
        fields, intents = u.watch.on_remedy_done(ev, u.facts(), u.gate.waiting)
        for reply in self._replies:
            if not reply.done():
                reply.set_result(fields)
        self._replies.clear()
        self.carry_out(intents)
