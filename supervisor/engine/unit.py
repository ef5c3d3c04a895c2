"""The supervisor: the single task that owns the engine's state.

Everything that happens reaches `EngineUnit.run` as a typed event (`supervisor/engine/events.py`)
on one queue: the engine's exit, its health, the end of a take-down, a backoff timer, a
signal, a control request, a reloaded config, a tick. Each is handled by a
`handle_<name>` method that may change state (only through `_set_state`, which checks
the transition table), and may start jobs: tasks that do I/O (spawn, probe, take down,
read files) and report back only by putting an event on the queue. No job touches the
supervisor's attributes, no handler blocks, and no lock exists.

Invariants:
- at most one engine exists at a time: a new one is spawned only after the previous
  one's take-down has proven its tree gone (`handle_down`);
- any exit the daemon did not ask for is a crash, whatever the exit code;
- every wait is bounded (startup timeout, drain + grace, reap and GPU-release timeouts).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import signal
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from supervisor import reload
from supervisor.config import (
    DEFAULT_ENGINE,
    Config,
    diff_keys,
)
from supervisor.engine import process as eng
from supervisor.engine import proctree, views, watching
from supervisor.engine.commands import COMMANDS
from supervisor.engine.effects import Effects, Timer
from supervisor.engine.events import (
    BackoffElapsed,
    CanaryDone,
    CommandError,
    ControlRequest,
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
    Tick,
    TreeSeen,
    ViewRequest,
    iso_time,
)
from supervisor.engine.jobs import JobEffects, merge_known
from supervisor.engine.lifecycle import RestartTracker
from supervisor.engine.states import State, check_transition
from supervisor.front.admission import Gate, GateLimits
from supervisor.front.proxy import FrontProxy
from supervisor.loop import Jobs
from supervisor.ops.audit import AuditTrail
from supervisor.ops.exposition import ExporterView
from supervisor.ops.logs import set_level
from supervisor.ops.sdnotify import Notifier
from supervisor.watchdog import evidence, relaunch
from supervisor.watchdog.gpu import GpuProcessLister, GpuSampler
from supervisor.watchdog.policy import PolicyMemory
from supervisor.watchdog.poller import ScrapeHealth
from supervisor.watchdog.signals import SignalWindow

log = structlog.get_logger("supervisor")
EXTEND_EVERY_S = 10.0  # while the first engine starts, push systemd's start timeout ...
EXTEND_BY_S = 30.0  # ... this far ahead each time


# ---- the supervisor -------------------------------------------------------------------

@dataclass
class Clock:
    """Injected time: `monotonic` for every deadline and duration, `wall` only for the
    timestamps people read."""

    monotonic: Callable[[], float] = time.monotonic
    wall: Callable[[], float] = time.time


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

    def __post_init__(self) -> None:
        self.queue: asyncio.Queue[Event] = asyncio.Queue()
        # every process, socket and timer this task sets going goes through `act`
        self.act: Effects = self.effects if self.effects is not None else JobEffects(self)
        self.state = State.STOPPED
        self.state_reason = "not started"
        self.state_since = self.clock.monotonic()
        self.started_at = self.clock.monotonic()
        self.not_running_since: float | None = self.started_at  # None while RUNNING
        self.audit = AuditTrail(self.config.audit.path, self.config.audit.max_bytes,
                                self.config.audit.backups)
        self.tracker = RestartTracker(self.config.restart)
        self.state_file = proctree.StateFile(self.config.state_file)
        self.guard = proctree.Guard()
        self.engine: eng.EngineProcess | None = None
        self.generation = 0
        self.fatal_errors: list[str] = []
        self.scrapes = ScrapeHealth()
        self.last_decision: DecisionRecord | None = None  # the latest, lifecycle steps included
        self.last_policy_decision: DecisionRecord | None = None
        self.last_exit: str | None = None
        self.fatal_reason: str | None = None
        self.exit_code = 0
        self._spawning = False
        self._taking_down = False
        # (rule, reason): the next take-down of this engine first captures evidence
        self._evidence_for: tuple[str, str] | None = None
        self._force = asyncio.Event()
        self._restart_reason = ""
        self._restart_when_down = False
        self._backoff: Timer | None = None
        self._backoff_until: float | None = None
        self._ready_sent = False
        self._last_watchdog = 0.0
        self._last_extend = -EXTEND_EVERY_S
        self._stop_replies: list[asyncio.Future[dict[str, Any]]] = []
        self._jobs = Jobs()
        self._done = False
        # the watchdog
        self.window = SignalWindow(self.config.signals.window(self.config.gpu))
        self.policy_memory = PolicyMemory()
        self.policy_paused = False
        self.throttle_level = 0
        self.batch_reduced = False
        self.spec_tokens: int | None = relaunch.spec_tokens(self.config.engine.args)
        self.restarts_by_reason: dict[str, int] = {}
        self.trips_by_rule: dict[str, int] = {}
        self.actions_by_kind: dict[str, int] = {}
        self._gpu_errors_logged = False
        # the front door: present when [proxy] is enabled
        self.proxy: FrontProxy | None = None
        self.gate = Gate(self._gate_limits())
        self.drained_by_operator = False
        # in-place remedies: what this engine supports, the one in progress
        self.sleep_mode: bool = False  # probed once the engine serves
        self.sleep_mode_why: str | None = "the engine has not started"
        self.remedy_running: tuple[str, float] | None = None  # (rung, since)
        # held by each canary probe, and by a KV reset from its drain to its end: the
        # daemon's own generations are engine traffic the drain must wait for too
        self._probe_lock = asyncio.Lock()
        self._probes_in_flight = 0  # the daemon's own generations at the engine now
        self._remedy_ended_at = -1.0
        self._remedy_replies: list[asyncio.Future[dict[str, Any]]] = []
        self.start_blocked: str | None = None  # why the last start was refused (GPU busy)
        self._relaunch: watching.Relaunch | None = None  # a policy relaunch, audited when it ends

    # ---- running ----------------------------------------------------------------------

    async def run(self) -> int:
        """Run until the engine is stopped for good. Returns its exit status. The host
        (supervisor/host.py) owns the signals, the sockets and the proxy around it."""
        if self.config.several:  # every line of this unit and its jobs names its engine
            structlog.contextvars.bind_contextvars(engine=self.name)
        self.guard.disarm()  # starts the guard now, so that its pid is in the first log line
        log.info("engine unit started", guard_pid=self.guard.pid)
        self._launch(self._ticker(), "ticker")
        if self.sampler is not None:
            self.act.sample_gpu(self.sampler)
        self._start_engine("daemon started")
        try:
            while not self._done:
                event = await self.queue.get()
                handler: Callable[[Any], None] = getattr(self, f"handle_{event.name}")
                handler(event)
        except BaseException:
            # A bug in a handler: do not leave the engine running without its supervisor.
            if self.engine is not None:
                log.critical("daemon failing; killing the engine's process group",
                             pid=self.engine.pid, exc_info=True)
                proctree.kill_group(self.engine.pgid, self.engine.known)
            self.exit_code = 70  # EX_SOFTWARE
            raise
        finally:
            self.gate.close("the engine is stopped")
            await self._jobs.cancel_all()
            self.guard.close()
        return self.exit_code

    async def submit(self, command: str, args: dict[str, Any]) -> dict[str, Any]:
        """Called by the control server: enqueue an intent and wait for its answer."""
        reply: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self.queue.put_nowait(ControlRequest(command, args, reply))
        return await reply

    def _launch(self, coro: Coroutine[Any, Any, Any], what: str) -> asyncio.Task[Any]:
        return self._jobs.launch(coro, what)

    async def _ticker(self) -> None:
        interval = self.tick_interval_s
        if self.notifier.watchdog_interval_s is not None:
            interval = min(interval, self.notifier.watchdog_interval_s)
        while True:
            await asyncio.sleep(interval)
            self.queue.put_nowait(Tick())

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
        if new in (State.FATAL, State.STOPPING, State.STOPPED):
            self.gate.close(f"the engine is {new.value}: {reason}")
        elif new is not State.RUNNING:
            self.gate.hold(f"the engine is {new.value}: {reason}")
        # RUNNING opens the gate only once a canary has passed (handle_gate_probe)
        self._audit("state", **{"from": old.value, "to": new.value}, reason=reason, pid=pid)
        self.notifier.status(f"{new.value}: {reason}"[:200])

    def _decide(self, action: str, reason: str) -> None:
        self.last_decision = DecisionRecord(action, reason, self.clock.wall())

    def _audit(self, event: str, **fields: Any) -> None:
        if self.config.several:
            fields["engine"] = self.name
        err = self.audit.append({"time": iso_time(self.clock.wall()), "event": event, **fields})
        if err is not None:
            log.warning("audit write failed", error=err)

    # ---- engine lifecycle -------------------------------------------------------------

    def _start_engine(self, reason: str) -> None:
        assert self.engine is None and not self._spawning
        self.generation += 1
        self.scrapes.reset()
        self.window.reset()
        self._evidence_for = None  # (for the engine that went, if none was taken down)
        self.sleep_mode, self.sleep_mode_why = False, "the engine is not serving yet"
        self._spawning = True
        self._force = asyncio.Event()
        if self._relaunch is not None:
            self._relaunch.starts += 1
        self._set_state(State.STARTING, reason)
        self._decide("start", reason)
        cfg = self.config.engine
        overrides = self.overrides()
        if overrides:
            cfg = dataclasses.replace(cfg, args=relaunch.apply(cfg.args, overrides))
            log.info("engine arguments overridden", overrides=overrides,
                     throttle_level=self.throttle_level)
        spec = eng.build_spawn_spec(cfg, self.environ)
        self.act.spawn(self.generation, spec, cfg)

    def handle_spawned(self, ev: Spawned) -> None:
        self._spawning = False
        for line in ev.leftovers:
            log.warning("killed a process left by an earlier run", process=line)
            self._audit("leftover_killed", process=line)
        if ev.engine is None:
            log.error("engine could not be started", error=ev.error)
            self._audit("spawn_failed", error=ev.error, gpu_busy=ev.gpu_busy)
            if self.state is State.STOPPING:
                self._finish_stop()
            elif ev.gpu_busy:
                self._start_blocked(ev.error or "GPU busy")
            elif self.state is State.DRAINING:
                self._start_engine(self._restart_reason)
            else:
                self._failure(f"engine could not be started: {ev.error}", healthy_for=None)
            return
        self.start_blocked = None
        engine = ev.engine
        self.engine = engine
        if self.proxy is not None:
            self.proxy.follow_engine(self.name, engine.config.base_url,
                                     engine.config.served_models(), engine.config.models_open)
        log.info("engine spawned", pid=engine.pid, argv=engine.spec.argv)
        self._audit("spawn", pid=engine.pid, generation=engine.generation)
        self.act.watch(engine)
        if self.state in (State.STOPPING, State.DRAINING):
            self._take_down(graceful=True)  # a stop or restart came while it was spawning

    def handle_metrics_sampled(self, ev: MetricsSampled) -> None:
        watching.on_metrics(self, ev)

    def handle_tree_seen(self, ev: TreeSeen) -> None:
        if self.engine is not None and self.engine.generation == ev.generation:
            e = self.engine
            e.known = merge_known(e.known, list(ev.procs))
            e.live_processes = len(ev.procs)
            e.rss_bytes = ev.rss_bytes
            if e.cpu_seen is not None and ev.at > e.cpu_seen[0]:
                # a process that exited takes its CPU seconds with it: never below zero
                used = max(0.0, ev.cpu_s - e.cpu_seen[1])
                e.cpu_percent = round(100 * used / (ev.at - e.cpu_seen[0]), 2)
            e.cpu_seen = (ev.at, ev.cpu_s)
            self.window.add_tree(ev.at, ev.rss_bytes, e.cpu_percent)

    def handle_exited(self, ev: Exited) -> None:
        engine = self.engine
        if engine is None or engine.generation != ev.generation:
            return
        engine.exit_code = ev.code
        self.last_exit = engine.describe_exit()
        exit_fields: dict[str, Any] = {"exit_code": ev.code}
        if ev.code < 0:
            with contextlib.suppress(ValueError):
                exit_fields = {"signal": signal.Signals(-ev.code).name}
        asked = self._taking_down or self.state not in (State.STARTING, State.RUNNING)
        log.info("engine exited", pid=engine.pid, asked=asked, **exit_fields)
        self._audit("exit", pid=engine.pid, asked=asked, **exit_fields)
        if asked:
            return
        # vLLM may exit 0 after its engine core died: any unasked exit is a crash.
        healthy_for = (self.clock.monotonic() - engine.healthy_at
                       if engine.healthy_at is not None else None)
        self._failure(f"engine {self.last_exit} without being asked", healthy_for=healthy_for)

    def handle_health_result(self, ev: HealthResult) -> None:
        engine = self.engine
        if (engine is None or engine.generation != ev.generation
                or self.state is not State.STARTING or self._taking_down):
            return
        now = self.clock.monotonic()
        if ev.healthy:
            engine.healthy_at = now
            self._set_state(State.RUNNING,
                            f"/health answered 200 after {now - engine.started_at:.1f} s")
            if not self._ready_sent:
                self._ready_sent = True
                self.notifier.ready(f"RUNNING: engine pid {engine.pid} serving")
            self.act.serve(engine)
            if self.proxy is None or not self.config.canary.enabled:
                watching.finish_relaunch(self, "ok", None)  # serving: nothing more is waited for
            if self.proxy is not None:
                if self.config.canary.enabled:
                    self.act.gate_probe(engine)
                elif not self.drained_by_operator:
                    self.gate.release()  # no canary configured: healthy is all we know
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
            self._backoff_until = self.clock.monotonic() + verdict.delay_s
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
        self._backoff_until = self.clock.monotonic() + delay
        self._set_state(State.BACKOFF, f"start refused: {why}; checking again in {delay:g} s")
        self._decide("backoff", f"start refused: {why}")
        if not self._ready_sent:
            # systemd's start must not wait on someone else's job: say so, and stay up
            self._ready_sent = True
            self.notifier.ready(f"BACKOFF: start refused: {why}"[:200])
        self._arm_backoff()

    def _give_up(self, reason: str, engine: eng.EngineProcess | None = None) -> None:
        """FATAL, with the last error lines of `engine` (default: the current one)."""
        engine = engine or self.engine
        errors = list(engine.recent_errors) if engine else []
        self.fatal_reason = reason
        self._set_state(State.FATAL, reason)
        watching.finish_relaunch(self, "failed", reason)
        self._decide("give_up", reason)
        log.error("giving up on the engine", reason=reason, last_engine_errors=errors[-10:])
        self.fatal_errors = errors[-10:]
        if not self._ready_sent:
            # The daemon is up and answering even though the engine is not: tell systemd,
            # so that `systemctl start` returns and `status` shows FATAL with the reason.
            self._ready_sent = True
            self.notifier.ready(f"FATAL: {reason}"[:200])

    def _arm_backoff(self) -> None:
        delay = max(0.0, (self._backoff_until or 0.0) - self.clock.monotonic())
        self._backoff = self.act.after(delay, BackoffElapsed(self.generation))

    def _cancel_backoff(self) -> None:
        if self._backoff is not None:
            self._backoff.cancel()
            self._backoff = None
        self._backoff_until = None

    def handle_backoff_elapsed(self, ev: BackoffElapsed) -> None:
        self._backoff = None
        if (self.state is State.BACKOFF and ev.generation == self.generation
                and self.engine is None and not self._spawning):
            self._start_engine("backoff elapsed")

    def _take_down(self, graceful: bool) -> None:
        engine = self.engine
        assert engine is not None and not self._taking_down
        self._taking_down = True
        if self._relaunch is not None and self._relaunch.taken_down_at is None:
            self._relaunch.taken_down_at = self.clock.monotonic()
        req = self._evidence_request(engine)
        self._audit("take_down", pid=engine.pid, graceful=graceful,
                    evidence_for=req.rule if req is not None else None)
        log.info("taking the engine down", pid=engine.pid, graceful=graceful)
        self.act.take_down(engine, graceful, self._force, req)

    def _evidence_request(self, engine: eng.EngineProcess) -> evidence.EvidenceRequest | None:
        pending, self._evidence_for = self._evidence_for, None
        if pending is None or not self.config.evidence.enabled:
            return None
        rule, reason = pending
        pids = [engine.pid, *(p.pid for p in engine.known if p.pid != engine.pid)]
        return evidence.EvidenceRequest(
            reason=reason, rule=rule, engine_pid=engine.pid, pids=pids,
            log_lines=list(engine.recent_lines),
            signals=watching.signals(self, self.clock.monotonic()), gpu=self.window.gpu_snapshot(),
            wall=self.clock.wall())

    def handle_evidence_captured(self, ev: EvidenceCaptured) -> None:
        fields = {"rule": ev.request.rule, "reason": ev.request.reason,
                  "pid": ev.request.engine_pid, **ev.bundle.as_dict()}
        if ev.bundle.error:
            log.error("evidence not captured", **fields)
        else:
            log.info("evidence captured", **fields)
        self._audit("evidence", **fields)

    def handle_down(self, ev: Down) -> None:
        engine = self.engine
        assert engine is not None
        self.engine = None
        self._taking_down = False
        if self._relaunch is not None and self._relaunch.down_at is None:
            self._relaunch.down_at = self.clock.monotonic()
        problem = ev.error
        if ev.result is not None:
            r = ev.result
            engine.exit_code = r.exit_code
            survivors = [proctree.describe(p.pid) for p in r.survivors]
            held = {pid: round(mem / 2**20) for pid, mem in r.gpu_holders.items()}
            fields: dict[str, Any] = {"pid": engine.pid, "duration_s": round(r.duration_s, 3),
                                      "sigkilled": r.sigkilled, "exit": engine.describe_exit()}
            if survivors:
                problem = "processes of the old engine tree survived SIGKILL: " + ", ".join(
                    survivors)
                fields["survivors"] = survivors
            elif held:
                problem = "GPU memory still held by the old engine tree: " + ", ".join(
                    f"pid {p} ({mib} MiB)" for p, mib in held.items())
                fields["gpu_holders_mib"] = held
            if r.port_problem:
                fields["port"] = r.port_problem
            log.info("engine tree reaped", **fields, problem=problem)
            self._audit("reaped", **fields, problem=problem)
        if self.state is State.FATAL:
            self.fatal_errors = list(engine.recent_errors)[-10:]  # now complete
        if problem is None:
            self.act.forget(engine)
        else:
            log.error("engine tree not proven gone", problem=problem)

        if self.state is State.STOPPING:
            if problem:
                self.exit_code = 1
            self._finish_stop()
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
            if not self._force.is_set():
                log.warning("second stop request: skipping to SIGKILL", reason=reason)
                self._audit("force_stop", reason=reason)
                self._force.set()
            return
        self._cancel_backoff()
        self._set_state(State.STOPPING, reason)
        watching.finish_relaunch(self, "abandoned", f"the daemon is stopping: {reason}")
        self._decide("stop", reason)
        self.notifier.stopping(f"STOPPING: {reason}")
        if self.engine is not None and not self._taking_down:
            self._take_down(graceful=True)
        elif self.engine is None and not self._spawning:
            self._finish_stop()
        # otherwise: a take-down (ends in handle_down) or a spawn (ends in handle_spawned)
        # is in flight, and finishes the stop.

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
            if self.engine is not None and not self._taking_down:
                if self.proxy is not None:
                    log.info("restart: new requests held", in_flight=self.gate.in_flight,
                             waiting=self.gate.waiting)
                if graceful and self.proxy is not None \
                        and self.engine.config.drain == "continue":
                    paused = self.proxy.pause_streams(self.name)
                    log.info("restart: streams paused, to go on on the new engine",
                             paused=paused)
                if graceful and self.proxy is not None and self.gate.in_flight:
                    # The gate holds new requests now; let the ones at the engine finish
                    # before SIGTERM (vLLM's own drain aborts streams), bounded.
                    self.act.drain(self.engine)
                else:
                    self._take_down(graceful=graceful)
            # a take-down already running (a crash being reaped) ends in handle_down
        elif s in (State.BACKOFF, State.FATAL):
            self.tracker.reset()
            self.fatal_reason = None
            self._cancel_backoff()
            self._restart_reason = reason
            self._decide("restart", reason)
            if self.engine is None and not self._spawning:
                self._start_engine(reason)
            else:
                self._restart_when_down = True
        elif s is State.DRAINING:
            raise CommandError("a restart is already in progress")
        else:
            raise CommandError(f"the daemon is {s.value}")

    # ---- the watchdog -----------------------------------------------------------------

    def overrides(self) -> dict[str, str | None]:
        """Engine flags the next (or current) start replaces: throttle, reduced batch,
        speculative tokens. None = the flag is removed."""
        level = 0 if self.proxy is not None else self.throttle_level  # live at the proxy
        return relaunch.overrides(self.config.engine.args, self.config.throttle,
                                  level, self.batch_reduced, self.spec_tokens)

    def _gate_limits(self) -> GateLimits:
        p = self.config.proxy
        return GateLimits(concurrency=p.max_concurrency, tokens=p.max_tokens_in_flight,
                          level_factors=tuple(self.config.throttle.level_factors),
                          queue_max=p.hold_queue_max, max_wait_s=p.hold_timeout_s,
                          kv_high=p.kv_breaker_high, kv_low=p.kv_breaker_low)

    def serving(self) -> bool:
        """Serving: the engine runs and the gate lets requests through."""
        return self.state is State.RUNNING and self.gate.held_reason is None \
            and not self._taking_down

    def handle_drained(self, ev: Drained) -> None:
        engine = self.engine
        log.info("proxy drained" if ev.idle else "drain timeout: requests still in flight",
                 waited_s=round(ev.waited_s, 3), in_flight=self.gate.in_flight)
        self._audit("drained", idle=ev.idle, waited_s=round(ev.waited_s, 3))
        if (engine is None or engine.generation != ev.generation or self._taking_down
                or self.state not in (State.DRAINING, State.STOPPING)):
            return  # the engine is gone already (a crash being reaped) or a stop took over
        self._take_down(graceful=True)

    def handle_gate_probe(self, ev: GateProbe) -> None:
        if (self.engine is None or self.engine.generation != ev.generation
                or self.state is not State.RUNNING):
            return
        if not ev.ok:
            log.warning("the first canary failed; releasing held requests anyway",
                        error=ev.error, waiting=self.gate.waiting)
        watching.finish_relaunch(
            self, "ok", None if ev.ok else f"the first canary failed: {ev.error}")
        if self.drained_by_operator:
            log.info("engine ready; requests stay held until `resume`", waiting=self.gate.waiting)
            return
        waiting = self.gate.waiting
        self.gate.release()
        if waiting:
            log.info("held requests released", count=waiting)
            self._audit("released", count=waiting)

    def _count_restart(self, reason: str) -> None:
        self.restarts_by_reason[reason] = self.restarts_by_reason.get(reason, 0) + 1

    # ---- in-place remedies ------------------------------------------------------------

    def handle_sleep_mode_probed(self, ev: SleepModeProbed) -> None:
        watching.on_sleep_mode_probed(self, ev)

    def handle_remedy_done(self, ev: RemedyDone) -> None:
        watching.on_remedy_done(self, ev)

    def handle_canary_done(self, ev: CanaryDone) -> None:
        watching.on_canary_done(self, ev)

    def handle_gpu_sampled(self, ev: GpuSampled) -> None:
        watching.on_gpu_sampled(self, ev)

    async def view(self) -> ExporterView:
        """For the exporter: answered by the state-owning task, so that /healthz fails
        when that task is stuck."""
        reply: asyncio.Future[ExporterView] = asyncio.get_running_loop().create_future()
        self.queue.put_nowait(ViewRequest(reply))
        return await reply

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
        wd = self.notifier.watchdog_interval_s
        # The keep-alive comes from this loop only: a stuck loop stops it, and systemd's
        # watchdog then restarts the daemon.
        if wd is not None and now - self._last_watchdog >= wd:
            self._last_watchdog = now
            self.notifier.watchdog()
        if (not self._ready_sent and self.state in (State.STARTING, State.BACKOFF)
                and now - self._last_extend >= EXTEND_EVERY_S):
            # First start of a large model can take minutes: keep systemd's start timeout
            # ahead of us, but only while the engine is starting.
            self._last_extend = now
            self.notifier.extend_timeout(EXTEND_BY_S)
        if self.config.policy.enabled and self.remedy_running is None:
            # (during an in-place remedy the signals describe the remedy, not the engine)
            watching.evaluate_policy(self, now)

    def handle_reloaded(self, ev: Reloaded) -> None:
        if ev.config is None:
            log.warning("reload refused; the running config stays in force", error=ev.error)
            self._audit("reload_refused", error=ev.error)
            if ev.reply is not None and not ev.reply.done():
                ev.reply.set_exception(CommandError(f"reload refused: {ev.error}"))
            return
        new = ev.config
        plan = reload.plan(diff_keys(self.config, new))
        self.config = new
        # what applies now: every copy of the old config is replaced or reconfigured here
        # (the rest is read from self.config where it is used); supervisor/reload.py
        # says which key applies when
        self.tracker.cfg = new.restart
        set_level(new.log.level)
        self.audit = AuditTrail(new.audit.path, new.audit.max_bytes, new.audit.backups)
        self.window.reconfigure(new.signals.window(new.gpu))
        self.gate.set_limits(self._gate_limits())
        # (a shorter list of level factors: the level stays within it)
        self.throttle_level = min(self.throttle_level, len(new.throttle.level_factors))
        # (the proxy's shared settings are the host's to reconfigure)
        log.info("config reloaded", **plan.as_dict())
        if plan.next_engine_start:
            log.info("engine settings take effect at the next start",
                     keys=list(plan.next_engine_start))
        if plan.next_daemon_start:
            log.warning("these settings take effect only when the daemon restarts",
                        keys=list(plan.next_daemon_start))
        self._audit("reload", **plan.as_dict())
        if ev.reply is not None and not ev.reply.done():
            ev.reply.set_result(plan.as_dict())

    # ---- control ----------------------------------------------------------------------

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

    def status(self) -> dict[str, Any]:
        """What `vllm-supervisorctl status` shows (supervisor/engine/views.py)."""
        return views.status(self)

def runtime_paths_ok(cfg: Config) -> str | None:
    """Create the runtime directory; returns a problem instead of raising."""
    try:
        Path(cfg.daemon.runtime_dir).mkdir(parents=True, exist_ok=True)
        Path(cfg.control.socket).parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return f"cannot create runtime directory: {exc}"
    return None
