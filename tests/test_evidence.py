"""Evidence bundles: stacks read from real processes (running, stopped, gone), the bound
on py-spy, retention, and the listing."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from supervisor.watchdog.evidence import (
    EvidenceRequest,
    capture,
    find_py_spy,
    list_bundles,
    prune,
)
from tests.harness import wait_for

# (the file it touches says it is in wedged(): the stack the tests read exists by then)
SLEEPER = ("import pathlib, sys, time\ndef wedged():\n    pathlib.Path(sys.argv[1]).touch()\n"
           "    time.sleep(600)\nwedged()\n")


@pytest.fixture
def sleeper(tmp_path_factory):
    inside = tmp_path_factory.mktemp("sleeper") / "in-wedged"
    p = subprocess.Popen([sys.executable, "-c", SLEEPER, str(inside)])
    wait_for(inside.exists, 10, "the sleeper to reach wedged()")
    yield p
    p.kill()
    p.wait()


def request(pids: list[int], rule: str = "no_progress", wall: float | None = None
            ) -> EvidenceRequest:
    return EvidenceRequest(reason="no progress for 6 s", rule=rule, engine_pid=pids[0],
                           pids=pids, log_lines=["(APIServer pid=1) INFO last words"],
                           signals={"engine_stalled_s": 6.0, "kv_cache_usage": None},
                           gpu=None, wall=wall if wall is not None else time.time())


def test_a_bundle_holds_stacks_log_lines_and_signals(tmp_path, sleeper):
    py_spy = find_py_spy()
    assert py_spy is not None  # installed with the supervisor
    b = asyncio.run(capture(request([sleeper.pid]), tmp_path, 5, 10.0, py_spy))
    assert b.error is None and b.stacks == {sleeper.pid: "ok"}
    path = Path(b.path)
    assert "wedged" in (path / "stacks.txt").read_text()
    assert (path / "engine.log").read_text() == "(APIServer pid=1) INFO last words\n"
    doc = json.loads((path / "bundle.json").read_text())
    assert doc["signals"] == {"engine_stalled_s": 6.0, "kv_cache_usage": None}
    assert doc["processes"][0]["pid"] == sleeper.pid and doc["rule"] == "no_progress"
    assert b.bytes == sum(f.stat().st_size for f in path.iterdir())


def test_a_stopped_process_is_read_without_resuming_it_and_a_gone_one_is_named(
        tmp_path, sleeper):
    os.kill(sleeper.pid, signal.SIGSTOP)
    wait_for(lambda: psutil.Process(sleeper.pid).status() == psutil.STATUS_STOPPED, 10,
             "the sleeper stopped", interval=0.01)
    try:
        b = asyncio.run(capture(request([sleeper.pid, 999_999_999]), tmp_path, 5, 10.0,
                                find_py_spy()))
    finally:
        os.kill(sleeper.pid, signal.SIGCONT)
    assert b.stacks[sleeper.pid].startswith("ok (the process is stopped")
    assert b.stacks[999_999_999] == "skipped: the process is gone"
    assert "wedged" in (Path(b.path) / "stacks.txt").read_text()


def test_py_spy_is_bounded_and_its_absence_is_said(tmp_path, sleeper):
    slow = tmp_path / "slow-py-spy"
    slow.write_text("#!/bin/sh\nsleep 30\n")
    slow.chmod(0o755)
    t0 = time.monotonic()
    b = asyncio.run(capture(request([sleeper.pid]), tmp_path / "ev", 5, 1.0, str(slow)))
    assert time.monotonic() - t0 < 10  # (a bound, not a benchmark: 30 s otherwise)
    assert b.stacks[sleeper.pid] == "failed: py-spy took longer than the evidence bound"
    assert (Path(b.path) / "bundle.json").exists()  # the rest is kept all the same
    b = asyncio.run(capture(request([sleeper.pid]), tmp_path / "ev", 5, 1.0, None))
    assert b.stacks[sleeper.pid] == "skipped: py-spy is not installed"


def test_a_refused_read_is_skipped_with_py_spys_reason(tmp_path, sleeper):
    refusing = tmp_path / "refusing-py-spy"
    refusing.write_text("#!/bin/sh\necho 'Permission denied (os error 1)' >&2\nexit 1\n")
    refusing.chmod(0o755)
    b = asyncio.run(capture(request([sleeper.pid]), tmp_path / "ev", 5, 5.0, str(refusing)))
    assert b.stacks[sleeper.pid] == ("skipped: not permitted to read the process "
                                     "(Permission denied (os error 1))")


def test_only_the_newest_bundles_are_kept_and_listed_oldest_first(tmp_path):
    base = 1_790_000_000.0
    for i in range(5):
        b = asyncio.run(capture(request([999_999_999], wall=base + i), tmp_path, 3, 5.0,
                                None))
        assert b.error is None
    names = [b["name"] for b in list_bundles(tmp_path)]
    assert names == [request([1], wall=base + i).name for i in (2, 3, 4)]  # oldest went
    same = asyncio.run(capture(request([999_999_999], wall=base + 4), tmp_path, 10, 5.0,
                               None))
    assert same.path.endswith("-no_progress-2")  # one second, two bundles: both kept
    listed = list_bundles(tmp_path)
    assert listed[-1]["rule"] == "no_progress" and listed[-1]["bytes"] > 0
    assert prune(tmp_path, 1) == [e["name"] for e in listed[:-1]]
    assert list_bundles(tmp_path / "nothing-here") == []


def test_vllms_own_dumps_of_the_tree_are_copied_in_and_named(tmp_path, sleeper):
    """vLLM 0.33's dumps (`--watchdog-config`): from the daemon's folder of the engine's
    start all of them; from the operator's own folder only the tree's processes'. py-spy
    reads every process all the same (the API server never dumps; a dump may be old)."""
    dumps = tmp_path / "dumps"
    dumps.mkdir()
    core = dumps / f"VLLM_STACK_DUMP_for_engine_0_{sleeper.pid}.log"
    core.write_text("\n>>> Call stack dump #1 at Mon Dec  1 10:00:00 2026 due to feed "
                    "timeout\n\nThread 0x01 (most recent call first):\n  File \"core.py\", "
                    "line 7 in step\n\n" + "=" * 64 + "\n")
    other = dumps / "VLLM_STACK_DUMP_for_engine_0_999999999.log"
    other.write_text(core.read_text())
    req = dataclasses.replace(request([sleeper.pid]), dump_dir=str(dumps))
    b = asyncio.run(capture(req, tmp_path / "ev", 5, 10.0, find_py_spy()))
    assert b.error is None and b.stacks == {sleeper.pid: "ok"}
    copied = {Path(d["file"]).name for d in b.vllm_dumps}
    assert copied == {core.name, other.name}  # the daemon's own folder: this start's
    mine = next(d for d in b.vllm_dumps if d["pid"] == sleeper.pid)
    assert Path(mine["file"]).read_text() == core.read_text()
    assert mine["file"].startswith(b.path) and mine["source"] == str(core)
    assert mine["last"].endswith("due to feed timeout") and mine["dumps"] == 1
    assert b.as_dict()["vllm_dumps"] == [dict(d) for d in b.vllm_dumps]  # (the audit's)
    doc = json.loads((Path(b.path) / "bundle.json").read_text())
    assert {Path(d["file"]).name for d in doc["vllm_dumps"]} == copied
    assert b.bytes == sum(f.stat().st_size for f in Path(b.path).rglob("*") if f.is_file())
    (listed,) = list_bundles(tmp_path / "ev")
    assert sorted(listed["vllm_dumps"]) == sorted(d["file"] for d in b.vllm_dumps)
    # the operator's folder holds other engines' dumps too: the tree's pids pick
    theirs = dataclasses.replace(req, dump_dir_owned=False)
    b = asyncio.run(capture(theirs, tmp_path / "ev", 5, 10.0, None))
    assert [Path(d["file"]).name for d in b.vllm_dumps] == [core.name]
    # an engine without them: nothing copied, nothing said
    b = asyncio.run(capture(request([sleeper.pid]), tmp_path / "ev", 5, 10.0, None))
    assert b.vllm_dumps == [] and not (Path(b.path) / "vllm-stack-dumps").exists()
