"""`engine.take_down` on real processes, with a scripted GPU lister standing in for NVML."""

from __future__ import annotations

import asyncio
import errno
import sys
import time
import types
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from supervisor.engine.process import process as eng
from supervisor.engine.process import proctree, takedown
from supervisor.settings.sections import EngineConfig
from supervisor.watchdog.gpu import NoGpu
from tests.harness import FAKE_ENGINE, alive, free_port


class ScriptedGpu:
    """Lists the given pids as holding GPU memory for the first `polls` calls."""

    def __init__(self, holders: dict[int, int], polls: int) -> None:
        self.holders = holders
        self.polls = polls
        self.calls = 0

    def processes(self) -> dict[int, int] | None:
        self.calls += 1
        return dict(self.holders) if self.calls <= self.polls else {}


def engine_config(*args: str, **kw: float) -> EngineConfig:
    return EngineConfig(command=[sys.executable, str(FAKE_ENGINE), *args], port=free_port(),
                        cwd=str(Path.cwd()), drain_timeout_s=1,
                        stop_grace_s=kw.get("grace", 1),
                        reap_timeout_s=3, gpu_release_timeout_s=kw.get("gpu_timeout", 3))


async def spawn_running(cfg: EngineConfig) -> eng.EngineProcess:
    spec = eng.build_spawn_spec(cfg, {"PATH": "/usr/bin:/bin"})
    e = await eng.spawn_engine(spec, 1, 0.0, cfg)
    exited: asyncio.Future[int] = asyncio.ensure_future(e.proc.wait())
    assert await eng.wait_healthy(f"http://127.0.0.1:{cfg.port}/health", 0.05, 20, exited)
    e.known = await asyncio.to_thread(proctree.snapshot_tree, e.pid)
    return e


def test_take_down_waits_until_the_gpu_is_released():
    async def run() -> tuple[takedown.TakeDown, ScriptedGpu, list[int]]:
        # (a grace a loaded host keeps within: at 1 s, CI's busiest minute SIGKILLed it)
        cfg = engine_config("--child", grace=10)
        e = await spawn_running(cfg)
        pids = [p.pid for p in e.known]
        gpu = ScriptedGpu({pids[-1]: 6 << 30, 999_999: 1 << 30}, polls=3)
        r = await takedown.take_down(e, cfg, graceful=True, force=asyncio.Event(), gpu=gpu)
        return r, gpu, pids

    r, gpu, pids = asyncio.run(run())
    assert r.gpu_holders == {} and gpu.calls == 4  # polled until the old tree left the GPU
    assert r.survivors == [] and alive(pids) == []
    assert r.exit_code == 0 and not r.sigkilled


def test_the_release_is_looked_at_quickly_at_first_then_at_the_usual_interval(monkeypatch):
    """On a full card the standby's wake waits for the proof that the old engine's memory
    is back (0.27-0.71 s after a kill on the H200): every 20 ms for the first 2 s, then
    every `interval_s`, within the timeout; on a driven clock."""
    clock = [100.0]
    slept: list[float] = []

    async def sleep(s: float) -> None:
        slept.append(s)
        clock[0] += s

    monkeypatch.setattr(takedown, "time", types.SimpleNamespace(monotonic=lambda: clock[0]))
    monkeypatch.setattr(takedown, "asyncio", types.SimpleNamespace(
        sleep=sleep, to_thread=asyncio.to_thread))
    calls = []

    def held() -> dict[int, int]:
        calls.append(clock[0])
        return {7: 1 << 30} if clock[0] < 102.5 else {}

    left = asyncio.run(takedown.poll_until_clear(held, 10.0, interval_s=0.25,
                                                 quick_for_s=takedown.QUICK_FOR_S))
    assert left == {}
    quick = [s for s in slept if s == takedown.QUICK_INTERVAL_S]
    n = round(takedown.QUICK_FOR_S / takedown.QUICK_INTERVAL_S)
    assert n <= len(quick) <= n + 1  # (2 s of them, to a float's rounding)
    assert slept[len(quick):] == [0.25, 0.25]  # (then the usual interval, until clear)
    # without `quick_for_s`: the usual interval from the first look, and the timeout holds
    slept.clear()
    clock[0] = 0.0
    assert asyncio.run(takedown.poll_until_clear(lambda: [1], 1.0, interval_s=0.25)) == [1]
    assert slept == [0.25] * 4


def test_take_down_reports_gpu_memory_that_is_never_released():
    async def run() -> tuple[takedown.TakeDown, int]:
        cfg = engine_config(gpu_timeout=0.5)
        e = await spawn_running(cfg)
        gpu = ScriptedGpu({e.pid: 24 << 30}, polls=10**6)
        return await takedown.take_down(e, cfg, graceful=False, force=asyncio.Event(),
                                        gpu=gpu), e.pid

    r, pid = asyncio.run(run())
    assert r.gpu_holders == {pid: 24 << 30}  # only pids of the old tree; foreign ones are not ours
    assert r.sigkilled


