"""The standby's lifecycle in one engine unit, with recorded effects and a driven clock
(no process): armed beside the serving engine or before it, awake or asleep, the
failover (a wake first when asleep), a failed wake, a standby that fails. Reloads and
re-arming: tests/test_standby_reload.py; the snapshot standby:
tests/test_standby_snapshot_unit.py."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from supervisor.engine.events import (
    Down,
    Drained,
    Exited,
    GateProbe,
    HealthResult,
    Reloaded,
    Slept,
    Spawned,
    Woken,
)
from supervisor.settings.config import parse_config
from tests.standby_worlds import (
    SLEEP,
    armed_asleep,
    crash_then_wake,
    ready_standby,
)
from tests.unit_world import World


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
