"""A client connection's states, one per side as h11 keeps them: where its reading is
(`Phase`: the parser between requests, in a head, in a body) and where its writing is
(`Send`), with the one table that says which writing state may follow which.

Like `supervisor/engine/states.py`, this module imports nothing of the project: it is
the vocabulary of `supervisor/front/connection.py`, `reading.py` and `sending.py`. Every
change of `Send` goes through `Sender._to`, which checks `SEND`; a change the table does
not allow raises `TransitionError`: a bug in the front door, never a client's doing. (The
changes are not logged: a connection goes through four of them a request; the refusals
and the cuts log their own line.)
"""

from __future__ import annotations

import enum


class Phase(enum.Enum):
    """Where the parser is in the connection's bytes."""

    IDLE = "idle"  # between requests
    HEAD = "head"  # a request's line and header fields
    BODY = "body"  # its body (with its chunk framing and trailers)


class Send(enum.Enum):
    """Where the connection's writing is. (Beside it, as h11 keeps its keep-alive flag:
    `Sender.closing`, no request after the one being answered is served.)"""

    # (hashed as the object it is, in C: Enum's own hash, in Python, cost a request
    # more than a microsecond in the table's lookups; a member is its only instance)
    __hash__ = object.__hash__

    IDLE = "idle"  # no answer under way: none yet, or the last one kept the connection
    ANSWERING = "answering"  # a request's answer under way, not a byte of it written:
    # a refusal may still be written in its place
    WRITING = "writing"  # bytes of that answer written: a refusal can only cut it now
    CLOSING = "closing"  # no answer more (the last one out, a refusal, or none): the
    # transport closed, or what the client still sends read and dropped for at most
    # LINGER_S after our side ended
    CLOSED = "closed"  # the client gone (`connection_lost`): nothing more is written


SEND: dict[Send, frozenset[Send]] = {
    # IDLE -> CLOSING: a refusal with no answer under way, or the connection closed idle
    Send.IDLE: frozenset({Send.ANSWERING, Send.CLOSING, Send.CLOSED}),
    # -> IDLE: the answer ended and the connection is kept (the next request, if one
    # waits, goes IDLE -> ANSWERING at once); -> CLOSING: it was the last, or refused
    Send.ANSWERING: frozenset({Send.WRITING, Send.IDLE, Send.CLOSING, Send.CLOSED}),
    Send.WRITING: frozenset({Send.IDLE, Send.CLOSING, Send.CLOSED}),
    Send.CLOSING: frozenset({Send.CLOSED}),
    Send.CLOSED: frozenset(),
}


class TransitionError(RuntimeError):
    """A change of state the table does not allow: a bug, never an input error."""


def check(old: Send, new: Send) -> None:
    """`old` -> `new` is in `SEND`, or `TransitionError`."""
    if new not in SEND[old]:
        raise TransitionError(f"send transition {old.value} -> {new.value} is not allowed")
