"""On a GPU host only (skipped without NVML): the daemon's NVML view of the engine tree,
and the watchdog's NVML sampler on a GPU under load.

A fake engine whose child holds GPU memory through torch stands in for vLLM's
EngineCore; tests/gpu_burn.py heats the GPU. Run on the lent H100 with the command in
docs/gpu-validation.md; the results are written there by hand from that run's output
(the JSON lines this file prints).
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time

import pytest

from supervisor.watchdog.gpu import GpuReading, NvmlLister, NvmlSampler
from tests.harness import alive, fake_engine_config, wait_for

nvml = NvmlLister([])
NO_GPU = nvml.init()
pytestmark = pytest.mark.skipif(NO_GPU is not None, reason=f"no GPU: {NO_GPU}")
MIB = 1024
LOAD_S = 45.0  # seconds of sampling under load


def holders() -> dict[int, int]:
    return nvml.processes() or {}


def test_restart_waits_for_the_old_tree_to_leave_the_gpu_and_sigkill_frees_it(
        daemon_factory, tmp_path):
    cfg = fake_engine_config(tmp_path, "--gpu-mib", str(MIB),
                             engine={"startup_timeout_s": 120, "gpu_release_timeout_s": 30})
    d = daemon_factory(cfg)
    d.wait_state("RUNNING", 120)
    main, core = d.engine_pids()[:2]
    listed = wait_for(lambda: holders().get(core), 30, "NVML to list the engine core")
    assert listed >= MIB << 20
    assert main not in holders()  # memory is attributed to the core, not the API server
    t0 = time.monotonic()
    assert d.ctl("restart", "--reason", "gpu test").returncode == 0
    d.wait_state("RUNNING", 120, extra=lambda s: s["restarts"] == 1)
    restart_s = time.monotonic() - t0
    reaped = [e for e in d.events() if e["event"] == "reaped"][-1]
    assert "problem" not in reaped or reaped["problem"] is None
    assert core not in holders()
    new_core = d.engine_pids()[3]
    wait_for(lambda: holders().get(new_core), 30, "the new core on the GPU")
    t1 = time.monotonic()
    os.kill(d.pid, signal.SIGKILL)
    d.proc.wait(5)
    wait_for(lambda: new_core not in holders() and alive(d.engine_pids()) == [], 15,
             "the orphaned tree to be killed and its GPU memory released")
    freed_s = time.monotonic() - t1
    print("gpu results:", json.dumps({
        "nvml_listed_core_mib": listed >> 20, "restart_with_gpu_release_s": round(restart_s, 2),
        "reap_s": reaped["duration_s"], "daemon_sigkill_to_gpu_freed_s": round(freed_s, 2)}))


def test_a_sibling_engines_gpu_memory_is_not_foreign_when_the_other_restarts(
        daemon_factory, tmp_path):
    """Two engines sharing GPU 0 (share_gpus), each core holding 1 GiB, no foreign memory
    allowed: each start sees the other's memory on the GPU, and starts all the same
    (the daemon's own processes are not foreign); a restart of one leaves the other be."""
    from tests.test_engines import all_serving, engines_config, engines_of, pids

    each = {"fake": ["--gpu-mib", str(MIB)], "gpus": [0], "share_gpus": True,
            "startup_timeout_s": 120, "gpu_release_timeout_s": 30,
            "gpu_foreign_allowance_mib": 0}
    cfg = engines_config(tmp_path, a=dict(each, fake=list(each["fake"])),
                         b=dict(each, fake=list(each["fake"])))
    d = daemon_factory(cfg)
    wait_for(lambda: all_serving(d, "a", "b"), 120, "both engines to serve")
    b_core = pids(tmp_path, "b")[1]
    wait_for(lambda: holders().get(b_core), 30, "NVML to list b's core")
    t0 = time.monotonic()
    assert d.ctl("restart", "--engine", "a").returncode == 0
    wait_for(lambda: engines_of(d)["a"]["restarts"] == 1 and all_serving(d, "a"), 120,
             "a to restart beside b's memory")
    restart_s = time.monotonic() - t0
    assert not [e for e in d.events() if e.get("event") == "spawn_failed"]
    assert engines_of(d)["b"]["restarts"] == 0 and b_core in holders()
    print("gpu results:", json.dumps({"sibling_restart_s": round(restart_s, 2),
                                      "b_core_mib": holders()[b_core] >> 20}))


def test_nvml_lister_reads_the_real_device():
    procs = nvml.processes()
    assert procs is not None  # NVML answered
    for pid, used in procs.items():
        assert pid > 0 and used >= 0


def _read_ready_pid(burn: subprocess.Popen[str], timeout: float) -> int:
    """The workload's "ready PID" line, within `timeout` (CUDA start-up, 2 GiB allocation)."""
    assert burn.stdout is not None
    ready, _, _ = select.select([burn.stdout], [], [], timeout)
    assert ready, f"gpu_burn printed nothing in {timeout:g} s (exit code {burn.poll()})"
    line = burn.stdout.readline()
    assert line.startswith("ready "), f"gpu_burn said {line!r} (exit code {burn.poll()})"
    return int(line.split()[1])


def test_nvml_sampler_reads_a_loaded_gpu_and_sees_its_memory_released():
    """The watchdog's sampler on a real GPU heated by a torch workload: temperature,
    the card's slowdown mark, power against its limit, clock-event reasons, and the
    workload's memory attributed to its pid, then gone after SIGKILL."""
    sampler = NvmlSampler([])
    assert sampler.init() is None
    idle = sampler.sample()
    burn = subprocess.Popen([sys.executable, "-m", "tests.gpu_burn", "--seconds", "90",
                             "--gib", "2"], stdout=subprocess.PIPE, text=True)
    loaded: list[GpuReading] = []
    after_kill: list[GpuReading] = []
    try:
        pid = _read_ready_pid(burn, 120)
        t_end = time.monotonic() + LOAD_S
        next_t = time.monotonic()
        while next_t < t_end:  # one sample a second, as the daemon's period would
            loaded.append(sampler.sample())
            next_t += 1.0
            time.sleep(max(0.0, next_t - time.monotonic()))
        assert burn.poll() is None, "the workload ended before it was killed"
        held = max((r.process_memory or {}).get(pid, 0) for r in loaded)
        burn.send_signal(signal.SIGKILL)
        t_kill = time.monotonic()

        def released() -> bool:
            r = sampler.sample()
            after_kill.append(r)
            return r.process_memory is not None and pid not in r.process_memory

        wait_for(released, 30, "the killed workload's memory to leave NVML's list")
        release_s = time.monotonic() - t_kill
        burn.wait(10)
    finally:
        if burn.poll() is None:
            burn.kill()
            burn.wait(10)
        sampler.close()
    every = [idle, *loaded, *after_kill]
    hot = loaded[len(loaded) // 2:]  # the second half: the card has warmed up
    temps = [r.temperature_c for r in loaded if r.temperature_c is not None]
    powers = [r.power_w for r in hot if r.power_w is not None]
    reasons = sorted({r.clock_event_reasons for r in every
                      if r.clock_event_reasons is not None})
    utils = [r.utilization_ratio for r in loaded if r.utilization_ratio is not None]
    errors = sorted({e for r in every for e in r.errors})
    results = {
        "samples": len(loaded),
        "idle_temperature_c": idle.temperature_c,
        "max_loaded_temperature_c": max(temps, default=None),
        "slowdown_temperature_c": idle.slowdown_temperature_c,
        "idle_power_w": idle.power_w, "max_loaded_power_w": max(powers, default=None),
        "idle_power_limit_w": idle.power_limit_w,
        "loaded_power_limit_w": sorted({r.power_limit_w for r in loaded}, key=str),
        "idle_reasons": None if idle.clock_event_reasons is None
        else hex(idle.clock_event_reasons),
        "reasons_seen": [hex(r) for r in reasons],
        "thermal_throttled_seen": any(r.thermal_throttled for r in every),
        "power_capped_seen": any(r.power_capped for r in every),
        "max_utilization_ratio": max(utils, default=None),
        "workload_pid_gpu_mib": held >> 20, "release_after_sigkill_s": round(release_s, 3),
        "samples_after_kill": len(after_kill),
        "xid_registration": sampler.xid_problem or "registered",
        "xids_seen": sorted({x for r in every for x in r.xids}),
        "errors": errors}
    print("nvml sampler results:", json.dumps(results))
    assert idle.temperature_c is not None and len(temps) == len(loaded)
    assert idle.slowdown_temperature_c is not None and idle.slowdown_temperature_c > 50
    assert idle.power_w is not None and idle.power_limit_w is not None
    assert len(powers) == len(hot) and max(powers) > idle.power_w  # the workload draws power
    assert all(isinstance(r.clock_event_reasons, int) for r in loaded)
    assert all(isinstance(r.thermal_throttled, bool) and isinstance(r.power_capped, bool)
               for r in loaded)
    assert held >= 2 << 30
    assert errors == []


def test_daemon_shows_nvml_readings_and_the_engine_gpu_memory_in_status_and_exporter(
        daemon_factory, tmp_path):
    import httpx

    cfg = fake_engine_config(tmp_path, "--gpu-mib", str(MIB), gpu={"sampler": "nvml",
                                                                   "period_s": 1.0},
                             engine={"startup_timeout_s": 120, "gpus": [0]})
    cfg["engine"]["env"]["FAKE_ENGINE_ENVFILE"] = str(tmp_path / "engine.env")
    d = daemon_factory(cfg)
    d.wait_state("RUNNING", 120)
    # the engine runs on the GPU the daemon watches, as CUDA and NVML both count it
    env = json.loads((tmp_path / "engine.env").read_text())
    assert (env["CUDA_VISIBLE_DEVICES"], env["CUDA_DEVICE_ORDER"]) == ("0", "PCI_BUS_ID")
    # the core's CUDA context comes first, its 1 GiB tensor a moment later
    sig = wait_for(lambda: (s := d.status()["signals"])["engine_gpu_memory_bytes"]
                   and s["engine_gpu_memory_bytes"] >= MIB << 20 and s,
                   30, "the engine's 1 GiB in status")
    assert sig["gpu_temperature_c"] is not None and sig["gpu_power_w"] is not None
    assert sig["gpu_slowdown_temperature_c"] is not None and sig["gpu_power_limit_w"]
    assert sig["gpu_thermal_throttled"] in (0.0, 1.0)
    text = httpx.get(f"{d.exporter_url}/metrics", timeout=5).text
    assert "vllm_supervisor_gpu_temperature_celsius" in text
    assert "vllm_supervisor_engine_gpu_memory_bytes" in text
    print("daemon gpu signals:", json.dumps({k: v for k, v in sig.items()
                                             if k.startswith(("gpu_", "engine_gpu"))}))
    # each GPU on its own: NVML's index, its readings, the engine tree's memory there
    (gpu,) = wait_for(lambda: (g := d.status()["gpus"]) and g[0]["engine_memory_bytes"]
                      and g[0]["engine_memory_bytes"] >= MIB << 20 and g, 30, "per-GPU")
    assert gpu["index"] == 0 and gpu["temperature_c"] is not None
    assert gpu["slowdown_temperature_c"] and gpu["power_limit_w"]
    assert gpu["memory_total_bytes"] > gpu["memory_used_bytes"] >= gpu["engine_memory_bytes"]
    text = httpx.get(f"{d.exporter_url}/metrics", timeout=5).text
    assert 'vllm_supervisor_gpu_device_temperature_celsius{gpu="0"}' in text
    assert 'vllm_supervisor_gpu_device_engine_memory_bytes{gpu="0"}' in text
    shown = d.ctl("status").stdout
    line = next(x for x in shown.splitlines() if x.startswith("gpu 0"))
    print("daemon per-GPU:", json.dumps(gpu), "| status:", line)
