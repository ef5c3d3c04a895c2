"""A copy of a dumped engine spawned by the daemon's own jobs (supervisor/engine/snapshot/
copies.py, through `JobEffects.spawn` with a spec that says `restore`), with the real CRIU
on the fake engine: found healthy through its relay on the daemon's loopback, its output
read from its own pipes as a spawned engine's (stdout and stderr apart), a completion
served, then taken down by the daemon's take-down (SIGTERM to its group) with its whole
tree proven gone, the namespace's `unshare` ended, its relay's port free again and its
folder of its own removed. A spawn from images that are not there fails that spawn,
saying why, and leaves nothing."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from structlog.testing import capture_logs

from supervisor.engine.effects import jobs
from supervisor.engine.events import Down, Event, HealthResult, Spawned
from supervisor.engine.process import process as eng
from supervisor.engine.process import proctree
from supervisor.engine.snapshot import copies, criu
from supervisor.front.admission import Gate
from supervisor.loop import Clock
from supervisor.settings.config import parse_config
from supervisor.watchdog.gpu import NoGpu
from tests.harness import free_port, next_event
from tests.test_snapshot_criu import FAKE, GUARD_S, alive, carried, healthy
from tests.test_snapshot_cuda import Scripted


def effects(cfg, queue: asyncio.Queue[Event], clock: Clock,
            gpu: copies.GpuState = copies.REAL_GPU) -> jobs.JobEffects:
    return jobs.JobEffects(queue=queue, config=lambda: cfg, clock=clock, environ={},
                           gpu=NoGpu(), siblings=set, gate=Gate(), front=None, name="e",
                           gpu_state=gpu)


async def line_seen(engine: eng.EngineProcess, needle: str) -> None:
    """Until the daemon has read a line of the engine's stdout with `needle` in it."""
    for _ in range(int(GUARD_S / 0.05)):
        if any(line.startswith("[stdout]") and needle in line for line in engine.recent_lines):
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"{needle!r} never read from its stdout: "
                         f"{list(engine.recent_lines)[-5:]}")


def config(tmp_path: Path, port: int):
    return parse_config({
        "engine": {"command": [sys.executable, str(FAKE)], "port": port,
                   "reap_timeout_s": 10.0, "gpu_release_timeout_s": 1.0,
                   "stop_grace_s": 10.0, "startup_timeout_s": GUARD_S,
                   "health_interval_s": 0.1},
        "daemon": {"runtime_dir": str(tmp_path / "run")},
        "audit": {"path": str(tmp_path / "events.jsonl")}}, "t.toml", tmp_path)


def dumped(tmp_path: Path, port: int, tool: criu.Criu,
           flags: tuple[str, ...] = ("--scheduling-policy", "priority"),
           healthy_then: Callable[[int], None] = lambda pid: None) -> Path:
    """The fake engine (and its core) started as the daemon starts one, with `flags`, its
    stdout and stderr two pipes of ours, dumped: the images. `healthy_then`: a look at
    it (its pid) once healthy, before the dump."""
    images = tmp_path / "images"
    engine = subprocess.Popen(
        [sys.executable, str(FAKE), "--port", str(port), "--child", *flags],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
        env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)
    try:
        assert engine.stdout is not None and engine.stderr is not None
        asyncio.run(healthy(port))
        healthy_then(engine.pid)
        pipes = (criu.pipe_inode(engine.stdout.fileno()), criu.pipe_inode(engine.stderr.fileno()))
        asyncio.run(criu.dump(tool, engine.pid, images, pipes=pipes, within_s=GUARD_S))
        engine.wait(GUARD_S)
    finally:
        if engine.poll() is None:
            os.killpg(engine.pid, signal.SIGKILL)
            engine.wait(GUARD_S)
    return images


