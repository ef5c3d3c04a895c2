"""A proxy worker's view of the daemon's engines: their gates as last told, and every
decision that must hold across workers asked of the daemon.

The worker's `FrontProxy` runs unchanged over these: `GateMirror` answers what the proxy
reads of a gate (held or closed and why, the breaker, the limits, when the engine is
expected) from the daemon's last state message, and sends `acquire` and `done` to the
daemon, whose `Gate` admits or refuses (so the limits, the hold, the throttle level, the
KV breaker, the hold queue's bound and order and the fleet's early refusal are the one
gate's, whatever worker a request came in on). `RemoteLanes` asks the daemon for an
engine's suspect lane (one suspect at a time per engine, across workers). A failure seen
at an engine start is told to the daemon, which tells every worker
(`WorkerBackend.failed`), so a request sent after any worker saw the start fail is not
charged with its death.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from supervisor.front import quarantine
from supervisor.front.admission import GateLimits, Rejected, Ticket
from supervisor.front.dispatch import Backend
from supervisor.plane.wire import Link


@dataclass
class RemoteTicket(Ticket):
    """A slot the daemon granted: its id there, and the engine start it was counted at."""

    id: int = 0
    generation: int = 0


class Daemon:
    """The worker's side of the decisions the daemon makes: each a request with an id,
    answered once; a request the worker gives up on is cancelled (and a slot granted
    meanwhile given back)."""

    def __init__(self, link: Link) -> None:
        self.link = link
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future[Any]] = {}
        self._gates: dict[int, GateMirror] = {}  # the gate each slot is asked of

    async def _ask(self, kind: str, *args: Any,
                   gate: GateMirror | None = None) -> tuple[int, Any]:
        i = next(self._ids)
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._waiting[i] = fut
        if gate is not None:
            self._gates[i] = gate
        self.link.send((kind, i, *args))
        try:
            return i, await fut
        except asyncio.CancelledError:
            self._waiting.pop(i, None)
            self._gates.pop(i, None)
            # granted meanwhile: given back; else the daemon stops waiting for it
            granted = fut.done() and not fut.cancelled() and fut.exception() is None
            self.link.send(("cancel", i, granted))
            raise

    async def acquire(self, gate: GateMirror, tokens: int, refusable: bool) -> RemoteTicket:
        i, (tokens, waited_s, held, generation) = await self._ask(
            "acquire", gate.engine, tokens, refusable, gate=gate)
        return RemoteTicket(tokens, waited_s, held, id=i, generation=generation)

    def done(self, ticket: Ticket) -> None:
        assert isinstance(ticket, RemoteTicket)
        self.link.send(("done", ticket.id))

    async def lane(self, engine: str) -> int:
        i, _ = await self._ask("lane", engine)
        return i

    def answered(self, i: int, result: Any) -> None:
        fut = self._waiting.pop(i, None)
        if (gate := self._gates.pop(i, None)) is not None:
            # a slot granted: the gate was open then, whatever the last state said (the
            # next state, sent after the grant, is read after it): a continued stream
            # must not read the hold it was let through as still on
            gate.held_reason = gate.closed_reason = None
        if fut is not None and not fut.done():
            fut.set_result(result)

    def refused(self, i: int, reason: str, detail: str, waited_s: float, held: bool) -> None:
        self._gates.pop(i, None)
        fut = self._waiting.pop(i, None)
        if fut is not None and not fut.done():
            fut.set_exception(Rejected(reason, detail, waited_s=waited_s, held=held))

    def lost(self, why: str) -> None:
        """The daemon is gone: every request waiting for it is refused."""
        for i in list(self._waiting):
            self.refused(i, "engine_down", f"the daemon is gone ({why})", 0.0, False)


class GateMirror:
    """What the proxy reads of an engine's gate, as the daemon last said; admission is the
    daemon's (`Daemon.acquire`)."""

    def __init__(self, engine: str, daemon: Daemon) -> None:
        self.engine = engine
        self.daemon = daemon
        self.limits = GateLimits()
        self.level = 0
        self.held_reason: str | None = "engine not started"
        self.closed_reason: str | None = None
        self.unhealthy: str | None = "engine not started"
        self.breaker_open = False
        self.ready_at: float | None = None
        self.in_flight = 0
        self.waiting = 0

    async def acquire(self, tokens: int, refusable: bool = False) -> Ticket:
        return await self.daemon.acquire(self, tokens, refusable)

    def done(self, ticket: Ticket) -> None:
        self.daemon.done(ticket)


class WorkerBackend(Backend):
    """An engine as a worker sees it: whether it serves and which start it is, as the
    daemon last said; the failures seen at its starts shared through the daemon."""

    daemon: Daemon | None = None
    is_ready: bool = False
    start: int = 0

    def failed(self, generation: int, now: float) -> float:
        first = super().failed(generation, now)
        if first == now and self.daemon is not None:
            self.daemon.link.send(("failed", self.name, generation, now))
        return first

    def served(self, generation: int, sent_at: float) -> None:
        had = generation in self.failure_seen
        super().served(generation, sent_at)
        if had and generation not in self.failure_seen and self.daemon is not None:
            self.daemon.link.send(("served", self.name, generation, sent_at))


def worker_backend(engine: dict[str, Any], daemon: Daemon) -> WorkerBackend:
    gate = GateMirror(engine["name"], daemon)
    b = WorkerBackend(engine["name"], gate, lambda: False, engine["upstream"])  # type: ignore[arg-type]
    b.daemon = daemon
    b.ready = lambda: b.is_ready
    b.generation = lambda: b.start
    apply(b, engine)
    return b


def apply(b: WorkerBackend, engine: dict[str, Any]) -> None:
    """The daemon's latest word on engine `b` (`pool.engine_state` writes it)."""
    gate = b.gate
    assert isinstance(gate, GateMirror)
    b.upstream, b.models, b.models_open = engine["upstream"], engine["models"], \
        engine["models_open"]
    b.fallback, b.is_ready, b.start = engine["fallback"], engine["ready"], engine["generation"]
    for generation, first in engine["failure_seen"].items():
        if b.failure_seen.get(generation, first + 1) > first:
            b.failure_seen[generation] = first
    for generation in [g for g in b.failure_seen if g not in engine["failure_seen"]
                       and engine["cleared"].get(g, -1.0) > b.failure_seen[g]]:
        del b.failure_seen[generation]
    for key in ("limits", "level", "held_reason", "closed_reason", "unhealthy",
                "breaker_open", "ready_at", "in_flight", "waiting"):
        setattr(gate, key, engine[key])


class RemoteLanes(quarantine.Quarantine):
    """The suspect lanes, one per engine across the workers: the daemon's."""

    def __init__(self, daemon: Daemon) -> None:
        super().__init__()
        self.daemon = daemon

    @contextlib.asynccontextmanager
    async def _through(self, engine: str, timeout_s: float | None) -> AsyncIterator[None]:
        i = await asyncio.wait_for(self.daemon.lane(engine), timeout_s)
        try:
            yield
        finally:
            self.daemon.link.send(("unlane", i))
