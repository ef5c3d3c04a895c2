"""The proof's warm-up through the real daemon and a fake engine (issue 48): a new engine's
first request that asks for log-probabilities takes a long first step (vLLM compiling
its sampler helper on a cold cache; here a child process burns a core meanwhile), and
its counters stand still. That step is no stall; a warm-up that never ends within its
budget (burning a core or idle) is a failed start, judged by the proof, not the progress
rule. Real HTTP, signals and processes; the
engine's /metrics scripted (tests/test_watchdog.py's `MetricsScript`)."""

from __future__ import annotations

import httpx

from tests.harness import free_port, wait_for
from tests.test_watchdog import metrics, watchdog_config  # noqa: F401  (a fixture)

COLD_S = 9.0  # longer than the progress rule's 6 s, with scrapes every 2 s


def cold_config(tmp_path, metrics_path, *extra: str, **canary: float):  # type: ignore[no-untyped-def]
    listen = f"127.0.0.1:{free_port()}"
    cfg = watchdog_config(tmp_path, "--logprobs", "--first-logprobs-s", str(COLD_S),
                          "--metrics-file", str(metrics_path), *extra,
                          proxy={"enabled": True, "listen": listen})
    # the default rules and periods (scrape 2 s; no_progress at 6 s stalled)
    cfg["metrics"] = {"period_s": 2.0, "timeout_s": 2.0}
    cfg["canary"] = {"period_s": 10.0, "timeout_s": 5.0, **canary}
    return cfg, f"http://{listen}"


def test_running_through_a_cold_first_step_of_its_proof_without_a_decision(
        daemon_factory, tmp_path, metrics):  # noqa: F811
    # the engine's counters stand still the whole proof long, with a request running
    metrics.set(running=1, waiting=0, generation=0.0)
    cfg, proxy = cold_config(tmp_path, metrics.path)
    d = daemon_factory(cfg)
    d.wait_state("STARTING", 20)
    # a client at once: held until the engine is proven, then answered
    r = httpx.post(f"{proxy}/v1/completions", timeout=120,
                   json={"model": "fake", "prompt": "hello", "max_tokens": 4})
    assert r.status_code == 200, r.text
    metrics.set(generation=50.0)  # serving: its steps count tokens
    (warmed,) = [e for e in d.events() if e["event"] == "paths_warmed"]
    assert warmed["ok"] is True and warmed["error"] is None, warmed
    assert warmed["slowest"]["path"] == "logprobs" and warmed["slowest"]["s"] >= COLD_S
    assert set(warmed["paths"]) >= {"logprobs", "chat_logprobs", "stream", "sampling",
                                    "stop", "structured"}
    # two more scrapes of a serving engine: no decision, no restart, the same engine
    pid = d.status()["pid"]
    wait_for(lambda: d.status()["signals"]["engine_stalled_s"] == 0.0, 10, "progress seen")
    st = d.status()
    assert d.decisions() == [] and st["restarts"] == 0 and st["pid"] == pid, \
        (d.decisions(), st)


def test_a_proof_whose_first_step_hangs_is_a_failed_start_at_its_budget_not_a_decision(
        daemon_factory, tmp_path, metrics):  # noqa: F811
    """The same first step, burning nothing (a hang, or a wait on a lock another engine's
    compile holds: the two-engine e2e saw one engine's tree idle at 2.5 % while its
    sibling compiled the helper both needed): the proof judges it with its own deadline,
    the progress rule never does."""
    metrics.set(running=1, waiting=0, generation=0.0)
    cfg, _ = cold_config(tmp_path, metrics.path, "--first-logprobs-idle",
                         warm_up_timeout_s=12.0)
    cfg["engine"]["args"] = ["--first-logprobs-s", "600"]  # (the last one wins)
    d = daemon_factory(cfg)
    failed = wait_for(lambda: [e for e in d.events() if e["event"] == "paths_warmed"], 60,
                      "the warm-up's end")[0]
    assert failed["ok"] is False and failed["paths"]["logprobs"]["answer"] == "timeout"
    wait_for(lambda: len(d.engine_argvs()) >= 2, 60, "a second start")
    assert d.decisions() == []  # (12 s of no progress with work at it: no decision)


def test_a_warm_up_silent_past_its_budget_fails_the_start(daemon_factory, tmp_path,
                                                           metrics):  # noqa: F811
    metrics.set(running=0, waiting=0, generation=0.0)
    cfg, _ = cold_config(tmp_path, metrics.path, warm_up_timeout_s=3.0)
    d = daemon_factory(cfg)
    failed = wait_for(lambda: [e for e in d.events() if e["event"] == "paths_warmed"], 60,
                      "the warm-up's end")[0]
    assert failed["ok"] is False and "no answer within the warm-up's 3 s" in failed["error"]
    assert failed["paths"]["logprobs"]["answer"] == "timeout"
    # a failed start: the engine taken down and started again
    wait_for(lambda: len(d.engine_argvs()) >= 2, 60, "a second start")
    assert d.decisions() == []  # (the start failed; no rule decided anything)
