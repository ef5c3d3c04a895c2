"""A sleeping standby's weights on the card ahead of a fault (`engine.standby_weights =
"gpu"`, supervisor/engine/pair/weights_ahead.py, docs/standby.md "Its weights on the card
ahead of a fault"): where NVML's settled reading leaves room for its weights and 1 GiB
more beside the serving engine, a ready standby's weights are woken (`tags=weights`: it
sleeps on) long before any fault, and a failover then wakes only its KV cache once the old
engine's tree is gone. A card that runs short takes them back (the standby replaced: woken
weights cannot sleep again). Decided over the recording effects and the driven clock of
tests/unit_world.py; through the daemon and the fake engine in
tests/test_standby.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from supervisor.engine.events import Exited, GateProbe, GpuSampled, Tick, Woken
from supervisor.engine.pair.weights_ahead import AHEAD_MARGIN_BYTES, FLOOR_BYTES
from supervisor.engine.process.process import EngineProcess
from supervisor.settings.config import ConfigError, parse_config
from tests.pair_world import MODES
from tests.test_early_wake import GIB, WEIGHTS, armed, audited, reading, wakes
from tests.unit_world import World

ROOM = WEIGHTS + AHEAD_MARGIN_BYTES


def gpu_world(tmp: Path, weights: str = "gpu", args: tuple[str, ...] = ()) -> World:
    mode = MODES["sleep_first"]
    return World(tmp, fronted=True, engine={**mode, "env": dict(mode["env"]),
                                             "standby_weights": weights,
                                             "args": [*mode["args"], *args]})


def asked_ahead(w: World) -> tuple[EngineProcess, EngineProcess]:
    """Armed (`test_early_wake.armed`), the card read with room for the standby's weights,
    then a tick: their wake ahead asked. (first, standby)"""
    first, spare = armed(w)
    w.feed(GpuSampled(reading(ROOM), w.now))
    w.feed(Tick())
    return first, spare


def on_card(w: World) -> tuple[EngineProcess, EngineProcess]:
    """... and answered: the standby's weights on the card. (first, standby)"""
    first, spare = asked_ahead(w)
    w.feed(Woken(spare.generation, None, 0.45, None, ("weights",)))
    return first, spare


def test_the_weights_wake_ahead_and_a_failover_wakes_only_the_kv_cache(tmp_path: Path) -> None:
    w = gpu_world(tmp_path)
    try:
        first, spare = armed(w)
        w.feed(Tick())
        assert wakes(w) == []  # (no reading of the card yet: nothing is woken blind)
        w.feed(GpuSampled(reading(ROOM - 1), w.now))
        w.feed(Tick())
        assert wakes(w) == []  # (a byte short of the margin)
        w.feed(GpuSampled(reading(ROOM), w.now))
        w.feed(Tick())
        assert wakes(w) == [{"pid": spare.pid, "tags": ["weights"]}]
        assert w.sup.status()["standby"]["weights"] == "waking"
        w.feed(Tick())
        assert len(wakes(w)) == 1  # (asked once)
        w.feed(Woken(spare.generation, None, 0.45, 0.41, ("weights",)))
        st = w.sup.status()["standby"]
        assert (st["weights"], st["state"], st["asleep"]) == ("gpu", "ready", True)
        assert st["weights_off"] is None
        assert st["early_wake"] is None  # (nothing left to wake early)
        on_card = audited(tmp_path, "standby_weights_on_card")[-1]
        assert on_card["pid"] == spare.pid and on_card["weights_bytes"] == WEIGHTS
        # the card now as NVML reads it: the weights there, the floor kept
        w.feed(GpuSampled(reading(AHEAD_MARGIN_BYTES), w.now))
        w.feed(Tick())
        assert "take_down" not in w.fx.names()

        w.feed(Exited(first.generation, -9))  # a fault
        assert w.sup.engine is spare
        assert len(wakes(w)) == 1  # (its weights are there: nothing before the tree goes)
        fo = audited(tmp_path, "failover")[-1]
        assert fo["weights_ahead"] == "back" and "weights_early" not in fo
        w.down(first)
        assert wakes(w)[1:] == [{"pid": spare.pid, "tags": ["kv_cache"]}]  # the rest only
        w.feed(Woken(spare.generation, None, 0.26, None, ("kv_cache",)))
        assert w.fx.last("gate_probe") == {"pid": spare.pid}
        w.feed(GateProbe(spare.generation, True, None))
        assert w.state == "RUNNING" and audited(tmp_path, "failover_done")
    finally:
        w.loop.close()


