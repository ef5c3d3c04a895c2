"""The front door through the real daemon and a fake engine: streaming passes through,
restarts lose no request, the hold and the throttle are bounded and observable, the
engine's administrative routes stay private, and bad HTTP input is refused."""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.harness import (
    fake_engine_config,
    free_port,
    path_tricks,
    raw_request,
    wait_for,
    write_config,
)


def proxy_config(tmp: Path, *fake: str, **proxy: Any) -> dict[str, dict[str, Any]]:
    cfg = fake_engine_config(tmp, "--child", "--served-model-name", "fake", *fake,
                             canary={"period_s": 0.5, "timeout_s": 2.0})
    cfg["proxy"] = {"enabled": True, "listen": f"127.0.0.1:{free_port()}", **proxy}
    return cfg


def url(cfg: dict[str, Any], path: str = "/v1/completions") -> str:
    return f"http://{cfg['proxy']['listen']}{path}"


def stream(cfg: dict[str, Any], tokens: int = 20, timeout: float = 60) -> list[str]:
    """One streamed completion through the proxy; its SSE data lines."""
    body = {"model": "fake", "prompt": "hi", "max_tokens": tokens, "stream": True}
    with httpx.stream("POST", url(cfg), json=body, timeout=timeout) as r:
        assert r.status_code == 200, r.read()
        return [line for line in r.iter_lines() if line.startswith("data: ")]


def complete(cfg: dict[str, Any], tokens: int = 2, timeout: float = 60) -> httpx.Response:
    return httpx.post(url(cfg), json={"model": "fake", "prompt": "hi", "max_tokens": tokens},
                      timeout=timeout)


def test_streams_pass_through_chunk_by_chunk_with_status_and_headers(daemon_factory,
                                                                     tmp_path):
    cfg = proxy_config(tmp_path, "--token-delay", "0.05")
    d = daemon_factory(cfg)
    d.wait_state("RUNNING")
    wait_for(lambda: d.status()["admission"]["held"] is None, 10, "the gate to open")
    body = {"model": "fake", "prompt": "hi", "max_tokens": 10, "stream": True}
    arrivals = []
    with httpx.stream("POST", url(cfg), json=body, timeout=30) as r:
        assert r.status_code == 200
        assert r.headers["x-fake-engine"] == "1"
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                arrivals.append((time.monotonic(), line))
    assert [line for _, line in arrivals][-1] == "data: [DONE]" and len(arrivals) == 11
    # unbuffered: the chunks arrived spread over the stream, not all at its end
    assert arrivals[-1][0] - arrivals[0][0] > 0.2
    assert httpx.get(url(cfg, "/v1/models"), timeout=5).json()["data"][0]["id"] == "fake"
    r = httpx.post(url(cfg, "/v1/nothing"), json={}, timeout=5)
    assert r.status_code == 404  # not a route the proxy forwards


def test_admin_routes_are_refused_and_health_endpoints_answer(daemon_factory, tmp_path):
    cfg = proxy_config(tmp_path)
    d = daemon_factory(cfg)
    d.wait_state("RUNNING")
    wait_for(lambda: httpx.get(url(cfg, "/readyz"), timeout=5).status_code == 200, 10,
             "readyz")
    for path in ("/sleep?level=1", "/wake_up", "/reset_prefix_cache", "/collective_rpc",
                 "/server_info", "/pause", "/scale_elastic_ep", "/is_sleeping",
                 "/v1/load_lora_adapter"):
        r = httpx.post(url(cfg, path), timeout=5)
        assert r.status_code == 403, path
    assert not (tmp_path / "prefix-resets").exists()  # never reached the engine
    assert httpx.get(url(cfg, "/admin/anything"), timeout=5).status_code == 404
    assert httpx.get(url(cfg, "/metrics"), timeout=5).status_code == 404  # not public
    assert httpx.get(url(cfg, "/healthz"), timeout=5).text == "ok\n"
    # vLLM's own /health would say 200 for a frozen engine: the proxy answers it instead
    assert httpx.get(url(cfg, "/health"), timeout=5).text == "ready\n"
    recs = [r for r in d.log_records() if r.get("event") == "request path refused"]
    assert [r["reason"] for r in recs] == ["admin_route"] * 9 + ["not_allowed"] * 2
    assert all(r["peer"] == "127.0.0.1" for r in recs)


