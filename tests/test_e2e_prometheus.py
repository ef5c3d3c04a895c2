"""End-to-end: a real Prometheus (Debian's build) scraping the daemon's exporter and the
real vLLM CPU engine every second, with deploy/prometheus/alerts.yml loaded, while faults
are provoked: scripted NVML heat, the brief's KV-saturation recipe through the proxy, and
a SIGKILL of `VLLM::EngineCore`. Through Prometheus' HTTP API the matching alerts go
pending or firing; then every query of deploy/grafana/vllm-supervisor.json (panels,
annotations, variables) runs against that Prometheus: none errors, none is empty.

One daemon and one Prometheus serve the tests in order (one engine start, one restart).
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.harness import ROOT, Daemon, RouterProcess, alive, free_port, wait_for
from tests.test_e2e_vllm import START_TIMEOUT, tree, vllm_config

pytestmark = pytest.mark.e2e

PROMETHEUS = ROOT / ".tools" / "prometheus" / "usr" / "bin" / "prometheus"
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "vllm-supervisor.json"
MODEL = "tiny-llama"


def gpu_reading(path: Path, temp: float, throttled: bool) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({
        "temperature_c": temp, "slowdown_temperature_c": 89.0, "power_w": 350.0,
        "power_limit_w": 700.0, "utilization_ratio": 0.9, "thermal_throttled": throttled,
        "power_capped": False, "process_memory": {}}))
    os.replace(tmp, path)


class Prometheus:
    def __init__(self, tmp: Path, exporter: str, engine: str, router: str) -> None:
        if not PROMETHEUS.exists():
            pytest.fail("prometheus is not set up: run `bash scripts/setup.sh prometheus`")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        conf = tmp / "prometheus.yml"
        conf.write_text(json.dumps({  # (JSON is YAML)
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s",
                       "scrape_timeout": "1s"},
            "rule_files": [str(ALERTS)],
            "scrape_configs": [
                {"job_name": "vllm-supervisor", "static_configs": [{"targets": [exporter]}]},
                {"job_name": "vllm-engine", "static_configs": [{"targets": [engine]}]},
                {"job_name": "vllm-router", "static_configs": [{"targets": [router]}]}]}))
        self.log = tmp / "prometheus.log"
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                [str(PROMETHEUS), f"--config.file={conf}",
                 f"--storage.tsdb.path={tmp / 'prom-data'}",
                 f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    def get(self, path: str, **params: Any) -> Any:
        r = httpx.get(self.url + path, params=params, timeout=10)
        body = r.json()
        assert body.get("status") == "success", (path, params, body)
        return body["data"]

    def alert(self, name: str) -> dict[str, Any] | None:
        """The alert's pending or firing instance, if any."""
        for a in self.get("/api/v1/alerts")["alerts"]:
            if a["labels"]["alertname"] == name:
                return dict(a)
        return None

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)


@pytest.fixture(scope="module")
def observed(tmp_path_factory: pytest.TempPathFactory
             ) -> Iterator[tuple[Daemon, dict[str, Any], Prometheus]]:
    tmp = tmp_path_factory.mktemp("e2e-prometheus")
    cfg: dict[str, Any] = vllm_config(tmp)
    # 5 blocks of 128 tokens (vLLM's CPU block), one of them vLLM's own null block: 4
    # for requests, as many as one request of max_model_len 512 takes
    cfg["engine"]["args"] += ["--num-gpu-blocks-override", "5", "--max-num-seqs", "16"]
    gpu = tmp / "gpu.json"
    gpu_reading(gpu, 60, False)
    cfg.update({
        "proxy": {"enabled": True, "listen": f"127.0.0.1:{free_port()}",
                  "hold_timeout_s": 240.0},
        "gpu": {"sampler": "file", "file": str(gpu), "period_s": 0.5},
        "policy": {"min_action_gap_s": 0},
        # rates exist once half the window is covered: 5 s after each engine start, so the
        # dashboard's rate panels have series after the crash test's restart too
        "signals": {"rate_window_s": 10},
        "canary": {"period_s": 3.0},  # (its latency panel: a passing canary soon after a start)
        "policy.rules.thermal": {"for_s": 2, "clear_for_s": 4, "cooldown_s": 5},
    })
    # a router in front, as in a fleet: the daemon registers with it (the fleet panels)
    router = RouterProcess(free_port(), free_port(), tmp / "router.log")
    router.start()
    cfg["fleet"] = {"routers": [router.url], "check_interval_s": 2.0}
    d = Daemon(tmp, cfg)
    d.gpu_file = gpu  # type: ignore[attr-defined]
    d.seen_pids = []  # type: ignore[attr-defined]
    prom = Prometheus(tmp, cfg["exporter"]["listen"], f"127.0.0.1:{cfg['engine']['port']}",
                      f"127.0.0.1:{router.metrics_port}")
    try:
        yield d, cfg, prom
    finally:
        prom.close()
        router.stop()
        seen = d.seen_pids  # type: ignore[attr-defined]
        d.close()
        for pid in alive(seen):
            os.kill(pid, signal.SIGKILL)


