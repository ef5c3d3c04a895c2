"""The watchdog half of one engine's unit: the signals kept from the engine's metrics,
the GPU and the canary; the policy evaluated every tick; the in-place remedies; the
settings the policy tunes (throttle level, reduced batch, speculative tokens).

`EngineWatch` owns all of that state, alone. It is called on its unit's task with the
events the unit hands it and a `UnitFacts` of the unit's own state, and it never
changes the unit: what it wants done comes back as intents (`supervisor/engine/intents.py`)
that the unit carries out (`supervisor/engine/remedies.py`). The decisions themselves are pure
(`supervisor/watchdog/policy.py`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import structlog

from supervisor.engine.events import (
    CanaryDone,
    DecisionRecord,
    GpuSampled,
    MetricsSampled,
    RemedyDone,
    SleepModeProbed,
)
from supervisor.engine.intents import (
    BeginRemedy,
    Decided,
    EvidenceFor,
    HoldDown,
    Intent,
    Restart,
    Throttled,
    remedy_ended,
)
from supervisor.engine.process import process as eng
from supervisor.engine.states import State
from supervisor.settings.config import Config
from supervisor.watchdog import devroutes, relaunch, xid
from supervisor.watchdog.policy import EngineFacts, PolicyMemory, PolicyState, decide
from supervisor.watchdog.poller import NO_ANSWER, ScrapeHealth
from supervisor.watchdog.signal_list import Signals
from supervisor.watchdog.signals import SignalWindow

log = structlog.get_logger("supervisor")

# why a KV reset waits (`EngineFacts.api_silent`): an API server that does not answer
# would not answer the reset's pause either
API_SILENT = "the engine did not answer its last /metrics scrape"


@dataclass(frozen=True)
class UnitFacts:
    """What the watchdog reads of its unit, handed to it with each call."""

    state: State
    engine: eng.EngineProcess | None  # the current engine; None between two
    taking_down: bool
    fronted: bool  # a front proxy holds requests for this engine
    at_engine: int  # requests the daemon knows are at the engine (the gate's + canaries)
    # the engine serves (RUNNING) but its proof (warm-up, canary, golden check) has not
    # let clients in yet
    proving: bool = False

    def settled(self) -> bool:
        """The engine serves: proven, clients let in (its memory now a growth point)."""
        return self.state is State.RUNNING and not self.proving and not self.taking_down

    def serving_engine(self, generation: int) -> bool:
        """`generation` is the engine that serves now, not one being taken down."""
        return (self.engine is not None and self.engine.generation == generation
                and self.state is State.RUNNING and not self.taking_down)


@dataclass
class Tuning:
    """The engine settings the watchdog tunes. The throttle level is live at the proxy
    when there is one, else a relaunch; `spec_tokens` is the policy's own choice of
    num_speculative_tokens (None: the engine's arguments as configured)."""

    throttle_level: int = 0
    batch_reduced: bool = False
    spec_tokens: int | None = None


@dataclass(frozen=True)
class Remedy:
    rung: str
    since: float
    reason: str


class EngineWatch:
    def __init__(self, config: Config, environ: dict[str, str], monotonic: Callable[[], float],
                 wall: Callable[[], float], audit: Callable[..., None]) -> None:
        self.config = config
        self._environ = environ
        self._monotonic, self._wall, self._audit = monotonic, wall, audit
        self.window = SignalWindow(config.signals.window(config.gpu))
        self.scrapes = ScrapeHealth()
        self.memory = PolicyMemory()
        self.paused = False
        self.tuning = Tuning()
        self.trips_by_rule: dict[str, int] = {}
        self.actions_by_kind: dict[str, int] = {}
        self.last_decision: DecisionRecord | None = None  # the policy's latest
        # in-place remedies: what this engine supports, the one in progress
        self.sleep_mode = False  # probed once the engine serves
        self.sleep_mode_why: str | None = "the engine has not started"
        # and whether it empties its KV cache when paused (its KV reset then needs no
        # sleep: remedy.pause_resets), why not
        self.pause_resets = False
        self.pause_why: str | None = "the engine has not started"
        # why this unit's engines no longer sleep: a wake broke one (its warm-up wake
        # failed, or its answers changed after it), until the daemon restarts
        self.wake_broken: str | None = None
        self.remedy: Remedy | None = None
        self._remedy_ended_at = -1.0
        self._gpu_errors_logged = False

    # ---- the unit's lifecycle ---------------------------------------------------------

    def engine_starting(self) -> None:
        """A new engine: its signals start afresh."""
        self.scrapes.reset()
        self.window.reset()
        self.sleep_mode, self.sleep_mode_why = False, "the engine is not serving yet"
        self.pause_resets, self.pause_why = False, "the engine is not serving yet"

    def reconfigure(self, config: Config) -> None:
        self.config = config
        self.window.reconfigure(config.signals.window(config.gpu))
        # (a shorter list of level factors: the level stays within it)
        self.tuning.throttle_level = min(self.tuning.throttle_level,
                                         len(config.throttle.level_factors))

    def overrides(self, fronted: bool) -> dict[str, str | None]:
        """Engine flags the next (or current) start replaces: throttle, reduced batch,
        speculative tokens. None = the flag is removed."""
        t = self.tuning
        level = 0 if fronted else t.throttle_level  # live at the proxy
        return relaunch.overrides(self.config.engine.args, self.config.throttle, level,
                                  t.batch_reduced, t.spec_tokens)

    def spec_tokens(self) -> int | None:
        """num_speculative_tokens in force: the policy's, else the configured one."""
        if self.tuning.spec_tokens is not None:
            return self.tuning.spec_tokens
        return relaunch.spec_tokens(self.config.engine.args)

    # ---- operator ---------------------------------------------------------------------

    def set_throttle(self, level: int) -> bool:
        changed = level != self.tuning.throttle_level
        self.tuning.throttle_level = level
        return changed

    def pause(self, paused: bool) -> bool:
        changed = paused != self.paused
        self.paused = paused
        return changed

    # ---- signals ----------------------------------------------------------------------

    def on_metrics(self, ev: MetricsSampled, unit: UnitFacts) -> None:
        e = unit.engine
        if e is None or e.generation != ev.generation:
            return
        if ev.snapshot is None:
            # (logged once per streak, counted always)
            if self.scrapes.failed(silent=(ev.error or "").startswith(NO_ANSWER)):
                log.warning("metrics scrape failed", error=ev.error, pid=e.pid)
            return
        now = self._monotonic()
        ended = self.scrapes.succeeded(ev.snapshot, now)
        # the requests the daemon knows are at the engine: a stopped core's own gauges
        # freeze at their last value, which may say idle
        # (a proof judges itself: its warm-up within canary.warm_up_timeout_s, its canary
        # within its deadline; its steps in flight are work, whatever they wait for: a
        # sibling engine's compile holds a lock it waits on, its own tree idle)
        hung = self.window.add_metrics(now, ev.snapshot, unit.at_engine,
                                       working=unit.proving)
        if hung:
            log.warning("canary failures judged by a scrape: no progress since they began",
                        counted=hung, consecutive=self.window.canary_failures, pid=e.pid)
        if ended:
            log.info("metrics scrape recovered", failed_scrapes=ended, pid=e.pid)

    def signals(self, now: float, engine: eng.EngineProcess | None) -> Signals:
        """The watchdog's signals now, under the names used in config, logs, status and
        the exporter. None means unknown."""
        at = self.scrapes.last_at
        up = now - engine.healthy_at if engine is not None and engine.healthy_at is not None \
            else None
        return self.window.compute(
            now, metrics_age_s=round(now - at, 3) if at is not None else None,
            staleness_s=round(self.scrapes.staleness_s(now), 3),
            scrape_failures_total=self.scrapes.failures_total, engine_uptime_s=up,
            max_model_len=engine.max_model_len if engine is not None else None)

    def on_canary_done(self, ev: CanaryDone, unit: UnitFacts) -> None:
        if not unit.serving_engine(ev.generation):
            return  # a draining engine refuses work on purpose: not the canary's business
        if self.remedy is not None or ev.started <= self._remedy_ended_at:
            return  # an engine asleep for a KV reset does not answer: not a hang
        o = ev.outcome
        # A canary that timed out behind a queue while tokens kept flowing is slow, not
        # hung: only a failure with no progress counts towards the hang rule. Where no
        # scrape answered during it (an engine too busy to serve its page, a host short
        # of CPU), the next scrape that does judges it.
        counted: bool | None = False
        if not o.ok:
            moved = self.window.progressed_between(ev.started, ev.ended)
            if moved is None and not self.config.metrics.enabled:
                moved = False  # (no page will tell: the canary alone decides)
            counted = None if moved is None else not moved
        before = self.window.canary_failures
        self.window.add_canary(o.ok, o.latency_s if o.ok else None, counted, ev.started)
        assert unit.engine is not None
        if not o.ok:
            log.warning("canary failed", error=o.error, latency_s=round(o.latency_s, 3),
                        counted="at the next scrape" if counted is None else counted,
                        consecutive=self.window.canary_failures, pid=unit.engine.pid)
        elif before:
            log.info("canary passed again", latency_s=round(o.latency_s, 3),
                     failures_before=before)

    def on_gpu_sampled(self, ev: GpuSampled, engine: eng.EngineProcess | None,
                       settled: bool = True) -> None:
        r = ev.reading
        if r.errors and not self._gpu_errors_logged:
            log.warning("GPU readings incomplete; retrying each period", errors=list(r.errors))
        elif not r.errors and self._gpu_errors_logged:
            log.info("GPU readings complete again")
        self._gpu_errors_logged = bool(r.errors)
        pids = [p.pid for p in engine.known] if engine is not None else []
        remedies = {c: xid.describe(c).remedy for c in r.xids}
        for gpu, code in r.xids_by_gpu():
            x = xid.describe(code)
            log.error("GPU XID event", xid=code, name=x.name, remedy=x.remedy, gpu=gpu)
            self._audit("xid", xid=code, name=x.name, remedy=x.remedy, gpu=gpu)
        self.window.add_gpu(ev.at, r, pids, remedies, settled and self.remedy is None)

    # ---- the policy -------------------------------------------------------------------

    def facts(self, unit: UnitFacts) -> EngineFacts:
        """What the policy knows of the engine and of the remedies it allows."""
        prefix_off = self.prefix_reset_off(unit.engine)
        kv_off = self.kv_reset_off() if self.kv_reset_by() is None else \
            None if unit.fronted else "no front proxy to hold requests while it sleeps"
        return EngineFacts(
            state=unit.state.value,
            generation=unit.engine.generation if unit.engine is not None else 0,
            throttle_level=self.tuning.throttle_level,
            max_throttle_level=len(self.config.throttle.level_factors),
            batch_reduced=self.tuning.batch_reduced, spec_tokens=self.spec_tokens(),
            spec_tokens_max=(self.config.policy.spec_tokens_max
                             or relaunch.spec_tokens(self.config.engine.args) or 0),
            can_reset_prefix_cache=prefix_off is None,
            # sleep and wake behind a hold of new requests: the proxy must be there to hold
            can_kv_reset=self.kv_reset_by() is not None and unit.fronted,
            # with the proxy, throttling is admission control; without it, a relaunch
            live_throttle=unit.fronted,
            api_silent=API_SILENT if self.scrapes.silent else None,
            why_off={k: v for k, v in (("reset_prefix_cache", prefix_off),
                                       ("kv_reset", kv_off)) if v is not None})

    def prefix_reset_off(self, engine: eng.EngineProcess | None) -> str | None:
        """Why the engine has no prefix-cache reset (None: it has one): the development
        routes it was found serving at its start, its environment; between engines, the
        configuration's."""
        if engine is not None:
            return devroutes.prefix_reset_off(engine.routes, engine.spec.env)
        env = eng.build_spawn_spec(self.config.engine, self._environ).env
        return devroutes.prefix_reset_off(None, env)

    def evaluate(self, now: float, unit: UnitFacts) -> list[Intent]:
        """One tick of the policy: what it decided, as intents for the unit."""
        if not self.config.policy.enabled or self.remedy is not None:
            # (during an in-place remedy the signals describe the remedy, not the engine)
            return []
        state = PolicyState(self.facts(unit), self.memory, self.paused)
        d = decide(self.signals(now, unit.engine), state, self.config.policy, now)
        self.memory = d.memory
        if d.held_back is not None:
            log.info("policy action held back", rule=d.rule, held_back=d.held_back,
                     reason=d.reason, evidence=dict(d.evidence))
            self._audit("decision_held_back", rule=d.rule, held_back=d.held_back,
                        reason=d.reason, evidence=dict(d.evidence))
        if d.action == "none":
            return []
        assert d.rule is not None
        # One canonical line and one audit entry per decision.
        evidence = {**d.evidence, **self._gpu_evidence(now, d.evidence)}
        fields: dict[str, Any] = {"rule": d.rule, "action": d.action, "reason": d.reason,
                                  "evidence": evidence, "dry_run": d.dry_run,
                                  "throttle_level": d.throttle_level}
        log.warning("policy decision", **fields)
        self._audit("decision", **fields)
        self.trips_by_rule[d.rule] = self.trips_by_rule.get(d.rule, 0) + 1
        self.last_decision = DecisionRecord(d.action, d.reason, self._wall(), d.rule,
                                            evidence, d.dry_run)
        out: list[Intent] = [Decided(self.last_decision)]
        if d.dry_run:
            return out
        self.actions_by_kind[d.action] = self.actions_by_kind.get(d.action, 0) + 1
        reason = f"policy {d.rule}: {d.action} ({d.reason})"
        if d.action == "alert":
            log.error("policy alert", rule=d.rule, reason=d.reason)
            remedy_ended(self._audit, {"rung": "alert", "outcome": "alerted",
                                       "duration_s": 0.0, "rule": d.rule})
        elif d.action == "hold_down":
            codes = [xid_text(gpu, c) for gpu, c in self.window.xids]
            why = f"{reason}: {', '.join(codes) or 'GPU error'}; the GPU needs a reset or " \
                  "a reboot, so the engine stays down until `vllm-supervisorctl restart`"
            out.append(HoldDown(why, self._evidence(d.rule, reason)))
        elif d.action in ("reset_prefix_cache", "kv_reset"):
            if unit.engine is not None:
                out.append(self.begin_remedy(d.action, reason, unit))
        else:
            # throttle and lift at the proxy, or a relaunch: restart, restart_now, and
            # every relaunch with new arguments
            t = self.tuning
            t.throttle_level, t.batch_reduced = d.throttle_level, d.batch_reduced
            # (the configured number is no override: a reload of the engine's
            # arguments then applies as configured)
            t.spec_tokens = None if d.spec_tokens == relaunch.spec_tokens(
                self.config.engine.args) else d.spec_tokens
            if d.restarts_engine:
                lifted = d.action == "lift"  # (restoring settings is not a remedy)
                out.append(Restart(
                    reason, graceful=d.action != "restart_now",
                    rung=None if lifted else d.action,
                    evidence=None if lifted else self._evidence(d.rule, reason)))
            elif d.action == "throttle":
                out.append(Throttled(d.rule, t.throttle_level))
        return out

    def _gpu_evidence(self, now: float, evidence: Mapping[str, Any]) -> dict[str, Any]:
        """A GPU rule's evidence names the GPU: the one nearest its slowdown threshold (its
        readings) for the thermal and power signals, where each XID happened for XIDs."""
        if not any(k.startswith("gpu_") for k in evidence):
            return {}
        out: dict[str, Any] = {}
        if any(k.startswith("gpu_xid") for k in evidence) and self.window.xids:
            out["xids"] = [xid_text(gpu, c) for gpu, c in self.window.xids]
        worst = self.window.worst_gpu(now)
        if worst is not None:
            out["gpu"] = worst.index
            out["gpu_readings"] = {
                "temperature_c": worst.temperature_c,
                "slowdown_temperature_c": worst.slowdown_temperature_c,
                "power_w": worst.power_w, "power_limit_w": worst.power_limit_w,
                "thermal_throttled": worst.thermal_throttled}
        return out

    def _evidence(self, rule: str, reason: str) -> EvidenceFor | None:
        """Evidence first at the take-down, if the rule is one of evidence.rules (a hang,
        no progress, an XID by default)."""
        return (rule, reason) if rule in self.config.evidence.rules else None

    # ---- in-place remedies ------------------------------------------------------------

    def on_sleep_mode_probed(self, ev: SleepModeProbed, unit: UnitFacts) -> None:
        if unit.engine is None or unit.engine.generation != ev.generation:
            return
        self.sleep_mode, self.sleep_mode_why = ev.available, ev.why
        self.pause_resets, self.pause_why = ev.pause, ev.pause_why
        if ev.available and self.wake_broken is not None:
            self.sleep_mode, self.sleep_mode_why = False, self.wake_broken
        by = self.kv_reset_by()
        if by is not None:
            log.info("the engine can drop its KV cache in place", by=by)
        else:
            log.info("no KV reset in place for this engine", reason=self.kv_reset_off())

    def kv_reset_ways(self) -> tuple[str, ...]:
        """The ways this engine's KV cache can be emptied in place, in the order a KV
        reset tries them: "pause" (no sleep, where its vLLM empties it when paused; a
        pause refused goes on to the sleep), "sleep" (a sleep and a wake)."""
        return (("pause",) if self.pause_resets else ()) + \
            (("sleep",) if self.sleep_mode else ())

    def kv_reset_by(self) -> str | None:
        """How this engine's KV cache is emptied in place ("pause", "sleep"), or None."""
        ways = self.kv_reset_ways()
        return ways[0] if ways else None

    def kv_reset_off(self) -> str | None:
        """Why this engine has no KV reset in place (None: it has one)."""
        if self.kv_reset_by() is not None:
            return None
        if self.pause_why is None or self.pause_why == self.sleep_mode_why:
            return self.sleep_mode_why
        return f"{self.sleep_mode_why}; no pause either: {self.pause_why}"

    def kv_reset_refusal(self, unit: UnitFacts) -> str | None:
        if unit.state is not State.RUNNING or unit.engine is None or unit.taking_down:
            return f"the engine is not serving (state {unit.state.value})"
        if self.remedy is not None:
            return f"a {self.remedy.rung} is already in progress"
        if self.kv_reset_by() is None:
            return f"this engine cannot drop its KV cache in place: {self.kv_reset_off()}"
        if unit.proving:
            # (its proof may sleep and wake it too, and sends it a generation: a second
            # sleep under either can wedge vLLM)
            return ("the engine is being proven (its first generation, after its warm-up "
                    "sleep and wake): try again once the gate opens")
        return None

    def begin_remedy(self, rung: str, reason: str, unit: UnitFacts) -> BeginRemedy:
        self.remedy = Remedy(rung, self._monotonic(), reason)
        log.info("remedy started", rung=rung, reason=reason, in_flight=unit.at_engine)
        return BeginRemedy(rung, reason, self.kv_reset_ways() if rung == "kv_reset" else ())

    def suspect(self) -> str | None:
        """Why the engine may be frozen: canaries failing in a row with no progress (the
        hang rule acts at its own threshold; a router should look elsewhere before)."""
        n = self.window.canary_failures
        return f"its last {n} canaries failed with no progress" if n >= 2 else None

    def holds_requests(self) -> str | None:
        """Why new requests must wait at the proxy for a remedy now (a KV reset)."""
        if self.remedy is not None and self.remedy.rung == "kv_reset":
            return f"KV reset in progress ({self.remedy.reason})"
        return None

    def on_remedy_done(self, ev: RemedyDone, unit: UnitFacts,
                       held: int) -> tuple[dict[str, Any], list[Intent]]:
        """The remedy's audit fields (the operator's answer), and what follows."""
        self.remedy = None
        self._remedy_ended_at = self._monotonic()
        self.window.restart_progress_clock()  # (the remedy's own pause is no stall)
        o = ev.outcome
        outcome = "ok" if o.ok else ("not attempted" if not o.attempted else "failed")
        fields: dict[str, Any] = {
            "rung": ev.rung, "outcome": outcome, "duration_s": round(ev.duration_s, 3),
            "steps_s": {k: round(v, 3) for k, v in o.steps.items()}, "error": o.error,
            "held": held if ev.rung == "kv_reset" else None}
        if ev.rung == "kv_reset":  # (beside the daemon's steps: vLLM's own sleep and wake)
            fields["vllm_s"] = o.vllm_s
            # (the engine's count of requests as the idle wait read it: [seconds, count])
            fields["idle_counts"] = [list(p) for p in o.idle_counts] \
                if o.idle_counts is not None else None
            # (whose sleep aborts its requests: no idle wait, `idle_counts` None)
            fields["vllm_version"] = o.vllm_version
        remedy_ended(self._audit, fields)
        if not unit.serving_engine(ev.generation) or o.ok or not o.attempted:
            # (the engine went meanwhile: its restart holds and releases requests)
            return fields, []
        # The engine refused or failed its remedy (it may even be asleep): a drained
        # restart instead; new requests stay held through it.
        why = f"{ev.rung} failed ({o.error}): restarting instead"
        if ev.rung == "kv_reset" and "wake_up" in o.steps:  # (slept: its wake failed)
            self.wake_broken = (f"a wake broke an engine of this unit (a KV reset: "
                                f"{o.error}): no sleep until the daemon restarts")
        return fields, [Restart(why, rung="restart", evidence=(f"{ev.rung}_failed", why))]


def xid_text(gpu: int | None, code: int) -> str:
    where = f" on GPU {gpu}" if gpu is not None else ""
    return f"XID {code} ({xid.describe(code).name}){where}"
