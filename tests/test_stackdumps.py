"""vLLM 0.33's stack dumps (`--watchdog-config`, supervisor/watchdog/stackdumps.py): which
versions get the flag, the operator's own setting read in every form vLLM takes, the
timeout under the daemon's own stall deadline, the folders kept bounded, and the dumps
read back for evidence."""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path

import pytest

from supervisor.watchdog import stackdumps as sd
from supervisor.watchdog.rules import DEFAULT_RULES, RuleConfig

CANARY = {"canary_enabled": True, "canary_period_s": 10.0, "canary_timeout_s": 5.0}


def dump(path: Path, seq: int, reason: str = "feed timeout", body: str = "") -> None:
    """One dump appended as vLLM's ThreadedWatchDog.dump_stack writes it."""
    with path.open("a") as f:
        f.write(f"\n>>> Call stack dump #{seq} at Mon Dec  1 10:00:0{seq % 10} 2026 due to "
                f"{reason}\n\n")
        f.write(body or 'Thread 0x01 (most recent call first):\n  File "core.py", line 1\n')
        f.write("\n" + "=" * 64 + "\n")


@pytest.mark.parametrize(("version", "has"), [
    ("0.33.0", True), ("0.33.1rc1", True), ("0.34.0+cu130", True), ("1.0.0", True),
    ("0.32.0", False), ("0.32.9.dev12+gabc", False), ("0.26.0", False), (None, False),
    ("unknown", False)])
def test_only_vllm_033_and_later_get_the_flag(version, has):
    assert sd.has_watchdog(version) is has


def test_the_operators_own_setting_is_read_in_every_form_vllm_takes():
    assert sd.operator_config(["serve", "m", "--max-num-seqs", "4"]) is None
    doc = {"timeout": 60, "dump_dir": "/var/dumps"}
    assert sd.operator_config(["--watchdog-config", json.dumps(doc)]) == doc
    assert sd.operator_config([f"--watchdog_config={json.dumps(doc)}"]) == doc
    assert sd.operator_config(["--watchdog-config.dump_dir", "/d",
                               "--watchdog-config.timeout=20"]) == {"dump_dir": "/d",
                                                                    "timeout": 20}
    # vLLM will refuse it; the daemon only knows it is the operator's
    assert sd.operator_config(["--watchdog-config", "{oops"]) == {}
    assert sd.operator_config(["--watchdog-configs", "x"]) is None  # another flag


def test_the_default_rules_decide_a_stall_in_6_s_and_the_dump_comes_before():
    deadline = sd.stall_deadline_s(DEFAULT_RULES, **CANARY)
    assert deadline == 6.0  # no_progress: engine_stalled_s >= 6
    timeout, interval = sd.timing(deadline)
    assert (timeout, interval) == (4, 1) and timeout + interval < deadline


def test_the_deadline_follows_the_rules_that_take_an_engine_down():
    rules = dict(DEFAULT_RULES)
    rules["no_progress"] = dataclasses.replace(rules["no_progress"], enabled=False)
    # hang: the third canary failure (5 s + 2 x 15 s) or 30 s of frozen metrics
    assert sd.stall_deadline_s(rules, **CANARY) == 30.0
    assert sd.stall_deadline_s(rules, canary_enabled=True, canary_period_s=2.0,
                               canary_timeout_s=1.0) == 1.0 + 2 * 3.0
    assert sd.stall_deadline_s(
        {"hang": RuleConfig(when="canary_failures > 1", action="restart_now")},
        **CANARY) == 5.0 + 15.0  # (> 1: the second)
    assert sd.stall_deadline_s(
        {"hang": RuleConfig(when="canary_failures >= 3", action="restart_now")},
        canary_enabled=False, canary_period_s=10, canary_timeout_s=5) is None
    slow = {"stall": RuleConfig(when="engine_stalled_s >= 20 and requests_waiting > 0",
                                action="restart", for_s=10),
            "alert_only": RuleConfig(when="engine_stalled_s >= 1", action="alert"),
            "off": RuleConfig(when="engine_stalled_s >= 2", action="restart", enabled=False)}
    assert sd.stall_deadline_s(slow, **CANARY) == 30.0
    assert sd.stall_deadline_s({}, **CANARY) is None


@pytest.mark.parametrize(("deadline", "expected"), [
    (6.0, (4, 1)), (30.0, (20, 5)), (300.0, (200, 10)), (0.5, (1, 1)),
    (None, (sd.DEFAULT_TIMEOUT_S, 5))])
def test_the_timeout_is_whole_seconds_under_the_deadline(deadline, expected):
    timeout, interval = sd.timing(deadline)
    assert (timeout, interval) == expected
    assert isinstance(timeout, int) and isinstance(interval, int) and timeout > 0
    if deadline is not None and deadline >= 2:
        assert timeout + interval < deadline


