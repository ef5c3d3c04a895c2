"""One engine unit's state, and the one executor of the steps that change it.

`UnitState` holds everything the unit owns (`supervisor/engine/unit.py` is the task that
feeds it events): the lifecycle (`set_state`, checked by `supervisor/engine/states.py`),
the serving engine's place (`slot`; a failover's `serve_from` swaps it for the
standby's), the restart's one deadline, the gate's admission (`keeper`), the backoff's
timer, the counts. Its deciders (`Handover`, `Failures`, `Remedies`) read it as
`PairFacts` and return steps (`supervisor/engine/steps.py`); `run_steps` carries them
out, each by the one method here, effect or decider that owns what it changes. So every
piece of the unit's state has one writer: this class.
"""


from __future__ import annotations

import asyncio
import dataclasses
import itertools
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from supervisor.engine import restarts, stops, views
from supervisor.engine.effects.jobs import JobEffects
from supervisor.engine.effects.protocol import Effects, Front
from supervisor.engine.events import (
    CommandError,
    DecisionRecord,
    Event,
    iso_time,
)
from supervisor.engine.executor import Executor
from supervisor.engine.failures import Failures
from supervisor.engine.gatekeeper import GateKeeper
from supervisor.engine.golden_check import GoldenCheck
from supervisor.engine.intents import Intent, RelaunchLog
from supervisor.engine.notices import SystemdNotices
from supervisor.engine.pair import rearm
from supervisor.engine.pair.handover import Handover
from supervisor.engine.pair.slot import EngineSlot
from supervisor.engine.pair.standby import Standby
from supervisor.engine.pair.weight_cache import WeightCache
from supervisor.engine.process import kv_tier
from supervisor.engine.process import process as eng
from supervisor.engine.remedies import Remedies
from supervisor.engine.startup.start_times import Expected, StartTimes
from supervisor.engine.states import State, check_transition
from supervisor.engine.steps import PairFacts, Step
from supervisor.engine.watch import EngineWatch, UnitFacts
from supervisor.front.admission import Gate, GateLimits
from supervisor.loop import Clock
from supervisor.ops.audit import AuditTrail
from supervisor.ops.logs import set_level
from supervisor.ops.sdnotify import Notifier
from supervisor.settings import engine_checks
from supervisor.settings.bays import ENGINE_BAYS, WEIGHT_CACHE_BAY
from supervisor.settings.config import DEFAULT_ENGINE, Config
from supervisor.settings.sections import EngineConfig
from supervisor.watchdog import relaunch
from supervisor.watchdog.gpu import GpuProcessLister, GpuSampler

log = structlog.get_logger("supervisor")




