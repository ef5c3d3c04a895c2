"""The daemon out of file descriptors (EMFILE) is the daemon's own problem, never the
engine's: a canary, a scrape or a look at /proc it could not make is no sample, the jobs
that make them live on, a take-down proves the tree gone without /proc, and the audit
keeps its records until it can write them (issue 33, H1).

The shortage is simulated where the daemon meets it (the exception httpx, psutil or
os.open raises), so the tests run without starving pytest itself; tests/test_flood.py
starves a real daemon.
"""

from __future__ import annotations

import asyncio
import errno
import os
import resource
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import httpx
import psutil
import pytest
from structlog.testing import capture_logs

from supervisor.engine.effects import http_jobs, jobs
from supervisor.engine.events import CanaryDone, Event, MetricsSampled, TreeSeen
from supervisor.engine.process import process as eng
from supervisor.engine.process import proctree, takedown
from supervisor.front.admission import Gate
from supervisor.loop import Clock
from supervisor.ops import audit as audit_module
from supervisor.ops import descriptors
from supervisor.ops.audit import AuditTrail
from supervisor.settings.config import Config, parse_config
from supervisor.watchdog import canary
from supervisor.watchdog.gpu import NoGpu
from supervisor.watchdog.poller import scrape
from tests.harness import next_event as harness_next_event
from tests.harness import until

GUARD_S = 20.0  # a hang guard, not a timing assertion


def emfile() -> OSError:
    return OSError(errno.EMFILE, "Too many open files")


def connect_error_from_emfile(request: httpx.Request) -> NoReturn:
    """As httpx raises it: anyio's happy eyeballs hides the socket's EMFILE behind "All
    connection attempts failed", the same words as a refused connection."""
    try:
        try:
            raise emfile()
        except OSError as exc:
            raise OSError("All connection attempts failed") from exc
    except OSError as exc:
        raise httpx.ConnectError("All connection attempts failed", request=request) from exc


def bare_emfile(request: httpx.Request) -> NoReturn:
    raise emfile()  # (httpx lets a bare OSError through at times)


def refused(request: httpx.Request) -> NoReturn:
    try:
        raise ConnectionRefusedError(errno.ECONNREFUSED, "Connection refused")
    except OSError as exc:
        raise httpx.ConnectError("All connection attempts failed", request=request) from exc


def client_of(handler: Callable[[httpx.Request], httpx.Response]) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.MockTransport(handler))


def config(tmp_path: Path, **sections: dict[str, Any]) -> Config:
    doc: dict[str, Any] = {"engine": {"command": ["true"], "port": 18999},
                           "daemon": {"runtime_dir": str(tmp_path)}, **sections}
    return parse_config(doc, "t.toml", tmp_path)


def effects(cfg: Config, queue: asyncio.Queue[Event]) -> jobs.JobEffects:
    return jobs.JobEffects(queue=queue, config=lambda: cfg, clock=Clock(), environ={},
                           gpu=NoGpu(), siblings=set, gate=Gate(), front=None, name="e")


class Running:
    """Stands for an engine's asyncio process in jobs that only read its return code."""

    returncode: int | None = None
    pid = 1 << 22


def engine_of(cfg: Config, proc: Any) -> eng.EngineProcess:
    spec = eng.SpawnSpec(argv=["true"], env={}, cwd="/", host="127.0.0.1",
                         port=cfg.engine.port)
    return eng.EngineProcess(generation=1, proc=proc, pid=proc.pid, started_at=0.0,
                             spec=spec, config=cfg.engine)


async def next_event(queue: asyncio.Queue[Event], kind: type[Any]) -> Any:
    """The next event of `kind` (others are dropped), within the guard."""
    return await harness_next_event(queue, kind, GUARD_S)


# ---- telling the shortage apart ---------------------------------------------------------

