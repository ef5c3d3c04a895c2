"""vLLM's offload files (`/dev/shm/vllm_offload_{engine_id}.mmap`) and message queues'
(`/dev/shm/psm_*`) of an engine that died: removed before a relaunch, those its tree
held and no other (supervisor/engine/process/shm_files.py). Real processes hold real
files, in a folder of the test's own in place of /dev/shm; an engine's whole path goes
through the daemon's jobs: spawned, watched, killed, taken down."""

from __future__ import annotations

import asyncio
import mmap
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from structlog.testing import capture_logs

from supervisor.engine.effects import jobs
from supervisor.engine.events import Down, Event, Exited, TreeSeen
from supervisor.engine.process import process as eng
from supervisor.engine.process import shm_files
from supervisor.front.admission import Gate
from supervisor.loop import Clock
from supervisor.settings.config import parse_config
from supervisor.watchdog.gpu import NoGpu
from tests.harness import free_port, next_event, until

GUARD_S = 30.0  # a hang guard, not a timing assertion

# Holds each path of argv open and mapped (created when missing), as vLLM's region does;
# with "--unlink LAST", unlinks the last one while holding it; then says "ready".
HOLDER = textwrap.dedent("""
    import mmap, os, sys, time
    args = sys.argv[1:]
    unlink = args[-1] if "--unlink" in args else None
    args = [a for a in args if a != "--unlink"]
    kept = []
    for path in args:
        fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
        os.ftruncate(fd, mmap.PAGESIZE)
        kept.append((fd, mmap.mmap(fd, mmap.PAGESIZE)))
    if unlink:
        os.unlink(unlink)
    print("ready", flush=True)
    time.sleep(600)
""")

# An engine as vLLM's CPU offload leaves its files: its API server creates its region's
# file and holds it (O_EXCL: the creator), its core (a child, in its group) holds another
# (SHM_TWIN, an engine_id another engine holds too) and a message queue's (psm_); a third
# it creates and closes, and says so as vLLM does. Then "ready", and it waits to be
# killed.
ENGINE = textwrap.dedent("""
    import mmap, os, sys, time
    shm = os.environ["SHM"]
    def hold(name, flags=os.O_CREAT | os.O_RDWR):
        fd = os.open(os.path.join(shm, name), flags, 0o600)
        os.ftruncate(fd, 4 * mmap.PAGESIZE)
        return fd, mmap.mmap(fd, 4 * mmap.PAGESIZE)
    ours = hold("vllm_offload_ours.mmap", os.O_CREAT | os.O_EXCL | os.O_RDWR)
    held, holds = os.pipe()
    if os.fork() == 0:
        twin = hold("vllm_offload_twin.mmap")
        queue = hold("psm_0a1b2c3d", os.O_CREAT | os.O_EXCL | os.O_RDWR)
        os.write(holds, b"x")
        time.sleep(600)
    early = os.path.join(shm, "vllm_offload_early.mmap")
    os.close(os.open(early, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600))
    print(f"(EngineCore_DP0 pid={os.getpid()}) INFO 05-01 10:00:00 "
          f"[shared_offload_region.py:142] Created mmap file {early} (0.00 GB)", flush=True)
    os.read(held, 1)  # its child holds the twin (bounded by the test's wait for "ready")
    print("ready", flush=True)
    time.sleep(600)
""")


