"""The snapshot standby in one engine unit, with recorded effects and a driven clock (no
process): dumped on a full card and a copy of it first, a cold start that waits for a
copy being restored or for the tree in the standby's place, a failed dump, a stop during
a dump, a copy that cannot be restored."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from supervisor.engine.events import (
    CoreExited,
    Exited,
    GateProbe,
    HealthResult,
    HostCacheEmptied,
    Slept,
    Spawned,
    Woken,
)
from supervisor.watchdog.remedy import REST, WEIGHTS
from tests.standby_worlds import (
    SNAPSHOT,
    asleep_first,
    crash_then_wake,
    dumped,
)
from tests.unit_world import World


def test_a_snapshot_standby_on_a_full_card_is_dumped_then_a_copy_of_it_first(
        tmp_path: Path) -> None:
    """`standby = "snapshot"` at vLLM's default share (two engines do not fit side by
    side): the standby starts first (under the io_uring filter, its own sockets on
    loopback), is proven, put to sleep and dumped; a copy of its images is restored in
    its place before the engine starts beside it, ready at once (asleep, proven before
    its dump: no generation reaches it); after a crash the copy is woken once the old
    engine is gone, and the next standby is another copy, restored beside it (no room
    for a new engine, room for a copy) with no dump."""
    w = World(tmp_path, fronted=True, engine={**SNAPSHOT, "args": ["--enable-sleep-mode"]})
    try:
        w.sup.start("test")
        first_spawn = w.fx.last("spawn")
        assert first_spawn["bay"] == 1 and first_spawn["spec"].restore is None
        assert first_spawn["spec"].argv[1].endswith("no_io_uring.py")
        assert first_spawn["spec"].env["VLLM_HOST_IP"] == "127.0.0.1"
        spare = w.spawned()
        w.feed(HealthResult(spare.generation, True))
        w.feed(GateProbe(spare.generation, True, None))
        w.feed(Slept(spare.generation, None, 0.2))
        assert w.fx.last("dump")["pid"] == spare.pid
        assert w.sup.status()["standby"]["state"] == "dumping"
        assert w.fx.names().count("spawn") == 1  # the engine waits
        dumped(w, spare)
        restore = w.fx.last("spawn")
        assert restore["bay"] == 1 and restore["spec"].restore is not None
        assert restore["spec"].restore.port == spare.spec.port
        assert w.fx.names().count("spawn") == 2  # (the copy first, not the engine)
        copy = w.spawned()
        w.feed(HealthResult(copy.generation, True))
        st = w.sup.status()["standby"]
        assert st["state"] == "ready" and st["asleep"] is True
        assert st["snapshot"] == {"made": True, "off": None, "copy": True}
        assert w.fx.last("gate_probe") != {"pid": copy.pid}  # (nothing reached it)
        assert w.fx.last("spawn")["bay"] == 0  # now the engine, beside the copy
        first = w.serving()
        w.feed(GateProbe(first.generation, True, None))
        assert w.sup.gate.held_reason is None

        crash_then_wake(w, first, copy)  # a crash: the copy takes over
        again = w.fx.last("spawn")
        assert again["bay"] == 0 and again["spec"].restore is not None  # another copy
        assert w.fx.names().count("dump") == 1
    finally:
        w.loop.close()


@pytest.mark.parametrize("how", ["restart", "crash"])
def test_a_cold_start_waits_for_a_copy_being_restored(tmp_path: Path, how: str) -> None:
    """A copy of the standby's images is being restored when a cold start comes (an
    operator's restart while nothing serves yet, or the serving engine's crash with no
    ready standby): nothing spawns beside a restore whose GPU memory still grows (vLLM's
    start would count it as its own; found by the pair machine). Once the copy is ready,
    asleep: before any engine of the unit served, the engine spawns beside it; after one
    did (the crash), the copy serves in place of the cold start, woken and proven, and
    another copy is restored as the standby."""
    w = World(tmp_path, fronted=True, engine={**SNAPSHOT, "args": ["--enable-sleep-mode"]})
    try:
        spare = asleep_first(w)
        dumped(w, spare)
        if how == "restart":
            assert w.fx.last("spawn")["spec"].restore is not None  # the copy, spawning
            w.control("restart")
        else:  # a copy took over from a crash; the next copy is being restored when
            # the one serving crashes too (no standby ready: a cold start)
            copy = w.spawned()
            w.feed(HealthResult(copy.generation, True))
            first = w.serving()
            w.feed(GateProbe(first.generation, True, None))
            crash_then_wake(w, first, copy)
            assert w.fx.last("spawn")["spec"].restore is not None  # the next copy
            w.feed(Exited(copy.generation, 0))
            assert w.state == "BACKOFF"
            w.down(copy)
            w.last_timer_fires()  # (the backoff's)
        assert w.state == "STARTING"
        spawns = w.fx.names().count("spawn")
        restored = w.spawned()  # the copy's spawn ends
        assert w.fx.names().count("spawn") == spawns, "the engine spawned beside a restore"
        w.feed(HealthResult(restored.generation, True))  # ready, asleep
        if how == "restart":
            assert w.fx.names().count("spawn") == spawns + 1
            assert w.fx.last("spawn")["spec"].restore is None  # now the engine, beside it
            return
        assert w.fx.names().count("spawn") == spawns, "a cold start beside a ready copy"
        assert w.sup.engine is restored and w.state == "RUNNING"
        assert w.fx.last("wake") == {"pid": restored.pid}  # (nothing old to wait for)
        assert w.sup.gate.held_reason is not None  # held until it is proven
        w.feed(Woken(restored.generation, None, 0.5))
        w.feed(GateProbe(restored.generation, True, None))
        assert w.sup.gate.held_reason is None
        failover = [e for e in w.audit() if e["event"] == "failover"][-1]
        assert failover["reason"] == "a copy of the images serves in place of a cold start"
        assert failover["old_pid"] is None and failover["asleep"] is True
        again = w.fx.last("spawn")  # the next standby: another copy, restored
        assert w.fx.names().count("spawn") == spawns + 1
        assert again["bay"] != 0 or again["spec"].restore is not None
        assert again["spec"].restore is not None
    finally:
        w.loop.close()


def a_copy_letting_go_of_its_host_backup(w: World) -> Any:
    """`standby_weights = "gpu"`: a copy took over from a crash, and the next copy, being
    restored, serves in place of the cold start after the one serving crashed too; its
    weights woken, the emptying of its host cache asked. That copy."""
    spare = asleep_first(w)
    dumped(w, spare)
    copy = w.spawned()
    w.feed(HealthResult(copy.generation, True))
    first = w.serving()
    w.feed(GateProbe(first.generation, True, None))
    crash_then_wake(w, first, copy)  # (no NVML reading here: nothing woken ahead)
    w.feed(Exited(copy.generation, 0))  # the copy that serves crashes too
    w.down(copy)
    w.last_timer_fires()  # (the backoff's)
    restored = w.spawned()
    w.feed(HealthResult(restored.generation, True))  # ready: it serves
    assert w.sup.engine is restored and w.state == "RUNNING"
    assert w.fx.last("wake") == {"pid": restored.pid, "tags": list(WEIGHTS)}
    w.feed(Woken(restored.generation, None, 0.4, tags=WEIGHTS))
    assert w.fx.last("empty_host_cache") == {"pid": restored.pid}
    assert w.fx.last("wake") == {"pid": restored.pid, "tags": list(WEIGHTS)}
    assert w.sup.gate.held_reason is not None  # (nothing reaches it meanwhile)
    return restored


GPU_SNAPSHOT = {**SNAPSHOT, "args": ["--enable-sleep-mode"], "standby_weights": "gpu"}


@pytest.mark.parametrize("emptied", [True, False])
def test_a_copy_serving_in_place_of_a_cold_start_lets_its_host_backup_go_first(
        tmp_path: Path, emptied: bool) -> None:
    """With `standby_weights = "gpu"` the copy that serves in place of a cold start is
    woken as a copy whose weights went ahead is: its weights, then their pinned host
    backup let go, then the rest, all while requests are held; only then proven and
    served (on the H200 the copy that served without it gave the card back 0.73 s after
    its death, the others 0.24-0.30 s). A cache that could not be emptied is said, and
    the rest wakes all the same."""
    w = World(tmp_path, fronted=True, engine=GPU_SNAPSHOT)
    try:
        restored = a_copy_letting_go_of_its_host_backup(w)
        w.feed(HostCacheEmptied(restored.generation, emptied, 0.7, 0.68 if emptied else None,
                                None if emptied else "no answer"))
        assert w.fx.last("wake") == {"pid": restored.pid, "tags": list(REST)}
        assert w.sup.gate.held_reason is not None
        w.feed(Woken(restored.generation, None, 0.3, tags=REST))
        w.feed(GateProbe(restored.generation, True, None))
        assert w.sup.gate.held_reason is None
        said = [e["event"] for e in w.audit()]
        assert ("standby_host_cache_emptied" if emptied else "standby_host_cache_kept") \
            in said
        last = len(said) - 1 - said[::-1].index("failover_done")
        assert said.index("standby_weights_woken") < last
        w.feed(HostCacheEmptied(restored.generation, True, 0.7))  # (stale: nothing more)
        assert w.fx.names().count("wake") == 3  # (the first copy's, and these two)
    finally:
        w.loop.close()


def test_a_copy_that_dies_while_its_host_backup_is_let_go_is_a_cold_start(
        tmp_path: Path) -> None:
    """The copy taking over dies while its host cache is emptied: the handover is over
    (held requests stay held for the next engine), and the cache's late answer wakes
    nothing."""
    w = World(tmp_path, fronted=True, engine=GPU_SNAPSHOT)
    try:
        restored = a_copy_letting_go_of_its_host_backup(w)
        wakes = w.fx.names().count("wake")
        w.feed(CoreExited(restored.generation, restored.pid + 1))
        assert w.state == "BACKOFF" and w.sup.gate.held_reason is not None
        w.feed(HostCacheEmptied(restored.generation, True, 0.7))
        assert w.fx.names().count("wake") == wakes  # (no wake of the rest: it is gone)
        assert w.fx.last("take_down")["pid"] == restored.pid
    finally:
        w.loop.close()


def test_a_cold_start_waits_for_the_tree_in_the_standbys_place(tmp_path: Path) -> None:
    """On a full card with kept images: the engine starting beside a copy is restarted,
    the copy takes over, then dies too (a cold start after a backoff). The engine that was
    starting is still being taken down in the standby's place when the backoff ends: the
    cold start waits for its tree to be gone (its memory released), as with `"sleep"`,
    rather than spawning beside it. Found by the pair machine."""
    w = World(tmp_path, fronted=True, engine={**SNAPSHOT, "args": ["--enable-sleep-mode"]})
    try:
        spare = asleep_first(w)
        dumped(w, spare)
        copy = w.spawned()
        w.feed(HealthResult(copy.generation, True))
        first = w.spawned()  # the engine, starting beside the copy
        w.control("restart")
        assert w.sup.engine is copy and w.fx.last("take_down")["pid"] == first.pid
        w.feed(CoreExited(copy.generation, copy.pid + 1))
        assert w.state == "BACKOFF"
        w.down(copy)
        spawns = w.fx.names().count("spawn")
        w.last_timer_fires()  # (the backoff's)
        assert w.state == "STARTING"
        assert w.fx.names().count("spawn") == spawns, "spawned beside a tree going down"
        w.down(first)
        assert w.fx.names().count("spawn") == spawns + 1
    finally:
        w.loop.close()


def test_a_snapshot_standby_whose_dump_fails_is_a_sleeping_standby(tmp_path: Path) -> None:
    """The dump failed (CRIU missing, say): said in status and the audit, and from then
    on the standby is a sleeping one (no dump tried again until the daemon restarts);
    on a full card the engine starts once that one sleeps."""
    w = World(tmp_path, fronted=True, engine={**SNAPSHOT, "args": ["--enable-sleep-mode"]})
    try:
        spare = asleep_first(w)
        dumped(w, spare, "SnapshotError: CRIU does not run")
        st = w.sup.status()["standby"]
        assert st["snapshot"]["off"] == "SnapshotError: CRIU does not run"
        # (the standby first again, this time to stay asleep: the engine still waits)
        nxt = w.fx.last("spawn")
        assert nxt["bay"] == 1 and nxt["spec"].restore is None
        second = w.spawned()
        w.feed(HealthResult(second.generation, True))
        w.feed(GateProbe(second.generation, True, None))
        w.feed(Slept(second.generation, None, 0.2))
        st = w.sup.status()["standby"]
        assert st["state"] == "ready" and st["asleep"] is True
        assert w.fx.names().count("dump") == 1
        assert w.fx.last("spawn")["bay"] == 0  # the engine, beside the sleeping one
    finally:
        w.loop.close()


def test_a_stop_while_the_standby_is_dumped_waits_for_the_dump(tmp_path: Path) -> None:
    """The dump is the standby's take-down: a stop during it retires the standby and
    ends once the dump's take-down has proven its tree gone, with no copy restored."""
    w = World(tmp_path, fronted=True, engine={**SNAPSHOT, "args": ["--enable-sleep-mode"]})
    try:
        spare = asleep_first(w)
        assert w.sup.status()["standby"]["state"] == "dumping"
        reply = w.control("stop")
        assert w.sup.status()["standby"]["state"] == "retiring"
        assert not reply.done()
        dumped(w, spare)
        assert w.state == "STOPPED" and reply.done()
        assert w.fx.names().count("spawn") == 1  # (no copy, no engine)
    finally:
        w.loop.close()


def test_a_copy_that_cannot_be_restored_drops_the_images(tmp_path: Path) -> None:
    """The images are not trusted once a copy of them failed: on a full card the engine
    then starts (no room for a fresh standby beside it until its next cold start, which
    begins with one to dump again)."""
    w = World(tmp_path, fronted=True, engine={**SNAPSHOT, "args": ["--enable-sleep-mode"]})
    try:
        spare = asleep_first(w)
        dumped(w, spare)
        restore = w.fx.last("spawn")
        assert restore["spec"].restore is not None
        w.feed(Spawned(restore["generation"], None, "criu restore of copy g3 ended"))
        st = w.sup.status()["standby"]
        assert st["snapshot"]["made"] is False
        events = [json.loads(x)["event"] for x in
                  (tmp_path / "events.jsonl").read_text().splitlines()]
        assert "standby_images_dropped" in events
        assert w.fx.last("spawn")["bay"] == 0  # the engine, alone
    finally:
        w.loop.close()
