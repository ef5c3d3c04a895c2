"""The one reading of a process's life (`EngineSlot.on`, supervisor/engine/pair/outcomes.py),
row by row of its table, the same for every bay: the serving engine's, the standby's and
the weight cache's. The roles' reactions to each outcome are tested where they live
(test_supervisor_unit, test_standby_unit, test_weight_cache_unit)."""

from __future__ import annotations

import itertools
from collections import deque
from typing import Any

import pytest

from supervisor.engine import steps as do
from supervisor.engine.events import CoreExited, Down, Exited, HealthResult, Spawned, TreeSeen
from supervisor.engine.pair import outcomes as out
from supervisor.engine.pair.pair_states import Bay
from supervisor.engine.pair.slot import EngineSlot
from supervisor.engine.process.process import EngineProcess, build_spawn_spec
from supervisor.engine.process.takedown import TakeDown
from supervisor.settings.config import parse_config
from supervisor.watchdog.devroutes import DevRoutes

WHATS = ["engine", "weight cache"]


def slot(what: str) -> tuple[EngineSlot, list[tuple[str, dict[str, Any]]]]:
    audits: list[tuple[str, dict[str, Any]]] = []
    gens = itertools.count(1)
    s = EngineSlot(lambda name, **f: audits.append((name, f)),
                   lambda: next(gens), bay=1, what=what)
    return s, audits


def spawn(s: EngineSlot) -> EngineProcess:
    cfg = parse_config({"engine": {"command": ["vllm", "serve", "m"], "port": 18000}}).engine
    spec = s.spawn(build_spawn_spec(cfg, {}))
    return EngineProcess(generation=s.generation, proc=None,  # type: ignore[arg-type]
                         pid=4242, started_at=0.0, spec=spec, config=cfg,
                         recent_errors=deque(maxlen=5))


def up(what: str) -> tuple[EngineSlot, EngineProcess, list[tuple[str, dict[str, Any]]]]:
    s, audits = slot(what)
    e = spawn(s)
    assert s.on(Spawned(e.generation, e), 1.0) == out.Up(e)
    assert do.lifecycle(out.Up(e)) == [do.WatchProcess(e)]  # (watched once up)
    assert s.phase is Bay.STARTING and s.engine is e
    return s, e, audits


@pytest.mark.parametrize("what", WHATS)
def test_a_spawn_ends_up_or_failed(what: str) -> None:
    s, audits = slot(what)
    e = spawn(s)
    failed = s.on(Spawned(e.generation, None, "no such file", gpu_busy=True), 1.0)
    assert failed == out.SpawnFailed("no such file", True)
    assert s.phase is Bay.EMPTY and s.engine is None
    assert audits[-1][0].endswith("spawn_failed") and do.lifecycle(failed) == []  # unwatched
    s2, e2, _ = up(what)
    assert s2.engine is e2


@pytest.mark.parametrize("what", WHATS)
def test_health_counts_only_while_awaited_and_not_taken_down(what: str) -> None:
    s, e, _ = up(what)
    assert s.on(HealthResult(e.generation, True), 5.0, awaits_health=False) is out.NOTHING
    assert e.healthy_at is None and s.phase is Bay.STARTING
    assert s.on(HealthResult(e.generation + 99, True), 5.0) is out.NOTHING  # stale
    assert s.on(HealthResult(e.generation, True), 5.0) == out.Healthy(e)
    assert e.healthy_at == 5.0 and s.phase is Bay.HEALTHY

    s, e, _ = up(what)
    timed = s.on(HealthResult(e.generation, False), 5.0)
    assert timed == out.Unhealthy(e, "not healthy within 600 s", timed_out=True)
    given_up = s.on(HealthResult(e.generation, False, None, "its core failed to start"), 5.0)
    assert given_up == out.Unhealthy(e, "its core failed to start", timed_out=False)
    e.exit_code = 1  # (its exit says why)
    assert s.on(HealthResult(e.generation, False), 5.0) is out.NOTHING

    s, e, _ = up(what)
    s.take_down(True, None)
    assert s.on(HealthResult(e.generation, True), 5.0) is out.NOTHING


