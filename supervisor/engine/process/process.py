"""One engine process: spawning it, relaying its output, waiting for health (taking it
down: `takedown.py`).

These are the daemon's effects on the engine. They run as tasks started by the
supervisor's state-owning task and report back only through their return values (the
owner turns those into events); none of them reads or changes the supervisor's state.
Every wait here is bounded; every blocking /proc or kernel call goes to a worker thread.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging
import os
import re
import signal
import sys
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import httpx
import structlog
import uvloop

from supervisor.engine.process import host_cache, kv_tier, proctree, sleep_backup
from supervisor.engine.process.enginelog import (
    boot_failure_of,
    kv_tokens_of,
    parse_engine_line,
    phase_of,
    route_of,
    weights_backup_of,
    weights_of,
)
from supervisor.engine.snapshot import no_io_uring
from supervisor.engine.startup.compile_cache import CacheInfo
from supervisor.loop import http_client
from supervisor.ops.descriptors import Shortage, exhausted
from supervisor.settings.sections import EngineConfig
from supervisor.watchdog.devroutes import DevRoutes
from supervisor.watchdog.metrics import SleepOps
from supervisor.watchdog.stackdumps import StackDumps
from supervisor.watchdog.warmup import Warmed

log = structlog.get_logger("supervisor.engine")

# Variables that belong to the daemon's own relation with systemd, never to the engine:
# an engine that saw NOTIFY_SOCKET could send READY=1 in the daemon's name.
_PRIVATE_ENV = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "LISTEN_FDS",
                "LISTEN_PID", "LISTEN_FDNAMES")
_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
           "error": logging.ERROR, "critical": logging.CRITICAL}
_PR_SET_PDEATHSIG = 1
LINE_LIMIT = 1 << 20
# where a port picked at the spawn goes in its command line (`SpawnSpec.pick_port`)
PORT = "{port}"


@dataclass(frozen=True)
class SpawnSpec:
    argv: list[str]
    env: dict[str, str]
    cwd: str
    host: str
    port: int
    # how its weights are loaded, added to `argv` when it is spawned: `--load-format
    # ipc_cache ...` while its weight cache answers (supervisor/engine/pair/weight_cache.py),
    # () for vLLM's own load. Apart from `argv`, which says what the engine runs (a
    # standby fits, a golden baseline holds, whichever way its weights came)
    load: tuple[str, ...] = ()
    # folders its spawn makes first, the daemon user's only (0700): a weight cache's
    # socket folder. A folder that cannot be made fails the spawn, like a missing binary
    folders: tuple[str, ...] = ()
    # a port chosen by its spawn, not by whoever asked for it (a weight cache's health
    # port): any the kernel gives as free on `host`, none of these; `port` is then 0 and
    # `argv` says `PORT` where the port goes (`on_port`)
    pick_port: tuple[int, ...] | None = None
    # started with the standby's thinner arguments (`engine.standby_args`: an asymmetric
    # pair's thin standby): what the engine is, for as long as it lives, wherever it serves
    thin: bool = False
    # a copy of a dumped engine restored instead of `argv` executed (its images: issue
    # 49's route 3, engine/snapshot/copies.py); `argv` and `env` are then what the
    # dumped engine ran with
    restore: Restore | None = None
    # its output through pipes of the daemon's own making (one to be dumped: under uvloop
    # a subprocess's stdout is a socketpair, which CRIU cannot dump half of)
    pipes: bool = False

    @property
    def command_line(self) -> list[str]:
        """What is executed."""
        return [*self.argv, *self.load]

    def on_port(self, port: int) -> SpawnSpec:
        """The spec with its picked port in `port` and in `argv`'s place for it."""
        return replace(self, port=port, pick_port=None,
                       argv=[str(port) if a == PORT else a for a in self.argv])


