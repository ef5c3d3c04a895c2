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
import psutil
import pytest

from tests.continuation_streams import Seen, comp, expected_text, metrics, run
from tests.fake_tokens import prompt_ids
from tests.harness import wait_for
from tests.test_e2e_prometheus import NEEDS_STANDBY
from tests.test_e2e_vllm import NGRAM
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
    assert first["standby"]["bay"] == "healthy"  # (its process's phase: started, alive)

    # SIGKILL of the serving engine's main process
    answered_s = streams_under(cfg, lambda: os.kill(first["pid"], signal.SIGKILL))
    st = d.status()
    assert st["state"] == "RUNNING" and st["pid"] == spare_pid and st["restarts"] == 1
    assert st["last_decision"]["action"] == "failover"
    print(f"a new request answered {answered_s:.2f} s after the kill")
    log = d.log_records()
    # no cold start to wait for: the one state change to STARTING was the first start
    assert [e.get("to") for e in log].count("STARTING") == 1
    waited = [e["waited_s"] for e in log if e.get("event") == "stream continued"]
    assert len(waited) == 4, waited
    wait_for(lambda: standby_ready(d) and d.status()["standby"]["pid"] != spare_pid, 30,
             "a new standby in the old engine's place")
    assert d.status()["standby"]["port"] == cfg["engine"]["port"]
    m = metrics(cfg)
    assert m[("vllm_supervisor_standby_ready", ())] == 1
    assert m[("vllm_supervisor_failovers_total", ())] == 1
    assert m[("vllm_supervisor_last_failover_seconds", ())] > 0
    # the dashboard's standby panels read these (the e2e Prometheus daemon has no standby)
    assert {name for name, _ in m} >= set(NEEDS_STANDBY)

    # an operator's restart under the same load: paused streams go on on the standby
    second = d.status()
    answered_s = streams_under(
        cfg, lambda: d.ctl("restart", "--reason", "standby test").check_returncode())
    st = wait_for(lambda: (s := d.status())["state"] == "RUNNING" and s, 20, "RUNNING")
    assert st["pid"] == second["standby"]["pid"] and st["restarts"] == 2
    print(f"a new request answered {answered_s:.2f} s after the restart")
    audit = [json.loads(line) for line in
             Path(cfg["audit"]["path"]).read_text().splitlines() if line.strip()]
    states = [e for e in audit if e.get("event") == "state"]
    assert [e["to"] for e in states].count("STARTING") == 1  # the first start alone
    m = metrics(cfg)
    assert m[("vllm_supervisor_proxy_continuations_total", (("outcome", "continued"),))] >= 4
    wait_for(lambda: standby_ready(d), 30, "a standby again")


def test_a_restart_with_drain_finish_swaps_at_once_and_the_old_engine_finishes_its_streams(
        daemon_factory, tmp_path):
    """`drain = "finish"` (the default) with an awake standby: an operator's restart
    under four streams does not hold new requests behind them; a request sent just
    after it is answered by the standby while the streams are still running, and they
    end whole on the old engine, never broken nor continued; then the old engine is
    taken down and a new standby is proven in its place."""
    cfg = proxy_config(tmp_path, "--token-delay", "0.02", keepalive_s=0.5)
    cfg["engine"].update(standby="awake", drain="finish", drain_timeout_s=60)
    d = daemon_factory(cfg)
    d.wait_state("RUNNING")
    wait_for(lambda: standby_ready(d), 30, "the standby ready")
    before = d.status()
    results: list[Seen | None] = [None] * 4
    ended = [0.0] * 4
    started = [threading.Event() for _ in results]

    def one(i: int) -> None:
        results[i] = run(cfg, comp(prompt=f"stream {i}", max_tokens=N), started=started[i])
        ended[i] = time.monotonic()

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(results))]
    for t in threads:
        t.start()
    for e in started:
        assert e.wait(30), "a stream never started"
    d.ctl("restart", "--reason", "swap test").check_returncode()
    r = httpx.post(url(cfg), json={"model": "fake", "prompt": "new", "max_tokens": 2},
                   timeout=30)
    answered = time.monotonic()
    assert r.status_code == 200, r.text
    assert d.status()["pid"] == before["standby"]["pid"]  # the standby serves now
    for t in threads:
        t.join(60)
    assert answered < min(ended), (answered, ended)  # not held behind the streams
    for i, s in enumerate(results):
        assert s is not None and s.complete, s
        assert "".join(s.texts) == expected_text(prompt_ids({"prompt": f"stream {i}"}, False), N)
    m = metrics(cfg)
    assert m.get(("vllm_supervisor_proxy_continuations_total", (("outcome", "continued"),)),
                 0) == 0  # none broken: they ended where they began
    drained = wait_for(lambda: [e for e in d.log_records()
                                if e.get("event") == "swap: the old engine drained"], 20,
                       "the old engine drained")
    assert drained[0]["pid"] == before["pid"]
    wait_for(lambda: standby_ready(d) and d.status()["standby"]["pid"] != before["pid"], 30,
             "a new standby in the old engine's place")


