"""The supervisor's lifecycle with no process at all: its effects recorded by a fake
(`supervisor/engine/effects/protocol.py`), its events fed by hand, its clock driven by the test.

Each test states a transition and what the supervisor asked the world to do for it.
The same transitions run against real processes in tests/test_daemon.py and
tests/test_lifecycle.py; here they run in milliseconds and at exact virtual times.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from supervisor.engine.events import (
    BackoffElapsed,
    CanaryDone,
    CommandError,
    CoreExited,
    Drained,
    Exited,
    GateProbe,
    HealthResult,
    MetricsSampled,
    Reloaded,
    RemedyDone,
    SleepModeProbed,
)
from supervisor.engine.process import kv_tier
from supervisor.engine.unit import EngineUnit
from supervisor.loop import Clock
from supervisor.ops.sdnotify import Notifier
from supervisor.settings.config import parse_config
from supervisor.settings.sections import EngineConfig
from supervisor.watchdog.canary import CanaryOutcome
from supervisor.watchdog.gpu import NoGpu
from supervisor.watchdog.metrics import Snapshot
from supervisor.watchdog.remedy import RemedyOutcome
from tests.unit_world import World


@pytest.fixture
def world(tmp_path: Path) -> Iterator[World]:
    w = World(tmp_path)
    yield w
    w.loop.close()



def test_stopped_to_starting_to_running_with_each_effect_once(world: World) -> None:
    world.sup.start("daemon started")
    assert world.state == "STARTING" and world.fx.names() == ["spawn"]
    spec = world.fx.last("spawn")["spec"]
    assert spec.port == 18100 and "--shutdown-timeout" in spec.argv
    engine = world.spawned()
    assert world.fx.names() == ["spawn", "watch"]
    world.now += 42.5
    world.feed(HealthResult(engine.generation, True))
    assert world.state == "RUNNING"
    assert world.sup.state_reason == "/health answered 200 after 42.5 s"
    assert world.fx.names() == ["spawn", "watch", "serve"]


def test_running_to_backoff_on_an_exit_nobody_asked_for_then_starting_again(
        world: World) -> None:
    engine = world.serving()
    world.now += 10
    world.feed(Exited(engine.generation, 0))  # exit code 0 is a crash too
    assert world.state == "BACKOFF" and "without being asked" in world.sup.state_reason
    assert world.fx.last("take_down") == {"pid": engine.pid, "graceful": False,
                                          "evidence": None}
    world.down(engine)  # the tree proven gone: forgotten, then the backoff timer
    assert world.fx.names()[-2:] == ["forget", "after"]
    timer = world.fx.timers[-1]
    assert timer.delay_s == pytest.approx(1.0)  # backoff_initial_s
    world.now += timer.delay_s
    world.feed(timer.event)
    assert world.state == "STARTING" and world.fx.last("spawn")["generation"] == 2
    assert world.sup.status()["restarts"] == 1


def test_backoff_grows_and_a_stale_timer_is_ignored(world: World) -> None:
    delays = []
    for _ in range(2):
        engine = world.serving()  # healthy only briefly: not stable, the backoff grows
        world.feed(Exited(engine.generation, 1))
        world.down(engine)
        delays.append(world.fx.timers[-1].delay_s)
        world.now += delays[-1]
        world.feed(world.fx.timers[-1].event)
    assert delays == [pytest.approx(1.0), pytest.approx(2.0)]
    spawns = world.fx.names().count("spawn")
    world.feed(BackoffElapsed(1))  # a timer of an engine long gone
    assert world.fx.names().count("spawn") == spawns and world.state == "STARTING"


def test_boot_failures_to_fatal_and_out_by_an_operators_restart(world: World) -> None:
    world.sup.start("daemon started")
    for i in range(3):
        engine = world.spawned()
        world.feed(Exited(engine.generation, 1))  # never healthy: a boot failure
        world.down(engine)
        if i < 2:
            assert world.state == "BACKOFF"
            world.now += world.fx.timers[-1].delay_s
            world.feed(world.fx.timers[-1].event)
    assert world.state == "FATAL" and "3 boot failures" in world.sup.state_reason
    spawns = world.fx.names().count("spawn")
    reply = world.control("restart", reason="fixed the model path")
    assert reply.result()["reason"] == "fixed the model path"
    assert world.state == "STARTING" and world.fx.names().count("spawn") == spawns + 1


def test_running_to_draining_on_an_operators_restart_then_a_new_engine(
        world: World) -> None:
    engine = world.serving()
    reply = world.control("restart")
    assert reply.result()["state"] == "DRAINING" and world.state == "DRAINING"
    assert world.fx.last("take_down")["graceful"] is True
    engine.exit_code = 0
    world.feed(Exited(engine.generation, 0))  # asked for: not a crash
    assert world.state == "DRAINING"
    world.down(engine)
    assert world.state == "STARTING" and world.fx.last("spawn")["generation"] == 2
    st = world.sup.status()
    assert st["restarts"] == 1 and st["last_decision"]["action"] == "start"


def test_stop_takes_the_engine_down_and_ends_stopped(world: World) -> None:
    engine = world.serving()
    reply = world.control("stop")
    assert world.state == "STOPPING" and world.fx.last("take_down")["graceful"] is True
    world.down(engine)
    assert world.state == "STOPPED" and reply.result() == {"state": "STOPPED", "exit_code": 0}


def test_a_reloaded_port_is_used_at_the_next_start_only(world: World,
                                                              tmp_path: Path) -> None:
    engine = world.serving()
    doc = {**world.doc, "engine": {**world.doc["engine"], "port": 18200}}
    new = parse_config(doc, str(tmp_path / "config.toml"), tmp_path)
    reply: asyncio.Future[dict[str, Any]] = world.loop.create_future()
    world.feed(Reloaded(new, None, reply))
    assert reply.result()["next_engine_start"] == ["engine.port"]
    assert world.sup.status()["engine"]["port"] == 18100  # the running engine's
    world.control("restart")
    world.down(engine)
    assert world.fx.last("spawn")["spec"].port == 18200


SPEC_4 = '{"model":"draft","num_speculative_tokens":4}'
SPEC_6 = '{"model":"draft","num_speculative_tokens":6}'


def test_every_reloaded_engine_key_is_what_the_next_start_uses(tmp_path: Path) -> None:
    """No copy of the engine's config outlives a reload: after one that changes every
    [engine] key, the next start is made of the new values, and of nothing older (a
    speculative config of 4 tokens at the first start, 6 after the reload: 6)."""
    w = World(tmp_path, engine={"args": ["--speculative-config", SPEC_4]})
    try:
        engine = w.serving()
        assert SPEC_4 in w.fx.last("spawn")["spec"].argv
        changed = {
            "command": ["vllm", "serve", "m2"], "args": ["--speculative-config", SPEC_6],
            "env": {"A": "1"}, "inherit_env": False, "compile_cache": False,
            "cwd": str(tmp_path / "elsewhere"),
            "host": "127.0.0.2", "port": 18200, "health_path": "/ping",
            "health_interval_s": 2.0, "startup_timeout_s": 100.0, "drain_timeout_s": 5.0,
            "drain": "continue", "stop_grace_s": 3.0, "reap_timeout_s": 4.0, "gpus": [0],
            "gpu_release_timeout_s": 5.0, "gpu_foreign_allowance_mib": 10,
            "access_log": True, "models": ["m2"], "share_gpus": True, "standby": "awake",
            "standby_port": 18300, "standby_args": ["--max-num-seqs", "2"],
            # (the tier's folder is also kept from the reload on: test_kv_tier.py)
            "kv_tier": str(tmp_path / "kv"), "kv_tier_cpu_gib": 1.0,
            "kv_tier_chunk_tokens": 32,
            # (a snapshot standby's images and CRIU: its next dump and restore)
            "snapshot_dir": str(tmp_path / "snapshots"), "criu": "/usr/sbin/criu"}
        only_with_several = {"fallback"}  # ([engines.NAME] only)
        applied_now = {"rearm_window",  # (read at each tick, not at a start)
                       # the weight cache is started, restarted or taken down at once,
                       # and the next start maps it: tests/test_weight_cache_unit.py
                       "weight_cache", "weight_cache_command", "weight_cache_args",
                       # (the KV tier's keeper reads its bound at each look)
                       "kv_tier_max_gib",
                       # (a ready standby's weights woken ahead or taken back at each
                       # tick: tests/test_weights_ahead.py)
                       "standby_weights"}
        assert set(changed) | only_with_several | applied_now == {
            f.name for f in dataclasses.fields(EngineConfig)}, "a new [engine] key: add it"
        doc = {**w.doc, "engine": {**w.doc["engine"], **changed}}
        new = parse_config(doc, str(tmp_path / "config.toml"), tmp_path)
        reply: asyncio.Future[dict[str, Any]] = w.loop.create_future()
        w.feed(Reloaded(new, None, reply))
        assert sorted(reply.result()["next_engine_start"]) == sorted(
            f"engine.{k}" for k in changed)
        w.control("restart")
        w.down(engine)
        spawn = w.fx.last("spawn")
        assert spawn["cfg"] == new.engine  # every key as reloaded
        assert spawn["spec"].argv[:3] == ["vllm", "serve", "m2"]
        assert SPEC_6 in spawn["spec"].argv and SPEC_4 not in spawn["spec"].argv
        assert kv_tier.argv(new.engine)[1] in spawn["spec"].argv
        assert spawn["spec"].port == 18200 and spawn["spec"].env["A"] == "1"
        assert w.sup.status()["overrides"] == {}
    finally:
        w.loop.close()


def test_the_gate_follows_the_unit_canary_drain_kv_reset_restart_and_stop(
        tmp_path: Path) -> None:
    """With the proxy's gate in the loop: held until the first canary passes, held
    while the operator drains and during a KV reset, held through a restart, closed by
    a stop; the proxy follows each new engine and its streams are paused for a restart
    with drain = "continue"."""
    w = World(tmp_path, fronted=True, engine={"drain": "continue"})
    try:
        gate = w.sup.gate
        engine = w.serving()
        assert "follow" in w.fx.names() and w.fx.last("gate_probe") == {"pid": engine.pid}
        assert w.state == "RUNNING" and gate.held_reason is not None  # no canary yet
        assert gate.unhealthy is None  # (for a router: served within a short wait)
        w.feed(GateProbe(engine.generation, True, None))
        assert gate.held_reason is None and w.sup.serving()
        w.control("drain")
        assert gate.held_reason == "drain requested by operator" and not w.sup.serving()
        assert gate.unhealthy == "drain requested by operator"
        assert w.control("resume").result()["held"] is False and gate.held_reason is None
        assert gate.unhealthy is None
        w.sup.begin_remedy("kv_reset", "test")
        assert gate.held_reason == "KV reset in progress (test)"
        assert gate.unhealthy is None  # a KV reset holds for a fraction of a second
        w.feed(RemedyDone(engine.generation, "kv_reset",
                          RemedyOutcome(ok=True, steps={"sleep": 0.1}), 0.3))
        assert gate.held_reason is None
        assert w.control("throttle", level=2).result()["live"] is True
        assert gate.level == 2 and "take_down" not in w.fx.names()  # live: no relaunch
        w.control("restart")
        assert w.fx.last("pause_streams") == {"pid": engine.pid}
        assert gate.held_reason is not None and "DRAINING" in gate.held_reason
        assert gate.unhealthy is not None and "DRAINING" in gate.unhealthy  # a cold start
        w.down(engine)
        engine = w.serving()
        assert gate.held_reason is not None  # a new engine: its own first canary again
        w.feed(GateProbe(engine.generation, False, "timed out"))  # released anyway
        assert gate.held_reason is None and gate.closed_reason is None
        still = Snapshot(generation_tokens_total=40.0, prompt_tokens_total=9.0)
        w.feed(MetricsSampled(engine.generation, still, None))
        for _ in range(2):  # canaries failing with no progress: a frozen engine
            t0 = w.now
            w.now += 2
            w.feed(MetricsSampled(engine.generation, still, None))  # its page: still
            w.feed(CanaryDone(engine.generation, CanaryOutcome(False, 5.0, "timed out"),
                              t0, t0 + 5))
            w.now += 8
        assert gate.unhealthy == "its last 2 canaries failed with no progress"
        w.control("stop")
        assert gate.closed_reason is not None and "STOPPING" in gate.closed_reason
        assert gate.unhealthy is not None and "STOPPING" in gate.unhealthy
    finally:
        w.loop.close()


def test_a_restart_runs_under_one_deadline_from_its_drain_to_the_tree_gone(
        tmp_path: Path) -> None:
    w = World(tmp_path, fronted=True, engine={"drain_timeout_s": 20, "stop_grace_s": 5,
                                               "reap_timeout_s": 2, "gpu_release_timeout_s": 9})
    try:
        engine = w.serving()
        w.feed(GateProbe(engine.generation, True, None))
        ticket = w.loop.run_until_complete(w.sup.gate.acquire(1))  # a request in flight
        start = w.now
        w.control("restart")
        # the proxy's drain 20 + the engine's drain 20 and grace 5 + 3 x reap 2 + GPU 9
        assert w.fx.deadlines == [start + 60.0] and w.fx.names()[-1] == "drain"
        assert w.sup.status()["stop_deadline_in_s"] == 60.0
        w.now += 20.0
        w.sup.gate.done(ticket)
        w.feed(Drained(engine.generation, True, 20.0))
        assert w.fx.deadlines == [start + 60.0, start + 60.0]  # the same one
        assert w.sup.status()["stop_deadline_in_s"] == 40.0
        w.down(engine)
        assert w.sup.status()["stop_deadline_in_s"] is None
    finally:
        w.loop.close()


@pytest.mark.parametrize("how", ["exits", "loses_its_core"])
def test_an_engine_that_dies_during_a_restarts_drain_is_taken_down_at_once(
        tmp_path: Path, how: str) -> None:
    """A restart's drain waits for the requests at the engine to finish there; the engine
    dies meanwhile. Nothing can finish at a dead engine: it is taken down at once and the
    restart goes on (a cold start), rather than holding every client until the drain's
    timeout. The drain's late answer changes nothing. (Found by the pair machine's joint
    table: DRAINING with an exited engine nobody took down.)"""
    w = World(tmp_path, fronted=True, engine={"drain_timeout_s": 30})
    try:
        engine = w.serving()
        w.feed(GateProbe(engine.generation, True, None))
        ticket = w.loop.run_until_complete(w.sup.gate.acquire(1))  # a request in flight
        w.control("restart")
        assert w.fx.names()[-1] == "drain" and "take_down" not in w.fx.names()
        w.now += 1.0
        if how == "exits":
            engine.exit_code = -9
            w.feed(Exited(engine.generation, -9))
        else:
            w.feed(CoreExited(engine.generation, engine.pid + 1))
        assert w.fx.last("take_down") == {"pid": engine.pid, "graceful": False,
                                          "evidence": None}
        w.sup.gate.done(ticket)
        w.feed(Drained(engine.generation, True, 1.0))  # (late: nothing more)
        assert w.fx.names().count("take_down") == 1
        w.down(engine)
        assert w.state == "STARTING" and w.fx.last("spawn")["generation"] == 2
    finally:
        w.loop.close()


def test_an_operators_kv_reset_waits_for_the_engine_to_be_proven(tmp_path: Path) -> None:
    """`kv-reset` while the engine that just became healthy is still proven (its first
    generation, after the warm-up's own sleep and wake) is refused, saying so: a second
    sleep under the proof's can wedge vLLM, and the reset's end would let held requests
    through to an engine never proven. Once the gate opens, it is taken. (Found by the
    pair machine.)"""
    w = World(tmp_path, fronted=True, engine={"env": {"VLLM_SERVER_DEV_MODE": "1"},
                                               "args": ["--enable-sleep-mode"]})
    try:
        engine = w.serving()
        w.feed(SleepModeProbed(engine.generation, True, None))
        reply = w.control("kv-reset")
        with pytest.raises(CommandError, match="being proven"):
            reply.result()
        assert "remedy" not in w.fx.names()
        w.feed(GateProbe(engine.generation, True, None))
        assert w.sup.gate.held_reason is None
        w.control("kv-reset")
        assert w.fx.last("remedy") == {"pid": engine.pid, "rung": "kv_reset", "ways": ("sleep",)}
    finally:
        w.loop.close()


def test_an_operators_kv_reset_under_way_when_the_engine_stops_is_answered(
        tmp_path: Path) -> None:
    """A stop while an operator's `kv-reset` is under way: the reset's job ends with the
    unit, so its answer would never come; the operator is told it did not finish, at the
    stop's end, rather than left waiting. (Found by the pair machine.)"""
    w = World(tmp_path, fronted=True, engine={"env": {"VLLM_SERVER_DEV_MODE": "1"},
                                               "args": ["--enable-sleep-mode"]})
    try:
        engine = w.serving()
        w.feed(SleepModeProbed(engine.generation, True, None))
        w.feed(GateProbe(engine.generation, True, None))
        reset = w.control("kv-reset")
        assert w.fx.last("remedy") == {"pid": engine.pid, "rung": "kv_reset", "ways": ("sleep",)}
        stop = w.control("stop")
        w.down(engine)
        assert w.state == "STOPPED" and stop.result()["state"] == "STOPPED"
        with pytest.raises(CommandError, match="kv-reset not finished: the engine was stopped"):
            reset.result()
    finally:
        w.loop.close()


def test_a_restart_of_a_starting_engine_drains_nothing(tmp_path: Path) -> None:
    """A restart while the engine starts (after a crash, with a request still in flight at
    the proxy from the engine before): no request is at an engine that never served, so
    it is taken down at once, not after waiting out the drain's timeout. (Found by the
    pair machine: DRAINING with a starting engine.)"""
    w = World(tmp_path, fronted=True, engine={"drain_timeout_s": 30})
    try:
        first = w.serving()
        w.feed(GateProbe(first.generation, True, None))
        ticket = w.loop.run_until_complete(w.sup.gate.acquire(1))  # a request in flight
        w.feed(Exited(first.generation, -9))  # a crash: a cold start after the backoff
        w.down(first)
        w.last_timer_fires()
        second = w.spawned()
        assert w.state == "STARTING" and w.sup.gate.in_flight == 1
        w.control("restart")
        assert "drain" not in w.fx.names()
        assert w.fx.last("take_down")["pid"] == second.pid
        w.down(second)
        assert w.state == "STARTING" and w.fx.last("spawn")["generation"] == 3
        w.sup.gate.done(ticket)
    finally:
        w.loop.close()


def test_a_failed_in_place_remedy_becomes_a_drained_restart(world: World) -> None:
    engine = world.serving()
    world.sup.begin_remedy("reset_prefix_cache", "test")
    assert world.fx.last("remedy") == {"pid": engine.pid, "rung": "reset_prefix_cache",
                                       "ways": ()}
    assert world.sup.status()["remedies"]["running"]["rung"] == "reset_prefix_cache"
    world.now += 2
    world.feed(RemedyDone(engine.generation, "reset_prefix_cache",
                          RemedyOutcome(ok=False, error="HTTP 500"), 0.3))
    assert world.state == "DRAINING" and "reset_prefix_cache failed" in world.sup.state_reason
    assert world.fx.last("take_down")["graceful"]  # no requests in flight: no drain wait
    world.down(engine)
    assert world.state == "STARTING" and world.fx.last("spawn")["generation"] == 2
    assert world.sup.status()["remedies"]["running"] is None


def test_a_remedy_that_worked_leaves_the_engine_running(world: World) -> None:
    engine = world.serving()
    world.sup.begin_remedy("reset_prefix_cache", "test")
    world.feed(RemedyDone(engine.generation, "reset_prefix_cache",
                          RemedyOutcome(ok=True, steps={"reset": 0.01}), 0.01))
    assert world.state == "RUNNING" and "take_down" not in world.fx.names()


def test_a_unit_of_a_named_engine_uses_its_own_state_file_and_names_itself(
        tmp_path: Path) -> None:
    w = World(tmp_path)
    try:
        doc = dict(w.doc)
        engine = doc.pop("engine")
        doc["engines"] = {"a": {**engine, "port": 18101}, "b": {**engine, "port": 18102}}
        cfg = parse_config(doc, str(tmp_path / "config.toml"), tmp_path)
        unit = EngineUnit(config=cfg.for_engine("b"), notifier=Notifier({}), gpu=NoGpu(),
                          clock=Clock(monotonic=lambda: w.now, wall=lambda: w.now),
                          environ={}, effects=w.fx, name="b")
        assert Path(unit.config.state_file).name == "engine-tree-b.json"
        unit.start("test")
        assert w.fx.last("spawn")["spec"].port == 18102
        records = [json.loads(x) for x in (tmp_path / "events.jsonl").read_text().splitlines()]
        assert records[-1]["engine"] == "b" and records[-1]["to"] == "STARTING"
    finally:
        w.loop.close()


def test_a_failed_canary_no_scrape_could_judge_is_judged_by_the_next_one(
        tmp_path: Path) -> None:
    """An engine too busy to answer its /metrics page during a canary (a host short of
    CPU) has not shown it is frozen: the failure waits for the next scrape, which
    counts it only if the counters stood still since the canary began."""
    w = World(tmp_path, fronted=True)
    try:
        engine = w.serving()
        w.feed(GateProbe(engine.generation, True, None))
        gate = w.sup.gate

        def scrape(tokens: float) -> None:
            w.feed(MetricsSampled(engine.generation, Snapshot(
                generation_tokens_total=tokens, prompt_tokens_total=9.0), None))

        def failed_canaries(n: int) -> None:
            for _ in range(n):
                w.feed(CanaryDone(engine.generation,
                                  CanaryOutcome(False, 5.0, "timed out"), w.now, w.now + 5))
                w.now += 10

        def failures() -> float:
            return w.sup.status()["signals"]["canary_failures"]

        scrape(40.0)
        w.now += 1
        failed_canaries(2)  # no scrape answered meanwhile
        assert failures() == 0 and gate.unhealthy is None
        scrape(90.0)  # tokens flowed: slow, not frozen
        assert failures() == 0 and gate.unhealthy is None
        w.now += 1
        failed_canaries(2)
        scrape(90.0)  # the page stood still since they began: frozen
        assert failures() == 2
        assert gate.unhealthy == "its last 2 canaries failed with no progress"
        w.feed(CanaryDone(engine.generation, CanaryOutcome(True, 0.1, None), w.now,
                          w.now + 0.1))
        assert failures() == 0 and gate.unhealthy is None
    finally:
        w.loop.close()
