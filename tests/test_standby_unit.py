"""The standby's lifecycle in one engine unit, with recorded effects and a driven clock
(no process): armed beside the serving engine or before it, awake or asleep, the
failover (a wake first when asleep), a failed wake, a standby that fails."""

from __future__ import annotations

import asyncio
import json
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from supervisor.engine.events import (
    CoreExited,
    Down,
    Drained,
    Exited,
    GateProbe,
    HealthResult,
    Reloaded,
    Slept,
    Spawned,
    Tick,
    TreeSeen,
    Woken,
)
from supervisor.engine.process.process import EngineProcess
from supervisor.engine.process.takedown import TakeDown
from supervisor.settings.config import parse_config
from tests.test_supervisor_unit import World

SLEEP = {"standby": "sleep", "env": {"VLLM_SERVER_DEV_MODE": "1"}}


def ready_standby(w: World) -> EngineProcess:
    """The standby spawned, healthy and proven by its first generation: ready."""
    spare = w.spawned()
    w.feed(HealthResult(spare.generation, True))
    w.feed(GateProbe(spare.generation, True, None))
    return spare


def test_a_standby_is_proven_then_takes_over_a_crash_and_a_restart_without_a_cold_start(
        tmp_path: Path) -> None:
    """`standby = "awake"`: started beside the engine once it serves, proven with a
    generation, then the serving engine's crash is a failover (the proxy follows the
    standby, which is proven again before held requests go; the old tree is taken down
    in the standby's place, and a new standby starts there once it is gone); an
    operator's restart is a swap too. No cold start anywhere."""
    w = World(tmp_path, fronted=True, engine={"standby": "awake"})
    try:
        gate = w.sup.gate
        first = w.serving()
        w.feed(GateProbe(first.generation, True, None))
        spawn = w.fx.last("spawn")
        assert spawn["bay"] == 1 and spawn["spec"].port == 18101  # port + 1
        assert w.sup.status()["standby"]["state"] == "starting"
        spare = w.spawned()
        w.feed(HealthResult(spare.generation, True))
        assert w.fx.last("gate_probe") == {"pid": spare.pid}
        assert w.sup.status()["standby"]["state"] == "proving"
        w.feed(GateProbe(spare.generation, True, None))
        assert w.sup.status()["standby"]["state"] == "ready"
        spawns = w.fx.names().count("spawn")

        # the serving engine crashes: the standby serves at once
        w.now += 5
        w.feed(Exited(first.generation, 0))
        assert w.state == "RUNNING" and w.sup.engine is spare
        assert w.fx.last("follow") == {"pid": spare.pid}
        assert w.fx.last("serve") == {"pid": spare.pid}
        assert w.fx.last("take_down") == {"pid": first.pid, "graceful": False, "evidence": None}
        assert gate.held_reason is not None  # until the new engine answered a generation
        w.feed(GateProbe(spare.generation, True, None))
        assert gate.held_reason is None
        st = w.sup.status()
        assert st["restarts"] == 1 and st["last_decision"]["action"] == "failover"
        assert st["standby"]["state"] == "retiring" and st["pid"] == spare.pid
        assert w.fx.names().count("spawn") == spawns  # no cold start
        w.down(first)  # the old tree gone: a new standby in its place
        spawn = w.fx.last("spawn")
        assert spawn["bay"] == 0 and spawn["spec"].port == 18100
        third = w.spawned()
        w.feed(HealthResult(third.generation, True))
        w.feed(GateProbe(third.generation, True, None))
        assert w.sup.status()["standby"]["state"] == "ready"

        # an operator's restart with nothing in flight: a swap (a router need not look
        # elsewhere meanwhile)
        assert gate.unhealthy is None
        reply = w.control("restart")
        assert reply.result()["state"] == "RUNNING" and w.sup.engine is third
        assert w.fx.last("take_down") == {"pid": spare.pid, "graceful": True, "evidence": None}
        assert w.sup.status()["restarts"] == 2
        w.feed(Exited(spare.generation, 0))  # asked for: no failover, no crash
        assert w.state == "RUNNING" and w.sup.engine is third
        w.down(spare)
        assert w.fx.last("spawn")["bay"] == 0  # not while the handover is under way
        w.feed(GateProbe(third.generation, True, None))  # it is over: a new standby
        assert w.fx.last("spawn")["bay"] == 1

        # stop: both places emptied, then STOPPED
        fourth = w.spawned()
        stop = w.control("stop")
        downs = {d["pid"]: d["graceful"] for n, d in w.fx.calls if n == "take_down"}
        assert w.state == "STOPPING"
        # the serving engine drains; the standby, still starting, has nothing to finish
        assert downs[third.pid] is True and downs[fourth.pid] is False
        w.down(third)
        assert w.state == "STOPPING"
        w.down(fourth)
        assert w.state == "STOPPED" and stop.result()["state"] == "STOPPED"
    finally:
        w.loop.close()


