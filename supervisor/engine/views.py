"""Read-only views of one engine's unit: its status for `vllm-supervisorctl status`, and
its snapshot for the exporter. Called on the unit's task with the unit seen through
`Viewable` (what it shows); they read, never change.
"""

from __future__ import annotations

import os
from typing import Any, Protocol

from supervisor.engine.events import DecisionRecord
from supervisor.engine.failures import Failures
from supervisor.engine.golden_check import GoldenCheck
from supervisor.engine.pair import early_wake, weights_ahead
from supervisor.engine.pair.handover import Handover
from supervisor.engine.pair.pair_states import Cache, Phase
from supervisor.engine.pair.weight_cache import WeightCache
from supervisor.engine.process.kv_tier import Record as KvTierRecord
from supervisor.engine.process.process import EngineProcess
from supervisor.engine.startup.start_times import Expected
from supervisor.engine.states import State
from supervisor.engine.steps import PairFacts
from supervisor.engine.watch import EngineWatch, UnitFacts
from supervisor.front.admission import Gate
from supervisor.loop import Clock
from supervisor.ops.exposition import ExporterView, ProxyView
from supervisor.settings.config import Config
from supervisor.watchdog.policy import PRIORITY, EngineFacts
from supervisor.watchdog.signal_list import SIGNALS

RESTART_REASONS = ("crash", "boot_failure", "policy", "operator")  # the exporter's labels


class Viewable(Protocol):
    """What the views read of an engine's unit (`supervisor/engine/unit.py`)."""

    @property
    def config(self) -> Config: ...
    @property
    def clock(self) -> Clock: ...
    @property
    def state(self) -> State: ...
    @property
    def state_reason(self) -> str: ...
    @property
    def state_since(self) -> float: ...
    @property
    def started_at(self) -> float: ...
    @property
    def not_running_since(self) -> float | None: ...
    @property
    def last_start_s(self) -> float | None: ...
    @property
    def engine(self) -> EngineProcess | None: ...
    @property
    def thin_serves(self) -> bool: ...
    @property
    def generation(self) -> int: ...
    @property
    def gate(self) -> Gate: ...
    @property
    def fronted(self) -> bool: ...
    @property
    def drained_by_operator(self) -> bool: ...
    @property
    def watch(self) -> EngineWatch: ...
    @property
    def last_decision(self) -> DecisionRecord | None: ...
    @property
    def last_exit(self) -> str | None: ...
    @property
    def failures(self) -> Failures: ...
    @property
    def stop_deadline(self) -> float | None: ...
    @property
    def restarts_by_reason(self) -> dict[str, int]: ...
    @property
    def taking_down(self) -> bool: ...

    @property
    def restarts(self) -> int: ...
    @property
    def oom_deaths(self) -> int: ...
    @property
    def handover(self) -> Handover: ...
    @property
    def golden(self) -> GoldenCheck: ...
    @property
    def weights(self) -> WeightCache: ...
    @property
    def kv_tier(self) -> KvTierRecord: ...
    def expected_start(self) -> Expected | None: ...

    def serving(self) -> bool: ...

    def facts(self) -> UnitFacts: ...

    def pair_facts(self) -> PairFacts: ...


def admission(unit: Viewable) -> dict[str, Any] | None:
    """The gate of this engine (the host adds where the proxy listens)."""
    if not unit.fronted:
        return None
    g = unit.gate
    return {"held": g.held_reason,
            "in_flight": g.in_flight, "tokens_in_flight": g.tokens_in_flight,
            "waiting": g.waiting, "max_concurrency": g.concurrency_limit,
            "max_tokens_in_flight": g.token_limit or None,
            "kv_breaker_open": g.breaker_open,
            "drained_by_operator": unit.drained_by_operator}


def rules(unit: Viewable, now: float) -> dict[str, dict[str, Any]]:
    """Where each rule stands: how long its condition (or its clear condition) has
    held, and the throttle it holds. Answers "why has it not acted (or lifted) yet?"."""
    out = {}
    for name, m in unit.watch.memory.rules.items():
        out[name] = {
            "holding_s": round(now - m.true_since, 3) if m.true_since is not None else None,
            "clearing_s": (round(now - m.clear_since, 3) if m.clear_since is not None
                           else None),
            "levels": m.levels, "reduced_batch": m.reduced, "armed": m.armed,
            "trips": m.trips}
    return out


def gate_view(unit: Viewable) -> ProxyView | None:
    """This engine's gate; the host adds the proxy's shared counters."""
    if not unit.fronted:
        return None
    g = unit.gate
    return ProxyView(responses_by_code={}, rejections_by_reason={}, in_flight=g.in_flight,
                     held=g.waiting, held_limit=g.limits.queue_max,
                     kv_breaker_open=g.breaker_open, connect_retries=0)