@dataclass(frozen=True)
class Restore:
    """A spawn that restores a copy of a dumped engine (engine/snapshot/copies.py): the
    folder of its images, the CRIU that made them, and where the dumped engine binds its
    unix sockets (vLLM's `VLLM_RPC_BASE_PATH`: each copy gets a folder of its own
    mounted there), if it does."""

    images: str
    criu: str
    rpc_at: str | None = None
    port: int = 0  # the dumped engine's port, inside each copy (0: the spec's)
    # its client paths were warmed before its dump (`watchdog/warmup.py`): each copy
    # carries what that built, and its first proof does not ask them again
    warmed: bool = False
    # the dumped engine's vLLM version, as its start lines said (a copy prints none):
    # each copy's, for what depends on it (a KV reset's sleep); None: unknown
    vllm_version: str | None = None
    weights_bytes: int | None = None  # ... and its weights' backup, as its sleep said


@dataclass(frozen=True)
class Load:
    """How an engine started now gets its weights, and why: from its weight cache
    ("cache": `args` map them) or by vLLM's own load ("disk": no `args`)."""

    args: tuple[str, ...]
    weights: str
    why: str

    def fields(self) -> dict[str, str]:
        return {"weights": self.weights, "weights_why": self.why}


def build_spawn_spec(cfg: EngineConfig, environ: Mapping[str, str]) -> SpawnSpec:
    env = {k: v for k, v in environ.items() if k not in _PRIVATE_ENV} if cfg.inherit_env else {}
    env.update(cfg.env)
    env.update(kv_tier.env(cfg))  # (one block-hash seed for the pair, over an inherited one)
    env.update(gpu_pinning(cfg.gpus))
    env.setdefault("PYTHONUNBUFFERED", "1")  # engine lines reach the journal as they happen
    argv = [*cfg.command, "--host", cfg.host, "--port", str(cfg.port),
            "--shutdown-timeout", f"{cfg.drain_timeout_s:g}", *cfg.args, *kv_tier.argv(cfg)]
    env.update(sleep_backup.env(argv, env))  # (a woken engine's exit frees the card at once)
    extension, extension_env = host_cache.argv_env(argv, env)  # (... and once emptied,
    argv += extension  # sooner still)
    env.update(extension_env)
    if not cfg.access_log and not any(a.endswith("disable-uvicorn-access-log")
                                      for a in cfg.args):
        # (either spelling in the operator's args wins)
        argv.append("--disable-uvicorn-access-log")
    folders: tuple[str, ...] = ()
    if cfg.standby == "snapshot":  # every engine of the unit as a dumped one must be
        argv, rpc = dumpable(argv, env, cfg.snapshot_dir)
        folders = (rpc,)
    return SpawnSpec(argv=argv, env=env, cwd=cfg.cwd, host=cfg.host, port=cfg.port,
                     folders=folders, pipes=cfg.standby == "snapshot")


def snapshot_images(snapshot_dir: str) -> str:
    """Where a snapshot standby's images are kept, beside its socket folder (`rpc`)."""
    return str(Path(snapshot_dir) / "images")


def dumpable(argv: list[str], env: dict[str, str], snapshot_dir: str
             ) -> tuple[list[str], str]:
    """An engine as CRIU can dump it (docs/standby.md, the snapshot route): under a
    seccomp filter that refuses io_uring, its own sockets on loopback (a copy's network
    namespace has nothing else), its unix sockets in a folder of the snapshot's (each
    copy gets its own there). `env` is changed in place, the operator's values kept;
    the argv to run, and the folder."""
    env.setdefault("VLLM_HOST_IP", "127.0.0.1")
    rpc = env.setdefault("VLLM_RPC_BASE_PATH", str(Path(snapshot_dir) / "rpc"))
    return [sys.executable, no_io_uring.__file__, *argv], rpc


def make_folders(folders: Sequence[str]) -> None:
    """A spawn's `folders`, made if missing and the daemon user's only; OSError names the
    one that could not be."""
    for folder in folders:
        os.makedirs(folder, mode=0o700, exist_ok=True)
        os.chmod(folder, 0o700)


