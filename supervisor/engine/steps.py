"""What the engine pair's deciders ask their unit to do: steps, as data.

`Handover` (`supervisor/engine/pair/handover.py`: the standby and every handover to it),
`Failures` (`supervisor/engine/failures.py`: the backoff after a failure, giving up) and
`Remedies` (`supervisor/engine/remedies.py`: what the watchdog asks) read the unit's
state as `PairFacts`, a snapshot they cannot change, and return the steps that follow
from an event. The unit's one executor (`EngineUnit.run_steps`) carries them out in order: it
alone writes the unit's state (its lifecycle, its serving place, the restart's deadline,
the gate's admission, the backoff timer). A step that belongs to another decider (a
failed takeover is a failure; giving up abandons the standby) goes through the executor
too, so the deciders never call each other. Frozen values; nothing here acts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from supervisor.engine.events import DecisionRecord, Event
from supervisor.engine.intents import EvidenceFor
from supervisor.engine.pair import outcomes as out
from supervisor.engine.pair.slot import SlotView
from supervisor.engine.process import process as eng
from supervisor.engine.process import takedown
from supervisor.engine.states import State
from supervisor.settings.config import Config
from supervisor.settings.sections import EngineConfig


@dataclass(frozen=True)
class PairFacts:
    """The unit's state as its deciders read it, at one moment."""

    state: State
    slot: SlotView  # the serving engine's place, as it was at this moment
    config: Config
    environ: Mapping[str, str]
    fronted: bool  # a front proxy holds this engine's requests
    now: float  # monotonic
    stop_deadline: float | None  # the restart or stop under way's, if any
    restart_reason: str
    # what an engine started now in each engine bay runs with (`UnitState.engine_config`),
    # by bay: values, read at this moment
    engine_configs: tuple[EngineConfig, ...]
    # ... and a standby started now there (`standby_args` applied: a thinner one)
    standby_configs: tuple[EngineConfig, ...]
    evidence_s: float = 0.0  # the evidence a take-down captures first, its budget
    # the least memory free on one of the engine's GPUs, as NVML's last fresh reading
    # said (None: no fresh reading, or no GPU)
    card_free_bytes: int | None = None

    def engine_config(self, bay: int) -> EngineConfig:
        return self.engine_configs[bay]

    def standby_config(self, bay: int) -> EngineConfig:
        return self.standby_configs[bay]

    @property
    def engine(self) -> eng.EngineProcess | None:
        return self.slot.engine

    @property
    def generation(self) -> int:
        return self.slot.generation

    def restart_deadline(self, proxy_drain: bool) -> float:
        """The one deadline of the restart or stop under way, or of one beginning now:
        every step of it keeps within what is left (`process.stop_budget_s`)."""
        if self.stop_deadline is not None:
            return self.stop_deadline
        e = self.engine
        return self.now + takedown.stop_budget_s(e.config if e is not None else self.config.engine,
                                            proxy_drain=proxy_drain,
                                            evidence_s=self.evidence_s)

    def standby_deadline(self) -> float:
        """The deadline of a take-down in the standby's place, from now (no drain)."""
        return self.now + takedown.stop_budget_s(self.config.engine, proxy_drain=False,
                                            evidence_s=0.0)

    def spawn_spec(self, bay: int) -> eng.SpawnSpec:
        return eng.build_spawn_spec(self.engine_config(bay), self.environ)

    def standby_spec(self, bay: int) -> eng.SpawnSpec:
        """A standby's spawn: thin when the pair is asymmetric."""
        spec = eng.build_spawn_spec(self.standby_config(bay), self.environ)
        return dataclasses.replace(spec, thin=True) if self.thin_pair else spec

    @property
    def thin_pair(self) -> bool:
        """The standby is thinner than the engine (`engine.standby_args`)."""
        return bool(self.config.engine.standby_args) and self.config.engine.standby != "none"


# ---- the lifecycle -----------------------------------------------------------------

@dataclass(frozen=True)
class SetState:
    state: State
    reason: str


@dataclass(frozen=True)
class Decide:
    """The unit's last decision (for `status`)."""

    action: str
    reason: str


@dataclass(frozen=True)
class Record:
    """The policy decided, with its evidence: the unit's last decision."""

    record: DecisionRecord


