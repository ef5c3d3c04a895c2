"""End-to-end: the remediation ladder's rungs against the real vLLM CPU engine.

The CPU backend has no sleep mode, but its vLLM (0.26 or later) empties its KV cache when
paused, so every rung runs for real. Two rules whose symptom is made to persist on any
serving engine (the point is the ladder, not the symptom) drive one daemon, with the
front proxy and VLLM_SERVER_DEV_MODE=1: the throttle rule throttles live at the proxy;
the other resets the real engine's prefix cache (POST /reset_prefix_cache, answered by
vLLM), and, its symptom outliving that, the KV cache (POST /pause, checked, POST /resume),
then climbs to a drained restart, while a small load through the proxy loses nothing.
"""

from __future__ import annotations

import threading
from typing import Any

import httpx
import pytest

from tests.harness import Daemon, alive, free_port, wait_for
from tests.test_e2e_vllm import START_TIMEOUT, tree, vllm_config

pytestmark = pytest.mark.e2e

ALWAYS = "engine_uptime_s >= 0"  # holds on every serving engine
NEVER = "engine_uptime_s < 0"


def test_the_ladder_throttles_resets_the_prefix_cache_and_kv_cache_then_restarts(
        tmp_path):
    cfg: dict[str, Any] = vllm_config(tmp_path)
    cfg["engine"]["env"]["VLLM_SERVER_DEV_MODE"] = "1"
    cfg["engine"]["drain_timeout_s"] = 20.0
    cfg["proxy"] = {"enabled": True, "listen": f"127.0.0.1:{free_port()}",
                    "max_concurrency": 16, "hold_timeout_s": 240.0}
    cfg["canary"] = {"period_s": 2.0, "timeout_s": 5.0}
    cfg["policy"] = {"min_action_gap_s": 0}
    cfg["policy.rules.ladder_throttle"] = {
        "when": ALWAYS, "action": "throttle", "cooldown_s": 3600, "clear_when": NEVER}
    cfg["policy.rules.ladder_cache"] = {
        "when": ALWAYS, "action": "reset_prefix_cache", "cooldown_s": 8,
        "clear_when": NEVER}
    d = Daemon(tmp_path, cfg)
    seen: list[int] = []
    codes: list[int] = []
    stop = threading.Event()
    proxy = f"http://{cfg['proxy']['listen']}/v1/completions"

    def client() -> None:
        while not stop.is_set():
            try:
                r = httpx.post(proxy, timeout=300, json={
                    "model": "tiny-llama", "prompt": "hello", "max_tokens": 16})
                codes.append(r.status_code)
            except httpx.HTTPError:
                codes.append(-1)

    try:
        st = d.wait_state("RUNNING", START_TIMEOUT)
        seen += [p.pid for p in tree(st["pid"])]
        threads = [threading.Thread(target=client, daemon=True) for _ in range(3)]
        for t in threads:
            t.start()
        wait_for(lambda: any(e["event"] == "decision" and e["action"] == "restart"
                             for e in d.events()), 120, "the climb to a restart")
        # the new engine would climb on (reduced batch, then an alert): stop it here
        assert d.ctl("pause-policy").returncode == 0
        st = d.wait_state("RUNNING", START_TIMEOUT, extra=lambda s: s["restarts"] == 1)
        seen += [p.pid for p in tree(st["pid"])]
        wait_for(lambda: len(codes) >= 20, 120, "requests on the new engine")
        stop.set()
        for t in threads:
            t.join(300)

        decisions = [(e["rule"], e["action"], e["reason"]) for e in d.events()
                     if e["event"] == "decision"]
        assert [(r, a) for r, a, _ in decisions[:4]] == [
            ("ladder_throttle", "throttle"), ("ladder_cache", "reset_prefix_cache"),
            ("ladder_cache", "kv_reset"), ("ladder_cache", "restart")]
        assert "after kv_reset" in decisions[3][2]
        remedies = d.remedies()
        # each rung tried is one entry: rung, outcome, duration
        assert [(e["rung"], e["outcome"]) for e in remedies[:4]] == [
            ("throttle", "ok"), ("reset_prefix_cache", "ok"), ("kv_reset", "ok"),
            ("restart", "ok")], remedies
        assert remedies[0]["throttle_level"] == 1
        assert "reset_prefix_cache" in remedies[1]["steps_s"]  # the real engine answered 200
        # the real engine paused (its requests aborted, its caches cleared), found
        # holding no block, resumed, and answered a canary: no sleep on CPU
        kv = remedies[2]
        assert list(kv["steps_s"]) == ["drain", "pause", "check", "resume", "canary"], kv
        assert kv["vllm_version"] and kv["error"] is None, kv
        restart = remedies[3]
        assert list(restart["steps_s"]) == ["drain", "take_down", "start"]
        assert st["throttle_level"] == 1  # live at the proxy: not lifted by the restart
        assert st["admission"]["max_concurrency"] == 12  # 16 x 0.75
        assert st["remedies"]["kv_reset"] is True and st["remedies"]["kv_reset_by"] == "pause"
        assert st["remedies"]["kv_reset_unavailable"] is None
        # dev mode on: the real engine serves every development route (a GET of a POST
        # one refused with 405), so the prefix-cache reset and the pause are on
        assert st["dev_routes"] == dict.fromkeys(
            ("/reset_prefix_cache", "/sleep", "/wake_up", "/is_sleeping", "/pause",
             "/resume", "/is_paused"), True)
        assert st["off"] == {}, st["off"]
        assert st["remedies"]["reset_prefix_cache"] is True
        probed = [e for e in d.events(1000) if e["event"] == "dev_routes"]
        assert len(probed) == 2 and all(e["off"] == {"sleep": "the engine was not started "
                                                             "with --enable-sleep-mode"}
                                        for e in probed), probed
        assert codes and all(c == 200 for c in codes), sorted(set(codes))
        print("ladder:", {"decisions": [(r, a) for r, a, _ in decisions],
                          "prefix_reset_s": remedies[1]["duration_s"],
                          "kv_reset_s": kv["duration_s"], "kv_reset_held": kv["held"],
                          "restart_s": restart["duration_s"], "held": restart["held"],
                          "requests": len(codes)})
        r = d.ctl("stop", timeout=120)
        assert r.returncode == 0 and d.wait_exit(60) == 0
        assert alive(seen) == []
    finally:
        stop.set()
        d.close()