def test_a_fault_while_the_weights_wake_ahead_waits_for_them_then_the_rest(
        tmp_path: Path) -> None:
    w = gpu_world(tmp_path)
    try:
        first, spare = asked_ahead(w)
        w.feed(Exited(first.generation, -9))  # before the weights' answer
        assert audited(tmp_path, "failover")[-1]["weights_ahead"] == "asked"
        w.down(first)
        assert len(wakes(w)) == 1  # (not asked twice: vLLM would map them again)
        w.feed(Woken(spare.generation, None, 0.9, None, ("weights",)))
        assert wakes(w)[1:] == [{"pid": spare.pid, "tags": ["kv_cache"]}]
        assert audited(tmp_path, "standby_weights_woken")[-1]["pid"] == spare.pid
    finally:
        w.loop.close()


@pytest.mark.parametrize(("case", "said"), [
    ("host", None),  # (the operator's choice: nothing to explain)
    ("no_room", "the card leaves 15.50 GiB free; they need 15.00 GiB and 1 GiB more"),
    ("never_slept", "their size is not known yet"),
    ("no_reading", "no settled reading of the card yet"),
])
def test_no_weights_ahead_without_the_setting_room_or_their_size_and_status_says_why(
        tmp_path: Path, case: str, said: str | None) -> None:
    w = gpu_world(tmp_path, "host" if case == "host" else "gpu")
    try:
        armed(w, weights=None if case == "never_slept" else WEIGHTS)
        if case != "no_reading":
            free = ROOM - GIB // 2 if case == "no_room" else 40 * GIB
            w.feed(GpuSampled(reading(free), w.now))
        w.feed(Tick())
        assert wakes(w) == []
        st = w.sup.status()["standby"]
        assert st["weights"] == "host"
        assert st["weights_off"] is None if said is None else said in st["weights_off"]
    finally:
        w.loop.close()


def test_a_card_that_runs_short_takes_the_weights_back_and_none_wake_ahead_again(
        tmp_path: Path) -> None:
    w = gpu_world(tmp_path)
    try:
        first, spare = on_card(w)
        w.feed(GpuSampled(reading(FLOOR_BYTES - 1), w.now))  # the serving engine grew
        w.feed(Tick())
        assert w.fx.last("take_down")["pid"] == spare.pid  # (they cannot sleep again)
        back = audited(tmp_path, "standby_weights_taken_back")[-1]
        assert "the serving engine needs the room" in back["why"]  # type: ignore[operator]
        assert "the serving engine needs the room" in w.sup.status()["standby"]["weights_off"]
        assert w.sup.engine is first and w.state == "RUNNING"  # (the engine untouched)
    finally:
        w.loop.close()


def test_a_failed_wake_ahead_replaces_the_standby_and_is_not_tried_again(
        tmp_path: Path) -> None:
    w = gpu_world(tmp_path)
    try:
        first, spare = asked_ahead(w)
        w.feed(Woken(spare.generation, "POST /wake_up: HTTP 500: CUDA out of memory", 0.3,
                     None, ("weights",)))
        assert w.fx.last("take_down")["pid"] == spare.pid  # (it may be wedged)
        assert audited(tmp_path, "standby_weights_not_woken")[-1]["pid"] == spare.pid
        st = w.sup.status()["standby"]
        assert "CUDA out of memory" in st["weights_off"] and st["state"] == "retiring"
        assert w.sup.engine is first and w.state == "RUNNING"
    finally:
        w.loop.close()


def test_a_reload_back_to_host_replaces_a_standby_whose_weights_are_on_the_card(
        tmp_path: Path) -> None:
    w = gpu_world(tmp_path)
    try:
        _, spare = on_card(w)
        doc = dict(w.doc)
        doc["engine"] = {**doc["engine"], "standby_weights": "host"}
        w.sup.config = parse_config(doc, str(tmp_path / "config.toml"), tmp_path)
        w.feed(Tick())
        assert w.fx.last("take_down")["pid"] == spare.pid
        assert w.sup.status()["standby"]["weights_off"] is None  # (its choice, not a fault)
    finally:
        w.loop.close()


@pytest.mark.parametrize(("engine", "said"), [
    ({"standby": "awake"}, 'standby is "awake" (needs "sleep" or "snapshot")'),
    ({"standby": "none"}, 'standby is "none"'),
    ({"standby": "sleep", "standby_args": ["--gpu-memory-utilization", "0.28"]},
     "not for an asymmetric pair"),
])
def test_weights_on_the_card_need_a_sleeping_standby_of_the_same_size(
        tmp_path: Path, engine: dict[str, object], said: str) -> None:
    doc = {"engine": {"command": ["vllm", "serve", "m"], "standby_weights": "gpu", **engine}}
    with pytest.raises(ConfigError) as err:
        parse_config(doc, str(tmp_path / "c.toml"), tmp_path)
    assert "engine.standby_weights" in str(err.value) and said in str(err.value)
