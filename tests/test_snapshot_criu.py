"""The snapshot seam (supervisor/engine/snapshot/criu.py) with the real CRIU
(`scripts/setup.sh criu`: .tools/criu/criu) on the fake engine: a sleeping engine of two
processes (its API server and its "core") dumped, two copies of it restored at once in
namespaces of their own (the same pids and port each), each answering inside its own
network namespace, each writing to a pipe of its own, and each ended with nothing left;
and what is refused: a CRIU that does not run or is too old, images that are not there or
are broken (the copy ended, CRIU's words in the error)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from supervisor.engine.snapshot import criu, relay

ROOT = Path(__file__).resolve().parent.parent
CRIU = ROOT / ".tools" / "criu" / "criu"
FAKE = ROOT / "tests" / "fake_engine.py"
NO_IO_URING = ROOT / "supervisor" / "engine" / "snapshot" / "no_io_uring.py"
GUARD_S = 30.0  # every wait below is bounded by this


def carried() -> criu.Criu:
    if not CRIU.exists():
        pytest.fail("CRIU is not set up here: run `bash scripts/setup.sh criu`")
    return criu.Criu.at(str(CRIU))


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def ask(pid: int, port: int, method: str, path: str,
              body: dict[str, object] | None = None) -> tuple[int, bytes]:
    """One HTTP/1.1 request to 127.0.0.1:port inside `pid`'s network namespace."""
    sock = await criu.connect_in(pid, "127.0.0.1", port)
    reader, writer = await asyncio.open_connection(sock=sock)
    data = json.dumps(body).encode() if body is not None else b""
    writer.write(f"{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                 f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
                 .encode() + data)
    await writer.drain()
    raw = await asyncio.wait_for(reader.read(), GUARD_S)
    writer.close()
    head, _, rest = raw.partition(b"\r\n\r\n")
    return int(head.split()[1]), rest


async def healthy(port: int) -> None:
    for _ in range(int(GUARD_S / 0.1)):
        try:
            _, w = await asyncio.open_connection("127.0.0.1", port)
            w.close()
            return
        except OSError:
            await asyncio.sleep(0.1)
    raise AssertionError("the fake engine never listened")


async def read_until(fd: int, needle: bytes) -> bytes:
    """What the pipe's read end carries, until `needle` is in it."""
    seen = b""
    os.set_blocking(fd, False)
    for _ in range(int(GUARD_S / 0.05)):
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            chunk = b""
        seen += chunk
        if needle in seen:
            return seen
        await asyncio.sleep(0.05)
    raise AssertionError(f"{needle!r} never came through the copy's pipe: {seen[-300:]!r}")


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_versions_kernels_and_privilege_read_as_criu_and_linux_write_them() -> None:
    assert criu.version_of("Version: 4.2.1\n") == (4, 2)
    assert criu.version_of("GitID: v3.17\nVersion: 3.17.1") == (3, 17)
    assert criu.version_of("criu: command not found") is None
    assert criu.kernel_of("6.18.44-fc-v769") == (6, 18)
    assert criu.too_old((4, 2), (6, 18)) is None
    assert criu.too_old((4, 1), (6, 15)) is None
    assert "4.2 or later is needed from 6.16" in (criu.too_old((4, 1), (6, 16)) or "")
    assert "too old" in (criu.too_old((3, 16), (5, 10)) or "")
    assert criu.privileged("Name:\tx\nCapEff:\t000001ffffffffff\n")
    assert criu.privileged(f"CapEff:\t{1 << 40:016x}\n")  # CAP_CHECKPOINT_RESTORE alone
    assert not criu.privileged("CapEff:\t0000000000000000\n")


def test_images_of_another_command_line_or_version_are_stale_saying_which() -> None:
    made = {"argv": "vllm serve m --port 8001", "vllm": "0.26.0", "kernel": "6.18.44"}
    assert criu.stale(made, dict(made)) is None
    why = criu.stale(made, {**made, "vllm": "0.33.0"})
    assert why == "its vllm changed ('0.26.0' when it was made, '0.33.0' now)"
    assert "its driver changed ('unknown'" in (criu.stale(made, {**made, "driver": "580"}) or "")


