"""The one list of the watchdog's signals: each name, its exporter gauge and its help.

The same names appear in `config.toml`'s rule conditions, in log lines, in `status` and
(with the unit spelled out, Prometheus style) on the exporter. `signals.SignalWindow`
computes their values; this module only names them, so that the config's schema, the
policy and the views can know them without the window's arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SignalSpec:
    name: str
    metric: str  # the exporter's gauge name, after the vllm_supervisor_ prefix
    help: str


def _s(name: str, metric: str, help: str) -> SignalSpec:
    return SignalSpec(name, metric, help)


SIGNALS: tuple[SignalSpec, ...] = (
    _s("kv_cache_usage", "kv_cache_usage_ratio", "KV cache usage, 0..1 (worst engine)"),
    _s("kv_blocks_total", "kv_blocks", "KV cache blocks the engine allocated"),
    _s("kv_blocks_held", "kv_blocks_held", "KV blocks in use (usage x blocks)"),
    _s("kv_blocks_per_running_request", "kv_blocks_per_running_request",
       "KV blocks held per running request (the leak signature); unknown when none run"),
    _s("kv_blocks_unaccounted", "kv_blocks_unaccounted",
       "KV blocks held beyond what the running (and deferred) requests can hold at the "
       "engine's max_model_len (above 0: held by no request, leaked); unknown without it"),
    _s("requests_running", "requests_running", "requests the engine is running"),
    _s("requests_waiting", "requests_waiting", "requests queued in the engine"),
    _s("preemption_rate", "preemptions_per_second", "preemptions per second over the window"),
    _s("prefix_cache_hit_rate", "prefix_cache_hit_ratio",
       "prefix-cache hits / queries (tokens) over the window, with enough queries"),
    _s("prefix_cache_hit_rate_baseline", "prefix_cache_hit_ratio_baseline",
       "prefix-cache hit rate over the trailing baseline window before the current one"),
    _s("prefix_cache_hit_rate_ratio", "prefix_cache_hit_ratio_to_baseline",
       "current prefix-cache hit rate / its trailing baseline"),
    _s("generation_tokens_per_s", "generation_tokens_per_second",
       "generated tokens per second over the window"),
    _s("ttft_p99", "ttft_p99_seconds", "99th percentile time to first token over the window"),
    _s("spec_decode_acceptance_rate", "spec_decode_acceptance_ratio",
       "accepted / drafted speculative tokens over the window"),
    _s("engine_rss_bytes", "engine_rss_bytes", "resident memory of the whole engine tree"),
    _s("engine_rss_growth_bytes_per_h", "engine_rss_growth_bytes_per_hour",
       "growth of the engine tree's RSS over the growth window, per hour"),
    _s("engine_cpu_percent", "engine_cpu_percent", "CPU of the engine tree (100 = one core)"),
    _s("engine_uptime_s", "engine_serving_seconds", "seconds since the engine became healthy"),
    _s("gpu_temperature_c", "gpu_temperature_celsius", "hottest engine GPU"),
    _s("host_temperature_c", "host_temperature_celsius",
       "hottest CPU/SoC sensor of the host (psutil; unknown where it exposes none)"),
    _s("host_memory_stall_percent", "host_memory_stall_percent",
       "share of the last 10 s in which every task of the host stalled on memory "
       "(PSI full avg10; unknown without PSI)"),
    _s("gpu_slowdown_temperature_c", "gpu_slowdown_temperature_celsius",
       "the card's own slowdown threshold (NVML), or the configured fallback"),
    _s("gpu_slowdown_margin_c", "gpu_slowdown_margin_celsius",
       "degrees below the slowdown threshold (negative: above it)"),
    _s("gpu_power_w", "gpu_power_watts", "power draw of the engine GPUs"),
    _s("gpu_power_limit_w", "gpu_power_limit_watts", "enforced power limit of the engine GPUs"),
    _s("gpu_power_ratio", "gpu_power_ratio", "power draw / enforced limit"),
    _s("gpu_utilization", "gpu_utilization_ratio", "GPU utilisation, 0..1"),
    _s("gpu_memory_used_bytes", "gpu_memory_used_bytes", "memory used on the engine GPUs"),
    _s("engine_gpu_memory_bytes", "engine_gpu_memory_bytes",
       "GPU memory NVML attributes to the engine tree's pids"),
    _s("engine_gpu_memory_growth_bytes_per_h", "engine_gpu_memory_growth_bytes_per_hour",
       "growth of the engine tree's GPU memory over the growth window, per hour"),
    _s("gpu_thermal_throttled", "gpu_thermal_throttled",
       "1 when NVML reports SW or HW thermal slowdown"),
    _s("gpu_power_capped", "gpu_power_capped",
       "1 when NVML reports SW power cap or HW power brake (normal under full load)"),
    _s("gpu_xid_restart_errors", "gpu_xid_restart_errors",
       "XIDs since this engine started that an engine restart clears"),
    _s("gpu_xid_reset_errors", "gpu_xid_reset_errors",
       "XIDs since this engine started that need a GPU reset or a reboot"),
    _s("canary_failures", "canary_failures", "consecutive canary failures without progress"),
    _s("canary_latency_s", "canary_latency_seconds", "latency of the last passing canary"),
    _s("metrics_age_s", "metrics_age_seconds", "seconds since the last good /metrics scrape"),
    _s("metrics_staleness_s", "metrics_staleness_seconds",
       "seconds the engine's metrics have not moved while requests were running"),
    _s("engine_stalled_s", "engine_stalled_seconds",
       "seconds the engine's step and token counters have not moved while it had requests "
       "running or waiting (0 when they move or it is idle)"),
    _s("scrape_failures_total", "scrape_failures", "failed /metrics scrapes, this daemon"),
    _s("kv_tier_store_refusals_per_s", "kv_tier_store_refusals_per_second",
       "stores per second that vLLM's KV tier refused, its CPU part full (vLLM 0.33+, "
       "engine.kv_tier; each a request's new blocks, computed again after a fault)"),
    _s("kv_tier_stored_bytes_per_s", "kv_tier_stored_bytes_per_second",
       "bytes per second vLLM stored from the GPU into its KV tier (vLLM 0.33+)"),
    _s("kv_tier_loaded_bytes_per_s", "kv_tier_loaded_bytes_per_second",
       "bytes per second vLLM loaded from its KV tier instead of computing them (0.33+)"),
    _s("sleep_ops_in_flight", "sleep_mode_operations_in_flight",
       "sleep-mode calls (sleep, wake) the engine's API server is in (vLLM 0.32+; unknown "
       "until its first)"),
)

SIGNAL_NAMES: frozenset[str] = frozenset(s.name for s in SIGNALS)

Signals = dict[str, float | None]
