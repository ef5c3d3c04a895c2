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
