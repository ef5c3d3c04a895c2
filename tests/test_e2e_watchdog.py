"""End-to-end: the watchdog against the real vLLM CPU engine with the tiny model.

One daemon, started with the brief's KV-pressure flags (8 blocks of 128 tokens, 16
sequences) and the default rules, periods and windows (only the thermal rule is made
fast), serves the tests in order: (a) the brief's KV recipe, 24 clients asking 400
tokens each, trips the default kv_saturation rule and throttles by relaunch; (b) its
API server silent for 40 s while its core computes (SIGSTOP) is left alone; (c)
scripted NVML readings throttle for heat and lift with hysteresis. Each engine start
costs 40-80 s here, so the levels are few. (A SIGSTOPped EngineCore, decided by the
progress rule, is in tests/test_e2e_proxy.py: the daemon knows the requests at the
engine through its proxy.)
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from tests.harness import Daemon, alive, wait_for
from tests.test_e2e_vllm import START_TIMEOUT, complete, tree, vllm_config

pytestmark = pytest.mark.e2e


def _atomic_write(path: Path, doc: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc))
    os.replace(tmp, path)


def gpu_reading(path: Path, temp: float) -> None:
    _atomic_write(path, {"temperature_c": temp, "slowdown_temperature_c": 89.0,
                         "power_w": 350.0, "power_limit_w": 700.0,
                         "thermal_throttled": False, "power_capped": False,
                         "process_memory": {}})


@pytest.fixture(scope="module")
def watched(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Daemon, dict]]:
    tmp = tmp_path_factory.mktemp("e2e-watchdog")
    cfg: dict[str, Any] = vllm_config(tmp)
    cfg["engine"]["args"] += ["--num-gpu-blocks-override", "8", "--max-num-seqs", "16"]
    gpu = tmp / "gpu.json"
    gpu_reading(gpu, 60)
    cfg.update({
        "gpu": {"sampler": "file", "file": str(gpu), "period_s": 0.5},
        "throttle": {"level_factors": [0.75, 0.5]},
        # (the KV, hang and progress rules act once each here: no gap to wait out)
        "policy": {"min_action_gap_s": 0},
        "evidence": {"dir": str(tmp / "evidence")},
        # the one rule made fast: heat is scripted, and each lift is a 60 s relaunch
        "policy.rules.thermal": {"for_s": 2, "clear_for_s": 4, "cooldown_s": 5},
    })
    d = Daemon(tmp, cfg)
    d.gpu_file = gpu  # type: ignore[attr-defined]
    d.seen_pids = []  # type: ignore[attr-defined]
    try:
        yield d, cfg
    finally:
        seen = d.seen_pids  # type: ignore[attr-defined]
        d.close()
        for pid in alive(seen):  # never expected: the restarts prove their trees gone
            os.kill(pid, signal.SIGCONT)
            os.kill(pid, signal.SIGKILL)


def remember(d: Daemon) -> None:
    st = d.status()
    if st["pid"]:
        d.seen_pids += [p.pid for p in tree(st["pid"])]  # type: ignore[attr-defined]


def test_kv_saturation_trips_the_rule_and_throttles_with_evidence(watched):
    d, cfg = watched
    d.wait_state("RUNNING", START_TIMEOUT)
    remember(d)
    port = cfg["engine"]["port"]
    # The brief's recipe: 24 clients asking 400 tokens each with ignore_eos on 8 blocks,
    # each asking again as soon as it is answered, until the default rule decides.
    body = {"model": "tiny-llama", "prompt": "tell me a story", "max_tokens": 400,
            "ignore_eos": True}
    results: list[int | str] = []
    stop = threading.Event()

    def client() -> None:
        # one client (and TLS context) per thread: the test's own CPU stays off the 2
        # cores the engine needs to fall behind and preempt
        with httpx.Client(timeout=300) as http:
            while not stop.is_set():
                try:
                    r = http.post(f"http://127.0.0.1:{port}/v1/completions", json=body,
                                   timeout=300)
                    results.append(r.status_code)
                except httpx.HTTPError as exc:
                    results.append(type(exc).__name__)

    def tripped() -> list[dict[str, Any]]:
        return [e for e in d.decisions() if e["rule"] == "kv_saturation"]

    t0 = time.monotonic()
    threads = [threading.Thread(target=client, daemon=True) for _ in range(24)]
    for t in threads:
        t.start()
    try:
        wait_for(tripped, 420, f"the kv_saturation rule; log:\n{d.log_tail()}", interval=0.5)
        trip_s = time.monotonic() - t0
    finally:
        stop.set()
        for t in threads:
            t.join(330)
    dec = tripped()[0]
    assert dec["action"] == "throttle"
    ev = dec["evidence"]
    assert ev["preemption_rate"] >= 0.2 and ev["kv_cache_usage"] is not None
    assert [e["rule"] for e in d.decisions()] == ["kv_saturation"]  # nothing else tripped
    st = d.wait_state("RUNNING", START_TIMEOUT, extra=lambda s: s["restarts"] == 1)
    assert st["throttle_level"] == 1 and st["overrides"]["--max-num-seqs"] == "12"
    argv = " ".join(psutil.Process(st["pid"]).cmdline())
    assert "--max-num-seqs 12" in argv
    remember(d)
    first = min(r["timestamp"] for r in d.log_records()
                if r.get("event") == "policy decision")
    print("kv saturation:", json.dumps({"load_to_decision_s": round(trip_s, 2),
                                        "reason": dec["reason"],
                                        "evidence": ev, "decided_at": first,
                                        "client_results": dict(Counter(results))}))


SILENT_S = 40.0  # past the hang rule's 30 s and three of the canary's 10 s periods


def test_an_api_server_silent_for_40_s_while_its_core_computes_is_left_alone(watched):
    """An API server whose event loop is blocked while its core computes answers nothing
    (/health, /metrics, a canary): on an H200 a test engine's did for 10-20 s at a time
    under 128 prompts of 4k tokens, its detokenizer decoding each prompt again at every
    token (docs/gpu-validation.md, 2026-11-30 22:23 and 2026-12-01). Here the real API
    server is stopped (SIGSTOP: it answers nothing) for 40 s with a stream running, its
    core left to compute it. At the default rules and periods no decision follows: a
    silent scrape is no evidence of a stall, and each canary that failed meanwhile is
    weighed at the next scrape, which shows the counters moved. The stream ends whole."""
    d, cfg = watched
    st = d.wait_state("RUNNING", START_TIMEOUT)
    api, restarts, decided = st["pid"], st["restarts"], len(d.decisions())
    port = cfg["engine"]["port"]
    wait_for(lambda: d.status()["signals"]["canary_latency_s"] is not None, 30, "a canary")
    failures_before = d.status()["signals"]["scrape_failures_total"]
    chunks: list[dict[str, Any]] = []
    begun = threading.Event()

    def stream() -> None:
        body = {"model": "tiny-llama", "prompt": "tell me a story", "max_tokens": 300,
                "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body,
                          timeout=SILENT_S + 60) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    chunks.append(json.loads(line[6:]))
                    begun.set()

    reader = threading.Thread(target=stream, daemon=True)
    reader.start()
    assert begun.wait(60), "the stream's first token"
    os.kill(api, signal.SIGSTOP)  # the API server only: its EngineCore runs on
    stopped_at = time.monotonic()
    try:
        wait_for(lambda: d.status()["signals"]["scrape_failures_total"] > failures_before,
                 20, "a scrape the silent API server did not answer")
        time.sleep(max(0.0, SILENT_S - (time.monotonic() - stopped_at)))
    finally:
        os.kill(api, signal.SIGCONT)
    reader.join(60)
    assert not reader.is_alive()
    ends = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert ends[-1] == "length" and chunks[-1]["usage"]["completion_tokens"] == 300, \
        chunks[-1]
    # a good scrape since, and the engine answers: the silence is over for the daemon too
    wait_for(lambda: (s := d.status()["signals"])["metrics_age_s"] is not None
             and s["metrics_age_s"] < 5, 40, "scrapes again")
    assert complete(port)
    assert len(d.decisions()) == decided, d.decisions()[decided:]
    st = d.status()
    assert (st["pid"], st["restarts"], st["state"]) == (api, restarts, "RUNNING")
    silent = [r for r in d.log_records() if r.get("event") == "canary failed"
              and r.get("pid") == api]
    assert len(silent) >= 2 and not any(r["counted"] is True for r in silent), silent
    assert d.status()["signals"]["canary_failures"] == 0
    assert not [r for r in d.log_records()
                if r.get("event", "").startswith("canary failures judged by a scrape")]
    print("silent API server:", json.dumps({
        "silent_s": round(time.monotonic() - stopped_at, 1), "stream_chunks": len(chunks),
        "scrape_failures": d.status()["signals"]["scrape_failures_total"] - failures_before,
        "canaries_failed": len(silent), "decisions": 0}))


def test_scripted_nvml_heat_throttles_and_lifts_with_hysteresis(watched):
    d, cfg = watched
    gpu: Path = d.gpu_file  # type: ignore[attr-defined]
    d.wait_state("RUNNING", START_TIMEOUT)
    gpu_reading(gpu, 86)  # 3 C under the card's 89 C slowdown mark
    st = d.wait_state("RUNNING", START_TIMEOUT, extra=lambda s: s["restarts"] == 2)
    assert st["throttle_level"] == 2 and st["overrides"]["--max-num-seqs"] == "8"
    dec = d.decisions()[-1]
    assert dec["rule"] == "thermal" and dec["evidence"]["gpu_slowdown_margin_c"] == 3
    remember(d)

    gpu_reading(gpu, 82)  # 7 C under: inside the hysteresis band, no lift
    at7 = wait_for(lambda: (s := d.status())["signals"]["gpu_slowdown_margin_c"] == 7 and s,
                   10, "margin 7")["state_for_s"]
    # the daemon's own clock: 8 s at margin 7, twice clear_for_s
    wait_for(lambda: d.status()["state_for_s"] > at7 + 8, 20, "8 s at margin 7")
    assert d.status()["throttle_level"] == 2 and d.status()["restarts"] == 2

    gpu_reading(gpu, 79)  # 10 C under: lifts one level after clear_for_s
    st = d.wait_state("RUNNING", START_TIMEOUT, extra=lambda s: s["restarts"] == 3)
    assert st["throttle_level"] == 1 and st["overrides"]["--max-num-seqs"] == "12"
    assert d.decisions()[-1]["action"] == "lift"
    assert complete(cfg["engine"]["port"])
    remember(d)
    r = d.ctl("stop", timeout=120)
    assert r.returncode == 0 and d.wait_exit(60) == 0
    assert alive(d.seen_pids) == []  # type: ignore[attr-defined]