def test_a_restart_with_requests_in_flight_swaps_at_once_and_the_old_engine_finishes_them(
        tmp_path: Path) -> None:
    """`drain = "finish"` with an awake standby ready: the restart does not hold new
    requests while the old engine's finish; the standby serves at once (after its
    generation), the old engine keeps the requests it has until they end (the proxy's
    count of them, bounded by its drain timeout), and only then is taken down."""
    w = World(tmp_path, fronted=True, engine={"standby": "awake", "drain": "finish"})
    try:
        gate = w.sup.gate
        first = w.serving()
        w.feed(GateProbe(first.generation, True, None))
        spare = ready_standby(w)
        ticket = asyncio.run(gate.acquire(1))  # a stream at the serving engine
        w.control("restart")
        assert w.state == "RUNNING" and w.sup.engine is spare
        assert w.fx.last("follow") == {"pid": spare.pid}
        assert "drain" not in w.fx.names()  # nothing holds new requests behind the old
        assert w.fx.last("drain_behind") == {"pid": first.pid}
        assert "take_down" not in w.fx.names()  # the old engine keeps its stream
        w.feed(GateProbe(spare.generation, True, None))
        assert gate.held_reason is None  # new requests go to the standby now
        st = w.sup.status()
        assert st["last_decision"]["action"] == "failover" and st["restarts"] == 1
        gate.done(ticket)
        w.feed(Drained(first.generation, True, 2.5))  # its stream ended there
        assert w.fx.last("take_down") == {"pid": first.pid, "graceful": True, "evidence": None}
        w.feed(Drained(first.generation, True, 2.5))  # (a late repeat: nothing more)
        assert w.fx.names().count("take_down") == 1
        w.down(first)
        assert w.fx.last("spawn")["bay"] == 0  # a new standby in the old one's place
    finally:
        w.loop.close()


def test_the_old_engine_dying_while_it_finishes_behind_a_swap_is_no_standby_failure(
        tmp_path: Path) -> None:
    """The old engine crashes while the requests it had finish there behind a swap (the
    proxy continues them on the new one): its tree is taken down at once, and the next
    standby starts as soon as it is gone, with no backoff and no failure counted."""
    w = World(tmp_path, fronted=True, engine={"standby": "awake", "drain": "finish"})
    try:
        first = w.serving()
        w.feed(GateProbe(first.generation, True, None))
        spare = ready_standby(w)
        ticket = asyncio.run(w.sup.gate.acquire(1))
        w.control("restart")
        assert w.fx.last("drain_behind") == {"pid": first.pid}
        w.feed(GateProbe(spare.generation, True, None))  # the new one serves
        w.feed(Exited(first.generation, -9))  # the old one dies with its stream
        assert w.fx.last("take_down") == {"pid": first.pid, "graceful": False,
                                          "evidence": None}
        st = w.sup.status()
        assert st["standby"]["state"] == "retiring" and w.sup.handover.standby.failures == 0
        assert w.state == "RUNNING" and w.sup.engine is spare  # the new one serves on
        w.sup.gate.done(ticket)
        w.feed(Drained(first.generation, True, 0.5))  # (its drain job ends: nothing more)
        assert w.fx.names().count("take_down") == 1
        w.down(first)
        assert w.fx.last("spawn")["bay"] == 0  # the next standby at once, no backoff
        assert not any(t.event.__class__.__name__ == "StandbyDue" for t in w.fx.timers)
    finally:
        w.loop.close()


