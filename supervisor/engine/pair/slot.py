"""One engine process of a unit, from its spawn to its tree proven gone.

`EngineSlot` keeps the facts of the engine in it (the process, its generation, its bay's
phase: empty, spawning, starting, healthy, exited, taking down, checked against
`supervisor/engine/pair/pair_states.py`; what its take-down must capture first). It acts
on nothing and decides nothing: the unit's executor spawns and takes down its engine
(`supervisor/engine/executor.py`), the unit reads each event of its process through it
once (`on`), carries out what every process's life needs (`steps.lifecycle`: its jobs
watched once up, its state file and guard dropped once gone) and hands the outcome to
the role in the bay.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import signal
from collections.abc import Callable, Mapping
from typing import Any

import structlog

from supervisor.engine.events import (
    CardReleased,
    CoreExited,
    Down,
    Exited,
    HealthResult,
    Spawned,
    TreeSeen,
)
from supervisor.engine.intents import EvidenceFor
from supervisor.engine.pair import outcomes as out
from supervisor.engine.pair.pair_states import BAY, Bay, check
from supervisor.engine.process import process as eng
from supervisor.engine.process import proctree
from supervisor.watchdog import devroutes, evidence, hostmem
from supervisor.watchdog.devroutes import DevRoutes

log = structlog.get_logger("supervisor")


class _BayReading:
    """What a bay's phase and engine say, for the slot and its view alike."""

    phase: Bay
    engine: eng.EngineProcess | None
    spec: eng.SpawnSpec | None  # the engine's in the bay, or the spawn's under way

    @property
    def thin(self) -> bool:
        """The engine in the bay (or coming) is an asymmetric pair's thin standby."""
        return self.spec is not None and self.spec.thin

    @property
    def spawning(self) -> bool:
        return self.phase is Bay.SPAWNING

    @property
    def taking_down(self) -> bool:
        return self.phase is Bay.TAKING_DOWN

    def current(self, generation: int) -> eng.EngineProcess | None:
        """The engine in the bay, if it is of `generation` (events of a gone one are
        stale)."""
        e = self.engine
        return e if e is not None and e.generation == generation else None


@dataclasses.dataclass(frozen=True)
class SlotView(_BayReading):
    """One bay as the deciders read it, at one moment (`EngineSlot.view`): which bay,
    its phase and generation, and the engine in it."""

    bay: int
    phase: Bay
    generation: int
    engine: eng.EngineProcess | None
    spec: eng.SpawnSpec | None


