"""The unit's effects as jobs: spawn, watch, take down, drain, sample, timers here; those
that talk to a running engine over HTTP (health, poll, canary, probe, sleep and wake,
remedy) in `supervisor/engine/effects/http_jobs.py`, started from here
(`supervisor/engine/effects/protocol.py` is their protocol; tests replace this class with a
recording fake).

Each job is a coroutine started on this object's task group. It is given what it needs
(the unit's queue, its current config, clock, environment, GPU lister, siblings, gate and
the front proxy), never the unit; it does the I/O and reports only by putting an event
on the queue: no job changes the unit's state.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import psutil
import structlog

from supervisor.engine.effects.http_jobs import HttpJobs
from supervisor.engine.effects.protocol import Front, Timer
from supervisor.engine.events import (
    CardReleased,
    CoreExited,
    Down,
    Drained,
    Event,
    EvidenceCaptured,
    Exited,
    GpuSampled,
    HealthResult,
    KvTierSeen,
    Spawned,
    Tick,
    TreeSeen,
)
from supervisor.engine.process import kv_tier, proctree, shm_files, sleep_backup, takedown
from supervisor.engine.process import process as eng
from supervisor.engine.process.corewatch import CoreWatch
from supervisor.engine.snapshot import copies
from supervisor.engine.startup import compile_cache, start_dirs
from supervisor.front.admission import Gate
from supervisor.front.continuation import schedules_by_priority
from supervisor.loop import Clock, Jobs
from supervisor.ops.descriptors import Shortage, exhausted
from supervisor.settings.bays import BAYS, WEIGHT_CACHE_BAY
from supervisor.settings.config import Config
from supervisor.settings.sections import EngineConfig
from supervisor.watchdog import evidence, hostheat, hostmem, stackdumps
from supervisor.watchdog.gpu import GpuProcessLister, GpuSampler

log = structlog.get_logger("supervisor")


# how long a start short of descriptors (nothing spawned yet) is tried again
SHORTAGE_RETRY_S = 10.0
# how often the KV tier's folder is measured and kept under its bound: a 128-stream
# load of an 8B model wrote ~3 GiB/s to it on an H200; a refused folder is tried again
KV_TIER_EVERY_S = 1.0
KV_TIER_MAX_EVERY_S = 2.0
KV_TIER_RETRY_S = 30.0


def _host_warning(cfg: EngineConfig, folder: Path) -> tuple[str | None, bool]:
    """kv_tier.host_warning with this host's mounts and memory, and whether the folder is
    in memory (off the event loop)."""
    try:
        mounts = Path("/proc/mounts").read_text()
    except OSError:
        mounts = ""
    return (kv_tier.host_warning(cfg, folder, mounts, psutil.virtual_memory().total),
            kv_tier.in_memory(folder, mounts))


def host_short() -> int:
    """What this host lacks of the floor a KV tier in memory leaves it (`kv_tier.host_short`),
    from its MemAvailable now."""
    m = psutil.virtual_memory()
    return kv_tier.host_short(int(m.available), int(m.total))


# the keeper's prunes for the host's memory said at warning level at most this often
SAY_SHORT_EVERY_S = 30.0


class JobEffects:
    """The unit's effects: each one a job (a coroutine below that reports back only
    through the unit's queue), started on this object's task group. The jobs read the
    unit's current config and its clock; they never change its state."""

    def __init__(self, *, queue: asyncio.Queue[Event], config: Callable[[], Config],
                 clock: Clock, environ: dict[str, str], gpu: GpuProcessLister,
                 siblings: Callable[[], set[int]], gate: Gate, front: Front | None,
                 name: str, shm_dir: Path = shm_files.SHM_DIR,
                 gpu_state: copies.GpuState = copies.REAL_GPU,
                 host_short: Callable[[], int] = host_short) -> None:
        self.queue, self.config, self.clock, self.environ = queue, config, clock, environ
        self.gpu, self.siblings, self.gate, self.front, self.name = (
            gpu, siblings, gate, front, name)
        # vLLM's offload files that each engine's tree held, by its main pid, removed
        # once the tree is proven gone (engine/process/shm_files.py; the folder: tests use theirs)
        self.shm_dir = shm_dir
        self._shm: dict[int, shm_files.Seen] = {}
        self._thp_said = False  # the host's huge pages setting looked at, for a sleep backup
        self.gpu_state = gpu_state  # the CUDA driver's checkpoint API, for dumps and copies
        # what the host lacks of a KV tier's floor, now (blocking: through a thread)
        self.host_short = host_short
        # each bay (settings/bays.py) its own state file and guard
        self.bays = {b: (proctree.StateFile(config().state_file_of(b)), proctree.Guard())
                     for b in BAYS}
        self._in_bay: dict[int, eng.EngineProcess] = {}  # watched, not yet forgotten
        self._kv_tiers: list[Path] = []  # the KV tier folders this daemon emptied and keeps
        self._kv_refused: dict[Path, tuple[str, float]] = {}  # folder -> (why, when)
        self._kv_lock = asyncio.Lock()  # (one taker of a folder at a time)
        self._jobs = Jobs()
        # the jobs that talk to the engine over HTTP, and the daemon's own requests to
        # each engine (engine/effects/http_jobs.py)
        self.http = HttpJobs(queue=queue, config=config, clock=clock, environ=environ,
                             gate=gate, front=front)

    def _launch(self, coro: Any, what: str) -> asyncio.Task[Any]:
        return self._jobs.launch(coro, what)

    def begin(self) -> dict[str, Any]:
        guard = self.bays[0][1]
        guard.disarm()  # starts the guard now, so that its pid is in the first log line
        self._launch(self._keep_kv_tier(), "kv tier")
        return {"guard_pid": guard.pid}

    async def end(self) -> None:
        await self._jobs.cancel_all()
        for _, guard in self.bays.values():
            guard.close()
        for folder in self._kv_tiers:  # (the engines are gone: their blocks with them)
            await asyncio.to_thread(kv_tier.clear, folder)

    def tick_every(self, interval_s: float) -> None:
        async def ticker() -> None:
            while True:
                await asyncio.sleep(interval_s)
                self.queue.put_nowait(Tick())

        self._launch(ticker(), "ticker")

    def spawn(self, generation: int, spec: eng.SpawnSpec, cfg: EngineConfig, bay: int) -> None:
        self._launch(self._spawn(generation, spec, cfg, bay), "spawn")

    def watch(self, engine: eng.EngineProcess) -> None:
        self.bays[engine.bay][1].arm(engine.pgid)
        self._in_bay[engine.bay] = engine
        stdout, stderr = engine.streams
        engine.relays = [
            self._launch(eng.relay_output(engine, stdout, "stdout"), "relay stdout"),
            self._launch(eng.relay_output(engine, stderr, "stderr"), "relay stderr")]
        self._launch(self._watch(engine), "watch engine")

    def watch_health(self, engine: eng.EngineProcess) -> None:
        self._launch(self.http.watch_health(engine), "watch health")

    def serve(self, engine: eng.EngineProcess) -> None:
        config = self.config()
        if config.metrics.enabled:
            self._launch(self.http.poll(engine, config.metrics), "poll metrics")
        if config.canary.enabled:
            self._launch(self.http.canary(engine), "canary")
        self._launch(self.http.probe_sleep_mode(engine), "probe sleep mode")
        if engine.cache is not None:  # what its start compiled
            self._launch(compile_cache.measure(engine.cache, self.clock.monotonic),
                         "measure the compile cache")

    def gate_probe(self, engine: eng.EngineProcess, golden: bool = True,
                   warm: bool = False, woken: bool = False,
                   sleeps_later: bool = False) -> None:
        self._launch(self.http.gate_probe(engine, golden, warm, woken, sleeps_later),
                     "gate probe")

    def sleep(self, engine: eng.EngineProcess) -> None:
        self._launch(self.http.sleep_or_wake(engine, asleep=True), "sleep")

    def wake(self, engine: eng.EngineProcess, tags: tuple[str, ...] = ()) -> None:
        self._launch(self.http.sleep_or_wake(engine, asleep=False, tags=tags), "wake up")

    def empty_host_cache(self, engine: eng.EngineProcess) -> None:
        self._launch(self.http.empty_host_cache(engine), "empty the host cache")

    def take_down(self, engine: eng.EngineProcess, graceful: bool, force: asyncio.Event,
                  req: evidence.EvidenceRequest | None, deadline: float) -> None:
        self._launch(self._take_down(engine, graceful, force, req, deadline), "take down")

    def dump(self, engine: eng.EngineProcess, snapshot: eng.Restore, made: Mapping[str, str],
             deadline: float) -> None:
        self._launch(self._dump(engine, snapshot, dict(made), deadline), "dump")

    def forget(self, engine: eng.EngineProcess) -> None:
        self._shm.pop(engine.pid, None)
        state_file, guard = self.bays[engine.bay]
        state_file.remove()
        guard.disarm()
        if self._in_bay.get(engine.bay) is engine:
            del self._in_bay[engine.bay]
        self.http.forget(engine)

    def drain(self, engine: eng.EngineProcess, deadline: float) -> None:
        self._launch(self._drain(engine, deadline), "drain")

    def drain_behind(self, engine: eng.EngineProcess, deadline: float) -> None:
        self._launch(self._drain_behind(engine, deadline), "drain behind a swap")

    def remedy(self, engine: eng.EngineProcess, rung: str, ways: tuple[str, ...]) -> None:
        self._launch(self.http.apply_remedy(engine, rung, ways), rung)

    def sample_gpu(self, sampler: GpuSampler) -> None:
        self._launch(self._sample_gpu(sampler), "gpu sampler")

    def follow(self, engine: eng.EngineProcess) -> None:
        if self.front is not None:
            c = engine.config
            self.front.follow_engine(self.name, c.base_url, c.served_models(), c.models_open,
                                     schedules_by_priority(engine.spec.argv))

    def pause_streams(self, engine: eng.EngineProcess) -> int | None:
        return self.front.pause_streams(self.name) if self.front is not None else 0

    def kill_now(self, engine: eng.EngineProcess) -> None:
        proctree.kill_group(engine.pgid, engine.known)

    def probes_in_flight(self) -> int:
        return self.http.in_flight()

    def after(self, delay_s: float, event: Event) -> Timer:
        queue = self.queue

        async def later() -> None:
            await asyncio.sleep(delay_s)
            queue.put_nowait(event)

        return self._launch(later(), f"timer: {event.name}")

    async def _spawn(self, generation: int, spec: eng.SpawnSpec, cfg: EngineConfig,
                     bay: int) -> None:
        leftovers: list[str] = []
        state_file = self.bays[bay][0]
        # its compile cache and vLLM's stack-dump folder (engine/startup/start_dirs.py)
        dirs = await start_dirs.prepare(
            spec, cfg, self.config(), self.name, bay, generation,
            [e.dumps.dir for b, e in self._in_bay.items() if b != bay and e.dumps],
            self.clock.monotonic)
        asked, spec = spec, dirs.spec
        if not self._thp_said and sleep_backup.asks_huge_pages(spec.env):
            self._thp_said = True  # (the host's setting, said once)
            why = sleep_backup.refused(await asyncio.to_thread(sleep_backup.thp_setting))
            if why is not None:
                log.warning("sleep backup without huge pages", why=why)
        if kv_tier.folder_of(cfg) is not None and "--kv-transfer-config" in spec.argv \
                and (why := await self._take_kv_tier(cfg)) is not None:
            # (served without a tier rather than with one nobody keeps under its bound)
            log.warning("engine started without its KV tier", why=why)
            spec = dataclasses.replace(spec, argv=kv_tier.without(spec.argv))
        shortage = Shortage("spawn")
        until = self.clock.monotonic() + SHORTAGE_RETRY_S
        while True:
            try:
                if spec.pick_port is not None:  # (a weight cache's health port)
                    port = proctree.free_port(spec.host, set(spec.pick_port))
                    # (the one asked for too: its log and status say the port it has)
                    spec, asked = spec.on_port(port), asked.on_port(port)
                    cfg = dataclasses.replace(cfg, port=port)
                if spec.folders:  # (a weight cache's; an engine has none)
                    await asyncio.to_thread(eng.make_folders, spec.folders)
                engine = await self._check_and_spawn(generation, spec, cfg, bay, leftovers)
                break
            except Exception as exc:  # any failure here is a failed start, never a stuck one
                if exhausted(exc) and self.clock.monotonic() < until:
                    # the daemon's own shortage, with nothing of the engine's running yet:
                    # not a failed start; tried again, bounded
                    shortage.failed(exc)
                    await asyncio.sleep(0.5)
                    continue
                error = str(exc) if isinstance(exc, OSError | RuntimeError) else repr(exc)
                self.queue.put_nowait(Spawned(generation, None, error, tuple(leftovers),
                                              gpu_busy=isinstance(exc, takedown.GpuBusy)))
                return
        shortage.ok()
        # (its spec stays the one asked for, which the unit compares with its config's;
        # the cache's folder and the dumps' are this job's additions)
        engine.spec, engine.cache, engine.dumps = asked, dirs.cache, dirs.dumps
        # The engine runs: nothing from here fails its start (that would leave it running
        # unwatched). A state file not written now is written at the watch's first look.
        try:
            await asyncio.to_thread(state_file.write, engine.pgid, engine.known)
        except OSError as exc:
            log.warning("cannot write the state file yet", error=str(exc), pid=engine.pid)
        self.queue.put_nowait(Spawned(generation, engine, None, tuple(leftovers)))

    async def _check_and_spawn(self, generation: int, spec: eng.SpawnSpec, cfg: EngineConfig,
                               bay: int, leftovers: list[str]) -> eng.EngineProcess:
        """The checks before a start (leftovers of an earlier run killed, the GPUs and
        the port free), then the spawn. Raises for a start refused or failed."""
        found, own = await takedown.clean_leftovers(self.bays[bay][0], cfg.reap_timeout_s)
        leftovers.extend(found)
        # (a sibling engine's processes on a shared GPU are expected, not foreign; so
        # are those of this unit's engine in its other bay)
        beside = {p.pid for b, e in self._in_bay.items() if b != bay for p in e.known}
        await takedown.check_gpus_free(self.gpu, own, cfg.gpu_foreign_allowance_mib << 20,
                                       cfg.gpu_release_timeout_s,
                                       frozenset(self.siblings()) | beside)
        if spec.restore is not None:  # a copy of a dumped engine (its port: its relay's)
            engine = await copies.spawn_copy(spec, generation, self.clock.monotonic(), cfg,
                                             self.config().daemon.runtime_dir,
                                             self.config().evidence.log_lines,
                                             self.gpu_state)
        else:
            held = await asyncio.to_thread(proctree.port_holder, spec.host, spec.port)
            if held is not None:
                raise RuntimeError(f"engine port refused: {held}")
            engine = await eng.spawn_engine(spec, generation, self.clock.monotonic(), cfg,
                                            self.config().evidence.log_lines)
        engine.bay = bay
        if bay == WEIGHT_CACHE_BAY:
            engine.source = "weight_cache"
        return engine

    async def _watch(self, engine: eng.EngineProcess) -> None:
        """Report the exit at once (asyncio wakes on SIGCHLD), the first health, and the
        tree as it grows, so that the tree can be proven gone later."""
        gen = engine.generation
        exited: asyncio.Future[int] = asyncio.ensure_future(takedown.wait_exit(engine.proc))
        exited.add_done_callback(
            lambda f: None if f.cancelled() else self.queue.put_nowait(
                Exited(gen, f.result(), hostmem.oom_kills())))
        health = asyncio.ensure_future(self.http.first_health(engine, exited))
        # An error in the probe counts as "not healthy": STARTING must never outlive its bound.
        health.add_done_callback(
            lambda f: None if f.cancelled() else self.queue.put_nowait(
                f.result() if f.exception() is None else HealthResult(gen, False)))
        # what the state file holds: nothing known, so that the first look writes it
        # (the spawn's write may have failed)
        recorded: list[proctree.ProcInfo] = []
        # the core's death is a crash the moment it happens, not when its API server exits
        cores = CoreWatch(lambda pid: None if exited.done()
                          else self.queue.put_nowait(CoreExited(gen, pid, hostmem.oom_kills())))
        shortage = Shortage("watch engine", pid=engine.pid)
        try:
            while not exited.done():
                began_healthy = health.done()
                try:
                    recorded = await self._look_at_tree(engine, cores, recorded)
                except OSError as exc:
                    if not exhausted(exc):
                        raise
                    # /proc unreadable for want of a descriptor: no look this time, and
                    # the engine is none the worse for it
                    shortage.failed(exc)
                    await asyncio.wait({exited}, timeout=0.5)
                    continue
                shortage.ok()
                # Once more the moment it is healthy (during this look, or while waiting
                # for the next): its core is there by then, and a core not yet watched
                # would die unseen until its API server exits, 10 s of looks later.
                if health.done() and not began_healthy:
                    continue
                waits: set[asyncio.Future[Any]] = {exited}
                if not health.done():
                    waits.add(health)
                await asyncio.wait(waits, timeout=2.0 if engine.healthy_at is None else 10.0)
        finally:
            cores.close()
            health.cancel()

    async def _look_at_tree(self, engine: eng.EngineProcess, cores: CoreWatch,
                            recorded: list[proctree.ProcInfo]) -> list[proctree.ProcInfo]:
        """One look at the engine's tree: reported, its cores watched, the state file
        rewritten when the tree grew. Returns what the state file now holds."""
        procs = await asyncio.to_thread(proctree.snapshot_tree, engine.pid)
        if not procs:
            return recorded
        cores.add(procs)
        if engine.spec.restore is None:  # (a copy's /dev/shm is its own: it goes with it)
            seen = await asyncio.to_thread(shm_files.held, [p.pid for p in procs],
                                           self.shm_dir)
            self._shm.setdefault(engine.pid, {}).update(seen)
        rss, cpu = await asyncio.to_thread(proctree.tree_usage, procs)
        heat, _ = await asyncio.to_thread(hostheat.hottest)
        starved, killed = await asyncio.to_thread(
            lambda: (hostmem.memory_stall_pct(), hostmem.oom_kills()))
        dumps = engine.dumps  # (vLLM only appends to its files: they are bounded here)
        if dumps is not None and dumps.owned and (
                cut := await asyncio.to_thread(stackdumps.trim, dumps.dir)):
            log.info("vLLM's stack dump files cut to their newest dumps", files=cut)
        self.queue.put_nowait(TreeSeen(engine.generation, tuple(procs),
                                       self.clock.monotonic(), rss, cpu, heat, starved,
                                       killed))
        merged = proctree.merge_known(recorded or engine.known, procs)
        if len(merged) > len(recorded):  # rewrite only when the tree grew
            try:
                await asyncio.to_thread(self.bays[engine.bay][0].write, engine.pgid, merged)
                return merged
            except OSError as exc:
                log.warning("cannot write the state file", error=str(exc))
        return recorded

    async def _evidence(self, engine: eng.EngineProcess,
                            req: evidence.EvidenceRequest) -> None:
        """Bounded: the take-down waits for this at most evidence.timeout_s (+1 s to write
        what was gathered), whatever py-spy does."""
        cfg = self.config().evidence
        # the tree as it is now, beside every pid seen in it: a child forked since the
        # last look at the tree is read too
        try:
            live = await asyncio.to_thread(proctree.snapshot_tree, engine.pid)
        except OSError:  # (out of descriptors: the pids already known are read)
            live = []
        dumps = engine.dumps  # (vLLM's own stack dumps, where it writes them)
        req = dataclasses.replace(req, pids=list(dict.fromkeys(
            [*req.pids, *(p.pid for p in live)])), dump_dir=dumps.dir if dumps else None,
            dump_dir_owned=dumps is None or dumps.owned)
        try:
            bundle = await asyncio.wait_for(
                evidence.capture(req, Path(cfg.dir), cfg.keep, cfg.timeout_s,
                                 evidence.find_py_spy()), cfg.timeout_s + 1.0)
        except TimeoutError:
            bundle = evidence.Bundle(str(Path(cfg.dir) / req.name), cfg.timeout_s + 1.0, 0,
                                     {}, "the capture ran past its bound")
        except Exception as exc:  # evidence is best effort: the take-down goes on
            bundle = evidence.Bundle(str(Path(cfg.dir) / req.name), 0.0, 0, {},
                                     f"the capture failed: {type(exc).__name__}: {exc}")
        self.queue.put_nowait(EvidenceCaptured(engine.generation, req, bundle))

    async def _dump(self, engine: eng.EngineProcess, snapshot: eng.Restore,
                    made: dict[str, str], deadline: float) -> None:
        """A dump (engine/snapshot/copies.py), then the take-down that proves the tree
        gone: a dump ends it, one that failed leaves it running to be taken down."""
        took, error = None, None
        try:
            took = await copies.dump_engine(engine, snapshot, made, self.gpu_state,
                                            max(1.0, deadline - self.clock.monotonic()))
            log.info("engine dumped", pid=engine.pid, seconds=took, images=snapshot.images)
        except Exception as exc:  # (said in its Down; the take-down goes on)
            error = f"{type(exc).__name__}: {exc}"[:2000]
            log.warning("engine not dumped", pid=engine.pid, images=snapshot.images,
                        error=error)
        await self._take_down(engine, error is not None, asyncio.Event(), None, deadline,
                              dumped=(took, error))

    async def _take_down(self, engine: eng.EngineProcess, graceful: bool,
                         force: asyncio.Event, req: evidence.EvidenceRequest | None,
                         deadline: float,
                         dumped: tuple[float | None, str | None] = (None, None)) -> None:
        try:
            if req is not None:
                await self._evidence(engine, req)
            # the engine's own config: a reload since its start does not change its stop
            result = await takedown.take_down(
                engine, engine.config, graceful=graceful, force=force, gpu=self.gpu,
                budget_s=deadline - self.clock.monotonic(),
                on_card_released=lambda s: self.queue.put_nowait(
                    CardReleased(engine.generation, s)))
            # With the tree gone the pipes close: let the relays log the engine's last
            # words (a boot failure's traceback) before anyone reads them.
            if engine.relays:
                await asyncio.wait(engine.relays, timeout=2.0)
            if not result.survivors:  # (before a relaunch could meet them)
                await self._remove_shm_files(engine)
                await copies.forget(engine)
        except Exception as exc:  # reported as an event: the lifecycle must not hang
            self.queue.put_nowait(Down(engine.generation, None, f"take-down failed: {exc!r}",
                                       *dumped))
            raise
        self.queue.put_nowait(Down(engine.generation, result, None, *dumped))

    async def _remove_shm_files(self, engine: eng.EngineProcess) -> None:
        """The shared-memory files of vLLM's that the tree, proven gone, left behind (a
        crash, a SIGKILL: its clean exit removes them itself): those its processes held
        open at a look, and those its own lines said it made. Never by their name alone:
        other engines' sit beside them (engine/process/shm_files.py)."""
        seen = self._shm.pop(engine.pid, {})
        for path in shm_files.named(list(engine.recent_lines), self.shm_dir):
            seen.setdefault(path, None)
        if not seen:
            return
        try:
            await asyncio.to_thread(shm_files.remove, seen, engine.pid)
        except Exception as exc:  # (best effort: never a take-down that failed)
            log.warning("the dead engine's shared-memory files not cleaned", pid=engine.pid,
                        error=repr(exc))

    async def _take_kv_tier(self, cfg: EngineConfig) -> str | None:
        """The tier's folder made this daemon's (emptied, marked, owner only): None once
        it is, else why not. Asked by the keeper and by every spawn that names it (an
        engine is given a tier only once its folder is kept); a refusal is tried again
        after KV_TIER_RETRY_S, not at every ask."""
        folder = kv_tier.folder_of(cfg)
        if folder is None or folder in self._kv_tiers:
            return None
        async with self._kv_lock:
            if folder in self._kv_tiers:
                return None
            refused = self._kv_refused.get(folder)
            now = self.clock.monotonic()
            if refused is not None and now - refused[1] < KV_TIER_RETRY_S:
                return refused[0]
            error = await asyncio.to_thread(kv_tier.clear, folder)
            if error is None:
                self._kv_tiers.append(folder)
                self._kv_refused.pop(folder, None)
                log.info("KV tier ready", folder=str(folder), max_gib=cfg.kv_tier_max_gib)
                return None
            if refused is None or refused[0] != error:
                log.error("KV tier refused", folder=str(folder), error=error)
            self._kv_refused[folder] = (error, now)
            self.queue.put_nowait(KvTierSeen(str(folder), kv_tier.Usage(0, 0, error=error)))
            return error

    async def _keep_kv_tier(self) -> None:
        """The engine's KV tier folder (`engine.kv_tier`, engine/process/kv_tier.py):
        emptied when the daemon starts, then kept under its bound every second or two,
        each look reported. A reload that names another folder adds it: the running
        engines still write to the old one until their next start, so both are kept
        under the bound, and `end` empties every one. Nothing that goes wrong in a look
        ends the keeping."""
        warned: tuple[Any, ...] | None = None  # the settings the host warning was for
        warning: str | None = None
        in_memory: set[Path] = set()  # the folders on tmpfs (their files host memory)
        said_short = -math.inf
        pruned: dict[Path, kv_tier.Pruned] = {}
        while True:
            looked = self.clock.monotonic()
            try:
                cfg = self.config().engine
                want = kv_tier.folder_of(cfg)
                if want is not None and await self._take_kv_tier(cfg) is None:
                    key = (want, cfg.kv_tier_cpu_gib, cfg.kv_tier_max_gib, cfg.standby)
                    if key != warned:
                        warned = key
                        warning, memory = await asyncio.to_thread(_host_warning, cfg, want)
                        in_memory.discard(want)
                        if memory:
                            in_memory.add(want)
                        if warning is not None:
                            log.warning("KV tier: host memory", why=warning)
                for folder in self._kv_tiers:
                    short = (await asyncio.to_thread(self.host_short)
                             if folder in in_memory else 0)
                    usage = await asyncio.to_thread(
                        kv_tier.prune, folder, int(cfg.kv_tier_max_gib * kv_tier.GIB),
                        self.clock.wall(), short)
                    if short and self.clock.monotonic() - said_short >= SAY_SHORT_EVERY_S:
                        said_short = self.clock.monotonic()
                        log.warning("KV tier pruned for the host's memory", folder=str(folder),
                                    short_bytes=short, removed_bytes=usage.removed_bytes,
                                    left_bytes=usage.bytes)
                    if usage.removed_files:
                        log.debug("KV tier pruned", folder=str(folder),
                                  files=usage.removed_files, bytes=usage.removed_bytes,
                                  left_bytes=usage.bytes)
                    now = self.clock.monotonic()
                    said = pruned.setdefault(folder, kv_tier.Pruned(now)).add(usage, now)
                    if said is not None:
                        log.info("KV tier kept under its bound", folder=str(folder), **said)
                    self.queue.put_nowait(KvTierSeen(str(folder), dataclasses.replace(
                        usage, warning=warning if folder == want else None)))
            except Exception:  # (logged; the next look tries again)
                log.exception("KV tier look failed")
            # a folder of many small files takes a while to walk: the looks are spaced
            # by three times their own length, within 1-2 s (a soft bound: what the
            # engines write meanwhile passes it)
            took = self.clock.monotonic() - looked
            await asyncio.sleep(min(KV_TIER_MAX_EVERY_S, max(KV_TIER_EVERY_S, 3 * took)))

    async def _drain(self, engine: eng.EngineProcess, deadline: float) -> None:
        t0 = self.clock.monotonic()
        idle = await self.gate.wait_idle(
            min(engine.config.drain_timeout_s, max(0.0, deadline - t0)))
        self.queue.put_nowait(Drained(engine.generation, idle, self.clock.monotonic() - t0))

    async def _drain_behind(self, engine: eng.EngineProcess, deadline: float) -> None:
        t0 = self.clock.monotonic()
        until = t0 + min(engine.config.drain_timeout_s, max(0.0, deadline - t0))
        front = self.front
        # (polled: the proxy counts its requests per engine start on this loop, and
        # tells no one when one ends)
        while front is not None and front.in_flight_at(self.name, engine.generation) \
                and self.clock.monotonic() < until:  # noqa: ASYNC110
            await asyncio.sleep(0.1)
        idle = front is None or not front.in_flight_at(self.name, engine.generation)
        self.queue.put_nowait(Drained(engine.generation, idle, self.clock.monotonic() - t0))

    async def _sample_gpu(self, sampler: GpuSampler) -> None:
        while True:
            reading = await asyncio.to_thread(sampler.sample)
            self.queue.put_nowait(GpuSampled(reading, self.clock.monotonic()))
            await asyncio.sleep(self.config().gpu.period_s)  # (a reload applies here)