def gpu_pinning(gpus: Sequence[int]) -> dict[str, str]:
    """The environment that gives an engine the GPUs its `gpus` names, and no other.

    NVML numbers GPUs by PCI bus; CUDA, by default, fastest first. `CUDA_DEVICE_ORDER=
    PCI_BUS_ID` makes CUDA count as NVML does, so the indices the daemon watches are the
    GPUs the engine uses. Indices rather than UUIDs: every vLLM version takes them (0.22
    and older crash on a UUID, vllm#20939; newer ones refuse the short form, vllm#51677).
    {} without `gpus`: the engine sees what the daemon sees."""
    if not gpus:
        return {}
    return {"CUDA_DEVICE_ORDER": "PCI_BUS_ID",
            "CUDA_VISIBLE_DEVICES": ",".join(str(g) for g in gpus)}


def _libc_prctl() -> object | None:
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name, use_errno=True).prctl if name else None
    except OSError:
        return None


_prctl = _libc_prctl()


def _child_setup() -> None:
    # Runs in the forked child before exec: ask the kernel to SIGTERM the engine when
    # the daemon's thread that forked it (the event loop's) dies. The guard process
    # finishes the job for the rest of the tree.
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)  # type: ignore[operator]


@dataclass
class EngineProcess:
    """One spawned engine. The supervisor's task owns it; the only exception is
    `recent_errors`, which the output relay appends to."""

    generation: int
    proc: asyncio.subprocess.Process
    pid: int
    started_at: float  # monotonic
    spec: SpawnSpec
    config: EngineConfig  # the settings it was started with (a reload applies at next start)
    # every process ever seen in its tree (to prove them all gone), and how many live now
    known: list[proctree.ProcInfo] = field(default_factory=list)
    live_processes: int = 1
    rss_bytes: int | None = None  # resident memory of the live tree, at the last look
    cpu_percent: float | None = None  # of one core, between the last two looks
    cpu_seen: tuple[float, float] | None = None  # (monotonic time, CPU seconds) last look
    healthy_at: float | None = None
    exit_code: int | None = None  # as asyncio reports it: negative = killed by that signal
    core_lost: int | None = None  # the pid of its core, when that died first (a crash)
    # the host's OOM kills at the last look at its tree, and whether the kernel's OOM
    # killer ran between that look and its unasked death (None: unknown)
    oom_kills_seen: int | None = None
    oom_killed: bool | None = None
    # while it starts: the phase its last lines announced (enginelog.PHASES), since when
    phase: str | None = None
    phase_since: float | None = None
    phases: list[tuple[str, float]] = field(default_factory=list)  # (phase, s after spawn)
    # as its first lines say (a copy: its images', else its /version at its first KV reset)
    vllm_version: str | None = None
    kv_tokens: int | None = None  # its KV cache in tokens, as its core said at its start
    # its weights on one GPU, as its sleeps say (a copy: its images'): what a wake of its
    # weights alone needs free there; None: it has not slept
    weights_bytes: int | None = None
    # NVML has listed processes of its tree on the card (the GPU samples while it served):
    # its take-down can then tell when none is listed any more (`takedown.card_released`)
    gpu_listed: bool = False
    # while it starts: when a line of its said that its core failed to start, and that line
    boot_failed_at: float | None = None  # monotonic
    boot_failure: str | None = None
    cache: CacheInfo | None = None  # its compile cache (VLLM_CACHE_ROOT), if the daemon's
    dumps: StackDumps | None = None  # where its vLLM writes its own stack dumps (0.33+)
    # vLLM's count of its sleep-mode calls as the daemon's last sleep or wake of it left it
    # (its jobs' alone: the next call's "before")
    sleep_ops: SleepOps | None = None
    # which of vLLM's development routes it serves, asked once its health check answered
    # (None: not asked, or not yet healthy)
    routes: DevRoutes | None = None
    # the longest sequence it takes, as its /v1/models said once healthy (None: not said);
    # bounds the KV blocks its running requests can hold (`signals.unaccounted`)
    max_model_len: int | None = None
    recent_errors: deque[str] = field(default_factory=lambda: deque(maxlen=20))
    recent_lines: deque[str] = field(default_factory=lambda: deque(maxlen=200))  # evidence
    relays: list[asyncio.Task[None]] = field(default_factory=list)  # stdout, stderr readers
    # a restored copy's output (the pipes its restore handed it), in place of `proc`'s:
    # `proc` is then the `unshare` its copy runs under (engine/snapshot/copies.py)
    outputs: tuple[asyncio.StreamReader, asyncio.StreamReader] | None = None
    scratch: str | None = None  # a folder of its own, removed once its tree is gone
    # the inodes of the pipes its stdout and stderr write to (their read ends the
    # daemon's), as its spawn found them: what a dump of it names external
    pipes: tuple[int, ...] = ()
    bay: int = 0  # which of its unit's places (state file, guard) it occupies
    source: str = "engine"  # its lines' `source` in the log ("weight_cache": the cache's)
    # started to map a weight cache's weights: what its own lines said of them (vLLM's
    # "Mapped N tensors from the weight cache daemon", or its fall back to the disk)
    weights: str | None = None
    # the paths its first proof warmed (`watchdog/warmup.py`): a later proof of it (after
    # a wake, a swap) does not ask them again; None: not warmed yet
    warmed: Warmed | None = None

    @property
    def pgid(self) -> int:
        return self.pid  # start_new_session=True: the engine leads its own group

    @property
    def streams(self) -> tuple[asyncio.StreamReader, asyncio.StreamReader]:
        """Its stdout and stderr, as the daemon reads them."""
        if self.outputs is not None:
            return self.outputs
        assert self.proc.stdout is not None and self.proc.stderr is not None
        return self.proc.stdout, self.proc.stderr

    def describe_exit(self) -> str:
        oom = " (the kernel's OOM killer ran as it died: the host is out of memory)" \
            if self.oom_killed else ""
        code = self.exit_code
        if self.core_lost is not None:  # (what ended it; the API server's exit followed)
            return f"lost its core (pid {self.core_lost}){oom}"
        if code is None:
            return "still running"
        if code < 0:
            try:
                return f"killed by {signal.Signals(-code).name}{oom}"
            except ValueError:
                return f"killed by signal {-code}{oom}"
        return f"exited with code {code}{oom}"


