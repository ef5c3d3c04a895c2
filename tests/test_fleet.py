"""A fleet on loopback: three daemons (fake engines) behind the real vllm-router 0.1.17
(installed by `scripts/setup.sh router`), started with no workers. The daemons register
themselves; load goes through the router; a rolling `restart` of each host in turn; a
SIGKILL of one whole daemon and its engine (host loss), then its return; a restart of
the router, which forgets its workers (the daemons add themselves again). Every request
is counted; the figures are printed (docs/fleet.md has a run's)."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.harness import Daemon, RouterProcess, free_port, wait_for
from tests.test_proxy import proxy_config

pytestmark = pytest.mark.component
TOKENS = 8


@dataclass
class Load:
    """Clients through the router: short completions, streamed and not, in a loop; each
    outcome recorded with when it started."""

    url: str
    clients: int = 6
    model: str = "fake"
    tokens: int = TOKENS
    done: list[tuple[float, float, str]] = field(default_factory=list)  # start, end, outcome
    _stop: threading.Event = field(default_factory=threading.Event)
    _paused: threading.Event = field(default_factory=threading.Event)
    _busy: set[int] = field(default_factory=set)  # clients that may have a request out
    _threads: list[threading.Thread] = field(default_factory=list)

    def __enter__(self) -> Load:
        self._threads = [threading.Thread(target=self._client, args=(i,), daemon=True)
                         for i in range(self.clients)]
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(60)

    def pause(self, paused: bool) -> None:
        if paused:
            self._paused.set()
        else:
            self._paused.clear()

    def idle(self) -> bool:
        """Paused, no client has a request out (each marks itself busy before it looks
        at the pause, so none can start one after this is true)."""
        return self._paused.is_set() and not self._busy

    def _client(self, i: int) -> None:
        n = 0
        with httpx.Client(timeout=30) as client:
            while not self._stop.is_set():
                self._busy.add(i)
                if self._paused.is_set():
                    self._busy.discard(i)
                    time.sleep(0.05)
                    continue
                n += 1
                stream = (i + n) % 2 == 0
                body = {"model": self.model, "prompt": f"c{i} r{n}",
                        "max_tokens": self.tokens, "stream": stream, "ignore_eos": True}
                t0 = time.monotonic()
                outcome = self._one(client, body)
                self.done.append((t0, time.monotonic(), outcome))
                self._busy.discard(i)

    def _one(self, client: httpx.Client, body: dict[str, Any]) -> str:
        try:
            if not body["stream"]:
                r = client.post(f"{self.url}/v1/completions", json=body)
                if r.status_code != 200:
                    return f"HTTP {r.status_code}: {r.text[:80]}"
                got = r.json()["usage"]["completion_tokens"]
                return "ok" if got == self.tokens else f"short: {got}"
            with client.stream("POST", f"{self.url}/v1/completions", json=body) as r:
                if r.status_code != 200:
                    return f"HTTP {r.status_code}: {r.read()[:80]!r}"
                data = [x[6:] for x in r.iter_lines() if x.startswith("data: ")]
            tokens = sum(1 for x in data if x != "[DONE]" and json.loads(x)["choices"]
                         and json.loads(x)["choices"][0].get("text"))
            if not data or data[-1] != "[DONE]":
                return f"truncated after {tokens} tokens"
            return "ok" if tokens == self.tokens else f"short: {tokens}"
        except (httpx.HTTPError, ValueError, KeyError) as exc:
            return f"{type(exc).__name__}: {exc}"[:120]

    def failed(self, since: float = 0.0, until: float = float("inf")) -> list[tuple[float, str]]:
        return [(round(s - since, 2), o) for s, _, o in list(self.done)
                if since <= s < until and o != "ok"]

    def count(self, since: float = 0.0, until: float = float("inf")) -> int:
        return sum(1 for s, _, _ in list(self.done) if since <= s < until)


def served(d: Daemon) -> int:
    """Requests the daemon's proxy answered so far (its access lines)."""
    return sum(1 for r in d.log_records() if r.get("event") == "request")


def host_config(tmp: Path, router: str) -> dict[str, Any]:
    cfg = proxy_config(tmp, "--token-delay", "0.02")
    cfg["fleet"] = {"routers": [router], "check_interval_s": 1.0, "request_timeout_s": 2.0,
                    "retry_initial_s": 0.1, "retry_max_s": 1.0, "leave_timeout_s": 2.0}
    return cfg


