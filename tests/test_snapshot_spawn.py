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
import dataclasses
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from structlog.testing import capture_logs

from supervisor.engine.effects import jobs
from supervisor.engine.events import Down, Event, HealthResult, Spawned
from supervisor.engine.process import process as eng
from supervisor.engine.snapshot import criu
from supervisor.front.admission import Gate
from supervisor.loop import Clock
from supervisor.settings.config import parse_config
from supervisor.watchdog.gpu import NoGpu
from tests.harness import free_port, next_event
from tests.test_snapshot_criu import FAKE, GUARD_S, alive, carried, healthy


def effects(cfg, queue: asyncio.Queue[Event], clock: Clock) -> jobs.JobEffects:
    return jobs.JobEffects(queue=queue, config=lambda: cfg, clock=clock, environ={},
                           gpu=NoGpu(), siblings=set, gate=Gate(), front=None, name="e")


def config(tmp_path: Path, port: int):
    return parse_config({
        "engine": {"command": [sys.executable, str(FAKE)], "port": port,
                   "reap_timeout_s": 10.0, "gpu_release_timeout_s": 1.0,
                   "stop_grace_s": 10.0, "startup_timeout_s": GUARD_S,
                   "health_interval_s": 0.1},
        "daemon": {"runtime_dir": str(tmp_path / "run")},
        "audit": {"path": str(tmp_path / "events.jsonl")}}, "t.toml", tmp_path)


def dumped(tmp_path: Path, port: int, tool: criu.Criu) -> Path:
    """The fake engine (and its core) started as the daemon starts one, its stdout and
    stderr two pipes of ours, dumped: the images."""
    images = tmp_path / "images"
    engine = subprocess.Popen(
        [sys.executable, str(FAKE), "--port", str(port), "--child",
         "--scheduling-policy", "priority"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
        env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)
    try:
        assert engine.stdout is not None and engine.stderr is not None
        asyncio.run(healthy(port))
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
            for _ in range(int(GUARD_S / 0.05)):  # its line, through its own stdout
                if any("request priority 5" in line for line in engine.recent_lines):
                    break
                await asyncio.sleep(0.05)
            assert any(line.startswith("[stdout]") and "request priority 5" in line
                       for line in engine.recent_lines), list(engine.recent_lines)[-5:]

            fx.take_down(engine, True, asyncio.Event(), None, clock.monotonic() + GUARD_S)
            down = await next_event(queue, Down, GUARD_S)
            assert down.error is None and down.result is not None
            assert down.result.survivors == []
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