@pytest.mark.parametrize("handler", [connect_error_from_emfile, bare_emfile])
def test_a_canary_the_daemon_could_not_send_raises_out_of_descriptors(handler) -> None:
    async def main() -> None:
        async with client_of(handler) as client:
            with pytest.raises(descriptors.OutOfDescriptors):
                await canary.probe(client, "http://engine", "m", "Hi", 1, 1.0)
            with pytest.raises(descriptors.OutOfDescriptors):
                await canary.find_model(client, "http://engine", 1.0)
            with pytest.raises(descriptors.OutOfDescriptors):
                await scrape(client, "http://engine/metrics", 1.0)

    asyncio.run(main())


def test_a_refused_canary_is_still_the_engines_failure() -> None:
    async def main() -> None:
        async with client_of(refused) as client:
            outcome = await canary.probe(client, "http://engine", "m", "Hi", 1, 1.0)
            assert not outcome.ok and "ConnectError" in (outcome.error or "")
            snap, error = await scrape(client, "http://engine/metrics", 1.0)
            assert snap is None and error is not None

    asyncio.run(main())


def test_exhausted_reads_errno_through_wrappers_and_groups() -> None:
    assert descriptors.exhausted(emfile())
    assert descriptors.exhausted(OSError(errno.ENFILE, "Too many open files in system"))
    assert descriptors.exhausted(ExceptionGroup("connect", [ValueError(), emfile()]))
    assert not descriptors.exhausted(ConnectionRefusedError(errno.ECONNREFUSED, "refused"))
    assert not descriptors.exhausted(OSError(errno.ENOENT, "No such file"))
    req = httpx.Request("GET", "http://x")
    with pytest.raises(httpx.ConnectError) as info:
        connect_error_from_emfile(req)
    assert descriptors.exhausted(info.value)
    with pytest.raises(httpx.ConnectError) as info:
        refused(req)
    assert not descriptors.exhausted(info.value)


def test_the_soft_limit_is_raised_to_the_hard_one_and_reported() -> None:
    code = ("from supervisor.ops import descriptors as d; b, s, h = d.raise_soft_limit(); "
            "print(b, s, h, d.soft_limit(), d.open_count())")

    def lowered() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, 512))

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         preexec_fn=lowered, check=True, timeout=GUARD_S)
    before, soft, hard, now, open_ = (int(x) for x in out.stdout.split())
    assert (before, soft, hard, now) == (64, 512, 512, 512)
    assert 3 <= open_ < 64


# ---- the watchdog's jobs live on, and judge nothing ---------------------------------------

def test_canaries_the_daemon_could_not_send_report_nothing_then_canaries_resume(
        tmp_path, monkeypatch) -> None:
    """Before: each came back as a failed canary (three make the hang rule restart a
    healthy engine)."""
    cfg = config(tmp_path, canary={"period_s": 0.5, "model": "fake"})
    calls: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request.url.path)
        if len(calls) <= 3:
            connect_error_from_emfile(request)
        return httpx.Response(200, json={"choices": [{"text": "x"}]})

    monkeypatch.setattr(http_jobs, "http_client", lambda **kw: client_of(handler))

    async def main() -> None:
        queue: asyncio.Queue[Event] = asyncio.Queue()
        act = effects(cfg, queue)
        task = asyncio.ensure_future(act.http.canary(engine_of(cfg, Running())))
        try:
            done = await next_event(queue, CanaryDone)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        assert done.outcome.ok, done.outcome  # the first outcome is the first canary sent
        assert len(calls) == 4

    with capture_logs() as logs:
        asyncio.run(main())
    short = [r for r in logs if "out of file descriptors" in r["event"]]
    assert len(short) == 1 and short[0]["job"] == "canary"  # once per episode
    assert any(r["event"] == "the daemon has file descriptors again" and r["skipped"] == 3
               for r in logs)


