"""An XID on the engine's GPUs while it starts ends the start (the rules `xid_restart`
and `xid_reset` judge only an engine that serves; a start on a broken GPU could hang until
its startup timeout): recorded effects and a driven clock, no process."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from supervisor.engine.events import GpuSampled, HealthResult
from supervisor.watchdog.gpu import DeviceReading, GpuReading
from tests.harness import fake_engine_config
from tests.unit_world import World


def starting(tmp_path: Path, **sections: dict[str, Any]) -> World:
    w = World(tmp_path, **sections)
    w.sup.start("test")
    return w


def sampled(w: World, *xids: int, gpu: int | None = 0) -> None:
    devices = () if gpu is None else (DeviceReading(index=gpu, xids=tuple(xids)),)
    w.feed(GpuSampled(GpuReading(xids=tuple(xids), devices=devices), at=w.now))


def test_an_xid_a_restart_clears_fails_the_start_and_the_next_one_follows(
        tmp_path: Path) -> None:
    w = starting(tmp_path)
    engine = w.spawned()
    w.now += 30
    sampled(w, 31)
    assert w.state == "BACKOFF"
    assert w.sup.state_reason.startswith(
        "XID 31 (GPU memory page fault) on GPU 0 while the engine started")
    # no grace: vLLM ignores SIGTERM until it serves
    assert w.fx.last("take_down") == {"pid": engine.pid, "graceful": False, "evidence": None}
    w.down(engine)
    w.feed(w.fx.timers[-1].event)  # the backoff over: the next start
    assert w.state == "STARTING" and w.fx.names().count("spawn") == 2


def test_an_xid_that_needs_a_gpu_reset_holds_the_engine_down(tmp_path: Path) -> None:
    w = starting(tmp_path)
    engine = w.spawned()
    sampled(w, 79, gpu=None)  # (NVML could not place it on a GPU)
    assert w.state == "FATAL"
    assert w.sup.state_reason.startswith("XID 79 (GPU has fallen off the bus) while the "
                                         "engine started; the GPU needs a reset or a reboot")
    assert w.fx.last("take_down")["graceful"] is False
    w.down(engine)
    assert w.state == "FATAL" and w.fx.names().count("spawn") == 1  # down until a restart


def test_an_informational_xid_a_disabled_rule_or_a_dry_run_leaves_the_start_alone(
        tmp_path: Path) -> None:
    cases: list[tuple[int, dict[str, Any]]] = [
        (43, {}),  # "GPU stopped processing": info
        (31, {"rules": {"xid_restart": {"enabled": False}}}),
        (79, {"rules": {"xid_reset": {"enabled": False}}}),
        (31, {"dry_run": True}),
        (79, {"enabled": False}),
    ]
    for i, (code, policy) in enumerate(cases):
        w = starting(tmp_path / str(i), policy=policy)
        engine = w.spawned()
        sampled(w, code)
        assert w.state == "STARTING" and "take_down" not in w.fx.names(), (code, policy)
        w.feed(HealthResult(engine.generation, True))
        assert w.state == "RUNNING"


def test_an_xid_after_the_start_is_the_rules_not_the_start(tmp_path: Path) -> None:
    w = World(tmp_path)
    w.serving()
    sampled(w, 31)
    assert w.state == "RUNNING" and "take_down" not in w.fx.names()


def test_over_the_real_daemon_a_scripted_xid_ends_a_slow_start_and_the_next_serves(
        daemon_factory: Any, tmp_path: Path) -> None:
    """The daemon, the fake engine (10 s to listen) and the file sampler: XID 31 read while
    the engine starts ends that start at once (not at its 600 s startup timeout); once the
    GPU reads clean, the next start serves."""
    gpu = tmp_path / "gpu.json"
    gpu.write_text(json.dumps({"temperature_c": 50.0, "xids": [31]}))
    cfg = fake_engine_config(tmp_path, "--startup-delay", "10",
                             engine={"startup_timeout_s": 600.0},
                             restart={"boot_failures_max": 10},
                             gpu={"sampler": "file", "file": str(gpu), "period_s": 0.5})
    d = daemon_factory(cfg)
    st = d.wait_state("BACKOFF", 30)
    assert "XID 31 (GPU memory page fault) while the engine started" in st["reason"]
    tmp = gpu.with_suffix(".tmp")
    tmp.write_text(json.dumps({"temperature_c": 50.0}))
    os.replace(tmp, gpu)
    d.wait_state("RUNNING", 60)
    assert any(e["event"] == "xid" and e["xid"] == 31 for e in d.events())