def test_a_criu_that_does_not_run_or_is_too_old_is_refused_saying_why(tmp_path: Path) -> None:
    old = tmp_path / "old-criu"
    old.write_text("#!/bin/sh\necho 'Version: 3.10'\n")
    old.chmod(0o755)
    missing = asyncio.run(criu.refusal(criu.Criu.at(str(tmp_path / "no-criu"))))
    assert missing is not None and "CRIU does not run" in missing and "no-criu" in missing
    why = asyncio.run(criu.refusal(criu.Criu.at(str(old))))
    assert why is not None and "CRIU 3.10" in why
    assert asyncio.run(criu.refusal(carried())) is None  # (this machine's, as set up)


def test_images_that_are_not_there_or_broken_are_refused_and_leave_nothing(
        tmp_path: Path) -> None:
    with pytest.raises(criu.SnapshotError, match="no snapshot in"):
        asyncio.run(criu.restore(carried(), tmp_path / "none", "a"))
    garbled = tmp_path / "garbled"
    garbled.mkdir()
    (garbled / criu.MANIFEST).write_text("{not json")
    with pytest.raises(criu.SnapshotError, match="missing or unreadable"):
        asyncio.run(criu.restore(carried(), garbled, "a"))
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / criu.MANIFEST).write_text(json.dumps({"pid": 1, "pipes": []}))
    (broken / "inventory.img").write_bytes(b"not an image")
    with pytest.raises(criu.SnapshotError, match="criu restore of copy a ended") as e:
        asyncio.run(criu.restore(carried(), broken, "a", within_s=GUARD_S))
    assert "Error" in str(e.value)  # (CRIU's own last lines)
    # a copy whose shell fails before CRIU runs (here a folder to mount that is not
    # there; on the H200, images in /dev/shm hidden by the copy's own) says what it said
    with pytest.raises(criu.SnapshotError, match=r"before CRIU: .*mount") as e:
        asyncio.run(criu.restore(carried(), broken, "b", within_s=GUARD_S,
                                 binds=[(tmp_path / "not-there", tmp_path / "garbled")]))
    assert "(no log)" in str(e.value)


@contextlib.contextmanager
def fake_engine(port: int, *flags: str) -> Iterator[subprocess.Popen[bytes]]:
    """The fake engine with a core (`--child`), its output through a pipe of ours; its
    group killed at the end if anything of it is left."""
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "PYTHONUNBUFFERED": "1"}
    engine = subprocess.Popen(
        [sys.executable, str(FAKE), "--port", str(port), "--child", *flags],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        env=env, start_new_session=True)
    try:
        yield engine
    finally:
        if engine.poll() is None:
            os.killpg(engine.pid, signal.SIGKILL)
            engine.wait(GUARD_S)


def test_a_dumped_engine_comes_back_twice_at_once_each_copy_in_its_own_namespaces(
        tmp_path: Path) -> None:
    port, tool = free_port(), carried()
    # (each request's priority in its log)
    with fake_engine(port, "--enable-sleep-mode", "--scheduling-policy", "priority") as engine:
        asyncio.run(two_copies(engine, port, tool, tmp_path / "images"))


async def two_copies(engine: subprocess.Popen[bytes], port: int, tool: criu.Criu,
                     images: Path) -> None:
    copies: list[criu.Copy] = []
    try:
        await healthy(port)
        assert engine.stdout is not None
        pipe = criu.pipe_inode(engine.stdout.fileno())
        made = {"argv": " ".join(engine.args), "kernel": os.uname().release}  # type: ignore[arg-type]
        took = await criu.dump(tool, engine.pid, images, pipes=(pipe,), within_s=GUARD_S,
                               made=made)
        assert took >= 0 and (images / "inventory.img").exists()
        assert await criu.made_of(images) == made
        assert await criu.made_of(images / "none") is None
        for _ in range(int(GUARD_S / 0.05)):  # (CRIU ends the dumped tree)
            if engine.poll() is not None:
                break
            await asyncio.sleep(0.05)
        assert engine.returncode == -signal.SIGKILL

        copies = list(await asyncio.gather(criu.restore(tool, images, "a", GUARD_S),
                                           criu.restore(tool, images, "b", GUARD_S)))
        a, b = copies
        assert len(a.pids) == len(b.pids) == 2  # the API server and its core, each
        assert not set(a.pids) & set(b.pids)
        for n, copy in enumerate(copies):  # the same port, each in its own namespace
            assert (await ask(copy.root, port, "GET", "/health"))[0] == 200
            code, _ = await ask(copy.root, port, "POST", "/v1/completions", {
                "model": "fake", "prompt": "hi", "max_tokens": 1, "priority": 7 + n})
            assert code == 200
            # its output through a pipe of its own, not the dumped engine's
            assert b"request priority %d" % (7 + n) in await read_until(
                copy.outputs[pipe], b"request priority %d" % (7 + n))
        with pytest.raises(OSError):  # nothing of theirs listens in the daemon's namespace
            await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), GUARD_S)

        pids = [p for c in copies for p in c.pids]
        assert await a.end(GUARD_S)
        assert all(alive(p) for p in b.pids)  # (the other copy unharmed)
        assert (await ask(b.root, port, "GET", "/health"))[0] == 200
        assert await b.end(GUARD_S)
        assert not any(alive(p) for p in pids)
    finally:
        for copy in copies:
            await copy.end(GUARD_S)


