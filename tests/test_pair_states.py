"""The engine pair's transition tables (supervisor/engine/pair/pair_states.py): every state is
reached from the start and has a way out (but FAILED, by design), and a change the table
does not allow raises."""

from __future__ import annotations

import enum
from collections.abc import Mapping

import pytest

from supervisor.engine.pair.pair_states import (
    BAY,
    CACHE,
    CACHE_BAYS,
    PHASE,
    ROLE,
    ROLE_BAYS,
    SERVING_BAYS,
    Bay,
    Cache,
    Phase,
    Role,
    check,
)
from supervisor.engine.states import State, TransitionError


def reachable(table: Mapping[enum.Enum, frozenset[enum.Enum]], start: enum.Enum) -> set:
    seen, todo = {start}, [start]
    while todo:
        for nxt in table[todo.pop()]:
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


@pytest.mark.parametrize(("table", "start", "terminal"), [
    (BAY, Bay.EMPTY, set()), (ROLE, Role.NONE, {Role.FAILED}), (PHASE, Phase.IDLE, set()),
    (CACHE, Cache.OFF, set()),
])
def test_every_state_is_reached_and_every_one_but_the_terminal_has_a_way_back(
        table, start, terminal) -> None:
    assert set(table) == set(type(start))  # a row for each state
    assert reachable(table, start) == set(type(start))
    for state in type(start):
        if state not in terminal:
            assert start in reachable(table, state), state  # back to the start


def test_a_change_the_table_does_not_allow_raises_naming_the_machine() -> None:
    check(BAY, Bay.EMPTY, Bay.SPAWNING)
    with pytest.raises(TransitionError, match="bay transition healthy -> spawning"):
        check(BAY, Bay.HEALTHY, Bay.SPAWNING)  # (never two processes in one bay)
    with pytest.raises(TransitionError, match="standby transition starting -> sleeping"):
        check(ROLE, Role.STARTING, Role.SLEEPING)  # (never put to sleep unproven; a copy
    # of a snapshot's images, proven and asleep before its dump, is ready at once)
    with pytest.raises(TransitionError, match="handover transition waking -> proving"):
        check(PHASE, Phase.WAKING, Phase.PROVING)  # (a woken standby is proven as woken)
    with pytest.raises(TransitionError, match="weight cache transition ready -> starting"):
        check(CACHE, Cache.READY, Cache.STARTING)  # (never two caches: the old one goes)


@pytest.mark.parametrize(("joint", "roles"), [
    (SERVING_BAYS, State), (ROLE_BAYS, Role), (CACHE_BAYS, Cache)], ids=["serving", "standby",
                                                                        "weight_cache"])
def test_each_role_table_says_which_bay_phases_each_of_its_states_allows(joint, roles) -> None:
    """The joint tables (the machines check every run against them): a row for each state
    of the role, each naming some of the bay's phases; none keeps an exited process but
    one on its way out (a standby being retired, a weight cache being stopped)."""
    assert set(joint) == set(roles)
    for state, phases in joint.items():
        assert phases and phases <= set(Bay), state
        assert Bay.EXITED not in phases or state in (Role.RETIRING, Cache.STOPPING), state