async def spawn_engine(spec: SpawnSpec, generation: int, now: float,
                       cfg: EngineConfig, keep_lines: int = 200) -> EngineProcess:
    """Start the engine in its own session. Raises OSError if it cannot be executed."""
    ends = (os.pipe(), os.pipe()) if spec.pipes else None
    try:
        proc = await asyncio.create_subprocess_exec(
            *spec.command_line, stdin=asyncio.subprocess.DEVNULL,
            stdout=ends[0][1] if ends else asyncio.subprocess.PIPE,
            stderr=ends[1][1] if ends else asyncio.subprocess.PIPE, env=spec.env,
            cwd=spec.cwd, start_new_session=True, preexec_fn=_child_setup, limit=LINE_LIMIT)
    except BaseException:
        for r, w in ends or ():
            os.close(r)
            os.close(w)
        raise
    outputs = None
    if ends:
        for _, w in ends:
            os.close(w)  # (the engine's, now)
        outputs = (await pipe_reader(ends[0][0]), await pipe_reader(ends[1][0]))
    engine = EngineProcess(generation=generation, proc=proc, pid=proc.pid, started_at=now,
                           spec=spec, config=cfg, recent_lines=deque(maxlen=keep_lines),
                           outputs=outputs)
    try:
        engine.known = await asyncio.to_thread(proctree.snapshot_tree, proc.pid)
        engine.pipes = await asyncio.to_thread(output_pipes, proc.pid)
    except OSError as exc:  # (it runs: never lose it; the watch's first look fills this)
        log.warning("cannot read the new engine's tree yet", error=str(exc), pid=proc.pid)
    return engine


class _PipeProtocol(asyncio.StreamReaderProtocol):
    """A pipe read to its end has nothing more to give: its transport closes then (the
    stream protocol's own keeps it open, half-closed, as a socket's; uvloop then closed
    it only when collected)."""

    def eof_received(self) -> bool:
        super().eof_received()
        return False