# what the daemon itself asks of an engine (its health, its development routes, scrape,
# the proof's warm-up (`/tokenize`: a token id for its long prefill), canary, golden check)
ENGINE_PROBES = {"GET /health", "GET /metrics", "GET /v1/models", "POST /v1/completions",
                 "POST /v1/chat/completions", "POST /tokenize", "GET /reset_prefix_cache",
                 "GET /sleep", "GET /wake_up", "GET /is_sleeping", "GET /pause",
                 "GET /resume", "GET /is_paused", "GET /version"}


def test_path_tricks_never_reach_the_engine_and_the_path_checked_is_the_path_sent(
        daemon_factory, tmp_path):
    cfg = proxy_config(tmp_path)
    d = daemon_factory(cfg)
    d.wait_state("RUNNING")
    wait_for(lambda: httpx.get(url(cfg, "/readyz"), timeout=5).status_code == 200, 10,
             "readyz")
    answers: dict[str, int] = {}
    for route in ("/reset_prefix_cache", "/server_info", "/collective_rpc", "/sleep"):
        for target in path_tricks(route):
            status, body = raw_request(cfg["proxy"]["listen"], "POST", target)
            answers[target] = status
            assert status in (400, 403), (target, status, body)
            assert json.loads(body)["error"]["type"] in ("bad_path", "admin_route")
    # what the proxy forwards reaches the engine as the path it checked, decoded once
    status, _ = raw_request(cfg["proxy"]["listen"], "POST", "/v1/%63ompletions",
                            b'{"model": "fake", "prompt": "hi", "max_tokens": 1}')
    assert status == 200
    status, _ = raw_request(cfg["proxy"]["listen"], "GET", "/v1/models?x=%2e%2e/sleep")
    assert status == 200
    reached = (tmp_path / "requests").read_text().splitlines()
    assert set(reached) - ENGINE_PROBES == {"GET /v1/models?x=%2e%2e/sleep"}
    assert reached.count("POST /v1/completions") >= 1
    assert not (tmp_path / "prefix-resets").exists()
    refused = [r for r in d.log_records() if r.get("event") == "request path refused"]
    assert len(refused) == len(answers)
    text = httpx.get(f"{d.exporter_url}/metrics", timeout=5).text
    bad = sum(1 for s in answers.values() if s == 400)
    admin = sum(1 for s in answers.values() if s == 403)
    assert f'vllm_supervisor_proxy_rejections_total{{reason="bad_path"}} {bad}.0' in text
    assert f'vllm_supervisor_proxy_rejections_total{{reason="admin_route"}} {admin}.0' in text


def test_restart_under_streaming_load_loses_no_request(daemon_factory, tmp_path):
    cfg = proxy_config(tmp_path, "--token-delay", "0.02")
    d = daemon_factory(cfg)
    d.wait_state("RUNNING")
    wait_for(lambda: d.status()["admission"]["held"] is None, 10, "the gate to open")
    results: list[Any] = []
    stop = threading.Event()

    def client() -> None:
        while not stop.is_set():
            try:
                lines = stream(cfg, tokens=25)
                results.append("ok" if lines[-1] == "data: [DONE]" and len(lines) == 26
                               else f"incomplete: {len(lines)}")
            except Exception as exc:  # counted, then asserted on
                results.append(repr(exc))

    threads = [threading.Thread(target=client, daemon=True) for _ in range(16)]
    for t in threads:
        t.start()
    wait_for(lambda: len(results) >= 16, 30, "some streams")
    assert d.ctl("restart", "--reason", "proxy test").returncode == 0
    d.wait_state("RUNNING", 30, extra=lambda s: s["restarts"] == 1)
    n = len(results)
    wait_for(lambda: len(results) >= n + 32, 30, "streams after the restart")
    stop.set()
    for t in threads:
        t.join(30)
    failed = [r for r in results if r != "ok"]
    assert failed == [] and len(results) > 48
    released = [e for e in d.events() if e["event"] == "released"]
    assert released and released[-1]["count"] > 0  # requests were held, then released


