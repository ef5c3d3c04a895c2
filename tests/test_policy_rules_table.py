"""Every default rule as one table: what trips it after `for_s` with its action and
evidence, a little less than `for_s` that does not, a conjunct missing or a value on the
boundary that does not, and unknown signals that never do."""

from __future__ import annotations

import pytest

from supervisor.watchdog.policy import EngineFacts
from supervisor.watchdog.rules import DEFAULT_RULES
from tests.policy_runs import COLLAPSE, LEAK, SATURATED, Run, Signals, config, gpu, only

# ---- every default rule, as a table ----------------------------------------------------

# rule -> (engine, a series that trips it, action, evidence)
TRIPS: dict[str, tuple[EngineFacts, Signals, str, dict[str, float | None]]] = {
    "kv_saturation": (EngineFacts(), SATURATED, "throttle",
                      {"preemption_rate": 0.5, "kv_cache_usage": 0.97}),
    "kv_leak": (EngineFacts(), LEAK, "restart", {"kv_cache_usage": 0.6, "requests_running": 0}),
    "prefix_collapse": (EngineFacts(can_reset_prefix_cache=True), COLLAPSE, "reset_prefix_cache",
                        {"prefix_cache_hit_rate": 0.2, "prefix_cache_hit_rate_ratio": 0.3}),
    "memory_growth": (EngineFacts(), {"engine_rss_bytes": 8e9,
                                     "engine_rss_growth_bytes_per_h": 3e9}, "restart",
                      {"engine_rss_bytes": 8e9, "engine_rss_growth_bytes_per_h": 3e9,
                       "engine_gpu_memory_growth_bytes_per_h": None}),
    "no_progress": (EngineFacts(), {"engine_stalled_s": 6.0}, "restart_now",
                    {"engine_stalled_s": 6.0}),
    "hang": (EngineFacts(), {"canary_failures": 3, "metrics_staleness_s": 2.5}, "restart_now",
             {"canary_failures": 3, "metrics_staleness_s": 2.5}),
    "thermal": (EngineFacts(), gpu(4.25), "throttle",
                {"gpu_slowdown_margin_c": 4.25, "gpu_thermal_throttled": 0}),
    "power_budget": (EngineFacts(), {"gpu_power_w": 650.0}, "throttle", {"gpu_power_w": 650.0}),
    "host_thermal": (EngineFacts(), {"host_temperature_c": 96.0}, "throttle",
                     {"host_temperature_c": 96.0}),
    "spec_decode_low": (EngineFacts(spec_tokens=3, spec_tokens_max=4),
                        {"spec_decode_acceptance_rate": 0.3}, "fewer_spec_tokens",
                        {"spec_decode_acceptance_rate": 0.3}),
    "spec_decode_high": (EngineFacts(spec_tokens=2, spec_tokens_max=4),
                         {"spec_decode_acceptance_rate": 0.8}, "more_spec_tokens",
                         {"spec_decode_acceptance_rate": 0.8}),
    "max_uptime": (EngineFacts(), {"engine_uptime_s": 21600, "requests_running": 0,
                                  "requests_waiting": 0}, "restart",
                   {"engine_uptime_s": 21600, "requests_running": 0, "requests_waiting": 0}),
    "xid_restart": (EngineFacts(), {"gpu_xid_restart_errors": 1}, "restart",
                    {"gpu_xid_restart_errors": 1}),
    "xid_reset": (EngineFacts(), {"gpu_xid_reset_errors": 2}, "hold_down",
                  {"gpu_xid_reset_errors": 2}),
}