def test_a_copy_is_spawned_watched_served_and_taken_down_as_any_engine(tmp_path) -> None:
    port, tool = free_port(), carried()
    images = dumped(tmp_path, port, tool)
    cfg = config(tmp_path, port)
    (tmp_path / "run").mkdir()
    rpc = tmp_path / "rpc"  # (where the dumped engine would bind its unix sockets)
    rpc.mkdir()
    spec = dataclasses.replace(eng.build_spawn_spec(cfg.engine, os.environ),
                               restore=eng.Restore(str(images), tool.argv[0], str(rpc)))

    async def main() -> None:
        queue: asyncio.Queue[Event] = asyncio.Queue()
        clock = Clock()
        fx = effects(cfg, queue, clock)
        engine = None
        try:
            fx.spawn(7, spec, cfg.engine, 1)
            spawned = await next_event(queue, Spawned, GUARD_S)
            assert spawned.error is None, spawned.error
            engine = spawned.engine
            assert engine is not None and engine.bay == 1 and engine.spec is spec
            relay_port = engine.config.port
            assert relay_port != port and engine.scratch is not None
            scratch = engine.scratch
            assert await asyncio.to_thread(os.path.isdir, scratch)
            pids = [p.pid for p in engine.known]
            assert pids[0] == engine.pid and len(pids) == 2  # (the API server, its core)
            fx.watch(engine)
            health = await next_event(queue, HealthResult, GUARD_S)
            assert health.healthy
            async with httpx.AsyncClient(timeout=GUARD_S) as client:
                r = await client.post(f"http://127.0.0.1:{relay_port}/v1/completions", json={
                    "model": "fake", "prompt": "hi", "max_tokens": 2, "priority": 5})
                assert r.status_code == 200
                await line_seen(engine, "request priority 5")  # (through its own stdout)

                # taken down with the client's connection to its relay still open, as the
                # proxy's are: the relay's end of it, closed first by the relay's death,
                # lingers on the relay's port, and the take-down's check of the port must
                # not take that for a holder (on the H200 it waited the whole
                # reap_timeout_s, 10 s, at every fault of a copy)
                fx.take_down(engine, True, asyncio.Event(), None, clock.monotonic() + GUARD_S)
                down = await next_event(queue, Down, GUARD_S)
            assert down.error is None and down.result is not None
            assert down.result.survivors == []
            assert down.result.port_problem is None, down.result.port_problem
            assert not any(alive(p) for p in pids)
            await asyncio.wait_for(engine.proc.wait(), GUARD_S)  # (its `unshare`)
            assert not await asyncio.to_thread(os.path.isdir, scratch)
            assert engine.scratch is None
            with pytest.raises(OSError):  # its relay went with it
                await asyncio.wait_for(asyncio.open_connection("127.0.0.1", relay_port), 5)
        finally:
            if engine is not None and engine.proc.returncode is None:
                os.killpg(engine.proc.pid, signal.SIGKILL)
            with capture_logs():
                await fx.end()

    asyncio.run(main())
    assert not [f for f in (tmp_path / "run").iterdir() if f.name.startswith("copy-")]


def test_a_copy_of_images_not_there_fails_its_spawn_saying_why(tmp_path) -> None:
    cfg = config(tmp_path, free_port())
    (tmp_path / "run").mkdir()
    spec = dataclasses.replace(eng.build_spawn_spec(cfg.engine, os.environ), restore=eng.Restore(
        str(tmp_path / "none"), carried().argv[0]))

    async def main() -> Spawned:
        queue: asyncio.Queue[Event] = asyncio.Queue()
        fx = effects(cfg, queue, Clock())
        try:
            fx.spawn(3, spec, cfg.engine, 1)
            return await next_event(queue, Spawned, GUARD_S)  # type: ignore[no-any-return]
        finally:
            with capture_logs():
                await fx.end()

    spawned = asyncio.run(main())
    assert spawned.engine is None and spawned.error is not None
    assert "no snapshot in" in spawned.error
    assert not any(f.name.startswith("copy-") for f in (tmp_path / "run").iterdir())


class Card(Scripted):
    """The scripted driver over this machine's processes: one in a PID namespace of its
    own (a copy's, restored) reads as checkpointed, as the dumped one it is a copy of was
    left; any other as running."""

    def __init__(self) -> None:
        super().__init__([])
        self.states = _States()


class _States(dict[int, str]):
    def __missing__(self, pid: int) -> str:
        status = Path(f"/proc/{pid}/status").read_text()
        nspid = next(line.split()[1:] for line in status.splitlines()
                     if line.startswith("NSpid:"))
        self[pid] = "checkpointed" if len(nspid) > 1 else "running"
        return self[pid]