def starting(unit: Viewable, now: float) -> dict[str, Any] | None:
    """While the engine starts: what it is doing as vLLM says (its start phase), for how
    long, and how long its last start took (the wait to expect)."""
    e = unit.engine
    if unit.state is not State.STARTING or e is None or e.healthy_at is not None:
        return None
    expected = unit.expected_start()
    return {"phase": e.phase,
            "phase_for_s": round(now - e.phase_since, 1) if e.phase_since is not None
            else None,
            "for_s": round(now - e.started_at, 1),
            "last_start_s": unit.last_start_s,
            "vllm_version": e.vllm_version,
            # learned from the past starts of this command line (engine/startup/start_times.py)
            "expected_s": expected.total_s if expected is not None else None,
            "eta_s": expected.left_s if expected is not None else None,
            "cold": expected.cold if expected is not None else None}


def off(unit: Viewable, facts: EngineFacts) -> dict[str, str]:
    """What the engine cannot do that the daemon would use, and why: the serving
    engine's in-place remedies (`reset_prefix_cache`, `kv_reset`: once it is up, its
    start's probe done) and, with `standby = "sleep"`, `sleeping_standby`; {} when
    nothing is off."""
    e = unit.engine
    out = dict(facts.why_off) if e is not None and e.healthy_at is not None else {}
    standby = unit.handover.sleeping_standby_off(unit.config.engine)
    if standby is not None:
        out["sleeping_standby"] = standby
    return out


def capabilities(unit: Viewable) -> dict[str, bool]:
    """For the exporter: each of those, on (True) or off, once the serving engine is up
    (its probe done); {} before: unknown."""
    e = unit.engine
    if e is None or e.healthy_at is None:
        return {}
    facts = unit.watch.facts(unit.facts())
    out = {"reset_prefix_cache": facts.can_reset_prefix_cache,
           "kv_reset": facts.can_kv_reset}
    if unit.config.engine.standby in ("sleep", "snapshot"):
        out["sleeping_standby"] = unit.handover.sleeping_standby_off(
            unit.config.engine) is None
    return out


def standby_status(h: Handover, now: float, mode: str, thin_serves: bool,
                   f: PairFacts) -> dict[str, Any]:
    """`status`'s `standby`: `"ready"` when armed (awake or asleep, and proven);
    `thin_serves`, the serving engine is an asymmetric pair's thin standby;
    `early_wake` (`early_wake.armed`); `weights_off` (`weights_ahead.why_not`);
    `host_cache`, once its weights are on the card: "asked", "emptied" or why kept
    (`weights_ahead.host_cache_emptied`)."""
    if mode == "none" and h.standby.idle:
        return {"state": "none"}
    return {"mode": mode, **h.standby.status(now), "thin_serves": thin_serves,
            "early_wake": early_wake.armed(h.standby, f),
            "weights_off": weights_ahead.why_not(h.standby, f,
                                                 idle=h.phase is Phase.IDLE),
            "host_cache": h.standby.host_cache if h.standby.weights == "back" else None}


def status(unit: Viewable) -> dict[str, Any]:
    """What `vllm-supervisorctl status` shows of this engine."""
    now = unit.clock.monotonic()
    e, w = unit.engine, unit.watch
    facts = w.facts(unit.facts())
    up = now - e.healthy_at if e is not None and e.healthy_at is not None else None
    return {
        "state": unit.state.value,
        "reason": unit.state_reason,
        "state_for_s": round(now - unit.state_since, 3),
        "pid": e.pid if e is not None and e.exit_code is None else None,
        "restarts": unit.restarts,
        "uptime_s": round(up, 3) if up is not None else None,
        "daemon_pid": os.getpid(),
        "daemon_uptime_s": round(now - unit.started_at, 3),
        "throttle_level": w.tuning.throttle_level,
        "overrides": w.overrides(unit.fronted),
        "admission": admission(unit),
        "policy": {"enabled": unit.config.policy.enabled,
                   "paused": w.paused,
                   "dry_run": unit.config.policy.dry_run,
                   "restarts_last_hour": len([t for t in w.memory.restarts
                                              if now - t < 3600]),
                   "max_restarts_per_hour": unit.config.policy.max_restarts_per_hour,
                   "trips": dict(w.trips_by_rule),
                   "rules": rules(unit, now)},
        "last_decision": unit.last_decision.as_dict() if unit.last_decision else None,
        "last_policy_decision": w.last_decision.as_dict() if w.last_decision else None,
        "last_exit": unit.last_exit,
        "backoff_remaining_s": (round(max(0.0, unit.failures.backoff_until - now), 3)
                                if unit.failures.backoff_until is not None
                                and unit.state is State.BACKOFF else None),
        # a restart's or stop's one deadline: the old tree proven gone by then
        "stop_deadline_in_s": (round(max(0.0, unit.stop_deadline - now), 3)
                               if unit.stop_deadline is not None else None),
        "fatal_reason": unit.failures.fatal_reason if unit.state is State.FATAL else None,
        "standby": standby_status(unit.handover, now, unit.config.engine.standby,
                                  unit.thin_serves, unit.pair_facts()),
        # the weight cache beside it (engine/pair/weight_cache.py); None: none configured
        "weight_cache": unit.weights.status(now),
        # the KV tier both engines share (engine/process/kv_tier.py); None: none configured
        "kv_tier": unit.kv_tier.view(unit.config.engine),
        "golden": unit.golden.status(),
        "start": starting(unit, now),
        # the serving engine's compile cache (engine/startup/compile_cache.py)
        "compile_cache": e.cache.view(now) if e is not None and e.cache is not None else None,
        # where its vLLM writes its own stack dumps (watchdog/stackdumps.py; vLLM 0.33+)
        "stack_dumps": e.dumps.view() if e is not None and e.dumps is not None else None,
        "start_blocked": unit.failures.start_blocked if unit.state is State.BACKOFF else None,
        # which of vLLM's development routes the serving engine was found serving at
        # its start (null: not known), and what is off for want of them, or of a flag
        "dev_routes": e.routes.as_dict() if e is not None and e.routes is not None else None,
        "off": off(unit, facts),
        "remedies": {
            "allowed": list(unit.config.policy.remedies),
            "reset_prefix_cache": facts.can_reset_prefix_cache,
            "kv_reset": facts.can_kv_reset,
            # how: "pause" (no sleep) or "sleep"; null with why unavailable
            "kv_reset_by": w.kv_reset_by(),
            "kv_reset_unavailable": w.kv_reset_off(),
            "running": (None if w.remedy is None else {
                "rung": w.remedy.rung, "for_s": round(now - w.remedy.since, 3)})},
        "last_engine_errors": unit.failures.fatal_errors if unit.state is State.FATAL else [],
        # the running engine's address; the config's until one has started
        "engine": {"host": (e.config if e is not None else unit.config.engine).host,
                   "port": (e.config if e is not None else unit.config.engine).port,
                   "processes": e.live_processes if e is not None else 0,
                   # its KV cache in tokens, as its core said at its start
                   "kv_tokens": e.kv_tokens if e is not None else None},
        "signals": w.signals(now, e),
        # each GPU of the engine (NVML's index), its readings and the engine's memory there
        "gpus": w.window.gpu_devices(now, _pids(e)),
        "config": unit.config.source,
    }