@dataclass
class UnitState:
    config: Config
    notifier: Notifier
    gpu: GpuProcessLister
    sampler: GpuSampler | None = None  # NVML or scripted readings; None: no GPU signals
    clock: Clock = field(default_factory=Clock)
    environ: dict[str, str] = field(default_factory=lambda: dict(os.environ))
    tick_interval_s: float = 1.0
    effects: Effects | None = None  # None: the daemon's own jobs (JobEffects)
    name: str = DEFAULT_ENGINE  # the engine's name ([engines.NAME]; "default" for [engine])
    # the processes of the host's other engines: on a shared GPU, their memory is expected
    siblings: Callable[[], set[int]] = field(default=lambda: set())
    # the front proxy, when [proxy] is on: reached only through the effects
    front: Front | None = None
    # a front proxy holds this engine's requests (tests with recording effects say so)
    fronted: bool = False

    def __post_init__(self) -> None:
        self.fronted = self.fronted or self.front is not None
        self.queue: asyncio.Queue[Event] = asyncio.Queue()
        self.gate = Gate(self._gate_limits())  # this engine's admission, at the proxy
        # every process, socket and timer this task sets going goes through `act`
        self.act: Effects = self.effects if self.effects is not None else JobEffects(
            queue=self.queue, config=lambda: self.config, clock=self.clock,
            environ=self.environ, gpu=self.gpu, siblings=self.siblings, gate=self.gate,
            front=self.front, name=self.name)
        self.state = State.STOPPED
        self.state_reason = "not started"
        self.state_since = self.clock.monotonic()
        self.started_at = self.clock.monotonic()
        self.not_running_since: float | None = self.started_at  # None while RUNNING
        self.last_start_s: float | None = None  # the last cold start: spawn to healthy
        self.kv_tier = kv_tier.Record()  # its KV tier folder, as its keeper last saw it
        # past starts' lengths, kept beside the audit trail (engine/startup/start_times.py)
        self.start_times = StartTimes(Path(self.config.audit.path).parent / (
            "start-times.json" if self.name == DEFAULT_ENGINE
            else f"start-times-{self.name}.json"))
        self.audit_trail = AuditTrail(self.config.audit.path, self.config.audit.max_bytes,
                                      self.config.audit.backups)
        self.watch = EngineWatch(self.config, self.environ, self.clock.monotonic,
                                 self.clock.wall, self.audit)
        generations = itertools.count(1)
        # the weight cache beside the engines, when it has one (engine/pair/weight_cache.py),
        # which says how each engine spawned gets its weights
        self.weights = WeightCache(self.audit, self.clock, EngineSlot(
            self.audit, lambda: next(generations), bay=WEIGHT_CACHE_BAY,
            what="weight cache"), self.config.restart)
        # the unit's places (settings/bays.py), by number: the roles below hold them
        self.bays: dict[int, EngineSlot] = {WEIGHT_CACHE_BAY: self.weights.slot, **{
            b: EngineSlot(self.audit, lambda: next(generations), bay=b,
                          load=self.weights.load) for b in ENGINE_BAYS}}
        serving, standby = ENGINE_BAYS
        # the serving engine's place, from spawn to reap
        self.slot = self.bays[serving]
        # the standby and every handover to it (engine/pair/handover.py)
        self.handover = Handover(Standby(self.audit, self.clock.monotonic,
                                         self.bays[standby]))
        # the golden check's baselines and verdicts (engine/golden_check.py)
        # the one executor of the deciders' steps (engine/executor.py)
        self.executor = Executor(self)
        self.golden = GoldenCheck(self.audit)
        self.golden_failures = 0  # the serving engine's proofs in a row that failed it
        self.serving_starts = 0  # engines that took the serving place (cold or failover)
        self.last_decision: DecisionRecord | None = None  # the latest, lifecycle steps included
        self.exit_code = 0
        self.restarts_by_reason: dict[str, int] = {}
        # its engines (either role) that died unasked while the kernel's OOM killer ran
        self.oom_deaths = 0
        # the backoff after a failure, a start refused, giving up (engine/failures.py)
        self.failures = Failures(self.config.restart)
        # a restart or stop under way ends by this (monotonic); None: none under way
        self.stop_deadline: float | None = None
        self.keeper = GateKeeper(self.gate, self.audit)  # opens, holds, closes the gate
        self.restart_reason = ""
        self.notices = SystemdNotices(self.notifier)
        self._stop_replies: list[asyncio.Future[dict[str, Any]]] = []
        # a relaunch the policy chose, audited once when it ends
        self.relaunch = RelaunchLog(self.audit, self.clock.monotonic,
                                    lambda: self.gate.waiting if self.fronted else None)
        # what the watchdog asks, carried out (engine/remedies.py)
        self.remedies = Remedies()
        self._done = False

    def set_state(self, new: State, reason: str) -> None:
        old = self.state
        check_transition(old, new)
        self.state = new
        self.state_reason = reason
        self.state_since = self.clock.monotonic()
        if new is State.RUNNING:
            self.not_running_since = None
        elif self.not_running_since is None:
            self.not_running_since = self.state_since
        pid = self.engine.pid if self.engine else None
        log.info("state change", **{"from": old.value, "to": new.value}, reason=reason, pid=pid)
        self.audit("state", **{"from": old.value, "to": new.value}, reason=reason, pid=pid)
        self.notices.status(f"{new.value}: {reason}")

    def decide(self, action: str, reason: str) -> None:
        self.decided(DecisionRecord(action, reason, self.clock.wall()))

    def decided(self, record: DecisionRecord) -> None:
        """The latest decision: a lifecycle step's, or the policy's with its evidence."""
        self.last_decision = record

    def audit(self, event: str, **fields: Any) -> None:
        """One entry in the audit trail, naming this engine when there are several."""
        if self.config.several:
            fields["engine"] = self.name
        err = self.audit_trail.append({"time": iso_time(self.clock.wall()), "event": event,
                                       **fields})
        if err is not None:
            log.warning("audit write failed", error=err)

    def expected_start(self) -> Expected | None:
        """While the serving engine starts: what its past starts say of this one (None
        once its core said it failed to start: no ETA for a start that is lost)."""
        e = self.engine
        if (self.state is not State.STARTING or e is None or e.healthy_at is not None
                or e.boot_failed_at is not None):
            return None
        now = self.clock.monotonic()
        return self.start_times.expect(
            e.spec.command_line, e.vllm_version, now - e.started_at, e.phase,
            now - e.phase_since if e.phase_since is not None else None)

    def sync_gate(self, ended: bool = False) -> None:
        """The gate follows the state (`supervisor/engine/gatekeeper.py`); while the
        engine starts, the gate knows when it is expected (a refusal's Retry-After)."""
        expected = self.expected_start()
        self.gate.ready_at = (self.clock.monotonic() + expected.left_s
                              if expected is not None else None)
        self.keeper.sync(self.state, self.state_reason, self.watch.holds_requests(),
                         self.watch.tuning.throttle_level if self.fronted else 0, ended,
                         suspect=self.watch.suspect(),
                         swap=self.state is State.DRAINING
                         and self.handover.fits(self.pair_facts()))

    def pair_facts(self) -> PairFacts:
        """The unit's state as its deciders read it, now (`supervisor/engine/steps.py`)."""
        evidence_s = self.config.evidence.timeout_s + 1.0 \
            if self.slot.evidence_for is not None and self.config.evidence.enabled else 0.0
        now, serving, standby = self.clock.monotonic(), self.slot.engine, self.handover.standby
        # (the card as NVML last saw it with the serving engine serving, all its memory
        # taken, none of it being released, and the standby as it is now: ready since)
        free = self.watch.window.least_free_bytes(
            now, since=max(serving.healthy_at, standby.since if standby.ready else 0.0)) \
            if serving is not None and serving.healthy_at is not None else None
        return PairFacts(self.state, self.slot.view(), self.config, self.environ, self.fronted,
                         now, self.stop_deadline, self.restart_reason,
                         tuple(self.engine_config(b) for b in ENGINE_BAYS),
                         tuple(self.standby_config(b) for b in ENGINE_BAYS), evidence_s, free)

    def carry_out(self, intents: list[Intent]) -> None:
        """What the watchdog asks (`supervisor/engine/remedies.py`)."""
        self.run_steps(self.remedies.carry_out(intents, self.facts()))

    def begin_remedy(self, rung: str, reason: str,
                     reply: asyncio.Future[dict[str, Any]] | None = None) -> None:
        """An in-place remedy on the serving engine (an operator's: answered at its end)."""
        self.run_steps(self.remedies.begin(self.watch, self.facts(), rung, reason, reply))

    def rearm(self, reason: str) -> str:
        """Protection back now (`pair/rearm.py`): what is done; ValueError: why not."""
        what, steps = rearm.rearm(self.handover, self.pair_facts(), reason)
        self.run_steps(steps)
        return what

    def run_steps(self, steps: list[Step]) -> None:
        """The deciders' steps (`supervisor/engine/steps.py`), carried out in order by the
        unit's one executor (`supervisor/engine/executor.py`)."""
        self.executor.run(steps)

    def facts(self) -> UnitFacts:
        """The unit's state as its watchdog half reads it."""
        return UnitFacts(self.state, self.engine, self.slot.taking_down, self.fronted,
                         self.gate.in_flight + self.executor.probes_in_flight(),
                         proving=self.state is State.RUNNING and not self.keeper.admitting)

    def serving(self) -> bool:
        """Serving: the engine runs and the gate lets requests through."""
        return self.state is State.RUNNING and self.gate.held_reason is None \
            and not self.slot.taking_down

    @property
    def engine(self) -> eng.EngineProcess | None:
        return self.slot.engine

    @property
    def generation(self) -> int:
        return self.slot.generation

    @property
    def taking_down(self) -> bool:
        return self.slot.taking_down

    @property
    def last_exit(self) -> str | None:
        return self.slot.last_exit

    @property
    def drained_by_operator(self) -> bool:
        return self.keeper.drained_by_operator

    @property
    def state_value(self) -> str:
        return self.state.value

    def start_engine(self, reason: str) -> None:
        self.watch.engine_starting()
        self.keeper.hold_until_proven()
        self.relaunch.starting()
        self.serving_starts += 1
        self.set_state(State.STARTING, reason)
        self.run_steps(self.handover.cold_start(self.pair_facts()))
        self.sync_capacity()
        self.decide("start", reason)
        first, steps = self.handover.start_first(self.pair_facts())
        self.run_steps(steps)
        if first:
            return
        self.spawn_serving()

    def engine_healthy(self, engine: eng.EngineProcess) -> None:
        """The serving engine answered /health (`EngineHealthy`): its start's length
        kept, what its development routes say a standby so started can do, and where its
        weights came from."""
        self.handover.engine_probed(engine)  # (before a standby is armed)
        now = engine.healthy_at if engine.healthy_at is not None else self.clock.monotonic()
        self.last_start_s = round(now - engine.started_at, 1)
        if self.start_times.cold(engine.spec.command_line, engine.vllm_version):
            log.info("a cold start: the engine runs another vLLM version than at its "
                     "last start", version=engine.vllm_version,
                     start_s=self.last_start_s)
        self.start_times.record(engine.spec.command_line, engine.vllm_version,
                                now - engine.started_at, engine.phases)
        self.weights.engine_started(engine, self.slot.load)

    def spawn_serving(self) -> None:
        if self.weights.holds_start():
            return  # (once the weight cache is ready or has failed: `cache_moved`)
        cfg = self.engine_config(self.slot.bay)
        if cfg.args != self.config.engine.args:
            log.info("engine arguments overridden", overrides=self.watch.overrides(
                self.fronted), throttle_level=self.watch.tuning.throttle_level)
        self.executor.spawn_in(self.slot, eng.build_spawn_spec(cfg, self.environ), cfg)

    def engine_config(self, bay: int) -> EngineConfig:
        """What an engine started now in `bay` runs with: the current config, its place's
        port (`EngineConfig.in_bay`), the watchdog's overrides (throttle, batch,
        speculative tokens)."""
        cfg = self.config.engine.in_bay(bay)
        overrides = self.watch.overrides(self.fronted)
        return dataclasses.replace(cfg, args=relaunch.apply(cfg.args, overrides)) \
            if overrides else cfg

    def standby_config(self, bay: int) -> EngineConfig:
        """What a standby started now in `bay` runs with: `engine_config` with the
        standby's own flags (`engine.standby_args`) in place of the engine's."""
        cfg = self.engine_config(bay)
        if not cfg.standby_args:
            return cfg
        return dataclasses.replace(cfg, args=engine_checks.thinned(cfg.args, cfg.standby_args))

    def serve_from(self) -> None:
        """A failover: the standby's place is the serving one now, and the old one the
        standby's, to be taken down (or kept) there. The restart that led here is over;
        the old engine's take-down has its own deadline."""
        standby = self.handover.standby
        self.slot, standby.slot = standby.slot, self.slot
        if self.state is not State.STARTING:  # (else the cold start it ends counted it)
            self.serving_starts += 1
        self.stop_deadline = None
        self.watch.engine_starting()
        self.keeper.hold_until_proven()
        self.sync_capacity()

    def set_stop_deadline(self, proxy_drain: bool) -> float:
        """The one deadline of the restart or stop beginning now (unless one runs):
        every step of it keeps within what is left (`process.stop_budget_s`)."""
        self.stop_deadline = self.pair_facts().restart_deadline(proxy_drain)
        return self.stop_deadline

    def take_down(self, graceful: bool) -> None:
        deadline = self.set_stop_deadline(proxy_drain=False)
        self.relaunch.taken_down()
        self.take_down_in(self.slot, graceful, deadline)

    def take_down_in(self, slot: EngineSlot, graceful: bool, deadline: float) -> None:
        """Take the engine in `slot` down, with the evidence its fault asked for."""
        req = slot.evidence_request(
            self.config.evidence.enabled,
            self.watch.signals(self.clock.monotonic(), slot.engine),
            self.watch.window.gpu_snapshot(), self.clock.wall())
        self.executor.take_down(slot, graceful, req, deadline)

    def begin_stop(self, reason: str,
                   reply: asyncio.Future[dict[str, Any]] | None = None) -> None:
        """A stop: the daemon ends once its engines are down (answering `reply` then); a
        second one skips to the SIGKILL."""
        if reply is not None:
            self._stop_replies.append(reply)
        self.run_steps(stops.stop(self.pair_facts(), reason, self.slot.force.is_set()))

    def maybe_finish_stop(self) -> None:
        """STOPPED once both places are empty (the serving engine's, the standby's), and
        then the weight cache's: it goes last."""
        if self.engine is None and not self.slot.spawning and self.handover.standby.idle:
            gone, steps = self.weights.down_last()
            self.run_steps(steps)
            if gone:
                self._finish_stop()

    def cache_moved(self) -> None:
        """The weight cache's state may have changed: a stop waiting for it may end, a
        start held while it started goes on (from disk, if it failed)."""
        if self.state is State.STOPPING:
            self.maybe_finish_stop()
        elif self.weights.release_start() and self.state is State.STARTING \
                and self.engine is None and not self.slot.spawning:
            self.spawn_serving()

    def _finish_stop(self) -> None:
        if self.weights.unproven is not None:
            self.exit_code = 1
        self.set_state(State.STOPPED, "engine stopped")
        self.remedies.abandon("the engine was stopped")
        for reply in self._stop_replies:
            if not reply.done():
                reply.set_result({"state": State.STOPPED.value, "exit_code": self.exit_code})
        self._done = True

    def restart_engine(self, reason: str, graceful: bool = True) -> None:
        """A restart of the serving engine (`supervisor/engine/restarts.py` decides its
        steps); CommandError: it cannot begin now, and why."""
        f = self.pair_facts()
        try:
            steps = restarts.restart(f, reason, graceful, self.gate.in_flight,
                                     self.handover.swaps_at_once(f))
        except restarts.RestartRefused as exc:
            raise CommandError(str(exc)) from None
        self.run_steps(steps)

    @property
    def restarts(self) -> int:
        return max(0, self.serving_starts - 1)

    def pids(self) -> set[int]:
        """Every process of this unit's engines (both places)."""
        return {p.pid for s in (self.slot, self.handover.standby.slot)
                if s.engine is not None for p in s.engine.known} | self.weights.pids()

    def count_restart(self, reason: str) -> None:
        self.restarts_by_reason[reason] = self.restarts_by_reason.get(reason, 0) + 1

    def _gate_limits(self, capacity: int | None = None) -> GateLimits:
        """The gate's limits from the config; `capacity`: the serving engine's KV cache
        in tokens where it bounds the token budget (`sync_capacity`)."""
        p = self.config.proxy
        tokens = p.max_tokens_in_flight
        if capacity:
            tokens = min(tokens, capacity) if tokens else capacity
        return GateLimits(concurrency=p.max_concurrency, tokens=tokens,
                          level_factors=tuple(self.config.throttle.level_factors),
                          queue_max=p.hold_queue_max, max_wait_s=p.hold_timeout_s,
                          kv_high=p.kv_breaker_high, kv_low=p.kv_breaker_low)

    @property
    def thin_serves(self) -> bool:
        """The serving engine is an asymmetric pair's thin standby (its spawn says so)."""
        return self.slot.thin

    def capacity(self) -> int | None:
        """While the thin standby of an asymmetric pair serves: its KV cache in tokens,
        as its core said at its start (None otherwise, or where it did not say)."""
        e = self.slot.engine
        return e.kv_tokens if self.thin_serves and e is not None else None

    def sync_capacity(self) -> None:
        """The gate's token budget follows the engine that serves (issue 51). While a
        thin standby serves, at most its KV cache's tokens are in flight at it: what it
        cannot hold waits at the gate, continued streams first and every wait bounded
        by `proxy.hold_timeout_s`, rather than in vLLM's own queue, unordered and
        unbounded. The full-size engine back, the configured budget again."""
        limits = self._gate_limits(self.capacity())
        if limits == self.gate.limits:
            return
        if limits.tokens != self.gate.limits.tokens:
            log.info("admission follows the serving engine's KV cache",
                     max_tokens_in_flight=limits.tokens or None,
                     configured=self.config.proxy.max_tokens_in_flight or None,
                     thin_serves=self.thin_serves)
        self.gate.set_limits(limits)

    def reconfigure(self, new: Config) -> None:
        """A reloaded config in force: every copy of the old one is replaced or
        reconfigured here (the rest is read from self.config where it is used, the
        engine's settings at its next start); supervisor/settings/reload.py says which key
        applies when."""
        self.config = new
        self.failures.reconfigure(new.restart)
        set_level(new.log.level)
        self.audit_trail = AuditTrail(new.audit.path, new.audit.max_bytes, new.audit.backups)
        self.watch.reconfigure(new)
        self.gate.set_limits(self._gate_limits(self.capacity()))
        self.weights.reconfigure(new.restart)
        if self.state is not State.STOPPING:  # (started, restarted or taken down now)
            self.run_steps(self.weights.want(new.engine, self.environ, new.weight_cache_dir))
            self.cache_moved()
        # (the proxy's shared settings are the host's to reconfigure)

    def status(self) -> dict[str, Any]:
        """What `vllm-supervisorctl status` shows (supervisor/engine/views.py)."""
        return views.status(self)

