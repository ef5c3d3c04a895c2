"""The policy with a fake clock, rule by rule: series that trip each default rule and
series that almost do; windows, hysteresis, cooldowns and escalation. The guardrails
(budget, gap, pause, dry run) are in tests/test_policy_guardrails.py, every default rule
as one table in tests/test_policy_rules_table.py."""

from __future__ import annotations

from supervisor.watchdog.policy import EngineFacts
from supervisor.watchdog.rules import DEFAULT_RULES
from tests.policy_runs import (
    COLLAPSE,
    LEAK,
    LEAKING,
    SATURATED,
    UNKNOWN,
    UNSATURATED,
    Run,
    config,
    first_action,
    gpu,
    only,
    seconds,
    series,
)

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
    acted = r.over(seconds(0, 1000), LEAKING)
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
