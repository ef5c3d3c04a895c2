"""Pure lifecycle rules with explicit times: backoff, boot-failure limit, transitions."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from supervisor.engine.lifecycle import RestartTracker
from supervisor.engine.states import TRANSITIONS, State, TransitionError, check_transition
from supervisor.settings.sections import RestartConfig

CFG = RestartConfig(backoff_initial_s=1, backoff_max_s=8, backoff_multiplier=2,
                    stable_uptime_s=300, boot_failures_max=3, boot_failure_window_s=600)


def test_crash_backoff_doubles_up_to_the_cap():
    t = RestartTracker(CFG)
    delays = [t.record_failure(100.0 * i, healthy_for_s=10, what="crash").delay_s
              for i in range(6)]
    assert delays == [1, 2, 4, 8, 8, 8]


def test_a_stable_run_resets_the_backoff():
    t = RestartTracker(CFG)
    for i in range(4):
        t.record_failure(i, healthy_for_s=1, what="crash")
    v = t.record_failure(1000, healthy_for_s=300, what="crash after a long run")
    assert v.delay_s == 1 and not v.fatal


def test_crashes_after_serving_never_make_fatal():
    t = RestartTracker(CFG)
    for i in range(50):
        assert not t.record_failure(i, healthy_for_s=5, what="crash").fatal


def test_boot_failures_within_the_window_make_fatal():
    t = RestartTracker(CFG)
    assert not t.record_failure(0, healthy_for_s=None, what="bad flag").fatal
    assert not t.record_failure(10, healthy_for_s=None, what="bad flag").fatal
    v = t.record_failure(20, healthy_for_s=None, what="bad flag")
    assert v.fatal and v.reason == "3 boot failures within 600 s; last: bad flag"


def test_boot_failures_outside_the_window_do_not_count():
    t = RestartTracker(CFG)
    t.record_failure(0, healthy_for_s=None, what="x")
    t.record_failure(10, healthy_for_s=None, what="x")
    assert not t.record_failure(700, healthy_for_s=None, what="x").fatal


def test_reset_leaves_fatal_behind():
    t = RestartTracker(CFG)
    for i in range(3):
        t.record_failure(i, healthy_for_s=None, what="x")
    t.reset()
    v = t.record_failure(5, healthy_for_s=None, what="x")
    assert not v.fatal and v.delay_s == 1


@given(st.lists(st.tuples(st.floats(0, 50), st.one_of(st.none(), st.floats(0, 1000))),
                max_size=40))
def test_delays_stay_within_bounds_and_fatal_needs_enough_boot_failures(events):
    t = RestartTracker(CFG)
    now = 0.0
    boots: list[float] = []
    for gap, healthy in events:
        now += gap
        if healthy is None:
            boots.append(now)
        v = t.record_failure(now, healthy_for_s=healthy, what="x")
        recent = [b for b in boots if now - b <= CFG.boot_failure_window_s]
        assert v.fatal == (len(recent) >= CFG.boot_failures_max)
        if not v.fatal:
            assert CFG.backoff_initial_s <= v.delay_s <= CFG.backoff_max_s
        if v.fatal:
            t.reset()
            boots.clear()


@pytest.mark.parametrize(("old", "new"), [
    (State.STOPPED, State.STARTING), (State.STARTING, State.RUNNING),
    (State.RUNNING, State.DRAINING), (State.DRAINING, State.STARTING),
    (State.RUNNING, State.BACKOFF), (State.BACKOFF, State.STARTING),
    (State.BACKOFF, State.FATAL), (State.FATAL, State.STARTING),
    (State.RUNNING, State.STOPPING), (State.STOPPING, State.STOPPED),
])
def test_allowed_transitions(old, new):
    check_transition(old, new)


@pytest.mark.parametrize(("old", "new"), [
    (State.STOPPED, State.RUNNING), (State.RUNNING, State.STARTING),
    (State.STOPPING, State.STARTING), (State.FATAL, State.RUNNING),
    (State.BACKOFF, State.RUNNING), (State.STOPPED, State.STOPPED),
])
def test_forbidden_transitions_raise(old, new):
    with pytest.raises(TransitionError):
        check_transition(old, new)


def test_every_state_can_reach_stopped():
    for start in State:
        seen, todo = {start}, [start]
        while todo:
            for nxt in TRANSITIONS[todo.pop()]:
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        assert State.STOPPED in seen or start is State.STOPPED
