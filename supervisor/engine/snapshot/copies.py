"""A copy of a dumped engine, restored as one of the daemon's engine processes: what a
spawn whose spec says `restore` does in place of executing the engine (issue 49's
route 3; `criu.py` restores, `relay.py` gives it a port).

What the daemon then holds is an `EngineProcess` like any spawned engine's, so that the
watch, the probes, the proxy and the take-down treat it as one (docs/standby.md, "How a
copy maps onto the daemon's engine process"):
- `proc` is the `unshare` it runs under: it ends when CRIU, the copy's PID namespace's
  init, does, which is when the restored engine's main process exits (its code is
  always 0: any exit the daemon did not ask for is a crash anyway);
- `pid` is the restored main process, as the daemon numbers it; it leads its own process
  group as a spawned engine does, so the usual take-down (SIGTERM to the group, then
  SIGKILL) ends it, and with it the namespace;
- its output is the pipes its restore handed it (`outputs`), read as a spawned engine's;
- its port is its relay's, on the daemon's host: `config.port` says it, so that every
  URL the daemon makes of the engine reaches the copy;
- `scratch` is a folder of its own, mounted where the dumped engine bound its unix
  sockets (two copies would otherwise bind the same files), removed once it is gone;
- its large anonymous memory is collapsed into huge pages first (`huge_pages`: CRIU
  restores it in 4 KiB pages, and a copy's exit then took 2.4 s on the H200 where a
  spawned engine's takes 0.66 s), before the GPU state its dump took off is brought back
  (CUDA pins that memory again) and it is handed over (a copy with none, on CPU, needs no
  driver). A collapse that cannot be done is logged, never the copy's failure.

`dump_engine` makes the images of an engine the daemon spawned: the GPU state of its
processes that hold the card taken off first (`cuda.take_off`), then CRIU's dump, which
ends the tree; a dump that fails leaves the tree running with its GPU state back.
`GpuState` is the seam to the CUDA driver (which processes hold the card, the driver or
why there is none): tests script it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import shutil
import tempfile
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import structlog

from supervisor.engine.process import kv_tier, proctree
from supervisor.engine.process import process as eng
from supervisor.engine.snapshot import criu, cuda, huge_pages, relay
from supervisor.settings.sections import EngineConfig
from supervisor.watchdog import warmup

log = structlog.get_logger("supervisor.engine")


@dataclass(frozen=True)
class GpuState:
    """Where a tree's GPU state is read and moved: which of its processes hold the card,
    and the CUDA driver's checkpoint API (or why there is none)."""

    holders: Callable[[Iterable[int]], list[int]] = cuda.gpu_holders
    driver: Callable[[], tuple[cuda.Driver | None, str | None]] = cuda.open_driver

    def opened(self) -> cuda.Driver:
        driver, why = self.driver()
        if driver is None:
            raise criu.SnapshotError(f"the engine holds the GPU and {why}")
        return driver


REAL_GPU = GpuState()  # this machine's driver and device files

async def dump_engine(engine: eng.EngineProcess, snapshot: eng.Restore,
                      made: Mapping[str, str], gpu: GpuState, within_s: float) -> float:
    """`engine`'s tree dumped to `snapshot.images` (docstring above): seconds taken.
    Raises SnapshotError or CheckpointError, the tree running on."""
    pids = [p.pid for p in await asyncio.to_thread(proctree.snapshot_tree, engine.pid)]
    held = await asyncio.to_thread(gpu.holders, pids)
    driver = gpu.opened() if held else None
    taken = await asyncio.to_thread(cuda.take_off, driver, held) if driver else []
    try:
        return await criu.dump(criu.Criu.at(snapshot.criu), engine.pid, Path(snapshot.images),
                               pipes=engine.pipes, within_s=within_s, made=made,
                               gpu=taken, port=engine.spec.port,
                               warmed=engine.warmed is not None,
                               vllm_version=engine.vllm_version,
                               weights_bytes=engine.weights_bytes)
    except BaseException:
        if driver is not None and taken:
            left = await asyncio.to_thread(cuda.bring_back, driver, taken)
            if left:
                log.error("a dump that failed left GPU state not brought back",
                          pid=engine.pid, errors=left)
        raise


def _ended() -> asyncio.StreamReader:
    """A reader with nothing to read (an image that kept one pipe for both outputs)."""
    reader = asyncio.StreamReader()
    reader.feed_eof()
    return reader


