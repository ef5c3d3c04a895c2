"""A flood of idle client connections against a daemon under a low descriptor limit
(issue 33, H1): the real daemon in its own session with the fake engine, limited to 256
descriptors (soft and hard, so that its raise at start cannot lift it), more idle TCP
connections opened to its proxy than that, held for several canary periods.

Before: the control socket reset every client, the canary and the scrape failed with
EMFILE, the `hang` rule restarted a healthy engine, the take-down gave up ("Too many open
files"), the daemon went FATAL and the engine's processes lived on unsupervised. Now: the
proxy's cap keeps descriptors in reserve, the daemon's own shortage is never read as the
engine's, and the engine is never restarted for it.

Loopback only, bounded in count and time. The exporter's refusals under a flood of its
own are logged with why.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import resource
import socket
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from structlog.testing import capture_logs

from supervisor.ops.exporter import Exporter
from supervisor.ops.exposition import ExporterView
from tests.harness import alive, wait_for
from tests.test_fd_exhaustion import until
from tests.test_proxy import complete, proxy_config

pytestmark = pytest.mark.component

LIMIT = 256  # the daemon's descriptors, soft and hard
FLOOD = 400  # idle connections, more than the daemon may hold
HOLD_S = 4.0  # several canary (0.5 s) and scrape (0.5 s) periods


def open_idle(address: str, n: int) -> list[socket.socket]:
    """`n` TCP connections that send nothing (each connected or refused, bounded)."""
    host, port = address.rsplit(":", 1)
    out = []
    for _ in range(n):
        s = socket.socket()
        s.settimeout(2.0)
        try:
            s.connect((host, int(port)))
        except OSError:
            s.close()
            continue
        s.setblocking(False)
        out.append(s)
    return out


def answered_503(conns: list[socket.socket]) -> int:
    """How many of `conns` the proxy has answered 503 (and closed) by now."""
    n = 0
    for s in conns:
        try:
            if s.recv(64, socket.MSG_PEEK).startswith(b"HTTP/1.1 503"):
                n += 1
        except OSError as exc:
            if exc.errno not in (errno.EAGAIN, errno.ECONNRESET):
                raise
    return n


def fresh_request(cfg: dict[str, Any]) -> int:
    """One request on a fresh connection: its status, within a bound (never a hang)."""
    try:
        return complete(cfg, timeout=10).status_code
    except httpx.TransportError as exc:  # a reset is a failure of its own, said here
        return -1 if "reset" in str(exc).lower() else -2


def test_a_connection_flood_under_a_low_descriptor_limit_leaves_the_daemon_running(
        daemon_factory, tmp_path):
    cfg = proxy_config(tmp_path, header_timeout_s=60.0, idle_timeout_s=75.0)
    cfg["metrics"] = {"period_s": 0.5, "timeout_s": 1.0}
    cfg["engine"]["health_interval_s"] = 0.1
    d = daemon_factory(cfg)
    # the daemon and every engine it spawns: 256 descriptors at most (a moment after
    # the exec, long before the daemon reads its config)
    resource.prlimit(d.pid, resource.RLIMIT_NOFILE, (LIMIT, LIMIT))
    d.wait_state("RUNNING", 20)
    engine_pids = d.engine_pids()
    assert complete(cfg).status_code == 200
    flood: list[socket.socket] = []
    statuses: list[int] = []
    try:
        t0 = time.monotonic()
        flood = open_idle(cfg["proxy"]["listen"], FLOOD)
        assert len(flood) > LIMIT
        # held for several canary periods, the control socket asked all along
        while time.monotonic() - t0 < HOLD_S:
            st = d.status()  # (raises if the control socket resets)
            assert st["state"] == "RUNNING" and st["restarts"] == 0, st
            statuses.append(fresh_request(cfg))
        refused = answered_503(flood)
        assert set(statuses) <= {200, 503}, statuses  # served or refused, never a hang
    finally:
        for s in flood:
            s.close()
    # after the flood: served on a fresh connection, the same engine, nothing decided
    wait_for(lambda: fresh_request(cfg) == 200, 15, "a request served after the flood")
    st = d.status()
    assert st["state"] == "RUNNING" and st["restarts"] == 0 and st["pid"] == engine_pids[0]
    assert d.decisions() == []
    records = d.log_records()
    events = [r.get("event", "") for r in records]
    assert "job failed" not in events and "engine tree not proven gone" not in events
    limit = next(r for r in records if r.get("event") == "file descriptor limit")
    assert limit["soft"] == limit["hard"] == LIMIT
    print(f"flood: {len(flood)} connections held {HOLD_S:g} s, {refused} answered 503 at "
          f"once; fresh requests during it: {statuses.count(200)} x 200, "
          f"{statuses.count(503)} x 503")
    # a stop leaves no engine process behind
    d.call("stop")
    assert d.wait_exit(30) == 0
    wait_for(lambda: not alive(engine_pids + d.engine_pids()), 10, "the engine tree gone")


def test_the_daemon_out_of_descriptors_reads_none_of_it_as_the_engines_sickness(
        daemon_factory, tmp_path):
    """The proxy's cap is sized at start; here the limit is lowered under the running
    daemon, so that the flood does take its last descriptor, for several canary periods.
    Before: the canary failed with EMFILE three times and the `hang` rule restarted the
    healthy engine (whose take-down then failed: FATAL)."""
    cfg = proxy_config(tmp_path)
    cfg["metrics"] = {"period_s": 0.5, "timeout_s": 1.0}
    d = daemon_factory(cfg)
    d.wait_state("RUNNING", 20)
    engine_pids = d.engine_pids()
    assert complete(cfg).status_code == 200
    fd_dir = Path(f"/proc/{d.pid}/fd")
    limit = len(list(fd_dir.iterdir())) + 8
    resource.prlimit(d.pid, resource.RLIMIT_NOFILE, (limit, limit))
    flood: list[socket.socket] = []
    try:
        flood = open_idle(cfg["proxy"]["listen"], 40)
        wait_for(lambda: len(list(fd_dir.iterdir())) >= limit - 1, 10,
                 "the daemon out of descriptors")
        # several canary periods with no descriptor to spare (the hang rule trips at 3)
        wait_for(lambda: sum(r.get("job") == "canary" for r in d.log_records()
                             if "out of file descriptors" in r.get("event", "")), 10,
                 "a canary the daemon could not send")
        t0 = time.monotonic()
        wait_for(lambda: time.monotonic() - t0 >= HOLD_S
                 and len(list(fd_dir.iterdir())) >= limit - 1, HOLD_S + 5,
                 "the shortage held for several canary periods")
    finally:
        for s in flood:
            s.close()
    wait_for(lambda: fresh_request(cfg) == 200, 15, "a request served after the flood")
    st = d.wait_state("RUNNING", 10)
    assert st["restarts"] == 0 and st["pid"] == engine_pids[0], st
    assert d.decisions() == []
    wait_for(lambda: any(r.get("event") == "the daemon has file descriptors again"
                         and r.get("job") == "canary" for r in d.log_records()), 10,
             "canaries sent again")
    events = [r.get("event", "") for r in d.log_records()]
    assert "job failed" not in events and "canary failed" not in events
    d.call("stop")
    assert d.wait_exit(30) == 0
    wait_for(lambda: not alive(engine_pids + d.engine_pids()), 10, "the engine tree gone")


def test_the_exporter_says_why_it_refuses_a_flood_and_when_it_serves_again() -> None:
    view = ExporterView(state="RUNNING", ready=True, throttle_level=0, restarts_by_reason={},
                        trips_by_rule={}, actions_by_kind={}, last_decision_wall=None,
                        policy_paused=False, dry_run=False, engine_uptime_s=1.0, gauges=[])

    async def get_view() -> ExporterView:
        return view

    async def main() -> None:
        exporter = Exporter("127.0.0.1:0", get_view, max_connections=2, head_timeout_s=30.0)
        await exporter.start()
        writers = []
        try:
            for _ in range(6):  # idle: 2 admitted, 2 answered 503, 2 reset
                _, w = await asyncio.open_connection("127.0.0.1", exporter.port)
                writers.append(w)
            await until(lambda: exporter._refused + exporter._reset >= 4)  # (each one met)
            for w in writers:
                w.close()
            await until(lambda: exporter._open == 0)
            async with httpx.AsyncClient(timeout=10) as client:
                r = await client.get(f"http://127.0.0.1:{exporter.port}/healthz")
                assert r.status_code == 200
        finally:
            for w in writers:
                with contextlib.suppress(Exception):
                    w.close()
            await exporter.close()

    with capture_logs() as logs:
        asyncio.run(main())
    refusing = [r for r in logs if r["event"].startswith("exporter refusing connections")]
    again = [r for r in logs if r["event"] == "exporter serving connections again"]
    assert len(refusing) == 1 and refusing[0]["max_connections"] == 2
    assert len(again) == 1 and again[0]["answered_503"] + again[0]["reset"] == 4