@pytest.mark.parametrize("what", WHATS)
def test_an_exit_is_a_death_only_when_nobody_asked_for_it(what: str) -> None:
    s, e, audits = up(what)
    died = s.on(Exited(e.generation, -9), 5.0)
    assert died == out.Died(e, "killed by SIGKILL without being asked", core=False)
    assert audits[-1][1]["asked"] is False
    assert s.phase is Bay.EXITED  # (its tree still to be taken down and reaped)
    s.take_down(False, None)
    assert s.phase is Bay.TAKING_DOWN

    s, e, audits = up(what)
    assert s.on(Exited(e.generation, 0), 5.0, exit_expected=True) is out.NOTHING
    assert audits[-1][1]["asked"] is True

    s, e, audits = up(what)
    s.take_down(True, None)
    assert s.on(Exited(e.generation, 0), 5.0) is out.NOTHING
    assert s.phase is Bay.TAKING_DOWN  # (the take-down's own exit: it goes on)
    assert s.on(Exited(e.generation + 99, 0), 5.0) is out.NOTHING  # stale


@pytest.mark.parametrize("what", WHATS)
def test_a_core_death_is_news_once_and_only_unasked(what: str) -> None:
    s, e, _ = up(what)
    died = s.on(CoreExited(e.generation, 4300), 5.0)
    assert isinstance(died, out.Died) and died.core and died.engine is e
    assert e.core_lost == 4300
    s, e, _ = up(what)
    assert s.on(CoreExited(e.generation, 4300), 5.0, exit_expected=True) is out.NOTHING
    s, e, _ = up(what)
    s.on(Exited(e.generation, 1), 5.0)
    assert s.on(CoreExited(e.generation, 4300), 5.0) is out.NOTHING  # after its own exit


@pytest.mark.parametrize("what", WHATS)
def test_a_tree_seen_and_a_take_down_ended(what: str) -> None:
    s, e, _ = up(what)
    tree = TreeSeen(e.generation, at=10.0, procs=(), rss_bytes=2**30, cpu_s=1.0)
    seen = s.on(tree, 10.0)
    assert seen == out.Seen(e, tree, None)  # (the CPU: known from the second look)
    seen = s.on(TreeSeen(e.generation, at=12.0, procs=(), rss_bytes=2**30, cpu_s=2.0), 12.0)
    assert isinstance(seen, out.Seen) and seen.cpu_percent == 50.0
    stale = TreeSeen(e.generation + 99, procs=(), at=12.0, rss_bytes=0, cpu_s=0.0)
    assert s.on(stale, 12.0) is out.NOTHING

    s.take_down(False, None)
    result = TakeDown(exit_code=-9, survivors=[], gpu_holders={}, port_problem=None,
                      duration_s=0.5, sigkilled=True)
    assert s.on(Down(e.generation, result), 13.0) == out.Gone(e, None)
    assert s.phase is Bay.EMPTY and s.engine is None
    assert do.lifecycle(out.Gone(e, None)) == [do.Forget(e)]  # (state file, guard dropped)

    s, e, _ = up(what)
    s.take_down(False, None)
    held = TakeDown(exit_code=-9, survivors=[], gpu_holders={4243: 2**30}, port_problem=None,
                    duration_s=0.5, sigkilled=True)
    gone = s.on(Down(e.generation, held), 13.0)
    assert isinstance(gone, out.Gone) and gone.problem is not None
    assert "GPU memory still held" in gone.problem and "pid 4243 (1024 MiB)" in gone.problem
    assert do.lifecycle(gone) == []  # (kept: the next start's leftover check finds it)


def test_only_an_engines_bay_keeps_the_development_routes_it_was_found_serving() -> None:
    """A weight cache is no engine: its health check's routes are not noted on it (no
    `dev_routes` audit), an engine's are."""
    routes = DevRoutes(served={"/sleep": True, "/wake_up": True})
    for what, kept in (("engine", True), ("weight cache", False)):
        s, e, audits = up(what)
        assert s.on(HealthResult(e.generation, True, routes), 5.0) == out.Healthy(e)
        assert (e.routes is routes) is kept
        assert any(name == "dev_routes" for name, _ in audits) is kept