def sleep_config(tmp_path: Path, *fake: str) -> dict[str, Any]:
    cfg = proxy_config(tmp_path, "--token-delay", "0.02", "--enable-sleep-mode",
                       "--gpu-memory-utilization", "0.45", *fake, keepalive_s=0.5)
    cfg["engine"].update(standby="sleep", drain="continue",
                         env={**cfg["engine"].get("env", {}), "VLLM_SERVER_DEV_MODE": "1"})
    return cfg


def test_a_core_crash_wakes_the_sleeping_standby_and_streams_go_on_there(daemon_factory,
                                                                          tmp_path):
    """`standby = "sleep"`: the standby is proven, put to sleep (vLLM's /sleep), and on
    a SIGKILL of the serving engine's core (its API server still up) woken and proven
    before anything else reaches it; the streams go on on it token-exact."""
    cfg = sleep_config(tmp_path)
    d = daemon_factory(cfg)
    d.wait_state("RUNNING")
    wait_for(lambda: standby_ready(d), 30, "the standby ready")
    first = d.status()
    assert first["standby"]["asleep"] is True
    spare_pid = first["standby"]["pid"]
    sleeps = (tmp_path / "sleeps").read_text().split()
    # the standby put to sleep once, the engine once (its warm-up sleep and wake before
    # it served), each with nothing running on it
    assert sleeps == ["0", "0"]
    main, core = d.engine_pids()[:2]
    assert main == first["pid"]
    answered_s = streams_under(cfg, lambda: os.kill(core, signal.SIGKILL))
    st = d.status()
    assert st["state"] == "RUNNING" and st["pid"] == spare_pid
    print(f"a new request answered {answered_s:.2f} s after the kill")
    audit = [json.loads(line) for line in
             Path(cfg["audit"]["path"]).read_text().splitlines() if line.strip()]
    names = [e["event"] for e in audit]
    assert names.index("core_exit") < names.index("failover") \
        < names.index("standby_woken") < names.index("failover_done")
    # the host's OOM kills read at each look at the tree and as the core's death was
    # seen (/proc/vmstat, for real): none between them, so not the OOM killer's doing
    if os.path.exists("/proc/vmstat"):
        assert next(e for e in audit if e["event"] == "core_exit")["oom_killed"] is False
    # nothing but the daemon's own calls reached the standby before its wake
    woke = next(e for e in audit if e["event"] == "standby_woken")
    assert woke["pid"] == spare_pid
    # beside the daemon's own seconds, what vLLM measured (its sleep-mode histogram): the
    # standby's sleep in its `standby_ready`, this wake alone in `standby_woken`
    slept = next(e for e in audit if e["event"] == "standby_ready" and e["pid"] == spare_pid)
    assert list(slept["vllm_s"]) == ["sleep"] and 0 < slept["vllm_s"]["sleep"] <= slept["sleep_s"]
    assert list(woke["vllm_s"]) == ["wake"] and 0 < woke["vllm_s"]["wake"] <= woke["seconds"]
    wait_for(lambda: standby_ready(d) and d.status()["standby"]["pid"] != spare_pid, 30,
             "a new standby, asleep, in the old engine's place")
    assert d.status()["standby"]["asleep"] is True


