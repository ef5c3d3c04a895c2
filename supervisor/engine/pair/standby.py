"""The standby: a second engine of the same command and arguments on the same GPUs and
its own port, kept loaded and idle (`engine.standby = "awake"`) or asleep through vLLM's
sleep mode (`"sleep"`), that takes over when the serving engine fails or is restarted
(docs/standby.md).

`Standby` owns the standby's place (`EngineSlot` in bay 1, or bay 0 once the engines have
swapped) and its lifecycle: started (beside the serving engine, or before it when the
two do not fit side by side), healthy, proven with a real generation, put to sleep when
so configured, and only then ready; a standby that fails is taken down and started again
after a backoff. On a failover the handover (`supervisor/engine/pair/handover.py`) gives the
unit the ready standby's slot as its serving one and hands its old slot back here to be
taken down; once that tree is proven gone a new standby starts in the freed place. Nothing
but the daemon's health checks, its probe of the development routes (GETs refused before
any handler runs, once, before its proof), its proof, its sleep and its wake reach a
standby before it serves (a request to a sleeping vLLM can crash it: vllm#15483). One
that cannot sleep (`devroutes.sleep_off`) is kept awake where it fits, else refused.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import structlog

from supervisor.engine import steps as do
from supervisor.engine.events import Event, GateProbe, Slept, StandbyDue
from supervisor.engine.pair import outcomes as out
from supervisor.engine.pair.pair_states import ON_ITS_WAY, ROLE, Role, check
from supervisor.engine.pair.slot import EngineSlot, SlotView
from supervisor.engine.process import process as eng
from supervisor.settings.engine_checks import SLEEPING
from supervisor.settings.sections import EngineConfig
from supervisor.watchdog import devroutes

log = structlog.get_logger("supervisor")

_Key = tuple[tuple[str, ...], tuple[tuple[str, str], ...]]


def _key(cfg: EngineConfig) -> _Key:
    """What decides whether an engine serves vLLM's development routes: its command and
    environment (`--enable-sleep-mode` is required of a sleeping standby at load)."""
    return tuple(cfg.command), tuple(sorted(cfg.env.items()))


# the key of the standby's backoff timer, held by the unit's executor
TIMER = "standby"


def made_of(spec: eng.SpawnSpec) -> dict[str, str]:
    """What a standby of `spec` is, as kept with its images (`standby = "snapshot"`): a
    copy restored from them serves only while a start would run the same. Its port
    aside: a copy listens on the dumped one's inside its namespace, whichever bay it is
    restored in, and is reached through its relay."""
    argv = ["PORT" if i and spec.argv[i - 1] == "--port" else a
            for i, a in enumerate(spec.argv)]
    env = " ".join(f"{k}={v}" for k, v in sorted(spec.env.items()))
    return {"argv": " ".join(argv), "env": env, "cwd": spec.cwd}


class Standby:
    """A decider: what it does to its engine (spawn it, take it down, put it to sleep,
    prove it, time its backoff) it returns as steps (`supervisor/engine/steps.py`) for the
    unit's executor; it holds no effects."""

    def __init__(self, audit: Callable[..., None], monotonic: Callable[[], float],
                 slot: EngineSlot) -> None:
        self._audit, self._monotonic = audit, monotonic
        self.slot = slot
        self.state = Role.NONE  # its role: supervisor/engine/pair/pair_states.py
        self.why: str | None = None
        self.since = monotonic()
        self.failures = 0  # in a row: the backoff before the next start
        self.mode = "awake"  # as it was started: "awake" or "sleep"
        self.asleep = False
        # an awake one sleeps and wakes once before it is ready; off for good once a
        # wake broke an engine of the unit (set by `EngineUnit.handle`)
        self.warm_up = True
        # why an engine of this unit cannot sleep (`devroutes.sleep_off`: a flag, a
        # development route it does not serve), for the command and environment it was
        # started with: learned from every engine's probe at its start (the serving
        # engine's and each standby's), so that a relaunch that changes it is seen
        self._no_sleep: tuple[_Key, str] | None = None
        # since when no standby is ready (monotonic; None while one is): the next fault
        # costs a cold start until one is
        self.unready_since: float | None = self.since
        # `standby = "snapshot"`: what its images were made of (None: none made by this
        # daemon run), why no dump is tried any more (one failed: a sleeping standby
        # then), and whether the next standby starts at once (one was just dumped: a
        # copy of it, or a sleeping one if the dump failed)
        self.image: dict[str, str] | None = None
        self.no_snapshot: str | None = None
        self.next_now = False
        self._copy = False  # the engine in its place (or coming) is a copy of the images
        self.image_port = 0  # the port its copies listen on inside their namespaces
        # the images are an earlier daemon run's (`adopt`), no copy of them ready yet in
        # this one: the first copy is restored before the engine starts (on a free card),
        # and one that fails leaves room for a fresh standby to start first and be dumped
        self.adopted = False
        self.image_warmed = False  # the dumped engine's client paths were warmed
        self.image_version: str | None = None  # the dumped engine's vLLM (None: unknown)
        self.image_weights: int | None = None  # ... its weights' backup (None: unknown)
        # `engine.standby_weights = "gpu"` (pair/weights_ahead.py): its weights woken onto
        # the card ahead of a fault, the rest asleep: None (on the host), "asked", "back";
        # and why none is woken ahead (until the serving engine's next cold start)
        self.weights: str | None = None
        self.weights_off: str | None = None
        # ... and once they are, its pinned host cache (their backup, kept by torch):
        # None (not asked), "asked", "emptied", or why it is kept
        self.host_cache: str | None = None

    def learned(self, engine: eng.EngineProcess) -> str | None:
        """An engine of this unit (either role) was probed at its start: whether engines
        so started can sleep. Why not (None: they can, or it was not probed)."""
        if engine.routes is None:
            return None
        why = devroutes.sleep_off(engine.routes, engine.spec.argv, engine.spec.env)
        self._no_sleep = (_key(engine.config), why) if why is not None else None
        return why

    def no_sleep(self, cfg: EngineConfig) -> str | None:
        """Why a standby of `cfg` cannot sleep, as the last probe of an engine so started
        said; None when it can, or nothing is known of it."""
        if self._no_sleep is None or self._no_sleep[0] != _key(cfg):
            return None
        return self._no_sleep[1]

    def owns(self, ev: Event) -> bool:
        """The event is about the engine in the standby's place (generations are unique
        across a unit's places)."""
        gen = getattr(ev, "generation", None)
        return gen is not None and gen == self.slot.generation and gen > 0

    def _to(self, state: Role, why: str | None = None) -> None:
        if state is not self.state:
            check(ROLE, self.state, state)
            if self.state is Role.READY:
                self.unready_since = self._monotonic()
            elif state is Role.READY:
                self.unready_since = None
            self.state, self.why, self.since = state, why, self._monotonic()

    @property
    def ready(self) -> bool:
        return self.state is Role.READY and self.slot.engine is not None

    @property
    def idle(self) -> bool:
        """No engine in the standby's place, none coming."""
        return self.slot.engine is None and not self.slot.spawning

    def can_start(self) -> bool:
        return self.idle and self.state not in (Role.FAILED, Role.WAITING)

    @property
    def on_its_way(self) -> bool:
        """Started, not ready yet."""
        return self.state in ON_ITS_WAY and not self.slot.taking_down

    @property
    def restoring(self) -> bool:
        """A copy of the kept images being restored (spawned, not ready yet)."""
        spec = self.slot.spec
        return self.on_its_way and spec is not None and spec.restore is not None

    @property
    def thin(self) -> bool:
        """The engine in its place (or coming) runs the thinner standby's arguments
        (`standby_args`): its spawn says so (`SpawnSpec.thin`)."""
        return self.slot.thin

    def adopt(self, made: dict[str, str], port: int, images: str, warmed: bool,
              vllm_version: str | None = None, weights_bytes: int | None = None) -> None:
        """Images an earlier run of the daemon left in this boot of the host
        (`criu.kept`): a copy of them is the first standby when they are of what a
        start would run (`restorable`), with no vLLM start and no dump."""
        self.image, self.image_port, self.adopted = made, port, True
        self.image_warmed = warmed
        self.image_version, self.image_weights = vllm_version, weights_bytes
        log.info("standby images kept from an earlier run", images=images)
        self._audit("standby_images_kept", images=images)

    def restorable(self, spec: eng.SpawnSpec) -> bool:
        """A copy of the kept images would be the standby a start of `spec` would be."""
        return self.no_snapshot is None and self.image is not None \
            and self.image == made_of(spec)

    def snapshot_spec(self, spec: eng.SpawnSpec, cfg: EngineConfig) -> eng.SpawnSpec:
        """The standby's spawn with `standby = "snapshot"`: a copy restored from its images
        when they are of `spec`; else `spec` itself (a standby to dump once asleep)."""
        if not self.restorable(spec):
            return spec
        return replace(spec, restore=eng.Restore(
            eng.snapshot_images(cfg.snapshot_dir), cfg.criu, spec.env.get("VLLM_RPC_BASE_PATH"),
            self.image_port, self.image_warmed, self.image_version, self.image_weights))

    def start(self, spec: eng.SpawnSpec, cfg: EngineConfig, mode: str) -> list[do.Step]:
        self._to(Role.STARTING)
        self.mode, self.asleep, self.next_now = mode, False, False
        self.weights = self.host_cache = None
        self._copy = spec.restore is not None  # (a copy of the images: one that fails
        # drops them, and the next standby is a fresh one, dumped again)
        log.info("standby starting", port=spec.port, mode=mode,
                 **({"thin": spec.thin} if cfg.standby_args else {}))
        return [do.Spawn(self.slot.bay, spec, cfg)]

    def no_room(self, why: str) -> None:
        """None can start now (the serving engine took the room a standby needs)."""
        if self.state is not Role.NO_ROOM:
            log.info("no standby for now", why=why)
        self._to(Role.NO_ROOM, why)

    def due_later(self, backoff_initial_s: float, backoff_max_s: float) -> list[do.Step]:
        """Start again after a backoff that grows with each failure in a row."""
        delay = min(backoff_max_s, backoff_initial_s * 2 ** max(0, self.failures - 1))
        self._to(Role.WAITING, self.why)
        return [do.ArmTimer(TIMER, delay, StandbyDue())]  # (one a timer before replaces)

    def due(self) -> None:
        if self.state is Role.WAITING:
            self._to(Role.NONE, self.why)

    @staticmethod
    def cancel_timer() -> list[do.Step]:
        return [do.CancelTimer(TIMER)]

    def forget_failures(self) -> None:
        """What it runs changed (an upgrade): earlier failures say nothing of the next."""
        self.failures = 0

    def fits(self, spec: eng.SpawnSpec) -> bool:
        """The ready standby was started as an engine started now would be (a reload or
        a relaunch with new arguments since makes it out of date)."""
        e = self.slot.engine
        return self.ready and e is not None and e.spec.argv == spec.argv \
            and e.spec.env == spec.env and e.spec.cwd == spec.cwd

    def take_over(self, old: SlotView, keep: bool = False) -> tuple[SlotView, bool]:
        """The ready standby's bay, to serve, and whether its engine is asleep (to be
        woken before anything reaches it); `old` (the serving one) takes its place (the
        unit swaps the two: `do.ServeFrom`), to be taken down by the caller, or with
        `keep` (a thin one, handing back to a full-size engine) to finish its requests
        and be the standby again."""
        new = self.slot.view()
        asleep, self.asleep = self.asleep, False
        self.weights = self.host_cache = None  # (the handover's now: `Handover.fail_over`)
        self.failures = 0
        if keep:
            self._to(Role.RETURNING, "a full-size engine took over")
        else:
            self._to(Role.RETIRING if old.engine is not None else Role.NONE, "took over")
        return new, asleep

    def keep(self, mode: str) -> list[do.Step]:
        """The thin engine back in the standby's place has no request left: put to
        sleep (with `standby = "sleep"`) and ready, as a standby started there would be."""
        e = self.slot.engine
        if self.state is not Role.RETURNING or e is None or self.slot.taking_down:
            return []
        self.mode = mode
        log.info("the thin engine is the standby again", pid=e.pid, mode=mode)
        why = self.learned(e) if mode == "sleep" else None
        if mode == "sleep" and why is None:
            self._to(Role.SLEEPING)
            return [do.Sleep(e)]
        # (an asymmetric pair fits awake: checked at load)
        self._ready(e, self._kept_awake(e, why) if why is not None else None)
        return []

    def retire(self, why: str, graceful: bool, deadline: float) -> list[do.Step]:
        """Take the engine in the standby's place down (a failed standby, one out of
        date, the daemon stopping)."""
        out = self.cancel_timer()
        if self.slot.engine is not None and not self.slot.taking_down:
            # one still starting has nothing to finish, and vLLM ignores SIGTERM until it
            # serves: it would cost the whole grace (30 s on the H100) for nothing
            out.append(do.TakeDownIn(self.slot.bay, graceful and self.state not in ON_ITS_WAY,
                                     deadline, evidence=False))
        if self.slot.engine is not None or self.slot.spawning:
            self._to(Role.RETIRING, why)
        elif self.state is not Role.FAILED:
            self._to(Role.NONE, why)
        return out

    def _gone_unasked(self, why: str, deadline: float) -> list[do.Step]:
        """The engine in the standby's place died. A standby's death is a failure (a
        backoff before the next); the old serving engine's, while the requests it had
        finish there behind a swap, is not the standby's: its tree is taken down, and a
        new standby starts once it is gone, as after any swap."""
        if self.state in (Role.RETIRING, Role.RETURNING):
            log.warning("the engine being retired died", why=why, reason=self.why,
                        pid=self.slot.engine.pid if self.slot.engine else None)
            self._audit("retired_engine_died", why=why, reason=self.why)
            return self.retire(self.why or why, graceful=False, deadline=deadline)
        return self._failed(why, deadline)

    def _drop_image(self, why: str) -> None:
        """A copy of the images failed: they are not trusted again (the next standby is
        a fresh one, dumped again once asleep)."""
        if self._copy and self.image is not None:
            log.warning("a copy of the standby's images failed: they are made again",
                        why=why)
            self._audit("standby_images_dropped", why=why)
            self.image = None
            if self.adopted:  # (an earlier run's, at the start: a fresh standby first)
                self.adopted, self.next_now = False, True

    def _failed(self, why: str, deadline: float) -> list[do.Step]:
        self.failures += 1
        self._drop_image(why)
        log.warning("standby failed", why=why, failures=self.failures)
        self._audit("standby_failed", why=why, failures=self.failures)
        return self.retire(why, graceful=False, deadline=deadline)

    def handle(self, ev: Event, deadline: float,
               awake_fits: bool = True) -> tuple[bool, list[do.Step]]:
        """One event of the standby's engine other than its process's (`on_outcome`):
        whether its place is free again and a new standby may start (the unit decides
        whether one should), and the steps for its engine. `awake_fits`: an awake
        standby has room beside the serving engine (one that cannot sleep is then kept
        awake; else it is refused)."""
        if isinstance(ev, GateProbe):
            return False, self._proved(ev, deadline, awake_fits)
        if isinstance(ev, Slept):
            return False, self._slept(ev, deadline)
        # anything else (evidence, metrics, canaries, drains) comes from jobs of a retired
        # engine: the unit audits evidence, and a standby never asks for it
        return False, []

    def _proved(self, ev: GateProbe, deadline: float, awake_fits: bool) -> list[do.Step]:
        e = self.slot.current(ev.generation)
        if e is None or self.slot.taking_down or self.state is not Role.PROVING:
            return []
        why = self.learned(e) if self.mode in SLEEPING else None
        if not ev.ok:
            return self._failed(f"its first generation failed: {ev.error}", deadline)
        if self.mode in SLEEPING and why is None:
            self._to(Role.SLEEPING)
            return [do.Sleep(e)]
        if why is None:
            self._ready(e)
        elif awake_fits:
            self._ready(e, self._kept_awake(e, why))
        else:
            # no sleep, and no room awake: refused, not failed (no backoff, no retry:
            # the next engine start's probe says again, docs/standby.md)
            log.warning("the standby cannot sleep and an awake one does not fit "
                        "beside the engine: no standby", why=why, pid=e.pid)
            self._audit("standby_refused", why=why, pid=e.pid)
            return self.retire(f"it cannot sleep: {why}", graceful=False, deadline=deadline)
        return []

    def _slept(self, ev: Slept, deadline: float) -> list[do.Step]:
        e = self.slot.current(ev.generation)
        if e is None or self.slot.taking_down or self.state is not Role.SLEEPING:
            return []
        if ev.error is not None:
            return self._failed(f"it could not be put to sleep: {ev.error}", deadline)
        self.asleep = True
        if self.mode == "snapshot" and self.no_snapshot is None:
            # kept as images (its GPU state taken off first), which ends it; a copy of
            # it is the standby next (`on_outcome`'s Gone)
            self._to(Role.DUMPING, "asleep: kept as images")
            images = eng.snapshot_images(e.config.snapshot_dir)
            log.info("standby asleep: kept as images", pid=e.pid, images=images,
                     sleep_s=round(ev.seconds, 3))
            return [do.DumpIn(self.slot.bay, eng.Restore(images, e.config.criu),
                              made_of(e.spec), deadline)]
        # (the daemon's calls, and what vLLM measured of its sleep)
        self._ready(e, sleep_s=round(ev.seconds, 3), vllm_s=ev.vllm_s)
        return []

    def reads(self) -> tuple[bool, bool]:
        """How its bay reads its process's events (`EngineSlot.on`): whether a health
        result counts (it is starting), whether an exit is expected (never: a standby's
        unasked exit is a failure)."""
        return self.state is Role.STARTING, False

    def on_outcome(self, outcome: out.Outcome, deadline: float,
                   stopping: bool) -> tuple[bool, list[do.Step]]:
        """Its engine's process, as its bay read it (`EngineSlot.on`): whether its place
        is free again, and the steps."""
        match outcome:
            case out.SpawnFailed(error):
                self.failures += 1
                self._drop_image(f"could not be restored: {error}")
                self._to(Role.NONE, f"could not be started: {error}")
                return True, []
            case out.Up():
                if stopping or self.state is Role.RETIRING:  # (retired while it spawned)
                    self._to(Role.RETIRING,
                             "the daemon is stopping" if stopping else self.why)
                    return False, [do.TakeDownIn(self.slot.bay, True, deadline, evidence=False)]
            case out.Healthy(e) if e.spec.restore is not None:
                # a copy of the standby as it was dumped: proven and asleep (a request
                # to a sleeping vLLM can crash it: nothing but its wake reaches it)
                self.asleep, self.adopted = True, False
                self._ready(e, "restored from its images")
                return False, []
            case out.Healthy(e):
                self._to(Role.PROVING)
                # a real generation proves it; one to be kept awake sleeps and wakes
                # once before (its first KV reset after a takeover costs no first sleep;
                # one to be dumped sleeps again: it keeps what that sleep reuses)
                return False, [do.ProbeGate(e, warm=self.warm_up and self.mode != "sleep",
                                            sleeps_later=self.mode == "snapshot")]
            case out.Unhealthy(_, why):
                return False, self._failed(why, deadline)
            case out.Died(_, why):
                return False, self._gone_unasked(f"it {why}", deadline)
            case out.Gone(e, problem, dumped_s, dump_error):
                if problem is not None:
                    self._to(Role.FAILED, problem)
                    self._audit("standby_failed", why=problem, failures=self.failures)
                    return False, []
                if self.state is Role.DUMPING:
                    self._dumped(e, dumped_s, dump_error)
                elif self.state is Role.RETIRING:
                    self._to(Role.NONE, self.why)
                return True, []
        return False, []

    def _dumped(self, e: eng.EngineProcess, dumped_s: float | None,
                dump_error: str | None) -> None:
        """The standby's dump ended, and its tree is gone: a copy of it is the standby
        next; or, the dump failed, no dump is tried again (a sleeping standby from now,
        said in status) until the daemon restarts."""
        if dump_error is None:
            # (what it was made of: the dumped engine's own spawn)
            self.image, self.next_now, self.image_port = made_of(e.spec), True, e.spec.port
            self.adopted, self.image_warmed = False, e.warmed is not None
            self.image_version, self.image_weights = e.vllm_version, e.weights_bytes
            images = eng.snapshot_images(e.config.snapshot_dir)
            log.info("standby kept as images", pid=e.pid, seconds=dumped_s, images=images)
            self._audit("standby_dumped", pid=e.pid, seconds=dumped_s, images=images)
            self._to(Role.NONE, "kept as images: a copy of it is the standby next")
            return
        self.image, self.no_snapshot, self.next_now = None, dump_error, True
        log.error("standby not kept as images: a sleeping standby from now",
                  pid=e.pid, error=dump_error)
        self._audit("standby_not_dumped", pid=e.pid, error=dump_error)
        self._to(Role.NONE, f"not kept as images ({dump_error}): a sleeping standby")

    def _kept_awake(self, e: eng.EngineProcess, why: str) -> str:
        """A standby configured to sleep that cannot: kept awake (it fits beside)."""
        self.mode = "awake"
        log.warning("the standby cannot sleep: kept awake", why=why, pid=e.pid)
        return f"kept awake: it cannot sleep: {why}"

    def _ready(self, e: eng.EngineProcess, why: str | None = None, **fields: Any) -> None:
        self._to(Role.READY, why)
        self.failures = 0  # (a later failure begins a new streak)
        fields = {"pid": e.pid, "port": e.config.port, "asleep": self.asleep,
                  "start_s": round(self._monotonic() - e.started_at, 3), **fields}
        if why is not None:
            fields["reason"] = why
        log.info("standby ready", **fields)
        self._audit("standby_ready", **fields)

    def status(self, now: float) -> dict[str, Any]:
        e = self.slot.engine
        alive = e is not None and e.exit_code is None
        unready = self.unready_since
        return {"state": self.state.value, "reason": self.why, "for_s": round(now - self.since, 3),
                # its process's phase in its bay (pair_states.Bay): spawning, starting,
                # healthy, exited, taking_down, empty
                "bay": self.slot.phase.value,
                # protected: the next crash or restart is a handover, not a cold start
                "protected": unready is None,
                "unprotected_for_s": round(now - unready, 3) if unready is not None else None,
                "pid": e.pid if alive and e is not None else None,
                "port": e.config.port if e is not None else None,
                "asleep": self.asleep, "thin": self.thin,
                # where a sleeping one's weights are (`engine.standby_weights`): "host",
                # "waking" (onto the card, ahead of a fault), "gpu" (and why not:
                # `views.standby_status`)
                "weights": ({"asked": "waking", "back": "gpu"}.get(self.weights or "", "host")
                            if self.asleep else None),
                # what it can carry of streams after a failover (a thin one: less than
                # the engine's), as its core said at its start; None: not said yet
                "kv_tokens": e.kv_tokens if alive and e is not None else None,
                # `standby = "snapshot"`: its images, whether they are made, and why no
                # dump is tried (one failed); None for other designs
                "snapshot": {"made": self.image is not None, "off": self.no_snapshot,
                             "copy": e is not None and e.spec.restore is not None}
                if self.mode == "snapshot" else None,
                # the tree's host memory as last seen (asleep at level 1: its weights)
                "rss_bytes": e.rss_bytes if alive and e is not None else None}
