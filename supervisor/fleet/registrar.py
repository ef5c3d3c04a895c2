"""This daemon's place in each vLLM router it is configured with (`[fleet]`, docs/fleet.md).

`Registrar` tends one task per router. The daemon wants to be a router's worker while its
proxy's `/health` says it serves (every model served now or within a short wait); while
it does not (a cold start, an operator's drain, FATAL, stopping) it wants out, so that the
router sends elsewhere instead of holding or failing requests here. Each task compares
that wish with what it knows of the router and calls the router only when they differ,
and reads the router's worker list every `check_interval_s` while registered: a router
that restarted has forgotten its workers, and is told again.

A router that is down, slow or answers nonsense never blocks the daemon: each call is
bounded, a failed one is retried with exponential backoff and jitter (tenacity), and a
state change (registered, left, unreachable) is logged once, not at every try. Stopping,
the daemon leaves every router first, within a bound, so that no router sends it a
request it would refuse.

Owns the routers' standing as this daemon knows it; reads the daemon only through the
`why_not` callable it is given.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import httpx
import structlog
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception_type,
    wait_exponential,
    wait_random,
)

from supervisor.fleet.router import Router, RouterError
from supervisor.loop import http_client

log = structlog.get_logger("supervisor")
# how often each task looks at the daemon's wish (a function call, no I/O)
LOOK_S = 0.25


class FleetSettings(Protocol):
    @property
    def routers(self) -> list[str]: ...
    @property
    def check_interval_s(self) -> float: ...
    @property
    def request_timeout_s(self) -> float: ...
    @property
    def retry_initial_s(self) -> float: ...
    @property
    def retry_max_s(self) -> float: ...


@dataclass
class Standing:
    """One router as this daemon knows it."""

    router: str
    registered: bool | None = None  # None: not known yet (a previous run may be listed)
    error: str | None = None  # the last call failed: why (until one succeeds)
    since: float = 0.0
    wake: asyncio.Event = field(default_factory=asyncio.Event)


class Registrar:
    def __init__(self, settings: FleetSettings, advertise: str,
                 why_not: Callable[[], str | None], client: httpx.AsyncClient | None = None,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self.s, self.advertise, self._why_not = settings, advertise, why_not
        self._client = client or http_client()
        self._own_client = client is None
        self._monotonic = monotonic
        self.standings = {u: Standing(u, since=monotonic()) for u in settings.routers}
        self._routers = {u: Router(u, self._client, settings.request_timeout_s)
                         for u in settings.routers}
        self._tasks: list[asyncio.Task[None]] = []
        self._leaving = False

    def start(self) -> None:
        self._tasks = [asyncio.ensure_future(self._tend(self._routers[u], st))
                       for u, st in self.standings.items()]

    def registered(self) -> dict[str, bool]:
        """Each router: whether this daemon is its worker (as last seen)."""
        return {u: bool(st.registered) and st.error is None
                for u, st in self.standings.items()}

    async def leave(self, timeout_s: float) -> None:
        """Stop tending, and leave every router it may be registered with, each within
        `timeout_s` (concurrently); a router that does not answer is logged, not waited
        for (its health checks will find this daemon gone)."""
        self._leaving = True
        for st in self.standings.values():
            st.wake.set()
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []

        async def one(st: Standing) -> None:
            if st.registered is False and st.error is None:
                return
            try:
                await asyncio.wait_for(self._routers[st.router].remove(self.advertise),
                                       timeout_s)
            except (RouterError, TimeoutError) as exc:
                log.warning("could not leave router", router=st.router,
                            error=str(exc) or f"no answer within {timeout_s:g} s")
                return
            self._standing(st, False, None, "the daemon is stopping")

        await asyncio.gather(*(one(st) for st in self.standings.values()))

    async def close(self, timeout_s: float) -> None:
        """The daemon ends: leave the routers if that was not done yet (an engine unit
        that failed ends the daemon without a stop), then close the client."""
        if not self._leaving:
            await self.leave(timeout_s)
        if self._own_client:
            await self._client.aclose()

    # ---- each router's task ---------------------------------------------------------

    async def _tend(self, r: Router, st: Standing) -> None:
        checked_at = float("-inf")
        while not self._leaving:
            want = self._why_not() is None
            now = self._monotonic()
            if want != st.registered or (want and now - checked_at >= self.s.check_interval_s):
                retrying = AsyncRetrying(
                    retry=retry_if_exception_type(RouterError),
                    # doubling from retry_initial_s up to retry_max_s, plus up to
                    # retry_initial_s of jitter (hosts that lost a router together do
                    # not come back to it in step)
                    wait=wait_exponential(multiplier=self.s.retry_initial_s,
                                          max=self.s.retry_max_s)
                    + wait_random(0, self.s.retry_initial_s),
                    stop=lambda _: self._leaving,
                    sleep=functools.partial(self._nap, st),
                    before_sleep=functools.partial(self._failed, st), reraise=True)
                try:
                    async for attempt in retrying:
                        with attempt:
                            await self._reconcile(r, st)
                except RouterError:
                    return  # (only when leaving: the retries never stop otherwise)
                checked_at = self._monotonic()
            await self._nap(st, LOOK_S)

    async def _reconcile(self, r: Router, st: Standing) -> None:
        """One look: in the router's list when wanted there, out of it when not."""
        why = self._why_not()
        if why is None:
            if self.advertise in await r.workers():
                self._standing(st, True, None, "listed")
                return
            forgot = st.registered is True and st.error is None
            await r.add(self.advertise)
            if forgot:  # (no change of standing to log, but news)
                log.info("registered with router", router=st.router,
                         advertise=self.advertise, why="the router had forgotten this daemon")
            self._standing(st, True, None, "serving")
        else:
            await r.remove(self.advertise)
            self._standing(st, False, None, why)

    def _standing(self, st: Standing, registered: bool, error: str | None, why: str) -> None:
        changed = (registered, error is None) != (st.registered, st.error is None)
        if changed:
            st.since = self._monotonic()
            if error is not None:
                log.warning("router unreachable", router=st.router, error=error)
            elif registered:
                log.info("registered with router", router=st.router, advertise=self.advertise,
                         why=why)
            else:
                log.info("out of router", router=st.router, why=why)
        st.registered, st.error = registered, error

    def _failed(self, st: Standing, rs: RetryCallState) -> None:
        exc = rs.outcome.exception() if rs.outcome is not None else None
        self._standing(st, bool(st.registered), str(exc), "call failed")

    async def _nap(self, st: Standing, seconds: float) -> None:
        """Sleep up to `seconds`; at once when the daemon leaves."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(st.wake.wait(), seconds)