def test_a_standby_that_does_not_wake_falls_back_to_a_cold_start(daemon_factory,
                                                                  tmp_path):
    fault = tmp_path / "wake-fault"
    cfg = sleep_config(tmp_path, "--wake-fault-file", str(fault))
    d = daemon_factory(cfg)
    d.wait_state("RUNNING")
    wait_for(lambda: standby_ready(d), 30, "the standby ready")
    wait_for(lambda: any(e["event"] == "warmed_up" for e in d.events()), 10, "warmed up")
    fault.write_text("fail")  # (the engine's warm-up wake went well)
    first = d.status()
    streams_under(cfg, lambda: os.kill(first["pid"], signal.SIGKILL))
    audit = [json.loads(line) for line in
             Path(cfg["audit"]["path"]).read_text().splitlines() if line.strip()]
    failed = next(e for e in audit if e["event"] == "failover_failed")
    assert "did not wake" in failed["reason"]
    st = wait_for(lambda: (s := d.status())["state"] == "RUNNING" and s, 30, "RUNNING")
    assert st["pid"] not in (first["pid"], first["standby"]["pid"])  # a cold start


def test_rearm_brings_the_standby_back_after_a_failover_on_a_full_card(daemon_factory,
                                                                       tmp_path):
    """Both engines at 0.88 (the standby first, asleep): after a failover none fits
    beside the engine that took over, and `status` says unprotected; `rearm` brings one
    back through a drained restart that starts it first, holding (not failing) the
    requests meanwhile; once armed, `rearm` is refused, saying why."""
    cfg = proxy_config(tmp_path, "--token-delay", "0.02", "--enable-sleep-mode",
                       "--gpu-memory-utilization", "0.88", keepalive_s=0.5)
    cfg["engine"].update(standby="sleep", drain="continue",
                         env={**cfg["engine"].get("env", {}), "VLLM_SERVER_DEV_MODE": "1"})
    d = daemon_factory(cfg)
    d.wait_state("RUNNING")
    wait_for(lambda: standby_ready(d), 30, "the standby ready")
    assert d.status()["standby"]["protected"] is True
    core = d.engine_pids()[1]
    os.kill(core, signal.SIGKILL)
    st = wait_for(lambda: (s := d.status())["standby"]["state"] == "no_room"
                  and s["admission"]["held"] is None and s, 30, "the failover, then no room")
    assert st["standby"]["protected"] is False and "0.88" in st["standby"]["reason"]
    assert "protected  no, for" in d.ctl("status").stdout
    r = d.ctl("rearm")
    assert r.returncode == 0 and "re-arming: drained restart" in r.stdout, r.stderr
    held = httpx.post(url(cfg), json={"model": "fake", "prompt": "hi", "max_tokens": 2},
                      timeout=60)
    assert held.status_code == 200  # held through the re-arm, not refused
    wait_for(lambda: standby_ready(d) and d.status()["state"] == "RUNNING", 60,
             "the standby ready again")
    assert d.status()["standby"]["protected"] is True
    again = d.ctl("rearm")
    assert again.returncode == 1 and "already protected" in again.stderr
    rearms = [e for e in d.events() if e["event"] == "rearm"]
    assert [e["how"] for e in rearms] == ["restart"]


