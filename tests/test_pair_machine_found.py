"""The bugs the pair machine (tests/test_pair_machine.py) found, each as its shortest
sequence, kept as regression tests once fixed (f267491, 889dea2; later ones beside the
code they fixed, e.g. tests/test_thin_pair.py and tests/test_supervisor_unit.py). A bug
still open would be a strict xfail here, its check tolerated in the machine
(`KNOWN_BUGS`) so that the machine goes on looking for others."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from supervisor.engine.events import (
    CoreExited,
    Down,
    Exited,
    GateProbe,
    HealthResult,
    Reloaded,
    Slept,
)
from supervisor.engine.process.process import EngineProcess
from supervisor.settings.config import parse_config
from tests.pair_world import MODES, world
from tests.unit_world import World


def reloaded_arguments(w: World, tmp: Path, mode: str, revision: str) -> None:
    """A reload (SIGHUP) whose only change is a new revision in the engine's arguments."""
    doc = {**w.doc, "engine": {**w.doc["engine"],
                               "args": [*MODES[mode]["args"], "--revision", revision]}}
    reply: asyncio.Future[dict[str, Any]] = w.loop.create_future()
    w.feed(Reloaded(parse_config(doc, str(tmp / "config.toml"), tmp), None, reply))
    assert reply.result()["next_engine_start"] == ["engine.args"]


def crashed_beside_a_sleeping_standby(w: World) -> tuple[EngineProcess, EngineProcess]:
    """No room beside (vLLM's default share): the standby started first and sleeps, the
    engine serves beside it, then crashes. The standby serves now, asleep: it is woken
    once the old engine's tree is gone (its memory released). (first, standby)"""
    w.sup.start("test")
    spare = w.spawned()  # the standby first
    w.feed(HealthResult(spare.generation, True))
    w.feed(GateProbe(spare.generation, True, None))
    w.feed(Slept(spare.generation, None, 0.2))
    first = w.serving()  # then the engine, beside the sleeping standby
    w.feed(GateProbe(first.generation, True, None))
    w.feed(Exited(first.generation, 0))
    assert w.sup.engine is spare and "wake" not in w.fx.names()  # once first is gone
    return first, spare


def test_a_late_sleep_answer_of_a_retired_standby_is_ignored(tmp_path: Path) -> None:
    """A standby being put to sleep is retired (a reload of the arguments: an upgrade),
    its tree is proven gone and the next standby spawns at once in its place; then the
    sleep job's answer (its call ends within 60 s, `remedy.SLEEP_TIMEOUT_S`) arrives.
    It is stale and must be ignored, as every stale event of a gone engine is."""
    w = world(tmp_path, "sleep_beside")
    try:
        first = w.serving()
        w.feed(GateProbe(first.generation, True, None))
        spare = w.spawned()
        w.feed(HealthResult(spare.generation, True))
        w.feed(GateProbe(spare.generation, True, None))
        assert w.fx.last("sleep") == {"pid": spare.pid}  # its sleep call under way
        reloaded_arguments(w, tmp_path, "sleep_beside", "v2")
        assert w.fx.last("take_down")["pid"] == spare.pid
        w.down(spare)
        assert w.fx.last("spawn")["generation"] > spare.generation  # the next standby
        w.feed(Slept(spare.generation, "POST /sleep?level=1: connection reset", 3.0))
        assert w.state == "RUNNING" and w.sup.engine is first
    finally:
        w.loop.close()


def test_a_standby_that_dies_while_it_waits_to_be_woken_is_one_failure(
        tmp_path: Path) -> None:
    """No room beside (vLLM's default share): the serving engine crashes, the sleeping
    standby takes over and waits for the old tree to be gone before its wake; it dies
    meanwhile (one GPU fault can end both): a crash, BACKOFF. The old engine's take-down
    then ends with its GPU memory not released: that must not fail the handover again."""
    w = world(tmp_path, "sleep_first")
    try:
        first, spare = crashed_beside_a_sleeping_standby(w)
        w.feed(Exited(spare.generation, 0))
        assert w.state == "BACKOFF"
        w.feed(Down(first.generation, None, "GPU memory still held by the old engine tree"))
        assert w.state in ("BACKOFF", "FATAL")
    finally:
        w.loop.close()


def test_a_standby_that_died_waiting_to_be_woken_is_not_woken(tmp_path: Path) -> None:
    """As above, the old engine's tree proven gone this time: nothing is woken (the
    standby that was to be woken is dead, its own take-down under way)."""
    w = world(tmp_path, "sleep_first")
    try:
        first, spare = crashed_beside_a_sleeping_standby(w)
        w.feed(Exited(spare.generation, 0))
        assert w.state == "BACKOFF"
        w.down(first)
        assert "wake" not in w.fx.names(), "a wake asked of the dead standby"
    finally:
        w.loop.close()


OLD_TREE_GONE = pytest.mark.parametrize("proven_gone", [False, True],
                                        ids=["old_tree_not_proven_gone", "old_tree_gone"])


def old_tree_ends(w: World, first: EngineProcess, proven_gone: bool) -> None:
    """The crashed engine's take-down ends: its tree proven gone, or its memory held."""
    if proven_gone:
        w.down(first)
    else:
        w.feed(Down(first.generation, None, "GPU memory still held by the old engine tree"))