def test_three_hosts_behind_vllm_router_through_restarts_a_host_loss_and_a_router_restart(
        daemon_factory, tmp_path):
    router = RouterProcess(free_port(), free_port(), tmp_path / "router.log")
    router.start()
    figures: dict[str, Any] = {}
    try:
        cfgs = [host_config(tmp_path / f"h{i}", router.url) for i in range(3)]
        for i in range(3):
            (tmp_path / f"h{i}").mkdir()
        hosts = [daemon_factory(c, sub=f"h{i}/run0") for i, c in enumerate(cfgs)]
        urls = [f"http://{c['proxy']['listen']}" for c in cfgs]
        wait_for(lambda: set(router.workers()) == set(urls), 30, "the three registered")
        figures["registered_after_ready_s"] = [registration_delay(d) for d in hosts]

        with Load(router.url) as load:
            wait_for(lambda: load.count() >= 60, 30, "load through the router")
            per_host = [served(d) for d in hosts]
            assert all(n > 0 for n in per_host), per_host  # round robin reaches each

            # a rolling restart: each host in turn, the next once the last serves again
            t0 = time.monotonic()
            for i, d in enumerate(hosts):
                before = [served(x) for x in hosts]
                r = d.ctl("restart", "--reason", "rolling restart")
                assert r.returncode == 0, r.stderr
                d.wait_state("RUNNING", 30)
                wait_for(lambda u=urls[i]: router.workers().get(u) is True, 30,
                         f"host {i} back in the router")
                time.sleep(1.0)
                figures.setdefault("rolling_served_by_others", []).append(
                    [served(x) - b for x, b in zip(hosts, before, strict=True)])
            figures["rolling"] = {"requests": load.count(t0), "failed": load.failed(t0)}
            assert not load.failed(t0), load.failed(t0)

            # host loss: the daemon and its engine SIGKILLed
            lost = hosts[0]
            engine_pgid = os.getpgid(lost.status()["pid"])
            lost_at = time.monotonic()
            os.kill(lost.pid, signal.SIGKILL)
            os.killpg(engine_pgid, signal.SIGKILL)
            wait_for(lambda: router.workers().get(urls[0]) is False, 30,
                     "the router to mark the lost host unhealthy")
            figures["router_marked_lost_host_unhealthy_after_s"] = round(
                time.monotonic() - lost_at, 2)
            others_before = [served(x) for x in hosts[1:]]
            time.sleep(3.0)
            figures["while_out_served_by_others"] = [
                served(x) - b for x, b in zip(hosts[1:], others_before, strict=True)]
            lost_failed = load.failed(lost_at, lost_at + 3.0)
            figures["host_loss"] = {"requests_after": load.count(lost_at, lost_at + 3.0),
                                    "failed_after": lost_failed,
                                    "in_flight_at_loss": sum(
                                        1 for s, e, _ in list(load.done) if s < lost_at <= e),
                                    "in_flight_at_loss_failed": [
                                        o for s, e, o in list(load.done)
                                        if s < lost_at <= e and o != "ok"]}
            # the return: the same host, same ports; it is listed still, healthy again
            back = daemon_factory(cfgs[0], sub="h0/run1")
            back.wait_state("RUNNING", 30)
            back_at = time.monotonic()
            wait_for(lambda: router.workers().get(urls[0]) is True, 30, "the host back")
            figures["returned_host_healthy_in_router_after_s"] = round(
                time.monotonic() - back_at, 2)
            hosts[0] = back
            before_back = served(back)
            time.sleep(6.0)  # (the router's breaker for it: 5 s at most)
            figures["returned_host_served"] = served(back) - before_back

            # the router restarts and forgets its workers: each daemon adds itself again
            load.pause(True)
            wait_for(load.idle, 30, "the requests in flight to end")
            router.stop()
            router.start()
            restarted = time.monotonic()
            wait_for(lambda: set(router.workers()) == set(urls), 30, "all three again")
            figures["re_registered_after_router_restart_s"] = round(
                time.monotonic() - restarted, 2)
            t1 = time.monotonic()
            load.pause(False)
            wait_for(lambda: load.count(t1) >= 60, 30, "load again")
            assert not load.failed(t1), load.failed(t1)
            figures["after_router_restart"] = {"requests": load.count(t1),
                                               "failed": load.failed(t1)}

        # failed requests after the loss are those that were at the lost host (its
        # streams in flight); none started after it may fail
        started_after = [x for x in lost_failed if x[0] > 0.05]
        assert not started_after, started_after
        figures["total_requests"] = load.count()

        # stopping, a daemon leaves the router before its engine stops
        hosts[2].ctl("stop")
        wait_for(lambda: urls[2] not in router.workers(), 10, "host 2 out of the router")
        left = [r for r in hosts[2].log_records() if r.get("event") == "out of router"]
        assert left and left[-1]["why"] == "the daemon is stopping"
    finally:
        router.stop()
        print("FLEET", json.dumps(figures))


