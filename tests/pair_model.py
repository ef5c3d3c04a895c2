"""The pair machine's model of the world (tests/test_pair_machine.py): what the unit asked
(read from its recording effects' log: spawns, watches, proofs, sleeps, wakes, take-downs,
dumps, drains, remedies, timers) and what the world told it (the events fed), kept as
`Proc`s and `Timer`s, with the checks each effect must pass as it is read (`expect`).
The machine's rules feed only what this model says the world could report now."""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from supervisor.engine.events import (
    CardReleased,
    CoreExited,
    Down,
    Drained,
    Event,
    Exited,
    GateProbe,
    HealthResult,
    HostCacheEmptied,
    RemedyDone,
    SleepModeProbed,
    Slept,
    Spawned,
    Woken,
)
from supervisor.engine.pair.pair_states import Cache
from supervisor.front.admission import Gate, Ticket
from supervisor.settings.bays import BAYS, ENGINE_BAYS, WEIGHT_CACHE_BAY
from supervisor.watchdog.remedy import REST, WEIGHTS
from tests.pair_world import (
    ASLEEP_BYTES,
    BACKOFF_MAX_S,
    CARD,
    CARD_BYTES,
    DEADLINE_MAX_S,
    GIB,
    KNOWN_BUGS,
    MODES,
    ROOM_BESIDE,
    SLEEPING_MODES,
    Proc,
    Timer,
    known_crash,
    share_of,
)
from tests.unit_world import World


