"""End-to-end: the real vLLM CPU engine (API server, core and worker: three processes, with
their message queues in /dev/shm and their ZMQ sockets in a folder) snapshotted by the
real CRIU and brought back twice at once, each copy in namespaces of its own with the
dumped engine's pids and port (supervisor/engine/snapshot/criu.py; issue 49's route 3).

Each copy answers a greedy completion with the tokens the engine gave before its dump
(the same engine, not a new one), its output comes through a pipe of its own, and ending
one leaves the other serving; in the end nothing of either is left. A third copy is
spawned by the daemon's own jobs, as a snapshot standby's spawn is
(supervisor/engine/snapshot/copies.py): healthy through its relay, serving the same
tokens, its log read as an engine's, and taken down by the daemon's take-down with
nothing left. The engine starts as route 3's standby does: under a seccomp filter that
refuses io_uring (CRIU cannot dump one), its own sockets on loopback (`VLLM_HOST_IP`; a
copy's namespace has nothing else).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx
import pytest
from structlog.testing import capture_logs

from supervisor.engine.events import Down, Event, HealthResult, Spawned
from supervisor.engine.process import process as eng
from supervisor.engine.snapshot import criu, relay
from supervisor.loop import Clock
from supervisor.settings.config import parse_config
from tests.harness import ROOT, cache_env, free_port, next_event, run_caches, wait_for
from tests.test_e2e_vllm import ENGINE_VLLM, MODEL, START_TIMEOUT
from tests.test_snapshot_criu import alive, carried, read_until
from tests.test_snapshot_spawn import effects, line_seen

pytestmark = pytest.mark.e2e

GUARD_S = 120.0  # a dump or a restore of the CPU engine, at most (7-8 s measured)
PROMPT = {"model": "tiny-llama", "prompt": "The snapshot of an engine", "max_tokens": 12,
          "temperature": 0.0}


async def complete_in(pid: int, port: int) -> dict[str, object]:
    """A completion from the copy whose process is `pid`, inside its network namespace."""
    sock = await criu.connect_in(pid, "127.0.0.1", port)
    reader, writer = await asyncio.open_connection(sock=sock)
    data = json.dumps(PROMPT).encode()
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                 b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(data)
                 + data)
    await writer.drain()
    raw = await asyncio.wait_for(reader.read(), GUARD_S)
    writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.split()[1] == b"200", raw[:300]
    doc: dict[str, object] = json.loads(body)
    return doc


def test_the_real_engine_snapshotted_comes_back_twice_at_once_as_itself(tmp_path: Path) -> None:
    tool = carried()
    port = free_port()
    rpc = Path(tempfile.mkdtemp(prefix="vsr-", dir="/tmp"))  # (short: unix socket paths)
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONUNBUFFERED": "1",
           "VLLM_HOST_IP": "127.0.0.1", "VLLM_RPC_BASE_PATH": str(rpc),
           **cache_env(run_caches())}
    argv = [sys.executable, str(ROOT / "supervisor" / "engine" / "snapshot" / "no_io_uring.py"),
            str(ENGINE_VLLM), "serve", str(MODEL), "--served-model-name", "tiny-llama",
            "--max-model-len", "512",
            "--dtype", "float32", "--enforce-eager", "--host", "127.0.0.1", "--port",
            str(port)]
    engine = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              stdin=subprocess.DEVNULL, env=env, start_new_session=True)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_for(lambda: engine.poll() is None and httpx.get(f"{base}/health", timeout=2)
                 .status_code == 200, START_TIMEOUT, "the engine healthy")
        before = httpx.post(f"{base}/v1/completions", json=PROMPT, timeout=60).json()
        text = before["choices"][0]["text"]
        assert text, before
        assert engine.stdout is not None
        asyncio.run(copies(tool, engine, port, rpc, tmp_path / "images", text))
    finally:
        if engine.poll() is None:
            os.killpg(engine.pid, signal.SIGKILL)
        engine.wait(30)
        # the dumped engine's message queues left in /dev/shm (kept with the images: the
        # copies had their own), and the images, its memory: 2.3 GiB not left for pytest
        kept = tmp_path / "images" / criu.SHM_KEPT
        for name in os.listdir(kept) if kept.is_dir() else []:
            if not name.startswith(criu.REMAP):
                (criu.SHM / name).unlink(missing_ok=True)
        for folder in (tmp_path / "images", rpc, *rpc.parent.glob(f"{rpc.name}-*")):
            shutil.rmtree(folder, ignore_errors=True)


async def copies(tool: criu.Criu, engine: subprocess.Popen[bytes], port: int, rpc: Path,
                 images: Path, text: str) -> None:
    assert engine.stdout is not None
    pipe = criu.pipe_inode(engine.stdout.fileno())
    took = await criu.dump(tool, engine.pid, images, pipes=(pipe,), within_s=GUARD_S)
    print(f"dumped in {took} s")
    assert (images / criu.SHM_KEPT).is_dir()  # (its message queues kept with it)
    assert not [n for n in os.listdir(criu.SHM) if n in os.listdir(images / criu.SHM_KEPT)
                and n.startswith(criu.REMAP)]  # (the dump's links moved, none left)
    made: list[criu.Copy] = []
    try:
        for name in ("a", "b"):  # (one at a time: two restores at once on 2 cores)
            own = rpc.parent / f"{rpc.name}-{name}"
            own.mkdir()
            made.append(await criu.restore(tool, images, name, GUARD_S, binds=[(own, rpc)]))
        a, b = made
        assert len(a.pids) >= 3 and len(a.pids) == len(b.pids)  # server, core, worker
        for copy in made:
            doc = await complete_in(copy.root, port)
            assert doc["choices"][0]["text"] == text, (doc, text)  # type: ignore[index]
        # each copy's log through its own pipe (vLLM's access log, one line per request)
        assert b"POST /v1/completions" in await read_until(a.outputs[pipe],
                                                           b"POST /v1/completions")
        with pytest.raises(OSError):  # nothing of theirs listens in the daemon's namespace
            await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 5)
        pids = [p for c in made for p in c.pids]
        assert await a.end(30)
        assert all(alive(p) for p in b.pids)  # (the other copy unharmed)
        # b on a port of the daemon's loopback, through its relay, as the proxy and the
        # watchdog would reach it: a generation, and vLLM's /metrics page
        listening = relay.bind_free()
        await relay.start(b.root, listening, port)
        here = listening.getsockname()[1]
        listening.close()
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{here}",
                                     timeout=GUARD_S) as client:
            r = await client.post("/v1/completions", json=PROMPT)
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == text, r.text
            metrics = (await client.get("/metrics")).text
            assert "vllm:num_requests_running" in metrics
        assert await b.end(30)
        assert not any(alive(p) for p in pids)
        # a third, spawned by the daemon's own jobs as a snapshot standby's spawn will be
        # (engine/snapshot/copies.py): healthy through its relay, serving, its output read
        # as an engine's, taken down by the daemon's take-down with nothing left
        await daemons_copy(tool, images, port, rpc, text)
    finally:
        for copy in made:
            await copy.end(30)


async def daemons_copy(tool: criu.Criu, images: Path, port: int, rpc: Path, text: str) -> None:
    runtime = Path(tempfile.mkdtemp(prefix="vsc-", dir="/tmp"))
    cfg = parse_config({
        "engine": {"command": [str(ENGINE_VLLM), "serve", str(MODEL)], "port": port,
                   "startup_timeout_s": GUARD_S, "health_interval_s": 0.25,
                   "stop_grace_s": 15.0, "reap_timeout_s": 15.0,
                   "gpu_release_timeout_s": 1.0},
        "daemon": {"runtime_dir": str(runtime)}}, "t.toml", runtime)
    spec = dataclasses.replace(eng.build_spawn_spec(cfg.engine, os.environ),
                               restore=eng.Restore(str(images), tool.argv[0], str(rpc)))
    queue: asyncio.Queue[Event] = asyncio.Queue()
    clock = Clock()
    fx = effects(cfg, queue, clock)
    engine = None
    try:
        fx.spawn(1, spec, cfg.engine, 1)
        spawned = await next_event(queue, Spawned, GUARD_S)
        assert spawned.error is None and spawned.engine is not None, spawned.error
        engine = spawned.engine
        pids = [p.pid for p in engine.known]
        fx.watch(engine)
        assert (await next_event(queue, HealthResult, GUARD_S)).healthy
        async with httpx.AsyncClient(base_url=engine.config.base_url,
                                     timeout=GUARD_S) as client:
            r = await client.post("/v1/completions", json=PROMPT)
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == text, r.text
        await line_seen(engine, "POST /v1/completions")  # (its access log, read as an engine's)
        fx.take_down(engine, True, asyncio.Event(), None, clock.monotonic() + GUARD_S)
        down = await next_event(queue, Down, GUARD_S)
        assert down.error is None and down.result is not None
        assert down.result.survivors == [] and not any(alive(p) for p in pids)
    finally:
        if engine is not None and engine.proc.returncode is None:
            os.killpg(engine.proc.pid, signal.SIGKILL)
        with capture_logs():
            await fx.end()
        shutil.rmtree(runtime, ignore_errors=True)
