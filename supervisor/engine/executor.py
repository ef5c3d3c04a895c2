"""The engine unit's one executor: the steps its deciders return, carried out in order.

The deciders (`Handover`, `Failures`, `Remedies`, the restart decider, the roles in the
bays: `Standby`, `WeightCache`) read the unit's state and return steps
(`supervisor/engine/steps.py`); the unit hands them here (`UnitState.run_steps`). Each
step goes to the one unit method, effect or decider that owns what it changes; a step
that is another decider's (`Fail`, `GiveUp`, `Abandon`, `Upgrade`, `FailOver`...) asks
that decider with the unit's state as it is then. The executor owns the roles' timers
(by name: the standby's backoff, the weight cache's) and finds a slot by its bay number,
whichever role holds it.
"""

from __future__ import annotations

from typing import Any, Protocol

import structlog

from supervisor.engine import steps as do
from supervisor.engine.effects.protocol import Effects, Timer
from supervisor.engine.events import DecisionRecord
from supervisor.engine.failures import Failures
from supervisor.engine.gatekeeper import GateKeeper
from supervisor.engine.intents import RelaunchLog, remedy_ended
from supervisor.engine.notices import SystemdNotices
from supervisor.engine.pair.handover import Handover
from supervisor.engine.pair.slot import EngineSlot
from supervisor.engine.pair.weight_cache import WeightCache
from supervisor.engine.process import process as eng
from supervisor.engine.states import State
from supervisor.engine.steps import PairFacts, Step
from supervisor.front.admission import Gate
from supervisor.loop import Clock
from supervisor.settings.sections import EngineConfig
from supervisor.watchdog import evidence
from supervisor.watchdog.gpu import GpuSampler

log = structlog.get_logger("supervisor")


class Executable(Protocol):
    """What the executor reaches of its unit (`supervisor/engine/unit_state.py`): the
    state it writes, the effects, the deciders it asks again, and the unit's own moves."""

    act: Effects
    clock: Clock
    exit_code: int
    golden_failures: int
    failures: Failures
    gate: Gate
    handover: Handover
    keeper: GateKeeper
    notices: SystemdNotices
    oom_deaths: int
    relaunch: RelaunchLog
    restart_reason: str
    slot: EngineSlot
    bays: dict[int, EngineSlot]  # every place of the unit, by number (settings/bays.py)
    stop_deadline: float | None
    weights: WeightCache

    @property
    def engine(self) -> eng.EngineProcess | None: ...
    def pair_facts(self) -> PairFacts: ...
    def set_state(self, new: State, reason: str) -> None: ...
    def decide(self, action: str, reason: str) -> None: ...
    def decided(self, record: DecisionRecord) -> None: ...
    def audit(self, event: str, **fields: Any) -> None: ...
    def count_restart(self, reason: str) -> None: ...
    def start_engine(self, reason: str) -> None: ...
    def spawn_serving(self) -> None: ...
    def restart_engine(self, reason: str, graceful: bool = True) -> None: ...
    def take_down(self, graceful: bool) -> None: ...
    def take_down_in(self, slot: EngineSlot, graceful: bool, deadline: float) -> None: ...
    def serve_from(self) -> None: ...
    def maybe_finish_stop(self) -> None: ...
    def engine_healthy(self, engine: eng.EngineProcess) -> None: ...
    def sync_gate(self, ended: bool = False) -> None: ...