def test_a_copy_is_reached_through_its_relay_on_the_daemons_loopback_and_ends_with_it(
        tmp_path: Path) -> None:
    port, tool = free_port(), carried()
    with fake_engine(port, "--token-delay", "0.05") as engine:
        asyncio.run(relayed(engine, port, tool, tmp_path / "images"))


async def relayed(engine: subprocess.Popen[bytes], port: int, tool: criu.Criu,
                  images: Path) -> None:
    import httpx

    await healthy(port)
    assert engine.stdout is not None
    await criu.dump(tool, engine.pid, images, pipes=(criu.pipe_inode(engine.stdout.fileno()),),
                    within_s=GUARD_S)
    copy = await criu.restore(tool, images, "a", GUARD_S)
    listening = relay.bind_free()
    here = listening.getsockname()[1]
    try:
        proc = await relay.start(copy.root, listening, port)
        listening.close()  # (the relay has it)
        base = f"http://127.0.0.1:{here}"
        async with httpx.AsyncClient(base_url=base, timeout=GUARD_S) as client:
            assert (await client.get("/health")).status_code == 200
            # a stream, token by token, through it
            events = []
            async with client.stream("POST", "/v1/completions", json={
                    "model": "fake", "prompt": "hi", "max_tokens": 5, "stream": True}) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        events.append(line)
            assert len(events) == 6 and events[-1] == "data: [DONE]", events
        assert await copy.end(GUARD_S)
        # the relay lived in the copy's PID namespace: it went with it
        assert await asyncio.wait_for(proc.wait(), GUARD_S) is not None
        with pytest.raises(OSError):
            await asyncio.wait_for(asyncio.open_connection("127.0.0.1", here), 5)
    finally:
        await copy.end(GUARD_S)


def test_a_copy_writes_its_kv_tier_to_the_hosts_folder_under_its_own_dev_shm(
        tmp_path: Path) -> None:
    # a copy mounts a /dev/shm of its own (vLLM's queues); a KV tier folder there must
    # still be the host's, which the next engine reads (issue 51 on the snapshot pair)
    port, tool = free_port(), carried()
    top = Path(tempfile.mkdtemp(prefix="vs-tier-test-", dir="/dev/shm"))
    tier = top / "kv-tier"
    tier.mkdir()
    config = json.dumps({"kv_connector": "OffloadingConnector", "kv_connector_extra_config": {
        "block_size": 16, "secondary_tiers": [{"type": "fs", "root_dir": str(tier)}]}})
    try:
        with fake_engine(port, "--kv-transfer-config", config) as engine:
            asyncio.run(tiered(engine, port, tool, tmp_path / "images", tier))
    finally:
        shutil.rmtree(top, ignore_errors=True)


