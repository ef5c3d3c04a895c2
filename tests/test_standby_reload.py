"""The standby through reloads and re-arming, in one engine unit with recorded effects and
a driven clock (no process): a drain before a swap, a reload of the engine's arguments
as an upgrade through the standby (or none when nothing changes), a policy relaunch, a
standby outdated by a reload, `rearm` and the quiet window."""

from __future__ import annotations

import asyncio
import json
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from supervisor.engine.events import (
    Exited,
    GateProbe,
    HealthResult,
    Reloaded,
    Slept,
    Tick,
    TreeSeen,
    Woken,
)
from supervisor.settings.config import parse_config
from tests.standby_worlds import (
    SLEEP,
    armed_asleep,
    ready_standby,
    unprotected_after_a_crash,
)
from tests.unit_world import World


def test_a_drain_before_a_swap_keeps_the_engine_healthy_for_routers() -> None:
    """A restart that hands over to a ready standby waits about a second: a router
    keeps sending (the requests are held, then served); one without a standby is a cold
    start: a router should look elsewhere."""
    from supervisor.engine.gatekeeper import GateKeeper
    from supervisor.engine.states import State
    from supervisor.front.admission import Gate

    keeper = GateKeeper(Gate(), lambda *a, **k: None)
    keeper.sync(State.DRAINING, "operator restart", None, 0, swap=True)
    assert keeper.gate.unhealthy is None and keeper.gate.held_reason is not None
    keeper.sync(State.DRAINING, "operator restart", None, 0, swap=False)
    assert keeper.gate.unhealthy == "the engine is DRAINING: operator restart"


def test_a_reload_of_the_engines_arguments_is_an_upgrade_through_the_standby(
        tmp_path: Path) -> None:
    """A new vLLM or model revision in the config: the standby is replaced by one with the
    new arguments, proven, then swapped in (a drained restart that is a handover); no
    cold start, and afterwards both engines run the new arguments."""
    w = World(tmp_path, fronted=True, engine={"standby": "awake"})
    try:
        first = w.serving()
        w.feed(GateProbe(first.generation, True, None))
        spare = ready_standby(w)
        doc = {**w.doc, "engine": {**w.doc["engine"], "args": ["--revision", "v2"]}}
        reply: asyncio.Future[dict[str, Any]] = w.loop.create_future()
        w.feed(Reloaded(parse_config(doc, str(tmp_path / "config.toml"), tmp_path),
                        None, reply))
        assert list(reply.result()["next_engine_start"]) == ["engine.args"]
        assert w.fx.last("take_down") == {"pid": spare.pid, "graceful": True,
                                          "evidence": None}
        assert w.state == "RUNNING" and w.sup.engine is first  # the engine serves on
        w.down(spare)
        spawn = w.fx.last("spawn")
        assert spawn["bay"] == 1 and "--revision" in spawn["spec"].argv
        new = w.spawned()
        w.feed(HealthResult(new.generation, True))
        w.feed(GateProbe(new.generation, True, None))  # proven: the swap
        assert w.sup.engine is new and w.state == "RUNNING"
        assert w.fx.last("take_down") == {"pid": first.pid, "graceful": True,
                                          "evidence": None}
        assert w.sup.status()["last_decision"]["action"] == "failover"
        states = [json.loads(x)["to"] for x in
                  (tmp_path / "events.jsonl").read_text().splitlines() if '"state"' in x]
        assert states.count("STARTING") == 1  # the first start alone: no cold start
        w.feed(GateProbe(new.generation, True, None))
        w.down(first)
        assert "--revision" in w.fx.last("spawn")["spec"].argv  # the next standby too
        assert w.sup.restarts_by_reason == {"upgrade": 1}
    finally:
        w.loop.close()


