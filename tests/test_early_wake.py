"""A sleeping standby's weights woken while the old engine's memory is released
(`early_wake.weights_fit`, docs/standby.md "Its weights wake while the old engine's memory
is released"): with no room beside
the serving engine for a whole standby, a failover wakes the standby once the old
engine's tree is gone. When NVML's last reading, taken with the old engine healthy, leaves
room on the card for the standby's weights (as its sleep said them) with a margin, their
wake (`/wake_up?tags=weights`) is asked at once, and only the rest (`tags=kv_cache`) once
the tree is gone. Decided over the recording effects and the driven clock of
tests/unit_world.py; the HTTP and the fake engine's side through the daemon in
tests/test_standby.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from supervisor.engine.events import Exited, GateProbe, GpuSampled, HealthResult, Slept, Woken
from supervisor.engine.pair.early_wake import EARLY_WAKE_MARGIN_BYTES
from supervisor.engine.process.enginelog import weights_backup_of
from supervisor.engine.process.process import EngineProcess
from supervisor.watchdog.gpu import DeviceReading, GpuReading
from tests.pair_world import world
from tests.unit_world import World

GIB = 2**30
CARD = 80 * GIB
WEIGHTS = 15 * GIB


def reading(free: int, devices: int = 1) -> GpuReading:
    """The card as NVML reads it, `free` bytes free on each of its GPUs."""
    parts = tuple(DeviceReading(i, memory_used_bytes=CARD - free, memory_total_bytes=CARD)
                  for i in range(devices))
    return GpuReading(memory_used_bytes=sum(CARD - free for _ in parts),
                      memory_total_bytes=CARD * devices, devices=parts)


def armed(w: World, weights: int | None = WEIGHTS, proving: int | None = None
          ) -> tuple[EngineProcess, EngineProcess]:
    """No room beside (vLLM's default share): the standby started first, slept (saying
    its weights' backup) and the engine serves beside it. (first, standby) `proving`:
    a reading of that much free taken while the engine is healthy but not yet proven (in
    its warm-up's sleep, all its memory not taken)."""
    w.sup.start("test")
    spare = w.spawned()
    w.feed(HealthResult(spare.generation, True))
    w.feed(GateProbe(spare.generation, True, None))
    w.feed(Slept(spare.generation, None, 0.2))
    spare.weights_bytes = weights  # (as its sleep's line said: process.py reads it)
    first = w.serving()
    if proving is not None:
        w.feed(GpuSampled(reading(proving), w.now))
    w.feed(GateProbe(first.generation, True, None))
    assert w.state == "RUNNING" and w.sup.engine is first
    return first, spare


def wakes(w: World) -> list[dict[str, object]]:
    return [args for name, args in w.fx.calls if name == "wake"]


def audited(tmp: Path, event: str) -> list[dict[str, object]]:
    lines = (tmp / "events.jsonl").read_text().splitlines()
    return [d for d in map(json.loads, lines) if d.get("event") == event]


def test_the_weights_wake_as_the_old_engine_goes_and_the_rest_once_it_is_gone(
        tmp_path: Path) -> None:
    w = world(tmp_path, "sleep_first")
    try:
        first, spare = armed(w)
        assert w.sup.status()["standby"]["early_wake"] is False  # (no reading yet)
        w.feed(GpuSampled(reading(WEIGHTS + EARLY_WAKE_MARGIN_BYTES), w.now))
        assert w.sup.status()["standby"]["early_wake"] is True  # (what a failover would do)
        w.feed(Exited(first.generation, -9))
        assert w.sup.engine is spare
        assert wakes(w) == [{"pid": spare.pid, "tags": ["weights"]}]  # before the tree went
        assert audited(tmp_path, "failover")[-1]["weights_early"] is True
        w.feed(Woken(spare.generation, None, 0.4, None, ("weights",)))
        assert len(wakes(w)) == 1  # (the old engine's memory is not released yet)
        assert audited(tmp_path, "standby_weights_woken")[-1]["pid"] == spare.pid
        w.down(first)
        assert wakes(w)[1:] == [{"pid": spare.pid, "tags": ["kv_cache"]}]
        assert "gate_probe" not in [n for n, _ in w.fx.calls[-2:]]  # proven once awake
        w.feed(Woken(spare.generation, None, 0.1, None, ("kv_cache",)))
        assert w.fx.last("gate_probe") == {"pid": spare.pid}
        w.feed(GateProbe(spare.generation, True, None))
        assert w.state == "RUNNING" and audited(tmp_path, "failover_done")
    finally:
        w.loop.close()


def test_weights_back_after_the_tree_went_wake_the_rest_then(tmp_path: Path) -> None:
    w = world(tmp_path, "sleep_first")
    try:
        first, spare = armed(w)
        w.feed(GpuSampled(reading(20 * GIB), w.now))
        w.feed(Exited(first.generation, -9))
        w.down(first)
        assert wakes(w) == [{"pid": spare.pid, "tags": ["weights"]}]  # one wake at a time
        w.feed(Woken(spare.generation, None, 0.6, None, ("weights",)))
        assert wakes(w)[1:] == [{"pid": spare.pid, "tags": ["kv_cache"]}]
        w.feed(Woken(spare.generation, None, 0.1, None, ("kv_cache",)))
        assert w.fx.last("gate_probe") == {"pid": spare.pid}
    finally:
        w.loop.close()


@pytest.mark.parametrize("case", ["no_room", "reading_before_healthy", "never_slept",
                                  "no_reading", "two_gpus_one_full", "reading_while_proving"])
def test_without_room_for_the_weights_the_whole_standby_wakes_once_the_tree_is_gone(
        tmp_path: Path, case: str) -> None:
    w = world(tmp_path, "sleep_first")
    try:
        first, spare = armed(w, weights=None if case == "never_slept" else WEIGHTS,
                             proving=40 * GIB if case == "reading_while_proving" else None)
        if case == "reading_before_healthy":
            # (taken while the engine was still starting: its memory not all taken yet)
            w.feed(GpuSampled(reading(40 * GIB), first.healthy_at - 1.0))  # type: ignore[operator]
        elif case == "no_room":
            w.feed(GpuSampled(reading(WEIGHTS + EARLY_WAKE_MARGIN_BYTES - 1), w.now))
        elif case == "never_slept":
            w.feed(GpuSampled(reading(40 * GIB), w.now))
        elif case == "two_gpus_one_full":
            r = reading(40 * GIB, devices=2)
            full = DeviceReading(1, memory_used_bytes=CARD - GIB, memory_total_bytes=CARD)
            w.feed(GpuSampled(GpuReading(devices=(r.devices[0], full)), w.now))
        assert w.sup.status()["standby"]["early_wake"] is False
        w.feed(Exited(first.generation, -9))
        assert wakes(w) == []
        assert "weights_early" not in audited(tmp_path, "failover")[-1]
        w.down(first)
        assert wakes(w) == [{"pid": spare.pid}]
    finally:
        w.loop.close()


def test_a_failed_weights_wake_fails_the_takeover_and_wakes_nothing_more(
        tmp_path: Path) -> None:
    w = world(tmp_path, "sleep_first")
    try:
        first, spare = armed(w)
        w.feed(GpuSampled(reading(20 * GIB), w.now))
        w.feed(Exited(first.generation, -9))
        w.feed(Woken(spare.generation, "POST /wake_up: HTTP 500: CUDA out of memory", 0.3,
                     None, ("weights",)))
        assert w.state == "BACKOFF"
        assert audited(tmp_path, "failover_failed")[-1]["reason"].startswith(  # type: ignore[union-attr]
            "the standby's weights did not wake")
        w.down(first)
        assert wakes(w) == [{"pid": spare.pid, "tags": ["weights"]}]
    finally:
        w.loop.close()


def test_vllms_sleep_line_says_the_weights_backup() -> None:
    line = ("CuMemAllocator: sleep freed 23.86 GiB memory in total, of which 15.51 GiB "
            "is backed up in CPU and the rest 8.35 GiB is discarded directly.")
    assert weights_backup_of(line) == int(15.51 * GIB)
    assert weights_backup_of("Sleep mode freed 23.86 GiB memory, 0.77 GiB memory is "
                             "still in use.") is None


def test_the_standby_started_first_is_no_handover_under_way(tmp_path: Path) -> None:
    """(A regression of this change, found in review: `STANDBY_FIRST` took a clock as a
    handover does, and a late `done` would have ended it as a failover.)"""
    w = world(tmp_path, "sleep_first")
    try:
        w.sup.start("test")
        h = w.sup.handover
        assert h.first and h.since is None
        assert h.done(w.sup.pair_facts()) == []  # (nothing to end)
    finally:
        w.loop.close()
