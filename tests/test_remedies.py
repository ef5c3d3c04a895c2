"""Component tests of the GPU path's remedies against the fake engine, over real sockets:
the KV reset through sleep and wake behind a hold of new requests (operator and policy),
its failure turning into a restart, the engines that cannot do it, and the refusal to
start beside another program's GPU memory (scripted NVML process list)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

from supervisor.watchdog.metrics import parse_metrics
from tests.harness import fake_engine_config, wait_for
from tests.test_proxy import complete, proxy_config, url

pytestmark = pytest.mark.component


def sleepy_config(tmp: Path, *fake: str, **sections: dict[str, Any]) -> dict[str, Any]:
    cfg = proxy_config(tmp, "--enable-sleep-mode", *fake)
    cfg["engine"]["env"]["VLLM_SERVER_DEV_MODE"] = "1"
    for name, table in sections.items():
        cfg.setdefault(name, {}).update(table)
    return cfg


def test_kv_reset_holds_new_requests_sleeps_a_drained_engine_and_releases_them(
        daemon_factory, tmp_path):
    cfg = sleepy_config(tmp_path, "--token-delay", "0.02")
    cfg["engine"]["drain_timeout_s"] = 10.0
    d = daemon_factory(cfg)
    d.wait_state("RUNNING")
    wait_for(lambda: d.status()["remedies"]["kv_reset"], 10, "sleep mode to be probed")
    assert d.status()["remedies"]["kv_reset_unavailable"] is None
    results: list[int] = []

    def load() -> None:  # a small concurrent load across the reset
        for _ in range(5):
            results.append(complete(cfg, tokens=20).status_code)

    threads = [threading.Thread(target=load) for _ in range(4)]
    for t in threads:
        t.start()
    wait_for(lambda: d.status()["admission"]["in_flight"] >= 2, 10, "requests in flight")
    r = d.ctl("kv-reset", timeout=60)
    for t in threads:
        t.join(60)
    assert r.returncode == 0, r.stderr
    assert "KV reset ok" in r.stdout
    assert results == [200] * 20  # none failed: held while the engine slept
    # the engine slept with nothing running (its warm-up, then the reset's): in-flight
    # requests finished first
    assert (tmp_path / "sleeps").read_text().split() == ["0", "0"]
    (ev,) = d.remedies()
    assert ev["rung"] == "kv_reset" and ev["outcome"] == "ok" and ev["error"] is None
    assert list(ev["steps_s"]) == ["drain", "engine_idle", "sleep", "wake_up", "canary"]
    assert ev["duration_s"] >= sum(ev["steps_s"].values()) - 1e-3
    # the engine's count as the idle wait read it, in the audit: it ended at 0
    assert ev["idle_counts"] and ev["idle_counts"][-1][1] == 0, ev
    st = d.status()
    assert st["restarts"] == 0 and st["admission"]["held"] is None
    assert st["remedies"]["running"] is None


def test_kv_reset_cuts_the_daemons_own_canary_before_the_engine_sleeps(
        daemon_factory, tmp_path):
    # each canary generates 16 tokens at 0.1 s: in flight 1.6 s (under a full batch vLLM
    # keeps it waiting for a place about as long: 1.4 s on the H100)
    cfg = sleepy_config(tmp_path, "--token-delay", "0.1",
                        canary={"period_s": 0.5, "timeout_s": 6.0, "max_tokens": 16})
    d = daemon_factory(cfg)
    d.wait_state("RUNNING")
    wait_for(lambda: d.status()["remedies"]["kv_reset"], 10, "sleep mode to be probed")
    wait_for(lambda: any(e["event"] == "warmed_up" for e in d.events()), 30, "warmed up")
    wait_for(lambda: d.status()["admission"]["held"] is None, 30, "the gate to open")
    asked = tmp_path / "requests"

    def canaries() -> int:
        return asked.read_text().count("POST /v1/completions")

    for i in range(2):
        seen = canaries()
        wait_for(lambda: canaries() > seen, 10, "a canary in flight")  # noqa: B023
        r = d.ctl("kv-reset", timeout=60)
        assert r.returncode == 0 and "KV reset ok" in r.stdout, (r.stdout, r.stderr)
        # cut at the engine (its client gone before the answer: aborted there), not
        # waited for: the reset's drain is not the canary's 3.2 s
        assert len((tmp_path / "aborts").read_text().split()) == i + 1
    # the engine slept with nothing running, the canary included, each time (its
    # warm-up before it served, then the two resets)
    assert (tmp_path / "sleeps").read_text().split() == ["0", "0", "0"]
    assert [e["outcome"] for e in d.remedies()] == ["ok", "ok"]
    # a cut canary is neither a pass nor a failure
    assert d.status()["signals"]["canary_failures"] == 0


@pytest.mark.parametrize("fault", ["fail", "wrong"])
def test_a_failed_wake_is_audited_and_becomes_a_restart_that_loses_nothing(daemon_factory,
                                                                           tmp_path, fault):
    """The KV reset's wake fails, or the engine answers the golden prompt otherwise
    after it: the remedy failed, the engine is restarted, nothing lost."""
    wake_fault = tmp_path / "wake-fault"
    d = daemon_factory(sleepy_config(tmp_path, "--wake-fault-file", str(wake_fault),
                                     "--logprobs"))
    d.wait_state("RUNNING")
    wait_for(lambda: d.status()["remedies"]["kv_reset"], 10, "sleep mode to be probed")
    wait_for(lambda: any(e["event"] == "warmed_up" for e in d.events()), 10, "warmed up")
    wait_for(lambda: d.status()["admission"]["held"] is None, 30, "the gate to open")
    wake_fault.write_text(fault)  # (its warm-up wake before it served went well)
    r = d.ctl("kv-reset", timeout=60)
    assert r.returncode == 1 and "KV reset failed" in r.stdout
    said = "POST /wake_up: HTTP 500" if fault == "fail" else \
        "golden check failed: completion: token 0"
    assert said in r.stdout, r.stdout
    # a request sent now is held through the restart and served by the new engine
    assert complete(d.sections, tokens=2).status_code == 200
    st = d.wait_state("RUNNING", 30, extra=lambda s: s["restarts"] == 1)
    assert "kv_reset failed" in st["last_decision"]["reason"]
    ev, fallback = d.remedies()
    steps = ["drain", "engine_idle", "sleep", "wake_up"] + (["canary"] if fault == "wrong" else [])
    assert ev["outcome"] == "failed" and list(ev["steps_s"]) == steps
    # the restart that replaced it is the next rung's own entry
    assert fallback["rung"] == "restart" and fallback["outcome"] == "ok"
    assert "kv_reset failed" in fallback["reason"]
    (evidence,) = [e for e in d.events() if e["event"] == "evidence"]  # before the kill
    assert evidence["rule"] == "kv_reset_failed" and evidence["error"] is None
    # a wake broke this engine: its successor is not put to sleep, by a warm-up or a
    # KV reset, and says why
    why = wait_for(lambda: d.status()["remedies"]["kv_reset_unavailable"], 10,
                   "the new engine's sleep mode probed")
    assert "a wake broke an engine" in why and ("wake_up" in why or "golden" in why), why
    assert [e["event"] for e in d.events()].count("warmed_up") == 1
    assert (tmp_path / "sleeps").read_text().split() == ["0", "0"]


def test_an_engine_sleeps_and_wakes_once_before_it_serves_and_its_first_kv_reset_is_warm(
        daemon_factory, tmp_path):
    """vLLM's first sleep of an engine pins its weights in host RAM (12.8 s for an 8B
    model on the H100, later ones 0.4 s): the daemon pays it before the engine serves,
    while the requests that came meanwhile are held, so that a KV reset holds clients
    for sleep and wake alone. The engine is proven again after that wake."""
    cfg = sleepy_config(tmp_path, "--first-sleep-delay", "1.5", "--logprobs")
    d = daemon_factory(cfg)
    d.wait_state("RUNNING")
    answer = complete(cfg, tokens=3)  # held through the warm-up, then served
    assert answer.status_code == 200
    audit = d.events()
    names = [e["event"] for e in audit]
    (warmed,) = [e for e in audit if e["event"] == "warmed_up"]
    assert warmed["ok"] is True and warmed["error"] is None
    assert list(warmed["steps_s"]) == ["sleep", "wake_up"]
    assert warmed["steps_s"]["sleep"] >= 1.5  # (the fake's first sleep)
    # what vLLM itself measured (its sleep-mode histogram, read before and after), beside:
    # within the daemon's own calls, which add HTTP and the /is_sleeping check
    own = warmed["vllm_s"]
    assert list(own) == ["sleep", "wake"] and 1.5 <= own["sleep"] <= warmed["steps_s"]["sleep"]
    assert 0 < own["wake"] <= warmed["steps_s"]["wake_up"]
    assert names.index("golden_recorded") < names.index("warmed_up")
    # its answers after the wake matched those before it
    assert d.status()["golden"] == {**d.status()["golden"], "passed": 1, "mismatches": 0}
    # the warm-up slept with nothing running, and the requests came after it
    assert (tmp_path / "sleeps").read_text().split() == ["0"]
    r = d.ctl("kv-reset", timeout=60)
    assert r.returncode == 0 and "KV reset ok" in r.stdout, (r.stdout, r.stderr)
    (ev,) = d.remedies()
    assert ev["outcome"] == "ok" and ev["steps_s"]["sleep"] < warmed["steps_s"]["sleep"]
    # this reset's own sleep and wake alone, not the warm-up's: the histogram's increase
    assert 0 < ev["vllm_s"]["sleep"] <= ev["steps_s"]["sleep"]
    assert 0 < ev["vllm_s"]["wake"] <= ev["steps_s"]["wake_up"]
    page = parse_metrics(httpx.get(f"http://127.0.0.1:{cfg['engine']['port']}/metrics",
                                   timeout=10).text)
    assert [(op, n) for op, n, _ in page.sleep_ops] == [("sleep", 2.0), ("wake", 2.0)]
    for op, _, total in page.sleep_ops:
        assert total == pytest.approx(own[op] + ev["vllm_s"][op], abs=0.002)
    assert f"vLLM's own: sleep {ev['vllm_s']['sleep']:.3f} s" in r.stdout
    assert (tmp_path / "sleeps").read_text().split() == ["0", "0"]
    assert d.status()["restarts"] == 0


@pytest.mark.parametrize("fault", ["--wake-fails", "--wrong-after-wake"])
def test_an_engine_a_wake_breaks_before_it_serves_is_restarted_and_not_put_to_sleep_again(
        daemon_factory, tmp_path, fault):
    """Its warm-up wake fails (the engine may be wedged), or it answers otherwise after
    it (the golden check): no request reaches it; it is restarted, and its successor
    serves without a warm-up and refuses a KV reset, saying why."""
    cfg = sleepy_config(tmp_path, fault, "--logprobs", "--startup-delay", "1")
    d = daemon_factory(cfg)
    wait_for(lambda: any(e.get("event") == "proxy listening" for e in d.log_records()), 10,
             "the proxy listening")
    answer = complete(cfg, tokens=3)  # sent during the start: held, then served
    assert answer.status_code == 200
    st = d.wait_state("RUNNING", 30, extra=lambda s: s["admission"]["held"] is None)
    assert st["restarts"] == 1
    (down,) = [e for e in d.events() if e["event"] == "state" and e["to"] == "BACKOFF"]
    assert "after its warm-up sleep and wake" in down["reason"]
    why = wait_for(lambda: d.status()["remedies"]["kv_reset_unavailable"], 10,
                   "the new engine's sleep mode probed")
    assert "a wake broke an engine" in why, why
    r = d.ctl("kv-reset")
    assert r.returncode == 1 and "a wake broke an engine" in r.stderr
    assert [e["event"] for e in d.events()].count("warmed_up") == 1
    assert (tmp_path / "sleeps").read_text().split() == ["0"]
    if fault == "--wrong-after-wake":
        mismatch = next(e for e in d.events() if e["event"] == "golden_mismatch")
        assert mismatch["why"].endswith("after its wake")
        assert d.status()["golden"]["baselines"] == 1


def test_kv_reset_is_refused_with_the_reason_when_the_engine_cannot(daemon_factory,
                                                                    tmp_path):
    cfg = proxy_config(tmp_path, "--enable-sleep-mode")  # no VLLM_SERVER_DEV_MODE
    d = daemon_factory(cfg)
    d.wait_state("RUNNING")
    wait_for(lambda: "DEV_MODE" in (d.status()["remedies"]["kv_reset_unavailable"] or ""),
             10, "the probe's verdict")
    r = d.ctl("kv-reset")
    assert r.returncode == 1
    assert "kv-reset refused" in r.stderr and "VLLM_SERVER_DEV_MODE" in r.stderr
    assert not (tmp_path / "sleeps").exists()
    assert d.status()["restarts"] == 0


def test_the_policy_climbs_from_kv_reset_to_a_restart_when_the_leak_outlives_it(
        daemon_factory, tmp_path):
    """A leak signature the KV reset does not cure (the scripted page keeps saying so):
    kv_reset first, then, a cooldown later, the next rung up, a drained restart."""
    metrics = tmp_path / "metrics.txt"
    metrics.write_text(
        'vllm:kv_cache_usage_perc{engine="0",model_name="fake"} 0.7\n'
        'vllm:num_requests_running{engine="0",model_name="fake"} 0.0\n'
        'vllm:num_requests_waiting{engine="0",model_name="fake"} 0.0\n')
    rules = {name: {"enabled": False} for name in (
        "kv_saturation", "prefix_collapse", "memory_growth", "hang", "thermal",
        "spec_decode_low", "spec_decode_high", "xid_restart", "xid_reset")}
    rules["kv_leak"] = {"for_s": 1.0, "cooldown_s": 3.0}
    cfg = sleepy_config(tmp_path, "--metrics-file", str(metrics),
                        metrics={"period_s": 0.2},
                        policy={"min_action_gap_s": 0.0, "rules": rules})
    d = daemon_factory(cfg)
    d.wait_state("RUNNING")
    st = d.wait_state("RUNNING", 40, extra=lambda s: s["restarts"] == 1)
    decisions = [e for e in d.events() if e["event"] == "decision"]
    assert [(e["rule"], e["action"]) for e in decisions[:2]] == [
        ("kv_leak", "kv_reset"), ("kv_leak", "restart")]
    assert decisions[0]["evidence"] == {"kv_cache_usage": 0.7, "requests_running": 0.0}
    assert "still kv_cache_usage >= 0.5" in decisions[1]["reason"]
    assert d.remedies()[0]["rung"] == "kv_reset" and d.remedies()[0]["outcome"] == "ok"
    wait_for(lambda: len(d.remedies()) >= 2, 20, "the restart's own entry")
    assert d.remedies()[1]["rung"] == "restart" and d.remedies()[1]["outcome"] == "ok"
    assert st["policy"]["rules"]["kv_leak"]["trips"] >= 2


def test_a_foreign_process_on_the_gpu_blocks_the_start_until_it_goes(daemon_factory,
                                                                      tmp_path):
    """NVML (scripted) lists a process this daemon did not start holding 5 GiB: the
    engine is not started beside it, status says who holds what, the daemon stays up, and
    the start goes ahead once the memory is free."""
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                             start_new_session=True)
    try:
        readings = tmp_path / "gpu.json"
        readings.write_text(json.dumps({"process_memory": {str(other.pid): 5 << 30}}))
        cfg = fake_engine_config(tmp_path, gpu={"sampler": "file", "file": str(readings)},
                                 restart={"backoff_initial_s": 0.2, "backoff_max_s": 0.5})
        d = daemon_factory(cfg)
        st = d.wait_state("BACKOFF", 20, extra=lambda s: bool(s["start_blocked"]))
        why = st["start_blocked"]
        assert f"pid {other.pid}" in why and "time.sleep(120)" in why and "5120 MiB" in why
        assert "engine.gpu_foreign_allowance_mib" in why
        assert st["pid"] is None and not (tmp_path / "engine.pids").exists()
        spawn_failed = [e for e in d.events() if e["event"] == "spawn_failed"]
        assert spawn_failed and spawn_failed[0]["gpu_busy"] is True
        # not a boot failure: it keeps looking, and never goes FATAL
        wait_for(lambda: len([e for e in d.events() if e["event"] == "spawn_failed"]) >= 4,
                 20, "more looks")
        assert d.status()["state"] == "BACKOFF"
        readings.write_text(json.dumps({"process_memory": {}}))
        st = d.wait_state("RUNNING", 20)
        assert st["start_blocked"] is None
    finally:
        other.kill()
        other.wait()


def test_a_foreign_process_within_the_allowance_does_not_block(daemon_factory, tmp_path):
    readings = tmp_path / "gpu.json"
    readings.write_text(json.dumps({"process_memory": {str(os.getppid()): 300 << 20}}))
    cfg = fake_engine_config(tmp_path, gpu={"sampler": "file", "file": str(readings)})
    cfg["engine"]["gpu_foreign_allowance_mib"] = 512
    d = daemon_factory(cfg)
    d.wait_state("RUNNING", 20)
    assert not [e for e in d.events() if e["event"] == "spawn_failed"]


def test_a_proxy_request_during_a_kv_reset_is_held_not_refused(daemon_factory, tmp_path):
    """The gate holds what arrives while the engine sleeps: the client sees latency."""
    cfg = sleepy_config(tmp_path)
    cfg["engine"]["drain_timeout_s"] = 10.0
    d = daemon_factory(cfg)
    d.wait_state("RUNNING")
    wait_for(lambda: d.status()["remedies"]["kv_reset"], 10, "sleep mode to be probed")
    # (the proof, its warm-up's paths with it, let clients in: the long request runs)
    wait_for(lambda: d.status()["admission"]["held"] is None, 30, "the gate to open")
    long = threading.Thread(target=lambda: complete(cfg, tokens=150))  # ~1.5 s in flight
    long.start()
    wait_for(lambda: d.status()["admission"]["in_flight"] >= 1, 10, "the long request")
    ctl = threading.Thread(target=lambda: d.ctl("kv-reset", timeout=60))
    ctl.start()
    wait_for(lambda: d.status()["remedies"]["running"] is not None, 10, "the reset to start")
    r = httpx.post(url(cfg), json={"model": "fake", "prompt": "x", "max_tokens": 1},
                   timeout=30)
    assert r.status_code == 200
    ctl.join(60)
    long.join(30)
    (ev,) = d.remedies()
    assert ev["outcome"] == "ok" and ev["steps_s"]["drain"] > 0.3