class EngineSlot(_BayReading):
    def __init__(self, audit: Callable[..., None],
                 next_generation: Callable[[], int], bay: int = 0,
                 load: Callable[[], eng.Load | None] | None = None,
                 what: str = "engine") -> None:
        self._audit, self._next = audit, next_generation
        self.bay = bay  # its state file and guard (supervisor/engine/effects/jobs.py)
        # how each engine spawned here gets its weights (its weight cache's, when the
        # engine has one: `WeightCache.load`), decided at its spawn
        self._load = load
        self.load: eng.Load | None = None
        # what lives here, in the log ("engine", "weight cache"); its audit entries are
        # prefixed with it when it is not an engine ("weight_cache_spawn")
        self.what = what
        self._prefix = "" if what == "engine" else what.replace(" ", "_") + "_"
        self.engine: eng.EngineProcess | None = None
        self.spec: eng.SpawnSpec | None = None
        self.generation = 0  # changes with every spawn
        self.phase = Bay.EMPTY
        self.last_exit: str | None = None  # how the last engine ended, for `status`
        # set by a second stop: the take-down in flight skips to SIGKILL
        self.force = asyncio.Event()
        # the next take-down of this engine first captures evidence for (rule, reason)
        self.evidence_for: EvidenceFor | None = None

    def _set_phase(self, new: Bay) -> None:
        check(BAY, self.phase, new)
        self.phase = new

    def view(self) -> SlotView:
        return SlotView(self.bay, self.phase, self.generation, self.engine, self.spec)

    def spawn(self, spec: eng.SpawnSpec) -> eng.SpawnSpec:
        """A spawn begins here (the executor's): its generation drawn, its load decided;
        the spec to spawn, with that load."""
        assert self.engine is None
        self._set_phase(Bay.SPAWNING)
        self.generation = self._next()  # unique across the unit's slots
        self.force = asyncio.Event()
        self.evidence_for = None  # (for the engine that went, if none was taken down)
        self.load = self._load() if self._load is not None else None
        if self.load is not None:
            spec = dataclasses.replace(spec, load=self.load.args)
        self.spec = spec
        return spec

    def _event(self, name: str, **fields: Any) -> None:
        self._audit(self._prefix + name, **fields)

    def on(self, ev: out.ProcessEvent, now: float, *, awaits_health: bool = True,
           exit_expected: bool = False) -> out.Outcome:
        """One process event, read once for every bay (`supervisor/engine/pair/outcomes.py`
        has the table). The role says what it is waiting for: `awaits_health`, a health
        result counts (its engine is starting); `exit_expected`, an exit is no failure
        even without a take-down (the role is not serving or starting)."""
        match ev:
            case Spawned():
                engine = self.spawned(ev)
                return out.Up(engine) if engine is not None \
                    else out.SpawnFailed(ev.error, ev.gpu_busy)
            case HealthResult():
                e = self.current(ev.generation)
                if e is None or self.taking_down or not awaits_health:
                    return out.NOTHING
                if ev.healthy:
                    if self.phase is Bay.STARTING:  # (not after its exit was seen)
                        self._set_phase(Bay.HEALTHY)
                    # (a weight cache serves no development routes of an engine's)
                    self.healthy(e, now, ev.routes if self.what == "engine" else None,
                                 ev.max_model_len)
                    return out.Healthy(e)
                if e.exit_code is not None:
                    return out.NOTHING  # (its exit says why)
                if ev.why:
                    return out.Unhealthy(e, ev.why, timed_out=False)
                return out.Unhealthy(
                    e, f"not healthy within {e.config.startup_timeout_s:g} s", timed_out=True)
            case Exited():
                asked = self.taking_down or exit_expected
                e = self.exited(ev, asked)
                return out.Died(e, f"{self.last_exit} without being asked", core=False) \
                    if e is not None and not asked else out.NOTHING
            case CoreExited():
                e = self.core_exited(ev)
                return out.Died(e, f"{self.last_exit}", core=True) \
                    if e is not None and not exit_expected else out.NOTHING
            case TreeSeen():
                cpu = self.tree_seen(ev)
                e = self.current(ev.generation)
                return out.Seen(e, ev, cpu) if e is not None else out.NOTHING
            case CardReleased():
                e = self.current(ev.generation)
                if e is None or not self.taking_down:
                    return out.NOTHING
                log.info(f"old {self.what}'s memory on the card released", pid=e.pid,
                         after_s=round(ev.after_s, 3))
                self._event("card_released", pid=e.pid, after_s=round(ev.after_s, 3))
                return out.CardFreed(e, ev.after_s)
            case Down():
                engine, problem = self.down(ev)
                return out.Gone(engine, problem, ev.dumped_s, ev.dump_error)

    def spawned(self, ev: Spawned) -> eng.EngineProcess | None:
        """The spawn ended: the engine now in the slot, or None (`ev.error` says why)."""
        self._set_phase(Bay.STARTING if ev.engine is not None else Bay.EMPTY)
        for line in ev.leftovers:
            log.warning("killed a process left by an earlier run", process=line)
            self._event("leftover_killed", process=line)
        load = self.load.fields() if self.load is not None else {}
        if ev.engine is None:
            self.spec = None
            log.error(f"{self.what} could not be started", error=ev.error)
            self._event("spawn_failed", error=ev.error, gpu_busy=ev.gpu_busy, **load)
            return None
        self.engine = engine = ev.engine
        log.info(f"{self.what} spawned", pid=engine.pid, argv=engine.spec.argv,
                 **({"load": engine.spec.load} if engine.spec.load else {}), **load)
        self._event("spawn", pid=engine.pid, generation=engine.generation, **load)
        return engine

    def healthy(self, engine: eng.EngineProcess, now: float,
                routes: DevRoutes | None = None, max_model_len: int | None = None) -> None:
        """The engine in the slot answered /health: since `now`, serving `routes` of
        vLLM's development routes (None: not asked), with `max_model_len` (None: not
        said). One log line and one audit entry (`dev_routes`) say which routes, and
        what of the engine's is off for want of them; a warning when its configuration
        asks for routes it does not serve."""
        engine.healthy_at = now
        engine.routes = routes
        engine.max_model_len = max_model_len
        if routes is None:
            return
        spec = engine.spec
        fields: dict[str, Any] = {
            "pid": engine.pid, "port": engine.config.port, "routes": routes.as_dict(),
            "off": devroutes.off(routes, spec.argv, spec.env),
            "unknown": dict(routes.errors) or None}
        missing = devroutes.missing_asked(routes, spec.argv, spec.env)
        if missing:
            log.warning("the engine does not serve development routes its configuration "
                        "asks for: what needs them is off", missing=missing, **fields)
        else:
            log.info("the engine's development routes", **fields)
        self._audit("dev_routes", **fields)

    def capture_at_take_down(self, evidence: EvidenceFor) -> None:
        """The next take-down of this engine first captures evidence for (rule, reason)."""
        self.evidence_for = evidence

    def tree_seen(self, ev: TreeSeen) -> float | None:
        """The engine's tree as last seen; its CPU percent (None: not yet known)."""
        e = self.current(ev.generation)
        if e is None:
            return None
        e.known = proctree.merge_known(e.known, list(ev.procs))
        e.live_processes = len(ev.procs)
        if ev.oom_kills is not None:
            e.oom_kills_seen = ev.oom_kills
        e.rss_bytes = ev.rss_bytes
        if e.cpu_seen is not None and ev.at > e.cpu_seen[0]:
            # a process that exited takes its CPU seconds with it: never below zero
            used = max(0.0, ev.cpu_s - e.cpu_seen[1])
            e.cpu_percent = round(100 * used / (ev.at - e.cpu_seen[0]), 2)
        e.cpu_seen = (ev.at, ev.cpu_s)
        return e.cpu_percent

    def exited(self, ev: Exited, asked: bool) -> eng.EngineProcess | None:
        """The engine's main process exited (asked for, or not); None: a stale event."""
        engine = self.current(ev.generation)
        if engine is None:
            return None
        engine.exit_code = ev.code
        if self.phase in (Bay.STARTING, Bay.HEALTHY):  # (a take-down's exit: it goes on)
            self._set_phase(Bay.EXITED)
        if not asked and engine.core_lost is None:
            _oom_seen(engine, ev.oom_kills)
        self.last_exit = engine.describe_exit()
        fields: dict[str, Any] = {"exit_code": ev.code}
        if ev.code < 0:
            with contextlib.suppress(ValueError):
                fields = {"signal": signal.Signals(-ev.code).name}
        if engine.oom_killed is not None and engine.core_lost is None:
            fields["oom_killed"] = engine.oom_killed
        log.info(f"{self.what} exited", pid=engine.pid, asked=asked, **fields)
        self._event("exit", pid=engine.pid, asked=asked, **fields)
        return engine

    def core_exited(self, ev: CoreExited) -> eng.EngineProcess | None:
        """The engine's core died, its API server still up: the engine, when that is news
        (not a take-down's doing, not after the API server's own exit)."""
        engine = self.current(ev.generation)
        if engine is None or engine.exit_code is not None or self.taking_down:
            return None
        engine.core_lost = ev.pid
        _oom_seen(engine, ev.oom_kills)
        self.last_exit = engine.describe_exit()
        oom = {"oom_killed": engine.oom_killed} if engine.oom_killed is not None else {}
        log.warning("engine core exited", pid=engine.pid, core_pid=ev.pid, **oom)
        self._event("core_exit", pid=engine.pid, core_pid=ev.pid, **oom)
        return engine

    def take_down(self, graceful: bool, req: evidence.EvidenceRequest | None) -> None:
        """A take-down begins here (the executor's, which starts its job)."""
        engine = self.engine
        assert engine is not None
        self._set_phase(Bay.TAKING_DOWN)
        self._event("take_down", pid=engine.pid, graceful=graceful,
                    evidence_for=req.rule if req is not None else None)
        log.info(f"taking the {self.what} down", pid=engine.pid, graceful=graceful)

    def evidence_request(self, enabled: bool, signals: Mapping[str, float | None],
                         gpu: Mapping[str, Any] | None,
                         wall: float) -> evidence.EvidenceRequest | None:
        """What the take-down now beginning captures first, if anything was asked."""
        pending, self.evidence_for = self.evidence_for, None
        engine = self.engine
        if pending is None or not enabled or engine is None:
            return None
        rule, reason = pending
        pids = [engine.pid, *(p.pid for p in engine.known if p.pid != engine.pid)]
        return evidence.EvidenceRequest(
            reason=reason, rule=rule, engine_pid=engine.pid, pids=pids,
            log_lines=list(engine.recent_lines), signals=signals, gpu=gpu, wall=wall)

    def down(self, ev: Down) -> tuple[eng.EngineProcess, str | None]:
        """The take-down ended: the engine that left the slot, and why its tree is not
        proven gone (None: it is, and its state file and guard are dropped)."""
        engine = self.engine
        assert engine is not None
        self._set_phase(Bay.EMPTY)
        self.engine = self.spec = None
        problem = ev.error
        if ev.result is not None:
            r = ev.result
            engine.exit_code = r.exit_code
            survivors = [proctree.describe(p.pid) for p in r.survivors]
            held = {pid: round(mem / 2**20) for pid, mem in r.gpu_holders.items()}
            fields: dict[str, Any] = {"pid": engine.pid, "duration_s": round(r.duration_s, 3),
                                      "sigkilled": r.sigkilled, "exit": engine.describe_exit()}
            if survivors:
                problem = (f"processes of the old {self.what} tree survived SIGKILL: "
                           + ", ".join(survivors))
                fields["survivors"] = survivors
            elif held:
                problem = f"GPU memory still held by the old {self.what} tree: " + ", ".join(
                    f"pid {p} ({mib} MiB)" for p, mib in held.items())
                fields["gpu_holders_mib"] = held
            if r.port_problem:
                fields["port"] = r.port_problem
            log.info(f"{self.what} tree reaped", **fields, problem=problem)
            self._event("reaped", **fields, problem=problem)
        if problem is not None:
            log.error(f"{self.what} tree not proven gone", problem=problem)
        return engine, problem


def _oom_seen(engine: eng.EngineProcess, oom_kills: int | None) -> None:
    """Whether the kernel's OOM killer ran between the last look at the engine's tree and
    its death, now seen (said at error level when it did: the host is out of memory)."""
    engine.oom_killed = hostmem.oom_killed(engine.oom_kills_seen, oom_kills)
    if engine.oom_killed:
        log.error("the kernel's OOM killer ran as the engine died: most likely it was the "
                  "one killed (the host is out of memory)", pid=engine.pid,
                  oom_kills_before=engine.oom_kills_seen, oom_kills_after=oom_kills)
