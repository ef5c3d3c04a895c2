"""A request's total deadline, kept: `request_timeout_s` from its arrival (the proxy's,
its engine's or its model's: which one is `supervisor/front/deadlines.py`'s to say),
whatever it waits for (the hold, the engine, a continuation).

Owns only the ending: past the deadline the proxy's answer is cancelled (leaving it
closes the engine's connection, and vLLM aborts the request) and the client told how it
ended. Never decides the deadline, never sends the request again.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable

import structlog

from supervisor.front import sse
from supervisor.front.exchange import Exchange, ProxyStats
from supervisor.front.messages import Request, Response, StreamResponse

log = structlog.get_logger("supervisor.proxy")


async def within(request: Request, path: str, ex: Exchange, stats: ProxyStats,
                 error: Callable[[int, str, str], Response],
                 answer: Callable[[], Awaitable[StreamResponse]]) -> StreamResponse:
    """`answer()` within `ex.request_timeout_s` of the request's arrival: past it, an
    error event `request_timeout` ends a stream (no [DONE]), a request no answer had
    begun for gets 504 (`error`, which counts it), any other begun answer is cut."""
    limit = ex.request_timeout_s
    loop = asyncio.get_running_loop()
    when = loop.time() + (ex.arrived + limit - time.monotonic())
    try:
        async with asyncio.timeout_at(when) as cm:
            return await answer()
    except TimeoutError:
        if not cm.expired():
            raise
    message = f"request_timeout: the request ran past its deadline ({limit:g} s)"
    log.warning("request timed out", path=path, limit_s=limit,
                events=ex.events, stream=ex.stream)
    resp = ex.resp
    ex.outcome = "request_timeout"
    if isinstance(resp, StreamResponse) and resp.prepared:
        stats.reject("request_timeout")  # (`error` counts the 504's)
        if ex.stream and not isinstance(resp, Response):
            with contextlib.suppress(ConnectionError):
                await resp.write(sse.error_event(message, 504, "request_timeout"))
                await resp.write_eof()
        elif request.transport is not None:
            request.transport.close()  # (a begun answer of another kind: cut)
        return resp
    ex.status = 504
    return error(504, message, "request_timeout")
