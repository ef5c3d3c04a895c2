"""The restart and stop deciders (`supervisor/engine/restarts.py`, `stops.py`) on their
own: the unit's state as `PairFacts`, the steps they return. (The unit carrying them out
is tested through tests/test_supervisor_unit.py, tests/test_standby_unit.py and the pair
machine.)"""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any

import pytest

from supervisor.engine import restarts, stops
from supervisor.engine import steps as do
from supervisor.engine.pair.pair_states import Bay
from supervisor.engine.pair.slot import SlotView
from supervisor.engine.states import State
from supervisor.engine.steps import PairFacts
from supervisor.settings.config import parse_config


def facts(tmp: Path, state: State, phase: Bay = Bay.HEALTHY, drain: str = "auto",
          fronted: bool = True, stop_deadline: float | None = None) -> PairFacts:
    doc: dict[str, dict[str, Any]] = {
        "engine": {"command": ["vllm", "serve", "m"], "port": 18100, "drain": drain},
        "daemon": {"runtime_dir": str(tmp / "run")},
        "control": {"socket": str(tmp / "run" / "c.sock")},
        "audit": {"path": str(tmp / "events.jsonl")},
        "gpu": {"sampler": "off"}, "proxy": {"enabled": fronted},
    }
    cfg = parse_config(doc, str(tmp / "config.toml"), tmp)
    engine = None if phase in (Bay.EMPTY, Bay.SPAWNING) else \
        types.SimpleNamespace(config=cfg.engine, generation=1, pid=4242)
    slot = SlotView(0, phase, 1, engine, None)  # type: ignore[arg-type]
    return PairFacts(state, slot, cfg, {}, fronted, 100.0, stop_deadline, "",
                     (cfg.engine, cfg.engine), (cfg.engine, cfg.engine))


def kinds(steps: list[do.Step]) -> list[str]:
    return [type(s).__name__ for s in steps]


@pytest.mark.parametrize(("state", "why"), [
    (State.DRAINING, "a restart is already in progress"),
    (State.STOPPING, "the daemon is STOPPING"),
    (State.STOPPED, "the daemon is STOPPED"),
])
def test_a_restart_that_cannot_begin_says_why(tmp_path: Path, state: State,
                                              why: str) -> None:
    with pytest.raises(restarts.RestartRefused, match=why):
        restarts.restart(facts(tmp_path, state), "operator", True, 0, False)


@pytest.mark.parametrize("state", [State.BACKOFF, State.FATAL])
def test_after_a_failure_the_failure_decider_restarts(tmp_path: Path, state: State) -> None:
    steps = restarts.restart(facts(tmp_path, state), "operator", True, 3, True)
    assert steps == [do.RestartReason("operator"), do.RestartFailed("operator")]


def test_with_requests_in_flight_and_an_awake_standby_it_takes_over_at_once(
        tmp_path: Path) -> None:
    f = facts(tmp_path, State.RUNNING, drain="continue")
    steps = restarts.restart(f, "operator", True, 5, True)
    assert kinds(steps) == ["RestartReason", "SetState", "Decide", "PauseStreams", "FailOver"]
    assert steps[1] == do.SetState(State.DRAINING, "operator")
    assert steps[-1] == do.FailOver("operator", True, drain_behind=True)


def test_with_requests_in_flight_and_no_standby_they_finish_first(tmp_path: Path) -> None:
    f = facts(tmp_path, State.RUNNING)
    steps = restarts.restart(f, "operator", True, 5, False)
    assert kinds(steps) == ["RestartReason", "SetState", "Decide", "StopDeadline", "Drain"]
    deadline = f.restart_deadline(proxy_drain=True)
    assert deadline > f.now
    assert steps[3] == do.StopDeadline(deadline)
    assert steps[4] == do.Drain(f.engine, deadline)  # type: ignore[arg-type]


def test_a_restart_under_way_keeps_its_deadline(tmp_path: Path) -> None:
    f = facts(tmp_path, State.RUNNING, stop_deadline=130.0)
    steps = restarts.restart(f, "operator", True, 5, False)
    assert steps[-1] == do.Drain(f.engine, 130.0)  # type: ignore[arg-type]


@pytest.mark.parametrize(("graceful", "fronted", "in_flight"), [
    (True, True, 0), (False, True, 5), (True, False, 5)])
def test_nothing_to_wait_for_swaps_or_takes_down(tmp_path: Path, graceful: bool,
                                                 fronted: bool, in_flight: int) -> None:
    f = facts(tmp_path, State.RUNNING, drain="continue", fronted=fronted)
    steps = restarts.restart(f, "policy", graceful, in_flight, True)
    assert steps[-1] == do.SwapOrTakeDown(graceful)
    # streams are paused only for a graceful restart behind a front proxy
    assert ("PauseStreams" in kinds(steps)) == (graceful and fronted)


def test_no_engine_yet_is_started_and_one_spawning_or_going_is_left(tmp_path: Path) -> None:
    none_yet = restarts.restart(facts(tmp_path, State.STARTING, Bay.EMPTY), "op", True, 0,
                                False)
    assert none_yet[-1] == do.StartEngine("op")
    for phase in (Bay.SPAWNING, Bay.TAKING_DOWN):
        steps = restarts.restart(facts(tmp_path, State.STARTING, phase), "op", True, 0, False)
        assert kinds(steps) == ["RestartReason", "SetState", "Decide"]


# ---- a stop (`supervisor/engine/stops.py`) -------------------------------------------

def test_a_stop_takes_the_engine_down_gracefully_within_one_deadline(tmp_path: Path) -> None:
    f = facts(tmp_path, State.RUNNING)
    steps = stops.stop(f, "SIGTERM received", forced=False)
    assert kinds(steps) == ["EndBackoff", "SetState", "RelaunchFinish", "Decide",
                            "NotifyStopping", "StopDeadline", "Abandon", "TakeDown"]
    deadline = f.restart_deadline(proxy_drain=False)
    assert steps[5] == do.StopDeadline(deadline)
    assert steps[6] == do.Abandon("the daemon is stopping", deadline)  # the standby too
    assert steps[-1] == do.TakeDown(graceful=True)


@pytest.mark.parametrize("phase", [Bay.EMPTY, Bay.SPAWNING, Bay.TAKING_DOWN])
def test_a_stop_with_nothing_to_take_down_ends_once_the_bay_is_empty(
        tmp_path: Path, phase: Bay) -> None:
    steps = stops.stop(facts(tmp_path, State.BACKOFF, phase), "stop", forced=False)
    assert steps[-1] == do.MaybeFinishStop()
    assert "TakeDown" not in kinds(steps)


def test_a_second_stop_skips_to_sigkill_and_a_third_does_nothing_more(
        tmp_path: Path) -> None:
    f = facts(tmp_path, State.STOPPING)
    assert stops.stop(f, "again", forced=False) == [do.ForceStop("again")]
    assert stops.stop(f, "and again", forced=True) == []
