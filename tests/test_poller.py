"""Scraping through httpx.MockTransport, and the bookkeeping of a stream of scrapes."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx

from supervisor.watchdog.metrics import parse_metrics
from supervisor.watchdog.poller import NO_ANSWER, ScrapeHealth, scrape

FIX = Path(__file__).parent / "fixtures" / "vllm-0.32-cpu-metrics"
SATURATED = (FIX / "kv-saturated.txt").read_text()
IDLE = (FIX / "idle.txt").read_text()


def run_scrape(handler) -> tuple:
    async def go() -> tuple:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            return await scrape(client, "http://engine/metrics", 1.0)

    return asyncio.run(go())


def test_scrape_parses_a_real_page():
    snap, error = run_scrape(lambda req: httpx.Response(200, text=SATURATED))
    assert error is None and snap.kv_cache_usage == 1.0 and snap.requests_waiting == 15


def test_scrape_reports_http_errors_garbage_and_timeouts():
    _, error = run_scrape(lambda req: httpx.Response(503, text="dead"))
    assert error == "HTTP 503"
    _, error = run_scrape(lambda req: httpx.Response(200, text="<html>oops</html>"))
    assert error.startswith("not a Prometheus text page")

    def slow(req: httpx.Request) -> httpx.Response:
        raise httpx.ReadTimeout("timed out", request=req)

    _, error = run_scrape(slow)
    assert error == "no answer within 1 s"

    def refused(req: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=req)

    _, error = run_scrape(refused)
    assert error.startswith("ConnectError")


def test_failures_are_logged_once_per_streak_and_counted_always():
    h = ScrapeHealth()
    assert [h.failed(), h.failed(), h.failed()] == [True, False, False]
    assert h.succeeded(parse_metrics(IDLE), 10.0) == 3
    assert h.failed() is True and h.failures_total == 4


def test_a_scrape_that_timed_out_marks_the_api_server_silent_until_one_is_answered():
    """Silent (a KV reset waits: `EngineFacts.api_silent`) only when nothing answered in
    time; a page that answers wrongly, or a refused connection, is not silence."""
    h = ScrapeHealth()

    def slow(req: httpx.Request) -> httpx.Response:
        raise httpx.ReadTimeout("timed out", request=req)

    _, error = run_scrape(slow)
    h.failed(silent=error.startswith(NO_ANSWER))
    assert h.silent
    _, error = run_scrape(lambda req: httpx.Response(200, text="<html>oops</html>"))
    h.failed(silent=error.startswith(NO_ANSWER))
    assert not h.silent and h.streak == 2
    h.failed(silent=True)
    h.succeeded(parse_metrics(IDLE), 3.0)
    assert not h.silent
    h.failed(silent=True)
    h.reset()  # (a new engine)
    assert not h.silent


def test_identical_scrapes_while_busy_are_stale():
    h = ScrapeHealth()
    busy = parse_metrics(SATURATED)  # 4 requests running
    h.succeeded(busy, 0.0)
    h.succeeded(busy, 2.0)
    h.succeeded(busy, 4.0)
    assert h.staleness_s(5.0) == 5.0  # unchanged since the first of the identical scrapes
    moved = parse_metrics(SATURATED.replace(
        'vllm:generation_tokens_total{engine="0",model_name="tiny"} 2782.0',
        'vllm:generation_tokens_total{engine="0",model_name="tiny"} 2790.0'))
    assert moved != busy
    h.succeeded(moved, 6.0)
    assert h.staleness_s(7.0) == 0.0


def test_identical_scrapes_while_idle_are_not_stale():
    h = ScrapeHealth()
    idle = parse_metrics(IDLE)
    for t in range(5):
        h.succeeded(idle, float(t))
    assert h.staleness_s(10.0) == 0.0


def test_reset_forgets_the_old_engine_but_keeps_the_failure_count():
    h = ScrapeHealth()
    h.failed()
    h.succeeded(parse_metrics(SATURATED), 1.0)
    h.reset()
    assert h.last is None and h.staleness_s(9.0) == 0.0 and h.failures_total == 1