def test_an_engine_the_daemon_spawned_is_dumped_by_its_effect_and_comes_back(tmp_path) -> None:
    """`JobEffects.dump`: the GPU state of the processes that hold the card taken off (a
    scripted driver: the fake engine's core holds it), the tree dumped with both of its
    output pipes and so ended, its take-down's `Down` saying the dump's seconds; a copy
    of it spawned from the images gets its GPU state back, by the pid it has inside, and
    writes to pipes of its own. Its KV tier in /dev/shm is the host's folder still, under
    the /dev/shm of the copy's own."""
    port, tool = free_port(), carried()
    top = Path(tempfile.mkdtemp(prefix="vs-tier-test-", dir="/dev/shm"))
    tier = top / "kv-tier"
    cfg = parse_config({
        "engine": {"command": [sys.executable, str(FAKE), "--child",
                               "--scheduling-policy", "priority"], "port": port,
                   "reap_timeout_s": 10.0, "gpu_release_timeout_s": 1.0,
                   "stop_grace_s": 10.0, "startup_timeout_s": GUARD_S,
                   "health_interval_s": 0.1, "kv_tier": str(tier),
                   "kv_tier_chunk_tokens": 16},
        "daemon": {"runtime_dir": str(tmp_path / "run")},
        "audit": {"path": str(tmp_path / "events.jsonl")}}, "t.toml", tmp_path)
    (tmp_path / "run").mkdir()
    images = tmp_path / "images"
    card = Card()
    gpu = copies.GpuState(holders=lambda pids: list(pids)[1:], driver=lambda: (card, None))
    snapshot = eng.Restore(str(images), tool.argv[0])
    spec = eng.build_spawn_spec(cfg.engine, os.environ)

    async def main() -> None:
        queue: asyncio.Queue[Event] = asyncio.Queue()
        clock = Clock()
        fx = effects(cfg, queue, clock, gpu)
        engines = []
        try:
            fx.spawn(1, spec, cfg.engine, 1)
            first = (await next_event(queue, Spawned, GUARD_S)).engine
            assert first is not None and len(first.pipes) == 2  # (its stdout, its stderr)
            engines.append(first)
            fx.watch(first)
            assert (await next_event(queue, HealthResult, GUARD_S)).healthy
            dumped = await until_two(first)
            fx.dump(first, snapshot, {"argv": " ".join(spec.argv)}, clock.monotonic() + GUARD_S)
            down = await next_event(queue, Down, GUARD_S)
            assert down.dump_error is None and down.dumped_s is not None and down.dumped_s > 0
            assert down.result is not None and down.result.survivors == []
            assert not any(alive(p) for p in dumped)
            core = dumped[1]
            assert card.calls == [("lock", core), ("checkpoint", core)]
            assert await criu.made_of(images) == {"argv": " ".join(spec.argv)}

            fx.spawn(2, dataclasses.replace(spec, restore=snapshot), cfg.engine, 1)
            copy = (await next_event(queue, Spawned, GUARD_S)).engine
            assert copy is not None
            engines.append(copy)
            copy_core = (await until_two(copy))[1]
            assert copy_core not in dumped
            assert card.calls[2:] == [("restore", copy_core), ("unlock", copy_core)]
            fx.watch(copy)
            assert (await next_event(queue, HealthResult, GUARD_S)).healthy
            async with httpx.AsyncClient(timeout=GUARD_S) as client:
                r = await client.post(f"{copy.config.base_url}/v1/completions", json={
                    "model": "fake", "prompt": "hi", "max_tokens": 2, "priority": 9})
                assert r.status_code == 200
            await line_seen(copy, "request priority 9")
            async with httpx.AsyncClient(timeout=GUARD_S) as client:
                r = await client.post(f"{copy.config.base_url}/v1/completions", json={
                    "model": "fake", "prompt": "a" * 40, "max_tokens": 1, "stream": True})
                assert r.status_code == 200
            # its two full chunks, written where the next engine reads them
            assert len(list(tier.rglob("*.bin"))) == 2
            fx.take_down(copy, True, asyncio.Event(), None, clock.monotonic() + GUARD_S)
            down = await next_event(queue, Down, GUARD_S)
            assert down.result is not None and down.result.survivors == []
            assert down.dumped_s is None and down.dump_error is None
        finally:
            for e in engines:
                if e.proc.returncode is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(e.proc.pid, signal.SIGKILL)
            with capture_logs():
                await fx.end()

    try:
        asyncio.run(main())
    finally:
        shutil.rmtree(top, ignore_errors=True)


async def until_two(engine: eng.EngineProcess) -> list[int]:
    """The engine's tree, once its core (its second process) is in it."""
    for _ in range(int(GUARD_S / 0.05)):
        pids = [p.pid for p in await asyncio.to_thread(proctree.snapshot_tree, engine.pid)]
        if len(pids) >= 2:
            return pids
        await asyncio.sleep(0.05)
    raise AssertionError("the fake engine's core was never seen")


def test_a_dump_that_fails_brings_the_gpu_state_back_and_takes_the_engine_down(
        tmp_path) -> None:
    port = free_port()
    cfg = config(tmp_path, port)
    cfg = dataclasses.replace(cfg, engine=dataclasses.replace(
        cfg.engine, command=[sys.executable, str(FAKE), "--child"]))
    (tmp_path / "run").mkdir()
    card = Card()
    gpu = copies.GpuState(holders=lambda pids: list(pids)[1:], driver=lambda: (card, None))
    no_criu = eng.Restore(str(tmp_path / "images"), str(tmp_path / "no-criu"))

    async def main() -> Down:
        queue: asyncio.Queue[Event] = asyncio.Queue()
        clock = Clock()
        fx = effects(cfg, queue, clock, gpu)
        engine = None
        try:
            fx.spawn(1, eng.build_spawn_spec(cfg.engine, os.environ), cfg.engine, 0)
            engine = (await next_event(queue, Spawned, GUARD_S)).engine
            assert engine is not None
            fx.watch(engine)
            assert (await next_event(queue, HealthResult, GUARD_S)).healthy
            pids = await until_two(engine)
            fx.dump(engine, no_criu, {}, clock.monotonic() + GUARD_S)
            down = await next_event(queue, Down, GUARD_S)
            assert not any(alive(p) for p in pids)
            return down  # type: ignore[no-any-return]
        finally:
            if engine is not None and engine.proc.returncode is None:
                os.killpg(engine.pid, signal.SIGKILL)
            with capture_logs():
                await fx.end()

    down = asyncio.run(main())
    assert down.dumped_s is None and down.dump_error is not None and "no-criu" in down.dump_error
    assert down.result is not None and down.result.survivors == []
    core = card.calls[0][1]
    assert card.calls == [("lock", core), ("checkpoint", core), ("restore", core),
                          ("unlock", core)]
