"""The engine pair's states, written down: each bay's (the place one engine process lives
in, from its spawn to its tree proven gone), the standby's role in its bay, the
handover between the serving engine and its standby, and the weight cache beside them;
with the transitions allowed between them (docs/architecture.md draws them).

Like `supervisor/engine/states.py` (the unit's own lifecycle), this module imports
nothing of the project: it is the vocabulary, and the one table per machine that says
which state may follow which. Every change goes through a setter that checks its table
(`EngineSlot._set_phase`, `Standby._to`, `Handover._set_phase`, `WeightCache._to`); a
change the table does not allow raises `TransitionError`: a bug in the daemon, never an
input error.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import TypeVar

from supervisor.engine.states import State, TransitionError


class Bay(enum.Enum):
    """One engine's place (`EngineSlot`): a process in it, or on its way in or out. The
    bay's phases are the process's life as its events say it (`EngineSlot.on`); what the
    engine does there (serves, waits asleep, is proven) is its role's."""

    EMPTY = "empty"  # no engine
    SPAWNING = "spawning"  # its spawn under way (a Spawned event ends it)
    STARTING = "starting"  # spawned, its /health not 200 yet
    HEALTHY = "healthy"  # it answered /health: started (its role and watchers judge it)
    EXITED = "exited"  # its main process exited, its tree not yet taken down and reaped
    TAKING_DOWN = "taking_down"  # its take-down under way (a Down event ends it)


# an engine in the bay (started or not, alive or exited): what a take-down ends
IN_BAY = frozenset({Bay.STARTING, Bay.HEALTHY, Bay.EXITED})

BAY: dict[Bay, frozenset[Bay]] = {
    Bay.EMPTY: frozenset({Bay.SPAWNING}),
    Bay.SPAWNING: frozenset({Bay.STARTING, Bay.EMPTY}),  # EMPTY: the spawn failed
    Bay.STARTING: frozenset({Bay.HEALTHY, Bay.EXITED, Bay.TAKING_DOWN}),
    Bay.HEALTHY: frozenset({Bay.EXITED, Bay.TAKING_DOWN}),
    Bay.EXITED: frozenset({Bay.TAKING_DOWN}),  # (its tree is reaped by a take-down)
    Bay.TAKING_DOWN: frozenset({Bay.EMPTY}),  # (a tree not proven gone: the role says)
}


class Role(enum.Enum):
    """The standby's role in its bay (`Standby`): what `status`'s `standby.state` says."""

    NONE = "none"  # none configured, or none yet
    WAITING = "waiting"  # to start after a backoff (a StandbyDue event ends it)
    NO_ROOM = "no_room"  # none can start beside the serving engine (until its next cold start)
    STARTING = "starting"  # spawned, not healthy yet
    PROVING = "proving"  # healthy, its first generation under way
    SLEEPING = "sleeping"  # being put to sleep
    READY = "ready"  # proven (and asleep, with "sleep"), idle: a failover may take it
    DUMPING = "dumping"  # ("snapshot") asleep, being kept as images, which ends it: a
    # copy restored from them is the standby next
    RETIRING = "retiring"  # an engine in its bay (a failed standby, the old serving one)
    # being taken down
    RETURNING = "returning"  # the thinner engine that served until a full-size one took
    # over again (an asymmetric pair): its requests finishing, then asleep, the standby
    FAILED = "failed"  # a tree not proven gone: no new standby in this bay until a restart


ON_ITS_WAY = frozenset({Role.STARTING, Role.PROVING, Role.SLEEPING, Role.DUMPING})