def test_an_asymmetric_pair_is_protected_again_after_each_of_three_core_kills(
        daemon_factory, tmp_path):
    """`standby_args` (a thin standby at 0.28 beside an engine at 0.60): three SIGKILLs
    of the serving core, each once protected again. Each time the thin one is woken and
    carries the streams (token-exact, a new request answered), a full-size engine starts
    beside it and takes over again (a swap: streams paused and continued), and the thin
    one sleeps again: no cold start held anyone, and no `rearm` was needed. What each
    carries (its KV cache in tokens, as its core said) is in status and the exporter."""
    cfg = proxy_config(tmp_path, "--token-delay", "0.02", "--enable-sleep-mode",
                       "--gpu-memory-utilization", "0.60", "--kv-tokens", "100000",
                       keepalive_s=0.5)
    cfg["engine"].update(standby="sleep", drain="continue",
                         standby_args=["--gpu-memory-utilization", "0.28",
                                       "--kv-tokens", "20000"],
                         env={**cfg["engine"].get("env", {}), "VLLM_SERVER_DEV_MODE": "1"})
    d = daemon_factory(cfg)
    d.wait_state("RUNNING")

    def protected() -> dict[str, Any] | None:
        st = d.status()
        sb = st["standby"]
        return st if (st["state"] == "RUNNING" and sb["protected"] and sb["thin"]
                      and not sb["thin_serves"] and st["admission"]["held"] is None) else None

    st = wait_for(protected, 30, "the thin standby ready")
    thin = st["standby"]["pid"]
    assert (st["engine"]["kv_tokens"], st["standby"]["kv_tokens"]) == (100_000, 20_000)
    m = metrics(cfg)
    assert m[("vllm_supervisor_engine_kv_cache_tokens", ())] == 100_000
    assert m[("vllm_supervisor_standby_kv_cache_tokens", ())] == 20_000
    for kill in range(3):
        full = st["pid"]
        core = psutil.Process(full).children()[0].pid  # (--child: its core)
        answered_s = streams_under(cfg, lambda core=core: os.kill(core, signal.SIGKILL))
        st = wait_for(lambda full=full: (s := protected()) and s["pid"] != full and s, 60,
                      f"protected again after kill {kill + 1}")
        print(f"kill {kill + 1}: a new request answered in {answered_s:.2f} s")
        assert st["standby"]["pid"] == thin  # the same thin engine, asleep again
        assert st["standby"]["asleep"] is True
    names = [e["event"] for e in d.events()]
    assert names.count("failover") == 6  # each kill: to the thin one, and back
    assert "rearm" not in names and "standby_failed" not in names
    ready = [e for e in d.events() if e["event"] == "standby_ready"]
    # the thin one started once, ready again after each return; each full-size engine
    # of a re-arm ready once before it took over
    assert sum(e["pid"] == thin for e in ready) == 4 and len(ready) == 7