@dataclass(frozen=True)
class Audit:
    event: str
    fields: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class CountRestart:
    reason: str  # the restart's label (crash, boot_failure, policy, an upgrade's)


@dataclass(frozen=True)
class CountOomDeath:
    """An engine of the unit died unasked while the kernel's OOM killer ran."""


@dataclass(frozen=True)
class StartEngine:
    """A cold start (STARTING; its standby first when two do not fit)."""

    reason: str


@dataclass(frozen=True)
class SpawnServing:
    """The serving engine's spawn, in the serving place (beside its sleeping standby)."""


@dataclass(frozen=True)
class RestartEngine:
    reason: str
    graceful: bool = True


@dataclass(frozen=True)
class RestartReason:
    """Why the restart beginning now began (the next start's reason)."""

    reason: str


@dataclass(frozen=True)
class RestartFailed:
    """A restart asked in BACKOFF or FATAL: the failure decider's (`Failures.restart`)."""

    reason: str


@dataclass(frozen=True)
class FailOver:
    """The standby takes over (`Handover.fail_over`, with the unit as it is then)."""

    reason: str
    graceful: bool
    drain_behind: bool = False


@dataclass(frozen=True)
class SwapOrTakeDown:
    """The standby takes over if it is ready and up to date, else the engine is taken
    down for a cold start (`Handover.swap_or_take_down`)."""

    graceful: bool


@dataclass(frozen=True)
class Drain:
    """The requests at `engine` finish there, up to `deadline`; then it is taken down
    (`Drained` answers)."""

    engine: eng.EngineProcess
    deadline: float


@dataclass(frozen=True)
class ForceStop:
    """A second stop while one runs: the take-down in flight skips to SIGKILL."""

    reason: str


@dataclass(frozen=True)
class EndBackoff:
    """The backoff under way, if any, is over without a start (`Failures`)."""


@dataclass(frozen=True)
class NotifyStopping:
    """systemd is told the daemon stops, and why."""

    status: str


@dataclass(frozen=True)
class StopDeadline:
    """The restart or stop beginning now ends by `at` (kept if one is under way)."""

    at: float


@dataclass(frozen=True)
class EndStopDeadline:
    """The restart or stop under way has taken its engine down: its deadline is spent."""


@dataclass(frozen=True)
class TakeDown:
    """The serving engine taken down, within the restart's deadline."""

    graceful: bool


@dataclass(frozen=True)
class DumpIn:
    """The engine in `bay` (a sleeping standby, `standby = "snapshot"`) kept as images
    in `snapshot.images`, which ends it; its take-down follows (`Effects.dump`: `Down`
    says how the dump went). `made`: what it is, kept with the images."""

    bay: int
    snapshot: eng.Restore
    made: Mapping[str, str]
    deadline: float


@dataclass(frozen=True)
class TakeDownIn:
    """The engine in `bay` taken down (the standby's place: a failed standby, the old
    serving engine behind a failover), with the evidence its fault asked for unless
    `evidence` is off (a role retiring its own engine). Nothing when that engine is
    already being taken down, or gone, by the time the step is carried out."""

    bay: int
    graceful: bool
    deadline: float
    evidence: bool = True


@dataclass(frozen=True)
class ArmStandby:
    """A standby started in its place if one is due (`Handover.arm`), as the unit is
    when this step is carried out."""


@dataclass(frozen=True)
class Spawn:
    """An engine started in `bay` (a standby's place, the weight cache's)."""

    bay: int
    spec: eng.SpawnSpec
    config: EngineConfig


@dataclass(frozen=True)
class Sleep:
    """`engine` put to sleep (`Slept` answers)."""

    engine: eng.EngineProcess


@dataclass(frozen=True)
class WatchProcess:
    """`engine`'s process watched: its exit, its tree, its output (`Exited`, `TreeSeen`,
    `CoreExited` answer)."""

    engine: eng.EngineProcess


@dataclass(frozen=True)
class Forget:
    """`engine`'s tree is proven gone: its state file and guard dropped."""

    engine: eng.EngineProcess


