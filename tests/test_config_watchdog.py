"""The watchdog's config sections: defaults, rules merged over the defaults, and errors
that name the full key path."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from supervisor.settings.config import ConfigError, diff_keys, parse_config
from supervisor.settings.sections import GpuConfig
from supervisor.watchdog.rules import DEFAULT_RULES


def doc(**sections: Any) -> dict[str, Any]:
    return {"engine": {"command": ["vllm"]}, **sections}


def problems(d: dict[str, Any]) -> str:
    with pytest.raises(ConfigError) as e:
        parse_config(d)
    return str(e.value)


def test_defaults_carry_every_default_rule():
    cfg = parse_config(doc())
    assert cfg.policy.rules == DEFAULT_RULES
    assert not cfg.policy.rules["power_budget"].enabled
    assert cfg.exporter.listen == "127.0.0.1:9402" and cfg.canary.period_s == 10


def test_one_key_of_a_default_rule_keeps_the_others():
    cfg = parse_config(doc(policy={"dry_run": True, "rules": {"hang": {"for_s": 5}}}))
    hang = cfg.policy.rules["hang"]
    assert hang.for_s == 5 and hang.when == DEFAULT_RULES["hang"].when
    assert hang.action == "restart_now" and cfg.policy.dry_run


def test_a_new_rule_needs_when_and_action():
    cfg = parse_config(doc(policy={"rules": {"slow_ttft": {
        "when": "ttft_p99 > 2", "action": "alert", "for_s": 120}}}))
    assert cfg.policy.rules["slow_ttft"].action == "alert"
    msg = problems(doc(policy={"rules": {"slow_ttft": {"when": "ttft_p99 > 2"}}}))
    assert "policy.rules.slow_ttft.action: required for a new rule" in msg


@pytest.mark.parametrize(("rule", "where", "what"), [
    ({"when": "kv_cache_usage >= banana"}, "policy.rules.kv_saturation.when", "cannot read"),
    ({"when": "kv_usage >= 0.9"}, "policy.rules.kv_saturation.when", "unknown signal"),
    ({"clear_when": "x < 1"}, "policy.rules.kv_saturation.clear_when", "unknown signal"),
    ({"color": "red"}, "policy.rules.kv_saturation.color", "unknown key"),
    ({"action": "reboot"}, "policy.rules.kv_saturation.action", "expected one of"),
    ({"for_s": -1}, "policy.rules.kv_saturation.for_s", "expected a number of seconds"),
    ({"enabled": "yes"}, "policy.rules.kv_saturation.enabled", "expected true or false"),
    ({"for_fraction": 0}, "policy.rules.kv_saturation.for_fraction", "above 0 and at most 1"),
    ({"for_fraction": 1.5}, "policy.rules.kv_saturation.for_fraction", "got 1.5"),
    ({"escalate_action": ""}, "policy.rules.kv_saturation.escalate_action", "required"),
    ({"escalate_when": "leaked > 0"}, "policy.rules.kv_saturation.escalate_when",
     "unknown signal"),
    ({"escalate_when": 3}, "policy.rules.kv_saturation.escalate_when", "condition string"),
])
def test_bad_rule_values_name_the_full_key(rule, where, what):
    msg = problems(doc(policy={"rules": {"kv_saturation": rule}}))
    assert where in msg and what in msg


def test_every_problem_is_reported_at_once():
    msg = problems(doc(policy={"rules": {"hang": {"for_s": "soon"}, "thermal": {"x": 1}}},
                       exporter={"listen": "nowhere"}))
    assert "policy.rules.hang.for_s" in msg and "policy.rules.thermal.x" in msg


@pytest.mark.parametrize(("sections", "where"), [
    ({"exporter": {"listen": "9402"}}, "exporter.listen"),
    ({"exporter": {"listen": "host:99999"}}, "exporter.listen"),
    ({"gpu": {"sampler": "file"}}, "gpu.file"),
    ({"gpu": {"sampler": "dcgm"}}, "gpu.sampler"),
    ({"throttle": {"level_factors": [0.5, 0.75]}}, "throttle.level_factors"),
    ({"throttle": {"level_factors": [1.5]}}, "throttle.level_factors"),
    ({"canary": {"timeout_s": 0}}, "canary.timeout_s"),
    ({"policy": {"rules": []}}, "policy.rules"),
])
def test_bad_watchdog_sections(sections, where):
    assert where in problems(doc(**sections))


def test_exporter_off_needs_no_valid_address_and_ipv6_is_fine():
    assert not parse_config(doc(exporter={"enabled": False, "listen": "x"})).exporter.enabled
    assert parse_config(doc(exporter={"listen": "[::1]:9402"})).exporter.listen == "[::1]:9402"


def test_watchdog_section_defaults():
    cfg = parse_config(doc())
    assert (cfg.canary.enabled, cfg.canary.timeout_s, cfg.canary.max_tokens) == (True, 5.0, 1)
    assert (cfg.gpu.sampler, cfg.gpu.file, cfg.gpu.slowdown_fallback_c) == ("auto", "", 85.0)
    assert cfg.signals.rate_window_s == 60 and cfg.signals.min_prefix_queries == 2048
    assert cfg.throttle.level_factors == [0.75, 0.5, 0.25]
    p = cfg.policy
    assert (p.enabled, p.dry_run, p.max_restarts_per_hour, p.min_action_gap_s) == (
        True, False, 4, 60.0)
    assert cfg.exporter.enabled


def test_the_signal_window_takes_the_gpu_fallback_and_a_staleness_from_the_gpu_period():
    cfg = parse_config(doc(signals={"rate_window_s": 30},
                           gpu={"period_s": 20, "slowdown_fallback_c": 80}))
    w = cfg.signals.window(cfg.gpu)
    assert (w.rate_window_s, w.slowdown_fallback_c, w.gpu_stale_s) == (30.0, 80.0, 60.0)
    assert parse_config(doc()).signals.window(GpuConfig()).gpu_stale_s == 30.0


def test_a_new_rule_without_when_names_that_key():
    msg = problems(doc(policy={"rules": {"quiet": {"action": "alert"}}}))
    assert "policy.rules.quiet.when: required for a new rule" in msg
    assert "policy.rules.quiet.action" not in msg


def test_a_default_rule_can_be_enabled_and_its_condition_replaced():
    cfg = parse_config(doc(policy={"rules": {"power_budget": {
        "enabled": True, "when": "gpu_power_ratio > 0.95", "clear_when": ""}}}))
    rule = cfg.policy.rules["power_budget"]
    assert rule.enabled and rule.when == "gpu_power_ratio > 0.95" and rule.clear_when == ""
    assert rule.action == "throttle" and rule.for_s == 60  # the rest stays
    assert cfg.policy.rules["thermal"] == DEFAULT_RULES["thermal"]


def test_problems_start_with_the_source_and_the_full_key_path():
    with pytest.raises(ConfigError) as e:
        parse_config(doc(policy={"rules": {"kv_saturation": {"when": "kv_usage > 1"}}}),
                     source="/etc/vllm-supervisor.toml")
    assert e.value.problems == [
        "policy.rules.kv_saturation.when: unknown signal 'kv_usage'"]
    assert str(e.value) == ("/etc/vllm-supervisor.toml: policy.rules.kv_saturation.when: "
                            "unknown signal 'kv_usage'")


@pytest.mark.parametrize("listen", [":9402", "host:", "host:port", "[::1]", "", "h:-1"])
def test_bad_exporter_addresses(listen):
    assert "exporter.listen" in problems(doc(exporter={"listen": listen}))


@pytest.mark.parametrize("listen", ["0.0.0.0:9402", "localhost:9402", "127.0.0.1:0"])
def test_good_exporter_addresses(listen):
    assert parse_config(doc(exporter={"listen": listen})).exporter.listen == listen


@pytest.mark.parametrize("factors", [[], [0.0], [0.5, 0.5], [0.75, 0.5, 1.0], [0.5, -0.1]])
def test_level_factors_must_decrease_strictly_between_0_and_1(factors):
    assert "throttle.level_factors" in problems(doc(throttle={"level_factors": factors}))


def test_gpu_file_sampler_with_a_file_resolves_it():
    cfg = parse_config(doc(gpu={"sampler": "file", "file": "gpu.jsonl"}), base_dir=Path("/b"))
    assert cfg.gpu.file == "/b/gpu.jsonl"


def test_a_changed_rule_shows_in_diff_keys():
    old = parse_config(doc())
    new = parse_config(doc(policy={"rules": {"hang": {"cooldown_s": 30}}}))
    assert diff_keys(old, new) == ["policy.rules"]


def test_evidence_rules_must_name_rules_and_the_dir_sits_beside_the_audit_trail():
    msg = problems(doc(evidence={"rules": ["hang", "frozen"]}))
    assert "evidence.rules: unknown rules ['frozen']" in msg
    cfg = parse_config(doc(audit={"path": "var/events.jsonl"}), "t.toml", Path("/base"))
    assert cfg.evidence.dir == "/base/var/evidence"
    assert cfg.evidence.rules == ["hang", "no_progress", "xid_restart", "xid_reset"]
