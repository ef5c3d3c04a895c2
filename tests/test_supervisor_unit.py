"""The supervisor's lifecycle with no process at all: its effects recorded by a fake
(`supervisor/engine/effects.py`), its events fed by hand, its clock driven by the test.

Each test states a transition and what the supervisor asked the world to do for it.
The same transitions run against real processes in tests/test_daemon.py and
tests/test_lifecycle.py; here they run in milliseconds and at exact virtual times.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from supervisor.config import EngineConfig, parse_config
from supervisor.engine.events import (
    BackoffElapsed,
    ControlRequest,
    Down,
    Event,
    Exited,
    HealthResult,
    Reloaded,
    RemedyDone,
    Spawned,
)
from supervisor.engine.process import EngineProcess, SpawnSpec, TakeDown
from supervisor.engine.unit import EngineUnit
from supervisor.loop import Clock
from supervisor.ops.sdnotify import Notifier
from supervisor.watchdog import evidence
from supervisor.watchdog.remedy import RemedyOutcome


@dataclasses.dataclass
class FakeTimer:
    delay_s: float
    event: Event
    cancelled: bool = False

    def cancel(self) -> None:
        self.cancelled = True


class RecordingEffects:
    """Every effect asked for, in order, as (name, details); nothing happens."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.timers: list[FakeTimer] = []

    def names(self) -> list[str]:
        return [name for name, _ in self.calls]

    def last(self, name: str) -> dict[str, Any]:
        return next(d for n, d in reversed(self.calls) if n == name)

    def spawn(self, generation: int, spec: SpawnSpec, cfg: EngineConfig) -> None:
        self.calls.append(("spawn", {"generation": generation, "spec": spec, "cfg": cfg}))

    def watch(self, engine: EngineProcess) -> None:
        self.calls.append(("watch", {"pid": engine.pid}))

    def serve(self, engine: EngineProcess) -> None:
        self.calls.append(("serve", {"pid": engine.pid}))

    def gate_probe(self, engine: EngineProcess) -> None:
        self.calls.append(("gate_probe", {"pid": engine.pid}))

    def take_down(self, engine: EngineProcess, graceful: bool, force: asyncio.Event,
                  req: evidence.EvidenceRequest | None) -> None:
        self.calls.append(("take_down", {"pid": engine.pid, "graceful": graceful,
                                         "evidence": req}))

    def forget(self, engine: EngineProcess) -> None:
        self.calls.append(("forget", {"pid": engine.pid}))

    def drain(self, engine: EngineProcess) -> None:
        self.calls.append(("drain", {"pid": engine.pid}))

    def remedy(self, engine: EngineProcess, rung: str) -> None:
        self.calls.append(("remedy", {"pid": engine.pid, "rung": rung}))

    def sample_gpu(self, sampler: Any) -> None:
        self.calls.append(("sample_gpu", {}))

    def begin(self) -> dict[str, Any]:
        self.calls.append(("begin", {}))
        return {}

    async def end(self) -> None:
        self.calls.append(("end", {}))

    def tick_every(self, interval_s: float) -> None:
        self.calls.append(("tick_every", {"interval_s": interval_s}))

    def follow(self, engine: EngineProcess) -> None:
        self.calls.append(("follow", {"pid": engine.pid}))

    def pause_streams(self, engine: EngineProcess) -> int:
        self.calls.append(("pause_streams", {"pid": engine.pid}))
        return 0

    def kill_now(self, engine: EngineProcess) -> None:
        self.calls.append(("kill_now", {"pid": engine.pid}))

    def probes_in_flight(self) -> int:
        return 0

    def after(self, delay_s: float, event: Event) -> FakeTimer:
        t = FakeTimer(delay_s, event)
        self.timers.append(t)
        self.calls.append(("after", {"delay_s": delay_s, "event": event}))
        return t


class World:
    """A supervisor, its recorded effects and a clock the test moves."""

    def __init__(self, tmp: Path, **sections: dict[str, Any]) -> None:
        doc: dict[str, dict[str, Any]] = {
            "engine": {"command": ["vllm", "serve", "m"], "port": 18100},
            "restart": {"backoff_initial_s": 1.0, "backoff_max_s": 8.0,
                        "boot_failures_max": 3, "boot_failure_window_s": 900},
            "daemon": {"runtime_dir": str(tmp / "run")},
            "control": {"socket": str(tmp / "run" / "c.sock")},
            "audit": {"path": str(tmp / "events.jsonl")},
            "gpu": {"sampler": "off"}, "proxy": {"enabled": False},
        }
        for name, table in sections.items():
            doc.setdefault(name, {}).update(table)
        self.doc = doc
        self.now = 1000.0
        self.fx = RecordingEffects()
        self.sup = EngineUnit(
            config=parse_config(doc, str(tmp / "config.toml"), tmp), notifier=Notifier({}),
            gpu=_NoGpu(), clock=Clock(monotonic=lambda: self.now, wall=lambda: self.now),
            environ={}, effects=self.fx)
        self.next_pid = 4000
        self.loop = asyncio.new_event_loop()  # the replies' futures; it never runs

    @property
    def state(self) -> str:
        return self.sup.state.value

    def feed(self, ev: Event) -> None:
        self.sup.handle(ev)

    def spawned(self) -> EngineProcess:
        """The engine the last `spawn` asked for, started."""
        spawn = self.fx.last("spawn")
        self.next_pid += 1
        engine = EngineProcess(generation=spawn["generation"], proc=None,  # type: ignore[arg-type]
                               pid=self.next_pid, started_at=self.now, spec=spawn["spec"],
                               config=spawn["cfg"], recent_errors=deque(maxlen=20))
        self.feed(Spawned(spawn["generation"], engine))
        return engine

    def serving(self) -> EngineProcess:
        """An engine serving: started first unless a spawn is already asked for."""
        if self.state == "STOPPED":
            self.sup.start("test")
        engine = self.spawned()
        self.now += 40
        self.feed(HealthResult(engine.generation, True))
        return engine

    def down(self, engine: EngineProcess) -> None:
        self.feed(Down(engine.generation, TakeDown(
            exit_code=engine.exit_code, survivors=[], gpu_holders={}, port_problem=None,
            duration_s=0.1, sigkilled=False)))

    def control(self, command: str, **args: Any) -> asyncio.Future[dict[str, Any]]:
        reply: asyncio.Future[dict[str, Any]] = self.loop.create_future()
        self.feed(ControlRequest(command, args, reply))
        return reply


class _NoGpu:
    def processes(self) -> dict[int, int] | None:
        return None


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


def test_a_failed_in_place_remedy_becomes_a_drained_restart(world: World) -> None:
    engine = world.serving()
    world.sup.begin_remedy("reset_prefix_cache", "test")
    assert world.fx.last("remedy") == {"pid": engine.pid, "rung": "reset_prefix_cache"}
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
        unit = EngineUnit(config=cfg.for_engine("b"), notifier=Notifier({}), gpu=_NoGpu(),
                          clock=Clock(monotonic=lambda: w.now, wall=lambda: w.now),
                          environ={}, effects=w.fx, name="b")
        assert Path(unit.config.state_file).name == "engine-tree-b.json"
        unit.start("test")
        assert w.fx.last("spawn")["spec"].port == 18102
        records = [json.loads(x) for x in (tmp_path / "events.jsonl").read_text().splitlines()]
        assert records[-1]["engine"] == "b" and records[-1]["to"] == "STARTING"
    finally:
        w.loop.close()