def remember(d: Daemon) -> None:
    st = d.status()
    if st["pid"]:
        d.seen_pids += [p.pid for p in tree(st["pid"])]  # type: ignore[attr-defined]


def until_alert(prom: Prometheus, name: str, timeout: float, since: float) -> dict[str, Any]:
    a = wait_for(lambda: prom.alert(name), timeout,
                 f"alert {name} pending or firing", interval=0.5)
    print(f"{name}: {a['state']} {time.monotonic() - since:.1f} s after the fault")
    return a


def stream(proxy: str, tokens: int = 32) -> bool:
    """One streamed completion through the proxy; whether it ended with [DONE] (vLLM may
    put several tokens in one event when its API server runs behind on 2 cores)."""
    body = {"model": MODEL, "prompt": "hello there", "max_tokens": tokens, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", f"http://{proxy}/v1/completions", json=body, timeout=300) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    return r.status_code == 200 and len(lines) >= 2 and lines[-1] == "data: [DONE]"


def test_every_target_is_scraped_and_clients_are_measured(observed):
    d, cfg, prom = observed
    d.wait_state("RUNNING", START_TIMEOUT)
    remember(d)
    wait_for(lambda: d.status()["admission"]["held"] is None, 60, "the gate to open")
    proxy = cfg["proxy"]["listen"]
    for _ in range(4):
        assert stream(proxy)
    assert httpx.post(f"http://{proxy}/reset_prefix_cache", timeout=10
                      ).status_code == 403  # a refusal, counted by reason

    def all_up() -> bool:
        res = prom.get("/api/v1/query", query="up")["result"]
        return {r["metric"]["job"]: r["value"][1] for r in res} == {
            "vllm-supervisor": "1", "vllm-engine": "1", "vllm-router": "1"}
    wait_for(all_up, 60, f"Prometheus scraping all three; log:\n{prom.log.read_text()}")
    q = 'sum(vllm_supervisor_client_ttft_seconds_count{model="tiny-llama"})'
    wait_for(lambda: prom.get("/api/v1/query", query=q)["result"], 30, "client TTFT series")


def test_scripted_heat_makes_the_thermal_alert_pending(observed):
    d, _, prom = observed
    t0 = time.monotonic()
    gpu_reading(d.gpu_file, 90, True)  # type: ignore[attr-defined]
    try:
        a = until_alert(prom, "VLLMGPUThermalSlowdown", 60, t0)
        assert a["state"] == "pending"  # (for: 5m)
        wait_for(lambda: d.status()["throttle_level"] >= 1, 60, "the thermal throttle")
    finally:
        gpu_reading(d.gpu_file, 60, False)  # type: ignore[attr-defined]


def test_kv_saturation_through_the_proxy_makes_its_alert_pending(observed):
    d, cfg, prom = observed
    d.wait_state("RUNNING", START_TIMEOUT)  # (not left to the tests before it)
    proxy = cfg["proxy"]["listen"]
    stop = threading.Event()
    results: list[int | str] = []

    def client(seed: int) -> None:
        # Each request fills the engine's KV cache from its first step: 440 prompt
        # tokens and 60 more take its 4 blocks, and the queue behind it keeps it so
        # while the queue lasts. (Short prompts that grow let the gauge dip between the
        # proxy's breaker and the scheduler's admissions: the alert came after 4-5
        # minutes of catching it at 95 %.) Random token ids: no prefix shared between
        # requests. One client (and TLS context) per thread.
        rng = random.Random(seed)
        with httpx.Client(timeout=300) as http:
            while not stop.is_set():
                body = {"model": MODEL, "prompt": [rng.randrange(3, 500) for _ in range(440)],
                        "max_tokens": 60, "ignore_eos": True}
                try:
                    r = http.post(f"http://{proxy}/v1/completions", json=body, timeout=300)
                    results.append(r.status_code)
                except httpx.HTTPError as exc:
                    results.append(type(exc).__name__)

    t0 = time.monotonic()
    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(24)]
    for t in threads:
        t.start()
    try:
        a = until_alert(prom, "VLLMKVCacheSaturated", 420, t0)
        assert a["state"] == "pending" and float(a["value"]) >= 0.95
        breaker = prom.alert("VLLMKVBreakerOpen")
        print("breaker alert:", breaker and breaker["state"])
    finally:
        stop.set()
        for t in threads:
            t.join(330)
    assert results and all(r == 200 for r in results), \
        (len(results), [r for r in results if r != 200][:20])


