"""On a GPU host only (skipped without NVML): the daemon's NVML view of the engine tree.

A fake engine whose child holds GPU memory through torch stands in for vLLM's
EngineCore. Run on the lent H100 with `tests/gpu_run.sh`; the results are written to
docs/gpu-validation.md by hand from that run's output.
"""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from supervisor.gpu import NvmlLister
from tests.harness import alive, fake_engine_config, wait_for

nvml = NvmlLister([])
NO_GPU = nvml.init()
pytestmark = pytest.mark.skipif(NO_GPU is not None, reason=f"no GPU: {NO_GPU}")
MIB = 1024


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


def test_nvml_lister_reads_the_real_device():
    procs = nvml.processes()
    assert procs is not None  # NVML answered
    for pid, used in procs.items():
        assert pid > 0 and used >= 0


def test_nvml_sampler_reads_a_loaded_gpu_and_sees_its_memory_released():
    """The watchdog's sampler on a real GPU heated by a torch workload: temperature,
    the card's slowdown mark, power against its limit, clock-event reasons, and the
    workload's memory attributed to its pid, then gone after SIGKILL."""
    import subprocess
    import sys

    from supervisor.gpu import NvmlSampler

    sampler = NvmlSampler([])
    assert sampler.init() is None
    idle = sampler.sample()
    burn = subprocess.Popen([sys.executable, "-m", "tests.gpu_burn", "--seconds", "90"],
                            stdout=subprocess.PIPE, text=True)
    readings = []
    try:
        assert burn.stdout is not None
        line = burn.stdout.readline()
        assert line.startswith("ready "), line
        pid = int(line.split()[1])
        t_end = time.monotonic() + 45
        while time.monotonic() < t_end:
            readings.append(sampler.sample())
            time.sleep(1.0)
        held = max((r.process_memory or {}).get(pid, 0) for r in readings)
        burn.send_signal(signal.SIGKILL)
        burn.wait(10)
        t_kill = time.monotonic()
        def released() -> bool:
            procs = sampler.sample().process_memory
            return procs is not None and pid not in procs  # {} once nothing is left

        wait_for(released, 30, "the killed workload's memory to leave NVML's list")
        release_s = time.monotonic() - t_kill
    finally:
        if burn.poll() is None:
            burn.kill()
            burn.wait(10)
    loaded = readings[-10:]
    temps = [r.temperature_c for r in readings if r.temperature_c is not None]
    powers = [r.power_w for r in loaded if r.power_w is not None]
    reasons = sorted({r.clock_event_reasons for r in readings
                      if r.clock_event_reasons is not None})
    assert idle.temperature_c is not None and temps
    assert idle.slowdown_temperature_c is not None and idle.slowdown_temperature_c > 50
    assert idle.power_w is not None and idle.power_limit_w is not None
    assert powers and max(powers) > idle.power_w  # the workload draws power
    assert reasons  # clock-event reasons read on every sample
    assert held >= 2 << 30
    errors = sorted({e for r in readings for e in r.errors})
    print("nvml sampler results:", json.dumps({
        "idle_temperature_c": idle.temperature_c, "max_loaded_temperature_c": max(temps),
        "slowdown_temperature_c": idle.slowdown_temperature_c,
        "idle_power_w": idle.power_w, "max_loaded_power_w": max(powers),
        "power_limit_w": idle.power_limit_w,
        "reasons_seen": [hex(r) for r in reasons],
        "thermal_throttled_seen": any(r.thermal_throttled for r in readings),
        "power_capped_seen": any(r.power_capped for r in readings),
        "utilization_max": max((r.utilization_ratio or 0.0) for r in readings),
        "workload_pid_gpu_mib": held >> 20, "release_after_sigkill_s": round(release_s, 2),
        "xid_registration": sampler.xid_problem or "registered",
        "errors": errors}))
    sampler.close()


def test_daemon_shows_nvml_readings_and_the_engine_gpu_memory_in_status_and_exporter(
        daemon_factory, tmp_path):
    import httpx

    cfg = fake_engine_config(tmp_path, "--gpu-mib", str(MIB), gpu={"sampler": "nvml",
                                                                   "period_s": 1.0},
                             engine={"startup_timeout_s": 120})
    d = daemon_factory(cfg)
    d.wait_state("RUNNING", 120)
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
