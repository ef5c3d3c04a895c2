"""An engine unit's bays (the serving engine, its standby, and the weight cache beside
them: supervisor/settings/bays.py) as a Hypothesis state machine: events fed in any order
the world allows, over the recording effects and the driven clock of
tests/unit_world.py, with no process.

The world is modelled from the effects log alone: a spawn asked and not yet answered, an
engine spawned and not yet taken down (its health, proof, sleep, wake, exit, core),
the take-downs, drains, probes, sleeps and wakes asked and not yet answered, the timers
set and not cancelled. A rule feeds only what that world could report now: a pending
spawn completes or fails, a watched engine answers its health or times out, a proof
passes or fails, a sleep or a wake works or not, any live engine (serving, standby,
starting, asleep, retiring) exits or loses its core unasked, a weight cache loses its
health, a take-down or a snapshot standby's dump ends (its tree proven gone or not, its
images made or not), a drain ends, a timer fires (or,
just cancelled, had fired already), requests arrive and end, the clock moves, a KV
reset or the probe of sleep mode ends; and the operator restarts, resets the KV cache,
reloads (new arguments or not; the weight cache on or off) and stops.

After every step:
- never two processes (live or being spawned) in one bay, never three engines at all,
  and with no room beside each other (`standby = "sleep"` at vLLM's default share) a
  spawn or a wake only while every other engine sleeps;
- each role and its bay's phase agree (pair_states' joint tables: the unit's state and
  the serving bay, the standby's role and its bay, the weight cache's state and its bay);
- an engine spawns on the weight cache exactly when the cache is ready, and the serving
  one never while the cache starts or stops;
- only a proven, sleeping standby is dumped, and a copy of its images is restored only
  where a sleeping engine fits on the card;
- the proxy follows a standby that took over only once it was proven and awake; nothing
  but its proof and its sleep reach a standby before that; held requests are released
  only by a proof of the engine the proxy follows (answered since its last health or
  wake; an ok one for a woken standby), and only while it is RUNNING and alive;
- each timer's delay and each take-down's or drain's deadline is bounded;
- STOPPED only after a stop, with nothing spawned left and nothing being spawned;
- the unit never raises.
At the end of every run: with every pending effect answered well and every timer fired,
the pair comes to rest (RUNNING with its gate open and its standby ready or out of room,
FATAL, or STOPPED) with no dead engine left in a place and a weight cache ready (or given
up); then a stop ends STOPPED with nothing left running.

Each bug it found is kept as its shortest sequence (tests/test_pair_machine_found.py, or
beside the code it fixed): a regression test once fixed, a strict xfail while open (its
check tolerated in the machine, `KNOWN_BUGS`, so that the machine goes on looking for
others).
"""

from __future__ import annotations

import asyncio
import shutil
from collections import deque
from collections.abc import Callable
from typing import Any, cast

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from supervisor.engine.events import (
    CardReleased,
    CoreExited,
    Down,
    Drained,
    Event,
    Exited,
    GateProbe,
    GpuSampled,
    HealthLost,
    HealthResult,
    HostCacheEmptied,
    Reloaded,
    RemedyDone,
    SleepModeProbed,
    Slept,
    Spawned,
    Tick,
    Woken,
)
from supervisor.engine.pair.pair_states import CACHE_BAYS, ROLE_BAYS, SERVING_BAYS, Bay, Cache
from supervisor.engine.process.process import EngineProcess
from supervisor.engine.process.takedown import TakeDown
from supervisor.settings.bays import BAYS, WEIGHT_CACHE_BAY
from supervisor.settings.config import parse_config
from supervisor.watchdog.gpu import GpuReading
from supervisor.watchdog.remedy import REST, WEIGHTS, RemedyOutcome
from tests.hypothesis_profiles import examples
from tests.pair_model import PairModel
from tests.pair_world import (
    ANSWERS_TO_REST,
    CARD_BYTES,
    GIB,
    MODES,
    ROOM_BESIDE,
    SLEEPING_MODES,
    Timer,
    share_of,
    world,
)