@pytest.mark.parametrize("broken", ["wrong", "drafts"])
def test_a_standby_that_wakes_answering_otherwise_is_refused_by_the_golden_check(
        daemon_factory, tmp_path, broken):
    """The golden check through the real daemon and fake engines that give vLLM-shaped
    log-probabilities: the serving engine's first proof records the baseline, the
    standby's matches it before it sleeps; once woken after a core SIGKILL it answers
    other tokens (`wrong`), or the same tokens with its speculative decoding's drafts
    never accepted any more (`drafts`: vllm#52487's zeroed draft weights), so nothing is
    sent to it: a cold start serves instead, every stream whole, and the audit holds the
    evidence."""
    fault = tmp_path / "wake-fault"
    cfg = sleep_config(tmp_path, "--logprobs", "--wake-fault-file", str(fault),
                       "--spec-acceptance", "0.6", "--speculative-config", NGRAM)
    d = daemon_factory(cfg)
    d.wait_state("RUNNING")
    wait_for(lambda: standby_ready(d), 30, "the standby ready")
    # the engine's answers after its warm-up wake, and the standby's, matched
    st = wait_for(lambda: (s := d.status())["golden"]["passed"] == 2 and s, 30,
                  "both proofs")
    assert st["golden"]["baselines"] == 1 and st["golden"]["mismatches"] == 0
    assert st["golden"]["last"]["acceptance"] == 0.6  # (the baseline's too)
    fault.write_text(broken)  # (the engine's warm-up wake went well)
    spare = st["standby"]["pid"]
    core = psutil.Process(st["pid"]).children()[0].pid
    streams_under(cfg, lambda: os.kill(core, signal.SIGKILL))
    back = wait_for(lambda: (s := d.status())["state"] == "RUNNING"
                    and s["admission"]["held"] is None and s, 60, "served again")
    assert back["pid"] != spare  # not the woken standby: a cold start
    events = d.events()
    mismatch = next(e for e in events if e["event"] == "golden_mismatch")
    assert mismatch["pid"] == spare
    if broken == "wrong":
        assert "token 0" in mismatch["why"]
        assert mismatch["expected"]["completion"]["ids"] \
            != mismatch["got"]["completion"]["ids"]
    else:
        assert mismatch["why"].startswith("speculative decoding accepted 0.0% of its "
                                          "draft tokens, the baseline 60.0%"), mismatch
        assert mismatch["expected"]["acceptance"] == 0.6
        assert mismatch["got"]["acceptance"] == 0.0
        assert mismatch["expected"]["completion"] == mismatch["got"]["completion"]
    failed = next(e for e in events if e["event"] == "failover_failed")
    assert "golden check failed" in failed["reason"]
    # (the cold-started engine meets the same fault at its warm-up wake, before it
    # serves: restarted once more, and then not put to sleep)
    golden = d.status()["golden"]
    assert golden["mismatches"] in (1, 2)
    m = metrics(cfg)  # on the exporter, for the alert (VLLMGoldenMismatch)
    assert m[("vllm_supervisor_golden_checks_total", (("verdict", "mismatch"),))] \
        == golden["mismatches"]
    assert m[("vllm_supervisor_golden_checks_total", (("verdict", "passed"),))] \
        == golden["passed"] >= 2


@pytest.mark.parametrize("free_gib", [20, 2], ids=["room_for_the_weights", "no_room"])
def test_a_kill_on_a_full_card_wakes_the_standbys_weights_while_the_old_engine_goes(
        daemon_factory, tmp_path, free_gib):
    """Both engines at 0.88 (the standby first, asleep; its sleep says 4 GiB of weights
    backed up). NVML's reading (scripted) leaves `free_gib` free with the engine serving:
    with room for the weights and the margin, a core SIGKILL wakes the standby's weights
    at once (`/wake_up?tags=weights`) and the rest once the old tree is gone
    (`tags=kv_cache`); without room, the whole standby once the old tree is gone. The
    streams go on whole either way."""
    gpu = tmp_path / "gpu.json"
    gpu.write_text(json.dumps({"memory_used_bytes": (80 - free_gib) * 2**30,
                               "memory_total_bytes": 80 * 2**30}))
    cfg = proxy_config(tmp_path, "--token-delay", "0.02", "--enable-sleep-mode",
                       "--gpu-memory-utilization", "0.88", "--weights-gib", "4",
                       keepalive_s=0.5)
    cfg["engine"].update(standby="sleep", drain="continue",
                         env={**cfg["engine"].get("env", {}), "VLLM_SERVER_DEV_MODE": "1"})
    cfg["gpu"] = {"sampler": "file", "file": str(gpu), "period_s": 0.5}
    d = daemon_factory(cfg)
    d.wait_state("RUNNING")
    wait_for(lambda: standby_ready(d), 30, "the standby ready")
    wait_for(lambda: any(e["event"] == "warmed_up" for e in d.events()), 10, "warmed up")
    spare = d.status()["standby"]["pid"]
    wakes = tmp_path / "wakes"
    assert wakes.read_text().split() == ["all"]  # (the engine's warm-up: a whole wake)
    # (a reading of the card with the engine serving, every 0.5 s: status says what a
    # failover would do now)
    wait_for(lambda: d.status()["standby"]["early_wake"] is (free_gib == 20), 10,
             "status to say whether the weights would wake early")
    pids = d.engine_pids()  # (each fake's own, then its core's: the standby's first)
    core = pids[pids.index(d.status()["pid"]) + 1]
    streams_under(cfg, lambda: os.kill(core, signal.SIGKILL))
    st = d.status()
    assert st["state"] == "RUNNING" and st["pid"] == spare
    early = free_gib == 20
    assert wakes.read_text().split()[1:] == (["weights", "kv_cache"] if early else ["all"])
    names = [e["event"] for e in d.events()]
    failover = next(e for e in d.events() if e["event"] == "failover")
    assert failover.get("weights_early", False) is early
    if early:
        assert names.index("failover") < names.index("standby_weights_woken") \
            < names.index("standby_woken") < names.index("failover_done")
    else:
        assert "standby_weights_woken" not in names


