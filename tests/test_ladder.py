"""The remediation ladder in the pure policy, with a fake clock: each rung taken only when
allowed and supported, the climb when a symptom outlives its remedy, the reset when it
clears, and the alert at the top."""

from __future__ import annotations

from supervisor.settings.sections import PolicyConfig
from supervisor.watchdog.policy import EngineFacts
from supervisor.watchdog.rules import LADDER, REMEDIES
from tests.policy_runs import COLLAPSE, LEAK, LEAKING, SATURATED, Run, config, gpu, only, seconds

SLEEPY = EngineFacts(can_kv_reset=True, can_reset_prefix_cache=True, live_throttle=True)


def with_remedies(cfg: PolicyConfig, *allowed: str) -> PolicyConfig:
    return PolicyConfig(dry_run=cfg.dry_run, max_restarts_per_hour=cfg.max_restarts_per_hour,
                        min_action_gap_s=cfg.min_action_gap_s, rules=cfg.rules,
                        remedies=list(allowed))


def actions(r: Run, times: list[float], signals: dict[str, float | None]) -> list[str]:
    return [d.action for d in r.over(times, signals)]


def test_the_ladder_is_ordered_cheapest_first_and_alert_is_always_there():
    assert LADDER == ("reset_prefix_cache", "throttle", "kv_reset", "restart", "reduce_batch",
                      "alert")
    assert "alert" not in REMEDIES and PolicyConfig().remedies == list(REMEDIES)


def test_kv_leak_takes_the_kv_reset_where_the_engine_can_sleep():
    r = Run(config(**only("kv_leak")), SLEEPY)
    (d,) = r.over(seconds(0, 30), LEAK)
    assert (d.action, d.restarts_engine) == ("kv_reset", False)
    assert "skipped" not in d.reason


def test_kv_leak_without_sleep_mode_skips_to_a_restart_and_says_why():
    r = Run(config(**only("kv_leak")), EngineFacts(live_throttle=True))
    (d,) = r.over(seconds(0, 30), LEAK)
    assert (d.action, d.restarts_engine) == ("restart", True)
    assert "kv_reset: the engine cannot drop its KV cache in place" in d.reason


SILENT = "the engine did not answer its last /metrics scrape"
HELD = (f"kv_reset held back: {SILENT}: its pause would hold every request until it "
        "answers (at most 60 s)")


def test_a_kv_reset_waits_while_the_api_server_is_silent_and_goes_once_it_answers():
    """A KV reset pauses the engine through its API server; one that does not answer
    (its last scrape timed out) would hold every request until it does. The reset is
    held back, said once, and taken at the first tick after a scrape is answered."""
    r = Run(config(**only("kv_leak")), SLEEPY)
    assert r.over(seconds(0, 29), LEAK) == []
    ds = [r.at(t, LEAK, api_silent=SILENT) for t in (30, 31, 32)]
    assert [d.action for d in ds] == ["none"] * 3
    assert ds[0].held_back == HELD
    assert ds[1].held_back is None and ds[2].held_back is None  # (said once)
    d = r.at(33, LEAK, api_silent=None)
    assert (d.action, d.rule) == ("kv_reset", "kv_leak")
    assert r.state.memory.silent_since is None


def test_a_kv_reset_waits_for_a_silent_api_server_at_most_60_s_then_goes():
    """A server that never answers again: the reset goes after 60 s of waiting, as it
    did before it waited (its pause's timeout and the ladder's restart judge then)."""
    r = Run(config(**only("kv_leak")), SLEEPY)
    r.over(seconds(0, 29), LEAK)
    held = [r.at(t, LEAK, api_silent=SILENT) for t in seconds(30, 89)]
    assert {d.action for d in held} == {"none"} and held[0].held_back == HELD
    d = r.at(90, LEAK, api_silent=SILENT)
    assert (d.action, d.rule) == ("kv_reset", "kv_leak")


def test_a_kv_reset_waiting_for_a_silent_api_server_lets_the_other_rules_act():
    """The wait holds back the KV reset alone: a throttle for heat, due at the same
    time and lower in priority, is taken meanwhile (it asks the engine nothing)."""
    r = Run(config(**only("kv_leak", "thermal")), SLEEPY)
    both = {**LEAK, **gpu(4)}
    r.over(seconds(0, 29), both)
    d = r.at(30, both, api_silent=SILENT)
    assert (d.action, d.rule) == ("throttle", "thermal")
    d = r.at(31, both, api_silent=None)
    assert (d.action, d.rule) == ("kv_reset", "kv_leak")


