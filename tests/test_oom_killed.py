"""An engine that dies while the kernel's OOM killer runs is said to have died of the
host's memory (supervisor/watchdog/hostmem.py's `oom_kill` count, read at each look at the
engine's tree and again as its death is seen): on an H200 host two engine cores died
without a line of their own, most likely so (docs/gpu-validation.md, 2026-11-30), and
nothing told the operator why. Over the recording effects and the driven clock of
tests/test_supervisor_unit.py; the count read for real through the daemon in
tests/test_standby.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from supervisor.engine.events import CoreExited, Exited, TreeSeen
from supervisor.engine.process.process import EngineProcess
from supervisor.engine.views import exporter_view
from tests.pair_world import world
from tests.test_early_wake import armed
from tests.unit_world import World


def looked(w: World, engine: EngineProcess, oom_kills: int | None) -> None:
    w.feed(TreeSeen(engine.generation, (), w.now, 10**9, 1.0, None, None, oom_kills))


def audit(tmp: Path, event: str) -> list[dict[str, object]]:
    return [d for d in map(json.loads, (tmp / "events.jsonl").read_text().splitlines())
            if d.get("event") == event]


@pytest.mark.parametrize(("before", "after", "killed"), [
    (5, 6, True), (5, 5, False), (None, 6, None)])
def test_a_core_lost_while_the_oom_killer_ran_says_so(tmp_path: Path, before: int | None,
                                                        after: int, killed: bool | None) -> None:
    w = World(tmp_path)
    try:
        engine = w.serving()
        looked(w, engine, before)
        w.feed(CoreExited(engine.generation, engine.pid + 1, after))
        (core_exit,) = audit(tmp_path, "core_exit")
        assert core_exit.get("oom_killed") is killed
        said = "OOM killer ran as it died" in w.sup.status()["reason"]
        assert said is bool(killed), w.sup.status()["reason"]
        assert exporter_view(w.sup).oom_deaths == (1 if killed else 0)
    finally:
        w.loop.close()


def test_an_engine_that_exits_while_the_oom_killer_ran_says_so(tmp_path: Path) -> None:
    w = World(tmp_path)
    try:
        engine = w.serving()
        looked(w, engine, 11)
        w.feed(Exited(engine.generation, -9, 12))
        (exit_,) = audit(tmp_path, "exit")
        assert exit_["oom_killed"] is True and exit_["signal"] == "SIGKILL"
        assert "killed by SIGKILL (the kernel's OOM killer ran" in w.sup.status()["reason"]
    finally:
        w.loop.close()


def test_a_sleeping_standby_the_oom_killer_took_is_counted_too(tmp_path: Path) -> None:
    """The standby's bay reads its process as the serving bay does: its unasked death
    while the OOM killer ran is counted for the exporter (`engine_oom_deaths_total`)."""
    w = world(tmp_path, "sleep_first")
    try:
        first, spare = armed(w)
        looked(w, spare, 40)
        w.feed(Exited(spare.generation, -9, 41))
        assert audit(tmp_path, "exit")[-1]["oom_killed"] is True
        assert exporter_view(w.sup).oom_deaths == 1
        assert w.sup.engine is first and w.state == "RUNNING"  # (the engine serves on)
    finally:
        w.loop.close()
