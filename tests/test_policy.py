"""The policy with a fake clock: for each default rule, series that trip it and series
that almost do; hysteresis, cooldowns, escalation, the restart budget, the minimum gap,
pause and dry-run. `decide` is pure: times are plain numbers."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

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


SATURATED: Signals = {"kv_cache_usage": 0.97, "requests_waiting": 5, "preemption_rate": 0.5,
                      "requests_running": 8}
ONLY = {name: {"enabled": False} for name in DEFAULT_RULES}


def only(*names: str, **changes: dict[str, Any]) -> dict[str, dict[str, Any]]:
    rules = {n: dict(v) for n, v in ONLY.items()}
    for n in names:
        rules[n] = {"enabled": True, **changes.get(n, {})}
    return rules


# ---- kv_saturation ---------------------------------------------------------------------

def test_kv_saturation_throttles_after_90_s_of_preemptions_with_its_evidence():
    r = Run(config(**only("kv_saturation")))
    acted = r.over(seconds(0, 90), SATURATED)
    assert len(acted) == 1
    d = acted[0]
    assert (d.rule, d.action, d.throttle_level) == ("kv_saturation", "throttle", 1)
    assert r.decisions[-1][0] == 90
    assert d.evidence == {"preemption_rate": 0.5, "kv_cache_usage": 0.97}
    assert d.restarts_engine  # no live throttle yet: a relaunch


def test_kv_saturation_almost_trips_89_s_or_with_too_few_or_unknown_preemptions():
    r = Run(config(**only("kv_saturation")))
    assert r.over(seconds(0, 89), SATURATED) == []
    for missing in ({"preemption_rate": 0.19}, {"preemption_rate": 0.0},
                    {"preemption_rate": None}):
        r = Run(config(**only("kv_saturation")))
        assert r.over(seconds(0, 300), {**SATURATED, **missing}) == [], missing


def test_one_burst_of_preemptions_does_not_trip_kv_saturation_alone():
    # one burst keeps the 60 s rate up for 60 s: 60 of the 90 s window, under 80 %
    r = Run(config(**only("kv_saturation")))
    burst = series([{**SATURATED, "preemption_rate": 0.0}], 0, 99) + \
        series([SATURATED], 100, 159) + series([{**SATURATED, "preemption_rate": 0.0}], 160,
                                               400)
    assert first_action(r, burst) is None


def test_a_streak_rule_interrupted_starts_its_timer_again():
    r = Run(config(**only("kv_saturation", kv_saturation={"for_fraction": 1.0})))
    assert r.over(seconds(0, 50), SATURATED) == []
    assert r.over([51], UNSATURATED) == []
    assert r.over(seconds(52, 140), SATURATED) == []  # 89 s since the gap
    assert r.over([142], SATURATED)[0].action == "throttle"


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


def test_kv_saturation_with_one_gap_still_trips_once_its_window_is_covered():
    r = Run(config(**only("kv_saturation")))
    samples = [*series([SATURATED], 0, 50), (51, UNSATURATED), *series([SATURATED], 52, 200)]
    assert first_action(r, samples) == (90, "throttle")
    assert "in 99% of the samples over 90 s (at least 80%)" in r.decisions[-1][1].reason


def test_kv_saturation_oscillating_mostly_true_trips_and_mostly_false_does_not():
    nine_in_ten = [SATURATED] * 9 + [UNSATURATED]
    r = Run(config(**only("kv_saturation")))
    # (at 90 s the window is covered; the first tick after it with the condition true)
    assert first_action(r, series(nine_in_ten, 0, 300)) == (90, "throttle")
    three_in_four = [SATURATED] * 3 + [UNSATURATED]
    assert first_action(Run(config(**only("kv_saturation"))),
                        series(three_in_four, 0, 600)) is None
    one_in_two = [SATURATED, UNSATURATED]
    assert first_action(Run(config(**only("kv_saturation"))),
                        series(one_in_two, 0, 600)) is None


def test_unknown_samples_count_as_not_true_never_as_alarms():
    few_gaps = [SATURATED] * 9 + [UNKNOWN]
    assert first_action(Run(config(**only("kv_saturation"))),
                        series(few_gaps, 0, 300)) == (90, "throttle")
    many_gaps = [SATURATED, UNKNOWN, UNKNOWN]
    assert first_action(Run(config(**only("kv_saturation"))),
                        series(many_gaps, 0, 600)) is None
    assert first_action(Run(config(**only("kv_saturation"))),
                        series([UNKNOWN], 0, 600)) is None


def test_a_windowed_rule_acts_only_while_its_condition_holds_now():
    r = Run(config(**only("kv_saturation")))
    samples = series([SATURATED], 0, 88) + series([UNSATURATED], 89, 91) + \
        series([SATURATED], 92, 110)
    assert first_action(r, samples) == (92, "throttle")


def test_a_windowed_rule_starts_afresh_on_a_new_engine_and_off_running():
    r = Run(config(**only("kv_saturation")))
    assert r.over(seconds(0, 40), SATURATED) == []
    assert r.at(41, SATURATED, generation=2).action == "none"  # a new engine: uncovered
    assert r.over(seconds(42, 130), SATURATED) == []
    assert r.over([131], SATURATED)[0].action == "throttle"
    r = Run(config(**only("kv_saturation")))
    assert r.over(seconds(0, 40), SATURATED) == []
    assert r.at(41, SATURATED, state="STARTING").action == "none"
    assert r.at(42, SATURATED, state="RUNNING").action == "none"  # judged from here
    assert r.over(seconds(43, 131), SATURATED) == []
    assert r.over([132], SATURATED)[0].action == "throttle"


def test_kv_saturation_steps_per_cooldown_then_escalates_to_restart_at_the_top():
    r = Run(config(**only("kv_saturation")), EngineFacts(max_throttle_level=2))
    acted = r.over(seconds(0, 1000), SATURATED)
    steps = [(t, d.action, d.throttle_level) for t, d in r.decisions if d.action != "none"]
    assert [a for _, a, _ in steps[:3]] == ["throttle", "throttle", "restart"]
    assert steps[0][0] == 90 and steps[1][0] == 90 + 120  # cooldown 120 s
    assert steps[1][2] == 2  # the top
    # each throttle is a relaunch: the new engine must show it for its 90 s window, then
    # 300 s more at the top level
    assert steps[2][0] == 211 + 90 + 300
    assert acted[2].throttle_level == 2  # a restart keeps the throttle
    assert "top throttle level" in acted[2].reason


def test_kv_saturation_lifts_one_level_per_clear_period_with_hysteresis():
    r = Run(config(**only("kv_saturation")), EngineFacts(max_throttle_level=3))
    r.over(seconds(0, 210), SATURATED)
    assert r.state.engine.throttle_level == 2
    band = {**SATURATED, "kv_cache_usage": 0.9, "preemption_rate": 0.0}  # not clear (< 0.85)
    assert r.over(seconds(211, 900), band) == []
    clear = {**band, "kv_cache_usage": 0.5}
    lifts = [(t, d) for t, d in ((t, r.at(t, clear)) for t in seconds(901, 1600))
             if d.action != "none"]
    assert [d.action for _, d in lifts] == ["lift", "lift"]
    # each lift is a relaunch: the next one needs 300 s of clear on the new engine
    assert lifts[0][0] == 901 + 300 and lifts[1][0] == 1202 + 300
    assert r.state.engine.throttle_level == 0


# ---- kv_leak ---------------------------------------------------------------------------

LEAK: Signals = {"kv_cache_usage": 0.6, "requests_running": 0}


def test_kv_leak_restarts_after_30_s_of_blocks_held_with_nothing_running():
    r = Run(config(**only("kv_leak")))
    acted = r.over(seconds(0, 30), LEAK)
    assert [(d.rule, d.action) for d in acted] == [("kv_leak", "restart")]
    assert acted[0].evidence == {"kv_cache_usage": 0.6, "requests_running": 0}


def test_kv_leak_almost_at_29_s_or_with_work_running_or_below_half():
    assert Run(config(**only("kv_leak"))).over(seconds(0, 29), LEAK) == []
    assert Run(config(**only("kv_leak"))).over(
        seconds(0, 100), {**LEAK, "requests_running": 1}) == []
    assert Run(config(**only("kv_leak"))).over(
        seconds(0, 100), {**LEAK, "kv_cache_usage": 0.49}) == []
    assert Run(config(**only("kv_leak"))).over(
        seconds(0, 100), {**LEAK, "requests_running": None}) == []  # unknown: no trip


def test_a_one_shot_rule_does_not_fire_twice_on_one_engine_without_clearing():
    r = Run(config(**only("kv_leak", kv_leak={"cooldown_s": 10})))
    # no relaunch: the generation stays (as when the restart was refused or failed)
    acted = [d for d in (r.at(t, LEAK, generation=1) for t in seconds(0, 300))
             if d.action != "none"]
    assert len(acted) == 1
    # clear (clear_for_s 0) re-arms it; clear as long as it had to hold to trip (30 s)
    # also starts its ladder again from the bottom
    r.over(seconds(301, 331), {**LEAK, "requests_running": 3})
    again = [d for d in (r.at(t, LEAK, generation=1) for t in seconds(332, 370))
             if d.action != "none"]
    assert [d.action for d in again] == ["restart"]


def test_a_new_engine_re_arms_a_one_shot_rule_within_its_cooldown_bounds():
    r = Run(config(**only("kv_leak", kv_leak={"cooldown_s": 100})))
    first = r.over(seconds(0, 30), LEAK)
    assert len(first) == 1 and r.state.engine.generation == 2
    later = [(t, d) for t, d in ((t, r.at(t, LEAK)) for t in seconds(31, 200))
             if d.action != "none"]
    assert later[0][0] == 130  # re-armed by the new engine, but the cooldown holds


# ---- prefix_collapse -------------------------------------------------------------------

COLLAPSE: Signals = {"prefix_cache_hit_rate": 0.2, "prefix_cache_hit_rate_ratio": 0.3}


def test_prefix_collapse_resets_the_cache_when_the_engine_allows_it():
    r = Run(config(**only("prefix_collapse")), EngineFacts(can_reset_prefix_cache=True))
    acted = r.over(seconds(0, 300, 5), COLLAPSE)
    assert [(d.action, d.restarts_engine) for d in acted] == [("reset_prefix_cache", False)]


def test_prefix_collapse_falls_back_to_a_restart_without_dev_mode():
    r = Run(config(**only("prefix_collapse")))
    acted = r.over(seconds(0, 300, 5), COLLAPSE)
    assert acted[0].action == "restart" and "VLLM_SERVER_DEV_MODE" in acted[0].reason


def test_prefix_collapse_almost_and_never_for_an_engine_without_a_baseline():
    cfg = config(**only("prefix_collapse"))
    assert Run(cfg).over(seconds(0, 295, 5), COLLAPSE) == []
    # still above half its baseline: a workload whose hit rate was always low
    assert Run(cfg).over(seconds(0, 900, 5), {**COLLAPSE,
                                               "prefix_cache_hit_rate_ratio": 0.6}) == []
    # never had hits: no baseline, so no ratio
    assert Run(cfg).over(seconds(0, 900, 5), {"prefix_cache_hit_rate": 0.0,
                                               "prefix_cache_hit_rate_ratio": None}) == []


# ---- memory_growth ---------------------------------------------------------------------

def test_memory_growth_restarts_on_growth_or_the_limit():
    grow = {"engine_rss_bytes": 8e9, "engine_rss_growth_bytes_per_h": 3e9}
    assert Run(config(**only("memory_growth"))).over(seconds(0, 60), grow)[0].action == \
        "restart"
    big = {"engine_rss_bytes": 7e10, "engine_rss_growth_bytes_per_h": None}
    assert Run(config(**only("memory_growth"))).over(seconds(0, 60), big)[0].action == \
        "restart"


def test_memory_growth_almost():
    slow = {"engine_rss_bytes": 8e9, "engine_rss_growth_bytes_per_h": 1.9e9}
    assert Run(config(**only("memory_growth"))).over(seconds(0, 600), slow) == []
    grow = {"engine_rss_bytes": 8e9, "engine_rss_growth_bytes_per_h": 3e9}
    assert Run(config(**only("memory_growth"))).over(seconds(0, 59), grow) == []


# ---- hang ------------------------------------------------------------------------------

def test_hang_restarts_without_drain_on_canary_failures_or_stale_metrics():
    d = Run(config(**only("hang"))).at(0, {"canary_failures": 3, "metrics_staleness_s": 0})
    assert (d.action, d.rule) == ("restart_now", "hang")
    d = Run(config(**only("hang"))).at(0, {"canary_failures": 0, "metrics_staleness_s": 30})
    assert d.action == "restart_now"


def test_hang_almost():
    assert Run(config(**only("hang"))).over(
        seconds(0, 100), {"canary_failures": 2, "metrics_staleness_s": 29.9}) == []


def test_hang_wins_over_a_simultaneous_throttle_and_skips_the_gap():
    r = Run(config(gap=600, **only("hang", "kv_saturation")))
    r.over(seconds(0, 90), SATURATED)
    assert r.decisions[-1][1].action == "throttle"
    d = r.at(91, {**SATURATED, "canary_failures": 3})
    assert d.action == "restart_now"  # 1 s after the throttle: the gap does not apply


def test_one_decision_per_tick_the_most_drastic_first():
    r = Run(config(**only("hang", "kv_leak", kv_leak={"for_s": 0})))
    d = r.at(0, {**LEAK, "canary_failures": 5})
    assert d.action == "restart_now"


# ---- thermal ---------------------------------------------------------------------------

def gpu(margin: float, throttled: float = 0.0) -> Signals:
    return {"gpu_slowdown_margin_c": margin, "gpu_thermal_throttled": throttled}


def test_thermal_throttles_within_5_c_of_the_cards_mark_for_30_s():
    r = Run(config(**only("thermal")))
    acted = r.over(seconds(0, 30), gpu(4))
    assert [(d.action, d.throttle_level) for d in acted] == [("throttle", 1)]
    assert acted[0].evidence == {"gpu_slowdown_margin_c": 4, "gpu_thermal_throttled": 0}


def test_thermal_throttles_on_nvml_thermal_slowdown_even_when_cool():
    assert Run(config(**only("thermal"))).over(seconds(0, 30), gpu(20, 1.0))[0].action == \
        "throttle"


def test_thermal_almost_and_unknown():
    assert Run(config(**only("thermal"))).over(seconds(0, 29), gpu(4)) == []
    assert Run(config(**only("thermal"))).over(seconds(0, 300), gpu(5.5)) == []
    assert Run(config(**only("thermal"))).over(seconds(0, 300), {}) == []  # no GPU


def test_thermal_hysteresis_no_lift_at_7_c_then_lift_after_2_min_at_8_c():
    r = Run(config(**only("thermal")))
    r.over(seconds(0, 30), gpu(3))
    assert r.state.engine.throttle_level == 1
    assert r.over(seconds(31, 600), gpu(7)) == []  # inside the band: holds
    acted = [(t, d) for t, d in ((t, r.at(t, gpu(8))) for t in seconds(601, 900))
             if d.action != "none"]
    assert [(t, d.action, d.throttle_level) for t, d in acted] == [(721, "lift", 0)]


def test_thermal_escalates_to_a_reduced_batch_after_10_min_at_the_top_and_lifts_it_first():
    r = Run(config(**only("thermal")), EngineFacts(max_throttle_level=1))
    acted = [(t, d) for t, d in ((t, r.at(t, gpu(2))) for t in seconds(0, 700))
             if d.action != "none"]
    assert [d.action for _, d in acted] == ["throttle", "reduce_batch"]
    # the throttle relaunched: 30 s on the new engine (from 31 s), then 600 s at the top
    assert acted[1][0] == 31 + 30 + 600
    assert r.state.engine.batch_reduced and r.state.engine.throttle_level == 1
    lifts = [d for d in (r.at(t, gpu(10)) for t in seconds(701, 1000)) if d.action != "none"]
    assert [(d.action, d.batch_reduced, d.throttle_level) for d in lifts] == [
        ("lift", False, 1), ("lift", False, 0)]


# ---- power_budget ----------------------------------------------------------------------

def test_power_budget_is_off_by_default_and_throttles_when_enabled():
    hot = {"gpu_power_w": 650.0}
    assert Run(config(**{n: {"enabled": False} for n in DEFAULT_RULES
                         if n != "power_budget"})).over(seconds(0, 300), hot) == []
    r = Run(config(**only("power_budget")))
    assert [d.action for d in r.over(seconds(0, 60), hot)] == ["throttle"]
    assert r.over(seconds(61, 400), {"gpu_power_w": 580.0}) == []  # hysteresis: < 560
    assert [d.action for d in r.over(seconds(401, 600), {"gpu_power_w": 500.0})] == ["lift"]


def test_host_thermal_is_off_by_default_and_throttles_a_hot_soc_with_hysteresis():
    """A unified-memory host's SoC (vllm#51950): off unless enabled; then a throttle at
    95 C, held until it is back under 85 C for clear_for_s."""
    hot = {"host_temperature_c": 96.0}
    assert Run(config(**{n: {"enabled": False} for n in DEFAULT_RULES
                         if n != "host_thermal"})).over(seconds(0, 300), hot) == []
    r = Run(config(**only("host_thermal")))
    assert [d.action for d in r.over(seconds(0, 30), hot)] == ["throttle"]
    assert r.over(seconds(31, 300), {"host_temperature_c": 90.0}) == []  # hysteresis
    assert [d.action for d in r.over(seconds(301, 500), {"host_temperature_c": 80.0})] \
        == ["lift"]


def test_power_budget_almost():
    r = Run(config(**only("power_budget")))
    assert r.over(seconds(0, 59), {"gpu_power_w": 650.0}) == []


# ---- speculative decoding --------------------------------------------------------------

def test_spec_decode_low_takes_one_token_off_down_to_none():
    r = Run(config(**only("spec_decode_low", spec_decode_low={"cooldown_s": 0})),
            EngineFacts(spec_tokens=2, spec_tokens_max=4))
    low = {"spec_decode_acceptance_rate": 0.3}
    acted = r.over(seconds(0, 3000, 10), low)
    assert [(d.action, d.spec_tokens) for d in acted] == [("fewer_spec_tokens", 1),
                                                          ("fewer_spec_tokens", 0)]


def test_spec_decode_high_adds_up_to_the_maximum_and_never_without_spec_decode():
    high = {"spec_decode_acceptance_rate": 0.8}
    r = Run(config(**only("spec_decode_high", spec_decode_high={"cooldown_s": 0})),
            EngineFacts(spec_tokens=3, spec_tokens_max=4))
    assert [(d.action, d.spec_tokens) for d in r.over(seconds(0, 3000, 10), high)] == [
        ("more_spec_tokens", 4)]
    none = Run(config(**only("spec_decode_high", "spec_decode_low")), EngineFacts())
    assert none.over(seconds(0, 3000, 10), high) == []


def test_spec_decode_almost():
    r = Run(config(**only("spec_decode_low")), EngineFacts(spec_tokens=3))
    assert r.over(seconds(0, 590, 10), {"spec_decode_acceptance_rate": 0.3}) == []
    assert r.over(seconds(600, 2000, 10), {"spec_decode_acceptance_rate": 0.45}) == []


# ---- max_uptime and XIDs ---------------------------------------------------------------

def test_max_uptime_off_by_default_then_waits_for_a_quiet_moment():
    busy = {"engine_uptime_s": 30000, "requests_running": 2, "requests_waiting": 0}
    assert Run(config()).over([0], {**busy, "requests_running": 0}) == []
    r = Run(config(**only("max_uptime")))
    assert r.over([0, 1, 2], busy) == []
    assert r.at(3, {**busy, "requests_running": 0}).action == "restart"


def test_xid_needing_a_reset_holds_the_engine_down_and_one_a_restart_clears_restarts():
    d = Run(config(**only("xid_reset", "xid_restart"))).at(0, {"gpu_xid_reset_errors": 1,
                                                               "gpu_xid_restart_errors": 1})
    assert d.action == "hold_down" and not d.restarts_engine
    d = Run(config(**only("xid_reset", "xid_restart"))).at(0, {"gpu_xid_reset_errors": 0,
                                                               "gpu_xid_restart_errors": 2})
    assert d.action == "restart"
    assert Run(config(**only("xid_reset", "xid_restart"))).at(
        0, {"gpu_xid_reset_errors": 0, "gpu_xid_restart_errors": 0}).action == "none"


# ---- guardrails ------------------------------------------------------------------------

def test_restart_budget_one_alert_then_nothing_until_an_hour_has_passed():
    # (a frozen engine: restart_now is off the ladder, so every new engine that freezes
    # again asks for another restart, and only the budget bounds them)
    r = Run(config(budget=2, **only("hang", hang={"for_s": 30})))
    frozen = {"canary_failures": 5}
    acted = [(t, d) for t, d in ((t, r.at(t, frozen)) for t in seconds(0, 3700, 10))
             if d.action != "none"]
    kinds = [(t, d.action) for t, d in acted]
    assert kinds[:3] == [(30, "restart_now"), (90, "restart_now"), (150, "alert")]
    assert "restart budget exhausted" in acted[2][1].reason
    held = [d.held_back for _, d in r.decisions if d.held_back]
    assert held == ["restart_now held back: restart budget exhausted"]  # reported once
    assert kinds[3] == (3630, "restart_now")  # the first restart left the hour at 3630


def test_minimum_gap_holds_an_action_back_and_reports_it_once():
    r = Run(config(gap=100, **only("kv_saturation", "kv_leak",
                                   kv_saturation={"for_s": 0, "cooldown_s": 0},
                                   kv_leak={"for_s": 0})))
    assert r.at(0, SATURATED).action == "throttle"
    d1 = r.at(1, {**SATURATED, "requests_running": 0, "kv_cache_usage": 0.97})
    assert d1.action == "none" and d1.held_back and "since the last action" in d1.held_back
    d2 = r.at(2, {**SATURATED, "requests_running": 0})
    assert d2.action == "none" and d2.held_back is None
    assert r.at(100, {**SATURATED, "requests_running": 0}).action == "restart"


def test_pause_holds_every_action_back_and_says_so_once():
    r = Run(config(**only("hang")))
    r.pause(True)
    ds = [r.at(t, {"canary_failures": 5}) for t in (0, 1, 2)]
    assert [d.action for d in ds] == ["none"] * 3
    assert ds[0].held_back == "restart_now held back: the policy is paused"
    assert ds[1].held_back is None and ds[2].held_back is None
    r.pause(False)
    assert r.at(3, {"canary_failures": 5}).action == "restart_now"


def test_dry_run_decides_and_reports_but_changes_nothing_and_honours_the_cooldown():
    r = Run(config(dry_run=True, **only("kv_saturation")))
    acted = [(t, d) for t, d in ((t, r.at(t, SATURATED)) for t in seconds(0, 400))
             if d.action != "none"]
    assert [t for t, _ in acted] == [90, 210, 330]  # every cooldown, not every tick
    assert all(d.dry_run and d.throttle_level == 0 for _, d in acted)
    assert r.state.engine.throttle_level == 0 and r.state.memory.restarts == ()
    assert r.state.memory.rules["kv_saturation"].levels == 0


def test_timers_restart_while_the_engine_is_not_running():
    r = Run(config(**only("kv_leak")))
    assert r.over(seconds(0, 20), LEAK) == []
    assert r.at(21, LEAK, state="DRAINING").action == "none"
    serving = [r.at(t, LEAK, state="RUNNING").action for t in seconds(22, 52)]
    assert serving == ["none"] * 30 + ["restart"]  # 30 s on a serving engine, from 22 s


def test_a_disabled_rule_never_acts():
    assert Run(config(hang={"enabled": False})).over(
        seconds(0, 10), {"canary_failures": 9}) == []


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 30), st.sampled_from(
    [SATURATED, LEAK, {"canary_failures": 4.0}, gpu(2), gpu(12), {}])), min_size=1,
    max_size=150), st.integers(0, 3), st.integers(1, 3), st.booleans())
def test_budget_and_throttle_bounds_hold_for_any_series(steps, budget, levels, live):
    r = Run(config(budget=budget, gap=0, kv_saturation={"for_s": 0, "cooldown_s": 0},
                   kv_leak={"for_s": 0, "cooldown_s": 0}, thermal={"for_s": 0, "cooldown_s": 0},
                   hang={"cooldown_s": 0}),
            EngineFacts(max_throttle_level=levels, live_throttle=live))
    t = 0.0
    restarts: list[float] = []
    for dt, signals in steps:
        t += dt
        d = r.at(t, signals)
        assert 0 <= d.throttle_level <= levels
        if d.restarts_engine and not d.dry_run:
            restarts.append(t)
        assert len([x for x in restarts if t - x < 3600]) <= budget


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


# ---- more guardrails -------------------------------------------------------------------

def test_hold_down_skips_the_minimum_gap_but_a_restart_does_not():
    r = Run(config(gap=600, **only("kv_leak", "xid_reset", "xid_restart",
                                   kv_leak={"for_s": 0})))
    assert r.at(0, LEAK, generation=1).action == "restart"
    assert r.at(1, {"gpu_xid_restart_errors": 1}, generation=2).action == "none"
    d = r.at(2, {"gpu_xid_reset_errors": 1}, generation=2)
    assert (d.action, d.rule, d.restarts_engine) == ("hold_down", "xid_reset", False)


def test_cooldowns_are_per_rule():
    r = Run(config(**only("kv_leak", "memory_growth", kv_leak={"for_s": 0, "cooldown_s": 600},
                          memory_growth={"for_s": 0})))
    assert r.at(0, LEAK).rule == "kv_leak"
    # kv_leak is cooling down (600 s); memory_growth has its own
    d = r.at(1, {"engine_rss_bytes": 7e10})
    assert (d.rule, d.action) == ("memory_growth", "restart")
    # a new engine re-arms kv_leak, but its own cooldown still holds until 600 s
    assert r.over(seconds(2, 599, 1), LEAK) == []
    assert r.at(600, LEAK).rule == "kv_leak"


def test_spec_token_rules_respect_none_zero_and_the_maximum():
    low = {"spec_decode_acceptance_rate": 0.1}
    high = {"spec_decode_acceptance_rate": 0.9}
    both = config(**only("spec_decode_low", "spec_decode_high"))
    times = [0.0, 600.0, 1300.0]
    assert Run(both, EngineFacts(spec_tokens=None, spec_tokens_max=4)).over(times, low) == []
    assert Run(both, EngineFacts(spec_tokens=None, spec_tokens_max=4)).over(times, high) == []
    assert Run(both, EngineFacts(spec_tokens=0, spec_tokens_max=4)).over(times, low) == []
    assert Run(both, EngineFacts(spec_tokens=4, spec_tokens_max=4)).over(times, high) == []
    assert Run(both, EngineFacts(spec_tokens=2, spec_tokens_max=0)).over(times, high) == []
    acted = Run(both, EngineFacts(spec_tokens=0, spec_tokens_max=4)).over(times, high)
    assert [(d.action, d.spec_tokens) for d in acted] == [("more_spec_tokens", 1)]


def test_pause_leaves_the_throttle_level_alone():
    r = Run(config(**only("kv_saturation")), EngineFacts(throttle_level=1))
    r.pause(True)
    ds = [r.at(t, SATURATED) for t in seconds(0, 400, 10)]
    assert all(d.action == "none" and d.throttle_level == 1 for d in ds)
    assert [d.held_back for d in ds if d.held_back] == [
        "throttle held back: the policy is paused"]


def test_dry_run_one_shot_rule_repeats_per_cooldown_and_restarts_nothing():
    r = Run(config(dry_run=True, **only("kv_leak", kv_leak={"cooldown_s": 600})))
    acted = [(t, d) for t, d in ((t, r.at(t, LEAK)) for t in seconds(0, 1300, 10))
             if d.action != "none"]
    assert [(t, d.action, d.dry_run) for t, d in acted] == [
        (30, "restart", True), (630, "restart", True), (1230, "restart", True)]
    assert r.state.engine.generation == 1  # nothing was relaunched
    assert r.state.memory.restarts == ()
    assert r.state.memory.rules["kv_leak"].armed  # nothing was done: not disarmed


def test_dry_run_never_spends_the_restart_budget():
    r = Run(config(dry_run=True, budget=1, **only("hang")))
    acted = [d for d in (r.at(t, {"canary_failures": 3}) for t in seconds(0, 600, 60))
             if d.action != "none"]
    assert [d.action for d in acted] == ["restart_now"] * 11  # every cooldown (60 s)


def test_a_non_running_engine_resets_throttle_and_clear_timers_too():
    r = Run(config(**only("thermal")))
    r.over(seconds(0, 30), gpu(3))
    assert r.state.engine.throttle_level == 1
    assert r.over(seconds(31, 150), gpu(10)) == []  # 119 s of clear
    r.at(151, gpu(10), state="STARTING")
    lifted = [(t, d.action) for t, d in ((t, r.at(t, gpu(10), state="RUNNING"))
                                         for t in seconds(152, 400)) if d.action != "none"]
    assert lifted == [(272, "lift")]  # 120 s of clear on a serving engine, from 152 s


def test_prefix_collapse_fallback_restart_spends_the_budget():
    r = Run(config(budget=1, **only("prefix_collapse", prefix_collapse={"cooldown_s": 0})))
    acted = r.over(seconds(0, 700, 10), COLLAPSE)
    assert [(d.action, d.restarts_engine) for d in acted] == [("restart", True), ("alert", False)]


def test_a_reset_prefix_cache_restarts_nothing_and_spends_no_budget():
    r = Run(config(budget=0, **only("prefix_collapse")), EngineFacts(can_reset_prefix_cache=True))
    acted = r.over(seconds(0, 300, 10), COLLAPSE)
    assert [(d.action, d.restarts_engine) for d in acted] == [("reset_prefix_cache", False)]
    assert r.state.memory.restarts == ()


def test_the_budget_alerts_again_once_it_has_freed_and_run_out_anew():
    r = Run(config(budget=1, **only("hang", hang={"for_s": 30})))
    acted = [(t, d.action) for t, d in ((t, r.at(t, {"canary_failures": 5}))
                                        for t in seconds(0, 3800, 10)) if d.action != "none"]
    assert acted == [(30, "restart_now"), (90, "alert"), (3630, "restart_now"),
                     (3690, "alert")]


def test_an_escalation_past_a_reduced_batch_alerts_once_and_then_gives_up():
    r = Run(config(**only("thermal")),
            EngineFacts(throttle_level=1, max_throttle_level=1, batch_reduced=True))
    acted = r.over(seconds(0, 3000, 10), gpu(1))
    assert [d.action for d in acted] == ["alert"]  # the top of the ladder, once
    assert "reduce_batch: the batch is already reduced" in acted[0].reason
    assert not acted[0].restarts_engine


def test_with_a_live_throttle_throttling_and_lifting_restart_nothing():
    r = Run(config(budget=0, **only("thermal")), EngineFacts(live_throttle=True))
    acted = r.over(seconds(0, 30), gpu(3)) + r.over(seconds(31, 200), gpu(10))
    assert [(d.action, d.throttle_level, d.restarts_engine) for d in acted] == [
        ("throttle", 1, False), ("lift", 0, False)]
    assert r.state.engine.generation == 1 and r.state.memory.restarts == ()


def test_with_a_live_throttle_lifting_a_reduced_batch_is_still_a_relaunch():
    r = Run(config(**only("thermal")), EngineFacts(live_throttle=True, max_throttle_level=1))
    acted = r.over(seconds(0, 700, 5), gpu(2))
    assert [(d.action, d.restarts_engine) for d in acted] == [
        ("throttle", False), ("reduce_batch", True)]
    lifts = r.over(seconds(705, 1000, 5), gpu(10))
    assert [(d.action, d.batch_reduced, d.throttle_level, d.restarts_engine)
            for d in lifts] == [("lift", False, 1, True), ("lift", False, 0, False)]


def test_with_a_live_throttle_each_lift_waits_for_its_own_clear_period():
    r = Run(config(**only("thermal", thermal={"cooldown_s": 0})),
            EngineFacts(live_throttle=True, max_throttle_level=2))
    r.over(seconds(0, 31), gpu(3))
    assert r.state.engine.throttle_level == 2  # no relaunch: one step per tick
    lifts = [(t, d.throttle_level) for t, d in ((t, r.at(t, gpu(10)))
                                                for t in seconds(32, 600)) if d.action != "none"]
    assert lifts == [(152, 1), (272, 0)]


def test_an_interruption_restarts_the_time_at_the_top_before_escalating():
    r = Run(config(**only("thermal")), EngineFacts(live_throttle=True, max_throttle_level=1))
    assert [d.action for d in r.over(seconds(0, 500), gpu(2))] == ["throttle"]
    assert r.over([501], gpu(6)) == []  # neither hot nor clear, for one tick
    acted = [(t, d.action) for t, d in ((t, r.at(t, gpu(2))) for t in seconds(502, 1300))
             if d.action != "none"]
    # (thermal is windowed: hot again at once, it holds at once; the top waits anew)
    assert acted == [(502 + 600, "reduce_batch")]


def test_thermal_lifts_on_a_card_that_cannot_report_clock_reasons_but_never_while_slowed():
    r = Run(config(**only("thermal")), EngineFacts(max_throttle_level=1))
    r.over(seconds(0, 30), gpu(3))
    assert r.state.engine.throttle_level == 1
    # cool by temperature, but NVML reports thermal slowdown: the trip condition holds,
    # so no lift (and no escalation before 600 s at the top)
    assert r.over(seconds(31, 400), gpu(12, 1.0)) == []
    unknown_flag: Signals = {"gpu_slowdown_margin_c": 12.0, "gpu_thermal_throttled": None}
    lifts = [(t, d.action) for t, d in ((t, r.at(t, unknown_flag)) for t in seconds(401, 600))
             if d.action != "none"]
    assert lifts == [(521, "lift")] and r.state.engine.throttle_level == 0