def test_a_rung_the_operator_does_not_allow_is_skipped():
    r = Run(with_remedies(config(**only("kv_leak")), "throttle", "restart"), SLEEPY)
    (d,) = r.over(seconds(0, 30), LEAK)
    assert d.action == "restart" and "kv_reset: not in policy.remedies" in d.reason


def test_with_no_remedy_allowed_the_policy_only_alerts_once():
    r = Run(with_remedies(config(**only("kv_leak")),), SLEEPY)
    assert actions(r, seconds(0, 3000, 10), LEAK) == ["alert"]


def test_a_leak_that_outlives_the_kv_reset_climbs_one_rung_per_cooldown_to_the_alert():
    r = Run(config(**only("kv_leak")), SLEEPY)  # cooldown 120 s
    acted = [(t, d.action) for t, d in ((t, r.at(t, LEAK)) for t in seconds(0, 3000, 10))
             if d.action != "none"]
    # kv_reset (in place: still armed), restart (a new engine re-arms the rule), the
    # reduced batch, then the alert: the top, given once
    assert acted == [(30, "kv_reset"), (150, "restart"), (270, "reduce_batch"),
                     (390, "alert")]
    d = next(d for _, d in r.decisions if d.action == "restart")
    assert "still kv_cache_usage >= 0.5 and requests_running == 0 after kv_reset" in d.reason


def test_a_cleared_symptom_starts_the_ladder_again_from_its_first_rung():
    r = Run(config(**only("kv_leak")), SLEEPY)  # for_s 30
    assert actions(r, seconds(0, 30), LEAK) == ["kv_reset"]
    cured = {"kv_cache_usage": 0.0, "requests_running": 0}
    assert actions(r, seconds(31, 60), cured) == []
    assert r.state.memory.rules["kv_leak"].rung == "kv_reset"  # clear 29 s: not yet
    assert actions(r, [61], cured) == []
    assert r.state.memory.rules["kv_leak"].rung == ""  # clear 30 s, as long as it tripped
    # leaking again, a cooldown later: a new occurrence, the cheap remedy again
    assert actions(r, seconds(150, 180), LEAK) == ["kv_reset"]


def test_a_signal_unknown_for_one_scrape_does_not_restart_the_climb():
    r = Run(config(**only("kv_leak")), SLEEPY)
    assert actions(r, seconds(0, 30), LEAK) == ["kv_reset"]
    assert actions(r, seconds(32, 60, 2), LEAK) == []
    # one scrape failed: the signals are unknown, the condition reads as not holding
    assert actions(r, [62], {"kv_cache_usage": None, "requests_running": None}) == []
    assert r.state.memory.rules["kv_leak"].rung == "kv_reset"
    # the leak, still there, outlived its KV reset: the next rung up, not the reset again
    acted = actions(r, seconds(64, 200, 2), LEAK)
    assert acted == ["restart"], acted


def test_prefix_collapse_climbs_from_the_prefix_reset_past_throttling():
    r = Run(config(**only("prefix_collapse")), SLEEPY)  # cooldown 1800 s
    acted = [d.action for d in r.over(seconds(0, 2200, 10), COLLAPSE)]
    # a throttle does nothing for a collapsed hit rate: only throttle rules throttle
    assert acted == ["reset_prefix_cache", "kv_reset"]


def test_kv_saturation_escalates_through_kv_reset_restart_and_reduced_batch_to_an_alert():
    cfg = config(**only("kv_saturation", kv_saturation={"cooldown_s": 10,
                                                         "escalate_after_s": 100}))
    r = Run(cfg, SLEEPY)
    acted = [d.action for d in r.over(seconds(0, 2000, 5), LEAKING)]
    assert acted == ["throttle", "throttle", "throttle", "kv_reset", "restart",
                     "reduce_batch", "alert"]
    assert r.state.engine.throttle_level == 3 and r.state.engine.batch_reduced