async def tiered(engine: subprocess.Popen[bytes], port: int, tool: criu.Criu,
                 images: Path, tier: Path) -> None:
    def blocks() -> set[str]:
        return {p.name for p in tier.rglob("*.bin")}

    await healthy(port)
    assert engine.stdout is not None
    await criu.dump(tool, engine.pid, images, pipes=(criu.pipe_inode(engine.stdout.fileno()),),
                    within_s=GUARD_S)
    assert (images / criu.SHM_KEPT).is_dir()  # (so each copy gets a /dev/shm of its own)
    with pytest.raises(criu.SnapshotError, match="nowhere"):  # a folder that is not there
        await criu.restore(tool, images, "gone", GUARD_S, shared=[tier.parent / "nowhere"])
    shared = await criu.restore(tool, images, "shared", GUARD_S, shared=[tier])
    own = await criu.restore(tool, images, "own", GUARD_S)
    try:
        assert blocks() == set()
        code, _ = await ask(shared.root, port, "POST", "/v1/completions", {
            "model": "fake", "prompt": "a" * 40, "max_tokens": 1, "stream": True})
        assert code == 200
        written = blocks()
        assert len(written) == 2  # its two full 16-token chunks, in the host's folder
        # a copy not given the folder writes to the /dev/shm of its own: nothing here
        code, _ = await ask(own.root, port, "POST", "/v1/completions", {
            "model": "fake", "prompt": "b" * 40, "max_tokens": 1, "stream": True})
        assert code == 200
        assert blocks() == written
    finally:
        for copy in (shared, own):
            await copy.end(GUARD_S)


def test_a_tree_that_cannot_be_dumped_runs_on_and_the_error_says_why(tmp_path: Path) -> None:
    # an io_uring, which CRIU cannot dump (io_uring_setup: 425 on x86-64)
    held = subprocess.Popen(
        [sys.executable, "-c", "import ctypes, time; libc = ctypes.CDLL(None); "
         "fd = libc.syscall(425, 8, ctypes.create_string_buffer(120)); assert fd >= 0; "
         "print('ready', flush=True); time.sleep(120)"],
        stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        assert held.stdout is not None and held.stdout.readline() == b"ready\n"
        with pytest.raises(criu.SnapshotError, match=f"criu dump of {held.pid} failed"):
            asyncio.run(criu.dump(carried(), held.pid, tmp_path / "images",
                                  within_s=GUARD_S))
        assert alive(held.pid) and held.poll() is None
        state = Path(f"/proc/{held.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        assert state in ("S", "R"), state  # (running on: not left stopped)
    finally:
        os.killpg(held.pid, signal.SIGKILL)
        held.wait(GUARD_S)


def test_a_command_under_the_io_uring_filter_runs_and_cannot_open_one() -> None:
    probe = ("import ctypes, os; libc = ctypes.CDLL(None, use_errno=True); "
             "fd = libc.syscall(425, 8, ctypes.create_string_buffer(120)); "
             "print(fd, ctypes.get_errno(), os.getpid() > 0)")
    out = subprocess.run([sys.executable, str(NO_IO_URING), sys.executable, "-c", probe],
                         capture_output=True, text=True, timeout=GUARD_S)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["-1", "38", "True"]  # ENOSYS, and the rest runs
    bare = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          timeout=GUARD_S)
    assert bare.stdout.split()[0] != "-1"  # (this kernel has io_uring: the filter did it)


def test_images_are_kept_for_a_restarted_daemon_only_within_one_boot(tmp_path: Path) -> None:
    made = {"argv": "vllm serve m --port PORT", "env": "", "cwd": "/"}
    manifest = {"pid": 1, "pipes": [], "made_of": made, "gpu": [], "port": 8101,
                "boot": criu.BOOT_ID.read_text().strip()}
    (tmp_path / criu.MANIFEST).write_text(json.dumps(manifest))
    assert criu.kept(tmp_path) == criu.Kept(made, 8101)
    (tmp_path / criu.MANIFEST).write_text(json.dumps({**manifest, "warmed": True,
                                                      "vllm_version": "0.26.0",
                                                      "weights_bytes": 16_653_909_279}))
    assert criu.kept(tmp_path) == criu.Kept(made, 8101, True, "0.26.0", 16_653_909_279)
    (tmp_path / criu.MANIFEST).write_text(json.dumps({**manifest, "boot": "another boot"}))
    assert criu.kept(tmp_path) is None  # (the driver, the kernel, the GPU may differ)
    (tmp_path / criu.MANIFEST).write_text(json.dumps({**manifest, "port": 0}))
    assert criu.kept(tmp_path) is None
    (tmp_path / criu.MANIFEST).write_text("{not json")
    assert criu.kept(tmp_path) is None
    assert criu.kept(tmp_path / "none") is None
