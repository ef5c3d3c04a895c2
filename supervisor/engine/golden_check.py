"""The golden check's baselines and verdicts, for one engine unit (docs/watchdog.md).

Every proof of an engine (`GateProbe`: after its start, a restart, a wake, a swap, and a
standby's before it sleeps) carries its answers to the golden prompt
(`supervisor/watchdog/golden.py`), and after an engine's warm-up sleep and wake its
answers once woken too; a KV reset's (`RemedyDone`) its answers after its wake.
`GoldenCheck` owns the unit's baselines, one per set
of arguments that change what an engine answers: the first proven answer records it
(audit `golden_recorded`; an upgrade's new arguments take a new one, said in the log),
and every later one is compared. Answers taken while other clients shared the engine's
batch (every try) are no verdict unless they match. A mismatch turns the proof into a
failed one, with the evidence (expected against got) in the audit (`golden_mismatch`):
a standby that fails it is not swapped in, a woken one is a failed takeover, and the
unit restarts a serving engine once and then holds it down
(`supervisor/engine/pair/serving.py`, `proved`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import structlog

from supervisor.engine.events import GateProbe, RemedyDone
from supervisor.engine.process import process as eng
from supervisor.watchdog import golden

log = structlog.get_logger("supervisor")


class GoldenCheck:
    def __init__(self, audit: Callable[..., None]) -> None:
        self._audit = audit
        self.baselines: dict[tuple[str, ...], golden.Golden] = {}
        self.passed = 0
        self.mismatches = 0
        self.last: dict[str, Any] | None = None  # the last verdict, for `status`

    def judge(self, ev: GateProbe, engine: eng.EngineProcess | None,
              tolerance: float) -> GateProbe:
        """The proof as it stands after the golden check: unchanged, or failed with
        why (and `golden_mismatch` set)."""
        if not ev.ok or engine is None:
            return ev
        for got, when in ((ev.golden, ""), (ev.golden_woken, " after its wake")):
            # (after the warm-up's sleep and wake: the first answers are its baseline)
            why = self.verdict(got, engine, tolerance, when)
            if why is not None:
                return dataclasses.replace(ev, ok=False, error=f"golden check failed: {why}",
                                           golden_mismatch=True,
                                           broken_by_wake=ev.broken_by_wake or bool(when))
        return ev

    def judge_remedy(self, ev: RemedyDone, engine: eng.EngineProcess | None,
                     tolerance: float) -> RemedyDone:
        """A KV reset's answers after its wake or its resume, against the engine's
        baseline: a mismatch fails the remedy (the unit restarts the engine)."""
        o = ev.outcome
        if not o.ok or engine is None:
            return ev
        why = self.verdict(ev.golden, engine, tolerance, " after the KV reset's wake"
                           if "wake_up" in o.steps else " after the KV reset")
        if why is None:
            return ev
        return dataclasses.replace(ev, outcome=dataclasses.replace(
            o, ok=False, error=f"golden check failed: {why}"))

    def verdict(self, got: golden.Golden | str | None, engine: eng.EngineProcess,
                tolerance: float, when: str) -> str | None:
        """Why these answers do not match the engine's baseline (said in the log and the
        audit), or None: they match, are the first (recorded), or give no verdict."""
        if got is None:
            return None
        if isinstance(got, str):  # (no verdict: the canary passed)
            self._note("unavailable", engine, why=got)
            return None
        key = golden.baseline_key(engine.spec.argv)
        want = self.baselines.get(key)
        why = golden.compare(want, got, tolerance) if want is not None else None
        if got.shared and (want is None or why is not None):
            # (another client's requests shared every try's batch: such answers may
            # differ from a lone one's, so they neither record nor condemn)
            self._note("unavailable", engine, why=(
                f"the engine served other clients' requests while it answered, "
                f"{got.asked} times ({got.shared} tokens of theirs the last)"))
            log.warning("golden check: no verdict, the engine was not asked alone",
                        pid=engine.pid, shared_tokens=got.shared)
            return None
        if want is None and got.routes != golden.ROUTES:
            # (after a wake one route is asked: a baseline takes both, at a proof that
            # asks both, so that the chat route is compared from then on)
            self._note("unavailable", engine, why=(
                "no baseline yet, and these answers are one route's (after a wake): "
                "the next proof that asks both records it"))
            return None
        if want is None:
            self.baselines[key] = got
            if len(self.baselines) > 1:
                log.info("golden check: a new baseline for new engine arguments",
                         pid=engine.pid)
            self._audit("golden_recorded", pid=engine.pid, **got.doc())
            self._note("recorded", engine)
            return None
        diff = round(golden.largest_difference(want, got), 6)
        if why is None:
            self.passed += 1
            if got.asked > 1:
                log.info("golden check: asked again while other clients' requests shared "
                         "the engine's batch", pid=engine.pid, asked=got.asked)
            self._note("ok", engine, largest_logprob_difference=diff, asked=got.asked,
                       **({"acceptance": round(got.acceptance, 4),
                           "baseline_acceptance": round(want.acceptance, 4)}
                          if got.acceptance is not None and want.acceptance is not None
                          else {}))
            return None
        self.mismatches += 1
        why += when
        log.error("golden check failed: the engine answers, but not as it did",
                  pid=engine.pid, why=why)
        self._audit("golden_mismatch", pid=engine.pid, why=why, tolerance=tolerance,
                    expected=want.doc(), got=got.doc())
        self._note("mismatch", engine, why=why, largest_logprob_difference=diff)
        return why

    def _note(self, verdict: str, engine: eng.EngineProcess, **fields: Any) -> None:
        self.last = {"verdict": verdict, "pid": engine.pid, **fields}

    def status(self) -> dict[str, Any]:
        return {"baselines": len(self.baselines), "passed": self.passed,
                "mismatches": self.mismatches, "last": self.last}
