"""What the watchdog asks, as steps for one engine unit.

`EngineWatch` (`supervisor/engine/watch.py`) decides and returns intents
(`supervisor/engine/intents.py`); `Remedies` turns them into the unit's steps
(`supervisor/engine/steps.py`), in order: a drained restart, a relaunch with new
arguments (through the standby when there is one), a hold-down (FATAL, the engine taken
down), an in-place remedy behind a hold of new requests, a live throttle at the gate.
The unit (`supervisor/engine/unit.py`, the one writer of its state) carries them out.
It owns the operators' requests for an in-place remedy (`kv-reset`) waiting for its end,
and answers them then. Never blocks; never decides.
"""

from __future__ import annotations

import asyncio
from typing import Any

from supervisor.engine import steps as do
from supervisor.engine.events import CommandError, RemedyDone
from supervisor.engine.intents import (
    BeginRemedy,
    Decided,
    HoldDown,
    Intent,
    Restart,
    Throttled,
)
from supervisor.engine.steps import Step
from supervisor.engine.watch import EngineWatch, UnitFacts


class Remedies:
    def __init__(self) -> None:
        # operators' in-place remedies, answered when the one under way ends
        self._replies: list[asyncio.Future[dict[str, Any]]] = []

    def carry_out(self, intents: list[Intent], facts: UnitFacts) -> list[Step]:
        """The steps of the watchdog's intents, in order."""
        out: list[Step] = []
        for intent in intents:
            if isinstance(intent, Decided):
                out.append(do.Record(intent.record))
            elif isinstance(intent, Restart):
                if intent.rung is not None:
                    out.append(do.RelaunchBegin(intent.rung, intent.reason))
                cold: list[Step] = [do.CountRestart("policy")]
                if intent.evidence is not None:
                    cold.append(do.CaptureEvidence(intent.evidence))
                cold.append(do.RestartEngine(intent.reason, graceful=intent.graceful))
                if intent.graceful and intent.rung is not None and intent.evidence is None:
                    # a relaunch with new arguments: through the standby when one can be
                    out.append(do.Upgrade(intent.reason, "policy", tuple(cold)))
                else:
                    out += cold
            elif isinstance(intent, HoldDown):
                if intent.evidence is not None:
                    out.append(do.CaptureEvidence(intent.evidence))
                out.append(do.GiveUp(intent.reason))
                if facts.engine is not None and not facts.taking_down:
                    out.append(do.TakeDown(graceful=True))
            elif isinstance(intent, BeginRemedy):
                e = facts.engine
                assert e is not None
                # (a KV reset holds new requests from now on)
                out.append(do.SyncGate())
                if intent.rung == "kv_reset" and facts.fronted \
                        and e.config.drain in ("auto", "continue"):
                    # its drain need not wait for the longest stream: the streams leave
                    # the engine and go on, token-exact, once the cache is rebuilt
                    # ("auto" too: waiting for them fails the reset whenever one
                    # outlasts drain_timeout_s, the busy engine's case; issue 48)
                    out.append(do.PauseStreams(e, "the KV reset"))
                out.append(do.StartRemedy(intent.rung, intent.ways))
            elif isinstance(intent, Throttled):
                out.append(do.Throttle(intent.rule, intent.level))  # live at the proxy
        return out

    def begin(self, watch: EngineWatch, facts: UnitFacts, rung: str, reason: str,
              reply: asyncio.Future[dict[str, Any]] | None = None) -> list[Step]:
        """An in-place remedy on the serving engine, as the policy begins one (an
        operator's KV reset is answered by `reply` when it ends)."""
        if reply is not None:
            self._replies.append(reply)
        return self.carry_out([watch.begin_remedy(rung, reason, facts)], facts)

    def done(self, ev: RemedyDone, watch: EngineWatch, facts: UnitFacts,
             waiting: int) -> list[Step]:
        """The remedy under way ended (whichever engine it was about): its operators are
        answered, and the steps of what the watchdog asks next."""
        fields, intents = watch.on_remedy_done(ev, facts, waiting)
        for reply in self._replies:
            if not reply.done():
                reply.set_result(fields)
        self._replies.clear()
        return self.carry_out(intents, facts)

    def abandon(self, why: str) -> None:
        """The unit stopped before the remedy under way ended (its job ends with the
        unit): its operators are told so rather than left waiting."""
        for reply in self._replies:
            if not reply.done():
                reply.set_exception(CommandError(f"kv-reset not finished: {why}"))
        self._replies.clear()
