"""Handing an engine's traffic to its standby (docs/standby.md), for one engine unit.

`Handover` owns the standby (`supervisor/engine/pair/standby.py`: its place and lifecycle)
and every handover under way: arming the standby (beside the serving engine, or before
it when two engines do not fit side by side), the failover (a crash, a drained restart)
with its wake and its proof, and an upgrade (new arguments: a standby with them, then a
swap). A decider: the unit (`supervisor/engine/unit.py`) calls in at its steps with its state as
`PairFacts`, and carries out the steps returned (`supervisor/engine/steps.py`: serve from
the standby's place, wake, take down, admit...); `Handover` writes only its own state (the
phase, `supervisor/engine/pair/pair_states.py`, the upgrade waiting, the counts) and its
standby's. Runs on the unit's task; never blocks.

Invariants:
- nothing but the daemon's health checks, its probe of the development routes, proof,
  sleep and wake reaches a standby before it serves;
- a new standby starts only once the old engine's tree is proven gone and no handover
  is under way (a standby starting while another engine releases the card fails vLLM's
  memory profiling);
- a woken standby serves only after a generation proved it; a failed wake or proof is a
  cold start.
"""

from __future__ import annotations

import dataclasses
from datetime import datetime

import structlog

from supervisor.engine import steps as do
from supervisor.engine.events import Drained, Event, GateProbe, HostCacheEmptied, Woken
from supervisor.engine.pair import copy_start, early_wake, outcomes, rearm, weights_ahead
from supervisor.engine.pair.pair_states import HANDING_OVER, PHASE, Phase, Role, check
from supervisor.engine.pair.standby import Standby
from supervisor.engine.process import process as eng
from supervisor.engine.states import State
from supervisor.engine.steps import PairFacts, Step
from supervisor.settings import engine_checks
from supervisor.settings.sections import EngineConfig
from supervisor.watchdog.remedy import REST, WEIGHTS

log = structlog.get_logger("supervisor")


