"""The asymmetric pair in one engine unit (`engine.standby_args`: a thin standby), with
recorded effects and a driven clock: after each crash the thin standby serves while a
full-size engine starts beside it, which takes over again; the thin one returns to
sleep; a planned restart goes the same way; a thin engine that dies during the re-arm
is a cold start of one full-size engine; standby_args that cannot work are refused at
load, naming the numbers. (Through the daemon: tests/test_standby.py.)"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from supervisor.engine.events import (
    Drained,
    Exited,
    GateProbe,
    HealthResult,
    Slept,
    Woken,
)
from supervisor.engine.process.process import EngineProcess
from supervisor.settings.config import ConfigError, parse_config
from tests.standby_worlds import SLEEP, armed_asleep
from tests.unit_world import World

# an asymmetric pair: an engine at 0.60 of the card, its standby at 0.28 (both awake fit)
THIN = {**SLEEP, "args": ["--enable-sleep-mode", "--gpu-memory-utilization", "0.60"],
        "standby_args": ["--gpu-memory-utilization", "0.28"], "drain": "continue"}


def share(engine: EngineProcess) -> str:
    argv = list(engine.spec.argv)
    return argv[len(argv) - 1 - argv[::-1].index("--gpu-memory-utilization") + 1]


def crash_to_thin_and_back(w: World, full: EngineProcess, thin: EngineProcess) -> Any:
    """The full-size engine crashes: the thin standby wakes at once and serves; the
    re-arm starts a full-size engine beside it, awake, which takes over again once
    proven; the thin one finishes its requests and sleeps: the standby again. The new
    full-size engine."""
    downs = w.fx.names().count("take_down")
    w.now += 5
    w.feed(Exited(full.generation, 0))
    assert w.sup.engine is thin and w.fx.last("wake") == {"pid": thin.pid}
    w.feed(Woken(thin.generation, None, 0.5))
    w.feed(GateProbe(thin.generation, True, None))
    assert w.state == "RUNNING" and w.sup.gate.held_reason is None
    st = w.sup.status()["standby"]
    assert st["thin_serves"] is True and st["protected"] is False
    w.down(full)  # the crashed tree gone: a full-size engine beside the thin one
    new = w.spawned()
    assert share(new) == "0.60" and w.sup.status()["standby"]["state"] == "starting"
    bays = {d["generation"]: d["bay"] for n, d in w.fx.calls if n == "spawn"}
    assert bays[new.generation] == bays[full.generation] != bays[thin.generation]
    ticket = asyncio.run(w.sup.gate.acquire(1))  # a stream at the thin engine meanwhile
    w.feed(HealthResult(new.generation, True))
    w.feed(GateProbe(new.generation, True, None))  # proven, awake: it takes over
    assert w.sup.engine is new and "sleep" not in [
        n for n, d in w.fx.calls[-6:] if d.get("pid") == new.pid]
    assert w.fx.last("pause_streams") == {"pid": thin.pid}  # (drain = "continue")
    assert w.fx.last("drain_behind") == {"pid": thin.pid}
    st = w.sup.status()["standby"]
    assert st["state"] == "returning" and st["thin"] is True and st["thin_serves"] is False
    w.feed(GateProbe(new.generation, True, None))  # the takeover's proof
    assert w.sup.gate.held_reason is None
    w.sup.gate.done(ticket)
    w.feed(Drained(thin.generation, True, 0.2))  # its requests ended: to sleep
    assert w.fx.last("sleep") == {"pid": thin.pid}
    w.feed(Slept(thin.generation, None, 0.3))
    st = w.sup.status()["standby"]
    assert st["state"] == "ready" and st["protected"] is True and st["asleep"] is True
    assert st["pid"] == thin.pid and st["thin"] is True
    # the thin one was never taken down, and the crashed one only
    assert w.fx.names().count("take_down") == downs + 1
    return new


def thin_serves_and_rearms(w: World) -> tuple[EngineProcess, EngineProcess, EngineProcess]:
    """Armed, then the full-size engine crashes: the thin standby is woken and serves,
    the crashed tree goes, and a full-size engine spawns beside the thin one (the
    re-arm). (the crashed engine, the thin one, the re-arm's)"""
    full, thin = armed_asleep(w, side_by_side=True)
    w.feed(Exited(full.generation, 0))
    w.feed(Woken(thin.generation, None, 0.5))
    w.feed(GateProbe(thin.generation, True, None))
    w.down(full)
    return full, thin, w.spawned()


def test_an_asymmetric_pair_is_protected_again_after_each_crash_without_holding_clients(
        tmp_path: Path) -> None:
    """`standby_args` makes the standby thinner (0.28 beside 0.60): after a crash it
    serves alone while a full-size engine starts beside it (no cold start held anyone),
    the full-size one takes over again once proven, and the thin one goes back to sleep:
    protected again, every time (three crashes here), never `no_room`."""
    w = World(tmp_path, fronted=True, engine=THIN)
    try:
        full, thin = armed_asleep(w, side_by_side=True)
        assert share(full) == "0.60" and share(thin) == "0.28"
        assert w.sup.status()["standby"]["thin"] is True
        for _ in range(3):
            full = crash_to_thin_and_back(w, full, thin)
            assert w.sup.status()["standby"]["state"] != "no_room"
        events = [json.loads(x)["event"] for x in
                  (tmp_path / "events.jsonl").read_text().splitlines()]
        assert events.count("failover") == 6 and events.count("upgrade") == 0
        assert w.state == "RUNNING" and w.sup.engine is full
    finally:
        w.loop.close()


def test_an_asymmetric_pairs_planned_restart_goes_to_the_thin_one_and_back(
        tmp_path: Path) -> None:
    """An operator's restart of the full-size engine: the thin standby takes the
    traffic (woken beside it: both fit), the old one is drained and taken down, and the
    re-arm brings a new full-size engine as after a crash."""
    w = World(tmp_path, fronted=True, engine=THIN)
    try:
        full, thin = armed_asleep(w, side_by_side=True)
        w.control("restart")
        assert w.sup.engine is thin and w.fx.last("wake") == {"pid": thin.pid}
        assert w.fx.last("take_down") == {"pid": full.pid, "graceful": True,
                                          "evidence": None}
        w.feed(Woken(thin.generation, None, 0.5))
        w.feed(GateProbe(thin.generation, True, None))
        assert w.sup.status()["standby"]["thin_serves"] is True
        w.down(full)
        new = w.spawned()
        assert share(new) == "0.60"
        w.feed(HealthResult(new.generation, True))
        w.feed(GateProbe(new.generation, True, None))
        assert w.sup.engine is new
        w.feed(GateProbe(new.generation, True, None))
        w.feed(Drained(thin.generation, True, 0.0))
        w.feed(Slept(thin.generation, None, 0.3))
        assert w.sup.status()["standby"]["protected"] is True
    finally:
        w.loop.close()


def test_a_thin_engine_that_dies_while_the_full_size_one_starts_is_a_cold_start_of_one(
        tmp_path: Path) -> None:
    """The thin engine serving dies before the full-size one beside it is ready: a cold
    start, and the full-size engine still starting is taken down first (two full-size
    engines do not fit); the cold start spawns once its tree is gone, and a thin standby
    follows beside the new engine."""
    w = World(tmp_path, fronted=True, engine=THIN)
    try:
        _, thin, rearm = thin_serves_and_rearms(w)
        assert share(rearm) == "0.60"
        w.feed(Exited(thin.generation, 0))  # the thin one dies meanwhile
        assert w.state == "BACKOFF"
        w.down(thin)
        spawns = w.fx.names().count("spawn")
        w.last_timer_fires()  # (the backoff's)
        assert w.state == "STARTING"
        assert w.fx.last("take_down") == {"pid": rearm.pid, "graceful": False,
                                          "evidence": None}
        assert w.fx.names().count("spawn") == spawns  # not before it is gone
        w.down(rearm)
        assert w.fx.names().count("spawn") == spawns + 1
        engine = w.serving()
        assert share(engine) == "0.60"
        w.feed(GateProbe(engine.generation, True, None))
        standby = w.spawned()
        assert share(standby) == "0.28" and w.sup.status()["standby"]["thin"] is True
    finally:
        w.loop.close()


def test_a_full_size_engine_that_dies_before_its_takeover_is_proven_fails_over_again(
        tmp_path: Path) -> None:
    """The full-size engine of the re-arm takes over from the thin one, which finishes
    its requests and is asleep again (the standby) before the takeover's proof answers;
    then the full-size engine dies. The thin standby is ready: it takes over in turn (a
    second handover), it is not a crash. (Found by tests/test_pair_machine.py: the
    handover refused to go from proving to waking.)"""
    w = World(tmp_path, fronted=True, engine=THIN)
    try:
        _, thin, new = thin_serves_and_rearms(w)
        w.feed(HealthResult(new.generation, True))
        w.feed(GateProbe(new.generation, True, None))  # proven, awake: it takes over
        assert w.sup.engine is new
        w.feed(Drained(thin.generation, True, 0.2))  # the thin one: to sleep
        w.feed(Slept(thin.generation, None, 0.3))
        assert w.sup.status()["standby"]["state"] == "ready"
        assert w.sup.gate.held_reason is not None  # (the takeover's proof not in yet)
        w.now += 2
        w.feed(Exited(new.generation, 0))
        assert w.state == "RUNNING" and w.sup.engine is thin
        assert w.fx.last("wake") == {"pid": thin.pid}
        w.feed(GateProbe(new.generation, False, "connection refused"))  # (stale: ignored)
        assert w.state == "RUNNING" and w.sup.engine is thin
        w.feed(Woken(thin.generation, None, 0.5))
        w.feed(GateProbe(thin.generation, True, None))
        assert w.sup.gate.held_reason is None
        events = [json.loads(x)["event"] for x in
                  (tmp_path / "events.jsonl").read_text().splitlines()]
        assert events.count("failover_failed") == 0 and events.count("failover") == 3
    finally:
        w.loop.close()


def test_a_cold_start_waits_for_a_thin_standby_being_taken_down_beside_it(
        tmp_path: Path) -> None:
    """The thin standby fails its proof (taken down) and the full-size engine crashes
    meanwhile: the cold start waits until the thin one's tree is gone, as for a full-size
    one (an engine starting while another releases the card fails vLLM's profiling),
    and spawns once it is; a thin standby follows beside the new engine."""
    w = World(tmp_path, fronted=True, engine=THIN)
    try:
        full = w.serving()
        w.feed(GateProbe(full.generation, True, None))
        thin = w.spawned()
        assert share(thin) == "0.28" and w.sup.status()["standby"]["thin"] is True
        w.feed(HealthResult(thin.generation, True))
        w.feed(GateProbe(thin.generation, False, "HTTP 500"))  # its proof failed
        assert w.fx.last("take_down")["pid"] == thin.pid
        assert w.sup.status()["standby"]["state"] == "retiring"
        w.feed(Exited(full.generation, 0))  # and the full-size engine crashes
        w.down(full)
        if w.state == "BACKOFF":
            timer = w.fx.timers[-1]
            w.now += timer.delay_s
            w.feed(timer.event)
        spawns = w.fx.names().count("spawn")
        assert w.state == "STARTING" and w.sup.engine is None
        assert w.fx.names().count("spawn") == spawns  # not while the thin one goes
        w.down(thin)
        assert w.fx.names().count("spawn") == spawns + 1
        engine = w.serving()
        assert share(engine) == "0.60"
        w.feed(GateProbe(engine.generation, True, None))
        assert w.sup.status()["standby"]["state"] == "waiting"  # (its backoff, after a failure)
        timer = w.fx.timers[-1]
        w.now += timer.delay_s
        w.feed(timer.event)
        standby = w.spawned()
        assert share(standby) == "0.28" and w.sup.status()["standby"]["thin"] is True
    finally:
        w.loop.close()


@pytest.mark.parametrize(("engine", "says"), [
    # (0.62 + 0.30 passed a check at 0.94 and ran the thin one out of memory on an H100)
    ({**THIN, "args": ["--enable-sleep-mode", "--gpu-memory-utilization", "0.62"],
      "standby_args": ["--gpu-memory-utilization", "0.30"]},
     "engine.standby_args: the engine's --gpu-memory-utilization 0.62 and the standby's "
     "0.3 make 0.92 of the card"),
    ({**THIN, "standby": "none"}, 'engine.standby_args: needs a standby'),
    ({**THIN, "standby_args": ["--enforce-eager"]}, "'--enforce-eager' has no value"),
    ({**THIN, "standby_args": ["0.3"]}, "'0.3' is not a flag"),
    ({**THIN, "standby_args": ["--gpu-memory-utilization", "a third"]},
     "engine.standby_args: --gpu-memory-utilization 'a third' is not a number"),
])
def test_a_standby_args_that_cannot_work_is_refused_naming_the_numbers(
        tmp_path: Path, engine: dict[str, Any], says: str) -> None:
    doc = {"engine": {"command": ["vllm", "serve", "m"], **engine}}
    # refused as a config error that names the key, after the file (never another
    # exception on the way)
    with pytest.raises(ConfigError, match=r"^\S+/config\.toml: engine\.standby_args: ") as got:
        parse_config(doc, str(tmp_path / "config.toml"), tmp_path)
    assert says in str(got.value)


def test_while_the_thin_standby_serves_admission_keeps_to_its_kv_cache(
        tmp_path: Path) -> None:
    """Issue 51: while the thin standby serves, the gate's token budget is its KV cache
    (as its core said at its start), so what it cannot hold waits at the gate (continued
    streams first, each wait bounded) rather than in vLLM's own queue; the full-size
    engine back, the configured budget again (none here). A cold start clears it too."""
    w = World(tmp_path, fronted=True, engine=THIN)
    try:
        full, thin = armed_asleep(w, side_by_side=True)
        full.kv_tokens, thin.kv_tokens = 553_712, 189_104
        assert w.sup.gate.limits.tokens == 0
        w.now += 5
        w.feed(Exited(full.generation, 0))
        assert w.sup.engine is thin and w.sup.gate.limits.tokens == 189_104
        w.feed(Woken(thin.generation, None, 0.5))
        w.feed(GateProbe(thin.generation, True, None))
        assert w.sup.status()["admission"]["max_tokens_in_flight"] == 189_104
        w.down(full)
        new = w.spawned()
        new.kv_tokens = 553_712
        w.feed(HealthResult(new.generation, True))
        w.feed(GateProbe(new.generation, True, None))
        assert w.sup.engine is new and w.sup.gate.limits.tokens == 0
        assert w.sup.status()["admission"]["max_tokens_in_flight"] is None
    finally:
        w.loop.close()


def test_a_configured_token_budget_below_the_thin_standbys_cache_is_kept(
        tmp_path: Path) -> None:
    """The thin standby's KV cache bounds the budget, never raises it."""
    w = World(tmp_path, fronted=True, engine=THIN,
              proxy={"max_tokens_in_flight": 100_000})
    try:
        full, thin = armed_asleep(w, side_by_side=True)
        thin.kv_tokens = 189_104
        w.now += 5
        w.feed(Exited(full.generation, 0))
        assert w.sup.engine is thin and w.sup.gate.limits.tokens == 100_000
        thin.kv_tokens = 50_048
        w.sup.sync_capacity()
        assert w.sup.gate.limits.tokens == 50_048
    finally:
        w.loop.close()