class Executor:
    def __init__(self, unit: Executable) -> None:
        self._unit = unit
        # the deciders' timers, by name (`do.ArmTimer`): the backoff's, the standby's,
        # the weight cache's
        self._timers: dict[str, Timer] = {}

    # ---- the unit's task: its jobs begun and ended with it ------------------------------

    def begin(self, tick_s: float, sampler: GpuSampler | None) -> None:
        """The unit's task begins: its jobs (ticks, the GPU sampler if any) with it."""
        log.info("engine unit started", **self._unit.act.begin())
        self._unit.act.tick_every(tick_s)
        if sampler is not None:
            self._unit.act.sample_gpu(sampler)

    def kill_now(self, *engines: eng.EngineProcess | None) -> None:
        """The unit's task is failing (a bug): no engine is left without its supervisor."""
        for engine in engines:
            if engine is not None:
                self._unit.act.kill_now(engine)

    async def end(self) -> None:
        """The unit's task ends: its jobs cancelled and waited for, its guards disarmed."""
        await self._unit.act.end()

    def probes_in_flight(self) -> int:
        """The daemon's own requests at the engines now (canaries, proofs)."""
        return self._unit.act.probes_in_flight()

    def run(self, steps: list[Step]) -> None:
        for step in steps:
            self._carry_out(step)

    def bay(self, bay: int) -> EngineSlot:
        """The place numbered `bay`, whichever role holds it now."""
        return self._unit.bays[bay]

    def spawn_in(self, slot: EngineSlot, spec: eng.SpawnSpec, cfg: EngineConfig) -> None:
        """An engine spawned in `slot` (`Spawned` answers)."""
        spec = slot.spawn(spec)
        self._unit.act.spawn(slot.generation, spec, cfg, slot.bay)

    def take_down(self, slot: EngineSlot, graceful: bool,
                  req: evidence.EvidenceRequest | None, deadline: float) -> None:
        """The engine in `slot` taken down, capturing `req` first (`Down` answers)."""
        engine = slot.engine
        assert engine is not None
        slot.take_down(graceful, req)
        self._unit.act.take_down(engine, graceful, slot.force, req, deadline)

    def cancel_timer(self, key: str) -> None:
        timer = self._timers.pop(key, None)
        if timer is not None:
            timer.cancel()

    def _carry_out(self, step: Step) -> None:
        u = self._unit
        match step:
            case do.SetState(state, reason):
                u.set_state(state, reason)
            case do.Decide(action, reason):
                u.decide(action, reason)
            case do.Record(record):
                u.decided(record)
            case do.Audit(event, fields):
                u.audit(event, **fields)
            case do.CountRestart(reason):
                u.count_restart(reason)
            case do.CountOomDeath():
                u.oom_deaths += 1
            case do.StartEngine(reason):
                u.start_engine(reason)
            case do.SpawnServing():
                u.spawn_serving()
            case do.RestartEngine(reason, graceful):
                u.restart_engine(reason, graceful)
            case do.RestartReason(reason):
                u.restart_reason = reason
            case do.RestartFailed(reason):
                self.run(u.failures.restart(u.pair_facts(), reason))
            case do.FailOver(reason, graceful, drain_behind):
                self.run(u.handover.fail_over(u.pair_facts(), reason, graceful,
                                              drain_behind=drain_behind))
            case do.SwapOrTakeDown(graceful):
                self.run(u.handover.swap_or_take_down(u.pair_facts(), graceful))
            case do.Drain(engine, deadline):
                u.act.drain(engine, deadline)
            case do.ForceStop(reason):
                log.warning("second stop request: skipping to SIGKILL", reason=reason)
                u.audit("force_stop", reason=reason)
                u.slot.force.set()
            case do.EndBackoff():
                self.run(u.failures.cancel_backoff())
            case do.NotifyStopping(status):
                u.notices.stopping(status)
            case do.StopDeadline(at):
                if u.stop_deadline is None:
                    u.stop_deadline = at
            case do.EndStopDeadline():
                u.stop_deadline = None
            case do.TakeDown(graceful):
                u.take_down(graceful)
            case do.TakeDownIn(bay, graceful, deadline, evidence):
                slot = self.bay(bay)
                if slot.engine is not None and not slot.taking_down:
                    if evidence:
                        u.take_down_in(slot, graceful, deadline)
                    else:
                        self.take_down(slot, graceful, None, deadline)
            case do.DumpIn(bay, snapshot, made, deadline):
                slot = self.bay(bay)
                engine = slot.engine
                if engine is not None and not slot.taking_down:
                    slot.take_down(False, None)
                    u.act.dump(engine, snapshot, made, deadline)
            case do.Spawn(bay, spec, cfg):
                self.spawn_in(self.bay(bay), spec, cfg)
            case do.WatchProcess(engine):
                u.act.watch(engine)
            case do.Forget(engine):
                u.act.forget(engine)
            case do.Sleep(engine):
                u.act.sleep(engine)
            case do.WatchHealth(engine):
                u.act.watch_health(engine)
            case do.ArmTimer(key, delay_s, event):
                self.cancel_timer(key)
                self._timers[key] = u.act.after(delay_s, event)
            case do.CancelTimer(key):
                self.cancel_timer(key)
            case do.CaptureEvidence(evidence):
                u.slot.capture_at_take_down(evidence)
            case do.ServeFrom():
                u.serve_from()
            case do.ArmStandby():
                self.run(u.handover.arm(u.pair_facts()))
            case do.MaybeFinishStop(failed):
                if failed:
                    u.exit_code = 1
                u.maybe_finish_stop()
            case do.Started():
                u.failures.started()
            case do.StartRefused(why):
                self.run(u.failures.start_refused(u.pair_facts(), why))
            case do.EngineHealthy(engine):
                u.engine_healthy(engine)
            case do.GoldenFailed():
                u.golden_failures += 1
            case do.GoldenPassed():
                u.golden_failures = 0
            case do.HandoverDone():
                self.run(u.handover.done(u.pair_facts()))
            case do.ServingFailed():
                u.handover.serving_failed(u.pair_facts())
            case do.FailedDown(engine, problem):
                self.run(u.failures.down(u.pair_facts(), engine, problem))
            case do.NotifyReady(text):
                u.notices.ready_once(text)
            case do.Fail(reason, healthy_for):
                self.run(u.failures.fail(u.pair_facts(), reason, healthy_for))
            case do.GiveUp(reason, engine):
                self.run(u.failures.give_up(u.pair_facts(), reason, engine))
            case do.Abandon(why, deadline):
                self.run(u.handover.abandon(why, deadline, u.clock.monotonic()))
            case do.Upgrade(why, label, otherwise):
                began = u.handover.begin_upgrade(u.pair_facts(), why, label)
                self.run(list(otherwise) if began is None else began)
            case do.Admit():
                u.keeper.admit()
            case do.Follow(engine):
                u.act.follow(engine)
            case do.Serve(engine):
                u.act.serve(engine)
            case do.ProbeGate(engine, golden, warm, woken, sleeps_later):
                u.act.gate_probe(engine, golden, warm=warm, woken=woken,
                                 sleeps_later=sleeps_later)
            case do.Wake(engine, tags):
                u.act.wake(engine, tags)
            case do.EmptyHostCache(engine):
                u.act.empty_host_cache(engine)
            case do.DrainBehind(engine, deadline):
                u.act.drain_behind(engine, deadline)
            case do.SyncGate():
                u.sync_gate()
            case do.PauseStreams(engine, why):
                paused = u.act.pause_streams(engine)
                log.info("streams paused, to go on after it", during=why, paused=paused)
            case do.StartRemedy(rung, ways):
                assert u.engine is not None
                u.act.remedy(u.engine, rung, ways)
            case do.Throttle(rule, level):
                u.sync_gate()  # live at the proxy: in force at once
                remedy_ended(u.audit, {
                    "rung": "throttle", "outcome": "ok", "duration_s": 0.0, "rule": rule,
                    "throttle_level": level, "max_concurrency": u.gate.concurrency_limit})
            case do.RelaunchBegin(rung, reason):
                u.relaunch.begin(rung, reason)
            case do.Relaunch("standby_ready"):
                u.relaunch.standby_ready()
            case do.Relaunch("taken_down"):
                u.relaunch.taken_down()
            case do.Relaunch("down"):
                u.relaunch.down()
            case do.RelaunchFinish(outcome, error):
                u.relaunch.finish(outcome, error)
            case _:
                raise AssertionError(f"no executor for step {step!r}")
