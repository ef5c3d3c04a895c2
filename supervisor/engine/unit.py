"""One engine's unit: the single task that owns that engine's state.

Everything that happens reaches `EngineUnit.handle` as a typed event
(`supervisor/engine/events.py`) on one queue: the engine's exit, its health, the end of a
take-down, a backoff timer, a signal, a control request, a reloaded config, a tick. Each
is handled by a `handle_<name>` method that may change state (only through `_set_state`,
which checks the transition table) and may start jobs through the effects protocol
(`supervisor/engine/effects.py`): spawn, probe, take down, drain, follow at the proxy.
Jobs report back only by putting an event on the queue; no handler blocks.

The unit owns the lifecycle; its watchdog half (`EngineWatch`,
`supervisor/engine/watch.py`) owns the signals, the policy's memory and the settings it
tunes, and asks for what it wants as intents (`supervisor/engine/intents.py`) that
`_carry_out` does here. After every event, `_sync_gate` alone opens, holds or closes
the proxy's gate for this engine, from the unit's state.

Invariants:
- at most one engine exists at a time: a new one is spawned only after the previous
  one's take-down has proven its tree gone (`handle_down`);
- any exit the daemon did not ask for is a crash, whatever the exit code;
- every wait is bounded (startup timeout, drain + grace, reap and GPU-release timeouts).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import os
import signal
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import structlog

from supervisor import engine_checks, reload
from supervisor.config import DEFAULT_ENGINE, Config, EngineConfig, diff_keys
from supervisor.engine import process as eng
from supervisor.engine import views
from supervisor.engine.commands import COMMANDS
from supervisor.engine.effects import Effects, Front, Timer
from supervisor.engine.events import (
    BackoffElapsed,
    CanaryDone,
    CommandError,
    ControlRequest,
    CoreExited,
    DecisionRecord,
    Down,
    Drained,
    Event,
    EvidenceCaptured,
    Exited,
    GateProbe,
    GpuSampled,
    HealthResult,
    MetricsSampled,
    Reloaded,
    RemedyDone,
    SignalReceived,
    SleepModeProbed,
    Spawned,
    StandbyDue,
    Tick,
    TreeSeen,
    ViewRequest,
    Woken,
    iso_time,
)
from supervisor.engine.gatekeeper import GateKeeper
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
from supervisor.engine.jobs import JobEffects
from supervisor.engine.lifecycle import RestartTracker
from supervisor.engine.notices import SystemdNotices
from supervisor.engine.slot import EngineSlot
from supervisor.engine.standby import Standby
from supervisor.engine.states import State, check_transition
from supervisor.engine.watch import EngineWatch, UnitFacts
from supervisor.front.admission import Gate, GateLimits
from supervisor.loop import Clock
from supervisor.ops.audit import AuditTrail
from supervisor.ops.exposition import ExporterView
from supervisor.ops.logs import set_level
from supervisor.ops.sdnotify import Notifier
from supervisor.watchdog import relaunch
from supervisor.watchdog.gpu import GpuProcessLister, GpuSampler

log = structlog.get_logger("supervisor")


@dataclass
class EngineUnit:
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
        self.audit_trail = AuditTrail(self.config.audit.path, self.config.audit.max_bytes,
                                      self.config.audit.backups)
        self.tracker = RestartTracker(self.config.restart)
        self.watch = EngineWatch(self.config, self.environ, self.clock.monotonic,
                                 self.clock.wall, self.audit)
        generations = itertools.count(1)
        # the serving engine's place, from spawn to reap; the standby's, when configured
        self.slot = EngineSlot(self.act, self.audit, lambda: next(generations), bay=0)
        self.standby = Standby(self.act, self.audit, self.clock.monotonic,
                               EngineSlot(self.act, self.audit, lambda: next(generations),
                                          bay=1))
        self.serving_starts = 0  # engines that took the serving place (cold or failover)
        self.failovers = 0
        self.last_failover_s: float | None = None  # fault seen to held requests released
        self._failover_at: float | None = None  # a handover under way since
        # a cold start waits for its standby to be asleep first (no room beside it else)
        self._standby_first = False
        self._waking = False  # the standby that took over is being woken
        self._wake_when_down = False  # ... once the old engine's memory is released
        self._proving_woken = False  # ... and proven with a generation
        # a reload or a policy relaunch changed what the engine runs: a standby with the
        # new arguments, then a swap to it ((why, the restart's reason label) meanwhile)
        self._upgrade: tuple[str, str] | None = None
        self.fatal_errors: list[str] = []
        self.last_decision: DecisionRecord | None = None  # the latest, lifecycle steps included
        self.fatal_reason: str | None = None
        self.exit_code = 0
        self.restarts_by_reason: dict[str, int] = {}
        self.start_blocked: str | None = None  # why the last start was refused (GPU busy)
        self.backoff_until: float | None = None
        # a restart or stop under way ends by this (monotonic); None: none under way
        self.stop_deadline: float | None = None
        self.keeper = GateKeeper(self.gate, self.audit)  # opens, holds, closes the gate
        self._restart_reason = ""
        self._restart_when_down = False
        self._backoff: Timer | None = None
        self.notices = SystemdNotices(self.notifier)
        self._stop_replies: list[asyncio.Future[dict[str, Any]]] = []
        self._remedy_replies: list[asyncio.Future[dict[str, Any]]] = []
        # a relaunch the policy chose, audited once when it ends
        self.relaunch = RelaunchLog(self.audit, self.clock.monotonic,
                                    lambda: self.gate.waiting if self.fronted else None)
        self._done = False

    # ---- running ----------------------------------------------------------------------

    async def run(self) -> int:
        """Run until the engine is stopped for good. Returns its exit status. The host
        (supervisor/host.py) owns the signals, the sockets and the proxy around it."""
        if self.config.several:  # every line of this unit and its jobs names its engine
            structlog.contextvars.bind_contextvars(engine=self.name)
        log.info("engine unit started", **self.act.begin())
        self.act.tick_every(self.notices.tick_interval(self.tick_interval_s))
        if self.sampler is not None:
            self.act.sample_gpu(self.sampler)
        self.start("daemon started")
        try:
            while not self._done:
                self.handle(await self.queue.get())
        except BaseException:
            # A bug in a handler: do not leave the engine running without its supervisor.
            if self.engine is not None:
                log.critical("daemon failing; killing the engine's process group",
                             pid=self.engine.pid, exc_info=True)
                self.act.kill_now(self.engine)
            self.exit_code = 70  # EX_SOFTWARE
            raise
        finally:
            self._sync_gate(ended=True)
            await self.act.end()
        return self.exit_code

    def handle(self, event: Event) -> None:
        """One event, by its `handle_<name>` method (the standby's engine's, by the
        standby); then the gate follows the state."""
        # (evidence and a remedy's end are the unit's whichever engine they were about:
        # an old engine's remedy must still end, and its operator be answered)
        if self.standby.owns(event) and not isinstance(event, EvidenceCaptured | RemedyDone):
            self._standby_event(event)
        else:
            handler: Callable[[Any], None] = getattr(self, f"handle_{event.name}")
            handler(event)
        self._sync_gate()

    def start(self, reason: str) -> None:
        """The first start (tests start the unit's engine here too)."""
        self._start_engine(reason)
        self._sync_gate()

    async def submit(self, command: str, args: dict[str, Any]) -> dict[str, Any]:
        """Called by the control server: enqueue an intent and wait for its answer."""
        reply: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self.post(ControlRequest(command, args, reply))
        return await reply

    def post(self, event: Event) -> None:
        """An event for this unit's task (a control request, a signal, a reload)."""
        self.queue.put_nowait(event)

    async def view(self) -> ExporterView:
        """For the exporter: answered by the state-owning task, so that /healthz fails
        when that task is stuck."""
        reply: asyncio.Future[ExporterView] = asyncio.get_running_loop().create_future()
        self.queue.put_nowait(ViewRequest(reply))
        return await reply

    # ---- state ------------------------------------------------------------------------

    def _set_state(self, new: State, reason: str) -> None:
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

    def _decide(self, action: str, reason: str) -> None:
        self.last_decision = DecisionRecord(action, reason, self.clock.wall())

    def audit(self, event: str, **fields: Any) -> None:
        """One entry in the audit trail, naming this engine when there are several."""
        if self.config.several:
            fields["engine"] = self.name
        err = self.audit_trail.append({"time": iso_time(self.clock.wall()), "event": event,
                                       **fields})
        if err is not None:
            log.warning("audit write failed", error=err)

    def _sync_gate(self, ended: bool = False) -> None:
        """The gate follows the state (`supervisor/engine/gatekeeper.py`)."""
        self.keeper.sync(self.state, self.state_reason, self.watch.holds_requests(),
                         self.watch.tuning.throttle_level if self.fronted else 0, ended,
                         suspect=self.watch.suspect(),
                         swap=self.state is State.DRAINING and self._standby_fits())

    def facts(self) -> UnitFacts:
        """The unit's state as its watchdog half reads it."""
        return UnitFacts(self.state, self.engine, self.slot.taking_down, self.fronted,
                         self.gate.in_flight + self.act.probes_in_flight())

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

    # ---- engine lifecycle -------------------------------------------------------------

    def _start_engine(self, reason: str) -> None:
        self.watch.engine_starting()
        self.keeper.admitting = False
        self.relaunch.starting()
        self.serving_starts += 1
        self._failover_at = None  # (a cold start ends any handover, and applies any upgrade)
        self._waking = self._wake_when_down = self._proving_woken = False
        self._upgrade = None
        self._set_state(State.STARTING, reason)
        self._decide("start", reason)
        if self._start_standby_first():
            return
        self._spawn_serving()

    def _start_standby_first(self) -> bool:
        """A sleeping standby that cannot start beside the serving engine starts before
        it: proven, put to sleep, then the engine starts beside it (docs/standby.md).
        Whether the engine's spawn waits for that."""
        cfg = self._engine_config(self.standby.slot.bay)
        if (cfg.standby != "sleep" or self.standby.ready
                or engine_checks.side_by_side(engine_checks.argv(cfg))):
            return False
        if self.standby.can_start():
            self._standby_first = True
            log.info("the standby starts first: the engine starts beside it once it "
                     "sleeps (no room for it to start beside the engine)")
            self._start_standby(due=True)
        else:
            self._standby_first = self.standby.on_its_way
        return self._standby_first

    def _spawn_serving(self) -> None:
        cfg = self._engine_config(self.slot.bay)
        if cfg.args != self.config.engine.args:
            log.info("engine arguments overridden", overrides=self.watch.overrides(
                self.fronted), throttle_level=self.watch.tuning.throttle_level)
        self.slot.spawn(eng.build_spawn_spec(cfg, self.environ), cfg)

    def _engine_config(self, bay: int) -> EngineConfig:
        """What an engine started now in `bay` runs with: the current config, its place's
        port (bay 1: the standby's), the watchdog's overrides (throttle, batch,
        speculative tokens)."""
        cfg = self.config.engine if bay == 0 else self.config.engine.second()
        overrides = self.watch.overrides(self.fronted)
        return dataclasses.replace(cfg, args=relaunch.apply(cfg.args, overrides)) \
            if overrides else cfg

    def handle_spawned(self, ev: Spawned) -> None:
        engine = self.slot.spawned(ev)
        if engine is None:
            if self.state is State.STOPPING:
                self._maybe_finish_stop()
            elif ev.gpu_busy:
                self._start_blocked(ev.error or "GPU busy")
            elif self.state is State.DRAINING:
                self._start_engine(self._restart_reason)
            else:
                self._failure(f"engine could not be started: {ev.error}", healthy_for=None)
            return
        self.start_blocked = None
        if self.fronted:
            self.act.follow(engine)  # the proxy's route for this engine goes to it now
        if self.state in (State.STOPPING, State.DRAINING):
            self._take_down(graceful=True)  # a stop or restart came while it was spawning

    def handle_tree_seen(self, ev: TreeSeen) -> None:
        cpu = self.slot.tree_seen(ev)
        if self.slot.current(ev.generation) is not None:
            self.watch.window.add_tree(ev.at, ev.rss_bytes, cpu)

    def handle_exited(self, ev: Exited) -> None:
        asked = self.slot.taking_down or self.state not in (State.STARTING, State.RUNNING)
        engine = self.slot.exited(ev, asked)
        if engine is None or asked:
            return
        # vLLM may exit 0 after its engine core died: any unasked exit is a crash.
        self._crashed(engine)

    def handle_core_exited(self, ev: CoreExited) -> None:
        """The core died and its API server is still up (it exits seconds later): the
        engine has crashed now, not when that exit comes."""
        engine = self.slot.core_exited(ev)
        if engine is not None and self.state in (State.STARTING, State.RUNNING):
            self._crashed(engine)

    def _crashed(self, engine: eng.EngineProcess) -> None:
        """The serving engine failed unasked: the standby serves, or a cold start."""
        if self.state is State.RUNNING and self._standby_fits():
            self._count_restart("crash")
            self._fail_over(f"engine {self.slot.last_exit} without being asked",
                            graceful=False)
            return
        healthy_for = (self.clock.monotonic() - engine.healthy_at
                       if engine.healthy_at is not None else None)
        self._failure(f"engine {self.slot.last_exit} without being asked",
                      healthy_for=healthy_for)

    def handle_health_result(self, ev: HealthResult) -> None:
        engine = self.slot.current(ev.generation)
        if engine is None or self.state is not State.STARTING or self.slot.taking_down:
            return
        now = self.clock.monotonic()
        if ev.healthy:
            engine.healthy_at = now
            self.last_start_s = round(now - engine.started_at, 1)
            self._set_state(State.RUNNING,
                            f"/health answered 200 after {now - engine.started_at:.1f} s")
            self.notices.ready_once(f"RUNNING: engine pid {engine.pid} serving")
            self.act.serve(engine)
            self._start_standby()
            if self.fronted and self.config.canary.enabled:
                self.act.gate_probe(engine)  # held requests go once one canary passed
            else:
                self.keeper.admitting = True  # no canary to wait for: healthy is all we know
                self.relaunch.finish("ok", None)  # serving: nothing more is waited for
        elif engine.exit_code is None:
            self._failure(f"engine not healthy within {engine.config.startup_timeout_s:g} s",
                          healthy_for=None)

    def _failure(self, reason: str, healthy_for: float | None) -> None:
        """The engine failed (crash, boot failure, startup timeout): back off or give up,
        and take down whatever is left of its tree."""
        verdict = self.tracker.record_failure(self.clock.monotonic(), healthy_for_s=healthy_for,
                                              what=reason)
        self._count_restart("crash" if healthy_for is not None else "boot_failure")
        if verdict.fatal:
            self._give_up(verdict.reason)
        else:
            self.backoff_until = self.clock.monotonic() + verdict.delay_s
            self._set_state(State.BACKOFF, f"{reason}; retrying in {verdict.delay_s:g} s")
            self._decide("backoff", reason)
        if self.engine is not None:
            self._take_down(graceful=False)
        elif self.state is State.BACKOFF:
            self._arm_backoff()

    def _start_blocked(self, why: str) -> None:
        """Another program holds the engine's GPUs: not a boot failure (the engine never
        ran), nothing to kill (not ours). Wait in BACKOFF, saying why, and look again
        every backoff_max_s; `restart` looks at once."""
        self.start_blocked = why
        delay = self.config.restart.backoff_max_s
        self.backoff_until = self.clock.monotonic() + delay
        self._set_state(State.BACKOFF, f"start refused: {why}; checking again in {delay:g} s")
        self._decide("backoff", f"start refused: {why}")
        # systemd's start must not wait on someone else's job: say so, and stay up
        self.notices.ready_once(f"BACKOFF: start refused: {why}")
        self._arm_backoff()

    def _give_up(self, reason: str, engine: eng.EngineProcess | None = None) -> None:
        """FATAL, with the last error lines of `engine` (default: the current one)."""
        engine = engine or self.engine
        errors = list(engine.recent_errors) if engine else []
        self.fatal_reason = reason
        self._standby_first = False
        self._set_state(State.FATAL, reason)
        # (on the same GPUs and arguments: a standby cannot help an engine held down)
        self.standby.retire(reason, graceful=True, deadline=self._standby_deadline())
        self.relaunch.finish("failed", reason)
        self._decide("give_up", reason)
        log.error("giving up on the engine", reason=reason, last_engine_errors=errors[-10:])
        self.fatal_errors = errors[-10:]
        # The daemon is up and answering even though the engine is not: tell systemd, so
        # that `systemctl start` returns and `status` shows FATAL with the reason.
        self.notices.ready_once(f"FATAL: {reason}")

    def _arm_backoff(self) -> None:
        delay = max(0.0, (self.backoff_until or 0.0) - self.clock.monotonic())
        self._backoff = self.act.after(delay, BackoffElapsed(self.generation))

    def _cancel_backoff(self) -> None:
        if self._backoff is not None:
            self._backoff.cancel()
            self._backoff = None
        self.backoff_until = None

    def handle_backoff_elapsed(self, ev: BackoffElapsed) -> None:
        self._backoff = None
        if (self.state is State.BACKOFF and ev.generation == self.generation
                and self.engine is None and not self.slot.spawning):
            self._start_engine("backoff elapsed")

    def _set_deadline(self, proxy_drain: bool) -> float:
        """The one deadline of the restart or stop beginning now (unless one runs):
        every step of it keeps within what is left (`process.stop_budget_s`)."""
        if self.stop_deadline is None:
            e = self.engine
            evidence_s = self.config.evidence.timeout_s + 1.0 \
                if self.slot.evidence_for is not None and self.config.evidence.enabled else 0.0
            self.stop_deadline = self.clock.monotonic() + eng.stop_budget_s(
                (e.config if e is not None else self.config.engine),
                proxy_drain=proxy_drain, evidence_s=evidence_s)
        return self.stop_deadline

    def _standby_deadline(self) -> float:
        """The deadline of a take-down in the standby's place, from now (no drain first)."""
        return self.clock.monotonic() + eng.stop_budget_s(
            self.config.engine, proxy_drain=False, evidence_s=0.0)

    def _take_down(self, graceful: bool) -> None:
        deadline = self._set_deadline(proxy_drain=False)
        self.relaunch.taken_down()
        self._take_down_in(self.slot, graceful, deadline)

    def _take_down_in(self, slot: EngineSlot, graceful: bool, deadline: float) -> None:
        """Take the engine in `slot` down, with the evidence its fault asked for."""
        req = slot.evidence_request(
            self.config.evidence.enabled,
            self.watch.signals(self.clock.monotonic(), slot.engine),
            self.watch.window.gpu_snapshot(), self.clock.wall())
        slot.take_down(graceful, req, deadline)

    def handle_evidence_captured(self, ev: EvidenceCaptured) -> None:
        fields = {"rule": ev.request.rule, "reason": ev.request.reason,
                  "pid": ev.request.engine_pid, **ev.bundle.as_dict()}
        if ev.bundle.error:
            log.error("evidence not captured", **fields)
        else:
            log.info("evidence captured", **fields)
        self.audit("evidence", **fields)

    def handle_down(self, ev: Down) -> None:
        engine, problem = self.slot.down(ev)
        self.stop_deadline = None
        self.relaunch.down()
        if self.state is State.FATAL:
            self.fatal_errors = list(engine.recent_errors)[-10:]  # now complete
        if self.state is State.STOPPING:
            if problem:
                self.exit_code = 1
            self._maybe_finish_stop()
        elif problem is not None and self.state is not State.FATAL:
            self._give_up(problem, engine)
        elif self.state is State.DRAINING:
            self._start_engine(self._restart_reason)
        elif self.state is State.BACKOFF:
            if self._restart_when_down:
                self._restart_when_down = False
                self._cancel_backoff()
                self._start_engine(self._restart_reason)
            else:
                self._arm_backoff()
        elif self.state is State.FATAL and self._restart_when_down and problem is None:
            self._restart_when_down = False
            self._start_engine(self._restart_reason)

    # ---- stop and restart -------------------------------------------------------------

    def _begin_stop(self, reason: str) -> None:
        if self.state is State.STOPPING:
            if not self.slot.force.is_set():
                log.warning("second stop request: skipping to SIGKILL", reason=reason)
                self.audit("force_stop", reason=reason)
                self.slot.force.set()
            return
        self._cancel_backoff()
        self._standby_first = False
        self._set_state(State.STOPPING, reason)
        self.relaunch.finish("abandoned", f"the daemon is stopping: {reason}")
        self._decide("stop", reason)
        self.notices.stopping(f"STOPPING: {reason}")
        self.standby.retire("the daemon is stopping", graceful=True,
                            deadline=self._set_deadline(proxy_drain=False))
        if self.engine is not None and not self.slot.taking_down:
            self._take_down(graceful=True)
        else:
            self._maybe_finish_stop()
        # otherwise: a take-down (ends in handle_down) or a spawn (ends in handle_spawned)
        # is in flight, and finishes the stop.

    def _maybe_finish_stop(self) -> None:
        """STOPPED once both places are empty (the serving engine's, the standby's)."""
        if self.engine is None and not self.slot.spawning and self.standby.idle:
            self._finish_stop()

    def _finish_stop(self) -> None:
        self._set_state(State.STOPPED, "engine stopped")
        for reply in self._stop_replies:
            if not reply.done():
                reply.set_result({"state": State.STOPPED.value, "exit_code": self.exit_code})
        self._done = True

    def _restart(self, reason: str, graceful: bool = True) -> None:
        s = self.state
        if s in (State.STARTING, State.RUNNING):
            self._restart_reason = reason
            self._set_state(State.DRAINING, reason)
            self._decide("restart", reason)
            if self.engine is not None and not self.slot.taking_down:
                if self.fronted:
                    log.info("restart: new requests held", in_flight=self.gate.in_flight,
                             waiting=self.gate.waiting)
                if graceful and self.fronted and self.engine.config.drain == "continue":
                    paused = self.act.pause_streams(self.engine)
                    log.info("restart: streams paused, to go on on the new engine",
                             paused=paused)
                if graceful and self.fronted and self.gate.in_flight:
                    # The gate holds new requests now; let the ones at the engine finish
                    # before SIGTERM (vLLM's own drain aborts streams), bounded.
                    self.act.drain(self.engine, self._set_deadline(proxy_drain=True))
                else:
                    self._swap_or_take_down(graceful)
            elif self.engine is None and not self.slot.spawning:
                self._start_engine(reason)  # (its standby was starting first)
            # a take-down already running (a crash being reaped) ends in handle_down
        elif s in (State.BACKOFF, State.FATAL):
            self.tracker.reset()
            self.fatal_reason = None
            self._cancel_backoff()
            self._restart_reason = reason
            self._decide("restart", reason)
            if self.engine is None and not self.slot.spawning:
                self._start_engine(reason)
            else:
                self._restart_when_down = True
        elif s is State.DRAINING:
            raise CommandError("a restart is already in progress")
        else:
            raise CommandError(f"the daemon is {s.value}")


    # ---- the standby (supervisor/engine/standby.py) -----------------------------------

    def _start_standby(self, due: bool = False) -> None:
        """A standby in its free place, when one is configured and the engine serves (or
        waits for it to sleep first); after a failure, once its backoff is `due`."""
        mode = self.config.engine.standby
        if (mode == "none" or not self.standby.can_start() or self._failover_at is not None
                or (self.state is not State.RUNNING and not self._standby_first)):
            return
        cfg = self._engine_config(self.standby.slot.bay)
        # (an awake standby's share was checked at load; on CPU no share is given)
        if mode == "sleep" and not self._standby_first \
                and not engine_checks.side_by_side(engine_checks.argv(cfg)):
            share = engine_checks.gpu_share(engine_checks.argv(cfg)) \
                or engine_checks.DEFAULT_GPU_SHARE
            self.standby.no_room(
                f"two engines at --gpu-memory-utilization {share:g} do not fit on the "
                f"card: a standby starts again before the engine's next cold start")
            return
        if self.standby.failures and not due:
            r = self.config.restart
            self.standby.due_later(r.backoff_initial_s, r.backoff_max_s)
            return
        self.standby.start(eng.build_spawn_spec(cfg, self.environ), cfg, mode)

    def handle_standby_due(self, _: StandbyDue) -> None:
        self.standby.due()
        self._start_standby(due=True)

    def _standby_event(self, ev: Event) -> None:
        free = self.standby.handle(ev, self._standby_deadline(),
                                   stopping=self.state is State.STOPPING)
        if self._wake_when_down and isinstance(ev, Down):
            self._wake_when_down = False  # the old engine is gone, its memory released
            if self.standby.state == "failed":
                self._takeover_failed(f"the old engine's tree was not proven gone "
                                      f"({self.standby.why}): not waking the standby")
            elif self.engine is not None:
                self.act.wake(self.engine)
        if self.state is State.STOPPING:
            self._maybe_finish_stop()
        elif self._standby_first and not self.standby.on_its_way:
            if self.standby.ready or self.standby.idle:
                self._standby_first = False
                if (self.state is State.STARTING and self.engine is None
                        and not self.slot.spawning):
                    self._spawn_serving()  # beside the sleeping standby (or without one)
        elif free:
            self._start_standby()
        if (self._upgrade is not None and self.state is State.RUNNING
                and self._standby_fits()):
            (why, label), self._upgrade = self._upgrade, None
            log.info("upgrade: the standby runs the new arguments; swapping to it", why=why)
            self._count_restart(label)
            self._restart(f"upgrade: {why}")  # (drained, then a swap: `_swap_or_take_down`)

    def _begin_upgrade(self, why: str, label: str) -> bool:
        """What the serving engine runs changed (a reload: a new vLLM, a model revision; a
        policy relaunch: fewer speculative tokens, a smaller batch): with a standby, one is
        started with the new arguments, proven, then swapped in, so that no client waits
        for a cold start, and the engine serves meanwhile. Whether that began; without a
        standby (or room for one beside the engine) a reload's change applies at the next
        start, a relaunch restarts cold."""
        e = self.engine
        if self.config.engine.standby == "none" or self.state is not State.RUNNING \
                or e is None:
            return False
        cfg = self._engine_config(self.slot.bay)
        spec = eng.build_spawn_spec(cfg, self.environ)
        if (spec.argv, spec.env, spec.cwd) == (e.spec.argv, e.spec.env, e.spec.cwd):
            return False  # (nothing the engine runs changed: a timeout, a grace...)
        if cfg.standby == "sleep" and not engine_checks.side_by_side(engine_checks.argv(cfg)):
            log.info("no room for a standby beside the engine: no upgrade through one",
                     why=why)
            return False
        self._upgrade = (why, label)
        log.info("upgrade: starting a standby with the new arguments", why=why)
        self.audit("upgrade", why=why)
        if self.standby.ready or self.standby.on_its_way:
            self.standby.retire("its arguments are out of date", graceful=True,
                                deadline=self._standby_deadline())
        self.standby.cancel_timer()
        self.standby.due()  # (a backoff under way is over: the arguments changed)
        self.standby.failures = 0
        self._start_standby(due=True)  # (now if its place is free; else once it is)
        return True

    def _standby_fits(self) -> bool:
        """A ready standby that runs what a start now would run."""
        cfg = self._engine_config(self.standby.slot.bay)
        return self.standby.fits(eng.build_spawn_spec(cfg, self.environ))

    def _swap_or_take_down(self, graceful: bool) -> None:
        """A drained restart: the standby takes over when it is ready and up to date;
        else the engine is taken down for a cold start (and an out-of-date standby is
        replaced)."""
        if self._standby_fits():
            self._fail_over(self._restart_reason, graceful)
            return
        if self.standby.ready:
            self.standby.retire("its arguments are out of date", graceful=True,
                                deadline=self._set_deadline(proxy_drain=False))
        self._take_down(graceful)

    def _fail_over(self, reason: str, graceful: bool) -> None:
        """The ready standby serves now: the proxy sends this engine's requests to it
        (streams in flight are continued on it, held requests go to it once it answered
        a generation); the old engine is taken down in the standby's place, and a new
        standby starts there once that tree is proven gone. A sleeping standby is woken
        first: at once when the two engines fit on the card side by side, else once the
        old engine's memory is released (a wake before that fails and wedges it)."""
        old = self.slot
        self.slot, asleep = self.standby.take_over(old)
        engine = self.slot.engine
        assert engine is not None
        self.serving_starts += 1
        self.failovers += 1
        self._failover_at = self.clock.monotonic()
        self.watch.engine_starting()
        self.keeper.admitting = False
        log.warning("failover: the standby serves", reason=reason, pid=engine.pid,
                    port=engine.spec.port, old_pid=old.engine.pid if old.engine else None,
                    asleep=asleep)
        self.audit("failover", reason=reason, pid=engine.pid, port=engine.spec.port,
                   old_pid=old.engine.pid if old.engine else None, graceful=graceful,
                   asleep=asleep)
        self._decide("failover", reason)
        if self.state is State.DRAINING:
            self._set_state(State.RUNNING, f"the standby took over ({reason})")
        if not asleep:
            self._serve_taken_over(engine)
        elif old.engine is not None \
                and not engine_checks.side_by_side(engine_checks.argv(engine.config)):
            self._waking = self._wake_when_down = True  # (handled in _standby_event)
        else:
            self._waking = True
            self.act.wake(engine)
        if old.engine is not None and not old.taking_down:
            self._take_down_in(old, graceful, self._set_deadline(proxy_drain=False))
        self.stop_deadline = None  # (the restart is over; the old engine's has its own)
        self.relaunch.taken_down()
        self.relaunch.down()

    def _serve_taken_over(self, engine: eng.EngineProcess) -> None:
        """The proxy's route goes to the engine that took over; held requests go once it
        answered a generation (a woken one always: a wake can leave a broken engine)."""
        if self.fronted:
            self.act.follow(engine)
        self.act.serve(engine)
        if self._proving_woken or (self.fronted and self.config.canary.enabled):
            self.act.gate_probe(engine)
        else:
            self.keeper.admitting = True
            self.relaunch.finish("ok", None)
            self._failover_done()

    def handle_woken(self, ev: Woken) -> None:
        engine = self.slot.current(ev.generation)
        if engine is None or self.slot.taking_down or not self._waking:
            return
        self._waking = False
        if ev.error is not None:
            self._takeover_failed(f"the standby did not wake: {ev.error}")
            return
        log.info("standby woken", pid=engine.pid, seconds=round(ev.seconds, 3))
        self.audit("standby_woken", pid=engine.pid, seconds=round(ev.seconds, 3))
        self._proving_woken = True
        self._serve_taken_over(engine)

    def _takeover_failed(self, reason: str) -> None:
        """The standby that took over cannot serve: today's path, a cold start after a
        backoff (the woken engine is taken down)."""
        log.error("failover failed: cold start", reason=reason)
        self.audit("failover_failed", reason=reason)
        self._failover_at = None
        self._waking = self._wake_when_down = self._proving_woken = False
        engine = self.engine
        healthy_for = (self.clock.monotonic() - engine.healthy_at
                       if engine is not None and engine.healthy_at is not None else None)
        self._failure(reason, healthy_for=healthy_for)

    def _failover_done(self) -> None:
        """The handover is over: held requests go to the standby now, and a new standby
        may start in the old engine's place once it is free."""
        if self._failover_at is not None:
            self.last_failover_s = round(self.clock.monotonic() - self._failover_at, 3)
            self._failover_at = None
            log.info("failover done", seconds=self.last_failover_s)
            self.audit("failover_done", seconds=self.last_failover_s)
            self._start_standby()

    def standby_status(self, now: float) -> dict[str, Any]:
        """`status`'s `standby`: `"ready"` when armed (awake and proven)."""
        if self.config.engine.standby == "none" and self.standby.idle:
            return {"state": "none"}
        return {"mode": self.config.engine.standby, **self.standby.status(now)}

    @property
    def restarts(self) -> int:
        return max(0, self.serving_starts - 1)

    def pids(self) -> set[int]:
        """Every process of this unit's engines (both places)."""
        return {p.pid for s in (self.slot, self.standby.slot) if s.engine is not None
                for p in s.engine.known}

    # ---- what the watchdog asks -------------------------------------------------------

    def _carry_out(self, intents: list[Intent]) -> None:
        for intent in intents:
            if isinstance(intent, Decided):
                self.last_decision = intent.record
            elif isinstance(intent, Restart):
                if intent.rung is not None:
                    self.relaunch.begin(intent.rung, intent.reason)
                if (intent.graceful and intent.rung is not None and intent.evidence is None
                        and self._begin_upgrade(intent.reason, "policy")):
                    continue  # a relaunch with new arguments: through the standby
                self._count_restart("policy")
                if intent.evidence is not None:
                    self.slot.evidence_for = intent.evidence
                self._restart(intent.reason, graceful=intent.graceful)
            elif isinstance(intent, HoldDown):
                if intent.evidence is not None:
                    self.slot.evidence_for = intent.evidence
                self._give_up(intent.reason)
                if self.engine is not None and not self.slot.taking_down:
                    self._take_down(graceful=True)
            elif isinstance(intent, BeginRemedy):
                assert self.engine is not None
                self._sync_gate()  # (a KV reset holds new requests from now on)
                self.act.remedy(self.engine, intent.rung)
            elif isinstance(intent, Throttled):
                self._sync_gate()  # live at the proxy: in force at once
                remedy_ended(self.audit, {"rung": "throttle", "outcome": "ok",
                                          "duration_s": 0.0, "rule": intent.rule,
                                          "throttle_level": intent.level,
                                          "max_concurrency": self.gate.concurrency_limit})

    def _count_restart(self, reason: str) -> None:
        self.restarts_by_reason[reason] = self.restarts_by_reason.get(reason, 0) + 1

    def _gate_limits(self) -> GateLimits:
        p = self.config.proxy
        return GateLimits(concurrency=p.max_concurrency, tokens=p.max_tokens_in_flight,
                          level_factors=tuple(self.config.throttle.level_factors),
                          queue_max=p.hold_queue_max, max_wait_s=p.hold_timeout_s,
                          kv_high=p.kv_breaker_high, kv_low=p.kv_breaker_low)

    # ---- the watchdog's events --------------------------------------------------------

    def handle_metrics_sampled(self, ev: MetricsSampled) -> None:
        self.watch.on_metrics(ev, self.facts())
        if ev.snapshot is not None and self.engine is not None \
                and self.engine.generation == ev.generation:
            self.gate.set_kv_usage(ev.snapshot.kv_cache_usage)

    def handle_canary_done(self, ev: CanaryDone) -> None:
        self.watch.on_canary_done(ev, self.facts())

    def handle_gpu_sampled(self, ev: GpuSampled) -> None:
        self.watch.on_gpu_sampled(ev, self.engine)

    def handle_sleep_mode_probed(self, ev: SleepModeProbed) -> None:
        self.watch.on_sleep_mode_probed(ev, self.facts())

    def handle_remedy_done(self, ev: RemedyDone) -> None:
        fields, intents = self.watch.on_remedy_done(ev, self.facts(), self.gate.waiting)
        for reply in self._remedy_replies:
            if not reply.done():
                reply.set_result(fields)
        self._remedy_replies.clear()
        self._carry_out(intents)

    def handle_drained(self, ev: Drained) -> None:
        engine = self.engine
        log.info("proxy drained" if ev.idle else "drain timeout: requests still in flight",
                 waited_s=round(ev.waited_s, 3), in_flight=self.gate.in_flight)
        self.audit("drained", idle=ev.idle, waited_s=round(ev.waited_s, 3))
        if (engine is None or engine.generation != ev.generation or self.slot.taking_down
                or self.state not in (State.DRAINING, State.STOPPING)):
            return  # the engine is gone already (a crash being reaped) or a stop took over
        if self.state is State.DRAINING:
            self._swap_or_take_down(graceful=True)
        else:
            self._take_down(graceful=True)

    def handle_gate_probe(self, ev: GateProbe) -> None:
        if (self.engine is None or self.engine.generation != ev.generation
                or self.state is not State.RUNNING):
            return
        if self._proving_woken:
            self._proving_woken = False
            if not ev.ok:
                self._takeover_failed(f"its first generation after waking failed: "
                                      f"{ev.error}")
                return
        if not ev.ok:
            log.warning("the first canary failed; releasing held requests anyway",
                        error=ev.error, waiting=self.gate.waiting)
        self.relaunch.finish("ok", None if ev.ok else f"the first canary failed: {ev.error}")
        self.keeper.admitting = True  # (`_sync_gate` lets the held requests go)
        self._failover_done()
        if self.keeper.drained_by_operator:
            log.info("engine ready; requests stay held until `resume`", waiting=self.gate.waiting)

    def handle_view_request(self, ev: ViewRequest) -> None:
        if not ev.reply.done():
            ev.reply.set_result(views.exporter_view(self))

    # ---- signals, ticks, reload -------------------------------------------------------

    def handle_signal_received(self, ev: SignalReceived) -> None:
        name = signal.Signals(ev.signum).name
        if ev.signum != signal.SIGHUP:  # (a reload is the host's: supervisor/host.py)
            self._begin_stop(f"{name} received")

    def handle_tick(self, _: Tick) -> None:
        now = self.clock.monotonic()
        self.notices.tick(now, starting=self.state in (State.STARTING, State.BACKOFF))
        self._carry_out(self.watch.evaluate(now, self.facts()))

    def handle_reloaded(self, ev: Reloaded) -> None:
        if ev.config is None:
            log.warning("reload refused; the running config stays in force", error=ev.error)
            self.audit("reload_refused", error=ev.error)
            if ev.reply is not None and not ev.reply.done():
                ev.reply.set_exception(CommandError(f"reload refused: {ev.error}"))
            return
        new = ev.config
        plan = reload.plan(diff_keys(self.config, new))
        self.config = new
        # what applies now: every copy of the old config is replaced or reconfigured here
        # (the rest is read from self.config where it is used, the engine's settings at
        # its next start); supervisor/reload.py says which key applies when
        self.tracker.cfg = new.restart
        set_level(new.log.level)
        self.audit_trail = AuditTrail(new.audit.path, new.audit.max_bytes, new.audit.backups)
        self.watch.reconfigure(new)
        self.gate.set_limits(self._gate_limits())
        # (the proxy's shared settings are the host's to reconfigure)
        log.info("config reloaded", **plan.as_dict())
        if plan.next_engine_start:
            log.info("engine settings take effect at the next start",
                     keys=list(plan.next_engine_start))
            self._begin_upgrade(f"reloaded {', '.join(plan.next_engine_start)}", "upgrade")
        if plan.next_daemon_start:
            log.warning("these settings take effect only when the daemon restarts",
                        keys=list(plan.next_daemon_start))
        self.audit("reload", **plan.as_dict())
        if ev.reply is not None and not ev.reply.done():
            ev.reply.set_result(plan.as_dict())

    # ---- control: what `supervisor/engine/commands.py` asks -----------------------------

    def handle_control_request(self, ev: ControlRequest) -> None:
        if ev.reply.done():  # the client gave up waiting
            return
        command = COMMANDS.get(ev.command)
        try:
            if command is None:
                raise CommandError(f"unknown command {ev.command!r}")
            command(self, ev)
        except CommandError as exc:
            ev.reply.set_exception(exc)

    def restart(self, reason: str) -> None:
        """An operator's restart (a throttle without a proxy is one too)."""
        self._restart(reason)
        self._count_restart("operator")

    def stop(self, reply: asyncio.Future[dict[str, Any]]) -> None:
        self._stop_replies.append(reply)
        self._begin_stop("stop requested over the control socket")

    def drain(self, held: bool) -> int:
        """The operator holds (or lets go) new requests; how many wait now."""
        self.keeper.drained_by_operator = held
        waiting = self.gate.waiting
        self._sync_gate()
        return waiting

    def set_throttle(self, level: int) -> bool:
        """The operator's throttle level: live at the proxy, else a drained relaunch.
        Whether it changed."""
        changed = self.watch.set_throttle(level)
        if changed and not self.fronted:
            self.restart(f"throttle level {level} requested by operator")
        self._sync_gate()
        return changed

    def kv_reset(self, reply: asyncio.Future[dict[str, Any]], reason: str) -> None:
        why = self.watch.kv_reset_refusal(self.facts())
        if why is not None:
            raise CommandError(f"kv-reset refused: {why}")
        self.audit("control", command="kv-reset")
        self._remedy_replies.append(reply)  # answered when it ends
        self.begin_remedy("kv_reset", reason)

    def begin_remedy(self, rung: str, reason: str) -> None:
        """An in-place remedy on the serving engine, as the policy begins one."""
        self._carry_out([self.watch.begin_remedy(rung, reason, self.facts())])

    def status(self) -> dict[str, Any]:
        """What `vllm-supervisorctl status` shows (supervisor/engine/views.py)."""
        return views.status(self)