def test_a_reload_that_changes_nothing_the_engine_runs_is_no_upgrade(tmp_path: Path) -> None:
    w = World(tmp_path, engine={"standby": "awake"})
    try:
        w.serving()
        ready_standby(w)
        doc = {**w.doc, "engine": {**w.doc["engine"], "stop_grace_s": 7.0}}
        reply: asyncio.Future[dict[str, Any]] = w.loop.create_future()
        w.feed(Reloaded(parse_config(doc, str(tmp_path / "config.toml"), tmp_path),
                        None, reply))
        assert "take_down" not in w.fx.names()
        assert w.sup.status()["standby"]["state"] == "ready"
    finally:
        w.loop.close()


def test_a_policy_relaunch_with_new_arguments_goes_through_the_standby(
        tmp_path: Path) -> None:
    """Fewer speculative tokens (the acceptance rule): with a standby, one is started with
    the new `--speculative-config`, proven, then swapped in; the engine serves meanwhile."""
    from supervisor.engine.intents import Restart

    spec = '{"method": "ngram", "num_speculative_tokens": 3}'
    w = World(tmp_path, fronted=True, engine={
        "standby": "awake", "args": ["--speculative-config", spec]})
    try:
        first = w.serving()
        w.feed(GateProbe(first.generation, True, None))
        spare = ready_standby(w)
        w.sup.watch.tuning.spec_tokens = 2  # (what the rule's decision sets)
        w.sup.carry_out([Restart("acceptance 0.21 < 0.4: fewer speculative tokens",
                                          rung="fewer_spec_tokens")])
        assert w.state == "RUNNING" and w.sup.engine is first  # no drain yet: it serves
        w.down(spare)  # the old standby, out of date, is gone
        argv = w.fx.last("spawn")["spec"].argv
        chosen = json.loads(argv[argv.index("--speculative-config") + 1])
        assert chosen["num_speculative_tokens"] == 2
        new = w.spawned()
        w.feed(HealthResult(new.generation, True))
        w.feed(GateProbe(new.generation, True, None))
        assert w.sup.engine is new and w.sup.restarts_by_reason == {"policy": 1}
        w.feed(GateProbe(new.generation, True, None))  # serving: its first generation
        audit = [json.loads(x) for x in (tmp_path / "events.jsonl").read_text().splitlines()]
        states = [e["to"] for e in audit if e["event"] == "state"]
        assert states.count("STARTING") == 1  # no cold start
        # the remedy's steps: the standby's start (the engine serving), then the swap's
        # drain and handover; not a drain as long as the standby's start
        rem = next(e for e in audit if e["event"] == "remedy")
        assert rem["rung"] == "fewer_spec_tokens" and rem["outcome"] == "ok"
        assert list(rem["steps_s"]) == ["standby", "drain", "take_down", "start"]
        assert rem["duration_s"] == pytest.approx(sum(rem["steps_s"].values()), abs=0.01)
    finally:
        w.loop.close()


def test_a_sleeping_standby_without_room_is_taken_down_when_a_reload_outdates_it(
        tmp_path: Path) -> None:
    """No room beside: a reload of the arguments begins no upgrade (no standby can start
    beside the engine), and the sleeping standby runs the old ones: it could never take
    over (a failover runs what a start would), so it is taken down at its next event,
    and none starts until the next cold start (`no_room`), instead of a `ready` that
    cannot serve."""
    w = World(tmp_path, fronted=True, engine={**SLEEP, "args": ["--enable-sleep-mode"]})
    try:
        first, spare = armed_asleep(w, side_by_side=False)
        spawns = w.fx.names().count("spawn")
        doc = {**w.doc, "engine": {**w.doc["engine"],
                                   "args": ["--enable-sleep-mode", "--revision", "v2"]}}
        reply: asyncio.Future[dict[str, Any]] = w.loop.create_future()
        w.feed(Reloaded(parse_config(doc, str(tmp_path / "config.toml"), tmp_path),
                        None, reply))
        assert w.state == "RUNNING" and w.sup.engine is first  # the engine serves on
        w.feed(TreeSeen(spare.generation, (), w.now, 0, 0.0))  # its next look
        assert w.fx.last("take_down") == {"pid": spare.pid, "graceful": True,
                                          "evidence": None}
        w.down(spare)
        assert w.sup.status()["standby"]["state"] == "no_room"
        assert w.fx.names().count("spawn") == spawns and w.sup.engine is first  # none since
    finally:
        w.loop.close()


