"""The engine and its weight cache (`engine.weight_cache`) as a Hypothesis state machine:
events fed in any order the world allows, over the recording effects and the driven clock
of tests/unit_world.py, with no process.

The world is read from the effects log: a spawn asked and not yet answered, a process
spawned and not yet taken down (its health, its exit), the take-downs asked and not yet
answered, the timers set and not cancelled. A rule feeds only what that world could
report now: a pending spawn completes or fails, a live cache answers its health (or not
in time) or loses it, a live engine answers its health, any live process exits unasked,
a take-down ends (its tree proven gone, or not), a timer fires; and the operator
restarts, reloads (the cache off, on, or with other weights) and stops.

After every step:
- never two cache processes (live or being spawned), never two engines;
- an engine is spawned only while its cache is neither starting nor being taken down,
  and with `--load-format ipc_cache` exactly when its cache was ready and alive then;
- STOPPED only with nothing spawned left and nothing being spawned;
- the unit never raises.
At the end of every run a stop, with every pending effect answered well and every timer
fired, ends STOPPED with nothing left running.
"""

from __future__ import annotations

import shutil
import tempfile
from collections import deque
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from supervisor.engine.events import Down, Exited, HealthLost, HealthResult, Reloaded, Spawned
from supervisor.engine.pair.pair_states import CACHE_BAYS, Cache
from supervisor.engine.process.process import EngineProcess, SpawnSpec
from supervisor.engine.process.proctree import ProcInfo
from supervisor.engine.process.takedown import TakeDown
from supervisor.engine.unit import EngineUnit
from supervisor.settings.config import parse_config
from tests.hypothesis_profiles import examples
from tests.unit_world import RecordingEffects, World

CACHE_BAY = 2


class CheckingEffects(RecordingEffects):
    """Records, and at each engine spawn checks it against its cache's state then."""

    def __init__(self) -> None:
        super().__init__()
        self.unit: EngineUnit | None = None
        self.problems: list[str] = []

    def spawn(self, generation: int, spec: SpawnSpec, cfg: Any, bay: int) -> None:
        super().spawn(generation, spec, cfg, bay)
        if bay == CACHE_BAY or self.unit is None:
            return
        wc = self.unit.weights
        if wc.configured and wc.state in (Cache.STARTING, Cache.STOPPING) and bay == 0:
            self.problems.append(f"an engine spawned while its cache was {wc.state.value}")
        cache = wc.slot.engine
        ready = (wc.state is Cache.READY and cache is not None and cache.exit_code is None
                 and not wc.slot.taking_down)
        if bool(spec.load) != ready:
            self.problems.append(f"an engine spawned with load {spec.load!r} while its "
                                 f"cache was {wc.state.value}")


class CacheMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.tmp = Path(tempfile.mkdtemp(prefix="wcm", dir="/tmp"))
        self.w = World(self.tmp, engine={"weight_cache": True},
                       daemon={"runtime_dir": str(self.tmp)})
        self.fx = CheckingEffects()
        self.w.fx = self.fx
        self.w.sup = EngineUnit(config=self.w.sup.config, notifier=self.w.sup.notifier,
                                gpu=self.w.sup.gpu, clock=self.w.sup.clock, environ={},
                                effects=self.fx)
        self.fx.unit = self.w.sup
        self.seen = 0  # effects read so far
        self.pending: dict[int, dict[str, Any]] = {}  # spawns asked, not answered
        self.live: dict[int, EngineProcess] = {}  # spawned, not down (by generation)
        self.downs: set[int] = set()  # take-downs asked (by generation), not answered
        self.stopped_asked = False
        self.variant = 0  # a reload's other weights: --dtype of this number
        self.w.sup.start("daemon started")
        self._read()

    def teardown(self) -> None:
        try:
            self.finish()
        finally:
            self.w.loop.close()
            shutil.rmtree(self.tmp, ignore_errors=True)

    # ---- the world, from the effects log ---------------------------------------------

    def _read(self) -> None:
        by_pid = {p.pid: g for g, p in self.live.items()}
        for name, d in self.fx.calls[self.seen:]:
            if name == "spawn":
                self.pending[d["generation"]] = d
            elif name == "take_down":
                self.downs.add(by_pid[d["pid"]])
        self.seen = len(self.fx.calls)

    def feed(self, ev: Any) -> None:
        self.w.feed(ev)
        self._read()

    def _of(self, bay: int) -> list[int]:
        return sorted(g for g, p in self.live.items() if p.bay == bay)

    # ---- rules ----------------------------------------------------------------------

    @precondition(lambda self: self.pending)
    @rule(ok=st.booleans(), data=st.data())
    def a_spawn_ends(self, ok: bool, data: st.DataObject) -> None:
        gen = data.draw(st.sampled_from(sorted(self.pending)))
        if not ok:
            self.pending.pop(gen)
            self.feed(Spawned(gen, None, "no such file"))
            return
        self._spawned(gen)

    @precondition(lambda self: any(p.healthy_at is None and g not in self.downs
                                   for g, p in self.live.items()))
    @rule(healthy=st.booleans(), data=st.data())
    def a_process_answers_its_health(self, healthy: bool, data: st.DataObject) -> None:
        gen = data.draw(st.sampled_from(sorted(
            g for g, p in self.live.items() if p.healthy_at is None and g not in self.downs)))
        self.w.now += 5
        if healthy:
            self.live[gen].healthy_at = self.w.now
        self.feed(HealthResult(gen, healthy))

    @precondition(lambda self: any(p.exit_code is None for p in self.live.values()))
    @rule(data=st.data())
    def a_process_exits_unasked(self, data: st.DataObject) -> None:
        gen = data.draw(st.sampled_from(sorted(
            g for g, p in self.live.items() if p.exit_code is None)))
        self.live[gen].exit_code = 1
        self.feed(Exited(gen, 1))

    @precondition(lambda self: any(p.healthy_at is not None and p.exit_code is None
                                   for p in (self.live[g] for g in self._of(CACHE_BAY))))
    @rule()
    def the_cache_loses_its_health(self) -> None:
        gen = self._of(CACHE_BAY)[-1]
        self.feed(HealthLost(gen, "/health answered 503 (3 times in a row)"))

    @precondition(lambda self: self.downs)
    @rule(proven=st.sampled_from([True, True, True, False]), data=st.data())
    def a_take_down_ends(self, proven: bool, data: st.DataObject) -> None:
        gen = data.draw(st.sampled_from(sorted(self.downs)))
        self.downs.discard(gen)
        p = self.live.pop(gen)
        p.exit_code = p.exit_code if p.exit_code is not None else -15
        survivors = [] if proven else [ProcInfo(p.pid + 100000, 1.0)]
        self.feed(Down(gen, TakeDown(exit_code=p.exit_code, survivors=survivors,
                                     gpu_holders={}, port_problem=None, duration_s=0.1,
                                     sigkilled=False)))

    @precondition(lambda self: any(not t.cancelled for t in self.fx.timers))
    @rule(data=st.data())
    def a_timer_fires(self, data: st.DataObject) -> None:
        timers = [t for t in self.fx.timers if not t.cancelled]
        t = data.draw(st.sampled_from(timers))
        t.cancelled = True  # (fired: once)
        self.w.now += t.delay_s
        self.feed(t.event)

    @precondition(lambda self: not self.stopped_asked)
    @rule()
    def the_operator_restarts(self) -> None:
        self.w.control("restart")  # (refused now and then: answered to the operator)
        self._read()

    @precondition(lambda self: not self.stopped_asked)
    @rule(what=st.sampled_from(["off", "on", "other weights"]))
    def a_reload(self, what: str) -> None:
        engine = dict(self.w.doc["engine"])
        if what == "off":
            engine["weight_cache"] = False
        else:
            engine["weight_cache"] = True
            if what == "other weights":
                self.variant += 1
                engine["args"] = ["--dtype", f"float{self.variant}"]
        self.w.doc = {**self.w.doc, "engine": engine}
        new = parse_config(self.w.doc, str(self.tmp / "config.toml"), self.tmp)
        self.feed(Reloaded(new, None, None))

    @precondition(lambda self: not self.stopped_asked)
    @rule()
    def a_stop(self) -> None:
        self.stopped_asked = True
        self.w.control("stop")
        self._read()

    @rule()
    def time_passes(self) -> None:
        self.w.now += 1

    # ---- invariants -----------------------------------------------------------------

    @invariant()
    def nothing_checked_at_a_spawn_went_wrong(self) -> None:
        assert self.fx.problems == []

    @invariant()
    def never_two_caches_nor_two_engines(self) -> None:
        for bay in (0, CACHE_BAY):
            here = [g for g, d in self.pending.items() if d["bay"] == bay] + self._of(bay)
            assert len(here) <= 1, (bay, here)

    @invariant()
    def the_cache_and_its_bay_agree(self) -> None:
        cache = self.w.sup.weights
        assert cache.slot.phase in CACHE_BAYS[cache.state], (cache.state, cache.slot.phase)

    @invariant()
    def stopped_only_with_nothing_left(self) -> None:
        if self.w.state == "STOPPED":
            assert self.stopped_asked and not self.live and not self.pending
            assert self.w.sup.weights.state in (Cache.OFF, Cache.FAILED)

    def settle(self) -> None:
        """Every pending effect answered well, every process healthy, every timer fired."""
        for _ in range(200):
            if self.pending:
                self._spawned(sorted(self.pending)[0])
            elif self.downs:
                gen = sorted(self.downs)[0]
                self.downs.discard(gen)
                self.live.pop(gen)
                self.feed(Down(gen, TakeDown(exit_code=0, survivors=[], gpu_holders={},
                                             port_problem=None, duration_s=0.1,
                                             sigkilled=False)))
            elif unhealthy := [g for g, p in self.live.items() if p.healthy_at is None]:
                self.live[unhealthy[0]].healthy_at = self.w.now
                self.feed(HealthResult(unhealthy[0], True))
            elif timers := [t for t in self.fx.timers if not t.cancelled]:
                timers[0].cancelled = True
                self.w.now += timers[0].delay_s
                self.feed(timers[0].event)
            else:
                return

    def _spawned(self, gen: int) -> None:
        d = self.pending.pop(gen)
        self.w.next_pid += 1
        p = EngineProcess(generation=gen, proc=None,  # type: ignore[arg-type]
                          pid=self.w.next_pid, started_at=self.w.now, spec=d["spec"],
                          config=d["cfg"], recent_errors=deque(maxlen=20),
                          known=[ProcInfo(self.w.next_pid, 1.0)], bay=d["bay"])
        self.live[gen] = p
        self.feed(Spawned(gen, p))

    def finish(self) -> None:
        """Everything answered well: at rest, a cache the engine has (and that was not
        given up) is ready; then a stop ends STOPPED with nothing left."""
        self.settle()
        wc = self.w.sup.weights
        if not self.stopped_asked and wc.configured:
            assert wc.state in (Cache.READY, Cache.FAILED), wc.state
        if not self.stopped_asked:
            self.a_stop()
        for _ in range(100):
            if self.w.state == "STOPPED":
                break
            if self.pending:
                gen = sorted(self.pending)[0]
                d = self.pending.pop(gen)
                self.w.next_pid += 1
                p = EngineProcess(generation=gen, proc=None,  # type: ignore[arg-type]
                                  pid=self.w.next_pid, started_at=self.w.now,
                                  spec=d["spec"], config=d["cfg"],
                                  recent_errors=deque(maxlen=20),
                                  known=[ProcInfo(self.w.next_pid, 1.0)], bay=d["bay"])
                self.live[gen] = p
                self.feed(Spawned(gen, p))
            elif self.downs:
                gen = sorted(self.downs)[0]
                self.downs.discard(gen)
                p = self.live.pop(gen)
                self.feed(Down(gen, TakeDown(exit_code=0, survivors=[], gpu_holders={},
                                             port_problem=None, duration_s=0.1,
                                             sigkilled=False)))
            elif any(not t.cancelled for t in self.fx.timers):
                t = next(t for t in self.fx.timers if not t.cancelled)
                t.cancelled = True
                self.feed(t.event)
            else:
                break
        assert self.w.state == "STOPPED", (self.w.state, self.w.sup.weights.state,
                                           self.live, self.pending, self.downs)
        assert not self.live or all(g in self.downs for g in self.live)


CacheMachine.TestCase.settings = settings(
    max_examples=examples(150), stateful_step_count=30, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])


TestCache = CacheMachine.TestCase

