"""The engine's lifecycle states and the transitions allowed between them.

This module imports nothing of the project: it is the vocabulary every other module
shares, and the single table that says which state may follow which.
"""

from __future__ import annotations

import enum


class State(enum.Enum):
    STARTING = "STARTING"  # engine spawned, waiting for /health to answer 200
    RUNNING = "RUNNING"  # engine healthy and serving
    DRAINING = "DRAINING"  # restart asked: engine finishing in-flight work, then stopped
    STOPPING = "STOPPING"  # daemon shutting down: engine being stopped for good
    BACKOFF = "BACKOFF"  # engine gone unasked (or failed to boot): tree reaped, waiting to retry
    FATAL = "FATAL"  # gave up restarting; daemon still answers, `restart` leaves this state
    STOPPED = "STOPPED"  # engine stopped for good, daemon about to exit


# Which states may follow each state. Every transition goes through
# EngineUnit.set_state, which checks this table; there is no way around it.
TRANSITIONS: dict[State, frozenset[State]] = {
    # STOPPED -> STARTING is the daemon's first start.
    State.STOPPED: frozenset({State.STARTING}),
    State.STARTING: frozenset({State.RUNNING, State.BACKOFF, State.FATAL, State.STOPPING,
                               State.DRAINING}),
    # RUNNING -> FATAL: the policy holds the engine down (an XID that needs a GPU reset).
    State.RUNNING: frozenset({State.DRAINING, State.BACKOFF, State.STOPPING, State.FATAL}),
    # DRAINING -> RUNNING: the drained engine's standby took over (no cold start)
    State.DRAINING: frozenset({State.STARTING, State.RUNNING, State.BACKOFF, State.FATAL,
                               State.STOPPING}),
    State.BACKOFF: frozenset({State.STARTING, State.FATAL, State.STOPPING}),
    State.FATAL: frozenset({State.STARTING, State.STOPPING}),
    State.STOPPING: frozenset({State.STOPPED}),
}


class TransitionError(RuntimeError):
    """A transition the table does not allow: a bug in the daemon, never an input error."""


def check_transition(old: State, new: State) -> None:
    if new not in TRANSITIONS[old]:
        raise TransitionError(f"transition {old.value} -> {new.value} is not allowed")
