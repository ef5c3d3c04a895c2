"""Read-only views of one engine's unit: its status for `vllm-supervisorctl status`, and
its snapshot for the exporter. Called on the unit's task; they read, never change.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from supervisor.engine import watching
from supervisor.engine.states import State
from supervisor.ops.exposition import ExporterView, ProxyView
from supervisor.watchdog.policy import PRIORITY
from supervisor.watchdog.signals import SIGNALS

if TYPE_CHECKING:
    from supervisor.engine.unit import EngineUnit

RESTART_REASONS = ("crash", "boot_failure", "policy", "operator")  # the exporter's labels


def admission(unit: EngineUnit) -> dict[str, Any] | None:
    if unit.proxy is None:
        return None
    g = unit.gate
    # (where it listens, not a reloaded address it will take at the next daemon start)
    listen = f"{unit.proxy.s.listen_host}:{unit.proxy.port}"
    upstream = unit.proxy.backends[unit.name].upstream \
        if unit.name in unit.proxy.backends else None
    return {"listen": listen, "upstream": upstream, "held": g.held_reason,
            "in_flight": g.in_flight, "tokens_in_flight": g.tokens_in_flight,
            "waiting": g.waiting, "max_concurrency": g.concurrency_limit,
            "max_tokens_in_flight": g.token_limit or None,
            "kv_breaker_open": g.breaker_open,
            "drained_by_operator": unit.drained_by_operator}


def rules(unit: EngineUnit, now: float) -> dict[str, dict[str, Any]]:
    """Where each rule stands: how long its condition (or its clear condition) has
    held, and the throttle it holds. Answers "why has it not acted (or lifted) yet?"."""
    out = {}
    for name, m in unit.policy_memory.rules.items():
        out[name] = {
            "holding_s": round(now - m.true_since, 3) if m.true_since is not None else None,
            "clearing_s": (round(now - m.clear_since, 3) if m.clear_since is not None
                           else None),
            "levels": m.levels, "reduced_batch": m.reduced, "armed": m.armed,
            "trips": m.trips}
    return out


def gate_view(unit: EngineUnit) -> ProxyView | None:
    """This engine's gate; the host adds the proxy's shared counters."""
    if unit.proxy is None:
        return None
    g = unit.gate
    return ProxyView(responses_by_code={}, rejections_by_reason={}, in_flight=g.in_flight,
                     held=g.waiting, held_limit=g.limits.queue_max,
                     kv_breaker_open=g.breaker_open, connect_retries=0)


def status(unit: EngineUnit) -> dict[str, Any]:
    """What `vllm-supervisorctl status` shows of this engine."""
    now = unit.clock.monotonic()
    e = unit.engine
    up = now - e.healthy_at if e is not None and e.healthy_at is not None else None
    return {
        "state": unit.state.value,
        "reason": unit.state_reason,
        "state_for_s": round(now - unit.state_since, 3),
        "pid": e.pid if e is not None and e.exit_code is None else None,
        "restarts": max(0, unit.generation - 1),
        "uptime_s": round(up, 3) if up is not None else None,
        "daemon_pid": os.getpid(),
        "daemon_uptime_s": round(now - unit.started_at, 3),
        "throttle_level": unit.throttle_level,
        "overrides": unit.overrides(),
        "admission": admission(unit),
        "policy": {"enabled": unit.config.policy.enabled,
                   "paused": unit.policy_paused,
                   "dry_run": unit.config.policy.dry_run,
                   "restarts_last_hour": len([t for t in unit.policy_memory.restarts
                                              if now - t < 3600]),
                   "max_restarts_per_hour": unit.config.policy.max_restarts_per_hour,
                   "trips": dict(unit.trips_by_rule),
                   "rules": rules(unit, now)},
        "last_decision": unit.last_decision.as_dict() if unit.last_decision else None,
        "last_policy_decision": (unit.last_policy_decision.as_dict()
                                 if unit.last_policy_decision else None),
        "last_exit": unit.last_exit,
        "backoff_remaining_s": (round(max(0.0, unit._backoff_until - now), 3)
                                if unit._backoff_until is not None
                                and unit.state is State.BACKOFF else None),
        "fatal_reason": unit.fatal_reason if unit.state is State.FATAL else None,
        "start_blocked": unit.start_blocked if unit.state is State.BACKOFF else None,
        "remedies": {
            "allowed": list(unit.config.policy.remedies),
            "reset_prefix_cache": watching.engine_view(unit).can_reset_prefix_cache,
            "kv_reset": watching.engine_view(unit).can_kv_reset,
            "kv_reset_unavailable": None if unit.sleep_mode else unit.sleep_mode_why,
            "running": (None if unit.remedy_running is None else {
                "rung": unit.remedy_running[0],
                "for_s": round(now - unit.remedy_running[1], 3)})},
        "last_engine_errors": unit.fatal_errors if unit.state is State.FATAL else [],
        # the running engine's address; the config's until one has started
        "engine": {"host": (e.config if e is not None else unit.config.engine).host,
                   "port": (e.config if e is not None else unit.config.engine).port,
                   "processes": e.live_processes if e is not None else 0},
        "signals": watching.signals(unit, now),
        "config": unit.config.source,
    }


def exporter_view(unit: EngineUnit) -> ExporterView:
    """What the exporter shows of this engine (the host adds the proxy's counters)."""
    now = unit.clock.monotonic()
    signals = watching.signals(unit, now)
    e = unit.engine
    return ExporterView(
        state=unit.state.value,
        ready=unit.serving() if unit.proxy is not None
        else unit.state is State.RUNNING and not unit._taking_down,
        throttle_level=unit.throttle_level,
        # every series exists from the start, at 0: Prometheus' increase() cannot see
        # a counter's first step when the series is born with it
        restarts_by_reason={**dict.fromkeys(RESTART_REASONS, 0), **unit.restarts_by_reason},
        trips_by_rule={**dict.fromkeys(unit.config.policy.rules, 0), **unit.trips_by_rule},
        actions_by_kind={**dict.fromkeys(PRIORITY, 0), **unit.actions_by_kind},
        last_decision_wall=unit.last_decision.wall if unit.last_decision else None,
        policy_paused=unit.policy_paused,
        dry_run=unit.config.policy.dry_run,
        engine_uptime_s=(now - e.healthy_at if e is not None and e.healthy_at is not None
                         else None),
        engine_not_running_s=(now - unit.not_running_since
                              if unit.not_running_since is not None else 0.0),
        engine_startup_timeout_s=unit.config.engine.startup_timeout_s,
        gauges=[(spec.metric, spec.help, signals[spec.name]) for spec in SIGNALS],
        proxy=gate_view(unit))
