"""The watchdog's config sections: defaults, rules merged over the defaults, and errors
that name the full key path."""

from __future__ import annotations

from typing import Any

import pytest

from supervisor.config import ConfigError, parse_config
from supervisor.rules import DEFAULT_RULES


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
    ({"escalate_action": ""}, "policy.rules.kv_saturation.escalate_action", "required"),
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
