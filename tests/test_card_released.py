"""A failover to a sleeping standby that waits for the old engine's memory wakes it as
soon as NVML lists none of the old tree (`CardReleased`, told by the take-down:
`takedown.card_released`), not when the whole tree is gone (`Down`): a killed core's
memory is back while its API server, or a copy's namespace, still goes (0.15-0.2 s on
the H200, docs/gpu-validation.md). Decided over the recording effects and the driven
clock of tests/unit_world.py; the take-down's side on real processes below."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
from structlog.testing import capture_logs

from supervisor.engine.effects import jobs
from supervisor.engine.events import (
    CardReleased,
    Down,
    Event,
    Exited,
    GateProbe,
    GpuSampled,
    Woken,
)
from supervisor.engine.process import takedown
from supervisor.engine.process.process import EngineProcess
from supervisor.engine.process.takedown import TakeDown
from supervisor.engine.snapshot import cuda
from supervisor.front.admission import Gate
from supervisor.loop import Clock
from supervisor.settings.config import parse_config
from supervisor.settings.sections import EngineConfig
from supervisor.watchdog.gpu import GpuReading, NoGpu
from tests.harness import FAKE_ENGINE, free_port
from tests.harness import until as until_async
from tests.pair_world import world
from tests.test_early_wake import WEIGHTS, armed, audited, reading, wakes
from tests.test_takedown import engine_config, spawn_running
from tests.unit_world import World

GIB = 2**30
GUARD_S = 30.0  # a hang guard, not a timing assertion


def spawns(w: World) -> int:
    return sum(1 for name, _ in w.fx.calls if name == "spawn")


def test_the_standby_wakes_once_the_old_engines_memory_is_released_not_its_tree(
        tmp_path: Path) -> None:
    w = world(tmp_path, "sleep_first")
    try:
        first, spare = armed(w)
        w.feed(Exited(first.generation, -9))  # (no reading: nothing woken early)
        assert w.sup.engine is spare and wakes(w) == []
        w.feed(CardReleased(first.generation, 0.05))
        assert wakes(w) == [{"pid": spare.pid}]  # its tree not gone yet
        said = audited(tmp_path, "card_released")[-1]
        assert (said["pid"], said["after_s"]) == (first.pid, 0.05)
        w.feed(Woken(spare.generation, None, 0.45, None))
        assert w.fx.last("gate_probe") == {"pid": spare.pid}
        w.feed(GateProbe(spare.generation, True, None))
        assert w.state == "RUNNING" and audited(tmp_path, "failover_done")
        w.down(first)
        assert len(wakes(w)) == 1  # (woken once)
        assert w.state == "RUNNING" and w.sup.engine is spare
    finally:
        w.loop.close()


def test_weights_ahead_the_rest_wakes_on_the_release(tmp_path: Path) -> None:
    """Weights woken early, then the memory released: the KV cache wakes then (and the
    other order: released first, the rest once the weights are back)."""
    for released_first in (False, True):
        tmp = tmp_path / str(released_first)
        tmp.mkdir()
        w = world(tmp, "sleep_first")
        try:
            first, spare = armed(w)
            w.feed(GpuSampled(reading(20 * GIB), w.now))
            w.feed(Exited(first.generation, -9))
            assert wakes(w) == [{"pid": spare.pid, "tags": ["weights"]}]
            if released_first:
                w.feed(CardReleased(first.generation, 0.1))
                assert len(wakes(w)) == 1  # (one wake at a time)
            w.feed(Woken(spare.generation, None, 0.6, None, ("weights",)))
            if not released_first:
                assert len(wakes(w)) == 1  # (the old engine's memory not released yet)
                w.feed(CardReleased(first.generation, 0.1))
            assert wakes(w)[1:] == [{"pid": spare.pid, "tags": ["kv_cache"]}]
            w.down(first)
            assert len(wakes(w)) == 2
        finally:
            w.loop.close()


def test_a_release_of_an_engine_not_being_taken_down_is_nothing(tmp_path: Path) -> None:
    w = world(tmp_path, "sleep_first")
    try:
        first, spare = armed(w)
        w.feed(CardReleased(first.generation, 0.1))  # (it serves: stale or foreign)
        w.feed(CardReleased(spare.generation, 0.1))
        assert wakes(w) == [] and not audited(tmp_path, "card_released")
        assert w.sup.engine is first and w.state == "RUNNING"
    finally:
        w.loop.close()


def test_a_tree_not_proven_gone_after_the_release_leaves_the_woken_standby_serving(
        tmp_path: Path) -> None:
    """The card was released (NVML lists none of the old tree), so the wake went on; a
    process of the old tree that then survives SIGKILL holds nothing of the card: the
    standby that took over serves, and its old place stays failed (said), not re-armed."""
    w = world(tmp_path, "sleep_first")
    try:
        first, spare = armed(w)
        w.feed(Exited(first.generation, -9))
        w.feed(CardReleased(first.generation, 0.05))
        w.feed(Woken(spare.generation, None, 0.45, None))
        w.feed(GateProbe(spare.generation, True, None))
        before = spawns(w)
        w.feed(Down(first.generation, None, "take-down failed: processes survived SIGKILL"))
        assert w.state == "RUNNING" and w.sup.engine is spare
        st = w.sup.status()["standby"]
        assert st["state"] == "failed" and "survived SIGKILL" in st["reason"]
        assert spawns(w) == before
    finally:
        w.loop.close()


def test_the_unit_notes_that_nvml_listed_its_engine(tmp_path: Path) -> None:
    w = world(tmp_path, "sleep_first")
    try:
        first, spare = armed(w)
        assert not first.gpu_listed
        w.feed(GpuSampled(GpuReading(process_memory={99_999: 1}), w.now))
        assert not first.gpu_listed  # (another process's)
        w.feed(GpuSampled(GpuReading(process_memory={first.pid: WEIGHTS}), w.now))
        assert first.gpu_listed and not spare.gpu_listed
    finally:
        w.loop.close()


# ---- the take-down's side: `takedown.card_released` ----------------------------------

class Listings:
    """NVML's listings in turn (the last one repeated), each call counted."""

    def __init__(self, *listings: dict[int, int] | None) -> None:
        self.listings = list(listings)
        self.calls = 0

    def processes(self) -> dict[int, int] | None:
        self.calls += 1
        return self.listings[min(self.calls, len(self.listings)) - 1]


