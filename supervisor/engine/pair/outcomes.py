"""What one event of an engine process did to its bay: the one reading of a process's
life (spawned, healthy or not, died unasked, seen, gone) that every bay's role acts on.

`EngineSlot.on` turns a process event (`Spawned`, `HealthResult`, `Exited`, `CoreExited`,
`TreeSeen`, `CardReleased`, `Down`) into one of these, once, for every bay, in one place
(the unit's `_on_process`, which also carries out `steps.lifecycle`); the role in the bay
then says what it does with it in one `match`: the serving engine's
(`supervisor/engine/pair/serving.py`), the standby's (`supervisor/engine/pair/standby.py`)
and the weight cache's (`supervisor/engine/pair/weight_cache.py`). A new role is a new
`match` and its `reads` (whether it awaits health, whether an exit is expected), not
another copy of the reading.

| event | when it counts | outcome |
|---|---|---|
| Spawned | (ends the spawn) | `Up`, or `SpawnFailed` |
| HealthResult | the role awaits health, no take-down | `Healthy` (marked so), `Unhealthy` |
| Exited | not asked: no take-down, none expected | `Died` |
| CoreExited | the same, the API server still up | `Died` (`core=True`) |
| TreeSeen | the engine of that generation | `Seen` |
| CardReleased | its take-down under way | `CardFreed` (its memory on the card released) |
| Down | (ends the take-down) | `Gone`, with why its tree is not proven gone |
| the rest, or a gone generation's | | `NOTHING` |
"""

from __future__ import annotations

from dataclasses import dataclass

from supervisor.engine.events import (
    CardReleased,
    CoreExited,
    Down,
    Exited,
    HealthResult,
    Spawned,
    TreeSeen,
)
from supervisor.engine.process import process as eng

# The events of a process's life, each read by `EngineSlot.on`.
PROCESS_EVENTS = (Spawned, HealthResult, Exited, CoreExited, TreeSeen, CardReleased, Down)
ProcessEvent = (Spawned | HealthResult | Exited | CoreExited | TreeSeen | CardReleased
                | Down)


@dataclass(frozen=True)
class Nothing:
    """Stale (an event of a process no longer in the bay), asked for, or not the role's
    moment: nothing to act on."""


NOTHING = Nothing()


@dataclass(frozen=True)
class SpawnFailed:
    error: str | None
    gpu_busy: bool  # refused because the GPU is not free (docs/lifecycle.md)


@dataclass(frozen=True)
class Up:
    engine: eng.EngineProcess


@dataclass(frozen=True)
class Healthy:
    engine: eng.EngineProcess  # `healthy_at` set, its development routes noted


@dataclass(frozen=True)
class Unhealthy:
    """Not healthy within its start, or its start given up, the process still running."""

    engine: eng.EngineProcess
    why: str
    timed_out: bool  # False: `why` is the health wait's own reason (a start given up)


@dataclass(frozen=True)
class Died:
    """Gone without being asked: its main process exited, or (`core`) its core died
    while the API server is still up."""

    engine: eng.EngineProcess
    why: str
    core: bool


@dataclass(frozen=True)
class Seen:
    engine: eng.EngineProcess
    tree: TreeSeen  # (its time, memory and the host's temperature)
    cpu_percent: float | None  # None: not known yet


@dataclass(frozen=True)
class CardFreed:
    """Being taken down, it holds nothing of the GPU any more (`CardReleased`): a wake that
    waited for its memory can begin; its tree may not be gone yet (`Gone` follows)."""

    engine: eng.EngineProcess
    after_s: float  # since its take-down began


@dataclass(frozen=True)
class Gone:
    """The take-down ended: the engine left the bay. `problem`: why its tree is not proven
    gone (None: it is). A take-down that was a dump (`DumpIn`) says how it went:
    `dumped_s`, or `dump_error`."""

    engine: eng.EngineProcess
    problem: str | None
    dumped_s: float | None = None
    dump_error: str | None = None


Outcome = Nothing | SpawnFailed | Up | Healthy | Unhealthy | Died | Seen | CardFreed | Gone