async def spawn_copy(spec: eng.SpawnSpec, generation: int, now: float, cfg: EngineConfig,
                     runtime_dir: str, keep_lines: int = 200,
                     gpu: GpuState = REAL_GPU) -> eng.EngineProcess:
    """A copy of `spec.restore`'s images, running, reached on a port of the daemon's and
    read through its own pipes (docstring above). Raises (SnapshotError, OSError) with
    nothing of it left running."""
    assert spec.restore is not None
    r = spec.restore
    scratch = await asyncio.to_thread(tempfile.mkdtemp, prefix=f"copy-{generation}-",
                                      dir=runtime_dir or None)
    binds = [(Path(scratch), Path(r.rpc_at))] if r.rpc_at else []
    # its KV tier, the host's folder both engines read, not one of its own /dev/shm
    tier = kv_tier.folder_of(cfg) if "--kv-transfer-config" in spec.argv else None
    copy: criu.Copy | None = None
    try:
        copy = await criu.restore(criu.Criu.at(r.criu), Path(r.images), f"g{generation}",
                                  within_s=cfg.startup_timeout_s, binds=binds,
                                  shared=[tier] if tier else [])
        await _into_huge_pages(copy)
        if copy.gpu:  # (its GPU state, as the dump took it off)
            left = await asyncio.to_thread(cuda.bring_back, gpu.opened(), copy.gpu)
            if left:
                raise criu.SnapshotError("the copy's GPU state not brought back: "
                                         + "; ".join(left.values()))
        listening = relay.bind_free(spec.host)
        try:
            port = int(listening.getsockname()[1])
            await relay.start(copy.root, listening, r.port or spec.port)
        finally:
            listening.close()  # (the relay holds its own)
        fds = list(copy.outputs.values())
        copy.outputs = {}  # (the readers own them now)
        readers = [await eng.pipe_reader(fd) for fd in fds]
    except BaseException:
        if copy is not None:
            await copy.end()
        await asyncio.to_thread(_remove, scratch)
        raise
    out = readers[0] if readers else _ended()
    err = readers[1] if len(readers) > 1 else _ended()
    engine = eng.EngineProcess(generation=generation, proc=copy.proc, pid=copy.root,
                               started_at=now, spec=spec,
                               config=dataclasses.replace(cfg, port=port),
                               recent_lines=deque(maxlen=keep_lines), outputs=(out, err),
                               scratch=scratch,
                               # (what its warm-up built, it has: its proof asks none)
                               warmed=warmup.Warmed() if r.warmed else None,
                               vllm_version=r.vllm_version, weights_bytes=r.weights_bytes)
    try:
        engine.known = await asyncio.to_thread(proctree.snapshot_tree, copy.root)
    except OSError as exc:  # (it runs: never lose it; the watch's first look fills this)
        log.warning("cannot read the copy's tree yet", error=str(exc), pid=copy.root)
    log.info("engine restored from its snapshot", pid=copy.root, port=port,
             images=r.images, generation=generation, warmed_before_its_dump=r.warmed)
    return engine


async def _into_huge_pages(copy: criu.Copy) -> None:
    """The copy's processes' large anonymous memory collapsed into huge pages, and one
    line saying how it went; never raises (but a cancellation)."""
    try:
        done, huge = await asyncio.to_thread(_collapsed, copy.pids)
    except Exception as exc:  # (a copy is worth more than how its pages are mapped)
        log.warning("copy's memory not collapsed into huge pages", pid=copy.root,
                    error=repr(exc))
        return
    if done.why_not is not None:
        log.warning("copy's memory not collapsed into huge pages", pid=copy.root,
                    why=done.why_not)
        return
    log.info("copy's memory collapsed into huge pages", pid=copy.root,
             asked_mib=done.asked >> 20, advised_mib=done.advised >> 20,
             refused_ranges=done.refused, seconds=done.seconds,
             anon_huge_mib=huge >> 20 if huge is not None else None,
             errors={str(p): e for p, e in done.errors.items()} or None)


def _collapsed(pids: list[int]) -> tuple[huge_pages.Collapsed, int | None]:
    """The processes' memory collapsed, then their anonymous memory in huge pages, all
    told (None when one's is unreadable): one trip to a thread."""
    done = huge_pages.collapse(pids)
    held = [huge_pages.anon_huge_bytes(p) for p in pids]
    return done, None if None in held else sum(h for h in held if h is not None)


def _remove(folder: str) -> None:
    shutil.rmtree(folder, ignore_errors=True)


async def forget(engine: eng.EngineProcess) -> None:
    """What a copy leaves once its tree is gone: its scratch folder."""
    if engine.scratch is not None:
        await asyncio.to_thread(_remove, engine.scratch)
        engine.scratch = None
