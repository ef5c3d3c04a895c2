"""An 8-GPU host, played by fake engines and 8 scripted GPUs: the example
`config.8-gpus.toml` (2 x TP=2 of one model, 4 x TP=1 of another with a fallback) run by
the real daemon. A GPU's heat or XID acts on the engine that owns that GPU and no other;
the evidence, `status` and the exporter name the GPU; the release check after a take-down
covers every GPU of a two-GPU engine."""

from __future__ import annotations

import json
import os
import time
import tomllib
from pathlib import Path
from typing import Any

import httpx

from tests.harness import fake_engine_config, free_port, wait_for

ROOT = Path(__file__).resolve().parent.parent
OWNERS = {0: "big-a", 1: "big-a", 2: "big-b", 3: "big-b",
          4: "small-a", 5: "small-b", 6: "small-c", 7: "small-d"}


class Gpus:
    """The host's 8 GPUs as the scripted sampler reads them (each write atomic)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.gpus: dict[int, dict[str, Any]] = {
            i: {"temperature_c": 55.0, "slowdown_temperature_c": 89.0, "power_w": 250.0,
                "power_limit_w": 700.0, "utilization_ratio": 0.5,
                "memory_used_bytes": 60 << 30, "memory_total_bytes": 80 << 30,
                "clock_event_reasons": 0, "process_memory": {}, "xids": []}
            for i in range(8)}
        self.write()

    def set(self, gpu: int, **values: Any) -> None:
        self.gpus[gpu].update(values)
        self.write()

    def write(self) -> None:
        doc = {"gpus": {str(i): g for i, g in self.gpus.items()}}
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(doc))
        os.replace(tmp, self.path)


def eight_gpu_config(tmp: Path, gpu_file: Path) -> dict[str, dict[str, Any]]:
    """config.8-gpus.toml with each vLLM swapped for the fake engine (its arguments kept,
    --tensor-parallel-size included) on a free port, and the GPUs scripted."""
    example = tomllib.loads((ROOT / "config.8-gpus.toml").read_text())
    cfg = fake_engine_config(
        tmp, canary={"period_s": 0.5, "timeout_s": 2.0},
        metrics={"period_s": 0.2, "timeout_s": 1.0},
        gpu={"sampler": "file", "file": str(gpu_file), "period_s": 0.5},
        policy={"min_action_gap_s": 0})
    cfg["policy.rules.thermal"] = {"for_s": 1, "cooldown_s": 1}
    base = cfg.pop("engine")
    for name, table in example["engines"].items():
        cfg[f"engines.{name}"] = {
            **base, **{k: v for k, v in table.items() if k not in ("command", "port")},
            "command": [*base["command"], "--child"], "port": free_port(),
            "startup_timeout_s": 30.0, "drain_timeout_s": 1.0, "gpu_release_timeout_s": 30.0,
            "env": {"FAKE_ENGINE_PIDFILE": str(tmp / f"{name}.pids")}}
    cfg["proxy"] = {"enabled": True, "listen": f"127.0.0.1:{free_port()}"}
    return cfg


def detail(d: Any) -> dict[str, dict[str, Any]]:
    st: dict[str, dict[str, Any]] = d.status()["detail"]
    return st


def decisions_by_engine(d: Any) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for e in d.decisions():
        out.setdefault(e.get("engine", "?"), []).append(e)
    return out


def test_one_gpus_heat_and_xid_act_on_its_engine_alone(daemon_factory, tmp_path):
    gpus = Gpus(tmp_path / "gpus.json")
    cfg = eight_gpu_config(tmp_path, gpus.path)
    d = daemon_factory(cfg)
    wait_for(lambda: all(e["serving"] for e in d.status()["engines"])
             and len(d.status()["engines"]) == 6, 60, "the six engines serving")
    # each engine's tree is on its own GPUs, as NVML would list them
    for gpu, name in OWNERS.items():
        pid = int((tmp_path / f"{name}.pids").read_text().split()[0])
        gpus.gpus[gpu]["process_memory"] = {str(pid): 30 << 30}
    gpus.write()

    # status and the exporter show each GPU of an engine, with the engine's memory on it
    big_a = wait_for(lambda: (g := detail(d)["big-a"]["gpus"])
                     and g[0]["engine_memory_bytes"] == 30 << 30 and g, 10, "per-GPU status")
    assert [g["index"] for g in big_a] == [0, 1]
    assert [g["index"] for g in detail(d)["small-b"]["gpus"]] == [5]
    assert detail(d)["big-a"]["signals"]["engine_gpu_memory_bytes"] == 60 << 30
    text = httpx.get(f"{d.exporter_url}/metrics", timeout=10).text
    assert 'vllm_supervisor_gpu_device_temperature_celsius{engine="big-b",gpu="3"} 55.0' \
        in text
    assert 'vllm_supervisor_gpu_device_engine_memory_bytes{engine="small-d",gpu="7"}' in text
    # today's engine-wide series stay as they were
    assert 'vllm_supervisor_gpu_temperature_celsius{engine="small-a"} 55.0' in text
    shown = d.ctl("status", "--engine", "small-b").stdout
    assert "gpu 5      55 C (slowdown at 89 C), 250 W of 700 W" in shown

    # GPU 5 runs 3 C below its slowdown mark: small-b alone is throttled
    gpus.set(5, temperature_c=86.0)
    dec = wait_for(lambda: decisions_by_engine(d).get("small-b"), 20, "small-b's decision")
    assert dec[0]["rule"] == "thermal" and dec[0]["evidence"]["gpu"] == 5
    assert dec[0]["evidence"]["gpu_readings"]["temperature_c"] == 86.0
    gpus.set(5, temperature_c=55.0)
    wait_for(lambda: detail(d)["small-b"]["state"] == "RUNNING"
             and detail(d)["small-b"]["throttle_level"] == 1, 20, "small-b throttled")
    assert set(decisions_by_engine(d)) == {"small-b"}

    # an XID that needs a GPU reset on GPU 3: big-b (GPUs 2-3) is held down, no other
    gpus.set(3, xids=[79])
    wait_for(lambda: detail(d)["big-b"]["state"] == "FATAL", 20, "big-b held down")
    gpus.set(3, xids=[])
    fatal = detail(d)["big-b"]["fatal_reason"]
    assert "XID 79" in fatal and "on GPU 3" in fatal
    xid = [e for e in d.events() if e["event"] == "xid"]
    # (the scripted file says it again at each sample until it is rewritten)
    assert {(e["engine"], e["gpu"], e["xid"]) for e in xid} == {("big-b", 3, 79)}
    assert set(decisions_by_engine(d)) == {"small-b", "big-b"}
    others = {n: s["state"] for n, s in detail(d).items() if n != "big-b"}
    assert set(others.values()) == {"RUNNING"}, others
    # "big" is still served, by big-a
    r = httpx.post(f"http://{cfg['proxy']['listen']}/v1/completions",
                   json={"model": "big", "prompt": "hi", "max_tokens": 2}, timeout=30)
    assert r.status_code == 200 and r.headers["x-supervisor-engine"] == "big-a"
    # as NVML forgets a process once it is gone: the daemon's stop waits for each
    # engine's GPUs to be released (up to engine.gpu_release_timeout_s, 60 s), and the
    # scripted GPUs would otherwise list the engines' memory for ever
    for gpu in OWNERS:
        gpus.gpus[gpu]["process_memory"] = {}
    gpus.write()


def test_a_two_gpu_engine_restarts_only_once_both_gpus_are_released(daemon_factory,
                                                                     tmp_path):
    gpus = Gpus(tmp_path / "gpus.json")
    cfg = eight_gpu_config(tmp_path, gpus.path)
    cfg = {k: v for k, v in cfg.items() if k in (
        "engines.big-a", "daemon", "audit", "log", "exporter", "gpu", "proxy", "restart")}
    cfg["engines.big-a"].pop("fallback", None)
    d = daemon_factory(cfg)
    wait_for(lambda: d.status().get("state") == "RUNNING", 30, "big-a serving")
    old = int((tmp_path / "big-a.pids").read_text().split()[0])
    # NVML keeps listing the old engine on GPU 1 (its second GPU) after it is gone
    gpus.set(0, process_memory={str(old): 30 << 30})
    gpus.set(1, process_memory={str(old): 30 << 30})
    assert d.ctl("restart", "--reason", "test").returncode == 0
    wait_for(lambda: not Path(f"/proc/{old}").exists(), 20, "the old engine gone")
    gpus.set(0, process_memory={})
    # its memory on GPU 0 is free, on GPU 1 not: no new engine yet
    wait_for(lambda: d.status()["state"] in ("STARTING", "DRAINING", "STOPPING"), 10,
             "the restart under way")
    assert wait_for(lambda: d.status()["stop_deadline_in_s"] is not None, 10, "a deadline")
    pids_before = (tmp_path / "big-a.pids").read_text().split()
    time.sleep(2)  # (nothing to wait for: proving that nothing happens)
    assert (tmp_path / "big-a.pids").read_text().split() == pids_before
    gpus.set(1, process_memory={})
    st = d.wait_state("RUNNING", 30, extra=lambda s: s["restarts"] == 1)
    assert st["pid"] != old