ROLE: dict[Role, frozenset[Role]] = {
    Role.NONE: frozenset({Role.STARTING, Role.WAITING, Role.NO_ROOM}),
    Role.WAITING: frozenset({Role.NONE}),  # (its backoff over, or cut short)
    Role.NO_ROOM: frozenset({Role.STARTING, Role.WAITING, Role.NONE}),
    # -> RETIRING: it failed (or went out of date, or the daemon stops) with an engine in
    # its bay to take down; -> NONE: the same with nothing there (a failed spawn)
    # STARTING -> READY: a copy of a snapshot's images, proven and asleep when dumped
    Role.STARTING: frozenset({Role.PROVING, Role.READY, Role.RETIRING, Role.NONE}),
    Role.PROVING: frozenset({Role.SLEEPING, Role.READY, Role.RETIRING, Role.NONE}),
    Role.SLEEPING: frozenset({Role.READY, Role.DUMPING, Role.RETIRING, Role.NONE}),
    # DUMPING -> NONE: its tree gone (dumped or not: its bay free for a copy, or for a
    # standby that is not dumped); -> FAILED: not proven gone; -> RETIRING: the daemon
    # stops, or a restart retires it, while the dump (its take-down) goes on
    Role.DUMPING: frozenset({Role.NONE, Role.FAILED, Role.RETIRING}),
    # READY -> RETIRING: it took over, the old serving engine now in its bay to be taken
    # down (-> NONE when there was none)
    Role.READY: frozenset({Role.RETIRING, Role.NONE, Role.RETURNING}),
    Role.RETIRING: frozenset({Role.NONE, Role.FAILED}),  # FAILED: not proven gone
    # RETURNING -> SLEEPING (or READY, awake): its requests ended; -> RETIRING: they did
    # not within the drain's timeout, or it died, or the daemon stops
    Role.RETURNING: frozenset({Role.SLEEPING, Role.READY, Role.RETIRING}),
    Role.FAILED: frozenset(),  # until the daemon restarts (an operator's call)
}


# The joint table: the phases the standby's bay may be in for each of its roles, between
# two events (tests/test_pair_machine.py holds every run to it). A role speaks of what
# its engine does, the bay of the process: a ready standby is a healthy process, never an
# exited one nobody took down.
ROLE_BAYS: dict[Role, frozenset[Bay]] = {
    Role.NONE: frozenset({Bay.EMPTY}),
    Role.WAITING: frozenset({Bay.EMPTY}),
    Role.NO_ROOM: frozenset({Bay.EMPTY}),
    Role.STARTING: frozenset({Bay.SPAWNING, Bay.STARTING}),
    Role.PROVING: frozenset({Bay.HEALTHY}),
    Role.SLEEPING: frozenset({Bay.HEALTHY}),
    Role.READY: frozenset({Bay.HEALTHY}),
    Role.DUMPING: frozenset({Bay.TAKING_DOWN}),  # (the dump is its take-down)
    # (drained first, already exited, or taken down once its spawn in flight ends)
    Role.RETIRING: IN_BAY | {Bay.SPAWNING, Bay.TAKING_DOWN},
    Role.RETURNING: frozenset({Bay.HEALTHY}),
    Role.FAILED: frozenset({Bay.EMPTY}),
}


# The serving role's joint table: the phases the serving engine's bay may be in for each
# state of the unit (`supervisor/engine/states.py`), between two events. RUNNING is a
# healthy process and nothing else (a dead one is failed over or taken down at once);
# STARTING may wait with the bay empty (for the weight cache, a standby to sleep first, or
# an old tree to be gone); no state keeps an exited engine nobody took down.
SERVING_BAYS: dict[State, frozenset[Bay]] = {
    State.STOPPED: frozenset({Bay.EMPTY}),
    State.STARTING: frozenset({Bay.EMPTY, Bay.SPAWNING, Bay.STARTING}),
    State.RUNNING: frozenset({Bay.HEALTHY}),
    # (finishing its requests, taken down, or the restart's spawn: a restart that came
    # while it spawned takes it down once it is up)
    State.DRAINING: frozenset({Bay.HEALTHY, Bay.TAKING_DOWN, Bay.EMPTY, Bay.SPAWNING}),
    State.STOPPING: frozenset({Bay.EMPTY, Bay.SPAWNING, Bay.TAKING_DOWN}),
    State.BACKOFF: frozenset({Bay.EMPTY, Bay.TAKING_DOWN}),
    State.FATAL: frozenset({Bay.EMPTY, Bay.TAKING_DOWN}),
}


class Phase(enum.Enum):
    """The handover under way between the serving engine and its standby (`Handover`).
    An upgrade waiting for its standby is not a phase: the serving engine serves, and
    the swap it ends in is a failover like any other."""

    IDLE = "idle"  # no handover
    STANDBY_FIRST = "standby_first"  # a cold start waits for its standby to be asleep
    # first (two engines do not fit side by side while both start)
    WAKING_WHEN_DOWN = "waking_when_down"  # the standby serves, asleep: woken once the
    # old engine's memory is released (NVML lists none of its tree, or its tree is gone)
    WAKING = "waking"  # the standby that took over is being woken
    PROVING = "proving"  # the standby serves: held requests go once it answers a
    # generation
    PROVING_WOKEN = "proving_woken"  # ... a woken one: if it fails, the handover failed


