"""The serving bay's role (`supervisor/engine/pair/serving.py`): its table, row by row.

A pure decider: the unit's state as `PairFacts` and one outcome of the serving engine's
process in, steps out; nothing held, nothing done. The unit's own tests
(tests/test_supervisor_unit.py) and the pair machine (tests/test_pair_machine.py) run it
through the executor; these pin each row of its table.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from pathlib import Path

import pytest

from supervisor.engine import steps as do
from supervisor.engine.events import GateProbe, TreeSeen
from supervisor.engine.pair import outcomes as out
from supervisor.engine.pair import serving
from supervisor.engine.process.process import EngineProcess
from supervisor.engine.states import State
from supervisor.engine.steps import PairFacts
from supervisor.watchdog.warmup import Warmed
from tests.unit_world import World


def facts(tmp: Path, state: State, fronted: bool = True, canary: bool = True) -> PairFacts:
    w = World(tmp, fronted=fronted, canary={"enabled": canary})
    return dataclasses.replace(w.sup.pair_facts(), state=state, restart_reason="the reason",
                               now=2000.0)


def engine(exit_code: int | None = None, healthy_at: float | None = None) -> EngineProcess:
    e = EngineProcess(generation=3, proc=None,  # type: ignore[arg-type]
                      pid=4242, started_at=1900.0, spec=None,  # type: ignore[arg-type]
                      config=None, recent_errors=deque(maxlen=20))  # type: ignore[arg-type]
    e.exit_code, e.healthy_at = exit_code, healthy_at
    return e


def decide(f: PairFacts, o: out.Outcome, fits: bool = False, warm: bool = True) -> list[do.Step]:
    return serving.on_process(f, o, standby_fits=fits, warm=warm)


@pytest.mark.parametrize("state,busy,want", [
    (State.STOPPING, False, [do.MaybeFinishStop()]),
    (State.STOPPING, True, [do.MaybeFinishStop()]),  # (a stop first: nothing to wait for)
    (State.STARTING, True, [do.StartRefused("GPU 0 held")]),
    (State.DRAINING, False, [do.StartEngine("the reason")]),
    (State.STARTING, False, [do.Fail("engine could not be started: GPU 0 held", None)]),
])
def test_a_spawn_that_failed(tmp_path: Path, state: State, busy: bool,
                             want: list[do.Step]) -> None:
    assert decide(facts(tmp_path, state), out.SpawnFailed("GPU 0 held", busy)) == want


def test_an_engine_up_is_followed_and_taken_down_if_a_stop_came_meanwhile(
        tmp_path: Path) -> None:
    e = engine()
    assert decide(facts(tmp_path, State.STARTING), out.Up(e)) == [do.Started(), do.Follow(e)]
    assert decide(facts(tmp_path, State.STARTING, fronted=False), out.Up(e)) == [do.Started()]
    for state in (State.STOPPING, State.DRAINING):
        assert decide(facts(tmp_path, state), out.Up(e)) == [
            do.Started(), do.Follow(e), do.TakeDown(graceful=True)]


def test_a_healthy_engine_runs_serves_arms_a_standby_and_is_proven(tmp_path: Path) -> None:
    e = engine(healthy_at=1912.5)
    steps = decide(facts(tmp_path, State.STARTING), out.Healthy(e), warm=False)
    assert steps == [do.EngineHealthy(e),
                     do.SetState(State.RUNNING, "/health answered 200 after 12.5 s"),
                     do.NotifyReady("RUNNING: engine pid 4242 serving"), do.Serve(e),
                     do.ArmStandby(), do.ProbeGate(e, golden=True, warm=False)]
    # nothing to prove it with (no canary): its held requests go at once
    steps = decide(facts(tmp_path, State.STARTING, canary=False), out.Healthy(e))
    assert steps[-2:] == [do.Admit(), do.RelaunchFinish("ok", None)]


def test_an_unhealthy_start_fails(tmp_path: Path) -> None:
    f = facts(tmp_path, State.STARTING)
    assert decide(f, out.Unhealthy(engine(), "not healthy within 60 s", timed_out=True)) \
        == [do.Fail("engine not healthy within 60 s", None)]
    assert decide(f, out.Unhealthy(engine(), "its start was given up", timed_out=False)) \
        == [do.Fail("its start was given up", None)]


def test_a_crash_fails_over_when_a_standby_fits_else_fails(tmp_path: Path) -> None:
    e = engine(exit_code=-9, healthy_at=1950.0)
    why = "engine killed by SIGKILL without being asked"
    running = facts(tmp_path, State.RUNNING)
    assert decide(running, out.Died(e, "", core=False), fits=True) == [
        do.CountRestart("crash"), do.FailOver(why, graceful=False)]
    assert decide(running, out.Died(e, "", core=False), fits=False) == [
        do.ServingFailed(), do.Fail(why, 50.0)]
    # a crash while starting is a failed start, standby or not
    assert decide(facts(tmp_path, State.STARTING), out.Died(e, "", core=False), fits=True) \
        == [do.ServingFailed(), do.Fail(why, 50.0)]
    lost = engine(healthy_at=None)
    lost.core_lost = 77
    assert decide(running, out.Died(lost, "", core=True))[-1] == do.Fail(
        "engine lost its core (pid 77) without being asked", None)


@pytest.mark.parametrize("state,problem,last", [
    (State.STOPPING, None, "finish"),
    (State.STOPPING, "survived SIGKILL", "finish, failed"),
    (State.RUNNING, "survived SIGKILL", "give up"),
    (State.DRAINING, None, "start"),
    (State.BACKOFF, None, "down"),
    (State.FATAL, "survived SIGKILL", "down"),  # (already given up: not twice)
    (State.RUNNING, None, None),  # (a failover's old engine: the standby's bay)
])
def test_a_tree_gone(tmp_path: Path, state: State, problem: str | None,
                     last: str | None) -> None:
    e = engine(exit_code=0)
    steps = decide(facts(tmp_path, state), out.Gone(e, problem))
    assert steps[:2] == [do.EndStopDeadline(), do.Relaunch("down")]
    want: dict[str | None, list[do.Step]] = {
        "finish": [do.MaybeFinishStop(failed=False)],
        "finish, failed": [do.MaybeFinishStop(failed=True)],
        "give up": [do.GiveUp(problem or "", e)], "start": [do.StartEngine("the reason")],
        "down": [do.FailedDown(e, problem)], None: []}
    assert steps[2:] == want[last]


def test_nothing_and_a_tree_look_ask_nothing(tmp_path: Path) -> None:
    f = facts(tmp_path, State.RUNNING)
    assert decide(f, out.NOTHING) == []
    seen = TreeSeen(3, (), 1.0, 0, 0.0)
    assert decide(f, out.Seen(engine(), seen, None)) == []


PASSED = [do.RelaunchFinish("ok", None), do.Admit(), do.HandoverDone()]


def test_a_proof_that_passed_lets_the_held_requests_go() -> None:
    assert serving.proved(GateProbe(3, ok=True, error=None), 1) == PASSED
    # (checked against its golden answers: none failed in a row now)
    checked = GateProbe(3, ok=True, error=None, golden="the answers")
    assert serving.proved(checked, 1) == [do.GoldenPassed(), *PASSED]
    # a canary that failed: released anyway, the relaunch saying why
    assert serving.proved(GateProbe(3, ok=False, error="HTTP 500"), 0) == [
        do.RelaunchFinish("ok", "the first canary failed: HTTP 500"), do.Admit(),
        do.HandoverDone()]


def test_a_proof_that_failed_restarts_the_engine_and_the_second_golden_one_holds_it_down(
        ) -> None:
    wrong = GateProbe(3, ok=True, error="answers changed", golden="x", golden_mismatch=True)
    assert serving.proved(wrong, 0) == [do.GoldenFailed(), do.Fail("answers changed", None)]
    assert serving.proved(wrong, 1) == [
        do.GoldenFailed(), do.GiveUp("answers changed (twice in a row: held down)")]
    woke = GateProbe(3, ok=False, error="wake failed", broken_by_wake=True)
    assert serving.proved(woke, 0) == [
        do.Fail("after its warm-up sleep and wake: wake failed", None)]
    cold = GateProbe(3, ok=True, error=None, warmed=Warmed(error="/v1/chat silent"))
    assert serving.proved(cold, 0) == [do.Fail("warm-up failed", None)]
