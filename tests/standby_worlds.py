"""The standby's states that the unit tests of the pair start from (tests/test_standby*.py,
tests/test_thin_pair.py, tests/test_golden.py): a ready standby, a pair proven and asleep
(side by side or the standby first), a crash and the wake after it, a pair unprotected
after a crash, a snapshot standby asleep and dumped. Over tests/unit_world.py's
`World`: recorded effects, a driven clock, no process."""

from __future__ import annotations

from typing import Any

from supervisor.engine.events import (
    Down,
    Exited,
    GateProbe,
    HealthResult,
    Slept,
    Woken,
)
from supervisor.engine.process.process import EngineProcess
from supervisor.engine.process.takedown import TakeDown
from tests.unit_world import World

SLEEP = {"standby": "sleep", "env": {"VLLM_SERVER_DEV_MODE": "1"}}


def ready_standby(w: World) -> EngineProcess:
    """The standby spawned, healthy and proven by its first generation: ready."""
    spare = w.spawned()
    w.feed(HealthResult(spare.generation, True))
    w.feed(GateProbe(spare.generation, True, None))
    return spare




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
