"""The watchdog through the real daemon: a fake engine whose /metrics, completions and
GPU readings the test scripts, real signals, sockets and HTTP. Each test checks a
transition the policy drives and the evidence it leaves in the audit trail."""

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
import pytest
from prometheus_client.parser import text_string_to_metric_families

from supervisor.watchdog.stackdumps import MAX_FILE_BYTES
from tests.harness import fake_engine_config, free_port, wait_for, write_config


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


class MetricsScript:
    """Writes a vLLM-shaped /metrics page for the fake engine, afresh every 50 ms, with
    counters that grow at the rates the test sets."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.values: dict[str, float] = {"kv": 0.1, "running": 1, "waiting": 0}
        self.rates: dict[str, float] = {"preemptions": 0.0, "generation": 50.0}
        self._counters = {"preemptions": 0.0, "generation": 0.0}
        self._stop = threading.Event()
        self._write(0.0)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def set(self, **values: float) -> None:
        for k, v in values.items():
            if k in self.rates:
                self.rates[k] = v
            else:
                self.values[k] = v

    def _write(self, dt: float) -> None:
        for k, r in self.rates.items():
            self._counters[k] += r * dt
        lbl = '{engine="0",model_name="fake"}'
        v, c = self.values, self._counters
        _atomic_write(self.path, "\n".join([
            "# TYPE vllm:kv_cache_usage_perc gauge", f"vllm:kv_cache_usage_perc{lbl} {v['kv']}",
            "# TYPE vllm:num_requests_running gauge",
            f"vllm:num_requests_running{lbl} {v['running']}",
            "# TYPE vllm:num_requests_waiting gauge",
            f"vllm:num_requests_waiting{lbl} {v['waiting']}",
            "# TYPE vllm:num_preemptions counter",
            f"vllm:num_preemptions_total{lbl} {c['preemptions']}",
            "# TYPE vllm:generation_tokens counter",
            f"vllm:generation_tokens_total{lbl} {c['generation']}",
            *([] if "blocks" not in v else [  # (vLLM's cache config, when set)
                "# TYPE vllm:cache_config_info gauge",
                f'vllm:cache_config_info{{block_size="{v.get("block_size", 16):g}",'
                f'engine="0",num_gpu_blocks="{v["blocks"]:g}"}} 1.0']), ""]))

    def _run(self) -> None:
        last = time.monotonic()
        while not self._stop.wait(0.05):
            now = time.monotonic()
            self._write(now - last)
            last = now

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


@pytest.fixture
def metrics(tmp_path: Path) -> Iterator[MetricsScript]:
    m = MetricsScript(tmp_path / "metrics.txt")
    yield m
    m.stop()


FAST = {  # windows and periods short enough for a test, same logic as the defaults
    "metrics": {"period_s": 0.1, "timeout_s": 1.0},
    "signals": {"rate_window_s": 2.0},
    "canary": {"period_s": 0.5, "timeout_s": 1.0},
}


def watchdog_config(tmp: Path, *fake_args: str, policy: dict[str, Any] | None = None,
                    rules: dict[str, dict[str, Any]] | None = None,
                    **sections: dict[str, Any]) -> dict[str, dict[str, Any]]:
    cfg = fake_engine_config(tmp, *fake_args, **FAST, **sections)
    cfg["policy"] = {"min_action_gap_s": 0, **(policy or {})}
    for name, table in (rules or {}).items():
        cfg[f"policy.rules.{name}"] = table
    return cfg


def flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


def scrape_exporter(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = httpx.get(f"{url}/metrics", timeout=5).text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_running_to_throttled_relaunch_when_kv_saturated_and_back_when_clear(
        daemon_factory, tmp_path, metrics):
    cfg = watchdog_config(
        tmp_path, "--metrics-file", str(metrics.path),
        engine={"args": ["--max-num-seqs", "16", "--max-num-batched-tokens", "1024"]},
        throttle={"level_factors": [0.5]},
        rules={"kv_saturation": {"for_s": 1, "clear_for_s": 1, "cooldown_s": 1}})
    d = daemon_factory(cfg)
    d.wait_state("RUNNING")
    metrics.set(kv=0.97, waiting=5, running=4, preemptions=3.0)
    st = d.wait_state("RUNNING", 30, extra=lambda s: s["restarts"] == 1)
    assert st["throttle_level"] == 1
    assert st["overrides"] == {"--max-num-seqs": "8", "--max-num-batched-tokens": "512"}
    argv = d.engine_argvs()[-1]
    assert flag(argv, "--max-num-seqs") == "8" and flag(argv, "--max-num-batched-tokens") == "512"
    dec = d.decisions()[-1]
    assert dec["rule"] == "kv_saturation" and dec["action"] == "throttle"
    assert dec["evidence"]["kv_cache_usage"] == pytest.approx(0.97)
    assert dec["evidence"]["preemption_rate"] > 0.2
    assert st["last_policy_decision"]["rule"] == "kv_saturation"
    assert st["last_decision"]["action"] == "start"  # the lifecycle's own latest step
    (rem,) = d.remedies()  # the relaunch, audited once the new engine served
    assert rem["rung"] == "throttle" and rem["outcome"] == "ok" and rem["error"] is None
    assert list(rem["steps_s"]) == ["drain", "take_down", "start"] and rem["starts"] == 1
    assert rem["duration_s"] == pytest.approx(sum(rem["steps_s"].values()), abs=0.01)

    # Clear: usage below 0.85 for clear_for_s lifts the level with a relaunch.
    metrics.set(kv=0.2, waiting=0, preemptions=0.0)
    st = d.wait_state("RUNNING", 30, extra=lambda s: s["restarts"] == 2)
    assert st["throttle_level"] == 0 and st["overrides"] == {}
    argv = d.engine_argvs()[-1]
    assert flag(argv, "--max-num-seqs") == "16"
    assert [e["action"] for e in d.decisions()] == ["throttle", "lift"]
    assert len(d.remedies()) == 1  # restoring the settings is not a remedy



def test_running_to_restart_without_drain_when_the_canary_hangs(daemon_factory, tmp_path):
    hang = tmp_path / "hang"
    cfg = watchdog_config(tmp_path, "--hang-file", str(hang),
                          rules={"hang": {"when": "canary_failures >= 2"}})
    d = daemon_factory(cfg)
    d.wait_state("RUNNING")
    wait_for(lambda: d.status()["signals"]["canary_latency_s"] is not None, 10, "a canary")
    t0 = time.monotonic()
    hang.touch()
    dec = wait_for(lambda: [e for e in d.decisions() if e["rule"] == "hang"], 30,
                   "the hang rule")[0]
    detected_s = time.monotonic() - t0
    hang.unlink()
    assert dec["action"] == "restart_now" and dec["evidence"]["canary_failures"] >= 2
    d.wait_state("RUNNING", 30, extra=lambda s: s["restarts"] == 1)
    downs = [e for e in d.events() if e["event"] == "take_down"]
    assert downs[-1]["graceful"] is False  # a frozen engine cannot drain
    failed = [r for r in d.log_records() if r.get("event") == "canary failed"]
    assert failed and all(r["counted"] for r in failed)
    (rem,) = d.remedies()
    assert rem["rung"] == "restart_now" and rem["outcome"] == "ok" and rem["starts"] == 1
    print(f"hang detected {detected_s:.2f} s after the engine froze")


def test_running_to_restart_when_the_counters_stop_before_the_canary_sees_it(
        daemon_factory, tmp_path, metrics):
    """The engine freezes (completions hang, /health and /metrics still answer, its
    counters stand still with requests running and waiting): at the default periods
    (scrape 2 s, canary every 10 s with a 5 s deadline, 3 failures) the progress rule
    decides first, and the canary, the second witness, has not yet failed three times."""
    hang = tmp_path / "hang"
    cfg = watchdog_config(tmp_path, "--child", "--hang-file", str(hang), "--metrics-file",
                          str(metrics.path))
    cfg["evidence"] = {"dir": str(tmp_path / "evidence")}
    cfg["metrics"] = {"period_s": 2.0, "timeout_s": 2.0}
    cfg["canary"] = {"period_s": 10.0, "timeout_s": 5.0}
    metrics.set(running=4, waiting=2, generation=50.0)
    d = daemon_factory(cfg)
    d.wait_state("RUNNING")
    wait_for(lambda: d.status()["signals"]["engine_stalled_s"] == 0.0, 10, "progress seen")
    t0 = time.monotonic()
    metrics.set(generation=0.0)
    hang.touch()
    dec = wait_for(lambda: d.decisions(), 60, "a decision")[0]
    detected_s = time.monotonic() - t0
    metrics.set(generation=50.0)
    hang.unlink()
    assert (dec["rule"], dec["action"]) == ("no_progress", "restart_now"), dec
    assert dec["evidence"]["engine_stalled_s"] >= 6
    assert d.status()["signals"]["canary_failures"] < 3
    d.wait_state("RUNNING", 30, extra=lambda s: s["restarts"] == 1)
    assert [e["rule"] for e in d.decisions()] == ["no_progress"]
    # evidence, captured before the kill, from the fake engine's own processes
    (ev,) = [e for e in d.events() if e["event"] == "evidence"]
    pids = [int(p) for p in (tmp_path / "engine.pids").read_text().split()[:2]]
    assert ev["rule"] == "no_progress" and ev["error"] is None
    assert [ev["stacks"][str(p)] for p in pids] == ["ok", "ok"], ev["stacks"]
    bundle = Path(ev["path"])
    assert "fake_engine.py" in (bundle / "stacks.txt").read_text()
    assert "fake engine starting" in (bundle / "engine.log").read_text()
    assert json.loads((bundle / "bundle.json").read_text())["signals"]["engine_stalled_s"] >= 6
    downs = [e for e in d.events() if e["event"] == "take_down"]
    assert downs[0]["evidence_for"] == "no_progress"
    listed = d.ctl("evidence")
    assert listed.returncode == 0 and str(bundle) in listed.stdout
    print(f"no progress decided {detected_s:.2f} s after the engine froze "
          f"(stalled {dec['evidence']['engine_stalled_s']} s); evidence "
          f"{ev['bytes']} bytes in {ev['duration_s']} s")


def test_a_hang_of_a_vllm_033_engine_leaves_vllms_own_stack_dump_in_the_evidence(
        daemon_factory, tmp_path):
    """vLLM 0.33's stack-dump watchdog: the daemon gives the engine a dump folder of its
    own per start and a timeout under its own hang deadline; the core's dump of the stall
    is in the hang's evidence bundle, which the audit names; a graceful stop makes the
    core dump again (SIGTERM), into its own start's folder."""
    from tests.test_compile_cache import fake_vllm

    hang = tmp_path / "hang"
    cfg = watchdog_config(tmp_path, "--child", "--hang-file", str(hang),
                          rules={"hang": {"when": "canary_failures >= 2"}})
    cfg["engine"]["env"]["PYTHONPATH"] = str(fake_vllm(tmp_path / "site", "0.33.0"))
    cfg["evidence"] = {"dir": str(tmp_path / "evidence")}
    d = daemon_factory(cfg)
    st = d.wait_state("RUNNING")
    root = tmp_path / "stack-dumps" / "default"
    first = st["stack_dumps"]
    assert first["owner"] == "daemon" and Path(first["dir"]).parent == root
    # the hang rule's deadline here: the 2nd canary failure, 1 + (0.5 + 1) s: whole
    # seconds under it, the least vLLM takes
    given = json.loads(flag(d.engine_argvs()[-1], "--watchdog-config") or "null")
    assert given == {"timeout": 1, "check_interval": 1, "dump_dir": first["dir"]}
    wait_for(lambda: d.status()["signals"]["canary_latency_s"] is not None, 10, "a canary")
    hang.touch()
    ev = wait_for(lambda: [e for e in d.events() if e["event"] == "evidence"], 30,
                  "the hang's evidence")[0]
    hang.unlink()
    assert ev["rule"] == "hang" and ev["error"] is None
    core_pid = int((tmp_path / "engine.pids").read_text().split()[1])
    (copy,) = ev["vllm_dumps"]  # the audit names the file, in the bundle and where it was
    assert copy["file"] == str(Path(ev["path"]) / "vllm-stack-dumps" /
                               f"VLLM_STACK_DUMP_for_engine_0_{core_pid}.log")
    assert copy["source"] == str(Path(first["dir"]) / Path(copy["file"]).name)
    assert copy["pid"] == core_pid and copy["last"].endswith("due to feed timeout")
    text = Path(copy["file"]).read_text()
    assert text.startswith("\n>>> Call stack dump #1 at ") and "watch_hang" in text
    assert ev["stacks"][str(core_pid)] == "ok"  # (py-spy as well)
    st = d.wait_state("RUNNING", 30, extra=lambda s: s["restarts"] == 1)
    second = st["stack_dumps"]["dir"]
    assert second != first["dir"] and Path(second).parent == root
    # a graceful restart: the core dumps at SIGTERM, in its own start's folder
    assert d.ctl("restart").returncode == 0
    d.wait_state("RUNNING", 30, extra=lambda s: s["restarts"] == 2)
    (dumped,) = Path(second).iterdir()
    assert dumped.read_text().count(">>> Call stack dump #") == 1
    assert "due to SIGTERM" in dumped.read_text()
    assert sorted(p.name for p in root.iterdir())[:2] == [Path(first["dir"]).name,
                                                           Path(second).name]
    # a running engine's file past its bound is cut to its newest dumps (at a look at
    # the tree, every 10 s once it serves)
    grown = Path(d.status()["stack_dumps"]["dir"]) / "VLLM_STACK_DUMP_for_worker_0_1.log"
    grown.write_text("".join(f"\n>>> Call stack dump #{n} at now due to feed timeout\n\n"
                             + "x" * 4000 + "\n" + "=" * 64 + "\n" for n in range(1, 1100)))
    wait_for(lambda: grown.stat().st_size <= MAX_FILE_BYTES // 2 + 100, 30, "the cut")
    assert "#1099 at now" in grown.read_text() and "#1 at now" not in grown.read_text()


def test_the_operators_own_watchdog_config_wins_and_its_folder_is_read(daemon_factory,
                                                                        tmp_path):
    from tests.test_compile_cache import fake_vllm

    hang = tmp_path / "hang"
    theirs = '{"timeout": 2, "dump_dir": "my-dumps"}'
    cfg = watchdog_config(tmp_path, "--hang-file", str(hang),
                          engine={"args": ["--watchdog-config", theirs],
                                  "cwd": str(tmp_path)},
                          rules={"hang": {"when": "canary_failures >= 2"}})
    cfg["engine"]["env"]["PYTHONPATH"] = str(fake_vllm(tmp_path / "site", "0.33.0"))
    d = daemon_factory(cfg)
    st = d.wait_state("RUNNING")
    assert st["stack_dumps"] == {"dir": str(tmp_path / "my-dumps"), "owner": "operator",
                                 "timeout_s": 2, "check_interval_s": 10}
    argv = d.engine_argvs()[-1]
    assert argv.count("--watchdog-config") == 1 and flag(argv, "--watchdog-config") == theirs
    assert not (tmp_path / "stack-dumps").exists()
    wait_for(lambda: d.status()["signals"]["canary_latency_s"] is not None, 10, "a canary")
    hang.touch()  # (no --child: the fake's main process is its core, and dumps)
    ev = wait_for(lambda: [e for e in d.events() if e["event"] == "evidence"], 30,
                  "the hang's evidence")[0]
    hang.unlink()
    (copy,) = ev["vllm_dumps"]
    assert copy["source"] == str(tmp_path / "my-dumps" /
                                 f"VLLM_STACK_DUMP_for_engine_0_{ev['pid']}.log")


def test_a_restart_remedy_whose_engine_never_boots_again_is_audited_as_failed(
        daemon_factory, tmp_path):
    hang, broken = tmp_path / "hang", tmp_path / "broken"
    cfg = watchdog_config(tmp_path, "--hang-file", str(hang), "--fail-boot-file", str(broken),
                          restart={"backoff_initial_s": 0.1, "boot_failures_max": 2},
                          rules={"hang": {"when": "canary_failures >= 2"}})
    d = daemon_factory(cfg)
    d.wait_state("RUNNING")
    broken.touch()  # every start from now on fails
    hang.touch()
    st = d.wait_state("FATAL", 30)
    hang.unlink()
    (rem,) = d.remedies()
    assert rem["rung"] == "restart_now" and rem["outcome"] == "failed"
    assert rem["starts"] == 2 and rem["error"] == st["fatal_reason"]
    # "start": the time spent on starts that all failed, until the daemon gave up
    assert list(rem["steps_s"]) == ["drain", "take_down", "start"]


def test_thermal_throttle_holds_within_hysteresis_and_lifts_when_cool(daemon_factory,
                                                                      tmp_path):
    gpu = tmp_path / "gpu.json"

    def reading(temp: float, throttled: bool = False) -> None:
        _atomic_write(gpu, json.dumps({
            "temperature_c": temp, "slowdown_temperature_c": 89.0, "power_w": 300.0,
            "power_limit_w": 700.0, "thermal_throttled": throttled, "power_capped": False,
            "process_memory": {}}))

    reading(60)
    cfg = watchdog_config(
        tmp_path, gpu={"sampler": "file", "file": str(gpu), "period_s": 0.5},
        engine={"args": ["--max-num-seqs", "16"]},
        # (for_s 5: the flag's few seconds below must not throttle again on a loaded
        # machine, where they ran past 1 s and made a second throttle of the lift)
        rules={"thermal": {"for_s": 5, "clear_for_s": 2, "cooldown_s": 1}})
    d = daemon_factory(cfg)
    d.wait_state("RUNNING")
    wait_for(lambda: d.status()["signals"]["gpu_slowdown_margin_c"] == 29, 10, "a reading")
    reading(86)  # 3 C below the card's own 89 C slowdown mark
    st = d.wait_state("RUNNING", 30, extra=lambda s: s["restarts"] == 1)
    assert st["throttle_level"] == 1 and st["overrides"]["--max-num-seqs"] == "12"
    dec = d.decisions()[-1]
    assert dec["rule"] == "thermal" and dec["evidence"]["gpu_slowdown_margin_c"] == 3

    reading(82)  # 7 C below: cooler, but inside the hysteresis band (lift at 8)
    at7 = wait_for(lambda: (s := d.status())["signals"]["gpu_slowdown_margin_c"] == 7 and s,
                   10, "margin 7")["state_for_s"]
    # the daemon's own clock: 4 s at margin 7, twice clear_for_s
    wait_for(lambda: d.status()["state_for_s"] > at7 + 4, 15, "4 s at margin 7")
    st = d.status()
    assert st["throttle_level"] == 1 and st["restarts"] == 1
    assert st["policy"]["rules"]["thermal"]["clearing_s"] is None

    reading(81, throttled=True)  # cool enough, but NVML says thermal slowdown: no lift
    wait_for(lambda: d.status()["signals"]["gpu_thermal_throttled"] == 1, 10, "the flag")
    reading(80)
    st = d.wait_state("RUNNING", 30, extra=lambda s: s["restarts"] == 2)
    assert st["throttle_level"] == 0 and st["overrides"] == {}
    assert [e["action"] for e in d.decisions()] == ["throttle", "lift"]


def test_running_to_fatal_hold_down_on_an_xid_that_needs_a_gpu_reset(daemon_factory,
                                                                     tmp_path):
    gpu = tmp_path / "gpu.json"
    _atomic_write(gpu, json.dumps({"temperature_c": 50.0, "xids": []}))
    cfg = watchdog_config(tmp_path, gpu={"sampler": "file", "file": str(gpu),
                                         "period_s": 0.5})
    d = daemon_factory(cfg)
    d.wait_state("RUNNING")
    _atomic_write(gpu, json.dumps({"temperature_c": 50.0, "xids": [79]}))
    st = d.wait_state("FATAL", 30)
    assert "XID 79" in st["fatal_reason"] and "reset or a reboot" in st["fatal_reason"]
    _atomic_write(gpu, json.dumps({"temperature_c": 50.0, "xids": []}))
    wait_for(lambda: d.status()["pid"] is None and d.status()["engine"]["processes"] == 0,
             20, "the engine taken down")
    assert next(e for e in d.events() if e["event"] == "xid")["xid"] == 79
    (ev,) = [e for e in d.events() if e["event"] == "evidence"]  # captured before the kill
    assert ev["rule"] == "xid_reset" and ev["stacks"][str(ev["pid"])] == "ok"
    assert json.loads((Path(ev["path"]) / "bundle.json").read_text())["gpu"]["xids"] == [79]
    # no restart loop: held down until the operator says so
    assert d.status()["restarts"] == 0
    assert d.ctl("restart").returncode == 0
    d.wait_state("RUNNING", 30)


def test_dry_run_pause_budget_and_the_exporter(daemon_factory, tmp_path, metrics):
    metrics.set(kv=0.6, running=0, generation=0.0)  # a leak signature: held, nothing running
    rules = {"kv_leak": {"for_s": 0.5, "cooldown_s": 1}}
    cfg = watchdog_config(tmp_path, "--metrics-file", str(metrics.path),
                          policy={"dry_run": True, "max_restarts_per_hour": 1}, rules=rules)
    d = daemon_factory(cfg)
    d.wait_state("RUNNING")
    # dry-run: decided and audited, not done
    dec = wait_for(lambda: d.decisions(), 20, "a dry-run decision")[0]
    assert dec["rule"] == "kv_leak" and dec["action"] == "restart" and dec["dry_run"] is True
    assert d.status()["restarts"] == 0 and d.status()["state"] == "RUNNING"

    # paused: due but held back, reported once
    assert d.ctl("pause-policy").returncode == 0
    cfg["policy"]["dry_run"] = False
    write_config(d.config, cfg)
    assert d.ctl("reload").returncode == 0
    held = wait_for(lambda: [e for e in d.events() if e["event"] == "decision_held_back"],
                    20, "an action held back")
    assert "paused" in held[0]["held_back"]
    wait_for(lambda: d.status()["policy"]["rules"]["kv_leak"]["holding_s"] > 3, 20, "3 s")
    assert len([e for e in d.events() if e["event"] == "decision_held_back"]) == 1
    assert d.status()["restarts"] == 0

    # resumed: it acts, once; the next one would exceed the budget: one alert instead
    assert d.ctl("resume-policy").returncode == 0
    d.wait_state("RUNNING", 30, extra=lambda s: s["restarts"] == 1)
    alert = wait_for(lambda: [e for e in d.decisions() if e["action"] == "alert"], 20,
                     "the budget alert")[0]
    assert "restart budget exhausted" in alert["reason"]
    st = d.status()
    assert st["restarts"] == 1 and st["policy"]["restarts_last_hour"] == 1

    m = scrape_exporter(d.exporter_url)
    assert m[("vllm_supervisor_engine_state", (("state", "RUNNING"),))] == 1
    assert m[("vllm_supervisor_engine_restarts_total", (("reason", "policy"),))] == 1
    assert m[("vllm_supervisor_policy_trips_total", (("rule", "kv_leak"),))] >= 3
    assert m[("vllm_supervisor_kv_cache_usage_ratio", ())] == pytest.approx(0.6)
    assert ("vllm_supervisor_gpu_temperature_celsius", ()) not in m  # unknown, not 0
    assert httpx.get(f"{d.exporter_url}/readyz", timeout=5).status_code == 200
    assert httpx.get(f"{d.exporter_url}/healthz", timeout=5).status_code == 200


def test_a_kv_reset_waits_while_the_api_server_is_silent_and_goes_once_it_answers(
        daemon_factory, tmp_path, metrics):
    """The KV reset pauses the engine through its API server, holding every request at the
    proxy until the engine answers. While the real API server answers nothing (SIGSTOP;
    its EngineCore child runs on), the kv_leak rule's reset is held back, said once in
    the audit; once a scrape is answered again it goes, by a pause."""
    metrics.set(kv=0.1, running=0)
    cfg = fake_engine_config(
        tmp_path, "--child", "--enable-sleep-mode", "--vllm-version", "0.26.0",
        "--metrics-file", str(metrics.path),
        canary={"period_s": 30.0, "timeout_s": 2.0})  # (the proof's; no canary meanwhile)
    cfg["engine"]["env"]["VLLM_SERVER_DEV_MODE"] = "1"
    cfg["proxy"] = {"enabled": True, "listen": f"127.0.0.1:{free_port()}"}
    cfg["policy"] = {"min_action_gap_s": 0}
    # (a long cooldown: the leak's signature stays after the reset, and the rule's next
    # firing would climb to a restart)
    cfg["policy.rules.kv_leak"] = {"for_s": 0.5, "cooldown_s": 600}
    d = daemon_factory(cfg)
    st = d.wait_state("RUNNING")
    wait_for(lambda: d.status()["remedies"]["kv_reset_by"] == "pause", 10, "the pause")
    api = st["pid"]
    assert d.ctl("pause-policy").returncode == 0
    metrics.set(kv=0.6)  # a leak's signature: blocks held, nothing running
    wait_for(lambda: d.status()["signals"]["kv_cache_usage"] == 0.6, 10, "the leak seen")
    failures = d.status()["signals"]["scrape_failures_total"]
    os.kill(api, signal.SIGSTOP)
    try:
        wait_for(lambda: d.status()["signals"]["scrape_failures_total"] > failures, 10,
                 "a scrape not answered")
        assert d.ctl("resume-policy").returncode == 0
        held = wait_for(lambda: [e for e in d.events() if e["event"] == "decision_held_back"
                                 and "did not answer" in e["held_back"]], 10,
                        "the reset held back")
        assert held[0]["rule"] == "kv_leak" and held[0]["held_back"] == (
            "kv_reset held back: the engine did not answer its last /metrics scrape: its "
            "pause would hold every request until it answers (at most 60 s)"), held
        time.sleep(1.0)  # (ticks go by: still held, said once)
        assert d.remedies() == [] and d.decisions() == []
        assert len([e for e in d.events() if e["event"] == "decision_held_back"
                    and "did not answer" in e["held_back"]]) == 1
    finally:
        os.kill(api, signal.SIGCONT)
    (rem,) = wait_for(lambda: d.remedies(), 20, "the KV reset")
    assert (rem["rung"], rem["outcome"]) == ("kv_reset", "ok"), rem
    assert "pause" in rem["steps_s"], rem
    (dec,) = d.decisions()
    assert (dec["rule"], dec["action"]) == ("kv_leak", "kv_reset")
    st = d.status()
    assert (st["pid"], st["restarts"]) == (api, 0)


def test_a_saturation_by_load_is_throttled_and_not_reset_and_a_leak_is(
        daemon_factory, tmp_path, metrics):
    """The KV saturation rule's escalation needs blocks held that no running request can
    hold (`kv_blocks_unaccounted`, from the engine's max_model_len as its /v1/models says
    it, asked once healthy): 64 blocks of 16 tokens, 97 % held. With 4 requests of at most
    256 tokens running (17 blocks each, 68 in all) that is load, and the rule stays at its
    top throttle level, saying once why; with 2 (34 blocks) 28 blocks are held by none,
    and it climbs."""
    cfg = watchdog_config(
        tmp_path, "--metrics-file", str(metrics.path),
        engine={"args": ["--max-num-seqs", "16", "--max-model-len", "256"]},
        throttle={"level_factors": [0.5]},
        rules={"kv_saturation": {"for_s": 1, "clear_for_s": 1, "cooldown_s": 1,
                                 "escalate_after_s": 2}})
    d = daemon_factory(cfg)
    d.wait_state("RUNNING")
    metrics.set(kv=0.97, waiting=5, running=4, preemptions=3.0, blocks=64)
    d.wait_state("RUNNING", 30, extra=lambda s: s["restarts"] == 1)  # the throttle
    held = wait_for(lambda: [e for e in d.events() if e["event"] == "decision_held_back"],
                    30, "the escalation held back")
    assert held[0]["rule"] == "kv_saturation", held
    assert "it needs kv_blocks_unaccounted > 0, which does not hold" in held[0]["held_back"]
    signals = d.status()["signals"]
    assert signals["kv_blocks_unaccounted"] == pytest.approx(0.97 * 64 - 4 * 17)
    time.sleep(3)  # (past escalate_after_s again: still nothing but the throttle)
    assert [e["action"] for e in d.decisions()] == ["throttle"]
    assert len([e for e in d.events() if e["event"] == "decision_held_back"]) == 1

    metrics.set(running=2)  # the same blocks held by half the requests: leaked
    dec = wait_for(lambda: [e for e in d.decisions() if e["action"] != "throttle"], 30,
                   "the escalation")[0]
    assert dec["rule"] == "kv_saturation" and dec["action"] in ("kv_reset", "restart"), dec
    assert dec["evidence"]["kv_blocks_unaccounted"] == pytest.approx(0.97 * 64 - 2 * 17)