HANDING_OVER = frozenset({Phase.WAKING_WHEN_DOWN, Phase.WAKING, Phase.PROVING,
                          Phase.PROVING_WOKEN})

PHASE: dict[Phase, frozenset[Phase]] = {
    # IDLE -> IDLE: a failover with nothing to wait for (no canary, awake) is over at once
    Phase.IDLE: frozenset({Phase.IDLE, Phase.STANDBY_FIRST, Phase.WAKING_WHEN_DOWN,
                           Phase.WAKING, Phase.PROVING}),
    Phase.STANDBY_FIRST: frozenset({Phase.IDLE}),
    Phase.WAKING_WHEN_DOWN: frozenset({Phase.WAKING, Phase.IDLE}),
    Phase.WAKING: frozenset({Phase.PROVING_WOKEN, Phase.IDLE}),
    # PROVING -> a handover again: the engine that took over died before its proof, and a
    # ready standby takes over in turn (an asymmetric pair's thin engine, kept and asleep
    # again behind the full-size one's swap)
    Phase.PROVING: frozenset({Phase.IDLE, Phase.WAKING_WHEN_DOWN, Phase.WAKING,
                              Phase.PROVING}),
    Phase.PROVING_WOKEN: frozenset({Phase.IDLE}),
}


class Cache(enum.Enum):
    """The engine's weight cache (`WeightCache`, `engine.weight_cache`): a `vllm preload`
    process beside the engine that holds its weights for the engine's starts to map."""

    OFF = "off"  # none configured (or turned off by a reload, or the daemon stopped)
    STARTING = "starting"  # spawned (or spawning), its /health not 200 yet
    READY = "ready"  # /health 200: an engine started now maps its weights
    STOPPING = "stopping"  # being taken down (it failed, went out of date, off, a stop)
    BACKOFF = "backoff"  # down after a failure; started again after a delay
    FAILED = "failed"  # given up (boot failures in a row), or its tree not proven gone:
    # engines load from disk until a reload changes it or the daemon restarts


CACHE: dict[Cache, frozenset[Cache]] = {
    Cache.OFF: frozenset({Cache.STARTING}),
    # -> BACKOFF | FAILED | OFF: its spawn failed (nothing to take down)
    Cache.STARTING: frozenset({Cache.READY, Cache.STOPPING, Cache.BACKOFF, Cache.FAILED,
                               Cache.OFF}),
    Cache.READY: frozenset({Cache.STOPPING}),
    # -> STARTING: it went out of date (a reload), and starts again at once
    Cache.STOPPING: frozenset({Cache.OFF, Cache.BACKOFF, Cache.FAILED, Cache.STARTING}),
    Cache.BACKOFF: frozenset({Cache.STARTING, Cache.OFF}),
    Cache.FAILED: frozenset({Cache.STARTING, Cache.OFF}),  # (a reload)
}

# The weight cache's states and its bay's phases, held together like ROLE_BAYS
# (tests/test_weight_cache_machine.py): ready is a healthy process, never an exited one.
CACHE_BAYS: dict[Cache, frozenset[Bay]] = {
    Cache.OFF: frozenset({Bay.EMPTY}),
    Cache.STARTING: frozenset({Bay.SPAWNING, Bay.STARTING}),
    Cache.READY: frozenset({Bay.HEALTHY}),
    # (taken down once its spawn in flight ends, drained of its engines first, or gone)
    Cache.STOPPING: IN_BAY | {Bay.SPAWNING, Bay.TAKING_DOWN, Bay.EMPTY},
    Cache.BACKOFF: frozenset({Bay.EMPTY}),
    Cache.FAILED: frozenset({Bay.EMPTY}),
}

_NAMES = {Bay: "bay", Role: "standby", Phase: "handover", Cache: "weight cache"}
S = TypeVar("S", Bay, Role, Phase, Cache)


def check(table: Mapping[S, frozenset[S]], old: S, new: S) -> None:
    """`old` -> `new` is in `table`, or `TransitionError`."""
    if new not in table[old]:
        raise TransitionError(f"{_NAMES[type(old)]} transition {old.value} -> {new.value} "
                              "is not allowed")