def exporter_view(unit: Viewable) -> ExporterView:
    """What the exporter shows of this engine (the host adds the proxy's counters)."""
    now = unit.clock.monotonic()
    e, w = unit.engine, unit.watch
    signals = w.signals(now, e)
    return ExporterView(
        state=unit.state.value,
        ready=unit.serving() if unit.fronted
        else unit.state is State.RUNNING and not unit.taking_down,
        throttle_level=w.tuning.throttle_level,
        # every series exists from the start, at 0: Prometheus' increase() cannot see
        # a counter's first step when the series is born with it
        restarts_by_reason={**dict.fromkeys(RESTART_REASONS, 0), **unit.restarts_by_reason},
        trips_by_rule={**dict.fromkeys(unit.config.policy.rules, 0), **w.trips_by_rule},
        actions_by_kind={**dict.fromkeys(PRIORITY, 0), **w.actions_by_kind},
        last_decision_wall=unit.last_decision.wall if unit.last_decision else None,
        policy_paused=w.paused,
        dry_run=unit.config.policy.dry_run,
        engine_uptime_s=(now - e.healthy_at if e is not None and e.healthy_at is not None
                         else None),
        engine_not_running_s=(now - unit.not_running_since
                              if unit.not_running_since is not None else 0.0),
        engine_startup_timeout_s=unit.config.engine.startup_timeout_s,
        standby_ready=(None if unit.config.engine.standby == "none"
                       else float(unit.handover.standby.ready)),
        kv_tokens=_tokens(e),
        standby_kv_tokens=(None if unit.config.engine.standby == "none"
                           else _tokens(unit.handover.standby.slot.engine)),
        weight_cache_ready=(float(unit.weights.state is Cache.READY)
                            if unit.weights.configured else None),
        failovers=unit.handover.failovers, last_failover_s=unit.handover.last_failover_s,
        oom_deaths=unit.oom_deaths,
        kv_tier_bytes=(tier := unit.kv_tier.numbers(unit.config.engine))[0],
        kv_tier_max_bytes=tier[1], kv_tier_removed_bytes=tier[2],
        kv_tier_store_refusals=tier[3],
        golden_checks={"passed": unit.golden.passed, "mismatch": unit.golden.mismatches},
        eta_s=expected.left_s if (expected := unit.expected_start()) is not None else None,
        capabilities=capabilities(unit),
        gauges=[(spec.metric, spec.help, signals[spec.name]) for spec in SIGNALS],
        gpus=[(int(g["index"]), g) for g in w.window.gpu_devices(now, _pids(e))],
        proxy=gate_view(unit))


def _tokens(e: EngineProcess | None) -> float | None:
    """A live engine's KV cache in tokens (None: none, or not said yet)."""
    if e is None or e.exit_code is not None or e.kv_tokens is None:
        return None
    return float(e.kv_tokens)


def _pids(e: EngineProcess | None) -> list[int]:
    return [p.pid for p in e.known] if e is not None else []
