"""Each engine's compile cache under the daemon's state directory (issue 37, point 3):
the vLLM version its command would run, asked of its own interpreter; one folder per
version, kept across restarts, older versions dropped; its size in `status`."""

from __future__ import annotations

import asyncio
import os
import stat
import sys
import time
from pathlib import Path

from supervisor.engine.startup import compile_cache as cc
from tests.harness import wait_for, write_config
from tests.test_proxy import proxy_config


def fake_vllm(site: Path, version: str) -> Path:
    """A site folder where vLLM `version` is installed, as importlib.metadata sees it."""
    info = site / f"vllm-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
    return site


def script(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def test_the_interpreter_of_a_command_is_itself_or_its_scripts(tmp_path: Path) -> None:
    env = {"PATH": os.environ["PATH"]}
    assert cc.interpreter([sys.executable, "-m", "vllm"], env) == sys.executable
    venv_script = script(tmp_path / "vllm", f"#!{sys.executable}\nprint('serve')\n")
    assert cc.interpreter([str(venv_script), "serve", "m"], env) == sys.executable
    by_env = script(tmp_path / "vllm-env", "#!/usr/bin/env python3\n")
    found = cc.interpreter([str(by_env)], env)
    assert found is not None and Path(found).name == "python3"
    binary = tmp_path / "engine"
    binary.write_bytes(b"\x7fELF\x02\x01")
    assert cc.interpreter([str(binary)], env) is None
    assert cc.interpreter([str(tmp_path / "missing")], env) is None


def test_the_version_is_asked_of_the_engines_own_environment(tmp_path: Path) -> None:
    site = fake_vllm(tmp_path / "site", "9.9.9")
    argv = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", "m"]
    env = {**os.environ, "PYTHONPATH": str(site)}
    assert asyncio.run(cc.installed_version(argv, env)) == "9.9.9"
    # no vLLM where it runs: unknown, never a failed start
    bare = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    assert asyncio.run(cc.installed_version(argv, bare)) is None
    # an interpreter that never answers is given up on in time
    slow = script(tmp_path / "python3", "#!/bin/sh\nsleep 30\n")
    t0 = time.monotonic()
    assert asyncio.run(cc.installed_version([str(slow)], env, timeout_s=0.5)) is None
    assert time.monotonic() - t0 < 10


def test_the_two_versions_last_started_are_kept(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    for age, name in enumerate(("0.33.0", "0.26.0", "0.25.0")):
        (root / name / "torch_compile_cache").mkdir(parents=True)
        os.utime(root / name, (time.time() - 100 * (age + 1),) * 2)
    env = {**os.environ, "PYTHONPATH": str(fake_vllm(tmp_path / "site", "0.34.0"))}
    info = asyncio.run(cc.prepare(env, [sys.executable], None, root, "e", time.monotonic))
    assert info is not None and info.version == "0.34.0" and info.bytes == 0
    assert info.dir == str(root / "0.34.0")
    assert sorted(p.name for p in root.iterdir()) == ["0.33.0", "0.34.0"]
    # the operator's own root wins: nothing made, nothing dropped
    own = {**env, "VLLM_CACHE_ROOT": str(tmp_path / "mine")}
    assert asyncio.run(cc.prepare(own, [sys.executable], None, root, "e",
                                  time.monotonic)) is None
    assert sorted(p.name for p in root.iterdir()) == ["0.33.0", "0.34.0"]
    # a version that cannot be told: the folder last started, not a cold one
    mute = script(tmp_path / "bin-python3", "#!/bin/sh\nexit 1\n")
    again = asyncio.run(cc.prepare({"PATH": os.environ["PATH"]}, [str(mute)], None, root,
                                   "e", time.monotonic))
    assert again is not None and again.dir == str(root / "0.34.0") and again.version is None
    # a name no folder can have is made safe
    assert cc.folder_for(root, "1.0/../x y").name == "1.0_.._x_y"
    assert cc.folder_for(root, None).name == "unknown"


def test_an_engine_keeps_its_cache_across_restarts_and_an_upgrade_starts_a_new_one(
        daemon_factory, tmp_path):
    cfg = proxy_config(tmp_path)
    cfg["engine"]["env"]["PYTHONPATH"] = str(fake_vllm(tmp_path / "v1", "0.26.0"))
    d = daemon_factory(cfg)
    d.wait_state("RUNNING", 30)
    folder = Path(cfg["audit"]["path"]).parent / "vllm-cache" / "default" / "0.26.0"
    starts = folder / "torch_compile_cache" / "fake" / "starts.log"
    cache = wait_for(lambda: (c := d.status()["compile_cache"]) and c["bytes"] and c, 20,
                     "the cache measured after the start")
    assert cache["dir"] == str(folder) and cache["vllm_version"] == "0.26.0"
    assert cache["bytes"] == starts.stat().st_size
    assert d.ctl("restart").returncode == 0
    wait_for(lambda: len(starts.read_text().splitlines()) == 2, 30,
             "the restarted engine in the same folder")
    # an upgrade: another vLLM where the command runs, a folder of its own; the old kept
    cfg["engine"]["env"]["PYTHONPATH"] = str(fake_vllm(tmp_path / "v2", "0.33.0"))
    write_config(d.config, cfg)
    assert d.ctl("reload").returncode == 0
    assert d.ctl("restart").returncode == 0
    wait_for(lambda: (d.status()["compile_cache"] or {}).get("vllm_version") == "0.33.0",
             30, "the upgraded engine's own folder")
    assert sorted(p.name for p in folder.parent.iterdir()) == ["0.26.0", "0.33.0"]
    assert len(starts.read_text().splitlines()) == 2
