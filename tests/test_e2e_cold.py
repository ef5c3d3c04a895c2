"""End-to-end: the first start of the real engine with nothing compiled (issue 48).

On a fresh machine the daemon once killed a healthy engine: the first request asking for
log-probabilities (its own golden check's) made vLLM compile a sampler helper for 10-20 s
on two cores, the client's request joined that step, the engine's counters stood still,
and the progress rule restarted it. This engine gets caches of its own, empty (vLLM's
root, torch inductor's and its precompiled headers, Triton's, `~/.cache`), and the
demo's watchdog settings; a client asks the moment the daemon starts, as the README's
curl does. Both directions: no decision while it warms and serves, and then a real hang
of this fresh engine (its core stopped under a client's request) caught by the progress
rule itself, not by a slower one.

With `canary.warm_up = false` (the code before the fix, as far as this test goes) the
client's answer comes from a second engine and `no_progress` is in the audit.
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from tests.harness import Daemon, cache_env, free_port, wait_for
from tests.test_e2e_vllm import START_TIMEOUT, vllm_config

pytestmark = pytest.mark.e2e


def ask(proxy: str, body: dict[str, Any], timeout: float) -> httpx.Response:
    return httpx.post(f"{proxy}/v1/completions", timeout=timeout,
                      json={"model": "tiny-llama", **body})


def core_of(pid: int) -> int:
    cores = [p.pid for p in psutil.Process(pid).children(recursive=True)
             if p.name().startswith("VLLM::EngineCor")]
    assert len(cores) == 1, cores
    return cores[0]


def test_a_cold_engine_is_warmed_before_clients_and_a_hang_is_still_caught(tmp_path):
    own = Path(tempfile.mkdtemp(prefix="vsc-", dir="/tmp"))  # (short: vLLM's sockets)
    for sub in ("vllm", "inductor", "triton", "xdg", "tmp"):
        (own / sub).mkdir()
    cfg = vllm_config(tmp_path)
    cfg["engine"]["env"].update(cache_env(own))
    proxy_listen = f"127.0.0.1:{free_port()}"
    cfg["proxy"] = {"enabled": True, "listen": proxy_listen, "hold_timeout_s": 600.0}
    cfg["canary"] = {"period_s": 10.0, "timeout_s": 5.0}  # (the demo's config.toml)
    proxy = f"http://{proxy_listen}"
    d = Daemon(tmp_path, cfg)
    try:
        # the README's curl, the moment the daemon listens: held until the engine is
        # proven
        d.wait_state("STARTING", 30)
        r = ask(proxy, {"prompt": "hello", "max_tokens": 8}, START_TIMEOUT + 300)
        assert r.status_code == 200, r.text
        first = d.status()
        assert first["state"] == "RUNNING" and first["restarts"] == 0, first
        pid = first["pid"]
        # clients that ask what the warm-up warmed: log-probabilities, several choices
        for i in range(6):
            r = ask(proxy, {"prompt": f"client {i}", "max_tokens": 16, "logprobs": 3,
                            "n": 1 + i % 2, "temperature": 0.5}, 120)
            assert r.status_code == 200, r.text
        warmed = [e for e in d.events() if e["event"] == "paths_warmed"]
        assert len(warmed) == 1 and warmed[0]["ok"] is True, warmed
        paths = warmed[0]["paths"]
        assert paths["logprobs"]["answer"] == "200", paths
        print("warm-up:", {k: v["s"] for k, v in paths.items()})
        # the progress rule judged it all along (scrapes every 2 s): one more period of
        # looks, and still no decision, no restart, the same engine
        time.sleep(12)
        st = d.status()
        assert d.decisions() == [], d.decisions()
        assert st["restarts"] == 0 and st["pid"] == pid, st

        # the other direction: this fresh engine's core stopped under a client's request
        core = core_of(pid)
        answers: list[httpx.Response | BaseException] = []

        def client() -> None:
            try:
                answers.append(ask(proxy, {"prompt": "after the hang", "max_tokens": 8},
                                   START_TIMEOUT + 120))
            except BaseException as exc:  # (reaches the test below)
                answers.append(exc)

        os.kill(core, signal.SIGSTOP)
        stopped_at = time.time()
        t = threading.Thread(target=client)
        t.start()
        decision = wait_for(lambda: (ds := d.decisions()) and ds[0], 120,
                            "a decision about the stopped core")
        print("hang caught by", decision["rule"], "after",
              round(time.time() - stopped_at, 1), "s (at most); evidence",
              decision["evidence"])
        assert decision["rule"] == "no_progress", decision
        assert decision["action"] == "restart_now", decision
        t.join(START_TIMEOUT + 150)
        assert not t.is_alive(), "the client's request never ended"
        assert len(answers) == 1 and isinstance(answers[0], httpx.Response), answers
        assert answers[0].status_code == 200, answers[0].text  # held through the restart
        after = d.wait_state("RUNNING", START_TIMEOUT, lambda s: s["pid"] != pid)
        assert after["restarts"] == 1, after
        assert len(d.decisions()) == 1, d.decisions()
    finally:
        d.close()  # (its engines' groups, a stopped core's included: SIGKILL ends it)
        shutil.rmtree(own, ignore_errors=True)