def test_scrapes_the_daemon_could_not_send_are_no_sample(tmp_path, monkeypatch) -> None:
    cfg = config(tmp_path, metrics={"period_s": 0.5})
    calls: list[int] = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(1)
        if len(calls) <= 2:
            bare_emfile(request)
        return httpx.Response(503)

    monkeypatch.setattr(http_jobs, "http_client", lambda **kw: client_of(handler))

    async def main() -> None:
        queue: asyncio.Queue[Event] = asyncio.Queue()
        act = effects(cfg, queue)
        task = asyncio.ensure_future(act.http.poll(engine_of(cfg, Running()), cfg.metrics))
        try:
            sampled = await next_event(queue, MetricsSampled)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        assert sampled.error == "HTTP 503" and len(calls) == 3  # the engine's own answer

    asyncio.run(main())


def test_the_watch_job_outlives_proc_reads_that_run_out_of_descriptors(
        tmp_path, monkeypatch) -> None:
    """Before: the `watch engine` job died with OSError(24), and the tree was never
    looked at again (status said "0 processes" of a live engine)."""
    cfg = config(tmp_path)
    real = proctree.snapshot_tree
    failures = [emfile(), emfile()]

    def starved_then_real(pid: int) -> list[proctree.ProcInfo]:
        if failures:
            raise failures.pop()
        return real(pid)

    monkeypatch.setattr(proctree, "snapshot_tree", starved_then_real)

    async def main() -> None:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", "import time; time.sleep(60)", start_new_session=True)
        queue: asyncio.Queue[Event] = asyncio.Queue()
        act = effects(cfg, queue)
        task = asyncio.ensure_future(act._watch(engine_of(cfg, proc)))
        try:
            seen = await next_event(queue, TreeSeen)
            assert [p.pid for p in seen.procs] == [proc.pid] and not failures
        finally:
            os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
        await asyncio.wait_for(task, GUARD_S)  # ends with the engine, not with an error

    asyncio.run(main())


# ---- the take-down ---------------------------------------------------------------------

class NoProc:
    """psutil, as the daemon out of descriptors meets it: /proc cannot be opened."""

    NoSuchProcess = psutil.NoSuchProcess
    AccessDenied = psutil.AccessDenied
    STATUS_ZOMBIE = psutil.STATUS_ZOMBIE

    @staticmethod
    def Process(pid: int) -> NoReturn:
        raise OSError(errno.EMFILE, "Too many open files", f"/proc/{pid}/stat")

    @staticmethod
    def pids() -> NoReturn:
        raise OSError(errno.EMFILE, "Too many open files", "/proc")


TREE = ("import os, sys, time\n"
        "if os.fork() == 0:\n    time.sleep(60)\n"
        "else:\n    print('up', flush=True); time.sleep(60)\n")


async def spawn_tree() -> tuple[asyncio.subprocess.Process, list[proctree.ProcInfo]]:
    """A main process and its child, in their own session, as an engine's tree."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", TREE, stdout=asyncio.subprocess.PIPE, start_new_session=True)
    assert proc.stdout is not None
    assert await asyncio.wait_for(proc.stdout.readline(), GUARD_S) == b"up\n"

    def both() -> list[proctree.ProcInfo]:
        procs = proctree.snapshot_tree(proc.pid)
        return procs if len(procs) == 2 else []

    return proc, await until(both, GUARD_S, "the main process and its child", 0.02)


def test_a_take_down_out_of_descriptors_proves_the_tree_gone_without_proc(
        tmp_path, monkeypatch) -> None:
    """Before: the take-down raised "Too many open files" ("engine tree not proven gone")
    and the daemon went FATAL with the engine's processes alive."""
    cfg = config(tmp_path, engine={"command": ["true"], "port": 18999, "reap_timeout_s": 5.0,
                                   "gpu_release_timeout_s": 0.0})

    def no_socket(host: str, port: int) -> NoReturn:
        raise emfile()

    async def main() -> None:
        proc, known = await spawn_tree()
        engine = engine_of(cfg, proc)
        engine.known = known
        with monkeypatch.context() as m:
            m.setattr(proctree, "psutil", NoProc)
            m.setattr(proctree, "port_busy", no_socket)
            with capture_logs() as logs:
                result = await asyncio.wait_for(takedown.take_down(
                    engine, cfg.engine, graceful=False, force=asyncio.Event(), gpu=NoGpu(),
                    budget_s=15.0), GUARD_S)
        assert result.survivors == [] and result.sigkilled
        assert result.port_problem is not None and "out of file descriptors" in \
            result.port_problem
        assert [p.pid for p in known if proctree.is_alive(p)] == []  # (psutil again)
        assert any(r["event"].startswith("the daemon is out of file descriptors")
                   and r["job"] == "take-down" for r in logs)

    asyncio.run(main())


