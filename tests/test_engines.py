"""Several engines under one daemon, through the real daemon and fake engines: routing by
model, a fallback that takes a down engine's requests, engines that fail alone, control
by `--engine`, labelled exporter series, and engines added and removed by reload."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.harness import alive, fake_engine_config, free_port, wait_for, write_config


def engines_config(tmp: Path, **engines: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """One fake engine per name, serving the model of that name, behind the proxy."""
    cfg = fake_engine_config(tmp, canary={"period_s": 0.5, "timeout_s": 2.0})
    base = cfg.pop("engine")
    for name, extra in engines.items():
        fake = extra.pop("fake", [])
        cfg[f"engines.{name}"] = {
            **base, "port": free_port(),
            "command": [*base["command"], "--child", "--served-model-name", name, *fake],
            "env": {"FAKE_ENGINE_PIDFILE": str(tmp / f"{name}.pids")}, **extra}
    cfg["proxy"] = {"enabled": True, "listen": f"127.0.0.1:{free_port()}"}
    return cfg


def ask(cfg: dict[str, Any], model: str, timeout: float = 30) -> httpx.Response:
    return httpx.post(f"http://{cfg['proxy']['listen']}/v1/completions",
                      json={"model": model, "prompt": "hi", "max_tokens": 2}, timeout=timeout)


def engines_of(d: Any) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in d.status()["engines"]}


def all_serving(d: Any, *names: str) -> bool:
    lines = engines_of(d)
    return all(lines.get(n, {}).get("serving") for n in names)


def pids(tmp: Path, name: str) -> list[int]:
    return [int(x) for x in (tmp / f"{name}.pids").read_text().split()]


def samples(d: Any) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = httpx.get(d.exporter_url + "/metrics", timeout=10).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def test_requests_go_by_model_and_a_fallback_takes_a_killed_engines_requests(
        daemon_factory, tmp_path):
    # "big" starts slowly (2 s), so that its restart leaves a window the fallback fills
    cfg = engines_config(tmp_path, big={"fallback": "small", "fake": ["--startup-delay", "2"]},
                         small={})
    d = daemon_factory(cfg)
    wait_for(lambda: all_serving(d, "big", "small"), 30, "both engines to serve")

    r = ask(cfg, "big")
    assert r.status_code == 200 and r.headers["x-supervisor-engine"] == "big"
    assert r.json()["model"] == "big"
    r = ask(cfg, "small")
    assert r.status_code == 200 and r.headers["x-supervisor-engine"] == "small"
    r = ask(cfg, "nope")
    assert r.status_code == 404 and "models: big, small" in r.json()["error"]["message"]
    listed = httpx.get(f"http://{cfg['proxy']['listen']}/v1/models", timeout=10).json()
    assert [m["id"] for m in listed["data"]] == ["big", "small"]

    # a steady load on both models while big's engine is SIGKILLed
    results: list[tuple[str, int, str, float]] = []
    stop = threading.Event()

    def client(model: str) -> None:
        while not stop.is_set():
            try:
                r = ask(cfg, model)
                results.append((model, r.status_code, r.headers.get("x-supervisor-engine", ""),
                                time.monotonic()))
            except httpx.HTTPError as exc:
                results.append((model, 0, repr(exc), time.monotonic()))

    threads = [threading.Thread(target=client, args=(m,)) for m in ("big", "big", "small")]
    for t in threads:
        t.start()
    try:
        wait_for(lambda: {r[0] for r in results if r[1] == 200} == {"big", "small"}, 10,
                 "the load answered on both models")
        killed_at = time.monotonic()
        for pid in pids(tmp_path, "big"):
            os.kill(pid, signal.SIGKILL)
        wait_for(lambda: engines_of(d)["big"]["restarts"] >= 1, 20, "big to restart")
        wait_for(lambda: all_serving(d, "big"), 30, "big to serve again")
        back_at = time.monotonic()
        wait_for(lambda: any(r[0] == r[2] == "big" and r[3] > back_at for r in results), 10,
                 "a request for big answered by big again")
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=60)
    failed = [r for r in results if r[1] != 200]
    assert not failed, failed[:5]
    big = [r for r in results if r[0] == "big"]
    by_fallback = [r for r in big if r[2] == "small" and r[3] > killed_at]
    assert by_fallback, "no request for big was answered by its fallback"
    assert big[-1][2] == "big"  # back on its own engine once it serves
    assert all(r[2] == "small" for r in results if r[0] == "small")
    st = engines_of(d)
    assert st["small"]["restarts"] == 0 and st["small"]["state"] == "RUNNING"

    m = samples(d)
    assert m[("vllm_supervisor_engine_state", (("engine", "big"), ("state", "RUNNING")))] == 1
    assert m[("vllm_supervisor_engine_restarts_total",
              (("engine", "big"), ("reason", "crash")))] == 1
    assert m[("vllm_supervisor_engine_restarts_total",
              (("engine", "small"), ("reason", "crash")))] == 0
    assert ("vllm_supervisor_proxy_in_flight", (("engine", "small"),)) in m


def test_control_names_the_engine_once_there_are_several(daemon_factory, tmp_path):
    cfg = engines_config(tmp_path, a={}, b={})
    d = daemon_factory(cfg)
    wait_for(lambda: all_serving(d, "a", "b"), 30, "both engines to serve")
    refused = d.ctl("restart")
    assert refused.returncode == 1
    assert "there are 2 engines (a, b); name one with --engine" in refused.stderr
    assert "no engine named 'c'" in d.ctl("drain", "--engine", "c").stderr
    out = d.ctl("status").stdout
    assert out.splitlines()[0].startswith("ENGINE") and "\n== a\n" in out and "\n== b\n" in out
    assert d.ctl("restart", "--engine", "b", "--reason", "test").returncode == 0
    wait_for(lambda: engines_of(d)["b"]["restarts"] == 1 and all_serving(d, "b"), 30,
             "b to restart")
    assert engines_of(d)["a"]["restarts"] == 0
    one = json.loads(d.ctl("status", "--engine", "b", "--json").stdout)
    assert one["engine_name"] == "b" and one["restarts"] == 1
    events = [json.loads(x) for x in d.ctl("events", "--engine", "b", "--json", "-n", "100")
              .stdout.splitlines()]
    assert events and all(e.get("engine", "b") == "b" for e in events)
    assert any(e.get("event") == "control" and e.get("command") == "restart" for e in events)


def test_one_engine_fatal_leaves_the_other_serving_and_ready_waits_for_both(
        daemon_factory, tmp_path):
    cfg = engines_config(tmp_path, ok={}, broken={"fake": ["--fail-boot"]})
    cfg["restart"] = {"backoff_initial_s": 0.1, "backoff_max_s": 0.2, "boot_failures_max": 2}
    d = daemon_factory(cfg)
    # (either may come first: the broken one gives up within 0.3 s of backoff, the other
    # serves once its fake engine is up, later on a loaded machine)
    wait_for(lambda: (e := engines_of(d))["broken"]["state"] == "FATAL" and e["ok"]["serving"],
             30, "broken to give up, and ok to serve beside it")
    assert engines_of(d)["broken"]["state"] == "FATAL" and engines_of(d)["ok"]["serving"]
    assert ask(cfg, "ok").status_code == 200
    r = ask(cfg, "broken")  # no fallback: refused at once, the engine is FATAL
    assert r.status_code == 503


def test_reload_adds_an_engine_and_removing_one_drains_and_stops_it(daemon_factory,
                                                                     tmp_path):
    cfg = engines_config(tmp_path, a={})
    d = daemon_factory(cfg)
    wait_for(lambda: all_serving(d, "a"), 30, "a to serve")
    first = pids(tmp_path, "a")

    added = engines_config(tmp_path, b={})
    cfg["engines.b"] = added["engines.b"]
    write_config(d.config, cfg)
    reply = d.ctl("reload")
    assert reply.returncode == 0 and "engines.b" in reply.stdout
    wait_for(lambda: all_serving(d, "a", "b"), 30, "b to serve")
    assert ask(cfg, "b").headers["x-supervisor-engine"] == "b"

    del cfg["engines.a"]
    write_config(d.config, cfg)
    assert d.ctl("reload").returncode == 0
    wait_for(lambda: list(engines_of(d)) == ["b"], 30, "a to be removed")
    wait_for(lambda: not alive(first), 10, "a's processes to be gone")
    r = ask(cfg, "a")
    assert r.status_code == 404 and "models: b" in r.json()["error"]["message"]
    assert ask(cfg, "b").status_code == 200
    kinds = [e["event"] for e in d.events()]
    assert "engine_added" in kinds and "engine_removed" in kinds


def test_replicas_of_one_model_share_it_and_a_held_request_takes_the_first_to_serve(
        daemon_factory, tmp_path):
    # two engines serving "m": r1 never boots, r2 boots slowly; a request sent before
    # either serves is held, and answered by whichever admits it first (r2), not left
    # waiting on r1's gate
    cfg = engines_config(tmp_path, r1={"models": ["m"], "fake": ["--fail-boot"]},
                         r2={"models": ["m"], "fake": ["--startup-delay", "3"]})
    for name in ("r1", "r2"):  # both answer to "m"
        cmd = cfg[f"engines.{name}"]["command"]
        cmd[cmd.index("--served-model-name") + 1] = "m"
    cfg["restart"] = {"backoff_initial_s": 0.5, "backoff_max_s": 1.0, "boot_failures_max": 50}
    d = daemon_factory(cfg)
    wait_for(lambda: engines_of(d), 10, "the daemon to answer")
    r = ask(cfg, "m")
    assert r.status_code == 200 and r.headers["x-supervisor-engine"] == "r2"
    assert engines_of(d)["r1"]["state"] in ("BACKOFF", "STARTING")


def test_each_engine_gets_the_gpus_it_names_and_no_other(daemon_factory, tmp_path):
    """`gpus` is given to the engine: CUDA counting as NVML does (PCI_BUS_ID) and only
    the GPUs named, whatever the daemon's own environment says; an engine without `gpus`
    sees what the daemon sees."""
    cfg = engines_config(tmp_path, a={"gpus": [2, 0], "share_gpus": True},
                         b={"gpus": [], "share_gpus": True})
    for name in ("a", "b"):
        cfg[f"engines.{name}"]["env"]["FAKE_ENGINE_ENVFILE"] = str(tmp_path / f"{name}.env")
    d = daemon_factory(cfg, env={"CUDA_VISIBLE_DEVICES": "7"})
    wait_for(lambda: all_serving(d, "a", "b"), 30, "both engines serving")
    a = json.loads((tmp_path / "a.env").read_text())
    b = json.loads((tmp_path / "b.env").read_text())
    assert a["CUDA_VISIBLE_DEVICES"] == "2,0" and a["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert b["CUDA_VISIBLE_DEVICES"] == "7" and "CUDA_DEVICE_ORDER" not in b