def test_force_skips_the_drain_of_an_engine_ignoring_sigterm():
    async def run() -> takedown.TakeDown:
        cfg = EngineConfig(command=[sys.executable, str(FAKE_ENGINE), "--ignore-sigterm"],
                           port=free_port(), cwd=str(Path.cwd()), drain_timeout_s=60,
                           stop_grace_s=60, reap_timeout_s=3)
        e = await spawn_running(cfg)
        force = asyncio.Event()
        loop = asyncio.get_running_loop()
        loop.call_later(0.3, force.set)
        # Without the force this would wait out 120 s of drain + grace: the deadline fails it.
        return await asyncio.wait_for(
            takedown.take_down(e, cfg, graceful=True, force=force, gpu=NoGpu()), 60)

    r = asyncio.run(run())
    assert r.sigkilled and r.exit_code == -9 and r.survivors == []


def test_the_stop_deadline_cuts_the_drain_of_an_engine_ignoring_sigterm():
    """A restart's one deadline: what is left of it bounds the engine's drain and grace
    (60 s + 60 s configured, 1 s left), and the kill is still made and proven."""
    async def run() -> takedown.TakeDown:
        cfg = EngineConfig(command=[sys.executable, str(FAKE_ENGINE), "--ignore-sigterm"],
                           port=free_port(), cwd=str(Path.cwd()), drain_timeout_s=60,
                           stop_grace_s=60, reap_timeout_s=3)
        budget = takedown.stop_budget_s(cfg, proxy_drain=True, evidence_s=6.0)
        assert budget == 60 + 6 + 60 + 60 + 9 + 60
        e = await spawn_running(cfg)
        return await asyncio.wait_for(
            takedown.take_down(e, cfg, graceful=True, force=asyncio.Event(), gpu=NoGpu(),
                          budget_s=1.0), 60)

    r = asyncio.run(run())
    assert r.sigkilled and r.exit_code == -9 and r.survivors == []
    assert r.duration_s < 60  # not the 120 s of drain and grace: what was left of 1 s


def test_a_sibling_engines_gpu_memory_is_neither_waited_for_nor_foreign() -> None:
    """Before a start: our own killed leftovers must leave the GPU (waited for), another
    engine of this daemon on a shared GPU is expected (not waited for, not foreign), and
    the same memory from a process the daemon did not start refuses the start."""
    sibling, leftover = 4242, 4343

    async def check(gpu: ScriptedGpu, own: set[int], siblings: frozenset[int]) -> None:
        await takedown.check_gpus_free(gpu, own, 0, 5.0, siblings)

    gpu = ScriptedGpu({sibling: 5 << 30}, polls=1000)
    asyncio.run(check(gpu, set(), frozenset({sibling})))  # started beside it at once
    assert gpu.calls == 1
    gpu = ScriptedGpu({sibling: 5 << 30, leftover: 1 << 30}, polls=3)
    asyncio.run(check(gpu, {leftover}, frozenset({sibling})))  # waits for the leftover only
    assert gpu.calls == 5  # 3 with the leftover, 1 clear, then the listing for others
    try:
        asyncio.run(check(ScriptedGpu({sibling: 5 << 30}, polls=1000), set(), frozenset()))
    except takedown.GpuBusy as exc:
        assert f"pid {sibling}" in str(exc) and "5120 MiB" in str(exc)
    else:
        raise AssertionError("a process the daemon did not start was not refused")


def _survivors_failing(monkeypatch, times: int) -> list[int]:
    """`proctree.survivors` raising EBADF (a descriptor closed under the take-down, as
    uvloop's double close did on the GPU, 2026-12-01) its first `times` calls."""
    real = proctree.survivors
    calls = [0]

    def flaky(known, pgid):
        calls[0] += 1
        if calls[0] <= times:
            raise OSError(errno.EBADF, "Bad file descriptor")
        return real(known, pgid)

    monkeypatch.setattr(proctree, "survivors", flaky)
    return calls


def test_a_take_down_whose_step_raised_is_tried_again_and_proves_the_tree_gone(monkeypatch):
    calls = _survivors_failing(monkeypatch, times=1)

    async def run() -> tuple[takedown.TakeDown, list[int]]:
        cfg = engine_config("--child")
        e = await spawn_running(cfg)
        pids = [p.pid for p in e.known]
        with capture_logs() as logs:
            r = await takedown.take_down(e, cfg, graceful=False, force=asyncio.Event(),
                                         gpu=NoGpu())
        assert [x["event"] for x in logs if x["log_level"] == "warning"] == [
            "take-down failed; trying it again, straight to the kill"]
        return r, pids

    r, pids = asyncio.run(run())
    assert calls[0] >= 2 and r.survivors == [] and alive(pids) == []
    assert len(pids) >= 2 and r.sigkilled


def test_a_take_down_that_keeps_failing_raises_its_last_error_with_the_tree_killed(
        monkeypatch):
    _survivors_failing(monkeypatch, times=10**6)

    async def run() -> list[int]:
        cfg = engine_config("--child")
        e = await spawn_running(cfg)
        pids = [p.pid for p in e.known]
        with pytest.raises(OSError, match="Bad file descriptor"):
            await takedown.take_down(e, cfg, graceful=True, force=asyncio.Event(),
                                     gpu=NoGpu())
        return pids

    pids = asyncio.run(run())
    # not proven by the take-down (its caller says so and trusts nothing of it), but the
    # group was killed before the proof failed
    assert _gone_within(pids, 5.0) == []


def _gone_within(pids: list[int], seconds: float) -> list[int]:
    """The pids still alive once `seconds` have passed or none is (reaped by init)."""
    end = time.monotonic() + seconds
    while (left := alive(pids)) and time.monotonic() < end:
        time.sleep(0.05)
    return left
