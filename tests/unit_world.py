"""One engine unit with no process at all (the unit tests' world): its effects recorded by
a fake (`RecordingEffects`, over `supervisor/engine/effects/protocol.py`), its events fed
by hand, its clock driven by the test (`FakeTimer`s fire when it says). `World` wraps the
unit, its loop and its fakes, with the moves most tests need (an engine spawned, healthy
and serving; a take-down answered; a control command)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections import deque
from pathlib import Path
from typing import Any

from supervisor.engine.events import (
    ControlRequest,
    Down,
    Event,
    HealthResult,
    Spawned,
)
from supervisor.engine.process.process import EngineProcess, SpawnSpec
from supervisor.engine.process.takedown import TakeDown
from supervisor.engine.unit import EngineUnit
from supervisor.loop import Clock
from supervisor.ops.sdnotify import Notifier
from supervisor.settings.config import parse_config
from supervisor.settings.sections import EngineConfig
from supervisor.watchdog import evidence
from supervisor.watchdog.gpu import NoGpu


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
        self.golden_asked: list[bool] = []  # each gate probe's: with the golden check?
        self.warm_asked: list[bool] = []  # each gate probe's: after a warm-up sleep?
        self.woken_asked: list[bool] = []  # each gate probe's: a woken takeover's?
        self.timers: list[FakeTimer] = []
        self.deadlines: list[float] = []  # of each drain and take-down, in order

    def names(self) -> list[str]:
        return [name for name, _ in self.calls]

    def last(self, name: str) -> dict[str, Any]:
        return next(d for n, d in reversed(self.calls) if n == name)

    def spawn(self, generation: int, spec: SpawnSpec, cfg: EngineConfig, bay: int) -> None:
        self.calls.append(("spawn", {"generation": generation, "spec": spec, "cfg": cfg,
                                     "bay": bay}))

    def watch(self, engine: EngineProcess) -> None:
        self.calls.append(("watch", {"pid": engine.pid}))

    def serve(self, engine: EngineProcess) -> None:
        self.calls.append(("serve", {"pid": engine.pid}))

    def watch_health(self, engine: EngineProcess) -> None:
        self.calls.append(("watch_health", {"pid": engine.pid}))

    def gate_probe(self, engine: EngineProcess, golden: bool = True,
                   warm: bool = False, woken: bool = False,
                   sleeps_later: bool = False) -> None:
        self.calls.append(("gate_probe", {"pid": engine.pid}))
        self.golden_asked.append(golden)
        self.warm_asked.append(warm)
        self.woken_asked.append(woken)

    def sleep(self, engine: EngineProcess) -> None:
        self.calls.append(("sleep", {"pid": engine.pid}))

    def wake(self, engine: EngineProcess, tags: tuple[str, ...] = ()) -> None:
        self.calls.append(("wake", {"pid": engine.pid, **({"tags": list(tags)} if tags else {})}))

    def empty_host_cache(self, engine: EngineProcess) -> None:
        self.calls.append(("empty_host_cache", {"pid": engine.pid}))

    def dump(self, engine: EngineProcess, snapshot: Any, made: Any, deadline: float) -> None:
        self.calls.append(("dump", {"pid": engine.pid, "images": snapshot.images}))
        self.deadlines.append(deadline)

    def take_down(self, engine: EngineProcess, graceful: bool, force: asyncio.Event,
                  req: evidence.EvidenceRequest | None, deadline: float) -> None:
        self.calls.append(("take_down", {"pid": engine.pid, "graceful": graceful,
                                         "evidence": req}))
        self.deadlines.append(deadline)

    def forget(self, engine: EngineProcess) -> None:
        self.calls.append(("forget", {"pid": engine.pid}))

    def drain(self, engine: EngineProcess, deadline: float) -> None:
        self.calls.append(("drain", {"pid": engine.pid}))
        self.deadlines.append(deadline)

    def drain_behind(self, engine: EngineProcess, deadline: float) -> None:
        self.calls.append(("drain_behind", {"pid": engine.pid}))
        self.deadlines.append(deadline)

    def remedy(self, engine: EngineProcess, rung: str, ways: tuple[str, ...]) -> None:
        self.calls.append(("remedy", {"pid": engine.pid, "rung": rung, "ways": ways}))

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

    def __init__(self, tmp: Path, fronted: bool = False, **sections: dict[str, Any]) -> None:
        doc: dict[str, dict[str, Any]] = {
            "engine": {"command": ["vllm", "serve", "m"], "port": 18100},
            "restart": {"backoff_initial_s": 1.0, "backoff_max_s": 8.0,
                        "boot_failures_max": 3, "boot_failure_window_s": 900},
            "daemon": {"runtime_dir": str(tmp / "run")},
            "control": {"socket": str(tmp / "run" / "c.sock")},
            "audit": {"path": str(tmp / "events.jsonl")},
            "gpu": {"sampler": "off"}, "proxy": {"enabled": fronted},
        }
        for name, table in sections.items():
            doc.setdefault(name, {}).update(table)
        self.doc = doc
        self.now = 1000.0
        self.fx = RecordingEffects()
        self.sup = EngineUnit(
            config=parse_config(doc, str(tmp / "config.toml"), tmp), notifier=Notifier({}),
            gpu=NoGpu(), clock=Clock(monotonic=lambda: self.now, wall=lambda: self.now),
            environ={}, effects=self.fx, fronted=fronted)
        self.next_pid = 4000
        self.loop = asyncio.new_event_loop()  # the replies' futures; it never runs

    @property
    def state(self) -> str:
        return self.sup.state.value

    def audit(self) -> list[dict[str, Any]]:
        """The audit trail's entries so far, oldest first."""
        path = Path(self.doc["audit"]["path"])
        return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []

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

    def last_timer_fires(self) -> None:
        """The last timer asked for (a backoff's, say) fires: the clock moved to it."""
        timer = self.fx.timers[-1]
        self.now += timer.delay_s
        self.feed(timer.event)

    def down(self, engine: EngineProcess) -> None:
        self.feed(Down(engine.generation, TakeDown(
            exit_code=engine.exit_code, survivors=[], gpu_holders={}, port_problem=None,
            duration_s=0.1, sigkilled=False)))

    def control(self, command: str, **args: Any) -> asyncio.Future[dict[str, Any]]:
        reply: asyncio.Future[dict[str, Any]] = self.loop.create_future()
        self.feed(ControlRequest(command, args, reply))
        return reply