def test_kv_saturation_without_sleep_mode_escalates_to_a_restart_as_before():
    cfg = config(**only("kv_saturation", kv_saturation={"cooldown_s": 10}))
    r = Run(cfg, EngineFacts(live_throttle=True))
    acted = [d for d in r.over(seconds(0, 700, 5), LEAKING)]
    assert [d.action for d in acted] == ["throttle"] * 3 + ["restart"]
    assert "kv_reset: the engine cannot drop its KV cache in place" in acted[-1].reason


def test_a_throttle_rule_whose_throttle_is_not_allowed_goes_straight_to_its_escalation():
    cfg = with_remedies(config(**only("thermal")), "kv_reset", "restart", "reduce_batch")
    r = Run(cfg, SLEEPY)
    acted = [(t, d.action) for t, d in ((t, r.at(t, gpu(2))) for t in seconds(0, 700, 10))
             if d.action != "none"]
    assert acted == [(630, "reduce_batch")]  # 30 s held, then 600 s "at the top"


def test_a_one_shot_rule_that_climbed_to_a_reduced_batch_restores_it_after_a_cooldown():
    cfg = config(**only("kv_leak", kv_leak={"cooldown_s": 100}))
    r = Run(cfg, SLEEPY)
    assert actions(r, seconds(0, 250, 10), LEAK) == ["kv_reset", "restart", "reduce_batch"]
    assert r.state.engine.batch_reduced
    clear = {"kv_cache_usage": 0.1, "requests_running": 2}
    assert actions(r, seconds(260, 350, 10), clear) == []  # gone, but not a cooldown yet
    (d,) = r.over([360], clear)
    assert (d.action, d.batch_reduced, d.restarts_engine) == ("lift", False, True)


def test_dry_run_reports_the_first_rung_each_cooldown_and_climbs_nothing():
    r = Run(config(dry_run=True, **only("kv_leak")), SLEEPY)
    acted = r.over(seconds(0, 400, 10), LEAK)
    assert [d.action for d in acted] == ["kv_reset"] * 4
    assert r.state.memory.rules["kv_leak"].rung == ""


# ---- an escalation needs its evidence (`escalate_when`) ---------------------------------

def test_a_saturation_by_load_stays_at_the_top_throttle_and_says_once_why_it_does_not_climb():
    """Every block held is one the running requests can hold: a KV reset would free none
    and make every stream compute its prompt again, so the rule never takes it."""
    cfg = config(**only("kv_saturation", kv_saturation={"cooldown_s": 10,
                                                         "escalate_after_s": 100}))
    r = Run(cfg, SLEEPY)
    assert actions(r, seconds(0, 2000, 5), SATURATED) == ["throttle"] * 3
    notes = [d.held_back for _, d in r.decisions if d.held_back]
    assert notes == ["kv_reset held back: it needs kv_blocks_unaccounted > 0, which does "
                     "not hold: nothing says kv_reset would cure it"], notes
    held = next(d for _, d in r.decisions if d.held_back)
    assert held.rule == "kv_saturation" and held.evidence["kv_blocks_unaccounted"] == -120.0
    assert r.state.engine.throttle_level == 3 and not r.state.engine.batch_reduced


def test_the_escalation_goes_once_its_evidence_appears_and_not_while_it_is_unknown():
    cfg = config(**only("kv_saturation", kv_saturation={"cooldown_s": 10,
                                                         "escalate_after_s": 100}))
    r = Run(cfg, SLEEPY)
    unknown = {**SATURATED, "kv_blocks_unaccounted": None}  # (no max_model_len said)
    assert actions(r, seconds(0, 600, 5), unknown) == ["throttle"] * 3
    # blocks held that no running request can hold: leaked, and the reset frees them
    assert actions(r, seconds(605, 700, 5), LEAKING) == ["kv_reset"]


def test_an_escalation_held_for_its_evidence_does_not_hold_back_another_rules_action():
    cfg = config(**only("kv_saturation", "prefix_collapse",
                        kv_saturation={"cooldown_s": 10, "escalate_after_s": 100}))
    r = Run(cfg, SLEEPY)
    assert actions(r, seconds(0, 600, 5), SATURATED) == ["throttle"] * 3
    both = {**SATURATED, **COLLAPSE}
    assert actions(r, seconds(605, 1000, 5), both) == ["reset_prefix_cache"]
