"""Handing an engine's traffic to its standby (docs/standby.md), for one engine unit.

`Handover` owns the standby (`supervisor/engine/standby.py`: its place and lifecycle)
and every handover under way: arming the standby (beside the serving engine, or before
it when two engines do not fit side by side), the failover (a crash, a drained restart)
with its wake and its proof, and an upgrade (new arguments: a standby with them, then a
swap). The unit (`supervisor/engine/unit.py`) owns the lifecycle and its state; it calls
in at its steps, and `Handover` acts on it only through `ServingUnit`: the steps of the
serving engine's lifecycle a handover may take. Runs on the unit's task; never blocks.

Invariants:
- nothing but the daemon's proof, sleep and wake reaches a standby before it serves;
- a new standby starts only once the old engine's tree is proven gone and no handover
  is under way (a standby starting while another engine releases the card fails vLLM's
  memory profiling);
- a woken standby serves only after a generation proved it; a failed wake or proof is a
  cold start.
"""

from __future__ import annotations

from typing import Any, Protocol

import structlog

from supervisor import engine_checks
from supervisor.config import Config, EngineConfig
from supervisor.engine import process as eng
from supervisor.engine.effects import Effects
from supervisor.engine.events import Down, Drained, Event, GateProbe, Woken
from supervisor.engine.failures import Failures
from supervisor.engine.gatekeeper import GateKeeper
from supervisor.engine.intents import RelaunchLog
from supervisor.engine.pair_states import HANDING_OVER, PHASE, Phase, Role, check
from supervisor.engine.slot import EngineSlot
from supervisor.engine.standby import Standby
from supervisor.engine.states import State
from supervisor.engine.watch import EngineWatch
from supervisor.loop import Clock

log = structlog.get_logger("supervisor")


class ServingUnit(Protocol):
    """What a handover reads and asks of its engine's unit."""

    @property
    def slot(self) -> EngineSlot: ...  # the serving engine's place (`serve_from` swaps it)

    @property
    def config(self) -> Config: ...
    @property
    def state(self) -> State: ...
    @property
    def environ(self) -> dict[str, str]: ...
    @property
    def fronted(self) -> bool: ...
    @property
    def clock(self) -> Clock: ...
    @property
    def act(self) -> Effects: ...
    @property
    def keeper(self) -> GateKeeper: ...
    @property
    def watch(self) -> EngineWatch: ...
    @property
    def relaunch(self) -> RelaunchLog: ...
    @property
    def engine(self) -> eng.EngineProcess | None: ...
    @property
    def restart_reason(self) -> str: ...
    @property
    def failures(self) -> Failures: ...

    def engine_config(self, bay: int) -> EngineConfig: ...
    def serve_from(self, slot: EngineSlot) -> None: ...
    def spawn_serving(self) -> None: ...
    def take_down(self, graceful: bool) -> None: ...
    def take_down_in(self, slot: EngineSlot, graceful: bool, deadline: float) -> None: ...
    def set_stop_deadline(self, proxy_drain: bool) -> float: ...
    def standby_deadline(self) -> float: ...
    def set_state(self, new: State, reason: str) -> None: ...
    def decide(self, action: str, reason: str) -> None: ...
    def restart_engine(self, reason: str, graceful: bool = True) -> None: ...
    def count_restart(self, reason: str) -> None: ...
    def maybe_finish_stop(self) -> None: ...
    def audit(self, event: str, **fields: Any) -> None: ...