def test_a_standby_out_of_date_after_a_reload_is_replaced_not_swapped_in(
        tmp_path: Path) -> None:
    w = World(tmp_path, engine={"standby": "awake"})
    try:
        first = w.serving()
        spare = ready_standby(w)
        assert w.sup.status()["standby"]["state"] == "ready"
        doc = {**w.doc, "engine": {**w.doc["engine"], "args": ["--max-num-seqs", "8"]}}
        new = parse_config(doc, str(tmp_path / "config.toml"), tmp_path)
        reply: asyncio.Future[dict[str, Any]] = w.loop.create_future()
        w.feed(Reloaded(new, None, reply))
        w.control("restart")
        assert w.state == "DRAINING"  # a cold restart: the standby has the old arguments
        downs = {d["pid"] for n, d in w.fx.calls if n == "take_down"}
        assert downs == {first.pid, spare.pid}
        w.down(first)
        assert "--max-num-seqs" in w.fx.last("spawn")["spec"].argv
        assert w.fx.last("spawn")["bay"] == 0
    finally:
        w.loop.close()


def test_a_standby_that_fails_is_started_again_after_a_growing_backoff(
        tmp_path: Path) -> None:
    w = World(tmp_path, engine={"standby": "awake"})
    try:
        w.serving()
        delays = []
        for _ in range(2):  # it cannot be started: backoff_initial_s, then twice that
            spawn = w.fx.last("spawn")
            assert spawn["bay"] == 1
            w.feed(Spawned(spawn["generation"], None, "port in use"))
            st = w.sup.status()["standby"]
            assert st["state"] == "waiting" and "port in use" in st["reason"]
            timer = w.fx.timers[-1]
            delays.append(timer.delay_s)
            w.now += timer.delay_s
            w.feed(timer.event)
        assert delays == [pytest.approx(1.0), pytest.approx(2.0)]
        spare = w.spawned()  # started again; this time it serves, then dies unasked
        w.feed(HealthResult(spare.generation, True))
        w.feed(GateProbe(spare.generation, True, None))
        assert w.sup.status()["standby"]["state"] == "ready"
        w.feed(Exited(spare.generation, 1))
        assert w.sup.status()["standby"]["state"] == "retiring"
        assert w.fx.last("take_down") == {"pid": spare.pid, "graceful": False,
                                          "evidence": None}
        assert w.state == "RUNNING"  # the serving engine is not touched
        w.down(spare)
        assert w.sup.status()["standby"]["state"] == "waiting"
        assert w.fx.timers[-1].delay_s == pytest.approx(1.0)  # a new streak
    finally:
        w.loop.close()


def test_a_standby_whose_core_failed_to_start_is_taken_down_with_what_it_said(
        tmp_path: Path) -> None:
    """A standby's start given up before its timeout (its core said it failed, and it did
    not exit: `process.start_given_up`) fails with that reason, its tree taken down."""
    w = World(tmp_path, engine={"standby": "awake"})
    try:
        w.serving()
        spare = w.spawned()
        why = "its core failed to start ('EngineCore failed to start.') and ..."
        w.feed(HealthResult(spare.generation, False, None, why))
        st = w.sup.status()["standby"]
        assert st["state"] == "retiring" and why in st["reason"]
        assert w.fx.last("take_down")["pid"] == spare.pid
        assert w.state == "RUNNING"  # the serving engine is not touched
    finally:
        w.loop.close()