def lifecycle(outcome: out.Outcome) -> list[Step]:
    """What every bay's process needs after its bay read an event (`EngineSlot.on`),
    whatever its role: its jobs watched once it is up; its state file and guard dropped
    once its tree is proven gone (one not proven keeps them: the next start's leftover
    check finds it). The unit runs these before the role's own steps."""
    match outcome:
        case out.Up(engine):
            return [WatchProcess(engine)]
        case out.Gone(engine, None):
            return [Forget(engine)]
        case out.Died(engine) if engine.oom_killed:
            return [CountOomDeath()]
    return []


@dataclass(frozen=True)
class WatchHealth:
    """`engine`'s /health kept polled (`HealthLost` after a few misses)."""

    engine: eng.EngineProcess


@dataclass(frozen=True)
class ArmTimer:
    """`event` after `delay_s`, on the timer named `key` (a role's backoff); one armed
    before under that name is cancelled."""

    key: str
    delay_s: float
    event: Event


@dataclass(frozen=True)
class CancelTimer:
    key: str


@dataclass(frozen=True)
class CaptureEvidence:
    """The serving engine's next take-down captures evidence for (rule, reason) first."""

    evidence: EvidenceFor


@dataclass(frozen=True)
class ServeFrom:
    """A failover: the standby's bay is the serving one now, and the serving one the
    standby's (its engine to be taken down there, or kept: the unit swaps the two)."""


@dataclass(frozen=True)
class MaybeFinishStop:
    """STOPPED once both places are empty; `failed`: the daemon then exits 1 (a tree
    not proven gone)."""

    failed: bool = False


@dataclass(frozen=True)
class Started:
    """The serving engine was spawned: its GPUs were free (`Failures.started`)."""


@dataclass(frozen=True)
class StartRefused:
    """Another program holds the engine's GPUs (`Failures.start_refused`)."""

    why: str


@dataclass(frozen=True)
class EngineHealthy:
    """The serving engine answered /health: its start recorded (its length, what its
    development routes say a standby can do, where its weights came from)."""

    engine: eng.EngineProcess


@dataclass(frozen=True)
class GoldenFailed:
    """The serving engine's proof failed the golden check: one more in a row."""


@dataclass(frozen=True)
class GoldenPassed:
    """The serving engine's proof passed the golden check: none in a row."""


@dataclass(frozen=True)
class HandoverDone:
    """The serving engine was proven: a handover under way is over (`Handover.done`)."""


@dataclass(frozen=True)
class ServingFailed:
    """The serving engine failed outside a failover: a handover to it under way is over
    (`Handover.serving_failed`)."""


@dataclass(frozen=True)
class FailedDown:
    """The failed engine's tree is gone, in BACKOFF or FATAL (`Failures.down`)."""

    engine: eng.EngineProcess
    problem: str | None


@dataclass(frozen=True)
class NotifyReady:
    """systemd's start returns, its status saying `text` (once per daemon start)."""

    text: str


# ---- another decider's --------------------------------------------------------------

@dataclass(frozen=True)
class Fail:
    """The engine failed (`Failures.fail`): back off or give up."""

    reason: str
    healthy_for: float | None


@dataclass(frozen=True)
class GiveUp:
    """FATAL (`Failures.give_up`), with the last error lines of `engine` (default: the
    serving one)."""

    reason: str
    engine: eng.EngineProcess | None = None


@dataclass(frozen=True)
class Abandon:
    """No more standby for now (`Handover.abandon`)."""

    why: str
    deadline: float


@dataclass(frozen=True)
class Upgrade:
    """What the engine runs changed: through a standby with the new arguments
    (`Handover.begin_upgrade`) when one can begin, else the steps `otherwise`."""

    why: str
    label: str
    otherwise: tuple[Step, ...]


# ---- the proxy and the engines' jobs ---------------------------------------------------

@dataclass(frozen=True)
class Admit:
    """The engine proved itself: held requests may go (`GateKeeper.admit`)."""


@dataclass(frozen=True)
class Follow:
    """The proxy's route for this engine goes to `engine` now."""

    engine: eng.EngineProcess


@dataclass(frozen=True)
class Serve:
    """`engine` serves: its watchers start (metrics, canary, progress)."""

    engine: eng.EngineProcess


