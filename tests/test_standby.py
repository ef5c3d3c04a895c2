"""The standby through the real daemon, its proxy and fake engines: a crash of the serving
engine and an operator's restart each hand the engine's requests to the standby that
was kept loaded beside it, with no cold start: streams in flight go on token-exact,
a new request is answered at once, and a new standby is proven in the old one's place.
(The real engine's run: tests/test_e2e_standby.py.)"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from tests.fake_engine import prompt_ids
from tests.harness import wait_for
from tests.test_continuation_proxy import Seen, comp, expected_text, metrics, run
from tests.test_proxy import proxy_config, url

N = 150  # tokens a stream; 3 s at 0.02 s a token: in flight at the fault


def standby_ready(d: Any) -> bool:
    return d.status()["standby"]["state"] == "ready"


def streams_under(cfg: dict[str, Any], fault: Any) -> float:
    """Four streams; `fault()` once each has tokens; then one new request, timed (s).
    Every stream must end whole and token-exact."""
    results: list[Seen | None] = [None] * 4
    started = [threading.Event() for _ in results]

    def one(i: int) -> None:
        results[i] = run(cfg, comp(prompt=f"stream {i}", max_tokens=N), started=started[i])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(results))]
    for t in threads:
        t.start()
    for e in started:
        assert e.wait(30), "a stream never started"
    fault()
    t0 = time.monotonic()
    r = httpx.post(url(cfg), json={"model": "fake", "prompt": "new", "max_tokens": 2},
                   timeout=30)
    answered_s = time.monotonic() - t0
    assert r.status_code == 200, r.text
    for t in threads:
        t.join(60)
    seen = [s for s in results if s is not None]
    assert len(seen) == 4
    for i, s in enumerate(seen):
        assert s.complete, s
        assert "".join(s.texts) == expected_text(prompt_ids({"prompt": f"stream {i}"}, False), N)
        assert s.usage is not None and s.usage["completion_tokens"] == N
    return answered_s


def test_a_crash_and_a_restart_each_hand_over_to_the_standby(daemon_factory, tmp_path):
    cfg = proxy_config(tmp_path, "--token-delay", "0.02", keepalive_s=0.5)
    cfg["engine"].update(standby="awake", drain="continue")
    d = daemon_factory(cfg)
    d.wait_state("RUNNING")
    wait_for(lambda: standby_ready(d), 30, "the standby ready")
    first = d.status()
    spare_pid = first["standby"]["pid"]
    assert first["standby"]["port"] == cfg["engine"]["port"] + 1

    # SIGKILL of the serving engine's main process
    answered_s = streams_under(cfg, lambda: os.kill(first["pid"], signal.SIGKILL))
    st = d.status()
    assert st["state"] == "RUNNING" and st["pid"] == spare_pid and st["restarts"] == 1
    assert st["last_decision"]["action"] == "failover"
    assert answered_s < 5, answered_s  # no cold start to wait for
    log = d.log_records()
    waited = [e["waited_s"] for e in log if e.get("event") == "stream continued"]
    assert len(waited) == 4 and max(waited) < 5, waited
    wait_for(lambda: standby_ready(d) and d.status()["standby"]["pid"] != spare_pid, 30,
             "a new standby in the old engine's place")
    assert d.status()["standby"]["port"] == cfg["engine"]["port"]
    m = metrics(cfg)
    assert m[("vllm_supervisor_standby_ready", ())] == 1
    assert m[("vllm_supervisor_failovers_total", ())] == 1
    assert 0 < m[("vllm_supervisor_last_failover_seconds", ())] < 5

    # an operator's restart under the same load: paused streams go on on the standby
    second = d.status()
    answered_s = streams_under(
        cfg, lambda: d.ctl("restart", "--reason", "standby test").check_returncode())
    st = wait_for(lambda: (s := d.status())["state"] == "RUNNING" and s, 20, "RUNNING")
    assert st["pid"] == second["standby"]["pid"] and st["restarts"] == 2
    assert answered_s < 5, answered_s
    audit = [json.loads(line) for line in
             Path(cfg["audit"]["path"]).read_text().splitlines() if line.strip()]
    states = [e for e in audit if e.get("event") == "state"]
    assert [e["to"] for e in states].count("STARTING") == 1  # the first start alone
    m = metrics(cfg)
    assert m[("vllm_supervisor_proxy_continuations_total", (("outcome", "continued"),))] >= 4
    wait_for(lambda: standby_ready(d), 30, "a standby again")