def test_survivors_by_signal_counts_a_live_tree_and_a_group_it_cannot_name() -> None:
    async def main() -> None:
        proc, known = await spawn_tree()
        try:
            main_only = [i for i in known if i.pid == proc.pid]
            assert proctree.survivors_by_signal(known, proc.pid) == sorted(
                known, key=lambda i: i.pid)
            # the child is in the group, but not known: counted under the group's number
            os.kill(proc.pid, signal.SIGKILL)
            await takedown.wait_exit(proc)  # (not proc.wait(): the child holds the pipe)
            left = proctree.survivors_by_signal(main_only, proc.pid)
            assert [i.pid for i in left] == [proc.pid] and "group" in left[0].name
        finally:
            os.killpg(proc.pid, signal.SIGKILL)
        # killed: gone once the orphan is reaped (by init, a moment later)
        await until(lambda: not proctree.survivors_by_signal(known, proc.pid), GUARD_S,
                    "the tree gone", 0.02)

    asyncio.run(main())


def test_kill_group_never_signals_a_pid_it_cannot_check(monkeypatch) -> None:
    sent: list[tuple[str, int, int]] = []
    monkeypatch.setattr(proctree, "psutil", NoProc)
    monkeypatch.setattr(proctree.os, "killpg", lambda pg, sig: sent.append(("group", pg, sig)))
    monkeypatch.setattr(proctree.os, "kill", lambda pid, sig: sent.append(("pid", pid, sig)))
    proctree.kill_group(4242, [proctree.ProcInfo(4243, 1.0)])
    assert sent == [("group", 4242, signal.SIGKILL)]


# ---- the audit trail ---------------------------------------------------------------------

def test_audit_records_are_kept_while_out_of_descriptors_and_written_in_order(
        tmp_path, monkeypatch) -> None:
    """Before: each record was lost, with one warning per record."""
    trail = AuditTrail(str(tmp_path / "events.jsonl"), 1 << 20, 1)
    assert trail.append({"event": "a"}) is None
    real_open = os.open
    monkeypatch.setattr(audit_module.os, "open", lambda *a, **k: (_ for _ in ()).throw(emfile()))
    first = trail.append({"event": "b"})
    assert first is not None and "Too many open files" in first
    assert trail.append({"event": "c"}) is None  # (said once per run)
    assert [r["event"] for r in trail.tail(10)] == ["a", "b", "c"]
    monkeypatch.setattr(audit_module.os, "open", real_open)
    assert trail.append({"event": "d"}) is None
    on_disk = (tmp_path / "events.jsonl").read_text().splitlines()
    assert [line.split('"event":"')[1].split('"')[0] for line in on_disk] == ["a", "b", "c", "d"]
    assert trail.dropped == 0 and trail.write_errors == 2


def test_audit_drops_the_oldest_kept_records_past_its_bound_and_says_how_many(
        tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(audit_module, "MAX_PENDING", 3)
    trail = AuditTrail(str(tmp_path / "events.jsonl"), 1 << 20, 1)
    real_open = os.open
    monkeypatch.setattr(audit_module.os, "open", lambda *a, **k: (_ for _ in ()).throw(emfile()))
    for i in range(5):
        trail.append({"time": i, "event": f"e{i}"})
    monkeypatch.setattr(audit_module.os, "open", real_open)
    trail.append({"time": 5, "event": "e5"})
    events = [r["event"] for r in trail.tail(10)]
    assert events == ["audit_records_dropped", "e3", "e4", "e5"]
    assert trail.tail(10)[0]["count"] == 3 and trail.dropped == 3