@OLD_TREE_GONE
def test_a_restart_while_the_standby_waits_to_be_woken_ends_its_wake(
        tmp_path: Path, proven_gone: bool) -> None:
    """An operator's restart while the standby that took over waits for the old tree to
    be gone: the restart takes that standby down (a cold start follows); the old tree's
    end then wakes nothing and fails nothing."""
    w = world(tmp_path, "sleep_first")
    try:
        first, spare = crashed_beside_a_sleeping_standby(w)
        w.control("restart")
        assert w.state == "DRAINING" and w.fx.last("take_down")["pid"] == spare.pid
        old_tree_ends(w, first, proven_gone)
        assert "wake" not in w.fx.names(), "a wake asked of the engine being taken down"
        w.down(spare)
        assert w.state in ("STARTING", "FATAL")
    finally:
        w.loop.close()


@OLD_TREE_GONE
def test_a_stop_while_the_standby_waits_to_be_woken_ends_its_wake(
        tmp_path: Path, proven_gone: bool) -> None:
    """A stop while the standby that took over waits for the old tree to be gone: both
    are taken down, nothing is woken, and the stop ends STOPPED."""
    w = world(tmp_path, "sleep_first")
    try:
        first, spare = crashed_beside_a_sleeping_standby(w)
        stop = w.control("stop")
        assert w.state == "STOPPING" and w.fx.last("take_down")["pid"] == spare.pid
        old_tree_ends(w, first, proven_gone)
        assert "wake" not in w.fx.names(), "a wake asked of the engine being stopped"
        w.down(spare)
        assert w.state == "STOPPED" and stop.result()["state"] == "STOPPED"
    finally:
        w.loop.close()


def test_a_restart_while_the_first_standby_is_retired_waits_for_its_tree(
        tmp_path: Path) -> None:
    """No room beside: the standby starts first and the engine waits for it. The standby
    dies while it starts and is being taken down; without a restart the engine waits
    for that tree to be gone (its memory released) before it spawns. An operator's
    restart meanwhile must wait the same: two engines do not fit on the card."""
    w = world(tmp_path, "sleep_first")
    try:
        w.sup.start("test")
        spare = w.spawned()
        w.feed(CoreExited(spare.generation, spare.pid + 1))
        assert w.fx.last("take_down")["pid"] == spare.pid
        assert w.fx.names().count("spawn") == 1  # the engine waits for that tree
        w.control("restart")
        assert w.fx.names().count("spawn") == 1, "the engine spawned beside a live tree"
        w.down(spare)
        assert w.fx.names().count("spawn") == 2
    finally:
        w.loop.close()


def crashed_then_reloaded(w: World, tmp: Path) -> tuple[EngineProcess, EngineProcess]:
    """An awake standby is starting when the serving engine crashes (BACKOFF, a cold
    start); a reload then changes the engine's arguments. (the crashed one, the standby)"""
    first = w.serving()
    w.feed(GateProbe(first.generation, True, None))
    spare = w.spawned()  # the standby, starting
    w.feed(Exited(first.generation, 0))
    assert w.state == "BACKOFF"
    reloaded_arguments(w, tmp, "awake", "v2")
    return first, spare


def the_next_crash_fails_over(w: World, spare: EngineProcess, second: EngineProcess) -> None:
    """The standby started with the old arguments, if replaced, by one with the new
    (proven); then `second`, serving, crashes: a failover, not a cold start."""
    if w.fx.last("take_down")["pid"] == spare.pid:  # (replaced: the new one ready)
        w.down(spare)
        ready = w.spawned()
        assert "--revision" in ready.spec.argv
        w.feed(HealthResult(ready.generation, True))
        w.feed(GateProbe(ready.generation, True, None))
    w.feed(Exited(second.generation, 0))
    assert w.state == "RUNNING", "the next crash is a cold start, not a failover"


def test_a_standby_started_before_a_reload_during_a_backoff_is_replaced(
        tmp_path: Path) -> None:
    """The serving engine crashes while its awake standby is still starting: BACKOFF,
    a cold start. A reload changes the arguments meanwhile (no upgrade: nothing serves);
    the standby becomes ready with the old ones, and the cold start runs the new ones.
    The standby must be replaced by one with the new arguments, so that the next crash
    is a failover."""
    w = world(tmp_path, "awake")
    try:
        first, spare = crashed_then_reloaded(w, tmp_path)
        w.feed(HealthResult(spare.generation, True))
        w.feed(GateProbe(spare.generation, True, None))
        assert w.sup.status()["standby"]["state"] == "ready"  # with the old arguments
        w.down(first)
        w.last_timer_fires()
        second = w.serving()
        assert "--revision" in second.spec.argv
        w.feed(GateProbe(second.generation, True, None))
        the_next_crash_fails_over(w, spare, second)
    finally:
        w.loop.close()


def test_a_standby_ready_only_after_the_cold_start_that_follows_a_reload_is_replaced(
        tmp_path: Path) -> None:
    """As above, but the standby started with the old arguments is proven only once the
    cold start with the new ones serves: it must be replaced all the same."""
    w = world(tmp_path, "awake")
    try:
        first, spare = crashed_then_reloaded(w, tmp_path)
        w.down(first)
        w.last_timer_fires()
        second = w.serving()  # the cold start, with the new arguments
        assert "--revision" in second.spec.argv
        w.feed(GateProbe(second.generation, True, None))
        w.feed(HealthResult(spare.generation, True))  # only now the old standby is proven
        w.feed(GateProbe(spare.generation, True, None))
        the_next_crash_fails_over(w, spare, second)
    finally:
        w.loop.close()
