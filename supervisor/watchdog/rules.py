"""The watchdog's rules: their schema and the defaults that ship. Pure data.

Each rule names a condition over signals (`supervisor.conditions`), how long it must
hold (as an unbroken streak, or, with `for_fraction` below 1, in that share of the
samples over the last `for_s`: real saturation oscillates), a clear condition and how
long that must hold (hysteresis), an action, a cooldown, and optionally an escalation:
what to do when the condition outlives the action (for a throttle: still true this long
at the top level). Why each default is what it is: docs/watchdog.md.
"""

from __future__ import annotations

from dataclasses import dataclass

# What a rule may ask for. "throttle" and "reduce_batch" are lifted again, one step at
# a time, once the rule's clear condition has held for clear_for_s.
ACTIONS = ("alert", "throttle", "reduce_batch", "reset_prefix_cache", "kv_reset", "restart",
           "restart_now", "fewer_spec_tokens", "more_spec_tokens", "hold_down")
LIFTABLE = ("throttle", "reduce_batch")

# The remediation ladder, cheapest rung first. A rule enters at its own action (or, for a
# throttle rule, at its escalate_action once throttling is exhausted); while its symptom
# persists without clearing, each further firing climbs to the next rung that the
# operator allows (`policy.remedies`) and the engine supports, skipping throttle (only a
# throttle rule throttles). "alert" is the top: give up acting and say so.
LADDER = ("reset_prefix_cache", "throttle", "kv_reset", "restart", "reduce_batch", "alert")
REMEDIES = LADDER[:-1]  # what `policy.remedies` may list; alerting is always allowed
# Remedies that leave the engine running: the rule stays armed, to climb if they fail.
IN_PLACE = ("reset_prefix_cache", "kv_reset")


@dataclass(frozen=True)
class RuleConfig:
    when: str
    action: str
    enabled: bool = True
    for_s: float = 0.0
    # 1: the condition holds for all of for_s without a break; below 1: in at least that
    # share of the samples over the last for_s (unknown samples count as not true), the
    # window covered, and the condition true now
    for_fraction: float = 1.0
    clear_when: str = ""  # empty: the rule is clear when `when` does not hold
    clear_for_s: float = 0.0
    cooldown_s: float = 300.0
    escalate_after_s: float = 0.0  # 0: never
    escalate_action: str = ""
    # the escalation also needs this to hold now (empty: nothing more): the evidence that
    # the next rung can cure what the throttle did not; while it does not hold, the rule
    # stays at the top throttle level and says once why it does not climb
    escalate_when: str = ""


DEFAULT_RULES: dict[str, RuleConfig] = {
    # vLLM preempts (evicts a running request, to recompute it later) only when its KV
    # cache cannot hold the next tokens: a sustained preemption rate is saturation by what
    # it costs. The window is longer than the rate's own (60 s): one burst keeps the rate
    # up for 60 s and must not trip it alone.
    "kv_saturation": RuleConfig(
        when="preemption_rate >= 0.2",
        for_s=90, for_fraction=0.8, clear_when="kv_cache_usage < 0.85", clear_for_s=300,
        action="throttle", cooldown_s=120, escalate_after_s=300, escalate_action="kv_reset",
        # a KV reset (and the restart above it) costs every running stream its prefill
        # again, and frees only blocks that no running request holds: escalate on that
        # evidence alone, never on load that the cache is too small for
        escalate_when="kv_blocks_unaccounted > 0"),
    "kv_leak": RuleConfig(
        when="kv_cache_usage >= 0.5 and requests_running == 0", for_s=30, for_fraction=0.8,
        action="kv_reset", cooldown_s=120),
    "prefix_collapse": RuleConfig(
        when="prefix_cache_hit_rate < 0.40 and prefix_cache_hit_rate_ratio < 0.5",
        for_s=300, for_fraction=0.8, action="reset_prefix_cache", cooldown_s=1800),
    "memory_growth": RuleConfig(
        when=("engine_rss_bytes > 6.4e10 or engine_rss_growth_bytes_per_h > 2e9"
              " or engine_gpu_memory_growth_bytes_per_h > 1e9"),
        for_s=60, action="restart", cooldown_s=3600),
    "no_progress": RuleConfig(
        when="engine_stalled_s >= 6", for_s=0, action="restart_now", cooldown_s=60),
    "hang": RuleConfig(
        when="canary_failures >= 3 or metrics_staleness_s >= 30", for_s=0,
        action="restart_now", cooldown_s=60),
    "thermal": RuleConfig(
        when="gpu_slowdown_margin_c <= 5 or gpu_thermal_throttled >= 1", for_s=30,
        for_fraction=0.8,
        # (clear also needs `when` to be false: NVML's slowdown flag blocks a lift when
        # reported, and a card that cannot report its clock reasons can still cool down)
        clear_when="gpu_slowdown_margin_c >= 8",
        clear_for_s=120, action="throttle", cooldown_s=60,
        escalate_after_s=600, escalate_action="reduce_batch"),
    # the host's CPU/SoC (unified-memory machines: vllm#51950), off unless enabled; the
    # threshold is the host's own (a GB10's SoC throttles near 100 C)
    "host_thermal": RuleConfig(
        enabled=False, when="host_temperature_c >= 95", for_s=30, for_fraction=0.8,
        clear_when="host_temperature_c <= 85", clear_for_s=120, action="throttle",
        cooldown_s=60),
    "power_budget": RuleConfig(
        enabled=False, when="gpu_power_w > 600", for_s=60, for_fraction=0.8,
        clear_when="gpu_power_w < 560", clear_for_s=120, action="throttle", cooldown_s=120),
    "spec_decode_low": RuleConfig(
        when="spec_decode_acceptance_rate < 0.4", for_s=600,
        action="fewer_spec_tokens", cooldown_s=600),
    "spec_decode_high": RuleConfig(
        when="spec_decode_acceptance_rate > 0.75", for_s=600,
        action="more_spec_tokens", cooldown_s=600),
    "max_uptime": RuleConfig(
        enabled=False,
        when="engine_uptime_s >= 21600 and requests_running == 0 and requests_waiting == 0",
        action="restart", cooldown_s=3600),
    "xid_restart": RuleConfig(when="gpu_xid_restart_errors > 0", action="restart",
                              cooldown_s=60),
    "xid_reset": RuleConfig(when="gpu_xid_reset_errors > 0", action="hold_down",
                            cooldown_s=60),
}