def test_the_daemons_dumps_for_033_and_the_operators_own_else(tmp_path):
    folder = tmp_path / "stack-dumps" / "default" / "x"
    mine = sd.plan(["vllm", "serve", "m"], "/srv", "0.33.0", 6.0, folder)
    assert mine is not None and mine.owned and mine.dir == str(folder)
    flag, value = mine.flag()
    assert flag == "--watchdog-config"
    assert json.loads(value) == {"timeout": 4, "check_interval": 1, "dump_dir": str(folder)}
    assert sd.plan(["vllm", "serve", "m"], "/srv", "0.32.0", 6.0, folder) is None
    assert sd.plan(["vllm", "serve", "m"], "/srv", None, 6.0, folder) is None
    theirs = sd.plan(["vllm", "--watchdog-config", '{"dump_dir": "dumps", "timeout": 9}'],
                     "/srv", "0.33.0", 6.0, folder)
    assert theirs == sd.StackDumps("/srv/dumps", "operator", 9, 10) and theirs.flag() == []
    off = sd.plan(["vllm", "--watchdog-config", '{"timeout": 9}'], "/srv", None, 6.0, folder)
    assert off is not None and off.dir == "" and off.view()["dir"] is None


def test_only_the_newest_start_folders_are_kept_within_their_bytes_and_never_one_in_use(
        tmp_path):
    root = tmp_path / "default"
    names = [sd.start_folder(root, 0, g, 1_790_000_000 + g) for g in range(5)]
    for n in names:
        n.mkdir(parents=True)
        dump(n / "VLLM_STACK_DUMP_for_engine_0_1.log", 1)
    # the newest 3, and the oldest: an engine still running
    assert sd.prune(root, keep={str(names[0])}, starts=3) == [names[1].name]
    assert sorted(p.name for p in root.iterdir()) == [names[i].name for i in (0, 2, 3, 4)]
    (names[3] / "VLLM_STACK_DUMP_for_engine_0_1.log").write_bytes(b"x" * 5000)
    assert sd.prune(root, keep=set(), max_bytes=1000) == [names[3].name, names[2].name,
                                                          names[0].name]
    assert [p.name for p in root.iterdir()] == [names[4].name]
    assert sd.prune(tmp_path / "missing", keep=set()) == []


def test_make_keeps_the_new_folder_and_the_ones_in_use(tmp_path):
    root = tmp_path / "default"
    old = [sd.start_folder(root, 0, g, 1_790_000_000 + g) for g in range(sd.KEEP_STARTS + 3)]
    for n in old:
        n.mkdir(parents=True)
    new = sd.start_folder(root, 1, 99, 1_790_009_999)
    dropped = sd.make(new, keep={str(old[0])})
    left = {p.name for p in root.iterdir()}
    # the new one and the newest others make KEEP_STARTS; the one in use beside them
    assert new.is_dir() and old[0].name in left and len(left) == sd.KEEP_STARTS + 1
    assert {n.name for n in old[-(sd.KEEP_STARTS - 1):]} < left
    assert set(dropped) == {n.name for n in old} - left


def test_a_file_past_its_bound_keeps_its_newest_dumps_and_vllm_appends_on(tmp_path):
    f = tmp_path / "VLLM_STACK_DUMP_for_engine_0_42.log"
    for seq in range(1, 41):
        dump(f, seq, body="x" * 200 + "\n")
    size = f.stat().st_size
    assert sd.trim(str(tmp_path), max_bytes=size + 1) == []
    assert sd.trim(str(tmp_path), max_bytes=size // 2) == [f.name]
    text = f.read_text()
    assert len(text.encode()) <= size // 4 + 100
    assert text.startswith("(older dumps dropped by vllm-supervisor)")
    assert ">>> Call stack dump #40 " in text and ">>> Call stack dump #1 " not in text
    assert text.split(">>> Call stack dump #")[1].startswith(str(40 - text.count(">>>") + 1))
    dump(f, 41)  # vLLM opens the file afresh for each dump
    assert f.read_text().rstrip().endswith("=" * 64) and "#41 " in f.read_text()


def test_the_dumps_of_the_trees_processes_are_copied_newest_first_and_bounded(tmp_path):
    src, dest = tmp_path / "dumps", tmp_path / "bundle" / "vllm-stack-dumps"
    src.mkdir()
    core, worker, other = (src / f"VLLM_STACK_DUMP_for_{n}.log"
                           for n in ("engine_0_100", "worker_0_101", "engine_0_999"))
    for seq in range(1, 4):
        dump(core, seq, body="c" * 300 + "\n")
    dump(worker, 1, "shutdown")
    dump(other, 1)
    (src / "unrelated.log").write_text("x")
    os.utime(worker, (time.time() - 60,) * 2)
    found = sd.find(str(src), {100, 101})
    assert [(f.name, f.pid) for f in found] == [("engine_0", 100), ("worker_0", 101)]
    assert {f.pid for f in sd.find(str(src), None)} == {100, 101, 999}
    copies = sd.copy(found, dest, per_file=1000)  # (a dump: about 440 bytes)
    c, w = copies
    assert c["file"] == str(dest / core.name) and c["truncated"] and c["dumps"] == 2
    assert c["last"].startswith(">>> Call stack dump #3 ") and c["process"] == "engine_0"
    assert Path(c["file"]).read_bytes() == core.read_bytes()[-c["bytes"]:]
    assert Path(c["file"]).read_text().startswith(">>> Call stack dump #2 ")
    assert not w["truncated"] and w["last"].endswith("due to shutdown")
    assert Path(w["file"]).read_bytes() == worker.read_bytes()
    # the bundle's bound on all of them together
    capped = sd.copy(found, tmp_path / "small", per_file=1000, total=400)
    assert capped[0]["bytes"] <= 400 and capped[1]["file"] is None
    assert "bound" in capped[1]["skipped"]
    assert sd.find(str(tmp_path / "none"), None) == []
