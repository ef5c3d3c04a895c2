"""One engine's unit: the single task that owns that engine's state.

Everything that happens reaches `EngineUnit.handle` as a typed event
(`supervisor/engine/events.py`) on one queue: the engine's exit, its health, the end of a
take-down, a backoff timer, a signal, a control request, a reloaded config, a tick. The
events of a process's life, whichever bay it is in, are read once here (`_on_process`:
its bay's `EngineSlot.on`, `supervisor/engine/pair/outcomes.py`), what every process's life
needs done (`steps.lifecycle`), and the outcome handed to the role in that bay: the
serving engine's (`supervisor/engine/pair/serving.py`), the standby's, the weight cache's,
each a decider that returns steps; every other event goes to a `handle_<name>` method.
Each may change state (only through `set_state`, which checks the transition table);
the jobs (spawn, probe, take down, drain, follow at the proxy) are started by the one
executor (`supervisor/engine/executor.py`), the only caller of the effects protocol
(`supervisor/engine/effects/protocol.py`). Jobs report back only by putting an event on
the queue; no handler blocks.

The unit's state and the one executor of the steps that change it are `UnitState`'s
(`supervisor/engine/unit_state.py`); this class is the task that feeds it events. Its
watchdog half (`EngineWatch`, `supervisor/engine/watch.py`) owns the signals, the
policy's memory and the settings it tunes, and asks for what it wants as intents
(`supervisor/engine/intents.py`) that `Remedies` (`supervisor/engine/remedies.py`) turns
into steps. Its standby and every handover to it (arming the standby, the failover with
its wake and proof, an upgrade through the standby) are `Handover`'s
(`supervisor/engine/pair/handover.py`), and an engine's failures (the backoff after one, a
start refused for a busy GPU, giving up) `Failures`' (`supervisor/engine/failures.py`):
deciders that read the unit as `PairFacts` and return steps
(`supervisor/engine/steps.py`), which `run_steps` carries out.
After every event, `sync_gate` alone opens, holds or closes the proxy's gate for this
engine, from the unit's state.

Invariants:
- at most one engine process in each of its two bays (the serving one's and, with a
  standby, the standby's: `supervisor/engine/pair/pair_states.py`): a new one is spawned in a
  bay only after the previous one's take-down there has proven its tree gone
  (`serving.on_process`'s `Gone`, `Standby.handle`);
- any exit the daemon did not ask for is a crash, whatever the exit code;
- every wait is bounded (startup timeout, drain + grace, reap and GPU-release timeouts).
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import structlog

from supervisor.engine import commands, views
from supervisor.engine import steps as do
from supervisor.engine.events import (
    BackoffElapsed,
    CacheDue,
    CanaryDone,
    ControlRequest,
    Drained,
    Event,
    EvidenceCaptured,
    GateProbe,
    GpuSampled,
    HealthLost,
    HostCacheEmptied,
    KvTierSeen,
    MetricsSampled,
    Reloaded,
    RemedyDone,
    SignalReceived,
    SleepModeProbed,
    Slept,
    StandbyDue,
    Tick,
    ViewRequest,
    Woken,
)
from supervisor.engine.pair import outcomes as out
from supervisor.engine.pair import serving
from supervisor.engine.pair.standby import made_of
from supervisor.engine.process import kv_tier
from supervisor.engine.process import process as eng
from supervisor.engine.snapshot import criu
from supervisor.engine.states import State
from supervisor.engine.unit_state import UnitState
from supervisor.engine.watch import xid_text
from supervisor.ops.exposition import ExporterView
from supervisor.watchdog import remedy, warmup, xid

log = structlog.get_logger("supervisor")

KEPT_READ_S = 10.0  # how long the start waits to read the standby's kept images' manifest




@dataclass
class EngineUnit(UnitState):
    # ---- running ----------------------------------------------------------------------

    async def run(self) -> int:
        """Run until the engine is stopped for good. Returns its exit status. The host
        (supervisor/host.py) owns the signals, the sockets and the proxy around it."""
        if self.config.several:  # every line of this unit and its jobs names its engine
            structlog.contextvars.bind_contextvars(engine=self.name)
        self.executor.begin(self.notices.tick_interval(self.tick_interval_s), self.sampler)
        await self._kept_images()
        self.start("daemon started")
        try:
            while not self._done:
                self.handle(await self.queue.get())
        except BaseException:
            # A bug in a handler: do not leave the engine running without its supervisor
            # (nor its weight cache: their guards are disarmed as the unit ends).
            if self.engine is not None:
                log.critical("daemon failing; killing the engine's process group",
                             pid=self.engine.pid, exc_info=True)
            self.executor.kill_now(self.engine, self.weights.slot.engine)
            self.exit_code = 70  # EX_SOFTWARE
            raise
        finally:
            self.sync_gate(ended=True)
            await self.executor.end()
        return self.exit_code

    async def _kept_images(self) -> None:
        """`standby = "snapshot"`: the images an earlier run of the daemon left in this
        boot of the host, adopted by the standby (a copy of them, not a start and a dump,
        when they are of what a start would run). A read that hangs is given up."""
        cfg = self.config.engine
        if cfg.standby != "snapshot":
            return
        images = eng.snapshot_images(cfg.snapshot_dir)
        try:
            found = await asyncio.wait_for(asyncio.to_thread(criu.kept, Path(images)),
                                           KEPT_READ_S)
        except TimeoutError:
            log.warning("the standby's kept images not read in time: made afresh",
                        images=images, within_s=KEPT_READ_S)
            return
        if found is None:
            return
        standby = self.handover.standby
        why = criu.stale(found.made_of, made_of(self.pair_facts().standby_spec(
            standby.slot.bay)))
        if why is not None:  # (a start dumps afresh, over them)
            log.info("the standby's kept images are of another start: made afresh",
                     images=images, why=why)
            return
        standby.adopt(found.made_of, found.port, images, found.warmed,
                      found.vllm_version, found.weights_bytes)

    def handle(self, event: Event) -> None:
        """One event, by its `handle_<name>` method (the standby's engine's, by the
        standby); then the gate follows the state."""
        if isinstance(event, GateProbe):  # (a proof: right, not just alive)
            standby = self.handover.standby.slot
            engine = standby.current(event.generation) or self.slot.current(event.generation)
            event = self.golden.judge(event, engine, self.config.canary.golden_tolerance)
            if event.warm_up is not None and engine is not None:
                self._warmed_up(engine, event.warm_up)
            if event.warmed is not None and engine is not None:
                self._paths_warmed(engine, event.warmed)
            if event.broken_by_wake:  # (the serving engine's or a standby's)
                self.handover.standby.warm_up = False
                self.watch.wake_broken = (
                    f"a wake broke an engine of this unit ({event.error}): no sleep "
                    "until the daemon restarts")
        # (evidence and a remedy's end are the unit's whichever engine they were about:
        # an old engine's remedy must still end, and its operator be answered)
        if isinstance(event, out.PROCESS_EVENTS):
            self._on_process(event)
        elif self.weights.owns(event):
            self.run_steps(self.weights.handle(event))
            self.cache_moved()
        elif self.handover.standby.owns(event) \
                and not isinstance(event, EvidenceCaptured | RemedyDone):
            self.run_steps(self.handover.on_event(self.pair_facts(), event))
        else:
            handler: Callable[[Any], None] = getattr(self, f"handle_{event.name}")
            handler(event)
        self.sync_gate()

    def _warmed_up(self, engine: eng.EngineProcess, w: remedy.WarmUp) -> None:
        fields = {"pid": engine.pid, "steps_s": {k: round(v, 3) for k, v in w.steps.items()},
                  "vllm_s": w.vllm_s, "host_cache": w.host_cache}
        if w.skipped is not None:
            log.info("no warm-up sleep: its sleep mode did not answer", why=w.skipped,
                     **fields)
        elif w.error is not None:
            log.warning("the warm-up sleep failed", error=w.error, broken=w.broken,
                        **fields)
        else:
            log.info("sleep path warmed: the engine slept and woke before it serves",
                     **fields)
        self.audit("warmed_up", ok=w.error is None and w.skipped is None,
                   error=w.error or w.skipped, **fields)

    def _paths_warmed(self, engine: eng.EngineProcess, w: warmup.Warmed) -> None:
        """An engine process's first proof asked every client path once: kept on the
        engine (a later proof of it does not ask again), logged and audited."""
        slowest = w.slowest()
        fields = {"pid": engine.pid, "took_s": round(w.took_s, 3),
                  "slowest": {"path": slowest[0], "s": slowest[1]} if slowest else None,
                  "paths": w.paths}
        if w.ok:
            engine.warmed = w
            log.info("client paths warmed before the engine serves", **fields)
        else:
            log.error("warm-up failed: the engine did not answer", error=w.error, **fields)
        self.audit("paths_warmed", ok=w.ok, error=w.error, **fields)

    def start(self, reason: str) -> None:
        """The first start (tests start the unit's engine here too): the weight cache
        first, when the engine has one (its start waits for it)."""
        self.run_steps(self.weights.want(self.config.engine, self.environ,
                                         self.config.weight_cache_dir))
        self.start_engine(reason)
        self.sync_gate()

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

    # ---- a process's life, in every bay (read once: EngineSlot.on) --------------------

    def _on_process(self, ev: out.ProcessEvent) -> None:
        """One event of a process's life, whichever bay it is in: read once by its bay
        (`EngineSlot.on`, as the role there says it reads), what every process's life
        needs carried out (`steps.lifecycle`), then the outcome handed to the role: the
        weight cache, the standby (through the handover) or the serving engine
        (`supervisor/engine/pair/serving.py`)."""
        now = self.clock.monotonic()
        stopping = self.state is State.STOPPING
        if self.weights.owns(ev):
            reads = self.weights.reads(ev)
            if reads is not None:
                outcome = self.weights.slot.on(ev, now, awaits_health=reads[0],
                                               exit_expected=reads[1])
                self.run_steps([*do.lifecycle(outcome),
                                *self.weights.on_outcome(outcome, stopping)])
            self.cache_moved()
            return
        standby = self.handover.standby
        if standby.owns(ev):
            awaits, expected = standby.reads()
            outcome = standby.slot.on(ev, now, awaits_health=awaits, exit_expected=expected)
            self.run_steps(do.lifecycle(outcome))
            self.run_steps(self.handover.on_outcome(self.pair_facts(), outcome))
            return
        # (a restart's drain asks nothing of the engine itself: its death then is news,
        # and ends the drain: `serving.on_process`)
        live = self.state in (State.STARTING, State.RUNNING, State.DRAINING)
        outcome = self.slot.on(ev, now, awaits_health=self.state is State.STARTING,
                               exit_expected=not live)
        self.run_steps(do.lifecycle(outcome))
        if isinstance(outcome, out.Seen):  # (the watchdog's: into its signal window)
            tree = outcome.tree
            self.watch.window.add_tree(tree.at, tree.rss_bytes, outcome.cpu_percent,
                                       tree.host_temperature_c,
                                       self.facts().settled() and self.watch.remedy is None,
                                       host_memory_stall_percent=tree.host_memory_stall_percent)
            return
        f = self.pair_facts()
        self.run_steps(serving.on_process(
            f, outcome, standby_fits=isinstance(outcome, out.Died) and self.handover.fits(f),
            warm=self.watch.wake_broken is None))

    def handle_backoff_elapsed(self, ev: BackoffElapsed) -> None:
        self.run_steps(self.failures.backoff_elapsed(self.pair_facts(), ev))

    def handle_evidence_captured(self, ev: EvidenceCaptured) -> None:
        fields = {"rule": ev.request.rule, "reason": ev.request.reason,
                  "pid": ev.request.engine_pid, **ev.bundle.as_dict()}
        if ev.bundle.error:
            log.error("evidence not captured", **fields)
        else:
            log.info("evidence captured", **fields)
        self.audit("evidence", **fields)

    # ---- the weight cache's events (its process's go to it: engine/pair/weight_cache.py) --

    def handle_cache_due(self, _: CacheDue) -> None:
        self.run_steps(self.weights.due())
        self.cache_moved()

    def handle_health_lost(self, ev: HealthLost) -> None:
        """(a process gone since: the weight cache's are handed to it)"""

    # ---- the standby's events (the handover's: supervisor/engine/pair/handover.py) ---------

    def handle_standby_due(self, _: StandbyDue) -> None:
        self.run_steps(self.handover.due(self.pair_facts()))

    def handle_woken(self, ev: Woken) -> None:
        self.run_steps(self.handover.woken(self.pair_facts(), ev))

    def handle_host_cache_emptied(self, ev: HostCacheEmptied) -> None:
        """The answer of a host cache emptied of an engine no longer in the standby's
        place: the one taking over, its rest woken next; else (it went, or took over
        after its weights' wake ahead) logged, nothing follows."""
        self.run_steps(self.handover.host_cache_emptied(self.pair_facts(), ev))

    def handle_slept(self, ev: Slept) -> None:
        """The answer of a sleep asked of a standby no longer in its place (retired, its
        tree gone, another standby there now): stale, as every event of a gone engine."""
        log.debug("stale sleep answer ignored", generation=ev.generation)

    # ---- the watchdog's events --------------------------------------------------------

    def handle_metrics_sampled(self, ev: MetricsSampled) -> None:
        self.watch.on_metrics(ev, self.facts())
        if ev.snapshot is not None and self.engine is not None \
                and self.engine.generation == ev.generation:
            self.gate.set_kv_usage(ev.snapshot.kv_cache_usage)
            refusals = ev.snapshot.kv_offload_refusals_total
            if refusals is not None and self.config.engine.kv_tier:
                said = self.kv_tier.refused.saw(ev.generation, refusals,
                                                self.clock.monotonic())
                if said:
                    log.warning("KV tier refused stores", refused=said,
                                total=self.kv_tier.refused.total,
                                detail=kv_tier.refused_warning(self.config.engine, said))

    def handle_canary_done(self, ev: CanaryDone) -> None:
        self.watch.on_canary_done(ev, self.facts())

    def handle_gpu_sampled(self, ev: GpuSampled) -> None:
        self.watch.on_gpu_sampled(ev, self.engine, self.facts().settled())
        listed, e = ev.reading.process_memory, self.engine
        if listed and e is not None and not e.gpu_listed:  # (`takedown.card_released`)
            e.gpu_listed = e.pid in listed or any(p.pid in listed for p in e.known)
        if self.state is State.STARTING and self.engine is not None \
                and not self.slot.taking_down:
            self._xid_while_starting(ev)

    def _xid_while_starting(self, ev: GpuSampled) -> None:
        """An XID on the engine's GPUs while it starts ends the start now, as the rules
        `xid_restart` and `xid_reset` end a serving engine's run (they judge only an
        engine that serves, and a start on a broken GPU can hang until its timeout): one
        that a restart clears is a failed start (a backoff, then the next start); one that
        needs a GPU reset or a reboot holds the engine down. A rule disabled, or the policy
        off or in dry run, leaves the start alone (the XID is logged and audited anyway)."""
        p = self.config.policy
        by_rule: dict[str, list[str]] = {}
        for gpu, code in ev.reading.xids_by_gpu():
            rule = xid.rule_for(xid.describe(code).remedy)
            cfg = p.rules.get(rule) if rule is not None else None
            if rule is not None and p.enabled and cfg is not None and cfg.enabled:
                by_rule.setdefault(rule, []).append(xid_text(gpu, code))
        if not by_rule:
            return
        if p.dry_run:
            log.warning("an XID while the engine starts: dry run, the start goes on",
                        xids=[x for xs in by_rule.values() for x in xs])
            return
        f = self.pair_facts()
        if "xid_reset" in by_rule:
            # (no grace: vLLM ignores SIGTERM until it serves)
            self.run_steps([*self.failures.give_up(
                f, f"{', '.join(by_rule['xid_reset'])} while the engine started; the GPU "
                "needs a reset or a reboot, so the engine stays down until "
                "`vllm-supervisorctl restart`"), do.TakeDown(graceful=False)])
        else:
            self.run_steps(self.failures.fail(
                f, f"{', '.join(by_rule['xid_restart'])} while the engine started",
                healthy_for=None))

    def handle_sleep_mode_probed(self, ev: SleepModeProbed) -> None:
        self.watch.on_sleep_mode_probed(ev, self.facts())

    def handle_remedy_done(self, ev: RemedyDone) -> None:
        ev = self.golden.judge_remedy(ev, self.slot.current(ev.generation),
                                      self.config.canary.golden_tolerance)
        self.run_steps(self.remedies.done(ev, self.watch, self.facts(), self.gate.waiting))

    def handle_drained(self, ev: Drained) -> None:
        engine = self.engine
        log.info("proxy drained" if ev.idle else "drain timeout: requests still in flight",
                 waited_s=round(ev.waited_s, 3), in_flight=self.gate.in_flight)
        self.audit("drained", idle=ev.idle, waited_s=round(ev.waited_s, 3))
        if (engine is None or engine.generation != ev.generation or self.slot.taking_down
                or self.state not in (State.DRAINING, State.STOPPING)):
            return  # the engine is gone already (a crash being reaped) or a stop took over
        if self.state is State.DRAINING:
            self.run_steps(self.handover.swap_or_take_down(self.pair_facts(), graceful=True))
        else:
            self.take_down(graceful=True)

    def handle_gate_probe(self, ev: GateProbe) -> None:
        """The serving engine's proof: a failed one of a standby that took over is the
        handover's; the rest its role's (`serving.proved`)."""
        if (self.engine is None or self.engine.generation != ev.generation
                or self.state is not State.RUNNING):
            return
        failed = self.handover.proof_failed(self.pair_facts(), ev)
        self.run_steps(failed if failed is not None
                       else serving.proved(ev, self.golden_failures))

    def handle_view_request(self, ev: ViewRequest) -> None:
        if not ev.reply.done():
            ev.reply.set_result(views.exporter_view(self))

    # ---- signals, ticks, reload -------------------------------------------------------

    def handle_signal_received(self, ev: SignalReceived) -> None:
        name = signal.Signals(ev.signum).name
        if ev.signum != signal.SIGHUP:  # (a reload is the host's: supervisor/host.py)
            self.begin_stop(f"{name} received")

    def handle_tick(self, _: Tick) -> None:
        now = self.clock.monotonic()
        self.notices.tick(now, starting=self.state in (State.STARTING, State.BACKOFF))
        self.carry_out(self.watch.evaluate(now, self.facts()))
        self.run_steps(self.handover.tick(self.pair_facts(),
                                          datetime.fromtimestamp(self.clock.wall())))

    def handle_kv_tier_seen(self, ev: KvTierSeen) -> None:
        self.kv_tier.saw(ev.folder, ev.usage)

    def handle_reloaded(self, ev: Reloaded) -> None:
        commands.reloaded(self, ev)

    # ---- control: what `supervisor/engine/commands.py` asks -----------------------------

    def handle_control_request(self, ev: ControlRequest) -> None:
        commands.run(self, ev)