def test_a_standby_retired_while_it_spawns_is_taken_down_once_it_exists(
        tmp_path: Path) -> None:
    """The engine given up on (its tree not proven gone) while its standby is being
    spawned: the standby is taken down as soon as it exists, not left idle."""
    w = World(tmp_path, engine={"standby": "awake"})
    try:
        engine = w.serving()
        assert w.fx.last("spawn")["bay"] == 1  # the standby, spawning
        w.control("restart")
        w.feed(Down(engine.generation, None, "take-down failed: boom"))
        assert w.state == "FATAL" and w.sup.status()["standby"]["state"] == "retiring"
        spare = w.spawned()
        assert w.fx.last("take_down") == {"pid": spare.pid, "graceful": True,
                                          "evidence": None}
        w.down(spare)
        assert w.sup.status()["standby"]["state"] == "none" and w.state == "FATAL"
    finally:
        w.loop.close()


def armed_asleep(w: World, side_by_side: bool) -> tuple[Any, Any]:
    """The serving engine and its standby, proven and asleep. Side by side: the engine
    first, the standby beside it once it serves; else the standby first, asleep, then
    the engine beside it."""
    if side_by_side:
        first = w.serving()
        w.feed(GateProbe(first.generation, True, None))
        assert w.fx.last("spawn")["bay"] == 1
        spare = w.spawned()
    else:
        w.sup.start("test")
        assert w.fx.last("spawn")["bay"] == 1 and w.state == "STARTING"
        spare = w.spawned()
        assert w.fx.names().count("spawn") == 1  # the engine waits for it
    w.feed(HealthResult(spare.generation, True))
    assert w.fx.last("gate_probe") == {"pid": spare.pid}
    w.feed(GateProbe(spare.generation, True, None))
    assert w.sup.status()["standby"]["state"] == "sleeping"
    assert w.fx.last("sleep") == {"pid": spare.pid}
    w.feed(Slept(spare.generation, None, 0.2))
    st = w.sup.status()["standby"]
    assert st["state"] == "ready" and st["asleep"] is True and st["mode"] == "sleep"
    if not side_by_side:
        assert w.fx.last("spawn")["bay"] == 0  # now the engine, beside the sleeping one
        first = w.serving()
        w.feed(GateProbe(first.generation, True, None))
    assert "serve" not in [n for n, d in w.fx.calls if d.get("pid") == spare.pid]
    return first, spare


def test_a_sleeping_standby_beside_the_engine_is_woken_then_proven_on_a_crash(
        tmp_path: Path) -> None:
    """Room for both (0.45 of the card each): the standby starts beside the serving
    engine, is proven, put to sleep; on the crash it is woken at once, and nothing
    reaches it (route, metrics, canary) before it is awake; held requests go once it
    answered a generation; then a new standby in the old place."""
    w = World(tmp_path, fronted=True, engine={
        **SLEEP, "args": ["--enable-sleep-mode", "--gpu-memory-utilization", "0.45"]})
    try:
        gate = w.sup.gate
        first, spare = armed_asleep(w, side_by_side=True)
        w.now += 5
        w.feed(Exited(first.generation, 0))
        assert w.state == "RUNNING" and w.sup.engine is spare
        assert w.fx.last("wake") == {"pid": spare.pid}
        assert w.fx.last("follow") != {"pid": spare.pid}  # asleep: not routed to
        assert gate.held_reason is not None
        w.now += 0.6
        w.feed(Woken(spare.generation, None, 0.6))
        assert w.fx.last("follow") == {"pid": spare.pid}
        assert w.fx.last("serve") == {"pid": spare.pid}
        assert w.fx.last("gate_probe") == {"pid": spare.pid} and gate.held_reason is not None
        w.feed(GateProbe(spare.generation, True, None))
        assert gate.held_reason is None
        st = w.sup.status()
        assert st["standby"]["state"] == "retiring" and st["last_decision"]["action"] == "failover"
        w.down(first)  # the old tree gone: a new standby in its place, to sleep too
        assert w.fx.last("spawn")["bay"] == 0
        events = [json.loads(x)["event"] for x in
                  (tmp_path / "events.jsonl").read_text().splitlines()]
        assert events.index("failover") < events.index("standby_woken") \
            < events.index("failover_done")
    finally:
        w.loop.close()