def test_engine_core_sigkill_fires_the_crash_alert(observed):
    d, _, prom = observed
    st = d.wait_state("RUNNING", START_TIMEOUT)
    core = next(p for p in tree(st["pid"]) if p.name().startswith("VLLM::EngineCor"))
    remember(d)
    t0 = time.monotonic()
    os.kill(core.pid, signal.SIGKILL)
    a = until_alert(prom, "VLLMEngineCrashed", 120, t0)
    assert a["state"] == "firing" and a["labels"]["reason"] == "crash"
    d.wait_state("RUNNING", START_TIMEOUT, extra=lambda s: s["restarts"] >= 1)
    remember(d)


# series that exist only with `engine.standby` configured (this daemon runs none): their
# queries must run; tests/test_standby.py checks that a daemon with a standby exports them
NEEDS_STANDBY = ("vllm_supervisor_standby_ready", "vllm_supervisor_failovers_total",
                 "vllm_supervisor_last_failover_seconds")


def dashboard_queries() -> list[tuple[str, str]]:
    dash = json.loads(DASHBOARD.read_text())
    out = [(f"panel {p['title']!r}", t["expr"]) for p in dash["panels"]
           for t in p.get("targets", [])]
    out += [(f"annotation {a['name']!r}", a["expr"]) for a in dash["annotations"]["list"]
            if "expr" in a]
    return out


def grafana(expr: str) -> str:
    """Grafana's variables, as a dashboard with every engine and model selected has them."""
    for var, value in (("$__rate_interval", "15s"), ("$instance", ".*"), ("$model", ".*")):
        expr = expr.replace(var, value)
    assert "$" not in expr, expr
    return expr


def test_every_dashboard_query_answers_with_series(observed):
    _, cfg, prom = observed
    q = 'sum(vllm_supervisor_client_ttft_seconds_count{model="tiny-llama"})'

    def ttft_count() -> float:
        res = prom.get("/api/v1/query", query=q)["result"]
        return float(res[0]["value"][1]) if res else 0.0
    before = ttft_count()
    assert stream(cfg["proxy"]["listen"])  # a stream on the new engine too
    wait_for(lambda: ttft_count() > before, 30, "Prometheus to scrape that stream")
    wait_for(lambda: prom.get("/api/v1/query", query="vllm_supervisor_preemptions_per_second")
             ["result"], 30, "the restarted engine's rates to be scraped")
    # (the canary's latency is the last passing canary's, of this engine start: the
    # module's earlier samples may be older than the range below on a slow machine)
    wait_for(lambda: prom.get("/api/v1/query", query="vllm_supervisor_canary_latency_seconds")
             ["result"], 60, "the restarted engine's canary to pass and be scraped")
    end = time.time()
    empty, failed = [], []
    for where, expr in dashboard_queries():
        r = httpx.get(prom.url + "/api/v1/query_range", timeout=30, params={
            "query": grafana(expr), "start": end - 900, "end": end, "step": "2"}).json()
        if r.get("status") != "success":
            failed.append((where, expr, r.get("error")))
        elif not r["data"]["result"] and not any(m in expr for m in NEEDS_STANDBY):
            empty.append((where, expr))
    dash = json.loads(DASHBOARD.read_text())
    for var in dash["templating"]["list"]:
        if var["type"] != "query":
            continue
        m = re.fullmatch(r"label_values\((.+), (\w+)\)", var["query"]["query"])
        assert m, var
        values = prom.get(f"/api/v1/label/{m[2]}/values", **{"match[]": grafana(m[1])})
        if not values:
            empty.append((f"variable {var['name']}", var["query"]["query"]))
    print(f"{len(dashboard_queries())} dashboard queries run")
    assert not failed, failed
    assert not empty, empty