def registration_delay(d: Daemon) -> float | None:
    """From the daemon's engine serving (its RUNNING line) to its registration line."""
    recs = d.log_records()
    running = next((r for r in recs if r.get("to") == "RUNNING"), None)
    reg = next((r for r in recs if r.get("event") == "registered with router"), None)
    if running is None or reg is None:
        return None
    t = [datetime.fromisoformat(x["timestamp"].replace("Z", "+00:00")) for x in (running, reg)]
    return round((t[1] - t[0]).total_seconds(), 3)



def test_in_a_fleet_a_new_request_is_refused_at_once_while_the_engine_cold_starts(
        daemon_factory, tmp_path):
    """Held for a cold start (minutes on a GPU), a request the router sent just before it
    learnt the host is out would wait that long (the real-vLLM fleet run: 3 of 18,063 timed
    out at the client); in a fleet it gets 503 at once, which vllm-router retries on another
    host. A handover or a KV reset (a short wait) still holds."""
    cfg = proxy_config(tmp_path, "--startup-delay", "3")
    cfg["fleet"] = {"routers": [f"http://127.0.0.1:{free_port()}"],  # (nobody there)
                    "retry_initial_s": 0.1, "retry_max_s": 0.5, "leave_timeout_s": 0.5}
    d = daemon_factory(cfg)
    d.wait_state("RUNNING", 30)
    url = f"http://{cfg['proxy']['listen']}"
    body = {"model": "fake", "prompt": "hi", "max_tokens": 2}
    assert httpx.post(f"{url}/v1/completions", json=body, timeout=10).status_code == 200
    assert d.ctl("restart", "--reason", "test").returncode == 0
    d.wait_state("STARTING", 10)
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=10)
    assert r.status_code == 503 and r.headers["retry-after"]
    assert r.json()["error"]["type"] == "engine_unavailable"
    assert "try another" in r.json()["error"]["message"]
    assert httpx.get(f"{url}/health", timeout=5).status_code == 503
    d.wait_state("RUNNING", 30, extra=lambda s: s["restarts"] == 1)
    assert httpx.post(f"{url}/v1/completions", json=body, timeout=10).status_code == 200
    text = httpx.get(f"{d.exporter_url}/metrics", timeout=5).text
    assert 'vllm_supervisor_proxy_rejections_total{reason="engine_unavailable"} 1.0' in text


def test_in_a_fleet_a_request_that_kills_its_engine_is_still_refused_here(
        daemon_factory, tmp_path):
    """The early refusal is for requests no engine has died with: one that killed this
    host's engine stays here, held while the engine comes back, so that its deaths are
    counted and it is refused after three (sent on with a 503, it would kill every host
    of the fleet in turn, one death each, and never be refused)."""
    cfg = proxy_config(tmp_path, "--die-on-prompt", "KILLER")
    cfg["fleet"] = {"routers": [f"http://127.0.0.1:{free_port()}"],  # (nobody there)
                    "retry_initial_s": 0.1, "retry_max_s": 0.5, "leave_timeout_s": 0.5}
    d = daemon_factory(cfg)
    d.wait_state("RUNNING", 30)
    r = httpx.post(f"http://{cfg['proxy']['listen']}/v1/completions",
                   json={"model": "fake", "prompt": "KILLER", "max_tokens": 4}, timeout=120)
    assert r.status_code == 502 and r.json()["error"]["type"] == "kills_engine", r.text
    assert d.status()["restarts"] >= 2
