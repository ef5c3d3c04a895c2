"""How late the daemon's event loop runs (supervisor/ops/looplag.py): a busy loop and a
blocked one, each a stall logged once with whose fault it was, the largest lag over the
window; and the daemon itself stopped (SIGSTOP) for a second and a half, as a host short
of CPU stops it, seen in `status` and on the exporter."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time
from pathlib import Path

import httpx
from structlog.testing import capture_logs

from supervisor.ops.looplag import LoopLag
from tests.harness import Daemon, fake_engine_config, wait_for


def test_a_busy_loop_and_a_blocked_one_are_stalls_each_logged_with_whose_it_was() -> None:
    async def run() -> LoopLag:
        lag = LoopLag(period_s=0.05, warn_s=0.3, window_s=0.5)
        task = asyncio.ensure_future(lag.run())
        await asyncio.sleep(0.2)
        end = time.process_time() + 0.6  # (0.6 s of its own CPU, however shared the
        while time.process_time() < end:  # host: the daemon's own work holds the loop)
            pass
        await asyncio.sleep(0.3)
        time.sleep(0.6)  # noqa: ASYNC251 (the point: a blocking call holds the loop)
        await asyncio.sleep(0.3)
        task.cancel()
        return lag

    with capture_logs() as logs:
        lag = asyncio.run(run())
    assert lag.stalls == 2 and lag.max_s() >= 0.5  # (the blocked one, 0.3 s before)
    stalls = [e for e in logs if e["event"] == "event loop stalled"]
    assert [e["why"] for e in stalls] == [
        "the daemon was busy",
        "the daemon got little CPU (a host short of cores) or waited in a blocking call"]
    assert all(e["lag_s"] >= 0.5 for e in stalls)
    assert stalls[0]["own_cpu_s"] >= 0.4 > stalls[1]["own_cpu_s"]
    assert sum(e["event"] == "event loop on time again" for e in logs) == 2


def test_a_streak_of_late_wakes_is_one_log_line_a_minute_and_the_largest_lag_ages_out(
        ) -> None:
    lag = LoopLag(period_s=0.25, warn_s=1.0, window_s=60.0, clock=lambda: 0.0)
    with capture_logs() as logs:
        lag.note(0.0, 2.0, 0.0)
        lag.note(2.0, 1.5, 0.0)  # still stalled: counted, not logged again
        lag.note(30.0, 0.5, 0.0)
        lag.note(40.0, 1.2, 0.0)  # another streak within the minute: counted only
        lag.note(41.0, 0.1, 0.0)
        lag.note(70.0, 1.1, 0.0)  # a minute after the last line: logged, with the count
    assert lag.stalls == 4
    assert [e["event"] for e in logs] == ["event loop stalled", "event loop on time again",
                                          "event loop stalled"]
    assert "stalls_not_logged" not in logs[0] and logs[2]["stalls_not_logged"] == 1
    lag = LoopLag(period_s=0.25, warn_s=1.0, window_s=60.0, clock=lambda: 0.0)
    lag.note(0.0, 2.0, 0.0)
    lag.note(2.0, 1.5, 0.0)
    lag.note(30.0, 0.5, 0.0)
    assert lag.max_s(30.0) == 2.0
    assert lag.max_s(61.0) == 1.5  # the 2.0 s of a minute before is gone
    assert lag.max_s(63.0) == 0.5
    assert lag.max_s(91.0) == 0.0


def test_a_daemon_stopped_for_a_while_reports_its_stall_in_status_and_on_the_exporter(
        tmp_path: Path) -> None:
    d = Daemon(tmp_path, fake_engine_config(tmp_path))
    try:
        d.wait_state("RUNNING", 20)
        st = d.status()
        assert st["loop"]["stalls"] == 0 and st["loop"]["lag_s"] < 1.0
        os.kill(d.pid, signal.SIGSTOP)  # as a host with no CPU to spare stops it
        time.sleep(1.5)
        os.kill(d.pid, signal.SIGCONT)
        loop = wait_for(lambda: (s := d.status()["loop"])["stalls"] >= 1 and s, 10,
                        "the stall in status")
        assert loop["lag_s"] >= 1.0
        stall = next(r for r in d.log_records() if r.get("event") == "event loop stalled")
        assert stall["lag_s"] >= 1.0 and stall["own_cpu_s"] < 0.5 * stall["lag_s"]
        page = httpx.get(f"http://{d.sections['exporter']['listen']}/metrics",
                         timeout=5).text
        got = re.search(r"^vllm_supervisor_event_loop_lag_seconds (\S+)$", page, re.M)
        assert got is not None and float(got.group(1)) >= 1.0, page
        assert re.search(r"^vllm_supervisor_event_loop_stalls_total [1-9]", page, re.M)
    finally:
        os.kill(d.pid, signal.SIGCONT)
        d.close()