class Handover:
    def __init__(self, standby: Standby) -> None:
        self.standby = standby
        self.failovers = 0
        self.served = False  # an engine of this unit served (pair/copy_start.py)
        self.last_failover_s: float | None = None  # fault seen to held requests released
        # the handover under way (supervisor/engine/pair/pair_states.py), and since when
        self.phase = Phase.IDLE
        self.since: float | None = None  # (monotonic; None in IDLE and STANDBY_FIRST)
        # a reload or a policy relaunch changed what the engine runs: a standby with the
        # new arguments, then a swap to it ((why, the restart's reason label) meanwhile;
        # not a phase: the engine serves until the swap, which is a failover like any)
        self._upgrade: tuple[str, str] | None = None
        self.rearmed_on: str | None = None  # the quiet window used (the day it began)
        # a failover that woke the standby's weights before the old engine's memory was
        # released: "asked", then "back" (None: none, or its whole wake waits for that)
        self._weights: str | None = None
        # ... and their host backup let go before the rest wakes (a copy that serves in
        # place of a cold start: pair/copy_start.py)
        self._let_go = False
        # (an asymmetric pair, `engine.standby_args`: while the thin standby serves, which
        # the serving bay's spawn says, `f.slot.thin`, a full-size engine starts beside it
        # and takes over again, as an upgrade)

    @property
    def first(self) -> bool:
        """A cold start waits for its standby to be asleep first."""
        return self.phase is Phase.STANDBY_FIRST

    def _set_phase(self, new: Phase, now: float) -> None:
        check(PHASE, self.phase, new)
        self.phase = new
        if new not in HANDING_OVER:
            self.since = None
        elif self.since is None:
            self.since = now
        if new in (Phase.IDLE, Phase.PROVING_WOKEN):
            self._weights, self._let_go = None, False

    def cold_start(self, f: PairFacts) -> list[Step]:
        """A cold start ends any handover, and applies any upgrade. A full-size engine in
        the standby's place of an asymmetric pair (the re-arm beside a thin one that
        served) is taken down: the engine starting now is full-size."""
        self._set_phase(Phase.IDLE, f.now)
        self._upgrade = None
        st = self.standby
        st.weights_off = None  # (a new serving engine: its room is measured afresh)
        if f.thin_pair and not st.thin and not st.idle and not st.slot.taking_down:
            return st.retire("a cold start: the standby's place is for a thin one",
                             graceful=False, deadline=f.standby_deadline())
        return []

    def serving_failed(self, f: PairFacts) -> None:
        """The engine that took over failed before the handover ended (it died waiting
        for its wake, or while proven): the handover is over, and nothing more is done
        for it (no wake once the old engine is down, no second failure)."""
        if self.phase in HANDING_OVER:
            log.warning("failover abandoned: the engine that took over failed",
                        phase=self.phase.value)
            self._set_phase(Phase.IDLE, f.now)

    def abandon(self, why: str, deadline: float, now: float) -> list[Step]:
        """No more standby for now: the engine is held down, or the daemon stops (a
        handover under way ends with it)."""
        self._set_phase(Phase.IDLE, now)
        return self.standby.retire(why, graceful=True, deadline=deadline)

    # ---- arming ---------------------------------------------------------------------

    def start_first(self, f: PairFacts) -> tuple[bool, list[Step]]:
        """A sleeping standby that cannot start beside the serving engine starts before
        it: proven, put to sleep, then the engine starts beside it (docs/standby.md).
        Whether the engine's spawn waits for that, and the steps that start it."""
        cfg = f.engine_config(self.standby.slot.bay)
        st = self.standby
        if f.thin_pair and not st.idle and (not st.thin or st.state is Role.RETIRING):
            # a full-size engine there still (being taken down): two do not fit; or any
            # engine being taken down there (the thin one that served, after a fault):
            # an engine starting while another releases the card fails vLLM's profiling
            self._set_phase(Phase.STANDBY_FIRST, f.now)
            return True, []
        if (served := copy_start.serves(self, f)) is not None:
            return True, served  # (no engine spawned: the copy serves)
        if st.restoring:
            # a copy being restored: the engine starts once it is ready (asleep, room
            # beside it), never beside a process whose GPU memory still grows (vLLM's
            # start would count it as its own and keep a smaller KV cache)
            self._set_phase(Phase.STANDBY_FIRST, f.now)
            return True, []
        if (cfg.standby not in engine_checks.SLEEPING or self.standby.ready
                or engine_checks.side_by_side(cfg)
                or (self.standby.restorable(f.standby_spec(self.standby.slot.bay))
                    and not self.standby.adopted and self.standby.idle)):
            # (a copy of the kept images is restored beside the engine, asleep, once its
            # place is free; the first of an earlier run's goes first, while a fresh
            # standby could still start)
            return False, []
        why = self.standby.no_sleep(cfg)
        if why is not None:
            # (it would be refused once proven: the engine starts alone, and its own
            # probe says again whether engines so started can sleep)
            log.info("no standby first: an engine so started cannot sleep", why=why)
            return False, []
        out: list[Step] = []
        if self.standby.can_start():
            self._set_phase(Phase.STANDBY_FIRST, f.now)
            log.info("the standby starts first: the engine starts beside it once it "
                     "sleeps (no room for it to start beside the engine)")
            out = self.arm(f, due=True)
        elif self.standby.on_its_way or not self.standby.idle:
            # on its way, or an engine in its place still being taken down (its memory
            # not yet released: two engines do not fit)
            self._set_phase(Phase.STANDBY_FIRST, f.now)
        return self.first, out

    def arm(self, f: PairFacts, due: bool = False) -> list[Step]:
        """A standby in its free place, when one is configured and the engine serves (or
        waits for it to sleep first); after a failure, once its backoff is `due`."""
        mode = f.config.engine.standby
        if f.slot.thin and self._upgrade is None and mode != "none":
            # the re-arm of an asymmetric pair: the full-size engine beside the thin one
            self._upgrade = ("re-arm: a full-size engine takes over from the thin standby "
                             "that serves", "rearm")
        replaced = self._replaced_if_out_of_date(f)
        if replaced is not None:
            return replaced
        if (mode == "none" or not self.standby.can_start() or self.phase in HANDING_OVER
                or (f.state is not State.RUNNING and not self.first)):
            return []
        full = f.slot.thin  # (else the standby's own arguments, thin or not)
        bay = self.standby.slot.bay
        cfg = f.engine_config(bay) if full else f.standby_config(bay)
        # (an awake standby's share was checked at load; on CPU no share is given; a
        # copy of a snapshot's images is restored asleep beside the engine)
        if mode in engine_checks.SLEEPING and not self.first \
                and not engine_checks.side_by_side(f.config.engine) \
                and not (mode == "snapshot" and self.standby.restorable(f.standby_spec(bay))):
            share = engine_checks.gpu_share(engine_checks.argv(cfg)) \
                or engine_checks.DEFAULT_GPU_SHARE
            why = self.standby.no_sleep(cfg)
            self.standby.no_room(
                f"two engines at --gpu-memory-utilization {share:g} do not fit on the "
                f"card: a standby starts again before the engine's next cold start"
                if why is None else
                f"no sleeping standby: the engine cannot sleep ({why}), and two engines "
                f"at --gpu-memory-utilization {share:g} do not fit on the card awake")
            return []
        if self.standby.failures and not due:
            r = f.config.restart
            return self.standby.due_later(r.backoff_initial_s, r.backoff_max_s)
        if full:
            log.info("re-arm: a full-size engine starts beside the thin one that serves, "
                     "to take over from it")
        # (the full-size one awake: it serves as soon as it is proven)
        spec = f.spawn_spec(bay) if full else f.standby_spec(bay)
        if mode == "snapshot":  # (a copy of its images, or one to be dumped)
            spec = self.standby.snapshot_spec(spec, cfg)
        return self.standby.start(spec, cfg, "awake" if full else mode)

    def _replaced_if_out_of_date(self, f: PairFacts) -> list[Step] | None:
        """A ready standby started before a reload changed the arguments, when no upgrade
        could begin (nothing served), is replaced once the engine serves, so that the
        next failover runs what a start would. The steps that replace it; None when it
        is not replaced."""
        if (self.standby.ready and f.state is State.RUNNING and self.phase is Phase.IDLE
                and self._upgrade is None and not self.fits(f)):
            return self.standby.retire("its arguments are out of date", graceful=True,
                                       deadline=f.standby_deadline())
        return None

    def engine_probed(self, engine: eng.EngineProcess) -> None:
        """The serving engine's development routes were probed at its start: whether a
        standby so started could sleep, as far as it says (`Standby.learned`)."""
        self.standby.learned(engine)
        self.served = True

    def due(self, f: PairFacts) -> list[Step]:
        """The standby's backoff is over."""
        self.standby.due()
        return self.arm(f, due=True)

    def on_event(self, f: PairFacts, ev: Event) -> list[Step]:
        """An event of the engine in the standby's place (the standby, or the old serving
        engine being taken down there) other than its process's (`on_outcome`), and what
        follows from it."""
        if isinstance(ev, Drained):  # (the old engine's, behind a swap)
            return self.drained_behind(f, ev)
        if isinstance(ev, Woken):  # (a ready standby's weights, woken ahead of a fault)
            return self._followed(f, False, weights_ahead.woken(self.standby, f, ev),
                                  released=False)
        if isinstance(ev, HostCacheEmptied):  # (... and then their backup let go)
            return weights_ahead.host_cache_emptied(self.standby, ev)
        free, out = self.standby.handle(ev, f.standby_deadline(),
                                        awake_fits=engine_checks.side_by_side(f.config.engine))
        return self._followed(f, free, out, released=False)

    def on_outcome(self, f: PairFacts, outcome: outcomes.Outcome) -> list[Step]:
        """The process of the engine in the standby's place, as its bay read it
        (`EngineSlot.on`), and what follows from it."""
        free, out = self.standby.on_outcome(outcome, f.standby_deadline(),
                                            stopping=f.state is State.STOPPING)
        # (the old engine's memory is released once NVML lists none of its tree, or its
        # tree is gone: the first of the two wakes a standby that waits for it)
        released = isinstance(outcome, outcomes.Gone | outcomes.CardFreed)
        return self._followed(f, free, out, released=released)

    def _followed(self, f: PairFacts, free: bool, out: list[Step],
                  released: bool) -> list[Step]:
        """What follows the standby's own steps: a wake waiting for the old engine's
        memory (`released`: its tree is gone, or NVML lists none of it), the stop's end, a
        standby armed in a freed place, an upgrade whose standby is ready."""
        if self.phase is Phase.WAKING_WHEN_DOWN and released:
            if f.state is not State.RUNNING or f.engine is None or f.slot.taking_down:
                # a restart or a stop overtook the handover: nothing to wake, and the
                # engine being taken down is theirs to finish
                self._set_phase(Phase.IDLE, f.now)
            elif self.standby.state is Role.FAILED:
                self._set_phase(Phase.WAKING, f.now)
                # (a failure: nothing else follows from this event)
                return [*out, *self.takeover_failed(
                    f, f"the old engine's tree was not proven gone ({self.standby.why}): "
                    f"not waking the standby")]
            else:
                self._set_phase(Phase.WAKING, f.now)  # the old engine's memory released
                if self._weights != "asked":  # (else once they are: `_weights_woken`)
                    out.append(do.Wake(f.engine, REST if self._weights == "back" else ()))
        if f.state is State.STOPPING:
            out.append(do.MaybeFinishStop())
        elif self.first and not self.standby.on_its_way:
            if self.standby.next_now and self.standby.idle:
                # (just dumped: its copy is restored before the engine starts beside it;
                # the dump failed: a sleeping standby first, as with "sleep")
                out += self.arm(f, due=True)
            if not self.standby.on_its_way and (self.standby.ready or self.standby.idle):
                self._set_phase(Phase.IDLE, f.now)
                if (f.state is State.STARTING and f.engine is None
                        and not f.slot.spawning):
                    out += copy_start.serves(self, f) or [do.SpawnServing()]  # (beside it)
        elif free:
            out += self.arm(f)
        else:
            out += self._replaced_if_out_of_date(f) or []  # (it may be ready just now)
        if self._upgrade is not None and f.state is State.RUNNING and self.fits(f):
            (why, label), self._upgrade = self._upgrade, None
            log.info("upgrade: the standby runs the new arguments; swapping to it", why=why)
            # (a policy relaunch: its steps say so; drained, then `swap_or_take_down`)
            out += [do.Relaunch("standby_ready"), do.CountRestart(label),
                    do.RestartEngine(f"upgrade: {why}")]
        return out

    # ---- re-arming ------------------------------------------------------------------

    def tick(self, f: PairFacts, local: datetime) -> list[Step]:
        """At each tick: a ready standby's weights woken ahead of a fault or taken back
        (pair/weights_ahead.py), and the quiet window's re-arm (pair/rearm.py)."""
        return [*weights_ahead.steps(self.standby, f, idle=self.phase is Phase.IDLE),
                *rearm.in_window(self, f, local)]

    # ---- an upgrade -----------------------------------------------------------------

    def begin_upgrade(self, f: PairFacts, why: str, label: str) -> list[Step] | None:
        """What the serving engine runs changed (a reload: a new vLLM, a model revision; a
        policy relaunch: fewer speculative tokens, a smaller batch): with a standby, one is
        started with the new arguments, proven, then swapped in, so that no client waits
        for a cold start, and the engine serves meanwhile. Its steps, or None when none
        began: without a standby (or room for one beside the engine) a reload's change
        applies at the next start, a relaunch restarts cold."""
        e = f.engine
        if f.config.engine.standby == "none" or f.state is not State.RUNNING or e is None:
            return None
        cfg = f.engine_config(f.slot.bay)
        # (a thin standby serving runs the standby's arguments: a re-arm is under way)
        spec = f.standby_spec(f.slot.bay) if f.slot.thin else f.spawn_spec(f.slot.bay)
        if (spec.argv, spec.env, spec.cwd) == (e.spec.argv, e.spec.env, e.spec.cwd):
            return None  # (nothing the engine runs changed: a timeout, a grace...)
        if cfg.standby in engine_checks.SLEEPING and not engine_checks.side_by_side(cfg):
            log.info("no room for a standby beside the engine: no upgrade through one",
                     why=why)
            return None
        self._upgrade = (why, label)
        log.info("upgrade: starting a standby with the new arguments", why=why)
        out: list[Step] = []
        if self.standby.ready or self.standby.on_its_way:
            out += self.standby.retire("its arguments are out of date", graceful=True,
                                       deadline=f.standby_deadline())
        out += self.standby.cancel_timer()
        self.standby.due()  # (a backoff under way is over: the arguments changed)
        self.standby.forget_failures()
        out += self.arm(f, due=True)  # (now if its place is free; else once it is)
        return [*out, do.Audit("upgrade", {"why": why})]

    # ---- the failover ---------------------------------------------------------------

    def fits(self, f: PairFacts) -> bool:
        """A ready standby that runs what a start now would run: a standby's arguments,
        or, while the thin standby of an asymmetric pair serves, the engine's."""
        bay = self.standby.slot.bay
        return self.standby.fits(f.spawn_spec(bay) if f.slot.thin
                                 else f.standby_spec(bay))

    def swaps_at_once(self, f: PairFacts) -> bool:
        """A drained restart need not hold new requests while the engine's finish: the
        standby is ready, up to date and awake (nothing to wait for before it serves), so
        it takes the new requests now and those at the old engine end there behind it
        (`fail_over(drain_behind=True)`)."""
        return self.fits(f) and not self.standby.asleep

    def swap_or_take_down(self, f: PairFacts, graceful: bool) -> list[Step]:
        """A drained restart: the standby takes over when it is ready and up to date;
        else the engine is taken down for a cold start (and an out-of-date standby is
        replaced)."""
        if self.fits(f):
            return self.fail_over(f, f.restart_reason, graceful)
        out: list[Step] = []
        if self.standby.ready or (f.slot.thin and self.standby.on_its_way):
            # (a full-size engine starting beside the thin one: two would not fit)
            deadline = f.restart_deadline(proxy_drain=False)
            out.append(do.StopDeadline(deadline))
            out += self.standby.retire("its arguments are out of date", graceful=True,
                                       deadline=deadline)
        return [*out, do.TakeDown(graceful)]

    def fail_over(self, f: PairFacts, reason: str, graceful: bool,
                  drain_behind: bool = False, let_go: bool = False) -> list[Step]:
        """The ready standby serves now: the proxy sends this engine's requests to it
        (streams in flight are continued on it, held requests go to it once it answered
        a generation); the old engine is taken down in the standby's place, and a new
        standby starts there once that tree is proven gone. A sleeping standby is woken
        first: at once when the two engines fit on the card side by side, else once the
        old engine's memory is released (a wake before that fails and wedges it).
        `drain_behind` (a drained restart to an awake standby): the requests at the old
        engine finish there first, up to its drain timeout, and then it is taken down.
        `let_go` (a sleeping one, no old engine): its weights first, then their pinned
        host backup let go, then the rest (pair/copy_start.py)."""
        old = f.slot
        # a thin engine handing back to a full-size one (an asymmetric pair's re-arm) is
        # kept, to be the standby again once its requests ended
        keep = (old.thin and graceful and old.engine is not None
                and old.engine.exit_code is None and not old.taking_down
                and old.engine.spec.argv == f.standby_spec(old.bay).argv)
        # the old engine's take-down keeps within the restart's deadline (or one from now)
        take_down = (old.engine is not None and not old.taking_down and not drain_behind
                     and not keep)
        deadline = f.restart_deadline(proxy_drain=False) if take_down else 0.0
        # its weights on the card already, or on their way there (pair/weights_ahead.py)
        ahead = self.standby.weights
        new, asleep = self.standby.take_over(old, keep=keep)
        engine = new.engine
        assert engine is not None
        self.failovers += 1
        self.served = True
        old_pid = old.engine.pid if old.engine else None
        log.warning("failover: the standby serves", reason=reason, pid=engine.pid,
                    port=engine.config.port, old_pid=old_pid, asleep=asleep,
                    **({"thin": new.thin, "old_kept": keep} if f.thin_pair else {}))
        # a sleeping standby woken once the old engine's memory is released: its weights
        # meanwhile, where they fit beside it
        when_down = asleep and old.engine is not None \
            and not engine_checks.side_by_side(f.config.engine)
        early = when_down and ahead is None and early_wake.weights_fit(f, engine)
        out: list[Step] = [
            do.ServeFrom(),  # (the restart is over: its deadline with it)
            do.Audit("failover", {"reason": reason, "pid": engine.pid,
                                  "port": engine.config.port, "old_pid": old_pid,
                                  "graceful": graceful, "asleep": asleep,
                                  **({"weights_early": True} if early else {}),
                                  **({"weights_ahead": ahead} if ahead else {})}),
            do.Decide("failover", reason)]
        if f.state is State.DRAINING:
            out.append(do.SetState(State.RUNNING, f"the standby took over ({reason})"))
        # what follows reads the unit as these steps leave it
        f = dataclasses.replace(f, slot=new, stop_deadline=None, state=State.RUNNING
                                if f.state is State.DRAINING else f.state)
        if not asleep:
            self._set_phase(Phase.PROVING, f.now)
            out += self._serve(f, engine)
        elif when_down:
            self._set_phase(Phase.WAKING_WHEN_DOWN, f.now)  # (woken in `_followed`)
            # every client waits for the old engine's memory now: its requests are done,
            # paused for continuation or past the drain's timeout (vLLM's own SIGTERM
            # would abort them too), so it is killed, not waited for (a graceful exit of
            # an 8B engine took 4.6 s on the H100; its memory, once killed, 0.3 s)
            graceful = False
            if early:
                self._weights = "asked"
                out.append(do.Wake(engine, WEIGHTS))
            elif ahead is not None:  # (the rest once the old memory is released and they
                # are back)
                self._weights = ahead
        else:
            self._set_phase(Phase.WAKING, f.now)
            self._weights = ahead
            if ahead is None and let_go:
                self._weights, self._let_go = "asked", True
                out.append(do.Wake(engine, WEIGHTS))
            elif ahead is None:
                out.append(do.Wake(engine))
            elif ahead == "back":  # (else the rest once they are: `_weights_woken`)
                out.append(do.Wake(engine, REST))
        if take_down:
            out.append(do.TakeDownIn(old.bay, graceful, deadline))
        elif (drain_behind or keep) and old.engine is not None and not old.taking_down:
            log.info("swap: the requests at the old engine finish there",
                     pid=old.engine.pid, generation=old.engine.generation)
            out.append(do.DrainBehind(old.engine, f.standby_deadline()))
        return [*out, do.Relaunch("taken_down"), do.Relaunch("down")]

    def _serve(self, f: PairFacts, engine: eng.EngineProcess) -> list[Step]:
        """The proxy's route goes to the engine that took over; held requests go once it
        answered a generation (a woken one always: a wake can leave a broken engine)."""
        out: list[Step] = [do.Follow(engine)] if f.fronted else []
        woken = self.phase is Phase.PROVING_WOKEN
        prove = woken or (f.fronted and f.config.canary.enabled)
        out += [do.Serve(engine), *do.proof(engine, prove=prove, golden=woken, woken=woken)]
        return out if prove else [*out, *self.done(f)]  # (unproven: the handover is over)

    def drained_behind(self, f: PairFacts, ev: Drained) -> list[Step]:
        """The requests at the old engine after a swap have ended (or its drain timeout
        ran out): it is taken down now, in the standby's place (unless it went already,
        or the daemon's stop took it down)."""
        old = self.standby.slot
        if old.engine is None or old.engine.generation != ev.generation \
                or old.taking_down:
            return []
        log.info("swap: the old engine drained" if ev.idle else
                 "swap: drain timeout, requests still at the old engine",
                 pid=old.engine.pid, waited_s=round(ev.waited_s, 3))
        out: list[Step] = [do.Audit("drained", {
            "idle": ev.idle, "waited_s": round(ev.waited_s, 3), "pid": old.engine.pid,
            "behind_swap": True})]
        if self.standby.state is Role.RETURNING:
            if ev.idle and f.state is not State.STOPPING:
                # (the thin one: the standby)
                return [*out, *self.standby.keep(f.config.engine.standby)]
            return [*out, *self.standby.retire(
                "its requests did not end within the drain's timeout", graceful=True,
                deadline=f.standby_deadline())]
        return [*out, do.TakeDownIn(old.bay, True, f.standby_deadline())]

    def woken(self, f: PairFacts, ev: Woken) -> list[Step]:
        engine = f.slot.current(ev.generation)
        if ev.tags == WEIGHTS:
            return self._weights_woken(f, ev, engine)
        if engine is None or f.slot.taking_down or self.phase is not Phase.WAKING:
            return []
        if ev.error is not None:
            return self.takeover_failed(f, f"the standby did not wake: {ev.error}")
        # the daemon's calls (POST /wake_up, GET /is_sleeping) and vLLM's own wake
        woken = {"pid": engine.pid, "seconds": round(ev.seconds, 3), "vllm_s": ev.vllm_s}
        log.info("standby woken", **woken)
        self._set_phase(Phase.PROVING_WOKEN, f.now)
        return [do.Audit("standby_woken", woken), *self._serve(f, engine)]

    def _weights_woken(self, f: PairFacts, ev: Woken,
                       engine: eng.EngineProcess | None) -> list[Step]:
        """The standby's weights are back (or not) while the old engine's memory was
        being released: the rest of it wakes once that is (at once if it is already)."""
        if (engine is None or f.slot.taking_down or self._weights != "asked"
                or self.phase not in (Phase.WAKING_WHEN_DOWN, Phase.WAKING)):
            return []  # (the handover ended meanwhile)
        if ev.error is not None:
            return self.takeover_failed(f, f"the standby's weights did not wake: {ev.error}")
        self._weights = "back"
        woken = {"pid": engine.pid, "seconds": round(ev.seconds, 3), "vllm_s": ev.vllm_s}
        log.info("standby's weights woken: their host backup let go next" if self._let_go
                 else "standby's weights woken while the old engine's memory is released",
                 **woken)
        out: list[Step] = [do.Audit("standby_weights_woken", woken)]
        if self.phase is Phase.WAKING and self._let_go:
            out.append(do.EmptyHostCache(engine))  # (the rest once it answered)
        elif self.phase is Phase.WAKING:  # (the old engine's memory was released first)
            out.append(do.Wake(engine, REST))
        return out

    def host_cache_emptied(self, f: PairFacts, ev: HostCacheEmptied) -> list[Step]:
        """The answer of the pinned host cache emptied of the engine taking over
        (`let_go`): the rest of it wakes now, the cache emptied or not."""
        engine = f.slot.current(ev.generation)
        if (engine is None or f.slot.taking_down or self.phase is not Phase.WAKING
                or not self._let_go or self._weights != "back"):
            log.info("host cache answer of an engine no longer the standby",
                     emptied=ev.emptied, generation=ev.generation, error=ev.error)
            return []
        self._let_go = False
        fields = {"pid": engine.pid, "seconds": round(ev.seconds, 3),
                  "worker_s": ev.worker_s}
        if ev.emptied:
            log.info("pinned host cache emptied before the engine serves: its death "
                     "gives the card back at once", **fields)
        else:
            log.warning("pinned host cache not emptied: its death gives the card back "
                        "later", error=ev.error, **fields)
        return [do.Audit("standby_host_cache_emptied" if ev.emptied
                         else "standby_host_cache_kept",
                         {**fields, **({} if ev.emptied else {"error": ev.error})}),
                do.Wake(engine, REST)]

    def proof_failed(self, f: PairFacts, ev: GateProbe) -> list[Step] | None:
        """The first generation after a handover answered: the steps when it was a woken
        standby's that failed (then the handover failed: a cold start), else None."""
        if ev.golden_mismatch and self.phase in (Phase.PROVING, Phase.PROVING_WOKEN):
            return self.takeover_failed(f, f"the engine that took over: {ev.error}")
        if self.phase is not Phase.PROVING_WOKEN or ev.ok:
            return None  # (a proof that passed: `done` ends the handover)
        return self.takeover_failed(f, f"its first generation after waking failed: "
                                    f"{ev.error}")

    def takeover_failed(self, f: PairFacts, reason: str) -> list[Step]:
        """The standby that took over cannot serve: today's path, a cold start after a
        backoff (the woken engine is taken down)."""
        log.error("failover failed: cold start", reason=reason)
        self._set_phase(Phase.IDLE, f.now)  # (not `cold_start`: an upgrade ends at the next)
        engine = f.engine
        healthy_for = (f.now - engine.healthy_at
                       if engine is not None and engine.healthy_at is not None else None)
        return [do.Audit("failover_failed", {"reason": reason}),
                do.Fail(reason, healthy_for)]

    def done(self, f: PairFacts) -> list[Step]:
        """The handover is over: held requests go to the standby now, and a new standby
        may start in the old engine's place once it is free."""
        if self.since is None:
            return []
        self.last_failover_s = round(f.now - self.since, 3)
        self._set_phase(Phase.IDLE, f.now)
        log.info("failover done", seconds=self.last_failover_s)
        # (a standby in the freed place: armed as the unit is once these steps ran, the
        # two bays swapped by a failover's `ServeFrom` among them)
        return [do.ArmStandby(), do.Audit("failover_done", {"seconds": self.last_failover_s})]

    def sleeping_standby_off(self, cfg: EngineConfig) -> str | None:
        """With `standby = "sleep"` in `cfg` (the engine's): why no standby sleeps (kept
        awake, or none), as the last probe of an engine of the unit said; None when one
        can, or nothing says otherwise."""
        why = self.standby.no_sleep(cfg) if cfg.standby in engine_checks.SLEEPING else None
        if why is None:
            return None
        if engine_checks.side_by_side(cfg):
            return f"{why}: the standby is kept awake"
        return f"{why}: no standby (an awake one does not fit beside the engine)"