class WhileAlive:
    """NVML as a dying engine shows it: `pid` listed with its memory while it runs (a
    zombie or a gone pid holds nothing); `calls` counted."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.calls = 0

    def processes(self) -> dict[int, int] | None:
        self.calls += 1
        try:
            running = psutil.Process(self.pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            running = False
        return {self.pid: 6 << 30} if running else {}


def released(gpu: Listings, listed_before: bool = False, timeout_s: float = 1.0
             ) -> tuple[bool, int]:
    told: list[int] = []
    ok = asyncio.run(takedown.card_released(gpu, lambda: {10, 11}, listed_before,
                                            lambda: told.append(1), timeout_s))
    assert len(told) == (1 if ok else 0)
    return ok, gpu.calls


def test_told_once_nvml_lists_none_of_the_tree_after_listing_some() -> None:
    assert released(Listings({11: 5, 12: 7}, {11: 5, 12: 7}, {12: 7})) == (True, 3)


def test_told_at_once_when_listed_before_and_not_now() -> None:
    assert released(Listings({12: 7}), listed_before=True) == (True, 1)


def test_a_tree_nvml_never_listed_is_told_nothing() -> None:
    assert released(Listings({12: 7})) == (False, 1)  # (no GPU of its, or pids unseen)
    assert released(Listings(None)) == (False, 1)  # (no NVML)


def test_nvml_unreadable_after_listing_is_no_release() -> None:
    ok, calls = released(Listings({10: 1}, None), timeout_s=0.2)
    assert not ok and calls > 2  # (looked at until its bound, never told)


async def core_killed(cfg: EngineConfig) -> tuple[EngineProcess, int]:
    """A fake engine whose child (its "core", on the card) was SIGKILLed and is gone, its
    main process still up: a crash as the failover sees it. (engine, the child's pid)"""
    e = await spawn_running(cfg)
    child = next(p.pid for p in e.known if p.pid != e.pid)
    os.kill(child, signal.SIGKILL)
    await until_async(lambda: not WhileAlive(child).processes(), GUARD_S, "the child's end")
    e.gpu_listed = True  # (NVML listed it while it served)
    return e, child


def test_the_take_down_tells_before_it_ends_and_only_where_nvml_listed_the_tree() -> None:
    async def run(gpu_of: str) -> tuple[TakeDown, list[float], list[str]]:
        cfg = engine_config("--child")
        e, child = await core_killed(cfg)
        if gpu_of == "none":
            e.gpu_listed = False
        order: list[str] = []
        told: list[float] = []

        def tell(s: float) -> None:
            told.append(s)
            order.append("told")

        gpu = WhileAlive(child) if gpu_of == "nvml" else NoGpu()
        r = await takedown.take_down(e, cfg, graceful=False, force=asyncio.Event(),
                                     gpu=gpu, on_card_released=tell)
        order.append("down")
        return r, told, order

    r, told, order = asyncio.run(run("nvml"))
    assert r.survivors == [] and order == ["told", "down"] and 0 <= told[0] < r.duration_s
    r, told, order = asyncio.run(run("none"))
    assert r.survivors == [] and told == [] and order == ["down"]


class SlowFirstLook(WhileAlive):
    """NVML whose first answer (the card's look, which begins before the take-down's
    own) takes 0.5 s: a loaded host's worker threads."""

    first = True

    def processes(self) -> dict[int, int] | None:
        if self.first:
            self.first = False
            time.sleep(0.5)
        return super().processes()


def test_the_take_down_waits_for_the_cards_look_in_flight_to_tell() -> None:
    """The take-down proved the tree gone before the card's look came back: it still
    tells before it returns, as promised (CI once saw the look cancelled instead)."""
    async def run() -> tuple[TakeDown, list[str]]:
        cfg = engine_config("--child")
        e, child = await core_killed(cfg)
        order: list[str] = []
        r = await takedown.take_down(e, cfg, graceful=False, force=asyncio.Event(),
                                     gpu=SlowFirstLook(child),
                                     on_card_released=lambda s: order.append("told"))
        order.append("down")
        return r, order

    r, order = asyncio.run(run())
    assert r.survivors == [] and r.gpu_holders == {} and order == ["told", "down"], order


def test_the_jobs_tell_the_unit_before_the_tree_is_down(tmp_path: Path) -> None:
    """Through the unit's take-down job: `CardReleased` of that engine, then its `Down`."""
    cfg = parse_config({
        "engine": {"command": [sys.executable, str(FAKE_ENGINE), "--child"],
                   "port": free_port(), "reap_timeout_s": 5.0, "gpu_release_timeout_s": 2.0},
        "daemon": {"runtime_dir": str(tmp_path)}}, "t.toml", tmp_path)

    async def main() -> tuple[int, list[Event]]:
        queue: asyncio.Queue[Event] = asyncio.Queue()
        clock = Clock()
        e, child = await core_killed(cfg.engine)
        gpu = WhileAlive(child)
        fx = jobs.JobEffects(queue=queue, config=lambda: cfg, clock=clock, environ={},
                             gpu=gpu, siblings=set, gate=Gate(), front=None, name="e")
        seen: list[Event] = []
        try:
            fx.take_down(e, False, asyncio.Event(), None, clock.monotonic() + GUARD_S)
            async with asyncio.timeout(GUARD_S):  # (a hang guard)
                while not seen or not isinstance(seen[-1], Down):
                    seen.append(await queue.get())
        finally:
            with capture_logs():
                await fx.end()
        return e.generation, seen

    gen, seen = asyncio.run(main())
    kinds = [type(ev).__name__ for ev in seen]
    assert kinds == ["CardReleased", "Down"], kinds
    told, down = seen
    assert isinstance(told, CardReleased) and isinstance(down, Down)
    assert told.generation == down.generation == gen and down.error is None
    assert down.result is not None and 0 <= told.after_s <= down.result.duration_s


def test_a_graceful_take_down_tells_nothing() -> None:
    """(No wake waits on one: a failover that waits for the old engine's memory kills it.)"""
    async def run() -> list[float]:
        cfg = engine_config("--child")
        e = await spawn_running(cfg)
        told: list[float] = []
        gpu = WhileAlive(e.known[-1].pid)
        await takedown.take_down(e, cfg, graceful=True, force=asyncio.Event(), gpu=gpu,
                                 on_card_released=told.append)
        return told

    assert asyncio.run(run()) == []


def test_a_process_of_the_tree_not_yet_recorded_is_waited_for_too() -> None:
    """The tree as it is at the take-down's start counts with the recorded one: a child
    the daemon's looks have not seen yet, on the card, is never told released while it
    runs (without that, NVML listing none of the recorded pids would tell at once)."""
    async def run() -> list[bool]:
        cfg = engine_config("--child")
        e = await spawn_running(cfg)
        child = next(p.pid for p in e.known if p.pid != e.pid)
        e.known = [p for p in e.known if p.pid == e.pid]  # (not recorded yet)
        e.gpu_listed = True
        gpu = WhileAlive(child)
        child_ran: list[bool] = []

        def tell(_: float) -> None:
            child_ran.append(gpu.processes() != {})

        await takedown.take_down(e, cfg, graceful=False, force=asyncio.Event(), gpu=gpu,
                                 on_card_released=tell)
        return child_ran

    assert True not in asyncio.run(run())  # (told, if at all, with the child gone)


class Broken:
    def processes(self) -> dict[int, int] | None:
        raise RuntimeError("NVML went away")


def test_a_look_that_fails_tells_nothing_and_says_so() -> None:
    with capture_logs() as logs:
        ok = asyncio.run(takedown.card_released(Broken(), lambda: {1}, True,
                                                lambda: None, 1.0))
    assert not ok
    assert [x["error"] for x in logs if "look at the card" in x["event"]] == [
        "RuntimeError: NVML went away"]


HOLDER = "import sys, time; f = open(sys.argv[1], 'w'); print('open', flush=True); time.sleep(60)"


def test_a_process_that_holds_the_device_open_keeps_the_card_though_nvml_lists_none(
        tmp_path: Path) -> None:
    """A child that inherited the GPU's descriptors keeps the memory with NVML listing
    nobody (a killed parent's memory stays until the child goes): not told until it
    is gone. Its device file: one of the test's, in place of /dev/nvidia*."""
    device = str(tmp_path / "nvidia")
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, device + "0"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "open\n"
        assert cuda.may_hold([holder.pid, 999_999_999], device)
        assert not cuda.may_hold([holder.pid], str(tmp_path / "other"))

        async def run() -> tuple[bool, list[bool]]:
            ran: list[bool] = []
            asyncio.get_running_loop().call_later(0.3, holder.kill)
            ok = await takedown.card_released(
                Listings({}), lambda: {holder.pid}, True,
                lambda: ran.append(holder.poll() is None and psutil.pid_exists(holder.pid)
                                   and psutil.Process(holder.pid).status()
                                   != psutil.STATUS_ZOMBIE),
                GUARD_S, device)
            return ok, ran

        ok, ran = asyncio.run(run())
        assert ok and ran == [False]  # told once, with the holder dead
        assert not cuda.may_hold([holder.pid], device)  # (a zombie, or gone)
    finally:
        holder.kill()
        holder.wait()
