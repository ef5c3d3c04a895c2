"""A sleeping engine's backup of its weights in registered, huge-page host memory
(supervisor/engine/process/sleep_backup.py): what an engine started with
`--enable-sleep-mode` is given, what the operator's own environment keeps, and a real
spawn's environment as the engine's process reads it."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

from supervisor.engine.process import process as eng
from supervisor.engine.process import sleep_backup
from supervisor.settings.sections import EngineConfig

SLEEPS = ["vllm", "serve", "m", "--enable-sleep-mode"]
OURS = {"PYTORCH_CUDA_ALLOC_CONF": "pinned_use_cuda_host_register:True,"
                                  "pinned_num_register_threads:8",
        "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}


def test_an_engine_that_can_sleep_gets_registered_huge_pages() -> None:
    assert sleep_backup.env(SLEEPS, {}) == OURS
    # either spelling of the flag, with a value too
    assert sleep_backup.env(["vllm", "serve", "m", "--enable_sleep_mode"], {}) == OURS
    assert sleep_backup.env(["vllm", "serve", "m", "--enable-sleep-mode=true"], {}) == OURS


def test_an_engine_that_cannot_sleep_gets_nothing() -> None:
    assert sleep_backup.env(["vllm", "serve", "m", "--max-num-seqs", "8"], {}) == {}
    assert sleep_backup.env(["vllm", "serve", "m", "--enable-sleep-modes"], {}) == {}


def test_the_operators_own_options_are_kept_and_win() -> None:
    # added to what is there
    got = sleep_backup.env(SLEEPS, {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512",
                                    "GLIBC_TUNABLES": "glibc.malloc.arena_max=2"})
    assert got == {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512,"
                                              "pinned_use_cuda_host_register:True,"
                                              "pinned_num_register_threads:8",
                   "GLIBC_TUNABLES": "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"}
    # an option the operator names is theirs, on or off: nothing to set
    off = {"PYTORCH_CUDA_ALLOC_CONF": "pinned_use_cuda_host_register:False",
           "GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}
    assert sleep_backup.env(SLEEPS, off) == {}
    # torch's newer name, where it is set, is the one torch reads
    got = sleep_backup.env(SLEEPS, {"PYTORCH_ALLOC_CONF": "expandable_segments:False"})
    assert got["PYTORCH_ALLOC_CONF"] == ("expandable_segments:False,"
                                         "pinned_use_cuda_host_register:True,"
                                         "pinned_num_register_threads:8")
    assert "PYTORCH_CUDA_ALLOC_CONF" not in got


def environ_of(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(entry.split("=", 1) for entry in raw.decode().split("\0") if "=" in entry)


def test_a_spawned_engine_runs_with_them_and_the_operators_env_wins(tmp_path) -> None:
    """A real spawn through the daemon's spawn spec: what the process itself was given."""
    idle = [sys.executable, "-c", "import sys, time; time.sleep(60)"]

    async def spawned(cfg: EngineConfig) -> dict[str, str]:
        engine = await eng.spawn_engine(eng.build_spawn_spec(cfg, {"PATH": "/usr/bin"}), 1,
                                        0.0, cfg)
        try:
            return environ_of(engine.pid)
        finally:
            os.killpg(engine.pgid, signal.SIGKILL)
            await engine.proc.wait()

    sleeping = EngineConfig(command=idle, args=["--enable-sleep-mode"], cwd=str(tmp_path))
    env = asyncio.run(spawned(sleeping))
    assert {k: env.get(k) for k in OURS} == OURS
    own = EngineConfig(command=idle, args=["--enable-sleep-mode"], cwd=str(tmp_path),
                       env={"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"})
    env = asyncio.run(spawned(own))
    assert env["GLIBC_TUNABLES"] == "glibc.malloc.hugetlb=0"
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == OURS["PYTORCH_CUDA_ALLOC_CONF"]
    awake = EngineConfig(command=idle, cwd=str(tmp_path))
    env = asyncio.run(spawned(awake))
    assert "GLIBC_TUNABLES" not in env and "PYTORCH_CUDA_ALLOC_CONF" not in env


def test_a_host_without_transparent_huge_pages_is_said(tmp_path) -> None:
    assert sleep_backup.asks_huge_pages(OURS)
    assert not sleep_backup.asks_huge_pages({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"})
    assert not sleep_backup.asks_huge_pages({})
    setting = tmp_path / "enabled"
    setting.write_text("always madvise [never]\n")
    why = sleep_backup.refused(sleep_backup.thp_setting(setting))
    assert why is not None and "enabled: never" in why and "madvise" in why
    for given in ("always [madvise] never", "[always] madvise never"):
        setting.write_text(given + "\n")
        assert sleep_backup.refused(sleep_backup.thp_setting(setting)) is None
    # a kernel without the feature: nothing to say
    assert sleep_backup.thp_setting(tmp_path / "missing") == ""
    assert sleep_backup.refused("") is None