def test_hold_timeout_and_full_queue_give_503_with_retry_after(daemon_factory, tmp_path):
    cfg = proxy_config(tmp_path, hold_timeout_s=0.5, hold_queue_max=2)
    d = daemon_factory(cfg)
    d.wait_state("RUNNING")
    wait_for(lambda: d.status()["admission"]["held"] is None, 10, "the gate to open")
    assert d.ctl("drain").returncode == 0
    r = complete(cfg)
    assert r.status_code == 503 and r.headers["retry-after"] == "5"
    assert "drain requested" in r.json()["error"]["message"]
    assert r.json()["error"]["type"] == "hold_timeout"
    out: list[int] = []
    threads = [threading.Thread(target=lambda: out.append(complete(cfg).status_code))
               for _ in range(2)]
    for t in threads:
        t.start()
    wait_for(lambda: d.status()["admission"]["waiting"] == 2, 5, "two held")
    full = complete(cfg)
    assert full.status_code == 503 and full.json()["error"]["type"] == "queue_full"
    for t in threads:
        t.join(10)
    assert out == [503, 503]
    text = httpx.get(f"{d.exporter_url}/metrics", timeout=5).text
    assert 'vllm_supervisor_proxy_rejections_total{reason="queue_full"} 1.0' in text
    assert 'vllm_supervisor_proxy_rejections_total{reason="hold_timeout"} 3.0' in text
    assert "vllm_supervisor_engine_ready 0.0" in text  # drained: not ready
    assert d.ctl("resume").returncode == 0
    assert complete(cfg).status_code == 200


def test_an_unknown_model_gets_404_at_once_with_the_models_even_while_held(
        daemon_factory, tmp_path):
    cfg = proxy_config(tmp_path, hold_timeout_s=30)
    d = daemon_factory(cfg)
    d.wait_state("RUNNING")
    wait_for(lambda: d.status()["admission"]["held"] is None, 10, "the gate to open")
    assert d.ctl("drain").returncode == 0  # held: a known model would wait 30 s
    # (held, it would have waited 30 s for a 503 `hold_timeout`: the client gives up at 10)
    r = httpx.post(url(cfg), json={"model": "gpt-4", "prompt": "x"}, timeout=10)
    assert r.status_code == 404
    err = r.json()["error"]
    assert err["type"] == "unknown_model" and "gpt-4" in err["message"]
    assert err["message"].endswith("models: fake")
    assert d.status()["admission"]["waiting"] == 0  # never queued
    text = httpx.get(f"{d.exporter_url}/metrics", timeout=5).text
    assert 'vllm_supervisor_proxy_rejections_total{reason="unknown_model"} 1.0' in text
    assert d.ctl("resume").returncode == 0
    assert complete(cfg).status_code == 200  # its own model passes
    access = [e for e in d.log_records() if e.get("event") == "request"]
    assert access[0]["status"] == 404 and access[0]["outcome"] == "unknown_model"


def test_resume_releases_held_requests_in_order_without_a_restart(daemon_factory, tmp_path):
    cfg = proxy_config(tmp_path)
    d = daemon_factory(cfg)
    d.wait_state("RUNNING")
    wait_for(lambda: d.status()["admission"]["held"] is None, 10, "the gate to open")
    assert d.ctl("drain").returncode == 0
    out: list[int] = []
    threads = [threading.Thread(target=lambda: out.append(complete(cfg).status_code))
               for _ in range(5)]
    for t in threads:
        t.start()
    wait_for(lambda: d.status()["admission"]["waiting"] == 5, 10, "five held")
    assert d.ctl("resume").returncode == 0
    for t in threads:
        t.join(20)
    assert out == [200] * 5 and d.status()["restarts"] == 0
    text = httpx.get(f"{d.exporter_url}/metrics", timeout=5).text
    m = {(s.name, tuple(sorted(s.labels.items()))): s.value
         for fam in text_string_to_metric_families(text) for s in fam.samples}
    assert m[("vllm_supervisor_proxy_responses_total", (("code", "200"),))] >= 5
    held = (("model", "fake"),)
    assert m[("vllm_supervisor_client_hold_wait_seconds_count", held)] >= 5
    # each of the five waited through the drain: none of them in the lowest bucket
    assert m[("vllm_supervisor_client_hold_wait_seconds_bucket",
              (("le", "+Inf"), ("model", "fake")))] >= 5
    assert m[("vllm_supervisor_client_hold_wait_seconds_bucket",
              (("le", "0.001"), ("model", "fake")))] <= \
        m[("vllm_supervisor_client_hold_wait_seconds_count", held)] - 5
    assert m[("vllm_supervisor_proxy_held", ())] == 0