def crash_then_wake(w: World, first: Any, spare: Any) -> None:
    """On a full card: the serving engine crashes, the sleeping standby takes its place
    but is woken only once the old engine's tree (and its memory) is gone; proven, it
    serves and the gate opens."""
    w.feed(Exited(first.generation, 0))
    assert w.sup.engine is spare and "wake" not in w.fx.names()
    w.down(first)  # the old engine's memory released: now the wake
    assert w.fx.last("wake") == {"pid": spare.pid}
    w.feed(Woken(spare.generation, None, 0.6))
    w.feed(GateProbe(spare.generation, True, None))
    assert w.sup.gate.held_reason is None


def test_a_standby_without_room_beside_starts_first_and_wakes_once_the_old_is_gone(
        tmp_path: Path) -> None:
    """vLLM's default share (0.9): two engines do not fit side by side. The standby
    starts first and sleeps, the engine starts beside it; on a crash the wake waits until
    the old engine's tree (and its GPU memory) is gone; afterwards no standby can start
    beside the one serving: none until the next cold start, which begins with one."""
    w = World(tmp_path, fronted=True, engine={**SLEEP, "args": ["--enable-sleep-mode"]})
    try:
        first, spare = armed_asleep(w, side_by_side=False)
        crash_then_wake(w, first, spare)
        st = w.sup.status()["standby"]
        assert st["state"] == "no_room" and "0.9" in st["reason"]
        spawns = w.fx.names().count("spawn")
        # the next crash is a cold start, which arms a standby first again
        w.feed(Exited(spare.generation, 0))
        assert w.state == "BACKOFF"
        w.down(spare)
        w.last_timer_fires()  # (the backoff's)
        assert w.state == "STARTING" and w.fx.names().count("spawn") == spawns + 1
        assert w.fx.last("spawn")["bay"] == 0  # (the places swapped): the standby's now
        assert w.sup.status()["standby"]["state"] == "starting"
    finally:
        w.loop.close()


def test_a_restart_to_a_sleeping_standby_without_room_kills_the_drained_engine(
        tmp_path: Path) -> None:
    """A planned swap on a full card: once the old engine is drained (its streams
    paused for continuation), every client waits for its memory, so it is killed, not
    waited for through vLLM's graceful exit; the standby wakes once its tree is gone."""
    w = World(tmp_path, fronted=True, engine={**SLEEP, "args": ["--enable-sleep-mode"],
                                              "drain": "continue"})
    try:
        first, spare = armed_asleep(w, side_by_side=False)
        ticket = asyncio.run(w.sup.gate.acquire(1))  # a request at the serving engine
        w.control("restart")
        assert w.state == "DRAINING" and w.fx.last("drain") == {"pid": first.pid}
        w.sup.gate.done(ticket)
        w.feed(Drained(first.generation, True, 0.4))
        assert w.sup.engine is spare and "wake" not in w.fx.names()
        assert w.fx.last("take_down") == {"pid": first.pid, "graceful": False,
                                          "evidence": None}
        w.down(first)
        assert w.fx.last("wake") == {"pid": spare.pid}
        w.feed(Woken(spare.generation, None, 0.5))
        w.feed(GateProbe(spare.generation, True, None))
        assert w.state == "RUNNING" and w.sup.gate.held_reason is None
    finally:
        w.loop.close()


def test_a_standby_that_does_not_wake_is_taken_down_for_a_cold_start(
        tmp_path: Path) -> None:
    w = World(tmp_path, fronted=True, engine={
        **SLEEP, "args": ["--enable-sleep-mode", "--gpu-memory-utilization", "0.45"]})
    try:
        first, spare = armed_asleep(w, side_by_side=True)
        w.feed(Exited(first.generation, 0))
        w.feed(Woken(spare.generation, "POST /wake_up: HTTP 500: CUDA out of memory", 0.1))
        assert w.state == "BACKOFF" and "did not wake" in w.sup.state_reason
        downs = {d["pid"] for n, d in w.fx.calls if n == "take_down"}
        assert downs == {first.pid, spare.pid}
        assert "follow" not in [n for n, d in w.fx.calls if d.get("pid") == spare.pid]
        failed = [json.loads(x) for x in (tmp_path / "events.jsonl").read_text().splitlines()
                  if '"failover_failed"' in x]
        assert failed and "CUDA out of memory" in failed[0]["reason"]
    finally:
        w.loop.close()