class PairModel:
    """The model, as the base of the machine: its state, and the reading of each effect."""

    def __init__(self) -> None:
        super().__init__()
        self.tmp = Path(tempfile.mkdtemp(prefix="pair-machine-"))
        self._w: World | None = None
        self.mode = "awake"
        self.procs: dict[int, Proc] = {}  # by generation
        self.by_pid: dict[int, Proc] = {}
        self.spawns: dict[int, dict[str, Any]] = {}  # asked, not answered: by generation
        self.pending: list[tuple[str, int]] = []  # (effect, generation) not answered
        self.timers: list[Timer] = []
        self.racing: list[Timer] = []  # just cancelled, but due: their event may be queued
        self.tickets: list[Ticket] = []
        self.replies: list[asyncio.Future[dict[str, Any]]] = []
        self.calls_seen = 0
        self.timers_seen = 0
        self.deadlines_seen = 0
        self.following: Proc | None = None  # the engine the proxy's route goes to
        self.stop_asked = False
        self.revision = 0
        self.failing = False  # a check or the unit raised: no settling at teardown
        self.step_spawned: int | None = None  # the generation this step's Spawned started
        self.step_healthy: int | None = None  # ... whose health this step's event said ok
        self.known_seen: set[str] = set()
        self.crashed = False  # the unit raised a known bug's exception: the run ends
        self.event: Event | None = None  # the one being fed
        self.weights_bytes = 4 * GIB  # each engine's, as its sleep says (`start` draws it)
        self.dumps: set[int] = set()  # generations whose take-down is a dump (a snapshot's)
        self.remedy_ways: dict[int, tuple[str, ...]] = {}  # a KV reset's, as asked
        self.cache_on = False  # `engine.weight_cache`, as the last config said
        self.held_by_operator = False  # `drain` asked, `resume` not yet

    # ---- the world ----------------------------------------------------------------------

    @property
    def w(self) -> World:
        assert self._w is not None
        return self._w

    @property
    def gate(self) -> Gate:
        return self.w.sup.gate

    @property
    def live(self) -> list[Proc]:
        return [p for p in self.procs.values() if not p.down]

    @property
    def engines(self) -> list[Proc]:
        """The live engines (the weight cache's process aside: its weights are counted in
        each engine's share of the card)."""
        return [p for p in self.live if p.bay in ENGINE_BAYS]

    @property
    def running(self) -> bool:
        return self._w is not None and self.w.state != "STOPPED" and not self.crashed

    @property
    def on_card(self) -> list[Proc]:
        """The live engines that hold memory on the card (not one being taken down whose
        memory NVML no longer lists: `CardReleased`)."""
        return [p for p in self.engines if not p.card_free]

    def awake_share(self) -> float:
        """The card's share that engines hold now: each live one not asleep (or being
        woken), and each spawn under way."""
        held = [share_of(p.engine.spec.argv) for p in self.on_card
                if not p.asleep or ("wake", p.gen) in self.pending
                or ("wake_rest", p.gen) in self.pending]
        return sum(held) + sum(share_of(d["spec"].argv) for d in self.spawns.values()
                               if d["bay"] in ENGINE_BAYS)

    def card_used(self) -> int:
        """The card's memory the engines hold now (every one whose tree is not gone)."""
        used = 0
        for p in self.on_card:
            if p.asleep:
                used += ASLEEP_BYTES + (self.weights_bytes if p.weights else 0)
            else:
                share = share_of(p.engine.spec.argv) * CARD_BYTES
                used += int(share if p.healthy else share / 2)
        return used

    def pending_of(self, *kinds: str) -> list[int]:
        return sorted({g for k, g in self.pending if k in kinds})

    def unhealthy_yet(self) -> list[int]:
        return sorted(p.gen for p in self.procs.values() if p.watched and not p.health_fed)

    def live_timers(self) -> list[Timer]:
        return [t for t in self.timers if t.live]

    def describe(self) -> str:
        st_ = self.w.sup.status()
        return (f"[{self.mode}] state {self.w.state} ({st_['reason']}), standby "
                f"{st_['standby']}, live {self.live}, spawns {sorted(self.spawns)}, "
                f"pending {self.pending}, "
                f"timers {[(t.fake.event, t.due) for t in self.live_timers()]}, "
                f"gate held {self.gate.held_reason!r}, following {self.following}")

    def config_doc(self) -> dict[str, Any]:
        doc = dict(self.w.doc)
        args = list(MODES[self.mode]["args"])
        if self.revision:
            args += ["--revision", f"v{self.revision}"]
        doc["engine"] = {**doc["engine"], "args": args, "weight_cache": self.cache_on}
        return doc

    def expect(self, ok: bool, check: str, why: Callable[[], str]) -> None:
        """A check of the pair; a failed one is a bug, unless it is a known one (then
        the run goes on, to look further)."""
        if ok:
            return
        if check in KNOWN_BUGS:
            self.known_seen.add(check)
            return
        raise AssertionError(f"{check}: {why()}")

    # ---- feeding, and reading what the unit asked ------------------------------------

    def feed(self, ev: Event) -> None:
        self.failing = True
        if not any(ev is t.fake.event for t in self.racing):
            self.racing = []
        self.step_spawned = self.step_healthy = None
        self.event = ev
        self.apply(ev)
        held_before = self.gate.held_reason is not None
        live_before = {id(t) for t in self.live_timers()}
        try:
            self.w.feed(ev)
        except Exception as exc:
            known = known_crash(exc)
            if known is None:
                raise
            self.known_seen.add(known)  # (the unit is broken: this run ends here)
            self.crashed = True
            self.failing = False
            return
        self.absorb()
        self.racing = [t for t in self.timers if id(t) in live_before and t.fake.cancelled
                       and t.due <= self.w.now]
        if held_before and self.gate.held_reason is None:
            e = self.following
            # (a proof of the engine followed, or the end of its KV reset: woken, and
            # its golden answer judged)
            by = (GateProbe, RemedyDone)
            self.expect(isinstance(ev, by) and e is not None
                        and ev.generation == e.gen, "released_without_proof", lambda: (
                            f"held requests released by {ev!r}, not by a proof of the "
                            f"followed engine {e}: {self.describe()}"))
        self.failing = False

    def apply(self, ev: Event) -> None:
        """What the event says of the world, before the unit hears it."""
        p = self.procs.get(getattr(ev, "generation", -1))
        if isinstance(ev, Spawned):
            self.spawns.pop(ev.generation)
            if ev.engine is not None:
                spawn = self.w.fx.calls  # (its bay and arguments: from the spawn asked)
                asked = next(d for n, d in reversed(spawn)
                             if n == "spawn" and d["generation"] == ev.generation)
                proc = Proc(ev.engine, asked["bay"])
                if asked["spec"].restore is not None:  # (proven and asleep when dumped)
                    proc.asleep = proc.ever_proven = True
                self.procs[ev.generation] = self.by_pid[ev.engine.pid] = proc
                self.step_spawned = ev.generation
            return
        if p is None:  # (a timer's or the operator's: about no engine)
            assert not isinstance(ev, HealthResult | GateProbe | Slept | Woken | Exited
                                  | CoreExited | CardReleased | Down | Drained | RemedyDone
                                  | SleepModeProbed | HostCacheEmptied), ev
            return
        if isinstance(ev, HealthResult):
            p.health_fed = True
            if ev.healthy:
                p.healthy, p.answered, p.proven = True, False, False
                self.step_healthy = p.gen
        elif isinstance(ev, GateProbe):
            self.pending.remove(("gate_probe", p.gen))
            p.answered = True
            if ev.ok:
                p.proven = p.ever_proven = True
        elif isinstance(ev, Slept):
            self.pending.remove(("sleep", p.gen))
            p.asleep = p.asleep or ev.error is None
            if ev.error is None:  # (its sleep's line says its weights: process.py)
                p.engine.weights_bytes = self.weights_bytes
        elif isinstance(ev, Woken):
            kind = {WEIGHTS: "wake_weights", REST: "wake_rest"}.get(ev.tags, "wake")
            self.pending.remove((kind, p.gen))
            if ev.error is None and kind == "wake_weights":
                p.weights = True
            elif ev.error is None:
                p.asleep, p.woken, p.answered, p.proven = False, True, False, False
                p.weights = False
        elif isinstance(ev, Exited):
            p.exited, p.exit_code = True, ev.code
        elif isinstance(ev, CoreExited):
            p.core_lost = True
        elif isinstance(ev, CardReleased):
            p.card_free = True
        elif isinstance(ev, Down):
            self.pending.remove(("take_down", p.gen))
            p.down = True
        elif isinstance(ev, Drained):
            kind = "drain" if ("drain", p.gen) in self.pending else "drain_behind"
            self.pending.remove((kind, p.gen))
        elif isinstance(ev, RemedyDone):
            self.pending.remove(("remedy", p.gen))
        elif isinstance(ev, SleepModeProbed):
            self.pending.remove(("sleep_probe", p.gen))
        elif isinstance(ev, HostCacheEmptied):
            self.pending.remove(("host_cache", p.gen))

    def absorb(self) -> None:
        """Every effect the unit asked for since the last look, checked and recorded."""
        fx = self.w.fx
        for name, d in fx.calls[self.calls_seen:]:
            self.calls_seen += 1
            check = getattr(self, f"asked_{name}", None)
            if check is not None:
                check(d)
        late = [dl for dl in fx.deadlines[self.deadlines_seen:]
                if dl > self.w.now + DEADLINE_MAX_S]
        self.deadlines_seen = len(fx.deadlines)
        # (a stop's one deadline may have passed while a spawn ran: then a kill at once)
        self.expect(not late, "unbounded_deadline", lambda: f"{late} at {self.w.now}")

    def proc(self, d: dict[str, Any]) -> Proc:
        p = self.by_pid.get(d["pid"])
        assert p is not None, f"an effect for pid {d['pid']}, never spawned"
        return p

    def asked_spawn(self, d: dict[str, Any]) -> None:
        bay = d["bay"]
        taken = [p.bay for p in self.live] + [s["bay"] for s in self.spawns.values()]
        self.expect(bay in BAYS and bay not in taken, "two_in_a_bay", lambda: (
            f"a spawn in bay {bay}, which holds a process or a spawn: {self.describe()}"))
        if bay == WEIGHT_CACHE_BAY:
            self.expect(self.cache_on, "cache_not_configured", self.describe)
            self.spawns[d["generation"]] = d
            return
        self.expect(sum(b in ENGINE_BAYS for b in taken) < 2, "a_third_engine", self.describe)
        self.on_the_cache(d)
        if d["spec"].restore is not None:  # a copy of a snapshot's images: asleep from
            # its start, with room beside the serving engine
            self.expect(self.mode == "snapshot", "restore_unasked", self.describe)
            self.expect(CARD_BYTES - self.card_used() >= ASLEEP_BYTES, "restore_past_the_card",
                        self.describe)
            self.spawns[d["generation"]] = d
            return
        if self.mode == "thin":
            self.expect(self.awake_share() + share_of(d["spec"].argv) <= CARD,
                        "spawn_past_the_card", lambda: (
                            f"a spawn at {share_of(d['spec'].argv)} beside "
                            f"{self.awake_share():g} awake: {self.describe()}"))
        if self.mode in SLEEPING_MODES:  # (vLLM's check at its start:
            # its share of the card free; a standby's weights woken ahead take from it)
            need = share_of(d["spec"].argv) * CARD_BYTES
            self.expect(CARD_BYTES - self.card_used() >= need, "spawn_past_the_free_card",
                        lambda: f"a spawn needing {need / GIB:g} GiB with "
                        f"{(CARD_BYTES - self.card_used()) / GIB:g} free: {self.describe()}")
        if not ROOM_BESIDE[self.mode]:
            self.expect(not self.spawns and all(
                p.asleep and ("wake", p.gen) not in self.pending for p in self.live),
                "spawn_beside_awake_no_room", lambda: (
                    f"a spawn beside an engine that is not asleep, with no room for both: "
                    f"{self.describe()}"))
        self.spawns[d["generation"]] = d

    def on_the_cache(self, d: dict[str, Any]) -> None:
        """An engine spawns on the weight cache exactly when the cache is ready (its
        process up and not going), the serving one never while the cache starts or
        stops (it waits for the cache's end: `WeightCache.holds_start`)."""
        wc = self.w.sup.weights
        cache = wc.slot.engine
        ready = (wc.state is Cache.READY and cache is not None and cache.exit_code is None
                 and not wc.slot.taking_down)
        load = d["spec"].load
        self.expect(bool(load) == ready, "load_without_cache", lambda: (
            f"an engine spawned with load {load!r}, the cache {wc.state.value}: "
            f"{self.describe()}"))
        serving = d["bay"] == self.w.sup.slot.bay
        self.expect(not (serving and wc.configured and wc.state in (
            Cache.STARTING, Cache.STOPPING)), "spawn_beside_a_moving_cache", lambda: (
            f"the serving engine spawned while its cache was {wc.state.value}: "
            f"{self.describe()}"))

    def asked_watch(self, d: dict[str, Any]) -> None:
        self.proc(d).watched = True

    def asked_serve(self, d: dict[str, Any]) -> None:
        p = self.proc(d)
        self.expect(p.alive and p.healthy and not p.asleep
                    and (p.gen == self.step_healthy or p.ever_proven), "serve_unproven",
                    lambda: f"serve {p}: not healthy, asleep or not proven: {self.describe()}")
        if ("sleep_probe", p.gen) not in self.pending:  # (its development routes probed:
            # whether a KV reset can sleep and wake it)
            self.pending.append(("sleep_probe", p.gen))

    def asked_gate_probe(self, d: dict[str, Any]) -> None:
        p = self.proc(d)
        self.expect(p.alive and p.healthy and not p.asleep, "proof_of_unready",
                    lambda: f"a proof asked of {p}: {self.describe()}")
        self.pending.append(("gate_probe", p.gen))

    def asked_sleep(self, d: dict[str, Any]) -> None:
        p = self.proc(d)
        self.expect(p.alive and p.proven and not p.asleep and p is not self.following,
                    "sleep_unproven", lambda: f"sleep asked of {p}: {self.describe()}")
        self.pending.append(("sleep", p.gen))

    def asked_wake(self, d: dict[str, Any]) -> None:
        p = self.proc(d)
        tags = tuple(d.get("tags", ()))
        if tags == WEIGHTS:  # (while the old engine's memory may be held still)
            free = CARD_BYTES - self.card_used()
            self.expect(p.alive and p.asleep and not p.weights, "wake_of_unready",
                        lambda: f"weights wake asked of {p}: {self.describe()}")
            self.expect(free >= self.weights_bytes, "weights_wake_past_the_card", lambda: (
                f"weights of {self.weights_bytes} woken with {free} free: {self.describe()}"))
            self.pending.append(("wake_weights", p.gen))
            return
        self.expect(tags != REST or p.weights, "rest_before_weights",
                    lambda: f"the rest of {p} woken before its weights: {self.describe()}")
        # (vLLM 0.26 maps a tag it is asked for again, awake or not: the weights twice)
        self.expect(tags == REST or (not p.weights and ("wake_weights", p.gen)
                    not in self.pending), "weights_woken_twice",
                    lambda: f"a whole wake of {p} after its weights: {self.describe()}")
        if not (p.alive and p.asleep):
            ev = self.event
            overtaken = isinstance(ev, Down) and ev.generation != p.gen
            self.expect(False, "wake_when_down_of_unready" if overtaken else "wake_of_unready",
                        lambda: f"wake asked of {p} (on {ev}): {self.describe()}")
        if self.mode == "thin" and p.alive:
            self.expect(self.awake_share() + share_of(p.engine.spec.argv) <= CARD,
                        "wake_past_the_card", lambda: f"wake of {p}: {self.describe()}")
        if not ROOM_BESIDE[self.mode] and p.alive:
            on_card = [q for q in self.live if not q.card_free]
            self.expect(on_card == [p] and not self.spawns, "wake_beside_no_room", lambda: (
                f"a wake beside another engine, with no room for both: {self.describe()}"))
        self.pending.append(("wake_rest" if tags == REST else "wake", p.gen))

    def asked_empty_host_cache(self, d: dict[str, Any]) -> None:
        """Only of an engine asleep with its weights on the card (a standby, or a copy
        taking over with requests held): never of one that requests reach (the emptying
        holds it), nor one whose weights' backup is still in use."""
        p = self.proc(d)
        self.expect(p.alive and p.asleep and p.weights and p is not self.following
                    and (self.w.sup.engine is not p.engine
                         or self.gate.held_reason is not None), "host_cache_of_unready",
                    lambda: f"host cache emptying asked of {p}: {self.describe()}")
        self.pending.append(("host_cache", p.gen))

    def asked_take_down(self, d: dict[str, Any]) -> None:
        p = self.proc(d)
        self.expect(not p.down and not p.down_asked, "take_down_twice",
                    lambda: f"take-down of {p} again: {self.describe()}")
        p.down_asked = True
        self.pending.append(("take_down", p.gen))

    def asked_dump(self, d: dict[str, Any]) -> None:
        """A sleeping standby kept as images: its take-down (`Down` answers it)."""
        p = self.proc(d)
        self.expect(self.mode == "snapshot" and p.alive and p.asleep and p.ever_proven
                    and p is not self.following, "dump_of_unready",
                    lambda: f"a dump of {p}: {self.describe()}")
        p.down_asked = True
        self.dumps.add(p.gen)
        self.pending.append(("take_down", p.gen))

    def asked_remedy(self, d: dict[str, Any]) -> None:
        """An in-place remedy (a KV reset: the engine slept and woken behind a hold)."""
        p = self.proc(d)
        # (answered: its proof came back, passed or failed: a failed first canary lets
        # clients in all the same, said)
        self.expect(p.alive and p.healthy and not p.asleep and p is self.following
                    and (p.answered or p.ever_proven), "remedy_of_unready",
                    lambda: f"a {d['rung']} asked of {p}: {self.describe()}")
        # (a KV reset by a way its probe found: a pause, a sleep, or both in that order)
        ways = tuple(d.get("ways", ()))
        self.expect(d["rung"] != "kv_reset" or ways in (("pause",), ("sleep",),
                                                        ("pause", "sleep")),
                    "kv_reset_without_a_way", lambda: f"a KV reset by {ways} of {p}")
        self.remedy_ways[p.gen] = ways
        self.pending.append(("remedy", p.gen))

    def asked_drain(self, d: dict[str, Any]) -> None:
        p = self.proc(d)
        self.expect(not p.down, "drain_of_gone", lambda: f"{p}")
        self.pending.append(("drain", p.gen))

    def asked_drain_behind(self, d: dict[str, Any]) -> None:
        p = self.proc(d)
        self.expect(not p.down, "drain_of_gone", lambda: f"{p}")
        self.pending.append(("drain_behind", p.gen))

    def asked_follow(self, d: dict[str, Any]) -> None:
        p = self.proc(d)
        self.expect(p.alive, "follow_gone",
                    lambda: f"the proxy follows {p}, dead or going: {self.describe()}")
        if p.gen != self.step_spawned:  # (a cold start's engine is followed once spawned)
            self.expect(p.ever_proven and p.healthy and not p.asleep, "follow_unproven",
                        lambda: f"the proxy follows a standby not proven or asleep: {p}: "
                                f"{self.describe()}")
            p.took_over = True
        self.following = p

    def asked_kill_now(self, d: dict[str, Any]) -> None:
        raise AssertionError(f"kill_now (the unit is failing): {d}")

    def asked_after(self, d: dict[str, Any]) -> None:
        fake = self.w.fx.timers[self.timers_seen]
        self.timers_seen += 1
        assert fake.event is d["event"]
        self.expect(0 <= d["delay_s"] <= BACKOFF_MAX_S, "unbounded_timer", lambda: f"{d}")
        self.timers.append(Timer(fake, self.w.now + d["delay_s"]))
