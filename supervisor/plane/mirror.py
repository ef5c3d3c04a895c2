"""A proxy worker's view of the daemon's engines: their gates as last told, and every
decision that must hold across workers asked of the daemon.

The worker's `FrontProxy` runs unchanged over these, which are what it reads of an
engine (`dispatch.EngineGate`) and of the suspect lanes (`quarantine.Lanes`), not copies
of the daemon's classes: `GateMirror` answers what the proxy reads of a gate (held and
why, unhealthy, the breaker, the limits, when the engine is expected, requests in
flight) from the daemon's last `State`, and sends `Acquire` and `Done` to the daemon,
whose `Gate` admits or refuses (so the limits, the hold, the throttle level, the KV
breaker, the hold queue's bound and order and the fleet's early refusal are the one
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
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from supervisor.front import quarantine
from supervisor.front.admission import GateLimits, Rejected, Ticket
from supervisor.front.dispatch import Backend
from supervisor.plane.messages import (
    Acquire,
    Cancel,
    Done,
    EngineState,
    Failed,
    Granted,
    Lane,
    Laned,
    Refused,
    Served,
    ToDaemon,
    ToWorker,
    Unlane,
)
from supervisor.plane.wire import Link

_STRAIGHT: contextlib.nullcontext[None] = contextlib.nullcontext()


@dataclass
class RemoteTicket(Ticket):
    """A slot the daemon granted: its id there, and the engine start it was counted at."""

    id: int = 0
    generation: int = 0


class Daemon:
    """The worker's side of the decisions the daemon makes: each a request with an id,
    answered once; a request the worker gives up on is cancelled (and a slot granted
    meanwhile given back)."""

    def __init__(self, link: Link[ToWorker, ToDaemon]) -> None:
        self.link = link
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future[Granted | Laned]] = {}
        self._gates: dict[int, GateMirror] = {}  # the gate each slot is asked of

    async def _ask(self, ask: Callable[[int], ToDaemon],
                   gate: GateMirror | None = None) -> Granted | Laned:
        i = next(self._ids)
        fut: asyncio.Future[Granted | Laned] = asyncio.get_running_loop().create_future()
        self._waiting[i] = fut
        if gate is not None:
            self._gates[i] = gate
        self.link.send(ask(i))
        try:
            return await fut
        except asyncio.CancelledError:
            self._waiting.pop(i, None)
            self._gates.pop(i, None)
            # granted meanwhile: given back; else the daemon stops waiting for it
            granted = fut.done() and not fut.cancelled() and fut.exception() is None
            self.link.send(Cancel(i, granted))
            raise

    async def acquire(self, gate: GateMirror, tokens: int, refusable: bool,
                      to_go: int | None) -> RemoteTicket:
        g = await self._ask(lambda i: Acquire(i, tokens, refusable,
                                              -1 if to_go is None else to_go, gate.engine),
                            gate)
        assert isinstance(g, Granted)
        return RemoteTicket(g.tokens, g.waited_s, g.held, id=g.id, generation=g.generation)

    def done(self, ticket: Ticket) -> None:
        assert isinstance(ticket, RemoteTicket)
        self.link.send(Done(ticket.id))

    async def lane(self, engine: str) -> int:
        laned = await self._ask(lambda i: Lane(i, engine))
        return laned.id

    def answered(self, answer: Granted | Laned) -> None:
        fut = self._waiting.pop(answer.id, None)
        if (gate := self._gates.pop(answer.id, None)) is not None:
            # a slot granted: the gate was open then, whatever the last state said (the
            # next state, sent after the grant, is read after it): a continued stream
            # must not read the hold it was let through as still on
            gate.held_reason = None
        if fut is not None and not fut.done():
            fut.set_result(answer)

    def refused(self, no: Refused) -> None:
        self._gates.pop(no.id, None)
        fut = self._waiting.pop(no.id, None)
        if fut is not None and not fut.done():
            fut.set_exception(Rejected(no.reason, no.detail, waited_s=no.waited_s,
                                       held=no.held))

    def lost(self, why: str) -> None:
        """The daemon is gone: every request waiting for it is refused."""
        for i in list(self._waiting):
            self.refused(Refused(i, "engine_down", f"the daemon is gone ({why})", 0.0,
                                 False))


class GateMirror:
    """An engine's gate as the proxy reads it (`dispatch.EngineGate`), as the daemon last
    said; admission is the daemon's (`Daemon.acquire`)."""

    def __init__(self, engine: str, daemon: Daemon) -> None:
        self.engine = engine
        self.daemon = daemon
        self.limits = GateLimits()
        self.held_reason: str | None = "engine not started"
        self.unhealthy: str | None = "engine not started"
        self.breaker_open = False
        self.ready_at: float | None = None
        self.in_flight = 0

    async def acquire(self, tokens: int, refusable: bool = False,
                      to_go: int | None = None) -> Ticket:
        return await self.daemon.acquire(self, tokens, refusable, to_go)

    def done(self, ticket: Ticket) -> None:
        self.daemon.done(ticket)

    def told(self, e: EngineState) -> None:
        self.limits, self.held_reason, self.unhealthy = e.limits, e.held_reason, e.unhealthy
        self.breaker_open, self.ready_at, self.in_flight = e.breaker_open, e.ready_at, \
            e.in_flight


