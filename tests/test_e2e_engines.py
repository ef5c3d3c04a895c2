"""End-to-end: two real vLLM CPU engines under one daemon, the tiny model served under two
names, the second engine the first one's fallback.

Under a small steady load on both names, SIGKILL of the primary's `VLLM::EngineCore`:
requests for the primary's model are answered by the fallback (its model name put in the
request, its name in `X-Supervisor-Engine`) until the primary is back; no request fails.
`status` and the exporter show both engines. The figures (requests, failures, time from
the crash to the fallback's first answer, the primary's time back, the daemon's RSS with
two engines) are written to `e2e-engines.json` in the test's directory and printed.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.harness import Daemon, alive, free_port, wait_for
from tests.test_e2e_vllm import START_TIMEOUT, tree, vllm_config

pytestmark = pytest.mark.e2e


def two_engines(tmp: Path) -> dict[str, Any]:
    cfg: dict[str, Any] = vllm_config(tmp)
    engine = cfg.pop("engine")
    # vLLM's CPU backend pins its worker to cores ("auto": core 0 for both engines here;
    # "0" and "1": each engine's core process then lands on the other's worker's core),
    # and on this machine a busy worker starved the other engine's restart on its core
    # for minutes: no pinning and one compute thread each (config.two-engines.toml too)
    cpu = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}
    # eager, as the demo: the first requests after a start once took 5.3 s for 8 tokens
    # (a sampler helper compiled at the first log-probabilities) and the progress rule
    # restarted both engines; the proof's warm-up now takes that step before clients
    # come (issue 48)
    args = engine["args"]
    primary = {**engine, "port": free_port(), "fallback": "fallback", "args": args,
               "env": {**engine["env"], **cpu}}
    fallback = {**engine, "port": free_port(),
                "args": ["--served-model-name", "tiny-llama-fallback", *args[2:]],
                "env": {**engine["env"], **cpu}}
    cfg["engines.primary"] = primary
    cfg["engines.fallback"] = fallback
    cfg["proxy"] = {"enabled": True, "listen": f"127.0.0.1:{free_port()}",
                    "hold_timeout_s": 240.0}
    cfg["canary"] = {"period_s": 2.0, "timeout_s": 10.0}
    return cfg


def lines(d: Daemon) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in d.status()["engines"]}


def test_a_fallback_engine_answers_while_the_primary_core_is_killed(tmp_path):
    cfg = two_engines(tmp_path)
    d = Daemon(tmp_path, cfg)
    seen: list[int] = []
    try:
        wait_for(lambda: all(e["serving"] for e in lines(d).values()), 2 * START_TIMEOUT,
                 "both engines to serve", interval=1.0)
        for e in lines(d).values():
            seen += [p.pid for p in tree(e["pid"])]
        url = f"http://{cfg['proxy']['listen']}/v1/completions"
        results: list[tuple[str, int, str, float]] = []
        stop = threading.Event()

        def client(model: str) -> None:
            with httpx.Client(timeout=300) as c:
                while not stop.is_set():
                    try:
                        r = c.post(url, json={"model": model, "prompt": "hello there",
                                              "max_tokens": 8})
                        # a whole answer (the random tiny model may well say "" or stop)
                        ok = r.status_code == 200 and \
                            r.json()["choices"][0]["finish_reason"] in ("length", "stop")
                        results.append((model, r.status_code if ok else -r.status_code,
                                        r.headers.get("x-supervisor-engine", ""),
                                        time.monotonic()))
                    except httpx.HTTPError as exc:
                        results.append((model, 0, repr(exc), time.monotonic()))
                    time.sleep(0.2)

        threads = [threading.Thread(target=client, args=(m,))
                   for m in ("tiny-llama", "tiny-llama", "tiny-llama-fallback")]
        for t in threads:
            t.start()
        try:
            # (killed 1.3 s after its first /health, a core's VLLM::Worker once outlived
            # SIGKILL for 30 s here, and the daemon rightly refused to start over it: the
            # crash comes once the primary has served a few requests of the load)
            wait_for(lambda: sum(r[2] == "primary" for r in results) >= 5, 120,
                     "the primary to serve the load")
            primary = lines(d)["primary"]
            core = next(p for p in tree(primary["pid"])
                        if p.name().startswith("VLLM::EngineCor"))
            killed_at = time.monotonic()
            os.kill(core.pid, signal.SIGKILL)
            wait_for(lambda: lines(d)["primary"]["restarts"] >= 1, 60, "the primary to restart")
            wait_for(lambda: lines(d)["primary"]["serving"], START_TIMEOUT,
                     "the primary to serve again", interval=0.5)
            back_at = time.monotonic()
            wait_for(lambda: any(r[2] == "primary" and r[3] > back_at for r in results), 60,
                     "an answer from the primary again")
        finally:
            stop.set()
            for t in threads:
                t.join(timeout=300)
        for e in lines(d).values():
            seen += [p.pid for p in tree(e["pid"])]
        failed = [r for r in results if r[1] != 200]
        mine = [r for r in results if r[0] == "tiny-llama"]
        by_fallback = [r for r in mine if r[2] == "fallback" and r[3] > killed_at]
        rss = psutil.Process(d.pid).memory_info().rss
        figures = {
            "requests": len(results), "failed": len(failed),
            "primary_model_requests": len(mine),
            "answered_by_fallback": len(by_fallback),
            "crash_to_first_fallback_answer_s": (round(by_fallback[0][3] - killed_at, 3)
                                                 if by_fallback else None),
            "primary_back_after_s": round(back_at - killed_at, 3),
            "daemon_rss_mib": round(rss / 2**20, 1),
        }
        (tmp_path / "e2e-engines.json").write_text(json.dumps(figures, indent=2))
        print("\ntwo engines:", json.dumps(figures))
        assert not failed, failed[:5]
        assert by_fallback, "no request for the primary's model was answered by the fallback"
        assert all(r[2] == "fallback" for r in results if r[0] == "tiny-llama-fallback")
        st = lines(d)
        assert st["fallback"]["restarts"] == 0 and st["fallback"]["state"] == "RUNNING"

        text = httpx.get(d.exporter_url + "/metrics", timeout=10).text
        m = {(s.name, tuple(sorted(s.labels.items()))): s.value
             for f in text_string_to_metric_families(text) for s in f.samples}
        assert m[("vllm_supervisor_engine_restarts_total",
                  (("engine", "primary"), ("reason", "crash")))] == 1
        assert m[("vllm_supervisor_engine_state",
                  (("engine", "fallback"), ("state", "RUNNING")))] == 1
        out = d.ctl("status").stdout
        assert "primary" in out.splitlines()[1] and "tiny-llama (-> fallback)" in out
    finally:
        d.close()
        for pid in alive(seen):
            os.kill(pid, signal.SIGKILL)
