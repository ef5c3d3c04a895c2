"""The supervisor's effects on the world, behind one protocol.

Every process, socket and timer the supervisor's task sets going goes through `Effects`:
each call starts a job that reports back only by putting an event on the queue
(`supervisor/engine/events.py`), and returns at once. The daemon's implementation is
`JobEffects` (`supervisor/engine/unit.py`: the jobs themselves); tests pass a recording fake
(`tests/test_supervisor_unit.py`) and feed the events by hand, with a driven clock, so
the lifecycle is tested without a process. Must never hold state of its own that the
supervisor reads.
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

from supervisor.config import EngineConfig
from supervisor.engine.events import Event
from supervisor.engine.process import EngineProcess, SpawnSpec
from supervisor.watchdog import evidence
from supervisor.watchdog.gpu import GpuSampler


class Timer(Protocol):
    def cancel(self) -> Any: ...


class Effects(Protocol):
    def spawn(self, generation: int, spec: SpawnSpec, cfg: EngineConfig) -> None:
        """Clean up leftovers, check the port and GPUs, start the engine: `Spawned`."""

    def watch(self, engine: EngineProcess) -> None:
        """Guard its group against the daemon's death, relay its output, watch its exit,
        first health and tree: `Exited`, `HealthResult`, `TreeSeen`."""

    def serve(self, engine: EngineProcess) -> None:
        """It serves: scrape its metrics, run the canary, probe its sleep mode, as the
        current config says: `MetricsSampled`, `CanaryDone`, `SleepModeProbed`."""

    def gate_probe(self, engine: EngineProcess) -> None:
        """One canary before held requests are let through: `GateProbe`."""

    def take_down(self, engine: EngineProcess, graceful: bool, force: asyncio.Event,
                  req: evidence.EvidenceRequest | None) -> None:
        """Evidence first when asked, then drain, SIGTERM, SIGKILL the group, reap and
        prove the tree gone (and its GPU memory released): `EvidenceCaptured`, `Down`."""

    def forget(self, engine: EngineProcess) -> None:
        """Its tree is proven gone: drop the state file, disarm the guard."""

    def drain(self, engine: EngineProcess) -> None:
        """Wait (bounded) for the requests in flight at the proxy: `Drained`."""

    def remedy(self, engine: EngineProcess, rung: str) -> None:
        """An in-place remedy (prefix-cache reset, KV reset): `RemedyDone`."""

    def after(self, delay_s: float, event: Event) -> Timer:
        """`event` on the queue once `delay_s` has passed, unless cancelled first."""

    def sample_gpu(self, sampler: GpuSampler) -> None:
        """Sample the GPU every `gpu.period_s` for as long as the unit runs: `GpuSampled`."""