# rule -> a series that almost trips it: one conjunct missing, or a value on the boundary
NEAR: dict[str, list[Signals]] = {
    "kv_saturation": [{**SATURATED, "preemption_rate": 0.0},
                      {**SATURATED, "preemption_rate": 0.199}],
    "kv_leak": [{**LEAK, "requests_running": 1}, {**LEAK, "kv_cache_usage": 0.499}],
    "prefix_collapse": [{**COLLAPSE, "prefix_cache_hit_rate_ratio": 0.5},
                        {**COLLAPSE, "prefix_cache_hit_rate": 0.4}],
    "memory_growth": [{"engine_rss_bytes": 6.4e10, "engine_rss_growth_bytes_per_h": 2e9,
                       "engine_gpu_memory_growth_bytes_per_h": 1e9}],
    "no_progress": [{"engine_stalled_s": 5.9}, {"engine_stalled_s": None},
                    {"engine_stalled_s": 0.0}],
    "hang": [{"canary_failures": 2, "metrics_staleness_s": 29.9}],
    "thermal": [gpu(5.01), gpu(20, 0.0)],
    "power_budget": [{"gpu_power_w": 600.0}],
    "host_thermal": [{"host_temperature_c": 94.9}, {"host_temperature_c": None}],
    "spec_decode_low": [{"spec_decode_acceptance_rate": 0.4}],
    "spec_decode_high": [{"spec_decode_acceptance_rate": 0.75}],
    "max_uptime": [{"engine_uptime_s": 21599, "requests_running": 0, "requests_waiting": 0},
                   {"engine_uptime_s": 30000, "requests_running": 0, "requests_waiting": 1}],
    "xid_restart": [{"gpu_xid_restart_errors": 0}],
    "xid_reset": [{"gpu_xid_reset_errors": 0}],
}


def test_the_tables_cover_every_default_rule():
    assert set(TRIPS) == set(DEFAULT_RULES) == set(NEAR)


@pytest.mark.parametrize("name", list(DEFAULT_RULES))
def test_each_default_rule_trips_after_for_s_with_its_action_and_evidence(name):
    engine, signals, action, evidence = TRIPS[name]
    for_s = DEFAULT_RULES[name].for_s
    r = Run(config(**only(name)), engine)
    acted = [(t, d) for t, d in ((t, r.at(t, signals)) for t in [0.0, for_s / 2, for_s])
             if d.action != "none"]
    assert [(t, d.rule, d.action) for t, d in acted] == [(for_s, name, action)]
    d = acted[0][1]
    assert d.evidence == evidence
    assert name in d.reason
    assert d.restarts_engine is (action in ("restart", "restart_now", "throttle",
                                            "fewer_spec_tokens", "more_spec_tokens"))
    if action == "fewer_spec_tokens":
        assert d.spec_tokens == 2
    if action == "more_spec_tokens":
        assert d.spec_tokens == 3


@pytest.mark.parametrize("name", [n for n, r in DEFAULT_RULES.items() if r.for_s > 0])
def test_each_default_rule_held_a_little_less_than_for_s_does_not_trip(name):
    engine, signals, _, _ = TRIPS[name]
    for_s = DEFAULT_RULES[name].for_s
    r = Run(config(**only(name)), engine)
    assert r.over([0.0, for_s / 2, for_s - 0.5], signals) == []
    # interrupted once just before: the timer starts again
    assert r.over([for_s - 0.25], {k: None for k in signals}) == []
    assert r.over([for_s, for_s + for_s - 0.5], signals) == []
    assert r.over([2 * for_s], signals)[0].rule == name


@pytest.mark.parametrize("name", list(DEFAULT_RULES))
def test_each_default_rule_almost_trips_with_a_conjunct_missing_or_on_the_boundary(name):
    engine, _, _, _ = TRIPS[name]
    for_s = DEFAULT_RULES[name].for_s
    for near in NEAR[name]:
        r = Run(config(**only(name)), engine)
        assert r.over([0.0, for_s, 2 * for_s + 1, 3 * for_s + 600], near) == [], near


@pytest.mark.parametrize("name", list(DEFAULT_RULES))
def test_each_default_rule_never_trips_on_unknown_signals(name):
    engine, signals, _, _ = TRIPS[name]
    for_s = DEFAULT_RULES[name].for_s
    unknown = {k: None for k in signals}
    r = Run(config(**only(name)), engine)
    assert r.over([0.0, for_s, 2 * for_s + 1, 3 * for_s + 600], unknown) == []
    assert Run(config(**only(name)), engine).over([0.0, for_s + 1], {}) == []