class Handover:
    def __init__(self, unit: ServingUnit, standby: Standby) -> None:
        self.u = unit
        self.standby = standby
        self.failovers = 0
        self.last_failover_s: float | None = None  # fault seen to held requests released
        # the handover under way (supervisor/engine/pair_states.py), and since when
        self.phase = Phase.IDLE
        self.since: float | None = None  # (monotonic; None in IDLE and STANDBY_FIRST)
        # a reload or a policy relaunch changed what the engine runs: a standby with the
        # new arguments, then a swap to it ((why, the restart's reason label) meanwhile;
        # not a phase: the engine serves until the swap, which is a failover like any)
        self._upgrade: tuple[str, str] | None = None

    @property
    def mode(self) -> str:
        return self.u.config.engine.standby

    @property
    def first(self) -> bool:
        """A cold start waits for its standby to be asleep first."""
        return self.phase is Phase.STANDBY_FIRST

    def _set_phase(self, new: Phase) -> None:
        check(PHASE, self.phase, new)
        self.phase = new
        if new not in HANDING_OVER:
            self.since = None
        elif self.since is None:
            self.since = self.u.clock.monotonic()

    def cold_start(self) -> None:
        """A cold start ends any handover, and applies any upgrade."""
        self._set_phase(Phase.IDLE)
        self._upgrade = None

    def serving_failed(self) -> None:
        """The engine that took over failed before the handover ended (it died waiting
        for its wake, or while proven): the handover is over, and nothing more is done
        for it (no wake once the old engine is down, no second failure)."""
        if self.phase in HANDING_OVER:
            log.warning("failover abandoned: the engine that took over failed",
                        phase=self.phase.value)
            self._set_phase(Phase.IDLE)

    def abandon(self, why: str, deadline: float) -> None:
        """No more standby for now: the engine is held down, or the daemon stops (a
        handover under way ends with it)."""
        self._set_phase(Phase.IDLE)
        self.standby.retire(why, graceful=True, deadline=deadline)

    # ---- arming ---------------------------------------------------------------------

    def start_first(self) -> bool:
        """A sleeping standby that cannot start beside the serving engine starts before
        it: proven, put to sleep, then the engine starts beside it (docs/standby.md).
        Whether the engine's spawn waits for that."""
        cfg = self.u.engine_config(self.standby.slot.bay)
        if (cfg.standby != "sleep" or self.standby.ready
                or engine_checks.side_by_side(engine_checks.argv(cfg))):
            return False
        if self.standby.can_start():
            self._set_phase(Phase.STANDBY_FIRST)
            log.info("the standby starts first: the engine starts beside it once it "
                     "sleeps (no room for it to start beside the engine)")
            self.arm(due=True)
        elif self.standby.on_its_way or not self.standby.idle:
            # on its way, or an engine in its place still being taken down (its memory
            # not yet released: two engines do not fit)
            self._set_phase(Phase.STANDBY_FIRST)
        return self.first

    def arm(self, due: bool = False) -> None:
        """A standby in its free place, when one is configured and the engine serves (or
        waits for it to sleep first); after a failure, once its backoff is `due`."""
        u, mode = self.u, self.mode
        if self._replaced_if_out_of_date():
            return
        if (mode == "none" or not self.standby.can_start() or self.phase in HANDING_OVER
                or (u.state is not State.RUNNING and not self.first)):
            return
        cfg = u.engine_config(self.standby.slot.bay)
        # (an awake standby's share was checked at load; on CPU no share is given)
        if mode == "sleep" and not self.first \
                and not engine_checks.side_by_side(engine_checks.argv(cfg)):
            share = engine_checks.gpu_share(engine_checks.argv(cfg)) \
                or engine_checks.DEFAULT_GPU_SHARE
            self.standby.no_room(
                f"two engines at --gpu-memory-utilization {share:g} do not fit on the "
                f"card: a standby starts again before the engine's next cold start")
            return
        if self.standby.failures and not due:
            r = u.config.restart
            self.standby.due_later(r.backoff_initial_s, r.backoff_max_s)
            return
        self.standby.start(eng.build_spawn_spec(cfg, u.environ), cfg, mode)

    def _replaced_if_out_of_date(self) -> bool:
        """A ready standby started before a reload changed the arguments, when no upgrade
        could begin (nothing served), is replaced once the engine serves, so that the
        next failover runs what a start would. Whether it was."""
        u = self.u
        if (self.standby.ready and u.state is State.RUNNING and self.phase is Phase.IDLE
                and self._upgrade is None and not self.fits()):
            self.standby.retire("its arguments are out of date", graceful=True,
                                deadline=u.standby_deadline())
            return True
        return False

    def due(self) -> None:
        """The standby's backoff is over."""
        self.standby.due()
        self.arm(due=True)

    def on_event(self, ev: Event) -> None:
        """An event of the engine in the standby's place (the standby, or the old serving
        engine being taken down there), and what follows from it."""
        u = self.u
        if isinstance(ev, Drained):  # (the old engine's, behind a swap)
            self.drained_behind(ev)
            return
        free = self.standby.handle(ev, u.standby_deadline(),
                                   stopping=u.state is State.STOPPING)
        if self.phase is Phase.WAKING_WHEN_DOWN and isinstance(ev, Down):
            if u.state is not State.RUNNING or u.engine is None or u.slot.taking_down:
                # a restart or a stop overtook the handover: nothing to wake, and the
                # engine being taken down is theirs to finish
                self._set_phase(Phase.IDLE)
            elif self.standby.state is Role.FAILED:
                self._set_phase(Phase.WAKING)
                self.takeover_failed(f"the old engine's tree was not proven gone "
                                     f"({self.standby.why}): not waking the standby")
            else:
                self._set_phase(Phase.WAKING)  # the old engine is gone, its memory released
                u.act.wake(u.engine)
        if u.state is State.STOPPING:
            u.maybe_finish_stop()
        elif self.first and not self.standby.on_its_way:
            if self.standby.ready or self.standby.idle:
                self._set_phase(Phase.IDLE)
                if (u.state is State.STARTING and u.engine is None
                        and not u.slot.spawning):
                    u.spawn_serving()  # beside the sleeping standby (or without one)
        elif free:
            self.arm()
        else:
            self._replaced_if_out_of_date()  # (it may have become ready just now)
        if self._upgrade is not None and u.state is State.RUNNING and self.fits():
            (why, label), self._upgrade = self._upgrade, None
            log.info("upgrade: the standby runs the new arguments; swapping to it", why=why)
            u.relaunch.standby_ready()  # (a policy relaunch: its steps say so)
            u.count_restart(label)
            u.restart_engine(f"upgrade: {why}")  # (drained, then `swap_or_take_down`)

    # ---- an upgrade -----------------------------------------------------------------

    def begin_upgrade(self, why: str, label: str) -> bool:
        """What the serving engine runs changed (a reload: a new vLLM, a model revision; a
        policy relaunch: fewer speculative tokens, a smaller batch): with a standby, one is
        started with the new arguments, proven, then swapped in, so that no client waits
        for a cold start, and the engine serves meanwhile. Whether that began; without a
        standby (or room for one beside the engine) a reload's change applies at the next
        start, a relaunch restarts cold."""
        u, e = self.u, self.u.engine
        if self.mode == "none" or u.state is not State.RUNNING or e is None:
            return False
        cfg = u.engine_config(u.slot.bay)
        spec = eng.build_spawn_spec(cfg, u.environ)
        if (spec.argv, spec.env, spec.cwd) == (e.spec.argv, e.spec.env, e.spec.cwd):
            return False  # (nothing the engine runs changed: a timeout, a grace...)
        if cfg.standby == "sleep" and not engine_checks.side_by_side(engine_checks.argv(cfg)):
            log.info("no room for a standby beside the engine: no upgrade through one",
                     why=why)
            return False
        self._upgrade = (why, label)
        log.info("upgrade: starting a standby with the new arguments", why=why)
        u.audit("upgrade", why=why)
        if self.standby.ready or self.standby.on_its_way:
            self.standby.retire("its arguments are out of date", graceful=True,
                                deadline=u.standby_deadline())
        self.standby.cancel_timer()
        self.standby.due()  # (a backoff under way is over: the arguments changed)
        self.standby.forget_failures()
        self.arm(due=True)  # (now if its place is free; else once it is)
        return True

    # ---- the failover ---------------------------------------------------------------

    def fits(self) -> bool:
        """A ready standby that runs what a start now would run."""
        cfg = self.u.engine_config(self.standby.slot.bay)
        return self.standby.fits(eng.build_spawn_spec(cfg, self.u.environ))

    def swaps_at_once(self) -> bool:
        """A drained restart need not hold new requests while the engine's finish: the
        standby is ready, up to date and awake (nothing to wait for before it serves), so
        it takes the new requests now and those at the old engine end there behind it
        (`fail_over(drain_behind=True)`)."""
        return self.fits() and not self.standby.asleep

    def swap_or_take_down(self, graceful: bool) -> None:
        """A drained restart: the standby takes over when it is ready and up to date;
        else the engine is taken down for a cold start (and an out-of-date standby is
        replaced)."""
        if self.fits():
            self.fail_over(self.u.restart_reason, graceful)
            return
        if self.standby.ready:
            self.standby.retire("its arguments are out of date", graceful=True,
                                deadline=self.u.set_stop_deadline(proxy_drain=False))
        self.u.take_down(graceful)

    def fail_over(self, reason: str, graceful: bool, drain_behind: bool = False) -> None:
        """The ready standby serves now: the proxy sends this engine's requests to it
        (streams in flight are continued on it, held requests go to it once it answered
        a generation); the old engine is taken down in the standby's place, and a new
        standby starts there once that tree is proven gone. A sleeping standby is woken
        first: at once when the two engines fit on the card side by side, else once the
        old engine's memory is released (a wake before that fails and wedges it).
        `drain_behind` (a drained restart to an awake standby): the requests at the old
        engine finish there first, up to its drain timeout, and then it is taken down."""
        u = self.u
        old = u.slot
        # the old engine's take-down keeps within the restart's deadline (or one from now)
        take_down = old.engine is not None and not old.taking_down and not drain_behind
        deadline = u.set_stop_deadline(proxy_drain=False) if take_down else 0.0
        new, asleep = self.standby.take_over(old)
        u.serve_from(new)  # (the restart is over: its deadline with it)
        engine = new.engine
        assert engine is not None
        self.failovers += 1
        log.warning("failover: the standby serves", reason=reason, pid=engine.pid,
                    port=engine.spec.port, old_pid=old.engine.pid if old.engine else None,
                    asleep=asleep)
        u.audit("failover", reason=reason, pid=engine.pid, port=engine.spec.port,
                old_pid=old.engine.pid if old.engine else None, graceful=graceful,
                asleep=asleep)
        u.decide("failover", reason)
        if u.state is State.DRAINING:
            u.set_state(State.RUNNING, f"the standby took over ({reason})")
        if not asleep:
            self._set_phase(Phase.PROVING)
            self._serve(engine)
        elif old.engine is not None \
                and not engine_checks.side_by_side(engine_checks.argv(engine.config)):
            self._set_phase(Phase.WAKING_WHEN_DOWN)  # (woken in `on_event`)
        else:
            self._set_phase(Phase.WAKING)
            u.act.wake(engine)
        if take_down:
            u.take_down_in(old, graceful, deadline)
        elif drain_behind and old.engine is not None and not old.taking_down:
            log.info("swap: the requests at the old engine finish there",
                     pid=old.engine.pid, generation=old.engine.generation)
            u.act.drain_behind(old.engine, u.standby_deadline())
        u.relaunch.taken_down()
        u.relaunch.down()

    def _serve(self, engine: eng.EngineProcess) -> None:
        """The proxy's route goes to the engine that took over; held requests go once it
        answered a generation (a woken one always: a wake can leave a broken engine)."""
        u = self.u
        if u.fronted:
            u.act.follow(engine)
        u.act.serve(engine)
        if self.phase is Phase.PROVING_WOKEN or (u.fronted and u.config.canary.enabled):
            u.act.gate_probe(engine)
        else:
            u.keeper.admit()
            u.relaunch.finish("ok", None)
            self.done()

    def drained_behind(self, ev: Drained) -> None:
        """The requests at the old engine after a swap have ended (or its drain timeout
        ran out): it is taken down now, in the standby's place (unless it went already,
        or the daemon's stop took it down)."""
        old = self.standby.slot
        if old.engine is not None and old.engine.generation == ev.generation \
                and not old.taking_down:
            log.info("swap: the old engine drained" if ev.idle else
                     "swap: drain timeout, requests still at the old engine",
                     pid=old.engine.pid, waited_s=round(ev.waited_s, 3))
            self.u.audit("drained", idle=ev.idle, waited_s=round(ev.waited_s, 3),
                         pid=old.engine.pid, behind_swap=True)
            self.u.take_down_in(old, True, self.u.standby_deadline())

    def woken(self, ev: Woken) -> None:
        u = self.u
        engine = u.slot.current(ev.generation)
        if engine is None or u.slot.taking_down or self.phase is not Phase.WAKING:
            return
        if ev.error is not None:
            self.takeover_failed(f"the standby did not wake: {ev.error}")
            return
        log.info("standby woken", pid=engine.pid, seconds=round(ev.seconds, 3))
        u.audit("standby_woken", pid=engine.pid, seconds=round(ev.seconds, 3))
        self._set_phase(Phase.PROVING_WOKEN)
        self._serve(engine)

    def proof_failed(self, ev: GateProbe) -> bool:
        """The first generation after a handover answered: whether it was a woken
        standby's that failed (then the handover failed: a cold start)."""
        if self.phase is not Phase.PROVING_WOKEN or ev.ok:
            return False  # (a proof that passed: `done` ends the handover)
        self.takeover_failed(f"its first generation after waking failed: {ev.error}")
        return True

    def takeover_failed(self, reason: str) -> None:
        """The standby that took over cannot serve: today's path, a cold start after a
        backoff (the woken engine is taken down)."""
        log.error("failover failed: cold start", reason=reason)
        self.u.audit("failover_failed", reason=reason)
        self._set_phase(Phase.IDLE)  # (not `cold_start`: an upgrade ends at the next one)
        engine = self.u.engine
        healthy_for = (self.u.clock.monotonic() - engine.healthy_at
                       if engine is not None and engine.healthy_at is not None else None)
        self.u.failures.fail(reason, healthy_for=healthy_for)

    def done(self) -> None:
        """The handover is over: held requests go to the standby now, and a new standby
        may start in the old engine's place once it is free."""
        if self.since is not None:
            self.last_failover_s = round(self.u.clock.monotonic() - self.since, 3)
            self._set_phase(Phase.IDLE)
            log.info("failover done", seconds=self.last_failover_s)
            self.u.audit("failover_done", seconds=self.last_failover_s)
            self.arm()

    def status(self, now: float) -> dict[str, Any]:
        """`status`'s `standby`: `"ready"` when armed (awake or asleep, and proven)."""
        if self.mode == "none" and self.standby.idle:
            return {"state": "none"}
        return {"mode": self.mode, **self.standby.status(now)}