def metrics(d: Any) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = httpx.get(f"{d.exporter_url}/metrics", timeout=5).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_client_latency_is_measured_by_model_and_each_request_has_one_access_line(
        daemon_factory, tmp_path):
    cfg = proxy_config(tmp_path, "--token-delay", "0.05")
    d = daemon_factory(cfg)
    d.wait_state("RUNNING")
    wait_for(lambda: d.status()["admission"]["held"] is None, 10, "the gate to open")
    body = {"model": "fake", "prompt": "hi", "max_tokens": 10, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.monotonic()
    with httpx.stream("POST", url(cfg), json=body, timeout=30) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    took = time.monotonic() - t0
    assert lines[-1] == "data: [DONE]"
    assert complete(cfg, tokens=3).status_code == 200
    r = httpx.post(url(cfg), json={"model": "no-such-model", "prompt": "x"}, timeout=10)
    m = metrics(d)
    fake, other = (("model", "fake"),), (("model", "other"),)
    assert m[("vllm_supervisor_client_ttft_seconds_count", fake)] == 1
    ttft = m[("vllm_supervisor_client_ttft_seconds_sum", fake)]
    assert 0 < ttft < took
    # ten tokens 50 ms apart: a gap per write after the first (the proxy writes what
    # one read brought, so a starved machine coalesces a few), 0.45 s of them in all
    gaps = m[("vllm_supervisor_client_stream_gap_seconds_count", fake)]
    assert gaps >= 3
    assert 0.2 < m[("vllm_supervisor_client_stream_gap_seconds_sum", fake)] < took
    assert m[("vllm_supervisor_client_request_duration_seconds_count", fake)] == 2
    assert m[("vllm_supervisor_client_request_duration_seconds_count", other)] == 1
    assert m[("vllm_supervisor_client_admission_wait_seconds_count", fake)] == 2
    assert ("vllm_supervisor_client_ttft_seconds_count", other) not in m  # not streamed
    access = [rec for rec in d.log_records() if rec.get("event") == "request"]
    assert len(access) == 3, access
    streamed, plain, unknown = access
    assert streamed["path"] == "/v1/completions" and streamed["method"] == "POST"
    assert streamed["model"] == "fake" and streamed["status"] == 200
    assert streamed["tokens"] == 10  # from the stream's usage chunk
    assert 0 < streamed["ttft_s"] < streamed["duration_s"] <= took
    assert plain["tokens"] == 3 and "ttft_s" not in plain
    assert unknown["model"] == "no-such-model" and unknown["status"] == r.status_code
    assert all(rec["peer"] == "127.0.0.1" for rec in access)


def test_throttle_levels_cap_concurrency_live(daemon_factory, tmp_path):
    cfg = proxy_config(tmp_path, "--token-delay", "0.02", max_concurrency=8)
    cfg["throttle"] = {"level_factors": [0.25]}
    d = daemon_factory(cfg)
    d.wait_state("RUNNING")
    wait_for(lambda: d.status()["admission"]["held"] is None, 10, "the gate to open")
    r = d.ctl("throttle", "1")
    assert r.returncode == 0 and "at most 2" in r.stdout
    (tmp_path / "max-running").unlink(missing_ok=True)
    out: list[int] = []
    threads = [threading.Thread(target=lambda: out.append(complete(cfg, 20).status_code))
               for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert out == [200] * 8
    peak = int((tmp_path / "max-running").read_text())
    assert peak <= 2 + 1  # the canary may run beside two requests
    assert d.status()["restarts"] == 0 and d.status()["throttle_level"] == 1
    assert d.ctl("unthrottle").returncode == 0
    assert d.status()["admission"]["max_concurrency"] == 8


def test_a_client_that_disconnects_cancels_its_upstream_request(daemon_factory, tmp_path):
    cfg = proxy_config(tmp_path, "--token-delay", "0.05")
    d = daemon_factory(cfg)
    d.wait_state("RUNNING")
    wait_for(lambda: d.status()["admission"]["held"] is None, 10, "the gate to open")
    body = {"model": "fake", "prompt": "hi", "max_tokens": 400, "stream": True}
    with httpx.stream("POST", url(cfg), json=body, timeout=30) as r:
        lines = r.iter_lines()
        next(lines)
        next(lines)
    # the engine sees its client gone long before the 20 s the stream would take
    wait_for(lambda: (tmp_path / "aborts").exists(), 10, "the engine to see the abort")
    wait_for(lambda: d.status()["admission"]["in_flight"] == 0, 10, "the slot freed")


@pytest.mark.parametrize("continued", [True, False])
def test_engine_crash_mid_stream_and_later_requests(daemon_factory, tmp_path, continued):
    """The whole engine SIGKILLed under a stream: the stream goes on, whole, on the
    restarted engine (with `continue_streams = false` it is cut, fast); requests sent
    after the crash are held and answered."""
    cfg = proxy_config(tmp_path, "--token-delay", "0.05", continue_streams=continued)
    d = daemon_factory(cfg)
    st = d.wait_state("RUNNING")
    wait_for(lambda: d.status()["admission"]["held"] is None, 10, "the gate to open")
    in_flight: list[Any] = []
    got: list[str] = []  # its data lines, as they arrive

    def long_stream() -> None:
        body = {"model": "fake", "prompt": "hi", "max_tokens": 200, "stream": True}
        try:
            with httpx.stream("POST", url(cfg), json=body, timeout=60) as r:
                assert r.status_code == 200, r.read()
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        got.append(line)
            in_flight.append(("ok" if got[-1] == "data: [DONE]" else "cut", len(got),
                              time.time()))
        except Exception as exc:  # without continuation: it fails, and fast
            in_flight.append((repr(exc), 0, time.time()))

    t = threading.Thread(target=long_stream)
    t.start()
    wait_for(lambda: len(got) >= 3, 10, "a few tokens delivered")
    os.killpg(st["pid"], signal.SIGKILL)  # the whole engine, as a crash
    later: list[int] = []
    waiters = [threading.Thread(target=lambda: later.append(complete(cfg).status_code))
               for _ in range(4)]
    for w in waiters:
        w.start()
    t.join(60)
    for w in waiters:
        w.join(60)
    assert in_flight, "the stream never ended"
    outcome, lines, ended = in_flight[0]
    if continued:
        assert (outcome, lines) == ("ok", 201), in_flight  # every token, then [DONE]
    else:
        # it failed, and at once: before the new engine was up, not held for it
        assert outcome != "ok", in_flight
        up = [e for e in d.log_records() if e.get("to") == "RUNNING"][-1]
        assert ended < datetime.fromisoformat(up["timestamp"]).timestamp(), (in_flight, up)
    assert later == [200] * 4  # held through the backoff and the restart
    assert d.status()["restarts"] == 1


def test_bad_http_input_is_refused_and_a_slow_client_stalls_no_one(daemon_factory,
                                                                   tmp_path):
    cfg = proxy_config(tmp_path, max_body_bytes=4096, max_header_bytes=2048)
    d = daemon_factory(cfg)
    d.wait_state("RUNNING")
    wait_for(lambda: d.status()["admission"]["held"] is None, 10, "the gate to open")
    host, port = cfg["proxy"]["listen"].split(":")

    def raw(data: bytes) -> bytes:
        with socket.create_connection((host, int(port)), timeout=5) as s:
            s.sendall(data)
            return s.recv(4096)

    def status_of(answer: bytes) -> int:
        return int(answer.split(b" ", 2)[1])

    assert status_of(raw(b"NONSENSE\r\n\r\n")) == 400
    assert status_of(raw(b"GET /v1/models HTTP/1.1\r\nX-Big: " + b"a" * 5000
                         + b"\r\n\r\n")) in (400, 431)
    r = httpx.post(url(cfg), content=b"x" * 10000, timeout=5,
                   headers={"content-type": "application/json"})
    assert r.status_code == 413
    # a client that sends half a request and stalls does not hold up the others
    slow = socket.create_connection((host, int(port)), timeout=5)
    slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
    try:
        t0 = time.monotonic()
        assert complete(cfg).status_code == 200
        assert time.monotonic() - t0 < 5
    finally:
        slow.close()
    assert d.status()["state"] == "RUNNING"


def test_status_shows_admission(daemon_factory, tmp_path):
    cfg = proxy_config(tmp_path)
    d = daemon_factory(cfg)
    d.wait_state("RUNNING")
    adm = wait_for(lambda: (a := d.status()["admission"])["held"] is None and a, 10, "open")
    assert adm["listen"] == cfg["proxy"]["listen"] and adm["max_concurrency"] == 256
    text = d.ctl("status").stdout
    assert "proxy " in text and "in flight" in text
    assert json.loads(d.ctl("status", "--json").stdout)["admission"]["waiting"] == 0


def test_reload_says_when_each_key_applies_and_the_proxy_follows_a_new_engine_port(
        daemon_factory, tmp_path):
    # the scenario a new user ran into: reload a new engine.port, then restart; every
    # request through the proxy got 503 because the proxy still targeted the old port
    cfg = proxy_config(tmp_path)
    d = daemon_factory(cfg)
    cfg = d.sections  # (as written: with the proxy workers tests/conftest.py chose)
    d.wait_state("RUNNING")
    wait_for(lambda: d.status()["admission"]["held"] is None, 10, "the gate to open")
    old_port, new_port = cfg["engine"]["port"], free_port()
    old_listen = cfg["proxy"]["listen"]
    cfg["engine"]["port"] = new_port
    cfg["proxy"].update(max_concurrency=7, retry_after_s=9, listen=f"127.0.0.1:{free_port()}")
    write_config(d.config, cfg)
    r = d.ctl("reload")
    assert r.returncode == 0, r.stderr
    assert "applied now: proxy.max_concurrency, proxy.retry_after_s" in r.stdout
    assert "at the next engine start: engine.port" in r.stdout
    assert "only when the daemon restarts: proxy.listen" in r.stdout
    warned = [e for e in d.log_records()
              if e.get("event") == "these settings take effect only when the daemon restarts"]
    assert warned and warned[-1]["keys"] == ["proxy.listen"]
    st = d.status()
    # admission limits at once; the running engine and the proxy's socket as they are
    assert st["admission"]["max_concurrency"] == 7
    assert st["admission"]["listen"] == old_listen
    assert st["engine"]["port"] == old_port
    assert complete(cfg | {"proxy": {"listen": old_listen}}).status_code == 200
    assert d.ctl("restart").returncode == 0
    d.wait_state("RUNNING", 30, extra=lambda s: s["restarts"] == 1)
    wait_for(lambda: d.status()["admission"]["held"] is None, 10, "the gate to open")
    st = d.status()
    assert st["engine"]["port"] == new_port
    assert st["admission"]["upstream"] == f"http://127.0.0.1:{new_port}"
    answers = [complete(cfg | {"proxy": {"listen": old_listen}}).status_code
               for _ in range(5)]
    assert answers == [200] * 5


def test_a_busy_proxy_port_stops_the_daemon_before_any_engine_starts(daemon_factory,
                                                                     tmp_path):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    try:
        cfg = proxy_config(tmp_path)
        cfg["proxy"]["listen"] = f"127.0.0.1:{taken.getsockname()[1]}"
        d = daemon_factory(cfg)
        assert d.wait_exit(20) == 1
        refused = [r for r in d.log_records() if r.get("event") == "cannot start"]
        assert refused and "proxy cannot listen" in refused[0]["error"]
        assert not (tmp_path / "engine.pids").exists()  # no engine was started
        assert not Path(d.socket).exists()  # the control socket was closed again
    finally:
        taken.close()
