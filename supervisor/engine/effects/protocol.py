"""An engine unit's effects on the world, behind one protocol.

Every process, socket, timer and call to the front proxy that a unit's task sets going
goes through `Effects`: each call starts a job that reports back only by putting an
event on the queue (`supervisor/engine/events.py`) and returns at once, or (the proxy's
`follow` and `pause_streams`, `kill_now`) acts at once. The daemon's implementation is
`JobEffects` (`supervisor/engine/effects/jobs.py`: the jobs themselves; those that talk to an
engine over HTTP in `supervisor/engine/effects/http_jobs.py`); tests pass a recording
fake (`tests/unit_world.py`) and feed the events by hand, with a driven clock,
so the lifecycle is tested without a process. It holds no state the unit reads but the
count of the daemon's own generations at the engine (`probes_in_flight`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any, Protocol

from supervisor.engine.events import Event
from supervisor.engine.process.process import EngineProcess, Restore, SpawnSpec
from supervisor.settings.sections import EngineConfig
from supervisor.watchdog import evidence
from supervisor.watchdog.gpu import GpuSampler


class Timer(Protocol):
    def cancel(self) -> Any: ...


class Front(Protocol):
    """The front proxy as the effects reach it (`supervisor/front/proxy.py`)."""

    def follow_engine(self, name: str, upstream: str, models: tuple[str, ...],
                      models_open: bool = False, priority_scheduling: bool = False
                      ) -> None: ...

    def pause_streams(self, engine: str) -> int | None: ...

    def in_flight_at(self, engine: str, generation: int) -> int: ...


class Effects(Protocol):
    def begin(self) -> dict[str, Any]:
        """The unit starts: arm what guards its engines (fields for its first log line)."""

    async def end(self) -> None:
        """The unit ends: every job cancelled and awaited, the guard closed."""

    def tick_every(self, interval_s: float) -> None:
        """`Tick` on the queue every `interval_s`, for as long as the unit runs."""

    def spawn(self, generation: int, spec: SpawnSpec, cfg: EngineConfig, bay: int) -> None:
        """Clean up the leftovers of `bay` (0, or 1: a standby's second place; 2: the
        weight cache's), check the port and GPUs, start the process there: `Spawned`."""

    def watch(self, engine: EngineProcess) -> None:
        """Guard its group against the daemon's death, relay its output, watch its exit,
        first health and tree: `Exited`, `HealthResult`, `TreeSeen`."""

    def watch_health(self, engine: EngineProcess) -> None:
        """Keep polling its /health once it answered 200 (the weight cache's): `HealthLost`
        after a few misses in a row."""

    def serve(self, engine: EngineProcess) -> None:
        """It serves: scrape its metrics, run the canary, probe its sleep mode, as the
        current config says: `MetricsSampled`, `CanaryDone`, `SleepModeProbed`."""

    def gate_probe(self, engine: EngineProcess, golden: bool = True,
                   warm: bool = False, woken: bool = False,
                   sleeps_later: bool = False) -> None:
        """One canary before held requests are let through: `GateProbe`; with `golden`,
        the golden check's answers too (`supervisor/watchdog/golden.py`); with `warm`,
        after one sleep and wake of an engine that has sleep mode (the first sleep's
        cost paid before it serves; the pinned host copy it leaves let go where the
        engine's KV reset pauses it, unless it `sleeps_later`); `woken` (a standby woken
        to take over): the golden answers on one route are the proof, the canary only
        where they give none."""

    def sleep(self, engine: EngineProcess) -> None:
        """Put a proven standby to sleep (vLLM's sleep mode, level 1): `Slept`."""

    def wake(self, engine: EngineProcess, tags: tuple[str, ...] = ()) -> None:
        """Wake a sleeping standby (only the memory of `tags`, when given): `Woken` (its
        generation proves it afterwards)."""

    def empty_host_cache(self, engine: EngineProcess) -> None:
        """Empty its pinned host cache through its worker extension: `HostCacheEmptied`."""

    def take_down(self, engine: EngineProcess, graceful: bool, force: asyncio.Event,
                  req: evidence.EvidenceRequest | None, deadline: float) -> None:
        """Evidence first when asked, then drain, SIGTERM, SIGKILL the group, reap and
        prove the tree gone (and its GPU memory released), by `deadline` (the unit's
        monotonic clock) as far as a kill allows: `EvidenceCaptured`, `Down`."""

    def dump(self, engine: EngineProcess, snapshot: Restore, made: Mapping[str, str],
             deadline: float) -> None:
        """The engine's tree kept as images to restore copies of (`snapshot.images`;
        its GPU state taken off first), which ends it; then its take-down proves it
        gone: `Down` with `dumped_s`, or `dump_error` (the tree then taken down as it
        ran)."""

    def forget(self, engine: EngineProcess) -> None:
        """Its tree is proven gone: drop the state file, disarm the guard."""

    def drain(self, engine: EngineProcess, deadline: float) -> None:
        """Wait for the requests in flight at the proxy, up to the engine's drain timeout
        and `deadline`: `Drained`."""

    def drain_behind(self, engine: EngineProcess, deadline: float) -> None:
        """After a swap to the standby: wait for the requests the proxy sent to `engine`
        (the old one; new requests go to the standby meanwhile) to end, up to its drain
        timeout and `deadline`: `Drained` with its generation."""

    def remedy(self, engine: EngineProcess, rung: str, ways: tuple[str, ...]) -> None:
        """An in-place remedy (prefix-cache reset; KV reset, by `ways`, in order: "pause",
        "sleep"): `RemedyDone`."""

    def follow(self, engine: EngineProcess) -> None:
        """The proxy's route for this engine goes to `engine`'s address and models."""

    def pause_streams(self, engine: EngineProcess) -> int | None:
        """A drained restart: the continuable streams at `engine` leave it now, to go on
        on the next engine. How many (None: each proxy worker logs its own count)."""

    def kill_now(self, engine: EngineProcess) -> None:
        """SIGKILL the engine's group at once (the unit itself is failing)."""

    def probes_in_flight(self) -> int:
        """The daemon's own generations (canaries) at the engine now."""

    def after(self, delay_s: float, event: Event) -> Timer:
        """`event` on the queue once `delay_s` has passed, unless cancelled first."""

    def sample_gpu(self, sampler: GpuSampler) -> None:
        """Sample the GPU every `gpu.period_s` for as long as the unit runs: `GpuSampled`."""