async def pipe_reader(fd: int) -> asyncio.StreamReader:
    """The event loop's reader of a pipe's read end, which it closes at its end of file.

    The descriptor is closed once. uvloop's transport closes it itself (libuv's
    `uv_close`), then closes the file object it was handed: the same number a second
    time (uvloop#763), and a descriptor another thread opened in between (a /proc read
    of the take-down's, in a worker thread) was closed from under it. On the H200 that
    failed a take-down with EBADF as a copy's core died, and a cold start replaced the
    wake. Under uvloop the file object does not own the descriptor; under the standard
    loop it does (its transport closes only the file object)."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=LINE_LIMIT, loop=loop)
    owned = not isinstance(loop, uvloop.Loop)
    pipe = os.fdopen(fd, "rb", buffering=0, closefd=owned)
    try:
        await loop.connect_read_pipe(lambda: _PipeProtocol(reader, loop=loop), pipe)
    except BaseException:
        if not owned:
            os.close(fd)
        pipe.close()
        raise
    return reader


def output_pipes(pid: int) -> tuple[int, ...]:
    """The inodes of the pipes process `pid`'s stdout and stderr write to."""
    out = []
    for fd in (1, 2):
        link = os.readlink(f"/proc/{pid}/fd/{fd}")
        if link.startswith("pipe:["):
            out.append(int(link[6:-1]))
    return tuple(out)


async def relay_output(engine: EngineProcess, stream: asyncio.StreamReader, name: str) -> None:
    """Re-emit each engine line as a structured event until the stream closes: empty
    fields left out, vLLM's route table (one line per route) summarised into one line
    (each route stays at debug level), and while it starts, each new phase of its start
    as one daemon line (`status` shows it too)."""
    default_level = "info" if name == "stdout" else "warning"
    routes: list[str] = []
    while True:
        try:
            raw = await stream.readline()
        except ValueError:  # a line longer than the limit: take what is buffered
            raw = await stream.read(LINE_LIMIT)
        if not raw:
            return
        text = raw.decode("utf-8", "replace")
        line = parse_engine_line(text, default_level)
        if not line.message.strip():
            continue
        level = _LEVELS[line.level]
        engine.recent_lines.append(f"[{name}] {text.rstrip()}"[:2000])
        if level >= logging.WARNING:
            engine.recent_errors.append(line.message[:500])
        fields = {k: v for k, v in (("proc", line.proc), ("proc_pid", line.proc_pid),
                                    ("where", line.where)) if v is not None}
        route = route_of(line.message)
        if route is not None:
            routes.append(route)
            level = logging.DEBUG
        elif routes:
            log.info("engine routes", count=len(routes), paths=" ".join(routes),
                     generation=engine.generation)
            routes.clear()
        log.log(level, line.message, source=engine.source, stream=name,
                generation=engine.generation, **fields)
        backup = weights_backup_of(line.message)
        if backup is not None:  # (each worker of a TP engine says its own: the largest)
            engine.weights_bytes = max(backup, engine.weights_bytes or 0)
        if engine.healthy_at is None:
            if engine.boot_failed_at is None:  # (the traceback after it names no phase)
                _note_phase(engine, phase_of(line.message))
            if engine.vllm_version is None:
                engine.vllm_version = version_of(line.message)
            if engine.kv_tokens is None:
                engine.kv_tokens = kv_tokens_of(line.message)
            if engine.spec.load and engine.weights is None:
                engine.weights = weights_of(line.message)
            if engine.boot_failed_at is None and boot_failure_of(line.message):
                engine.boot_failed_at = time.monotonic()
                engine.boot_failure = line.message.strip()[:300]
                _note_phase(engine, BOOT_FAILED_PHASE)  # (what `status` shows meanwhile)
                log.warning("the engine says its core failed to start", line=engine.boot_failure,
                            pid=engine.pid, taken_down_after_s=BOOT_FAILED_GRACE_S,
                            unless="it exits by itself first")


