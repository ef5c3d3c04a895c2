"""The typed events that reach the supervisor's one queue, and the record of its last
decision.

Every job, signal handler, control request and timer reports to `EngineUnit` only by
putting one of these on its queue; each `name` selects the `handle_<name>` method that
takes it (docs/lifecycle.md). Frozen values, no behaviour: this module imports no
lifecycle code.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, ClassVar

from supervisor.engine.process import kv_tier, proctree, takedown
from supervisor.engine.process import process as eng
from supervisor.ops.exposition import ExporterView
from supervisor.settings.config import Config
from supervisor.watchdog import canary, evidence, remedy, warmup
from supervisor.watchdog.devroutes import DevRoutes
from supervisor.watchdog.golden import Golden
from supervisor.watchdog.gpu import GpuReading
from supervisor.watchdog.metrics import Snapshot

# ---- events ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Event:
    name: ClassVar[str]


@dataclass(frozen=True)
class Spawned(Event):
    name = "spawned"
    generation: int
    engine: eng.EngineProcess | None
    error: str | None = None
    leftovers: tuple[str, ...] = ()
    gpu_busy: bool = False  # the error is other processes on the engine's GPUs


@dataclass(frozen=True)
class Exited(Event):
    name = "exited"
    generation: int
    code: int
    oom_kills: int | None = None  # the host's OOM kills as the exit was seen (hostmem.py)


@dataclass(frozen=True)
class CoreExited(Event):
    """The engine's `VLLM::EngineCore` ended while its API server may still be up
    (`supervisor/engine/process/corewatch.py`)."""
    name = "core_exited"
    generation: int
    pid: int
    oom_kills: int | None = None  # the host's OOM kills as the exit was seen (hostmem.py)


@dataclass(frozen=True)
class HealthResult(Event):
    name = "health_result"
    generation: int
    healthy: bool
    # healthy: which of vLLM's development routes it serves (`watchdog/devroutes.py`),
    # asked before this event is sent; None when not asked
    routes: DevRoutes | None = None
    # not healthy, though it runs: why its start is over before its startup timeout
    # (`process.start_given_up`); None: the timeout itself
    why: str | None = None
    # healthy: the max_model_len its /v1/models lists (None: not said, or not asked)
    max_model_len: int | None = None


@dataclass(frozen=True)
class MetricsSampled(Event):
    name = "metrics_sampled"
    generation: int
    snapshot: Snapshot | None
    error: str | None


@dataclass(frozen=True)
class TreeSeen(Event):
    name = "tree_seen"
    generation: int
    procs: tuple[proctree.ProcInfo, ...]
    at: float  # monotonic
    rss_bytes: int
    cpu_s: float  # CPU seconds used so far by the live processes
    host_temperature_c: float | None = None  # the hottest CPU/SoC sensor (hostheat.py)
    host_memory_stall_percent: float | None = None  # PSI's memory `full avg10` (hostmem.py)
    oom_kills: int | None = None  # the host's OOM kills since boot, at this look (hostmem.py)


@dataclass(frozen=True)
class EvidenceCaptured(Event):
    name = "evidence_captured"
    generation: int
    request: evidence.EvidenceRequest
    bundle: evidence.Bundle


@dataclass(frozen=True)
class CardReleased(Event):
    """An engine being taken down holds nothing of the GPU any more, its tree perhaps not
    gone yet: NVML, which had listed processes of its tree, lists none of them now, and
    none of them has the GPU's device files open (`takedown.card_released`). A sleeping
    standby waiting for that memory wakes on it instead of on the tree's end (`Down`)."""
    name = "card_released"
    generation: int
    after_s: float  # since its take-down began


@dataclass(frozen=True)
class Down(Event):
    name = "down"
    generation: int
    result: takedown.TakeDown | None
    error: str | None = None
    # a take-down that was a dump (`Effects.dump`): its seconds, or why it failed
    dumped_s: float | None = None
    dump_error: str | None = None


@dataclass(frozen=True)
class StandbyDue(Event):
    """Time to start the standby again after it failed."""

    name = "standby_due"


@dataclass(frozen=True)
class HealthLost(Event):
    """A process that answered /health stopped answering 200 (the weight cache's: a
    rank of it died while its launcher lives on)."""

    name = "health_lost"
    generation: int
    why: str


@dataclass(frozen=True)
class CacheDue(Event):
    """Time to start the weight cache again after it failed."""

    name = "cache_due"


@dataclass(frozen=True)
class BackoffElapsed(Event):
    name = "backoff_elapsed"
    generation: int


@dataclass(frozen=True)
class SignalReceived(Event):
    name = "signal_received"
    signum: int


@dataclass(frozen=True)
class ControlRequest(Event):
    name = "control_request"
    command: str
    args: dict[str, Any]
    reply: asyncio.Future[dict[str, Any]]


@dataclass(frozen=True)
class Reloaded(Event):
    name = "reloaded"
    config: Config | None
    error: str | None
    reply: asyncio.Future[dict[str, Any]] | None


