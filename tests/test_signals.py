"""SignalWindow at explicit times: real scrapes and synthetic snapshots in, signals out."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest

from supervisor.watchdog import signals
from supervisor.watchdog.gpu import DeviceReading, GpuReading, summarise
from supervisor.watchdog.metrics import Snapshot, parse_metrics
from supervisor.watchdog.signal_list import SIGNAL_NAMES, SIGNALS, Signals
from supervisor.watchdog.signals import SignalWindow, WindowConfig, histogram_quantile

FIX = Path(__file__).parent / "fixtures" / "vllm-0.32-cpu-metrics"


def scrape(name: str) -> Snapshot:
    return parse_metrics((FIX / name).read_text())


def compute(w: SignalWindow, now: float) -> Signals:
    return w.compute(now, metrics_age_s=1.0, staleness_s=0.0, scrape_failures_total=0,
                     engine_uptime_s=100.0)


def feed(w: SignalWindow, times: range | list[float], **series: object) -> None:
    """Snapshots at `times`; each keyword is a function of the time or a constant."""
    for t in times:
        fields = {k: (v(t) if callable(v) else v) for k, v in series.items()}
        w.add_metrics(t, Snapshot(**fields))  # type: ignore[arg-type]


def test_signal_names_and_exporter_names_are_unique():
    assert len(SIGNAL_NAMES) == len(SIGNALS)
    assert len({s.metric for s in SIGNALS}) == len(SIGNALS)


def test_an_empty_window_knows_nothing_but_its_counts():
    s = compute(SignalWindow(WindowConfig()), 0.0)
    assert set(s) == SIGNAL_NAMES
    assert s["kv_cache_usage"] is None and s["preemption_rate"] is None
    assert s["gpu_slowdown_margin_c"] is None and s["engine_rss_bytes"] is None
    assert (s["canary_failures"], s["gpu_xid_restart_errors"], s["gpu_xid_reset_errors"]) \
        == (0.0, 0.0, 0.0)
    assert (s["metrics_age_s"], s["metrics_staleness_s"], s["scrape_failures_total"],
            s["engine_uptime_s"]) == (1.0, 0.0, 0.0, 100.0)


# ---- the real scrapes ------------------------------------------------------------------

def test_kv_saturated_scrape_gives_full_cache_a_queue_and_blocks_per_request():
    w = SignalWindow(WindowConfig())
    w.add_metrics(0.0, scrape("kv-saturated.txt"))
    s = compute(w, 0.0)
    assert s["kv_cache_usage"] == 1.0
    assert s["requests_waiting"] == 15.0 and s["requests_running"] == 4.0
    assert s["kv_blocks_total"] == 8.0 and s["kv_blocks_held"] == 8.0
    assert s["kv_blocks_per_running_request"] == 2.0
    assert s["preemption_rate"] is None  # one scrape is not a rate


def test_the_saturated_scrape_is_its_load_and_blocks_beyond_it_are_unaccounted():
    """The real saturated engine (8 blocks of 128 tokens, 4 running, all held), with the
    max_model_len its /v1/models says: the 4 requests can hold 4 x (2 + 1) blocks, so no
    block is unaccounted for. Unknown without max_model_len."""
    w = SignalWindow(WindowConfig())
    w.add_metrics(0.0, scrape("kv-saturated.txt"))
    assert compute(w, 0.0)["kv_blocks_unaccounted"] is None
    s = w.compute(0.0, metrics_age_s=1.0, staleness_s=0.0, scrape_failures_total=0,
                  engine_uptime_s=100.0, max_model_len=256)
    assert s["kv_blocks_unaccounted"] == 8.0 - 4 * 3
    # one request of at most 129 tokens running: it holds 3 blocks at most, 5 are held
    # by none (leaked)
    snap = dataclasses.replace(scrape("kv-saturated.txt"), requests_running=1.0)
    assert signals.unaccounted(8.0, snap, 129) == 8.0 - 3
    assert signals.unaccounted(8.0, dataclasses.replace(snap, requests_running=0.0),
                               129) == 8.0  # (nothing running holds nothing)
    assert signals.unaccounted(8.0, dataclasses.replace(snap, block_size=None), 129) is None
    # a request vLLM deferred, waiting on its KV tier's load, holds the blocks it loads
    # into: counted as one that runs, its blocks are accounted for
    assert signals.unaccounted(8.0, dataclasses.replace(snap, requests_deferred=1.0),
                               129) == 8.0 - 2 * 3
    assert signals.unaccounted(8.0, dataclasses.replace(snap, requests_deferred=None),
                               129) == 8.0 - 3  # (no reasons on the page: none deferred)


def test_idle_scrape_holds_no_blocks_and_per_request_is_unknown_with_nothing_running():
    w = SignalWindow(WindowConfig())
    w.add_metrics(0.0, scrape("idle.txt"))
    s = compute(w, 0.0)
    assert s["kv_blocks_held"] == 0.0 and s["requests_running"] == 0.0
    assert s["kv_blocks_per_running_request"] is None


def test_sleep_operations_in_flight_are_unknown_until_the_engine_has_the_series():
    w = SignalWindow(WindowConfig())
    w.add_metrics(0.0, scrape("idle.txt"))  # (vLLM registers them at its first call)
    assert compute(w, 0.0)["sleep_ops_in_flight"] is None
    page = (FIX.parent / "vllm-0.33-constructed" / "after-kv-reset.txt").read_text()
    w.add_metrics(1.0, parse_metrics(page))
    assert compute(w, 1.0)["sleep_ops_in_flight"] == 0.0
    w.add_metrics(2.0, parse_metrics(page.replace(
        'vllm:sleep_mode_operations_in_flight{operation="wake"} 0.0',
        'vllm:sleep_mode_operations_in_flight{operation="wake"} 1.0')))
    assert compute(w, 2.0)["sleep_ops_in_flight"] == 1.0


def test_rates_and_ttft_p99_between_the_idle_and_the_saturated_scrape():
    w = SignalWindow(WindowConfig(rate_window_s=60))
    w.add_metrics(0.0, scrape("idle.txt"))
    w.add_metrics(40.0, scrape("kv-saturated.txt"))
    s = compute(w, 40.0)
    assert s["preemption_rate"] == pytest.approx(9 / 40)
    assert s["generation_tokens_per_s"] == pytest.approx(2782 / 40)
    # the 10 first tokens: 7 by 1.0 s, 10 by 2.5 s; rank 9.9 -> 1.0 + 1.5 * 2.9 / 3
    assert s["ttft_p99"] == pytest.approx(2.45)
    # 180 prefix-cache queries are too few to judge a hit rate on
    assert s["prefix_cache_hit_rate"] is None


def test_ttft_p99_covers_only_the_window_not_the_engines_whole_life():
    w = SignalWindow(WindowConfig(rate_window_s=60))
    w.add_metrics(0.0, scrape("kv-saturated.txt"))
    w.add_metrics(40.0, scrape("after-load.txt"))
    # increase: 7 in (1.0, 2.5], 7 in (2.5, 5.0]; rank 13.86 -> 2.5 + 2.5 * 6.86 / 7
    assert compute(w, 40.0)["ttft_p99"] == pytest.approx(4.95)
    assert compute(w, 40.0)["preemption_rate"] == pytest.approx((45 - 9) / 40)


def test_histogram_quantile_edges():
    inf = math.inf
    assert histogram_quantile(0.99, [], [(1.0, 5.0)]) is None  # no +Inf bucket
    assert histogram_quantile(0.99, [(1.0, 5.0), (inf, 5.0)], [(1.0, 5.0), (inf, 5.0)]) is None
    # in the open bucket: the highest finite bound
    assert histogram_quantile(0.99, [], [(1.0, 1.0), (2.0, 1.0), (inf, 10.0)]) == 2.0
    # in the first bucket: interpolated from 0
    assert histogram_quantile(0.5, [], [(4.0, 10.0), (inf, 10.0)]) == pytest.approx(2.0)


# ---- rates from counters ---------------------------------------------------------------

def test_rates_need_half_the_window_covered():
    w = SignalWindow(WindowConfig(rate_window_s=60))
    feed(w, range(0, 31, 10), preemptions_total=lambda t: t / 10,
         generation_tokens_total=lambda t: 100.0 * t)
    w20 = SignalWindow(WindowConfig(rate_window_s=60))
    feed(w20, range(0, 21, 10), preemptions_total=lambda t: t / 10)
    assert compute(w20, 20.0)["preemption_rate"] is None
    s = compute(w, 30.0)
    assert s["preemption_rate"] == pytest.approx(0.1)
    assert s["generation_tokens_per_s"] == pytest.approx(100.0)


def test_rates_use_only_the_last_window():
    w = SignalWindow(WindowConfig(rate_window_s=60))
    # 1 preemption/s for 100 s, then none for 60 s
    feed(w, range(0, 161, 10), preemptions_total=lambda t: float(min(t, 100)))
    assert compute(w, 160.0)["preemption_rate"] == 0.0
    assert compute(w, 160.0)["preemption_rate"] is not None


def test_a_counter_reset_makes_the_rate_unknown():
    w = SignalWindow(WindowConfig(rate_window_s=60))
    feed(w, range(0, 61, 10), preemptions_total=lambda t: 100.0 + t,
         generation_tokens_total=lambda t: 1000.0 + t)
    feed(w, [70.0], preemptions_total=2.0, generation_tokens_total=5.0)
    s = compute(w, 70.0)
    assert s["preemption_rate"] is None and s["generation_tokens_per_s"] is None


def test_an_absent_counter_is_unknown_not_zero():
    w = SignalWindow(WindowConfig(rate_window_s=60))
    feed(w, range(0, 61, 10), generation_tokens_total=lambda t: float(t))
    s = compute(w, 60.0)
    assert s["generation_tokens_per_s"] == pytest.approx(1.0)
    assert s["preemption_rate"] is None and s["spec_decode_acceptance_rate"] is None


# ---- prefix cache ----------------------------------------------------------------------

def test_prefix_hit_rate_needs_enough_queries():
    cfg = WindowConfig(rate_window_s=60, min_prefix_queries=2048)
    few = SignalWindow(cfg)  # 30 query tokens/s: 1800 over the window
    feed(few, range(0, 61, 10), prefix_cache_queries_total=lambda t: 30.0 * t,
         prefix_cache_hits_total=lambda t: 15.0 * t)
    assert compute(few, 60.0)["prefix_cache_hit_rate"] is None
    enough = SignalWindow(cfg)  # 50/s: 3000
    feed(enough, range(0, 61, 10), prefix_cache_queries_total=lambda t: 50.0 * t,
         prefix_cache_hits_total=lambda t: 20.0 * t)
    assert compute(enough, 60.0)["prefix_cache_hit_rate"] == pytest.approx(0.4)


def test_the_old_hit_rate_gauge_is_used_when_the_counters_are_absent():
    w = SignalWindow(WindowConfig())
    w.add_metrics(0.0, Snapshot(prefix_cache_hit_rate_gauge=0.7))
    assert compute(w, 0.0)["prefix_cache_hit_rate"] == 0.7
    # with the counters present (though too few queries), the gauge is not used
    w = SignalWindow(WindowConfig())
    feed(w, range(0, 61, 10), prefix_cache_queries_total=lambda t: float(t),
         prefix_cache_hits_total=0.0, prefix_cache_hit_rate_gauge=0.7)
    assert compute(w, 60.0)["prefix_cache_hit_rate"] is None


def collapsing(w: SignalWindow, until: int, end: int) -> None:
    """100 query tokens/s; 80% hits until `until`, no hits after."""
    feed(w, range(0, end + 1, 10), prefix_cache_queries_total=lambda t: 100.0 * t,
         prefix_cache_hits_total=lambda t: 80.0 * min(t, until))


def test_the_baseline_excludes_the_window_being_judged():
    w = SignalWindow(WindowConfig(rate_window_s=60, baseline_window_s=3600))
    collapsing(w, until=3540, end=3600)
    s = compute(w, 3600.0)
    assert s["prefix_cache_hit_rate"] == 0.0
    # the collapse is in the last 60 s only: a baseline that took it in would be < 0.8
    assert s["prefix_cache_hit_rate_baseline"] == pytest.approx(0.8)
    assert s["prefix_cache_hit_rate_ratio"] == 0.0


def test_the_baseline_trails_by_the_baseline_window():
    w = SignalWindow(WindowConfig(rate_window_s=60, baseline_window_s=3600))
    collapsing(w, until=3000, end=7200)
    s = compute(w, 7200.0)
    assert s["prefix_cache_hit_rate"] == 0.0
    assert s["prefix_cache_hit_rate_baseline"] is None  # an hour without a hit


def test_the_baseline_is_unknown_early_and_for_an_engine_that_never_had_hits():
    early = SignalWindow(WindowConfig(rate_window_s=60, baseline_window_s=3600))
    collapsing(early, until=10_000, end=100)
    assert compute(early, 100.0)["prefix_cache_hit_rate"] == pytest.approx(0.8)
    assert compute(early, 100.0)["prefix_cache_hit_rate_baseline"] is None
    never = SignalWindow(WindowConfig(rate_window_s=60, baseline_window_s=3600))
    feed(never, range(0, 3601, 10), prefix_cache_queries_total=lambda t: 100.0 * t,
         prefix_cache_hits_total=0.0)
    s = compute(never, 3600.0)
    assert s["prefix_cache_hit_rate"] == 0.0
    assert s["prefix_cache_hit_rate_baseline"] is None
    assert s["prefix_cache_hit_rate_ratio"] is None


def test_spec_decode_acceptance_needs_enough_drafts():
    w = SignalWindow(WindowConfig(rate_window_s=60, min_spec_draft_tokens=256))
    feed(w, range(0, 61, 10), spec_decode_draft_tokens_total=lambda t: 10.0 * t,
         spec_decode_accepted_tokens_total=lambda t: 3.0 * t)
    assert compute(w, 60.0)["spec_decode_acceptance_rate"] == pytest.approx(0.3)
    few = SignalWindow(WindowConfig(rate_window_s=60, min_spec_draft_tokens=256))
    feed(few, range(0, 61, 10), spec_decode_draft_tokens_total=lambda t: 4.0 * t,
         spec_decode_accepted_tokens_total=lambda t: 3.0 * t)
    assert compute(few, 60.0)["spec_decode_acceptance_rate"] is None


# ---- host memory -----------------------------------------------------------------------

def test_rss_growth_is_unknown_before_90_percent_of_the_window_then_per_hour():
    w = SignalWindow(WindowConfig(rss_growth_window_s=1800))
    mb = 1_000_000
    for t in range(0, 1606, 15):
        w.add_tree(float(t), 8_000 * mb + t // 15 * mb, 150.0)
    s = compute(w, 1605.0)
    assert s["engine_rss_growth_bytes_per_h"] is None  # 1605 s < 1620 s
    assert s["engine_rss_bytes"] == 8_000 * mb + 107 * mb and s["engine_cpu_percent"] == 150.0
    w.add_tree(1620.0, 8_000 * mb + 108 * mb, 140.0)
    # 1 MB per 15 s
    assert compute(w, 1620.0)["engine_rss_growth_bytes_per_h"] == pytest.approx(240 * mb)


def test_rss_growth_forgets_samples_older_than_the_window():
    w = SignalWindow(WindowConfig(rss_growth_window_s=1800))
    for t in range(0, 3616, 15):
        w.add_tree(float(t), 1_000_000 * min(t, 1800), None)  # grows, then flat
    s = compute(w, 3615.0)
    assert s["engine_rss_growth_bytes_per_h"] == 0.0
    assert s["engine_cpu_percent"] is None


def test_a_start_and_a_sleep_are_no_growth_a_leak_once_serving_still_is():
    """The soak of issue 48: a CPU engine's RSS went from 0.1 GB (its first look, while it
    imported) to 3.5 GB (served), and one window after the start that read as 7.5 GB/h:
    memory_growth restarted a healthy engine 28 min after its start. Only samples of an
    engine that serves make growth points: its start, its proof and a remedy's sleep
    (a GPU engine's memory from its share to 1.8 GB and back) do not."""
    gb = 1_000_000_000
    w = SignalWindow(WindowConfig(rss_growth_window_s=1800,
                                  gpu_memory_growth_window_s=1800))
    for t, rss in ((0, 0.1), (30, 1.5), (60, 3.0), (70, 3.4)):  # starting, proving
        w.add_tree(float(t), int(rss * gb), 100.0, settled=False)
    for t in range(80, 1900, 15):  # serving, flat
        w.add_tree(float(t), int(3.5 * gb), 20.0)
    s = compute(w, 1885.0)
    assert s["engine_rss_growth_bytes_per_h"] == 0.0 and s["engine_rss_bytes"] == 3.5 * gb
    for t in range(1900, 3700, 15):  # then a real leak: 1 MB every 15 s
        w.add_tree(float(t), int(3.5 * gb) + (t - 1885) // 15 * 1_000_000, 20.0)
    assert compute(w, 3685.0)["engine_rss_growth_bytes_per_h"] == pytest.approx(240e6, 0.02)
    # a GPU engine asleep for a KV reset (not settled) and awake again: no growth
    pids = (100,)
    for t in range(0, 1900, 15):
        asleep = t < 30  # (the first samples: one would be the baseline)
        used = int(1.8 * gb) if asleep else 75 * gb
        w.add_gpu(float(t), reading(process_memory={100: used}), pids, {},
                  settled=not asleep)
    assert compute(w, 1885.0)["engine_gpu_memory_growth_bytes_per_h"] == 0.0


# ---- GPU -------------------------------------------------------------------------------

def reading(**kw: object) -> GpuReading:
    base: dict[str, object] = dict(
        temperature_c=80.0, slowdown_temperature_c=87.0, power_w=350.0, power_limit_w=700.0,
        utilization_ratio=0.9, memory_used_bytes=60 << 30, memory_total_bytes=80 << 30,
        clock_event_reasons=0, thermal_throttled=False, power_capped=True,
        process_memory={100: 1 << 30, 101: 2 << 30, 999: 4 << 30}, xids=(), errors=())
    return GpuReading(**{**base, **kw})  # type: ignore[arg-type]


def gpu_signals(r: GpuReading, at: float = 0.0, now: float = 0.0,
                pids: tuple[int, ...] = (100, 101)) -> Signals:
    w = SignalWindow(WindowConfig(slowdown_fallback_c=85.0, gpu_stale_s=30.0))
    w.add_gpu(at, r, pids, {})
    return compute(w, now)


def test_gpu_margin_from_the_cards_own_threshold_and_power_ratio():
    s = gpu_signals(reading())
    assert s["gpu_temperature_c"] == 80.0 and s["gpu_slowdown_temperature_c"] == 87.0
    assert s["gpu_slowdown_margin_c"] == 7.0
    assert s["gpu_power_w"] == 350.0 and s["gpu_power_ratio"] == 0.5
    assert s["gpu_utilization"] == 0.9 and s["gpu_memory_used_bytes"] == float(60 << 30)
    assert (s["gpu_thermal_throttled"], s["gpu_power_capped"]) == (0.0, 1.0)


def test_gpu_margin_is_each_cards_own_and_the_nearest_card_names_the_gpu():
    # GPU 2 is the hotter card, but GPU 3 (its own slowdown at 87 C) is nearer its mark:
    # the rule judges GPU 3 (a cross-card "coolest threshold - hottest temperature" would
    # say 1 C, which no card is at)
    r = summarise([DeviceReading(index=2, temperature_c=86.0, slowdown_temperature_c=95.0,
                                 process_memory={100: 1 << 30, 999: 1 << 30}),
                   DeviceReading(index=3, temperature_c=84.0, slowdown_temperature_c=87.0,
                                 process_memory={101: 2 << 30}, xids=(79,))],
                  process_memory={100: 1 << 30, 999: 1 << 30, 101: 2 << 30}, xids=(79,))
    s = gpu_signals(r)
    assert s["gpu_temperature_c"] == 86.0 and s["gpu_slowdown_margin_c"] == 3.0
    w = SignalWindow(WindowConfig(slowdown_fallback_c=85.0, gpu_stale_s=30.0))
    w.add_gpu(0.0, r, (100, 101), {79: "reset"})
    worst = w.worst_gpu(0.0)
    assert worst is not None and worst.index == 3
    assert w.xids == [(3, 79)]
    rows = w.gpu_devices(0.0, (100, 101))
    assert [(g["index"], g["engine_memory_bytes"], g["slowdown_margin_c"]) for g in rows] \
        == [(2, 1 << 30, 9.0), (3, 2 << 30, 3.0)]
    assert w.gpu_devices(31.0, (100,)) == [] and w.worst_gpu(31.0) is None  # stale


def test_gpu_margin_falls_back_to_85_c_when_nvml_has_no_threshold():
    s = gpu_signals(reading(slowdown_temperature_c=None, temperature_c=82.0))
    assert s["gpu_slowdown_temperature_c"] == 85.0 and s["gpu_slowdown_margin_c"] == 3.0
    hot = gpu_signals(reading(slowdown_temperature_c=None, temperature_c=90.0))
    assert hot["gpu_slowdown_margin_c"] == -5.0  # above the mark: negative


def test_gpu_unknowns_stay_unknown():
    s = gpu_signals(reading(temperature_c=None, power_limit_w=None, thermal_throttled=None,
                            power_capped=None, memory_used_bytes=None, process_memory=None))
    assert s["gpu_slowdown_margin_c"] is None and s["gpu_temperature_c"] is None
    assert s["gpu_power_ratio"] is None and s["gpu_power_w"] == 350.0
    assert s["gpu_thermal_throttled"] is None and s["gpu_power_capped"] is None
    assert s["gpu_memory_used_bytes"] is None and s["engine_gpu_memory_bytes"] is None


def test_engine_gpu_memory_sums_only_the_engines_pids():
    assert gpu_signals(reading())["engine_gpu_memory_bytes"] == float(3 << 30)
    assert gpu_signals(reading(), pids=())["engine_gpu_memory_bytes"] == 0.0
    assert gpu_signals(reading(thermal_throttled=True))["gpu_thermal_throttled"] == 1.0


def test_a_stale_gpu_reading_is_unknown():
    assert gpu_signals(reading(), at=0.0, now=30.0)["gpu_slowdown_margin_c"] == 7.0
    s = gpu_signals(reading(), at=0.0, now=30.5)
    assert all(s[n] is None for n in SIGNAL_NAMES
               if n.startswith("gpu_") and not n.startswith("gpu_xid"))
    assert s["engine_gpu_memory_bytes"] is None


def test_xids_are_counted_by_remedy_and_an_unknown_code_needs_a_reset():
    w = SignalWindow(WindowConfig())
    remedies = {31: "restart", 48: "reset", 79: "reboot", 92: "info"}
    w.add_gpu(0.0, reading(xids=(31, 92)), (100,), remedies)
    w.add_gpu(5.0, reading(xids=(31, 48, 79, 12345)), (100,), remedies)
    w.add_gpu(10.0, reading(), (100,), remedies)  # nothing new: the counts stay
    s = compute(w, 10.0)
    assert s["gpu_xid_restart_errors"] == 2.0
    assert s["gpu_xid_reset_errors"] == 3.0  # 48, 79 and the unknown 12345; 92 is info
    assert [code for _, code in w.xids] == [31, 92, 31, 48, 79, 12345]  # (GPU unknown: flat)
    w.reset()  # a new engine
    assert compute(w, 11.0)["gpu_xid_restart_errors"] == 0.0 and w.xids == []


# ---- canary and progress ---------------------------------------------------------------

def test_canary_failures_count_only_when_counted_and_reset_on_success():
    w = SignalWindow(WindowConfig())
    w.add_canary(False, None, counted=False)  # stuck behind a busy queue: not a hang
    assert compute(w, 0.0)["canary_failures"] == 0.0
    w.add_canary(False, None, counted=True)
    w.add_canary(False, None, counted=True)
    w.add_canary(False, None, counted=False)
    assert compute(w, 0.0)["canary_failures"] == 2.0
    w.add_canary(True, 0.12, counted=False)
    s = compute(w, 0.0)
    assert s["canary_failures"] == 0.0 and s["canary_latency_s"] == 0.12
    w.add_canary(False, None, counted=True)
    s = compute(w, 0.0)
    assert s["canary_failures"] == 1.0 and s["canary_latency_s"] == 0.12  # the last pass


def test_progressed_between_compares_with_the_scrape_before_the_interval():
    w = SignalWindow(WindowConfig())
    tokens = {0: 100.0, 10: 100.0, 20: 150.0, 30: 150.0}
    for t, n in tokens.items():
        w.add_metrics(float(t), Snapshot(generation_tokens_total=n, prompt_tokens_total=0.0))
    assert w.progressed_between(5, 15) is False
    assert w.progressed_between(15, 25)  # 20 against 10
    assert w.progressed_between(20, 20)  # one scrape in it, against the one before
    assert w.progressed_between(25, 35) is False
    assert w.progressed_between(40, 50) is None  # no scrape in it: nothing to tell
    assert w.progressed_between(-5, 5) is None  # none before it to compare with
    w.add_metrics(40.0, Snapshot(generation_tokens_total=150.0, prompt_tokens_total=9.0))
    assert w.progressed_between(35, 45)  # prefill counts as progress


# ---- progress: engine_stalled_s ----------------------------------------------------------

def stalled(w: SignalWindow, now: float) -> float | None:
    return compute(w, now)["engine_stalled_s"]


def with_counters(name: str, generated: float, steps: float) -> Snapshot:
    """A real scrape with its generation and step counters set (the engine stepped)."""
    return dataclasses.replace(scrape(name), generation_tokens_total=generated,
                               engine_steps_total=steps)


def test_the_real_scrapes_carry_the_step_counter():
    assert scrape("kv-saturated.txt").engine_steps_total == 863.0
    assert scrape("after-load.txt").engine_steps_total == 3269.0
    h100 = parse_metrics((FIX.parent / "vllm-0.26-h100-metrics" / "idle.txt").read_text())
    assert h100.engine_steps_total is not None


def test_a_frozen_page_with_requests_running_and_waiting_is_a_stall_from_its_first_showing():
    w = SignalWindow(WindowConfig())
    w.add_metrics(0.0, with_counters("kv-saturated.txt", 1000, 800))
    w.add_metrics(2.0, with_counters("kv-saturated.txt", 1100, 820))  # stepping
    assert stalled(w, 2.0) == 0.0
    for t in (4.0, 6.0, 8.0):
        w.add_metrics(t, with_counters("kv-saturated.txt", 1100, 820))  # frozen from 2 s
    assert stalled(w, 8.0) == 6.0
    assert stalled(w, 9.9) == 6.0  # never more than the scrapes showed
    w.add_metrics(10.0, with_counters("kv-saturated.txt", 1101, 821))
    assert stalled(w, 10.0) == 0.0


def test_the_daemons_own_remedy_is_no_stall_of_the_engine():
    """A KV reset's sleep and wake (an engine's first sleep took 12.8 s on the H100):
    the counters stand still through it; once it ended, progress is measured afresh, so
    the no_progress rule does not restart the engine the remedy just fixed."""
    w = SignalWindow(WindowConfig())
    w.add_metrics(0.0, with_counters("kv-saturated.txt", 1000, 800))
    for t in (2.0, 6.0, 10.0, 14.0):  # asleep, then waking: nothing moves
        w.add_metrics(t, with_counters("kv-saturated.txt", 1000, 800))
    assert stalled(w, 14.0) == 14.0
    w.restart_progress_clock()
    assert stalled(w, 14.5) is None
    w.add_metrics(16.0, with_counters("kv-saturated.txt", 1000, 800))
    assert stalled(w, 16.0) == 0.0
    w.add_metrics(18.0, with_counters("kv-saturated.txt", 1000, 800))
    assert stalled(w, 18.0) == 2.0  # a real stall after it is still seen


def test_a_step_known_to_be_at_work_is_progress_and_a_stall_is_timed_from_its_end():
    """A new engine's proof: its first request compiles for many seconds (a cold cache),
    its counters stand still, its tree is busy (issue 48). Held as progress while the
    feeder says it works; the moment it stops working (its core stopped), the stall is
    timed from the last scrape that worked, as any other."""
    w = SignalWindow(WindowConfig())
    busy = dataclasses.replace(with_counters("kv-saturated.txt", 1000, 800),
                               requests_running=1.0, requests_waiting=0.0)
    for t in (0.0, 2.0, 4.0, 6.0, 8.0, 10.0, 12.0):  # 12 s in one compiling step
        w.add_metrics(t, busy, at_engine=1, working=True)
        assert stalled(w, t) == 0.0
    for t in (14.0, 16.0, 18.0):  # then nothing works any more: a hang
        w.add_metrics(t, busy, at_engine=1, working=False)
    assert stalled(w, 18.0) == 6.0


def test_waiting_alone_counts_as_demand():
    w = SignalWindow(WindowConfig())
    wedged = dataclasses.replace(scrape("kv-saturated.txt"), requests_running=0.0)
    for t in (0.0, 2.0, 4.0, 6.0):
        w.add_metrics(t, wedged)
    assert stalled(w, 6.0) == 6.0


def test_an_idle_engine_is_never_stalled_and_demand_is_timed_from_its_arrival():
    w = SignalWindow(WindowConfig())
    for t in (0.0, 2.0, 4.0, 6.0, 8.0):
        w.add_metrics(t, scrape("after-load.txt"))  # nothing running or waiting
    assert stalled(w, 8.0) == 0.0
    busy = dataclasses.replace(scrape("after-load.txt"), requests_waiting=1.0)
    w.add_metrics(10.0, busy)  # a request arrived, no step yet: not a stall of 10 s
    assert stalled(w, 10.0) == 0.0
    w.add_metrics(12.0, busy)
    assert stalled(w, 12.0) == 2.0


def test_progress_is_unknown_without_the_engines_counters():
    w = SignalWindow(WindowConfig())
    for t in (0.0, 2.0, 4.0):
        w.add_metrics(t, Snapshot())  # --disable-log-stats: no vllm:* series
    assert stalled(w, 4.0) is None
    w = SignalWindow(WindowConfig())
    assert stalled(w, 0.0) is None




def test_requests_the_daemon_has_at_the_engine_count_as_work_when_its_gauges_froze_idle():
    # a core stopped between two batches: its gauges froze at idle, while the proxy (or
    # the canary) has requests at it that no step serves
    w = SignalWindow(WindowConfig())
    w.add_metrics(0.0, scrape("after-load.txt"), at_engine=0)
    w.add_metrics(2.0, scrape("after-load.txt"), at_engine=3)
    w.add_metrics(4.0, scrape("after-load.txt"), at_engine=3)
    w.add_metrics(8.0, scrape("after-load.txt"), at_engine=1)
    assert stalled(w, 8.0) == 6.0
    w.add_metrics(10.0, scrape("after-load.txt"), at_engine=0)
    assert stalled(w, 10.0) == 0.0


def test_a_stall_while_the_host_is_starved_of_memory_is_the_hosts_for_a_bounded_time():
    """The counters stand still while every task of the host stalls on memory (PSI's
    `full avg10` at least `STARVED_PCT`, hostmem.py): not a hang of the engine, which a
    restart would only make reload. Excused for `STARVED_EXCUSE_S` in a row, then timed
    as any stall; unknown pressure (no PSI) excuses nothing."""
    excuse = signals.STARVED_EXCUSE_S
    w = SignalWindow(WindowConfig())
    busy = dataclasses.replace(with_counters("kv-saturated.txt", 1000, 800),
                               requests_running=4.0, requests_waiting=2.0)
    w.add_tree(0.0, 1 << 30, 50.0, host_memory_stall_percent=42.0)
    for t in range(0, int(excuse) + 1, 2):  # starved all along: excused
        w.add_tree(float(t), 1 << 30, 50.0, host_memory_stall_percent=42.0)
        w.add_metrics(float(t), busy)
        assert stalled(w, float(t)) == 0.0
    assert compute(w, excuse)["host_memory_stall_percent"] == 42.0
    for t in (excuse + 2, excuse + 4, excuse + 6):  # starved past the excuse: counted
        w.add_tree(t, 1 << 30, 50.0, host_memory_stall_percent=42.0)
        w.add_metrics(t, busy)
    assert stalled(w, excuse + 6) == 6.0
    # the pressure gone, the next starved spell is excused afresh; a light one is not one
    w.add_tree(excuse + 7, 1 << 30, 50.0, host_memory_stall_percent=signals.STARVED_PCT - 1)
    w.add_metrics(excuse + 8, busy)
    assert stalled(w, excuse + 8) == 8.0
    w.add_tree(excuse + 9, 1 << 30, 50.0, host_memory_stall_percent=signals.STARVED_PCT)
    w.add_metrics(excuse + 10, busy)
    assert stalled(w, excuse + 10) == 0.0

    plain = SignalWindow(WindowConfig())  # no PSI on this host: nothing excused
    for t in (0.0, 2.0, 4.0, 6.0):
        plain.add_tree(t, 1 << 30, 50.0, host_memory_stall_percent=None)
        plain.add_metrics(t, busy)
    assert stalled(plain, 6.0) == 6.0 and compute(plain, 6.0)["host_memory_stall_percent"] is None


def test_the_kv_tiers_counters_count_from_zero_once_they_appear():
    """vLLM shows each KV tier counter from its first count on: a window that begins
    without it and ends with it counted from 0; a window with none knows nothing."""
    w = SignalWindow(WindowConfig(rate_window_s=60))
    feed(w, range(0, 31, 10), generation_tokens_total=lambda t: float(t))
    feed(w, [40.0, 50.0, 60.0], kv_offload_refusals_total=lambda t: (t - 30) * 2,
         kv_offload_stored_bytes_total=lambda t: t * 1e6,
         kv_offload_loaded_bytes_total=lambda t: (t - 40) * 1e6)
    s = compute(w, 60.0)
    assert s["kv_tier_store_refusals_per_s"] == pytest.approx(60 / 60)
    assert s["kv_tier_stored_bytes_per_s"] == pytest.approx(60e6 / 60)
    assert s["kv_tier_loaded_bytes_per_s"] == pytest.approx(20e6 / 60)
    none = SignalWindow(WindowConfig(rate_window_s=60))
    feed(none, range(0, 61, 10), generation_tokens_total=lambda t: float(t))
    s = compute(none, 60.0)
    assert s["kv_tier_store_refusals_per_s"] is None and s["kv_tier_loaded_bytes_per_s"] is None
