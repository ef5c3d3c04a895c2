"""The engine's weight cache: a `vllm preload` process beside it, supervised
(`engine.weight_cache`, docs/weight-cache.md).

`WeightCache` owns the cache's place (an `EngineSlot` in the weight cache's bay: its
process tree in its own session, its state file and its guard), its state
(`pair_states.Cache`), its failures (`RestartTracker`: a backoff after each, and after
boot failures in a row it gives up), the health port its spawn picked and the command
line it runs, and decides how an engine started now gets its weights (`load`): mapped from the
cache while it answers healthy, vLLM's own load otherwise. The cache is started before
the unit's engine, whose start waits while the cache is starting (bounded by the cache's
startup timeout), and taken down after the unit's engines when the daemon stops. Like the
standby, it is a decider on the unit's task: the unit hands it what its bay read of its
process (`on_outcome`) and its health's loss (`handle`), and carries out the steps it
returns.

Invariants:
- one cache process at most: the next one spawns only once the last one's tree is
  proven gone (vLLM's per-GPU socket lock would refuse a second beside it anyway);
- an engine gets `--load-format ipc_cache` only while the cache is READY; otherwise its
  command line is what it would be without a cache;
- the cache's death never touches an engine: vLLM keeps weights it mapped alive in the
  engine (the CUDA driver holds them until the engine exits), so it serves on, and a
  restarted cache loads a second copy of the weights.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import structlog

from supervisor.engine import steps as do
from supervisor.engine.events import CacheDue, CoreExited, Event, HealthLost, iso_time
from supervisor.engine.lifecycle import RestartTracker
from supervisor.engine.pair import outcomes as out
from supervisor.engine.pair.pair_states import CACHE, Cache, check
from supervisor.engine.pair.slot import EngineSlot
from supervisor.engine.process import process as eng
from supervisor.engine.process import takedown
from supervisor.loop import Clock
from supervisor.settings import weight_cache_argv as wc
from supervisor.settings.bays import ENGINE_BAYS
from supervisor.settings.sections import EngineConfig, RestartConfig

log = structlog.get_logger("supervisor")


# the key of the cache's backoff timer, held by the unit's executor
TIMER = "weight_cache"


class WeightCache:
    """A decider: what it does to its process (spawn it, take it down, watch its health,
    time its backoff) it returns as steps (`supervisor/engine/steps.py`) for the unit's
    executor; it holds no effects."""

    def __init__(self, audit: Callable[..., None], clock: Clock,
                 slot: EngineSlot, restart: RestartConfig) -> None:
        self._audit, self._clock = audit, clock
        self.slot = slot
        self.state = Cache.OFF
        self.why = "not configured"
        self.since, self.since_wall = clock.monotonic(), clock.wall()
        self.last_error: str | None = None
        self.tracker = RestartTracker(restart)
        self._delay_s = 0.0  # the backoff after the take-down under way
        self._then = Cache.OFF  # what follows the take-down under way
        # the settings it is kept for (the unit's engine's, at its start and each reload)
        self._cfg: EngineConfig | None = None
        self._environ: Mapping[str, str] = {}
        self.sockets = ""  # its socket folder (`Config.weight_cache_dir`)
        self._key: tuple[Any, ...] | None = None  # what it runs, less its port
        self.port: int | None = None  # its health port, chosen by each spawn
        self.spawns = 0
        self.holding = False  # the serving engine's start waits for it
        self.unproven: str | None = None  # its tree was not proven gone: no other one
        self._gave_up: str | None = None  # why it was given up (boot failures in a row)
        self.last_engine_start: dict[str, Any] | None = None  # where its weights came from

    # ---- its place ---------------------------------------------------------------------

    @property
    def configured(self) -> bool:
        return self._cfg is not None and self._cfg.weight_cache

    def owns(self, ev: Event) -> bool:
        """The event is about the cache's process (generations are unique in a unit)."""
        gen = getattr(ev, "generation", None)
        return gen is not None and gen > 0 and gen == self.slot.generation

    def pids(self) -> set[int]:
        e = self.slot.engine
        return {p.pid for p in e.known} if e is not None else set()

    def _to(self, state: Cache, why: str) -> None:
        if state is not self.state:
            check(CACHE, self.state, state)
            log.info("weight cache", **{"from": self.state.value, "to": state.value}, why=why)
            self.state, self.since, self.since_wall = state, self._clock.monotonic(), \
                self._clock.wall()
        self.why = why

    def _spec(self) -> tuple[eng.SpawnSpec, EngineConfig]:
        """What the cache runs: `vllm preload` with the engine's interpreter, environment
        (its GPUs included) and folder; its health on loopback, at a port its spawn
        picks (none of the engine's); no drain."""
        cfg = self._cfg
        assert cfg is not None
        env = eng.build_spawn_spec(cfg, self._environ).env
        argv = wc.preload_argv(cfg, self.sockets, eng.PORT)
        own = dataclasses.replace(cfg, host=wc.HEALTH_HOST, port=0, health_path="/health",
                                  drain_timeout_s=0.0, args=[], standby="none")
        # (its socket folder and its port made and picked by the spawn: effects both)
        return eng.SpawnSpec(argv=argv, env=env, cwd=cfg.cwd, host=own.host, port=0,
                             folders=(self.sockets,),
                             pick_port=tuple(cfg.in_bay(b).port for b in ENGINE_BAYS)), own

    def _key_now(self) -> tuple[Any, ...]:
        spec, _ = self._spec()
        return tuple(spec.argv), tuple(sorted(spec.env.items())), spec.cwd

    # ---- the unit asks -----------------------------------------------------------------

    def want(self, cfg: EngineConfig, environ: Mapping[str, str],
             sockets: str) -> list[do.Step]:
        """The engine's settings now (the unit's start, a reload): the cache is started,
        started again when what it runs changed, or taken down when turned off."""
        self._cfg, self._environ, self.sockets = cfg, environ, sockets
        if not cfg.weight_cache:
            return self._off("turned off by a reload") if self.state is not Cache.OFF else []
        key = self._key_now()
        if self.unproven is not None:
            log.error("no weight cache until the daemon restarts: the last one's tree was "
                      "not proven gone", problem=self.unproven)
            return []
        if self.state is Cache.OFF:
            return self._start("the engine has a weight cache")
        if self.state is Cache.STOPPING and self._then is Cache.OFF and key == self._key:
            self._then = Cache.STARTING  # (turned off, and on again before it was down)
        elif key != self._key:
            self.tracker.reset()  # (its failures were of another command line)
            log.info("the weight cache's arguments changed: it starts again")
            if self.slot.engine is not None or self.slot.spawning:
                return self._take_down("its arguments changed", then=Cache.STARTING)
            return [*self.cancel_timer(), *self._start("its arguments changed")]
        return []

    def reconfigure(self, restart: RestartConfig) -> None:
        self.tracker.cfg = restart

    def load(self) -> eng.Load | None:
        """How an engine spawned now gets its weights (None: no weight cache)."""
        if not self.configured:
            return None
        e = self.slot.engine
        if (self.state is Cache.READY and e is not None and e.exit_code is None
                and not self.slot.taking_down):
            return eng.Load(wc.load_args(self.sockets), "cache",
                            f"the weight cache (pid {e.pid}) answers healthy")
        return eng.Load((), "disk", self._not_ready())

    def _not_ready(self) -> str:
        if self.state is Cache.STARTING:
            return "the weight cache is still starting"
        if self.state is Cache.BACKOFF:
            return f"the weight cache is down ({self.last_error}); {self.why}"
        if self.state is Cache.STOPPING:
            return f"the weight cache is being taken down: {self.why}"
        return f"the weight cache {self.state.value}: {self.why}"

    def holds_start(self) -> bool:
        """The serving engine's start waits while the cache starts (its weights loaded
        once, not twice side by side) or is being taken down (its memory released
        first): its start or its take-down ending (ready, failed, down) lets it go."""
        if self.state not in (Cache.STARTING, Cache.STOPPING):
            return False
        if not self.holding:
            log.info("the engine's start waits for its weight cache", pid=self.slot.engine.pid
                     if self.slot.engine is not None else None)
        self.holding = True
        return True

    def release_start(self) -> bool:
        """Whether a start held for the cache may go on now (once)."""
        if self.holding and self.state not in (Cache.STARTING, Cache.STOPPING):
            self.holding = False
            return True
        return False

    def down_last(self) -> tuple[bool, list[do.Step]]:
        """The unit stops with its engines gone: the cache goes now. Whether nothing of it
        is left (then the stop may end), and the steps that take it down."""
        self.holding = False
        if self.slot.engine is None and not self.slot.spawning:
            if self.state in (Cache.BACKOFF, Cache.STARTING, Cache.STOPPING):
                self._to(Cache.OFF, "the daemon stopped")
            return True, self.cancel_timer()
        return False, self._take_down("the daemon is stopping", then=Cache.OFF)

    def engine_started(self, engine: eng.EngineProcess, load: eng.Load | None) -> None:
        """An engine started on this cache serves: where its weights came from, as its
        own lines said (vLLM falls back to the disk when the cache's weights do not
        match the engine's, or the cache went meanwhile)."""
        if load is None or not self.configured:
            return
        said = engine.weights
        got = "disk" if load.weights == "disk" or (said or "").startswith("disk") \
            else "cache"
        line = said.split(": ", 1)[1] if said is not None else None  # (vLLM's own words)
        self.last_engine_start = {"pid": engine.pid, "weights": got,
                                  "why": load.why if load.weights == "disk" else line}
        if load.weights == "cache" and got == "disk":
            self.last_error = f"engine pid {engine.pid} loaded from disk: {line}"
            log.warning("the engine loaded its weights from disk, not from its weight "
                        "cache", pid=engine.pid, said=line)
            self._audit("weight_cache_missed", pid=engine.pid, said=line)

    @staticmethod
    def cancel_timer() -> list[do.Step]:
        return [do.CancelTimer(TIMER)]

    # ---- its lifecycle -----------------------------------------------------------------

    def _start(self, why: str) -> list[do.Step]:
        spec, own = self._spec()
        self._key, self.port, self._gave_up = self._key_now(), None, None
        self.spawns += 1
        self._to(Cache.STARTING, why)
        log.info("weight cache starting", sockets=self.sockets, argv=spec.argv)
        return [do.Spawn(self.slot.bay, spec, own)]

    def _off(self, why: str) -> list[do.Step]:
        if self.unproven is not None:
            return []  # (`failed` it stays, saying why, until the daemon restarts)
        if self.slot.engine is not None or self.slot.spawning:
            return self._take_down(why, then=Cache.OFF)
        self._to(Cache.OFF, why)
        return self.cancel_timer()

    def _take_down(self, why: str, then: Cache) -> list[do.Step]:
        self._then = then
        self._to(Cache.STOPPING, why)
        out = self.cancel_timer()
        e = self.slot.engine
        if e is not None and not self.slot.taking_down:
            deadline = self._clock.monotonic() + takedown.stop_budget_s(
                e.config, proxy_drain=False, evidence_s=0.0)
            out.append(do.TakeDownIn(self.slot.bay, True, deadline, evidence=False))
        return out  # (a spawn under way: taken down once it ends)

    def _failed(self, why: str, healthy_for: float | None) -> list[do.Step]:
        verdict = self.tracker.record_failure(self._clock.monotonic(),
                                              healthy_for_s=healthy_for, what=why)
        self.last_error = why
        log.warning("weight cache failed", why=why, gave_up=verdict.fatal,
                    retry_in_s=None if verdict.fatal else verdict.delay_s)
        self._audit("weight_cache_failed", why=why, gave_up=verdict.fatal,
                    retry_in_s=None if verdict.fatal else verdict.delay_s)
        self._delay_s = verdict.delay_s
        then = Cache.FAILED if verdict.fatal else Cache.BACKOFF
        self._gave_up = verdict.reason if verdict.fatal else None
        if self.slot.engine is not None:
            return self._take_down(why, then)  # (its group: ranks outlive their launcher)
        self._then = then
        return self._after_down()

    def _after_down(self) -> list[do.Step]:
        then, self._then = self._then, Cache.OFF
        if then is Cache.STARTING and self.configured:
            return self._start("started again after a reload")
        if then is Cache.BACKOFF:
            self._to(Cache.BACKOFF, f"starting again in {self._delay_s:g} s")
            return [do.ArmTimer(TIMER, self._delay_s, CacheDue())]
        if then is Cache.FAILED:
            self._to(Cache.FAILED, self.unproven or self._gave_up or str(self.last_error))
            log.error("giving up on the weight cache: engines load their weights from disk "
                      "until a reload changes it or the daemon restarts",
                      last_error=self.last_error)
        else:
            self._to(Cache.OFF, self.why)
        return []

    def due(self) -> list[do.Step]:
        """Its backoff is over."""
        if self.state is Cache.BACKOFF and self.configured:
            return self._start("its backoff is over")
        return []

    def handle(self, ev: Event) -> list[do.Step]:
        """One event of the cache's other than its process's (`on_outcome`): its health
        lost; anything else comes from a job of a process already gone."""
        s = self.slot
        if isinstance(ev, HealthLost):
            e = s.current(ev.generation)
            if e is not None and not s.taking_down and self.state is Cache.READY:
                return self._failed(ev.why, self._clock.monotonic() - e.healthy_at
                                    if e.healthy_at is not None else 0.0)
        return []

    def reads(self, ev: out.ProcessEvent) -> tuple[bool, bool] | None:
        """How its bay reads its process's events (`EngineSlot.on`): whether a health
        result counts (it is starting), whether an exit is expected (it is neither
        starting nor ready); None: not read at all (its core's death: a cache serves no
        requests that a crash would hold, and its exit follows)."""
        if isinstance(ev, CoreExited):
            return None
        return (self.state is Cache.STARTING,
                self.state not in (Cache.STARTING, Cache.READY))

    def on_outcome(self, outcome: out.Outcome, stopping: bool) -> list[do.Step]:
        """Its process, as its bay read it (`EngineSlot.on`)."""
        now = self._clock.monotonic()
        match outcome:
            case out.SpawnFailed(error):
                if self.state is Cache.STOPPING:
                    return self._after_down()
                return self._failed(f"could not be started: {error}", None)
            case out.Up(e):
                self.port = e.config.port  # (the one its spawn picked)
                if stopping or self.state is Cache.STOPPING:  # (asked down while spawning)
                    return self._take_down(self.why if self.state is Cache.STOPPING
                                           else "the daemon is stopping", self._then)
            case out.Healthy(e):
                fields = {"pid": e.pid, "port": self.port,
                          "start_s": round(now - e.started_at, 3)}
                self._to(Cache.READY, f"/health answered 200 after {fields['start_s']:.1f} s")
                log.info("weight cache ready", **fields)
                self._audit("weight_cache_ready", **fields)
                return [do.WatchHealth(e)]
            case out.Unhealthy(_, why):
                return self._failed(why, None)
            case out.Died(e, why):
                return self._failed(why, now - e.healthy_at
                                    if e.healthy_at is not None else None)
            case out.Gone(_, problem):
                if problem is not None:
                    self.unproven = self.last_error = problem
                    self._then = Cache.FAILED
                elif stopping and self._then is not Cache.OFF:
                    # (down for a restart or after a failure, and the daemon stops
                    # meanwhile: nothing starts again)
                    self._then, self.why = Cache.OFF, "the daemon is stopping"
                return self._after_down()
        return []

    # ---- what it shows -----------------------------------------------------------------

    def status(self, now: float) -> dict[str, Any] | None:
        """`status`'s `weight_cache` (None: none configured, none running)."""
        if not self.configured and self.state is Cache.OFF:
            return None
        e = self.slot.engine
        alive = e is not None and e.exit_code is None
        return {"state": self.state.value, "reason": self.why,
                "since": iso_time(self.since_wall), "for_s": round(now - self.since, 3),
                "pid": e.pid if alive and e is not None else None,
                "port": self.port, "socket_dir": self.sockets or None,
                "last_error": self.last_error, "spawns": self.spawns,
                # the serving engine's last start on it: where its weights came from
                "last_engine_start": self.last_engine_start}
