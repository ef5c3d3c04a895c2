"""The policy's guardrails with a fake clock: the restart budget, the minimum gap between
actions, pause, dry run, timers off RUNNING, disabled rules, cooldowns per rule, and the
budget and throttle bounds for any series."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from supervisor.watchdog.policy import EngineFacts
from tests.policy_runs import COLLAPSE, LEAK, SATURATED, Run, Signals, config, gpu, only, seconds

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


# ---- one-shot rules, cooldowns, spec tokens, pause and dry run ------------------------

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
