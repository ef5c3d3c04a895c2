"""The daemon's own requests to an engine: canaries and golden answers (owned here).

Each engine has one probe lock: a canary, the golden answers, the warm-up's sleep and
wake, the sleep-mode probe and a KV reset take it, so that none of the daemon's own
generations runs beside a KV reset (they would be engine traffic its drain waits for)
or reads a sleeping engine. The count of the daemon's generations in flight at each
engine is read by the unit (its own requests are not the clients').

A periodic canary is the daemon's alone: a KV reset that begins while one is in flight
cuts it (its request closed: vLLM aborts it) rather than wait for it, which under a
full batch waits for a stream to end first (up to 1.4 s on the H100, issue 35). A cut
canary has no outcome: no failure, no pass.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Coroutine
from typing import Any

import httpx

from supervisor.engine.process import process as eng
from supervisor.loop import Clock
from supervisor.ops.descriptors import OutOfDescriptors
from supervisor.settings.config import Config
from supervisor.watchdog import canary, golden, warmup


class EngineProbes:
    def __init__(self, config: Callable[[], Config], clock: Clock) -> None:
        self.config, self.clock = config, clock
        self._locks: dict[int, asyncio.Lock] = {}
        self._in_flight: dict[int, int] = {}  # the daemon's own generations at each engine
        self._cuts: dict[int, asyncio.Event] = {}  # a periodic canary's, while in flight

    def lock(self, engine: eng.EngineProcess) -> asyncio.Lock:
        return self._locks.setdefault(engine.generation, asyncio.Lock())

    def in_flight(self) -> int:
        return sum(self._in_flight.values())

    def forget(self, engine: eng.EngineProcess) -> None:
        self._locks.pop(engine.generation, None)
        self._in_flight.pop(engine.generation, None)
        self._cuts.pop(engine.generation, None)

    def cut_canary(self, engine: eng.EngineProcess) -> bool:
        """Ends the periodic canary in flight at this engine, if one is; whether one was."""
        cut = self._cuts.get(engine.generation)
        if cut is None:
            return False
        cut.set()
        return True

    async def probe(self, client: httpx.AsyncClient, engine: eng.EngineProcess,
                    model: str | None) -> tuple[str | None, float, canary.CanaryOutcome]:
        """One canary (the model asked for, when it began, its outcome), never beside a
        KV reset of its engine."""
        model, t0, outcome = await self._probe(client, engine, model, cuttable=False)
        assert outcome is not None  # (only a cuttable one has none)
        return model, t0, outcome

    async def periodic(self, client: httpx.AsyncClient, engine: eng.EngineProcess,
                       model: str | None
                       ) -> tuple[str | None, float, canary.CanaryOutcome | None]:
        """The periodic canary: as `probe`, but a KV reset may cut it, and then it has
        no outcome (None)."""
        return await self._probe(client, engine, model, cuttable=True)

    async def _probe(self, client: httpx.AsyncClient, engine: eng.EngineProcess,
                     model: str | None, cuttable: bool
                     ) -> tuple[str | None, float, canary.CanaryOutcome | None]:
        cfg = self.config().canary
        base = engine.config.base_url
        async with self.lock(engine):
            t0 = self.clock.monotonic()
            model = model or cfg.model or await canary.find_model(client, base, cfg.timeout_s)
            if model is None:
                return None, t0, canary.CanaryOutcome(False, self.clock.monotonic() - t0,
                                                      "/v1/models named no model")
            gen = engine.generation
            self._in_flight[gen] = self._in_flight.get(gen, 0) + 1  # (read by the unit)
            asked = canary.probe(client, base, model, cfg.prompt, cfg.max_tokens,
                                 cfg.timeout_s)
            try:
                if not cuttable:
                    return model, t0, await asked
                return model, t0, await self._unless_cut(gen, asked)
            finally:
                self._in_flight[gen] = self._in_flight.get(gen, 1) - 1

    async def _unless_cut(self, gen: int, asked: Coroutine[Any, Any, canary.CanaryOutcome]
                          ) -> canary.CanaryOutcome | None:
        cut = self._cuts[gen] = asyncio.Event()
        probe = asyncio.ensure_future(asked)
        stop = asyncio.ensure_future(cut.wait())
        try:
            await asyncio.wait((probe, stop), return_when=asyncio.FIRST_COMPLETED)
        finally:
            self._cuts.pop(gen, None)
            for t in (probe, stop):
                if not t.done():
                    t.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await t
        return None if probe.cancelled() else probe.result()

    async def warm(self, client: httpx.AsyncClient, engine: eng.EngineProcess
                   ) -> warmup.Warmed:
        """Every path a client may take, asked once (`watchdog/warmup.py`), counted
        among the daemon's own requests at the engine and never beside a KV reset."""
        cfg = self.config().canary
        base = engine.config.base_url
        async with self.lock(engine):
            model = cfg.model or await canary.find_model(client, base, cfg.timeout_s)
            if model is None:  # (nothing to ask: the canary that follows says so)
                return warmup.Warmed()
            gen = engine.generation
            self._in_flight[gen] = self._in_flight.get(gen, 0) + 1
            try:
                return await warmup.warm(client, base, model, cfg.prompt,
                                         cfg.warm_up_timeout_s, self.clock.monotonic)
            finally:
                self._in_flight[gen] = self._in_flight.get(gen, 1) - 1

    async def answers(self, client: httpx.AsyncClient, engine: eng.EngineProcess,
                      model: str | None, after_wake: bool = False
                      ) -> golden.Golden | str | None:
        """The engine's answers to the golden prompt (the unit judges them), when the
        check is on; never beside a KV reset of its engine. `after_wake`: the
        completions route's alone (`golden.AFTER_WAKE`)."""
        if not self.config().canary.golden:
            return None
        async with self.lock(engine):
            return await self.golden_unlocked(client, engine, model, after_wake)

    async def golden_unlocked(self, client: httpx.AsyncClient, engine: eng.EngineProcess,
                              model: str | None = None, after_wake: bool = False
                              ) -> golden.Golden | str | None:
        """(the caller holds the engine's probe lock)"""
        cfg = self.config().canary
        base = engine.config.base_url
        try:
            model = model or cfg.model or await canary.find_model(client, base, cfg.timeout_s)
            if model is None:
                return "no golden check: /v1/models named no model"
            # (its /metrics read before and after: another client's tokens meanwhile
            # mean the answers shared a batch, asked again; and drafts to count)
            return await golden.fetch(client, base, model, cfg.golden_prompt,
                                      cfg.golden_tokens, max(cfg.timeout_s, 5.0),
                                      drafts=golden.speculative(engine.spec.argv),
                                      routes=golden.AFTER_WAKE if after_wake
                                      else golden.ROUTES)
        except OutOfDescriptors as exc:  # (no verdict: the daemon could not ask)
            return f"no golden check: {exc}"
