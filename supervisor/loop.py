"""The daemon's event loop.

uvloop (libuv) rather than the standard library's selector loop: the front proxy
spends its CPU in the loop's read, write and callback machinery, once per streamed
chunk, and on a host where the proxy shares cores with the engine that CPU comes out of
the engine. `make bench-proxy` measures both loops side by side (docs/benchmarks.md).
Subprocesses, signal handlers, pidfd readers and threads behave the same under both;
the whole test suite runs the daemon on uvloop.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import ssl
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import httpx
import structlog
import uvloop

T = TypeVar("T")


@functools.cache
def _tls() -> ssl.SSLContext:
    return ssl.create_default_context()


def http_client(**kwargs: Any) -> httpx.AsyncClient:
    """An HTTP client for the daemon's own calls (engines, routers). httpx builds a TLS
    context for every new client, which loads the CA store: 20-40 ms of CPU on the event
    loop each time, once per canary, probe and scrape loop, and in a failover's path.
    Built once here and shared (the calls are to loopback HTTP almost always)."""
    return httpx.AsyncClient(verify=_tls(), **kwargs)


# The cyclic collector's first generation runs every 50,000 allocations, not 700. A
# proxy's requests and streams live for milliseconds to minutes, so at 700 nearly all
# of them were still alive at each collection, walked and promoted, only to be freed by
# their reference counts later: 10 % of a proxy process's CPU (perf, one-token streams),
# 3 % after this. What is garbage only by a cycle waits a little longer.
COLLECT_EVERY = 50_000


def quiet_collector() -> None:
    """The collector as a daemon process wants it: what start-up made kept out of every
    collection (`gc.freeze`), and the first generation collected less often."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(COLLECT_EVERY, 20, 20)


def run(main: Coroutine[Any, Any, T], loop: Literal["uvloop", "asyncio"] = "uvloop") -> T:
    """Run `main` to completion on a new event loop of the given kind, with the
    daemon's collector (`quiet_collector`)."""
    quiet_collector()
    factory = uvloop.new_event_loop if loop == "uvloop" else asyncio.new_event_loop
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(main)


@dataclass
class Clock:
    """Injected time: `monotonic` for every deadline and duration, `wall` only for the
    timestamps people read."""

    monotonic: Callable[[], float] = time.monotonic
    wall: Callable[[], float] = time.time


class Jobs:
    """The tasks one owner of state sets going (a unit's jobs, the host's): each one's
    failure logged, all cancelled and awaited together when the owner ends."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()

    def launch(self, coro: Coroutine[Any, Any, Any], what: str) -> asyncio.Task[Any]:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)

        def done(t: asyncio.Task[Any]) -> None:
            self._tasks.discard(t)
            if not t.cancelled() and t.exception() is not None:
                structlog.get_logger("supervisor").error("job failed", job=what,
                                                         exc_info=t.exception())

        task.add_done_callback(done)
        return task

    async def cancel_all(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
