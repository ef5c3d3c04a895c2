"""Requests that kill their engine, kept from taking the host down.

A request that crashes the engine whenever it runs (an oversized prompt that OOM-kills
vLLM, say) would otherwise be replayed on every restarted engine, since the proxy holds
and continues what a fault interrupts. Every request counts the engine deaths it was at
the engine for (`Exchange.deaths`): its stream broken by the engine, or its connection
dropped or answered 5xx by a dying engine; a connection refused does not count (the
request never reached an engine), nor a stream paused for a drained restart, nor a
request sent to an engine start after the front door first saw that start fail another
(it went to an engine already dying: the next suspect in a lane, sent the moment the
killer before it is answered, would otherwise count the killer's death as its own).

That first sign must be a death's. A request sent after it is not charged, the one that
kills the engine included: a false sign at a start that still serves would spare the
killer that death, and the killer, one death short, would kill once more, beside an
innocent running alone in the lane (an innocent refused after 4 deaths, issue 33). So a
connection a serving engine closed unanswered is no sign (`streams.NotDelivered.dropped`;
a kept connection it had closed while idle is sent again by `upstream.py` itself), and a
failure seen before a generation the start then completed is forgotten
(`dispatch.Backend.served`: a dying start completes nothing).

- At `SUSPECT_AT` deaths (2) a request is a suspect: from then on it goes to its engine
  only through that engine's suspect lane, one suspect at a time. Other requests flow as
  usual; the suspects wait for each other.
- At `REFUSE_AT` deaths (3) it is refused: a stream ends with an explicit error event and
  no `[DONE]`, any other request gets a JSON error with HTTP 502; counted under the
  reason `kills_engine` and logged with its id and a digest of its body, never the body.

Bounds. A request that kills its engine every time causes at most 3 deaths: with the
others at the first, again when resent with the others at the second, alone among the
suspects at the third. An innocent request is at most a suspect (it needs a third death
while it runs alone among suspects, which only a second request that kills the engine,
arriving just then, could cause); the extra wait it pays is the time the suspects ahead
of it in the lane take to run.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from collections.abc import AsyncIterator
from typing import Protocol

SUSPECT_AT = 2
REFUSE_AT = 3
REASON = "kills_engine"
_STRAIGHT: contextlib.nullcontext[None] = contextlib.nullcontext()


def digest(body: bytes) -> str:
    """What the log says of a refused request's body: enough to match it, not to read it."""
    return "sha256:" + hashlib.sha256(body).hexdigest()[:16]


def refusal(deaths: int) -> str:
    return (f"refused: this request was at the engine at {deaths} of its deaths "
            f"({REASON}); it is not sent again")


class Lanes(Protocol):
    """The suspect lanes as the front door goes through them: `Quarantine`, or a proxy
    worker's, which are the daemon's (`supervisor/plane/mirror.py`)."""

    def lane(self, engine: str, deaths: int,
             timeout_s: float | None = None) -> contextlib.AbstractAsyncContextManager[None]:
        ...


class Quarantine:
    """The suspect lane of each engine."""

    def __init__(self) -> None:
        self._lanes: dict[str, asyncio.Lock] = {}

    def lane(self, engine: str, deaths: int,
             timeout_s: float | None = None) -> contextlib.AbstractAsyncContextManager[None]:
        """Through engine's suspect lane when `deaths` makes a suspect (raises
        TimeoutError if it is not free within `timeout_s`); straight through otherwise
        (no generator on every request's way)."""
        if deaths < SUSPECT_AT:
            return _STRAIGHT
        return self._through(engine, timeout_s)

    @contextlib.asynccontextmanager
    async def _through(self, engine: str, timeout_s: float | None) -> AsyncIterator[None]:
        lock = self._lanes.setdefault(engine, asyncio.Lock())
        await asyncio.wait_for(lock.acquire(), timeout_s)
        try:
            yield
        finally:
            lock.release()