def test_with_standby_weights_on_the_gpu_a_kill_wakes_only_the_kv_cache(daemon_factory,
                                                                         tmp_path):
    """`engine.standby_weights = "gpu"` (pair/weights_ahead.py): both engines at 0.88, the
    standby first and asleep (4 GiB of weights, as its sleep says). With the card's reading
    (scripted NVML) leaving room for them and 1 GiB more, the standby's weights are woken
    ahead (`/wake_up?tags=weights`: it sleeps on), then its pinned host cache emptied
    through the daemon's worker extension (`/collective_rpc`: engine/process/host_cache.py),
    and a core SIGKILL later wakes only its KV cache (`tags=kv_cache`) once the old tree
    is gone; every stream whole."""
    gpu = tmp_path / "gpu.json"
    gpu.write_text(json.dumps({"memory_used_bytes": 60 * 2**30,
                               "memory_total_bytes": 80 * 2**30}))
    cfg = proxy_config(tmp_path, "--token-delay", "0.02", "--enable-sleep-mode",
                       "--gpu-memory-utilization", "0.88", "--weights-gib", "4",
                       keepalive_s=0.5)
    cfg["engine"].update(standby="sleep", drain="continue", standby_weights="gpu",
                         env={**cfg["engine"].get("env", {}), "VLLM_SERVER_DEV_MODE": "1"})
    cfg["gpu"] = {"sampler": "file", "file": str(gpu), "period_s": 0.5}
    d = daemon_factory(cfg)
    d.wait_state("RUNNING")
    wait_for(lambda: standby_ready(d), 30, "the standby ready")
    st = wait_for(lambda: (s := d.status())["standby"]["weights"] == "gpu" and s, 20,
                  "the standby's weights on the card")
    spare = st["standby"]["pid"]
    assert st["standby"]["asleep"] is True and st["standby"]["state"] == "ready"
    wakes = tmp_path / "wakes"
    assert wakes.read_text().split() == ["all", "weights"]  # (the engine's warm-up, then)
    assert "(its weights on the GPU)" in d.ctl("status").stdout
    on_card = next(e for e in d.events() if e["event"] == "standby_weights_on_card")
    assert on_card["pid"] == spare and on_card["weights_bytes"] == 4 * 2**30
    # its weights' backup let go while it serves nobody: asked once, of it alone
    wait_for(lambda: d.status()["standby"]["host_cache"] == "emptied", 20,
             "the standby's host cache emptied")
    assert (tmp_path / "host-cache").read_text().split() == ["emptied"]
    emptied = next(e for e in d.events() if e["event"] == "standby_host_cache_emptied")
    assert emptied["pid"] == spare
    pids = d.engine_pids()
    core = pids[pids.index(st["pid"]) + 1]
    streams_under(cfg, lambda: os.kill(core, signal.SIGKILL))
    st = d.status()
    assert st["state"] == "RUNNING" and st["pid"] == spare
    assert wakes.read_text().split()[2:] == ["kv_cache"]  # the rest only
    failover = next(e for e in d.events() if e["event"] == "failover")
    assert failover["weights_ahead"] == "back" and "weights_early" not in failover
    names = [e["event"] for e in d.events()]
    assert names.index("failover") < names.index("standby_woken") \
        < names.index("failover_done")