def test_rearm_is_a_drained_restart_standby_first_when_none_fits_and_refused_when_armed(
        tmp_path: Path) -> None:
    w = World(tmp_path, fronted=True, engine={**SLEEP, "args": ["--enable-sleep-mode"]})
    try:
        w.now += 5
        serving = unprotected_after_a_crash(w)
        assert w.sup.status()["standby"]["unprotected_for_s"] == 0
        w.now += 30
        assert w.sup.status()["standby"]["unprotected_for_s"] == 30
        reply = w.control("rearm")
        assert reply.result()["rearm"].startswith("drained restart: the standby starts first")
        assert w.state == "DRAINING"  # (nothing in flight: taken down at once)
        assert w.fx.last("take_down") == {"pid": serving.pid, "graceful": True,
                                          "evidence": None}
        assert w.sup.status()["last_decision"]["reason"] == "re-arm: requested by operator"
        w.down(serving)
        assert w.state == "STARTING" and w.fx.last("spawn")["bay"] == 0  # the standby's
        spare = w.spawned()
        w.feed(HealthResult(spare.generation, True))
        w.feed(GateProbe(spare.generation, True, None))
        w.feed(Slept(spare.generation, None, 0.2))
        first = w.serving()  # the engine, beside it
        w.feed(GateProbe(first.generation, True, None))
        st = w.sup.status()["standby"]
        assert st["protected"] is True and st["unprotected_for_s"] is None
        refused = w.control("rearm")
        assert "rearm refused: already protected" in str(refused.exception())
        assert w.sup.restarts_by_reason.get("rearm") == 1
    finally:
        w.loop.close()


def test_rearm_is_refused_without_a_standby(tmp_path: Path) -> None:
    w = World(tmp_path, fronted=True)
    try:
        first = w.serving()
        w.feed(GateProbe(first.generation, True, None))
        refused = w.control("rearm")
        assert "no standby is configured" in str(refused.exception())
        assert w.state == "RUNNING"
    finally:
        w.loop.close()


def test_the_quiet_window_rearms_once_a_window(tmp_path: Path) -> None:
    now = datetime.fromtimestamp(1000.0)  # (the world's clock, in local time)
    window = f"{(now - timedelta(minutes=5)):%H:%M}-{(now + timedelta(hours=1)):%H:%M}"
    w = World(tmp_path, fronted=True, engine={**SLEEP, "args": ["--enable-sleep-mode"],
                                              "rearm_window": window})
    try:
        w.feed(Tick())  # (armed: nothing to do)
        serving = unprotected_after_a_crash(w)
        w.feed(Tick())
        assert w.state == "DRAINING"
        assert w.sup.status()["last_decision"]["reason"] == \
            f"re-arm: the quiet window {window}"
        w.down(serving)
        spare = w.spawned()
        w.feed(HealthResult(spare.generation, True))
        w.feed(GateProbe(spare.generation, True, None))
        w.feed(Slept(spare.generation, None, 0.2))
        first = w.serving()
        w.feed(GateProbe(first.generation, True, None))
        # unprotected again in the same window: not re-armed twice in one window
        w.feed(Exited(first.generation, 0))
        w.down(first)
        w.feed(Woken(spare.generation, None, 0.6))
        w.feed(GateProbe(spare.generation, True, None))
        assert w.sup.status()["standby"]["state"] == "no_room"
        w.feed(Tick())
        assert w.state == "RUNNING" and w.sup.restarts_by_reason.get("rearm") == 1
        w.now += 86400  # the next day's window
        w.feed(Tick())
        assert w.state == "DRAINING" and w.sup.restarts_by_reason.get("rearm") == 2
    finally:
        w.loop.close()