def test_a_woken_standby_that_fails_its_generation_is_not_served_from(
        tmp_path: Path) -> None:
    """A wake can leave a broken engine (vllm#41563): held requests stay held, and the
    engine is taken down for a cold start."""
    w = World(tmp_path, fronted=True, engine={
        **SLEEP, "args": ["--enable-sleep-mode", "--gpu-memory-utilization", "0.45"]})
    try:
        first, spare = armed_asleep(w, side_by_side=True)
        w.feed(Exited(first.generation, 0))
        w.feed(Woken(spare.generation, None, 0.5))
        w.feed(GateProbe(spare.generation, False, "timed out after 5 s"))
        assert w.state == "BACKOFF" and w.sup.gate.held_reason is not None
        assert "after waking failed" in w.sup.state_reason
    finally:
        w.loop.close()


def test_a_standby_that_cannot_sleep_is_retried_after_a_backoff(tmp_path: Path) -> None:
    w = World(tmp_path, engine={
        **SLEEP, "args": ["--enable-sleep-mode", "--gpu-memory-utilization", "0.45"]})
    try:
        w.serving()
        spare = ready_standby(w)
        w.feed(Slept(spare.generation, "POST /sleep?level=1: HTTP 404", 0.01))
        st = w.sup.status()["standby"]
        assert st["state"] == "retiring" and "could not be put to sleep" in st["reason"]
        w.down(spare)
        assert w.sup.status()["standby"]["state"] == "waiting"
    finally:
        w.loop.close()


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


def unprotected_after_a_crash(w: World) -> Any:
    """A full card: the standby first, asleep, the engine beside it; the engine crashes,
    the woken standby serves, and none fits beside it now. The engine serving."""
    first, spare = armed_asleep(w, side_by_side=False)
    assert w.sup.status()["standby"]["protected"] is True
    w.feed(Exited(first.generation, 0))
    w.down(first)
    w.feed(Woken(spare.generation, None, 0.6))
    w.feed(GateProbe(spare.generation, True, None))
    st = w.sup.status()["standby"]
    assert st["state"] == "no_room" and st["protected"] is False
    assert st["unprotected_for_s"] is not None
    return spare


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



SNAPSHOT = {"standby": "snapshot", "env": {"VLLM_SERVER_DEV_MODE": "1"}, "criu": "criu"}


def asleep_first(w: World) -> EngineProcess:
    """A start on a full card: its standby first, proven and put to sleep."""
    w.sup.start("test")
    spare = w.spawned()
    w.feed(HealthResult(spare.generation, True))
    w.feed(GateProbe(spare.generation, True, None))
    w.feed(Slept(spare.generation, None, 0.2))
    return spare


def dumped(w: World, spare: EngineProcess, error: str | None = None) -> None:
    """The standby's dump ended (its take-down with it): kept as images, or not."""
    w.feed(Down(spare.generation, TakeDown(exit_code=-9, survivors=[], gpu_holders={},
                                           port_problem=None, duration_s=0.1,
                                           sigkilled=True),
                None, None if error else 0.5, error))