# vLLM's API server says its version first ("vLLM API server version 0.26.0"; 0.32 prints
# a banner instead), its core when it starts ("Initializing a V1 LLM engine (v0.32.0)")
_VERSION = re.compile(r"vLLM API server version (?P<version>\S+)"
                      r"|Initializing a V1 LLM engine \(v(?P<core>[^)\s]+)\)")


def version_of(message: str) -> str | None:
    """The vLLM version a start line of the engine's says, if it says one."""
    m = _VERSION.search(message)
    return (m["version"] or m["core"]) if m else None


def _note_phase(engine: EngineProcess, phase: str | None) -> None:
    if phase is None or phase == engine.phase:
        return
    now = time.monotonic()
    log.info("engine start phase", phase=phase, after_s=round(now - engine.started_at, 1),
             pid=engine.pid)
    engine.phase, engine.phase_since = phase, now
    engine.phases.append((phase, now - engine.started_at))


# how long an engine whose core said it failed to start may take to exit by itself (vLLM's
# does within seconds) before its start counts as failed and its tree is taken down
BOOT_FAILED_GRACE_S = 30.0
BOOT_FAILED_PHASE = "its core failed to start; waiting for it to exit"


def start_given_up(engine: EngineProcess, now: float) -> str | None:
    """Why the engine's start is over though it still runs: its core said it failed to
    start, `BOOT_FAILED_GRACE_S` ago or more. None while that is not so."""
    if engine.boot_failed_at is None or now - engine.boot_failed_at < BOOT_FAILED_GRACE_S:
        return None
    return (f"its core failed to start ({engine.boot_failure!r}) and the engine had not "
            f"exited {now - engine.boot_failed_at:.0f} s later")


async def wait_healthy(url: str, interval_s: float, timeout_s: float,
                       exited: asyncio.Future[int],
                       given_up: Callable[[], str | None] = lambda: None) -> bool:
    """Poll `url` until it answers 200 (True), or the time is up, the engine exits or
    `given_up` says why it never will (False). The port refuses connections until vLLM
    is ready, so errors are expected; a probe the daemon could not send (out of
    descriptors) is no answer either, logged once as the daemon's own."""
    deadline = time.monotonic() + timeout_s
    shortage = Shortage("health check", url=url)
    async with http_client(timeout=httpx.Timeout(min(5.0, max(interval_s, 1.0)))) as client:
        while not exited.done():
            try:
                r = await client.get(url)
                shortage.ok()
                if r.status_code == 200:
                    return True
            except (httpx.HTTPError, OSError) as exc:  # (httpx lets a bare OSError through)
                if exhausted(exc):
                    shortage.failed(exc)
            remaining = deadline - time.monotonic()
            if remaining <= 0 or given_up() is not None:
                return False
            await asyncio.wait({exited}, timeout=min(interval_s, remaining))
    return False


async def watch_health(url: str, interval_s: float, misses: int,
                       exited: asyncio.Future[int]) -> str | None:
    """Poll `url` once healthy, until `misses` answers in a row are not 200 (why, the
    last), or the process exits (None: its exit is reported on its own). Each probe
    is bounded; one the daemon could not send (out of descriptors) is no answer either
    way."""
    shortage = Shortage("health watch", url=url)
    missed, why = 0, ""
    async with http_client(timeout=httpx.Timeout(min(5.0, max(interval_s, 1.0)))) as client:
        while not exited.done():
            try:
                r = await client.get(url)
                shortage.ok()
                missed, why = (0, "") if r.status_code == 200 else (
                    missed + 1, f"/health answered {r.status_code}")
            except (httpx.HTTPError, OSError) as exc:
                if exhausted(exc):
                    shortage.failed(exc)
                else:
                    missed, why = missed + 1, f"/health did not answer: {exc!r}"
            if missed >= misses:
                return f"{why} ({missed} times in a row)"
            await asyncio.wait({exited}, timeout=interval_s)
    return None