class PairMachine(PairModel, RuleBasedStateMachine):
    @initialize(mode=st.sampled_from(sorted(MODES)), weights_gib=st.sampled_from([4, 8]),
                ahead=st.booleans())
    def start(self, mode: str, weights_gib: int, ahead: bool) -> None:
        # (4 GiB fit beside a 0.9 engine and a sleeping one on the card, 8 do not);
        # `ahead`: a sleeping standby's weights woken ahead of a fault where they fit
        self.mode, self.weights_bytes = mode, weights_gib * GIB
        self.cache_on = bool(MODES[mode].get("weight_cache"))
        gpu = ahead and mode in SLEEPING_MODES
        self._w = world(self.tmp, mode, "gpu" if gpu else "host")
        self.failing = True
        self.w.sup.start("test")
        self.absorb()
        self.failing = False

    # ---- what the engines' jobs report ----------------------------------------------

    def new_engine(self, generation: int) -> EngineProcess:
        spawn = self.spawns[generation]
        self.w.next_pid += 1
        return EngineProcess(
            generation=generation, proc=cast(asyncio.subprocess.Process, None),
            pid=self.w.next_pid, started_at=self.w.now, spec=spawn["spec"],
            config=spawn["cfg"], recent_errors=deque(maxlen=20), bay=spawn["bay"])

    @precondition(lambda self: self.running and bool(self.spawns))
    @rule(data=st.data())
    def spawn_completes(self, data: st.DataObject) -> None:
        gen = data.draw(st.sampled_from(sorted(self.spawns)), label="generation")
        self.feed(Spawned(gen, self.new_engine(gen)))

    @precondition(lambda self: self.running and bool(self.spawns))
    @rule(data=st.data(), gpu_busy=st.booleans())
    def spawn_fails(self, data: st.DataObject, gpu_busy: bool) -> None:
        gen = data.draw(st.sampled_from(sorted(self.spawns)), label="generation")
        why = "other processes hold the GPUs" if gpu_busy else "port in use"
        self.feed(Spawned(gen, None, why, gpu_busy=gpu_busy))

    @precondition(lambda self: self.running and bool(self.unhealthy_yet()))
    @rule(data=st.data(), healthy=st.booleans())
    def health_answers(self, data: st.DataObject, healthy: bool) -> None:
        gen = data.draw(st.sampled_from(self.unhealthy_yet()), label="generation")
        p = self.procs[gen]
        self.feed(HealthResult(gen, healthy and not p.dead and not p.down))
        self.gpu_reads()  # (the sampler reads the card soon after)

    @precondition(lambda self: self.running and bool(self.pending_of("gate_probe")))
    @rule(data=st.data(), ok=st.booleans())
    def proof_answers(self, data: st.DataObject, ok: bool) -> None:
        gen = data.draw(st.sampled_from(self.pending_of("gate_probe")), label="generation")
        p = self.procs[gen]
        ok = ok and not p.dead and not p.down and not p.asleep
        self.feed(GateProbe(gen, ok, None if ok else "timed out after 5 s"))

    @precondition(lambda self: self.running and bool(self.pending_of("sleep")))
    @rule(data=st.data(), ok=st.booleans())
    def sleep_answers(self, data: st.DataObject, ok: bool) -> None:
        gen = data.draw(st.sampled_from(self.pending_of("sleep")), label="generation")
        p = self.procs[gen]
        ok = ok and not p.dead and not p.down
        self.feed(Slept(gen, None if ok else "POST /sleep?level=1: HTTP 500", 0.2))
        self.gpu_reads()

    @precondition(lambda self: self.running and bool(self.wakes()))
    @rule(data=st.data(), ok=st.booleans())
    def wake_answers(self, data: st.DataObject, ok: bool) -> None:
        kind, gen = data.draw(st.sampled_from(self.wakes()), label="wake")
        self.feed(self.woken(kind, gen, ok))

    @precondition(lambda self: self.running and bool(self.pending_of("host_cache")))
    @rule(data=st.data(), ok=st.booleans())
    def host_cache_answers(self, data: st.DataObject, ok: bool) -> None:
        gen = data.draw(st.sampled_from(self.pending_of("host_cache")), label="generation")
        self.feed(self.host_cache_emptied(gen, ok))

    def host_cache_emptied(self, gen: int, ok: bool) -> HostCacheEmptied:
        p = self.procs[gen]
        ok = ok and not p.dead and not p.down
        return HostCacheEmptied(gen, ok, 0.5, 0.48 if ok else None,
                                None if ok else "POST /collective_rpc: HTTP 500")

    def wakes(self) -> list[tuple[str, int]]:
        return sorted((k, g) for k, g in self.pending if k.startswith("wake"))

    def woken(self, kind: str, gen: int, ok: bool) -> Woken:
        p = self.procs[gen]
        ok = ok and not p.dead and not p.down
        tags = {"wake_weights": WEIGHTS, "wake_rest": REST}.get(kind, ())
        return Woken(gen, None if ok else "POST /wake_up: HTTP 500: CUDA OOM", 0.6, None, tags)

    @precondition(lambda self: self.running)
    @rule()
    def gpu_reads(self) -> None:
        """NVML's reading of the card now (the GPU sampler's, every `gpu.period_s`)."""
        if not self.running:
            return
        used = self.card_used()
        self.feed(GpuSampled(GpuReading(memory_used_bytes=used,
                                        memory_total_bytes=CARD_BYTES), self.w.now))

    @precondition(lambda self: self.running and any(not p.exited for p in self.live))
    @rule(data=st.data(), code=st.sampled_from([0, 1, -9, -15]))
    def engine_exits(self, data: st.DataObject, code: int) -> None:
        gen = data.draw(st.sampled_from(sorted(p.gen for p in self.live if not p.exited)),
                        label="generation")
        self.feed(Exited(gen, code))

    @precondition(lambda self: self.running and any(not p.dead for p in self.engines))
    @rule(data=st.data())
    def engine_core_exits(self, data: st.DataObject) -> None:
        """(an engine's: the weight cache's process serves no requests, and its exit
        follows its core's, which `engine_exits` feeds)"""
        gen = data.draw(st.sampled_from(sorted(p.gen for p in self.engines if not p.dead)),
                        label="generation")
        self.feed(CoreExited(gen, self.procs[gen].pid + 1))

    def healthy_cache(self) -> list[int]:
        return [p.gen for p in self.live if p.bay == WEIGHT_CACHE_BAY and p.healthy
                and not p.dead and not p.down_asked]

    @precondition(lambda self: self.running and bool(self.healthy_cache()))
    @rule()
    def cache_loses_its_health(self) -> None:
        """The weight cache's /health fails in a row, while it is up."""
        self.feed(HealthLost(self.healthy_cache()[0], "/health answered 503 (3 times)"))

    @precondition(lambda self: self.running and bool(self.pending_of("take_down")))
    @rule(data=st.data(), proven_gone=st.booleans(), dumped=st.booleans(),
          released_first=st.booleans())
    def take_down_ends(self, data: st.DataObject, proven_gone: bool, dumped: bool,
                       released_first: bool) -> None:
        """(`dumped`: a dump, if it was one, made its images; `released_first`: NVML
        stopped listing the tree just before its end, `CardReleased` first)"""
        gen = data.draw(st.sampled_from(self.pending_of("take_down")), label="generation")
        if released_first and not self.procs[gen].card_free:
            self.feed(CardReleased(gen, 0.05))
            if not self.running or gen not in self.pending_of("take_down"):
                return  # (the unit crashed on it, or it ended its take-down otherwise)
        self.feed(self.down_event(gen, proven_gone, dumped))

    def card_not_told(self) -> list[int]:
        return [g for g in self.pending_of("take_down") if not self.procs[g].card_free]

    @precondition(lambda self: self.running and bool(self.card_not_told()))
    @rule(data=st.data())
    def card_released(self, data: st.DataObject) -> None:
        """A take-down under way: NVML lists none of the tree any more (its memory on the
        card released; its tree perhaps not gone yet)."""
        gen = data.draw(st.sampled_from(self.card_not_told()), label="generation")
        self.feed(CardReleased(gen, 0.05))

    def down_event(self, gen: int, proven_gone: bool, dumped: bool = True) -> Down:
        dump = gen in self.dumps
        if not proven_gone:
            return Down(gen, None, "take-down failed: processes survived SIGKILL",
                        None, None if not dump else "the tree did not go")
        p = self.procs[gen]
        return Down(gen, TakeDown(exit_code=p.exit_code if p.exited else -9,
                                  survivors=[], gpu_holders={}, port_problem=None,
                                  duration_s=0.1, sigkilled=not p.exited), None,
                    0.5 if dump and dumped else None,
                    "SnapshotError: criu dump failed" if dump and not dumped else None)

    @precondition(lambda self: self.running and bool(self.pending_of("drain", "drain_behind")))
    @rule(data=st.data(), idle=st.booleans())
    def drain_ends(self, data: st.DataObject, idle: bool) -> None:
        gen = data.draw(st.sampled_from(self.pending_of("drain", "drain_behind")),
                        label="generation")
        self.feed(Drained(gen, idle, 0.5 if idle else 30.0))

    @precondition(lambda self: self.running and bool(self.pending_of("remedy")))
    @rule(data=st.data(), ok=st.booleans())
    def remedy_ends(self, data: st.DataObject, ok: bool) -> None:
        """A KV reset ends: slept and woken (its golden answer as before), or not."""
        gen = data.draw(st.sampled_from(self.pending_of("remedy")), label="generation")
        self.feed(self.remedy_done(gen, ok))

    @precondition(lambda self: self.running and bool(self.pending_of("sleep_probe")))
    @rule(data=st.data(), pause=st.booleans())
    def sleep_mode_probed(self, data: st.DataObject, pause: bool) -> None:
        gen = data.draw(st.sampled_from(self.pending_of("sleep_probe")), label="generation")
        self.feed(self.sleep_probe(gen, pause))

    def sleep_probe(self, gen: int, pause: bool = False) -> SleepModeProbed:
        """What the engine's development routes say: sleep mode where it was started
        with it; a pause that empties its KV cache (vLLM 0.26+ with /pause) as drawn."""
        argv = self.procs[gen].engine.spec.argv
        on = "--enable-sleep-mode" in argv
        return SleepModeProbed(gen, on, None if on else "started without --enable-sleep-mode",
                               pause=pause, pause_why=None if pause else "vLLM 0.25.0")

    def remedy_done(self, gen: int, ok: bool) -> RemedyDone:
        ok = ok and self.procs[gen].alive
        if self.remedy_ways.get(gen, ("sleep",))[0] == "pause":
            outcome = RemedyOutcome(ok=True, steps={"pause": 0.1, "check": 0.01,
                                                    "resume": 0.01, "canary": 0.02}) \
                if ok else RemedyOutcome(ok=False, steps={"pause": 0.1, "resume": 0.01},
                                         error="POST /pause: HTTP 500")
        else:
            outcome = RemedyOutcome(ok=True, steps={"sleep": 0.1, "wake": 0.2}) if ok else \
                RemedyOutcome(ok=False, steps={"sleep": 0.1}, error="POST /wake_up: HTTP 500")
        return RemedyDone(gen, "kv_reset", outcome, 0.4)

    @precondition(lambda self: self.running and bool(self.live_timers()))
    @rule()
    def timer_fires(self) -> None:
        """The next timer fires (the clock moves to it): a backoff's end, a standby's."""
        self.fire(min(self.live_timers(), key=lambda t: t.due))

    def fire(self, t: Timer) -> None:
        self.w.now = max(self.w.now, t.due)
        t.fired = True
        self.feed(t.fake.event)

    @precondition(lambda self: self.running and bool(self.racing))
    @rule()
    def cancelled_timer_had_fired(self) -> None:
        """A timer cancelled by the last event, whose event was queued already."""
        self.fire(self.racing[0])

    @precondition(lambda self: self.running)
    @rule()
    def tick(self) -> None:
        """The unit's own tick (the watchdog's evaluation, the standby's weights ahead)."""
        self.feed(Tick())

    @rule(dt=st.sampled_from([0.5, 5.0, 40.0, 200.0, 1000.0]))
    def time_passes(self, dt: float) -> None:
        """The clock moves, up to the next timer (which fires then: `timer_fires`)."""
        self.racing = []
        if self._w is None:
            return
        due = [t.due for t in self.live_timers()]
        self.w.now = max(self.w.now, min([self.w.now + dt, *due]))

    # ---- requests at the proxy ------------------------------------------------------

    @precondition(lambda self: self.running and self.gate.held_reason is None
                  and self.gate.closed_reason is None
                  and len(self.tickets) < 2)
    @rule()
    def request_arrives(self) -> None:
        self.tickets.append(self.w.loop.run_until_complete(self.gate.acquire(1)))

    @precondition(lambda self: self.running and bool(self.tickets))
    @rule()
    def request_ends(self) -> None:
        self.gate.done(self.tickets.pop(0))

    # ---- the operator ---------------------------------------------------------------

    def control(self, command: str) -> None:
        self.failing = True
        before = self.gate.held_reason is not None
        reply = self.w.control(command)
        self.replies.append(reply)
        self.absorb()
        # (`resume` lets go the operator's own hold: the gate opens only to a proven
        # engine all the same, which `the_pair_holds` checks)
        self.expect(command == "resume" or not (before and self.gate.held_reason is None),
                    "released_without_proof",
                    lambda: f"held requests released by {command}: {self.describe()}")
        self.failing = False

    @precondition(lambda self: self.running)
    @rule(action=st.sampled_from(["restart", "stop", "reload_new_arguments", "reload_same",
                                  "reload_cache", "kv-reset", "rearm", "drain", "resume"]))
    def operator(self, action: str) -> None:
        """`vllm-supervisorctl restart` or `stop`, or a reload (SIGHUP) that changes the
        engine's arguments (a new revision) or only what it does not run (a grace), or
        turns the weight cache on or off (where the standby is awake: a cache rules out
        sleep mode); or a KV reset, a re-arm, a hold of new requests (`drain`) or its end
        (`resume`), each refused, saying why, where it cannot be done now."""
        self.racing = []
        if action in ("restart", "stop", "kv-reset", "rearm", "drain", "resume"):
            self.stop_asked = self.stop_asked or action == "stop"
            if action in ("drain", "resume"):
                self.held_by_operator = action == "drain"
            self.control(action)
            return
        if action == "reload_new_arguments":
            self.revision += 1
        if action == "reload_cache":
            if MODES[self.mode]["standby"] != "awake":
                return
            self.cache_on = not self.cache_on
        doc = self.config_doc()
        if action == "reload_same":
            doc["engine"]["stop_grace_s"] = 5.0 + len(self.replies) % 7
        cfg = parse_config(doc, str(self.tmp / "config.toml"), self.tmp)
        reply: asyncio.Future[dict[str, Any]] = self.w.loop.create_future()
        self.replies.append(reply)
        self.feed(Reloaded(cfg, None, reply))

    # ---- invariants -----------------------------------------------------------------

    @invariant()
    def the_pair_holds(self) -> None:
        if self._w is None or self.crashed:
            return
        self.failing = True
        bays = [p.bay for p in self.live] + [d["bay"] for d in self.spawns.values()]
        self.expect(len(bays) == len(set(bays)) and set(bays) <= set(BAYS), "two_in_a_bay",
                    self.describe)
        # each role and its bay's phase agree (pair_states.SERVING_BAYS, ROLE_BAYS)
        unit, serving = self.w.sup.state, self.w.sup.slot.phase
        self.expect(serving in SERVING_BAYS[unit], "state_and_bay", lambda: (
            f"{unit.value} with the serving bay {serving.value}: {self.describe()}"))
        standby = self.w.sup.handover.standby
        role, bay = standby.state, standby.slot.phase
        self.expect(bay in ROLE_BAYS[role], "role_and_bay", lambda: (
            f"a {role.value} standby in a {bay.value} bay: {self.describe()}"))
        wc = self.w.sup.weights
        self.expect(wc.slot.phase in CACHE_BAYS[wc.state], "cache_and_bay", lambda: (
            f"a {wc.state.value} weight cache in a {wc.slot.phase.value} bay: "
            f"{self.describe()}"))
        self.expect(not (self.held_by_operator and self.gate.held_reason is None),
                    "operator_hold_lost", lambda: (
                        f"the operator's drain no longer holds requests: {self.describe()}"))
        if self.gate.held_reason is None:
            e = self.following
            st_ = self.w.sup.status()
            self.expect(self.w.state == "RUNNING" and e is not None and not e.down
                        and not e.dead and not e.down_asked and not e.asleep and e.answered,
                        "open_to_unproven", lambda: (
                            f"requests let through to an engine not serving or not proven: "
                            f"{self.describe()}"))
            serving = self.w.sup.slot.phase
            self.expect(serving is Bay.HEALTHY, "open_to_unproven", lambda: (
                f"requests let through to a {serving.value} bay: {self.describe()}"))
            if e is not None:
                self.expect(not e.woken or e.proven, "open_to_unproven",
                            lambda: f"a woken standby serves unproven: {e}")
                self.expect(not e.took_over or e.ever_proven, "open_to_unproven",
                            lambda: f"a standby serves unproven: {e}")
                self.expect(st_["pid"] == e.pid, "status_pid",
                            lambda: f"status names pid {st_['pid']}, the proxy {e}")
        if self.w.state == "STOPPED":
            self.expect(self.stop_asked and not self.live and not self.spawns,
                        "stopped_with_engines", self.describe)
        self.failing = False

    # ---- the end of a run: at rest, then stopped ------------------------------------

    def good_answer(self) -> Callable[[], None] | None:
        """The next effect asked and not answered, answered well (a dead engine's health
        and proof fail); else the next timer fires. None: nothing is pending."""
        if self.spawns:
            gen = min(self.spawns)
            return lambda: self.feed(Spawned(gen, self.new_engine(gen)))
        if take_downs := self.pending_of("take_down"):
            return lambda: self.feed(self.down_event(take_downs[0], proven_gone=True))
        if drains := self.pending_of("drain", "drain_behind"):
            return lambda: self.feed(Drained(drains[0], True, 0.5))
        if remedies := self.pending_of("remedy"):
            return lambda: self.feed(self.remedy_done(remedies[0], ok=True))
        if probes := self.pending_of("sleep_probe"):
            return lambda: self.feed(self.sleep_probe(probes[0]))
        if unhealthy := self.unhealthy_yet():
            p = self.procs[unhealthy[0]]
            return lambda: self.feed(HealthResult(p.gen, not p.dead and not p.down))
        if wakes := self.wakes():
            return lambda: self.feed(self.woken(*wakes[0], ok=True))
        if caches := self.pending_of("host_cache"):
            return lambda: self.feed(self.host_cache_emptied(caches[0], ok=True))
        for kind in ("gate_probe", "sleep"):
            if gens := self.pending_of(kind):
                p = self.procs[gens[0]]
                ok = not p.dead and not p.down and not (kind == "gate_probe" and p.asleep)
                err = None if ok else "dead"
                ev: Event = (GateProbe(p.gen, ok, err) if kind == "gate_probe"
                             else Slept(p.gen, err, 0.2))
                return lambda: self.feed(ev)
        live = self.live_timers()
        return (lambda: self.fire(min(live, key=lambda t: t.due))) if live else None

    @precondition(lambda self: self.running and self.good_answer() is not None)
    @rule(answers=st.integers(1, 12))
    def the_world_goes_on(self, answers: int) -> None:
        """The oldest effects asked are answered well, or the next timer fires, up to
        `answers` in a row: runs reach a ready standby, and hand over to it, in a few
        steps, with the faults above in between."""
        for _ in range(answers):
            answer = self.good_answer()
            if answer is None or not self.running:
                return
            answer()
            self.the_pair_holds()

    def settle(self) -> None:
        while self.tickets:
            self.gate.done(self.tickets.pop())
        if self.held_by_operator and self.w.state != "STOPPED":
            self.held_by_operator = False
            self.control("resume")
        for _ in range(ANSWERS_TO_REST):
            if self.w.state == "STOPPED":
                return
            answer = self.good_answer()
            if answer is None:
                return
            answer()
            self.the_pair_holds()
        raise AssertionError(f"no rest after {ANSWERS_TO_REST} answers: {self.describe()}")

    def at_rest(self) -> None:
        state = self.w.state
        self.expect(state in ("RUNNING", "FATAL", "STOPPED"), "stuck",
                    lambda: f"nothing pending, no timer, and {state}: {self.describe()}")
        self.expect(not any(p.dead for p in self.live), "dead_engine_kept",
                    lambda: f"a dead engine left in its place: {self.describe()}")
        if state == "RUNNING":
            standby = self.w.sup.status()["standby"]
            self.expect(self.gate.held_reason is None, "held_for_ever", self.describe)
            self.expect(standby["state"] in ("ready", "no_room", "failed"), "no_standby_coming",
                        self.describe)
            if standby["state"] == "ready":
                spare = self.by_pid.get(standby["pid"])
                self.expect(spare is not None and spare in self.live
                            and spare is not self.following, "standby_ready_wrong",
                            self.describe)
                # (with no room beside, a reload's new arguments apply at the next start,
                # docs/standby.md: the sleeping standby keeps the old ones meanwhile)
                thin = self.mode == "thin"
                self.expect(not ROOM_BESIDE[self.mode] or spare is None or thin
                            or spare.engine.config.args == self.config_doc()["engine"]["args"],
                            "standby_out_of_date", self.describe)
                # an asymmetric pair at rest: the full-size engine serves, the thin one
                # is the standby (the re-arm ended)
                self.expect(not thin or (
                    spare is not None and self.following is not None
                    and share_of(spare.engine.spec.argv) == 0.28
                    and share_of(self.following.engine.spec.argv) == 0.60),
                    "thin_pair_not_rearmed", self.describe)
        if state == "FATAL":  # (a weight cache stays up for the operator's restart)
            self.expect(not self.engines, "fatal_with_engines", self.describe)
        wc = self.w.sup.weights
        self.expect(not self.cache_on or state == "STOPPED"
                    or wc.state in (Cache.READY, Cache.FAILED),
                    "cache_not_at_rest", lambda: f"a {wc.state.value} weight cache at rest: "
                    f"{self.describe()}")
        # (off, or failed: its tree not proven gone, until the daemon restarts)
        self.expect((self.cache_on and state != "STOPPED")
                    or wc.state in (Cache.OFF, Cache.FAILED), "cache_left_on",
                    lambda: f"a {wc.state.value} cache turned off: {self.describe()}")

    def teardown(self) -> None:
        try:
            if self._w is not None and not self.failing and not self.crashed:
                self.settle()
                self.at_rest()
                if self.w.state != "STOPPED":
                    self.stop_asked = True
                    self.control("stop")
                    self.settle()
                self.expect(self.w.state == "STOPPED" and not self.live and not self.spawns,
                            "stop_did_not_end", self.describe)
                self.expect(all(r.done() for r in self.replies), "unanswered", self.describe)
        finally:
            if self._w is not None:
                for r in self.replies:
                    if r.done() and not r.cancelled():
                        r.exception()  # (a refused restart: its answer, read)
                self.w.loop.close()
            shutil.rmtree(self.tmp, ignore_errors=True)


PairMachine.TestCase.settings = settings(
    max_examples=examples(300), stateful_step_count=30, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
TestPair = PairMachine.TestCase