def hold(*paths: Path | str) -> subprocess.Popen[str]:
    """Another process (not the engine's) holding these files; waited until it does."""
    p = subprocess.Popen([sys.executable, "-c", HOLDER, *map(str, paths)],
                         stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdout.readline() == "ready\n"
    return p


def ident(path: Path) -> tuple[int, int]:
    st = path.stat()
    return st.st_dev, st.st_ino


def test_held_names_the_offload_files_in_the_folder_its_processes_hold(tmp_path):
    shm, elsewhere = tmp_path / "shm", tmp_path / "elsewhere"
    shm.mkdir()
    elsewhere.mkdir()
    ours = shm / "vllm_offload_ours.mmap"
    queue = shm / "psm_1a2b"  # (a message queue's: Python's SharedMemory)
    p = hold(ours, queue, shm / "other_1a2b", elsewhere / "vllm_offload_x.mmap",
             "--unlink", shm / "vllm_offload_gone.mmap")
    try:
        # not another prefix, not another folder, not one whose name is gone
        assert shm_files.held([p.pid], shm) == {str(ours): ident(ours),
                                                str(queue): ident(queue)}
        assert shm_files.held([p.pid + 10**7], shm) == {}  # (no such process)
    finally:
        p.kill()
        p.wait()


def test_vllms_own_lines_name_its_files() -> None:
    shm = Path("/dev/shm")
    lines = [
        "[stdout] (EngineCore_DP0 pid=4242) INFO 05-01 10:00:00 [shared_offload_region.py:"
        "142] Created mmap file /dev/shm/vllm_offload_3f2a_dp0.mmap (1.07 GB)",
        "[stdout] (Worker_TP1 pid=4250) INFO 05-01 10:00:01 [shared_offload_region.py:128] "
        "Opened existing mmap file /dev/shm/vllm_offload_3f2a_dp0.mmap",
        "[stdout] INFO Created mmap file /mnt/huge/vllm_offload_3f2a_dp1.mmap (1.07 GB)",
        "[stdout] INFO Created mmap file /dev/shm/psm_3f2a (0.01 GB)",
        "[stdout] INFO Unlinked mmap file /dev/shm/vllm_offload_9999.mmap",
    ]
    assert shm_files.named(lines, shm) == ["/dev/shm/vllm_offload_3f2a_dp0.mmap"] * 2


def test_a_file_is_kept_when_replaced_under_its_name_or_held_by_a_live_process(tmp_path):
    replaced, held, gone = (tmp_path / f"vllm_offload_{n}.mmap" for n in ("r", "h", "g"))
    replaced.write_bytes(b"old")
    seen_as = ident(replaced)
    other = tmp_path / "other"
    other.write_bytes(b"new")
    other.replace(replaced)  # (a new file under the name since it was seen)
    p = hold(held)
    try:
        with capture_logs() as logs:
            removed = shm_files.remove({str(replaced): seen_as, str(held): ident(held),
                                        str(gone): None}, pid=77)
    finally:
        p.kill()
        p.wait()
    assert removed == [] and replaced.exists() and held.exists()
    kept = {r["path"]: r["event"] for r in logs}
    assert kept == {
        str(replaced): "a shared-memory file of the dead engine kept: another file has its "
                       "name since",
        str(held): "a shared-memory file of the dead engine kept: a live process holds it "
                   "open"}




def test_a_crashed_engines_files_go_at_its_take_down_and_no_other(tmp_path):
    shm = tmp_path / "shm"
    shm.mkdir()
    names = ("ours", "twin", "early", "theirs", "stale")
    files = {n: shm / f"vllm_offload_{n}.mmap" for n in names}
    files["queue"] = shm / "psm_0a1b2c3d"
    files["stale"].write_bytes(b"")  # (an engine's of another daemon, gone: not ours)
    # another engine of this host: its own file, and the twin (the same engine_id)
    other = hold(files["theirs"], files["twin"])
    cfg = parse_config({
        "engine": {"command": [sys.executable, "-c", ENGINE], "port": free_port(),
                   "env": {"SHM": str(shm)}, "reap_timeout_s": 5.0,
                   "gpu_release_timeout_s": 1.0},
        "daemon": {"runtime_dir": str(tmp_path)}}, "t.toml", tmp_path)

    async def main() -> Down:
        queue: asyncio.Queue[Event] = asyncio.Queue()
        clock = Clock()
        fx = jobs.JobEffects(queue=queue, config=lambda: cfg, clock=clock, environ={},
                             gpu=NoGpu(), siblings=set, gate=Gate(), front=None, name="e",
                             shm_dir=shm)
        engine = await eng.spawn_engine(eng.build_spawn_spec(cfg.engine, os.environ), 1,
                                        clock.monotonic(), cfg.engine)
        try:
            fx.watch(engine)
            await until(lambda: any("ready" in line for line in engine.recent_lines), GUARD_S,
                        "the engine's ready line", 0.05)
            # two looks at its tree (every 2 s while it starts): the second began once
            # both of its processes held their files
            for _ in range(2):
                await next_event(queue, TreeSeen, GUARD_S)
            os.killpg(engine.pgid, signal.SIGKILL)  # a crash
            await next_event(queue, Exited, GUARD_S)
            fx.take_down(engine, False, asyncio.Event(), None, clock.monotonic() + GUARD_S)
            return await next_event(queue, Down, GUARD_S)  # type: ignore[no-any-return]
        finally:
            with capture_logs():
                await fx.end()

    try:
        with capture_logs() as logs:
            down = asyncio.run(main())
    finally:
        other.kill()
        other.wait()
    assert down.error is None and down.result is not None and down.result.survivors == []
    left = {n for n, f in files.items() if f.exists()}
    # its own file and the one its lines named are gone; the twin another process still
    # holds, the other engine's and the stale one never were its
    assert left == {"twin", "theirs", "stale"}, left
    removed = sorted((r["path"], r["bytes"]) for r in logs
                     if r["event"] == "shared-memory file of the dead engine removed")
    assert removed == [(str(files["queue"]), 4 * mmap.PAGESIZE),
                       (str(files["early"]), 0), (str(files["ours"]), 4 * mmap.PAGESIZE)]
    kept = [r["path"] for r in logs if r["event"].startswith(
        "a shared-memory file of the dead engine kept")]
    assert kept == [str(files["twin"])]