class WorkerBackend(Backend):
    """An engine as a worker sees it: whether it serves and which start it is, as the
    daemon last said; the failures seen at its starts shared through the daemon."""

    def __init__(self, e: EngineState, daemon: Daemon) -> None:
        self.mirror = GateMirror(e.name, daemon)
        self.daemon = daemon
        self.is_ready, self.start = e.ready, e.generation
        super().__init__(e.name, self.mirror, self._ready, e.upstream,
                         generation=self._generation)
        self.told(e)

    def _ready(self) -> bool:
        return self.is_ready

    def _generation(self) -> int:
        return self.start

    def told(self, e: EngineState) -> None:
        """The daemon's latest word on this engine (`pool.engine_state` writes it)."""
        self.upstream, self.models, self.models_open = e.upstream, e.models, e.models_open
        self.priority_scheduling = e.priority_scheduling
        self.fallback, self.is_ready, self.start = e.fallback, e.ready, e.generation
        seen = dict(e.failure_seen)
        cleared = dict(e.cleared)
        for generation, first in seen.items():
            if self.failure_seen.get(generation, first + 1) > first:
                self.failure_seen[generation] = first
        for generation in [g for g in self.failure_seen if g not in seen
                           and cleared.get(g, -1.0) > self.failure_seen[g]]:
            del self.failure_seen[generation]
        self.mirror.told(e)

    def failed(self, generation: int, now: float) -> float:
        first = super().failed(generation, now)
        if first == now:
            self.daemon.link.send(Failed(self.name, generation, now))
        return first

    def served(self, generation: int, sent_at: float) -> None:
        had = generation in self.failure_seen
        super().served(generation, sent_at)
        if had and generation not in self.failure_seen:
            self.daemon.link.send(Served(self.name, generation, sent_at))


class RemoteLanes:
    """The suspect lanes (`quarantine.Lanes`), one per engine across the workers: the
    daemon's."""

    def __init__(self, daemon: Daemon) -> None:
        self.daemon = daemon

    def lane(self, engine: str, deaths: int,
             timeout_s: float | None = None) -> contextlib.AbstractAsyncContextManager[None]:
        if deaths < quarantine.SUSPECT_AT:
            return _STRAIGHT
        return self._through(engine, timeout_s)

    @contextlib.asynccontextmanager
    async def _through(self, engine: str, timeout_s: float | None) -> AsyncIterator[None]:
        i = await asyncio.wait_for(self.daemon.lane(engine), timeout_s)
        try:
            yield
        finally:
            self.daemon.link.send(Unlane(i))