def test_a_snapshot_standby_on_a_full_card_is_dumped_then_a_copy_of_it_first(
        tmp_path: Path) -> None:
    """`standby = "snapshot"` at vLLM's default share (two engines do not fit side by
    side): the standby starts first (under the io_uring filter, its own sockets on
    loopback), is proven, put to sleep and dumped; a copy of its images is restored in
    its place before the engine starts beside it, ready at once (asleep, proven before
    its dump: no generation reaches it); after a crash the copy is woken once the old
    engine is gone, and the next standby is another copy, restored beside it (no room
    for a new engine, room for a copy) with no dump."""
    w = World(tmp_path, fronted=True, engine={**SNAPSHOT, "args": ["--enable-sleep-mode"]})
    try:
        w.sup.start("test")
        first_spawn = w.fx.last("spawn")
        assert first_spawn["bay"] == 1 and first_spawn["spec"].restore is None
        assert first_spawn["spec"].argv[1].endswith("no_io_uring.py")
        assert first_spawn["spec"].env["VLLM_HOST_IP"] == "127.0.0.1"
        spare = w.spawned()
        w.feed(HealthResult(spare.generation, True))
        w.feed(GateProbe(spare.generation, True, None))
        w.feed(Slept(spare.generation, None, 0.2))
        assert w.fx.last("dump")["pid"] == spare.pid
        assert w.sup.status()["standby"]["state"] == "dumping"
        assert w.fx.names().count("spawn") == 1  # the engine waits
        dumped(w, spare)
        restore = w.fx.last("spawn")
        assert restore["bay"] == 1 and restore["spec"].restore is not None
        assert restore["spec"].restore.port == spare.spec.port
        assert w.fx.names().count("spawn") == 2  # (the copy first, not the engine)
        copy = w.spawned()
        w.feed(HealthResult(copy.generation, True))
        st = w.sup.status()["standby"]
        assert st["state"] == "ready" and st["asleep"] is True
        assert st["snapshot"] == {"made": True, "off": None, "copy": True}
        assert w.fx.last("gate_probe") != {"pid": copy.pid}  # (nothing reached it)
        assert w.fx.last("spawn")["bay"] == 0  # now the engine, beside the copy
        first = w.serving()
        w.feed(GateProbe(first.generation, True, None))
        assert w.sup.gate.held_reason is None

        crash_then_wake(w, first, copy)  # a crash: the copy takes over
        again = w.fx.last("spawn")
        assert again["bay"] == 0 and again["spec"].restore is not None  # another copy
        assert w.fx.names().count("dump") == 1
    finally:
        w.loop.close()


@pytest.mark.parametrize("how", ["restart", "crash"])
def test_a_cold_start_waits_for_a_copy_being_restored(tmp_path: Path, how: str) -> None:
    """A copy of the standby's images is being restored when a cold start comes (an
    operator's restart while nothing serves yet, or the serving engine's crash with no
    ready standby): the engine spawns only once the copy is ready, asleep, never beside a
    restore whose GPU memory still grows (vLLM's start would count it as its own). Found
    by the pair machine."""
    w = World(tmp_path, fronted=True, engine={**SNAPSHOT, "args": ["--enable-sleep-mode"]})
    try:
        spare = asleep_first(w)
        dumped(w, spare)
        if how == "restart":
            assert w.fx.last("spawn")["spec"].restore is not None  # the copy, spawning
            w.control("restart")
        else:  # a copy took over from a crash; the next copy is being restored when
            # the one serving crashes too (no standby ready: a cold start)
            copy = w.spawned()
            w.feed(HealthResult(copy.generation, True))
            first = w.serving()
            w.feed(GateProbe(first.generation, True, None))
            crash_then_wake(w, first, copy)
            assert w.fx.last("spawn")["spec"].restore is not None  # the next copy
            w.feed(Exited(copy.generation, 0))
            assert w.state == "BACKOFF"
            w.down(copy)
            w.last_timer_fires()  # (the backoff's)
        assert w.state == "STARTING"
        spawns = w.fx.names().count("spawn")
        restored = w.spawned()  # the copy's spawn ends
        assert w.fx.names().count("spawn") == spawns, "the engine spawned beside a restore"
        w.feed(HealthResult(restored.generation, True))  # ready, asleep
        assert w.fx.names().count("spawn") == spawns + 1
        assert w.fx.last("spawn")["spec"].restore is None  # now the engine, beside it
    finally:
        w.loop.close()