@dataclass(frozen=True)
class ProbeGate:
    """A first generation at `engine`: held requests go once it answered. `golden`: and
    the golden check (not for an awake standby taking over: it passed it when it became
    ready, and has not changed since; every held request waits for this proof)."""

    engine: eng.EngineProcess
    golden: bool = True
    warm: bool = False  # after one sleep and wake, where the engine has sleep mode
    # a standby woken to take over, clients waiting: its golden answers on one route are
    # the proof, no canary before them (`golden.AFTER_WAKE`)
    woken: bool = False
    # it will sleep again (a standby to be dumped asleep): the warm-up's pinned host copy
    # of its weights is kept for that sleep, even where its KV reset would pause it
    sleeps_later: bool = False


@dataclass(frozen=True)
class Wake:
    """Wake a sleeping `engine`: all of it, or only the memory of `tags` (vLLM's
    `/wake_up?tags=`: "weights" alone while the old engine's memory is still being
    released, then "kv_cache")."""

    engine: eng.EngineProcess
    tags: tuple[str, ...] = ()


@dataclass(frozen=True)
class EmptyHostCache:
    """Empty `engine`'s pinned host cache (its weights' backup, kept by torch after their
    wake), through its worker extension (`engine/process/host_cache.py`): asked of a
    standby that serves nobody."""

    engine: eng.EngineProcess


@dataclass(frozen=True)
class DrainBehind:
    """The requests at the old `engine` behind a swap finish there, up to `deadline`."""

    engine: eng.EngineProcess
    deadline: float


@dataclass(frozen=True)
class SyncGate:
    """The gate follows the watchdog's hold or throttle now (not only after the event)."""


@dataclass(frozen=True)
class PauseStreams:
    """Every stream of `engine` the proxy can continue leaves it now, to go on once
    `why` is over (on the engine that serves then)."""

    engine: eng.EngineProcess
    why: str


@dataclass(frozen=True)
class StartRemedy:
    """An in-place remedy on the serving engine (a KV reset, a prefix-cache reset)."""

    rung: str
    ways: tuple[str, ...] = ()  # a KV reset's (`BeginRemedy.ways`)


@dataclass(frozen=True)
class Throttle:
    """The throttle level changed: in force at the gate now, audited as a remedy."""

    rule: str
    level: int


@dataclass(frozen=True)
class RelaunchBegin:
    """The policy's relaunch begins (audited once when it ends: `RelaunchLog`)."""

    rung: str
    reason: str


@dataclass(frozen=True)
class Relaunch:
    """A step of the policy's relaunch under way, for its audit (`RelaunchLog`)."""

    step: Literal["standby_ready", "taken_down", "down"]


@dataclass(frozen=True)
class RelaunchFinish:
    outcome: str
    error: str | None


def proof(engine: eng.EngineProcess, *, prove: bool, golden: bool = True,
          warm: bool = False, woken: bool = False) -> list[Step]:
    """Healthy, then proven: held requests go once `engine` answered a first generation
    (`ProbeGate`, with the golden check unless `golden` is False; `warm`: after one sleep
    and wake), or at once when nothing proves it (`prove` False: no canary, healthy is
    all that is known). The one ending of a start's engine (`serving.on_process`) and of
    a standby that took over (`Handover._serve`)."""
    if prove:
        return [ProbeGate(engine, golden=golden, warm=warm, woken=woken)]
    return [Admit(), RelaunchFinish("ok", None)]


Step = (SetState | Decide | Record | Audit | CountRestart | CountOomDeath | StartEngine
        | SpawnServing
        | RestartEngine | RestartReason | RestartFailed | FailOver | SwapOrTakeDown | Drain
        | ForceStop | EndBackoff | NotifyStopping | StopDeadline | EndStopDeadline
        | TakeDown | TakeDownIn | DumpIn
        | Spawn | WatchProcess | Forget | Sleep | WatchHealth
        | ArmTimer | CancelTimer | ArmStandby | CaptureEvidence | ServeFrom
        | MaybeFinishStop | Started | StartRefused | EngineHealthy | GoldenFailed
        | GoldenPassed | HandoverDone | ServingFailed
        | FailedDown | NotifyReady | Fail | GiveUp | Abandon | Upgrade
        | Admit | Follow | Serve | ProbeGate | Wake | EmptyHostCache | DrainBehind | SyncGate
        | PauseStreams | StartRemedy | Throttle | RelaunchBegin | Relaunch | RelaunchFinish)