@dataclass(frozen=True)
class Tick(Event):
    name = "tick"


@dataclass(frozen=True)
class KvTierSeen(Event):
    """The engine's KV tier folder as its keeper last saw (and pruned) it."""

    name = "kv_tier_seen"
    folder: str
    usage: kv_tier.Usage


@dataclass(frozen=True)
class CanaryDone(Event):
    name = "canary_done"
    generation: int
    outcome: canary.CanaryOutcome
    started: float  # monotonic
    ended: float


@dataclass(frozen=True)
class GpuSampled(Event):
    name = "gpu_sampled"
    reading: GpuReading
    at: float


@dataclass(frozen=True)
class RemedyDone(Event):
    """An in-place remedy (prefix-cache reset, KV reset) ended, well or not."""

    name = "remedy_done"
    generation: int
    rung: str
    outcome: remedy.RemedyOutcome
    duration_s: float  # the whole remedy, the wait for in-flight requests included
    # a KV reset's answers to the golden prompt after its wake (the unit judges them)
    golden: Golden | str | None = None


@dataclass(frozen=True)
class SleepModeProbed(Event):
    """Whether this engine can drop its KV cache in place: by a sleep and a wake
    (`available`), by a pause and a resume (`pause`); why not, each."""

    name = "sleep_mode_probed"
    generation: int
    available: bool
    why: str | None
    pause: bool = False
    pause_why: str | None = None


@dataclass(frozen=True)
class Drained(Event):
    """The proxy has no request left at the engine (or the drain timeout ran out)."""

    name = "drained"
    generation: int
    idle: bool
    waited_s: float


@dataclass(frozen=True)
class Slept(Event):
    """A standby put to sleep (`POST /sleep?level=1`, then `/is_sleeping` says so)."""
    name = "slept"
    generation: int
    error: str | None  # None: asleep
    seconds: float  # the daemon's calls
    # what vLLM itself measured, by its operation (`sleep`); None: unknown
    vllm_s: Mapping[str, float] | None = None


@dataclass(frozen=True)
class Woken(Event):
    """A sleeping standby woken (`POST /wake_up`, then `/is_sleeping` says awake), or the
    memory of `tags` alone (`/wake_up?tags=weights`: it still sleeps after)."""
    name = "woken"
    generation: int
    error: str | None  # None: awake (with `tags`: that memory back)
    seconds: float  # the daemon's calls
    vllm_s: Mapping[str, float] | None = None  # vLLM's own (`wake`); None: unknown
    tags: tuple[str, ...] = ()  # (): the whole engine


@dataclass(frozen=True)
class HostCacheEmptied(Event):
    """The answer of `EmptyHostCache` (`engine/process/host_cache.py`): emptied by every
    worker, or why not; the daemon's seconds, and the workers' own (the longest)."""
    name = "host_cache_emptied"
    generation: int
    emptied: bool
    seconds: float
    worker_s: float | None = None
    error: str | None = None


@dataclass(frozen=True)
class GateProbe(Event):
    """The first canary of a new engine: its answer opens the gate (held requests go)."""

    name = "gate_probe"
    generation: int
    ok: bool
    error: str | None
    # its answers to the golden prompt (`supervisor/watchdog/golden.py`), or why there
    # are none; None when the check is off or the canary failed
    golden: Golden | str | None = None
    golden_mismatch: bool = False  # (set by the unit's GoldenCheck)
    # the engine failed after its warm-up wake: the wake failed, a canary after it did,
    # or its golden answers changed (set by the job, or by the unit's GoldenCheck)
    broken_by_wake: bool = False
    # the warm-up sleep and wake after the canary (`remedy.warm_up`), when one was asked,
    # and the golden answers after its wake
    warm_up: remedy.WarmUp | None = None
    golden_woken: Golden | str | None = None
    # every path a client may take, asked once before the canary (`watchdog/warmup.py`):
    # at an engine process's first proof only; None when not asked
    warmed: warmup.Warmed | None = None


@dataclass(frozen=True)
class ViewRequest(Event):
    name = "view_request"
    reply: asyncio.Future[ExporterView]


class CommandError(Exception):
    """A control request that cannot be carried out now; the message goes to the client."""


@dataclass
class DecisionRecord:
    """The last thing the daemon decided, for `status`: its own lifecycle steps and the
    policy's actions (with the rule and its evidence)."""

    action: str
    reason: str
    wall: float
    rule: str | None = None
    evidence: dict[str, Any] | None = None
    dry_run: bool = False

    def as_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"action": self.action, "reason": self.reason,
                             "time": iso_time(self.wall)}
        if self.rule is not None:
            d.update(rule=self.rule, evidence=self.evidence, dry_run=self.dry_run)
        return d


def iso_time(wall: float) -> str:
    return datetime.fromtimestamp(wall, UTC).isoformat(timespec="milliseconds")
