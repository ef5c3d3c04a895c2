"""What the policy tests feed `decide` (tests/test_policy*.py, tests/test_ladder.py): a
config of the default rules with changes, a `Run` that carries the memory and the
throttle level from one decision to the next as the daemon does, and the signal series
that trip the rules. `decide` is pure: times are plain numbers."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

from supervisor.settings.sections import PolicyConfig
from supervisor.watchdog.policy import EngineFacts, PolicyDecision, PolicyState, decide
from supervisor.watchdog.rules import DEFAULT_RULES, RuleConfig

Signals = dict[str, float | None]


def config(dry_run: bool = False, budget: int = 100, gap: float = 0.0,
           **rules: dict[str, Any]) -> PolicyConfig:
    merged = dict(DEFAULT_RULES)
    for name, changes in rules.items():
        merged[name] = dataclasses.replace(merged[name], **changes) if name in merged \
            else RuleConfig(**changes)
    return PolicyConfig(dry_run=dry_run, max_restarts_per_hour=budget, min_action_gap_s=gap,
                        rules=merged)


class Run:
    """Feeds decide() a signal series at given times, carrying the memory and the
    throttle level forward as the daemon does."""

    def __init__(self, cfg: PolicyConfig, engine: EngineFacts | None = None) -> None:
        self.cfg = cfg
        self.state = PolicyState(engine or EngineFacts())
        self.decisions: list[tuple[float, PolicyDecision]] = []

    def at(self, now: float, signals: Signals, **engine: Any) -> PolicyDecision:
        e = dataclasses.replace(self.state.engine, **engine) if engine else self.state.engine
        d = decide(signals, PolicyState(e, self.state.memory, self.state.paused), self.cfg, now)
        e = dataclasses.replace(e, throttle_level=d.throttle_level,
                                batch_reduced=d.batch_reduced, spec_tokens=d.spec_tokens)
        if d.restarts_engine and not d.dry_run:
            e = dataclasses.replace(e, generation=e.generation + 1)  # the relaunch
        self.state = PolicyState(e, d.memory, self.state.paused)
        self.decisions.append((now, d))
        return d

    def over(self, times: Iterable[float], signals: Signals) -> list[PolicyDecision]:
        return [d for d in (self.at(t, signals) for t in times) if d.action != "none"]

    def pause(self, paused: bool) -> None:
        self.state = dataclasses.replace(self.state, paused=paused)


def seconds(a: float, b: float, step: float = 1.0) -> list[float]:
    out, t = [], a
    while t <= b + 1e-9:
        out.append(t)
        t += step
    return out


# saturated by its load: the running requests can hold every block held
SATURATED: Signals = {"kv_cache_usage": 0.97, "requests_waiting": 5, "preemption_rate": 0.5,
                      "requests_running": 8, "kv_blocks_unaccounted": -120.0}
# saturated, with blocks held that no running request can hold: leaked
LEAKING: Signals = {**SATURATED, "kv_blocks_unaccounted": 4000.0}
ONLY = {name: {"enabled": False} for name in DEFAULT_RULES}


def only(*names: str, **changes: dict[str, Any]) -> dict[str, dict[str, Any]]:
    rules = {n: dict(v) for n, v in ONLY.items()}
    for n in names:
        rules[n] = {"enabled": True, **changes.get(n, {})}
    return rules

# ---- windowed rules (for_fraction < 1): real saturation oscillates ----------------------

def series(pattern: list[Signals], a: float, b: float) -> list[tuple[float, Signals]]:
    """The signals at each second from a to b, cycling through `pattern`."""
    return [(t, pattern[i % len(pattern)]) for i, t in enumerate(seconds(a, b))]


def first_action(r: Run, samples: list[tuple[float, Signals]]) -> tuple[float, str] | None:
    for t, sig in samples:
        d = r.at(t, sig)
        if d.action != "none":
            return t, d.action
    return None


UNSATURATED: Signals = {**SATURATED, "preemption_rate": 0.0}
UNKNOWN: Signals = {**SATURATED, "preemption_rate": None}


LEAK: Signals = {"kv_cache_usage": 0.6, "requests_running": 0}
COLLAPSE: Signals = {"prefix_cache_hit_rate": 0.2, "prefix_cache_hit_rate_ratio": 0.3}


def gpu(margin: float, throttled: float = 0.0) -> Signals:
    return {"gpu_slowdown_margin_c": margin, "gpu_thermal_throttled": throttled}
