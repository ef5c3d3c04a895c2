"""`standby = "snapshot"` through the real daemon, its proxy, fake engines and the real
CRIU (issue 49's route 3): the standby is proven, put to sleep, kept as images (which
ends it) and a copy restored from them is the standby, asleep; a crash of the serving
engine's core wakes the copy and the streams go on there token-exact; the next standby
is another copy of the same images, restored beside the engine that serves, with no
dump, and a crash of the copy that serves hands over to it in turn; a crash while the
next copy is still being restored lets that copy serve once ready, in place of a cold
start. A dump that cannot be made leaves a sleeping standby, said in status."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import httpx
import psutil

from tests.harness import wait_for
from tests.test_snapshot_criu import CRIU, carried
from tests.test_standby import sleep_config, standby_ready, streams_under


def snapshot_config(tmp_path: Path, criu: str, *fake: str) -> dict[str, Any]:
    cfg = sleep_config(tmp_path, *fake)
    cfg["engine"].update(standby="snapshot", criu=criu,
                         snapshot_dir=str(tmp_path / "snapshot"))
    return cfg


def in_a_namespace(pid: int) -> bool:
    """The process has a PID namespace of its own (a restored copy's)."""
    status = Path(f"/proc/{pid}/status").read_text()
    return len(next(line for line in status.splitlines()
                    if line.startswith("NSpid:")).split()) > 2


def audit(cfg: dict[str, Any]) -> list[dict[str, Any]]:
    return [json.loads(line) for line in
            Path(cfg["audit"]["path"]).read_text().splitlines() if line.strip()]


def test_the_standby_is_a_copy_of_its_images_before_and_after_a_failover(daemon_factory,
                                                                          tmp_path):
    carried()  # (CRIU set up here)
    cfg = snapshot_config(tmp_path, str(CRIU), "--vllm-version", "0.26.0",
                          "--weights-gib", "2")
    d = daemon_factory(cfg)
    d.wait_state("RUNNING")
    wait_for(lambda: standby_ready(d), 60, "the standby ready")
    first = d.status()
    sb = first["standby"]
    assert sb["mode"] == "snapshot" and sb["asleep"] is True
    assert sb["snapshot"] == {"made": True, "off": None, "copy": True}
    copy = sb["pid"]
    assert in_a_namespace(copy) and copy != first["pid"]
    # its port is where it is reached (its relay's), not the one inside its namespace
    assert sb["port"] not in (cfg["engine"]["port"], cfg["engine"]["port"] + 1)
    assert httpx.get(f"http://127.0.0.1:{sb['port']}/health", timeout=10).status_code == 200
    assert (tmp_path / "snapshot" / "images" / "snapshot.json").exists()
    names = [e["event"] for e in audit(cfg)]
    assert names.count("standby_dumped") == 1

    # a crash of the serving engine's core: the copy woken, the streams go on there
    main, core = d.engine_pids()[:2]
    answered_s = streams_under(cfg, lambda: os.kill(core, signal.SIGKILL))
    print(f"a new request answered {answered_s:.2f} s after the kill")
    st = d.status()
    assert st["state"] == "RUNNING" and st["pid"] == copy and st["restarts"] == 1
    events = audit(cfg)
    names = [e["event"] for e in events]
    assert names.index("failover") < names.index("standby_woken") \
        < names.index("failover_done")
    assert next(e for e in events if e["event"] == "standby_woken")["pid"] == copy
    # the copy carries what the dumped standby's warm-up built: its proof at the
    # failover asked no client path again (on the H200 that was 0.33-0.37 s of it)
    manifest = json.loads((tmp_path / "snapshot" / "images" / "snapshot.json").read_text())
    warmed = [e["pid"] for e in events if e["event"] == "paths_warmed"]
    assert manifest["warmed"] is True and main in warmed and copy not in warmed, warmed

    # both warmed up (a sleep and a wake before they served): the engine, whose KV reset
    # pauses it, let go of the pinned host copy its sleep left; the standby, dumped
    # asleep after, kept it for that sleep
    warmups = {e["pid"]: e for e in events if e["event"] == "warmed_up"}
    assert warmups[main]["host_cache"] == "emptied", warmups
    assert [e["host_cache"] for p, e in warmups.items() if p != main] == [None], warmups

    # a copy prints no start lines: it knows its vLLM from its images, and a KV reset
    # of it pauses it at once (0.26+), asking the engine nothing about its version
    assert manifest["vllm_version"] == "0.26.0"
    assert manifest["weights_bytes"] == 2 * 2**30  # (as its sleep said: an early wake's)
    r = d.ctl("kv-reset", timeout=60)
    assert r.returncode == 0 and "KV reset ok" in r.stdout, (r.stdout, r.stderr)
    reset = [e for e in audit(cfg) if e["event"] == "remedy"][-1]
    assert reset["vllm_version"] == "0.26.0" and reset["idle_counts"] is None, reset
    assert list(reset["steps_s"]) == ["drain", "pause", "check", "resume", "canary"], reset
    assert "GET /version" not in (tmp_path / "requests").read_text().splitlines()

    # the next standby: another copy of the same images, beside the copy that serves
    wait_for(lambda: standby_ready(d) and d.status()["standby"]["pid"] not in (copy, main),
             60, "another copy, the standby")
    again = d.status()["standby"]
    assert again["asleep"] is True and again["snapshot"]["copy"] is True
    assert in_a_namespace(again["pid"])
    assert [e["event"] for e in audit(cfg)].count("standby_dumped") == 1  # (no new dump)

    # a crash of the copy that serves: the next copy takes over, as the first did (the
    # H200 found a take-down of a copy, promoted, that failed and cold-started instead);
    # then, while the third copy is still being restored, a crash of that one too: no
    # standby ready, a cold start, and the copy being restored serves in its place once
    # ready (no engine started cold); the streams go on across both
    def core_of(pid: int) -> int:
        return next(c.pid for c in psutil.Process(pid).children(recursive=True)
                    if c.name().startswith("VLLM::EngineCo"))

    third: list[int] = []

    def two_crashes() -> None:
        at = len(audit(cfg))
        os.kill(core_of(copy), signal.SIGKILL)
        # (the restore, CRIU's, is under way from the failover's end to the copy's spawn)
        wait_for(lambda: any(e["event"] == "failover_done" for e in audit(cfg)[at:]), 30,
                 "the second failover done", interval=0.01)
        assert not any(e["event"] == "standby_ready" for e in audit(cfg)[at:])
        os.kill(core_of(again["pid"]), signal.SIGKILL)

    streams_under(cfg, two_crashes)
    wait_for(lambda: [e for e in audit(cfg) if e["event"] == "failover"][-1]["pid"]
             not in (main, copy, again["pid"]), 60, "a third copy took over")
    third.append([e for e in audit(cfg) if e["event"] == "failover"][-1]["pid"])
    wait_for(lambda: d.status()["pid"] == third[0], 60, "the third copy serving")
    st = d.status()
    events = audit(cfg)
    assert not [e for e in events if e["event"] in ("failover_failed", "standby_failed")], \
        [e for e in events if e["event"] in ("failover_failed", "standby_failed")]
    assert st["state"] == "RUNNING" and st["restarts"] == 3
    took = [e for e in events if e["event"] == "failover"][-1]
    assert took["reason"] == "a copy of the images serves in place of a cold start", took
    assert took["pid"] == third[0] and took["old_pid"] is None
    wait_for(lambda: standby_ready(d) and d.status()["standby"]["pid"]
             not in (copy, main, again["pid"], third[0]), 60, "a fourth copy, the standby")
    fourth = d.status()["standby"]["pid"]
    spawns = [e["pid"] for e in audit(cfg) if e["event"] == "spawn"]
    # no engine spawned cold after the third copy: the next spawn is the fourth copy
    assert spawns[spawns.index(third[0]) + 1:] == [fourth], spawns
    pids = [copy, again["pid"], third[0], fourth]
    stopped = d.ctl("stop")
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    assert d.proc.wait(timeout=60) == 0
    assert not [p for p in pids if psutil.pid_exists(p)
                and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]


def test_a_dump_that_cannot_be_made_leaves_a_sleeping_standby(daemon_factory, tmp_path):
    cfg = snapshot_config(tmp_path, str(tmp_path / "no-criu"))
    d = daemon_factory(cfg)
    d.wait_state("RUNNING")
    wait_for(lambda: standby_ready(d), 60, "a sleeping standby")
    sb = d.status()["standby"]
    assert sb["asleep"] is True and sb["snapshot"]["made"] is False
    assert sb["snapshot"]["copy"] is False and "no-criu" in sb["snapshot"]["off"]
    assert not in_a_namespace(sb["pid"])
    failed = next(e for e in audit(cfg) if e["event"] == "standby_not_dumped")
    assert "no-criu" in failed["error"]


def test_a_restarted_daemon_restores_its_standby_from_the_images_it_left(daemon_factory,
                                                                         tmp_path):
    """Images an earlier run left in this boot of the host: the next run's first standby
    is a copy of them, restored before the engine starts (no start of a standby, no
    dump). Images that cannot be restored leave the card to a fresh standby first,
    dumped again, and the engine starts beside its copy as on a first start."""
    carried()
    cfg = snapshot_config(tmp_path, str(CRIU))
    # a full card: two awake engines do not fit (the standby first, as on a GPU at 0.88)
    line = cfg["engine"]["command"]
    line[line.index("--gpu-memory-utilization") + 1] = "0.88"
    first = daemon_factory(cfg)
    first.wait_state("RUNNING")
    wait_for(lambda: standby_ready(first), 60, "the standby ready")
    assert first.ctl("stop").returncode == 0 and first.proc.wait(timeout=60) == 0

    said: list[str] = []  # (each run's log)

    def run(which: str) -> tuple[list[str], list[dict[str, Any]], dict[str, Any]]:
        at = len(audit(cfg))
        d = daemon_factory(cfg)  # (the same folder: an engine's cwd is the config's)
        d.wait_state("RUNNING")
        wait_for(lambda: standby_ready(d) and d.status()["standby"]["snapshot"]["copy"],
                 90, f"a copy the standby, the {which} run")
        st = d.status()
        assert d.ctl("stop").returncode == 0 and d.proc.wait(timeout=60) == 0
        said.append(d.log_path.read_text(errors="replace"))
        events = audit(cfg)[at:]
        return [e["event"] for e in events], events, st

    names, events, st = run("second")
    assert st["standby"]["snapshot"] == {"made": True, "off": None, "copy": True}
    assert "standby_images_kept" in names and "standby_dumped" not in names, names
    # the copy first, on a card still free: ready before the engine was spawned
    engine_spawn = next(i for i, e in enumerate(events)
                        if e["event"] == "spawn" and e.get("pid") == st["pid"])
    assert names.index("standby_ready") < engine_spawn, names

    (tmp_path / "snapshot" / "images" / "inventory.img").write_bytes(b"not an image")
    names, events, st = run("third")
    assert st["state"] == "RUNNING" and st["standby"]["snapshot"]["copy"] is True
    kept, dropped = names.index("standby_images_kept"), names.index("standby_images_dropped")
    dumped = names.index("standby_dumped")
    engine_spawn = next(i for i, e in enumerate(events)
                        if e["event"] == "spawn" and e.get("pid") == st["pid"])
    assert kept < dropped < dumped < engine_spawn, names  # (a fresh standby, first)

    # images of another start (an engine's environment changed since): not adopted,
    # saying why, and made afresh
    cfg["engine"]["env"] = {**cfg["engine"]["env"], "SOMETHING_NEW": "1"}
    names, events, st = run("fourth")
    assert "standby_images_kept" not in names and "standby_dumped" in names, names
    assert "kept images are of another start" in said[-1] and "its env changed" in said[-1]