def test_a_cold_start_waits_for_the_tree_in_the_standbys_place(tmp_path: Path) -> None:
    """On a full card with kept images: the engine starting beside a copy is restarted,
    the copy takes over, then dies too (a cold start after a backoff). The engine that was
    starting is still being taken down in the standby's place when the backoff ends: the
    cold start waits for its tree to be gone (its memory released), as with `"sleep"`,
    rather than spawning beside it. Found by the pair machine."""
    w = World(tmp_path, fronted=True, engine={**SNAPSHOT, "args": ["--enable-sleep-mode"]})
    try:
        spare = asleep_first(w)
        dumped(w, spare)
        copy = w.spawned()
        w.feed(HealthResult(copy.generation, True))
        first = w.spawned()  # the engine, starting beside the copy
        w.control("restart")
        assert w.sup.engine is copy and w.fx.last("take_down")["pid"] == first.pid
        w.feed(CoreExited(copy.generation, copy.pid + 1))
        assert w.state == "BACKOFF"
        w.down(copy)
        spawns = w.fx.names().count("spawn")
        w.last_timer_fires()  # (the backoff's)
        assert w.state == "STARTING"
        assert w.fx.names().count("spawn") == spawns, "spawned beside a tree going down"
        w.down(first)
        assert w.fx.names().count("spawn") == spawns + 1
    finally:
        w.loop.close()


def test_a_snapshot_standby_whose_dump_fails_is_a_sleeping_standby(tmp_path: Path) -> None:
    """The dump failed (CRIU missing, say): said in status and the audit, and from then
    on the standby is a sleeping one (no dump tried again until the daemon restarts);
    on a full card the engine starts once that one sleeps."""
    w = World(tmp_path, fronted=True, engine={**SNAPSHOT, "args": ["--enable-sleep-mode"]})
    try:
        spare = asleep_first(w)
        dumped(w, spare, "SnapshotError: CRIU does not run")
        st = w.sup.status()["standby"]
        assert st["snapshot"]["off"] == "SnapshotError: CRIU does not run"
        # (the standby first again, this time to stay asleep: the engine still waits)
        nxt = w.fx.last("spawn")
        assert nxt["bay"] == 1 and nxt["spec"].restore is None
        second = w.spawned()
        w.feed(HealthResult(second.generation, True))
        w.feed(GateProbe(second.generation, True, None))
        w.feed(Slept(second.generation, None, 0.2))
        st = w.sup.status()["standby"]
        assert st["state"] == "ready" and st["asleep"] is True
        assert w.fx.names().count("dump") == 1
        assert w.fx.last("spawn")["bay"] == 0  # the engine, beside the sleeping one
    finally:
        w.loop.close()


def test_a_stop_while_the_standby_is_dumped_waits_for_the_dump(tmp_path: Path) -> None:
    """The dump is the standby's take-down: a stop during it retires the standby and
    ends once the dump's take-down has proven its tree gone, with no copy restored."""
    w = World(tmp_path, fronted=True, engine={**SNAPSHOT, "args": ["--enable-sleep-mode"]})
    try:
        spare = asleep_first(w)
        assert w.sup.status()["standby"]["state"] == "dumping"
        reply = w.control("stop")
        assert w.sup.status()["standby"]["state"] == "retiring"
        assert not reply.done()
        dumped(w, spare)
        assert w.state == "STOPPED" and reply.done()
        assert w.fx.names().count("spawn") == 1  # (no copy, no engine)
    finally:
        w.loop.close()


def test_a_copy_that_cannot_be_restored_drops_the_images(tmp_path: Path) -> None:
    """The images are not trusted once a copy of them failed: on a full card the engine
    then starts (no room for a fresh standby beside it until its next cold start, which
    begins with one to dump again)."""
    w = World(tmp_path, fronted=True, engine={**SNAPSHOT, "args": ["--enable-sleep-mode"]})
    try:
        spare = asleep_first(w)
        dumped(w, spare)
        restore = w.fx.last("spawn")
        assert restore["spec"].restore is not None
        w.feed(Spawned(restore["generation"], None, "criu restore of copy g3 ended"))
        st = w.sup.status()["standby"]
        assert st["snapshot"]["made"] is False
        events = [json.loads(x)["event"] for x in
                  (tmp_path / "events.jsonl").read_text().splitlines()]
        assert "standby_images_dropped" in events
        assert w.fx.last("spawn")["bay"] == 0  # the engine, alone
    finally:
        w.loop.close()
