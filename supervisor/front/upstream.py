"""The proxy's client to its engines: HTTP/1.1 over keep-alive connections, one asyncio
protocol per connection with httptools' C response parser (as uvicorn parses requests;
the connection and the answer read on it are supervisor/front/upstream_conn.py's, the
pool and the request sent on one are here).

Why not aiohttp's client: on the proxy's hot path it cost 65-80 µs a request (its
connector, its request writer task, a Python callback per HTTP chunk of an answer) and
1.5 µs a streamed chunk (docs/proxy.md, "Cost per request and per chunk"). Here a request
is one write, an answer's head one wake-up, and each read of a streamed answer is handed
to the proxy whole, however many HTTP chunks it holds: to a task that waits for it
(`Answer.read_some`), or, for a stream, straight from the protocol's callback to the
proxy's sink (`Answer.pump`: vLLM writes one event per engine step, so a stream's reads
are nearly all one event, and a task woken per event was most of the proxy's cost per
event; issue 38).

What a caller sees (`Upstream.request`, used as `async with ... as answer`):
- `ConnectFailed`: no connection (refused, unreachable, or none within the connect
  timeout): the request never reached the engine.
- `Disconnected`: the connection went before the answer's head: the engine had it.
- `BodyCut`: the connection went inside the answer's body.
- `TimeoutError`: no byte of the answer for `read_timeout_s`.
All but the timeout are `UpstreamError`s; none is a `ConnectionError`, which the proxy
keeps for its own client going away.

Connections are kept for the next request once an answer was read to its end, and
dropped after `keepalive_s` idle (below uvicorn's own 5 s, so that the engine seldom
closes one under a request being sent: when it is next taken, or when another is put
back after it), or when the answer asked for it. A reader slower
than its engine pauses the socket's reading (64 KiB buffered at most), as aiohttp did.

A kept connection may still have been closed by the engine while it was idle, the close
not yet seen by the loop (a timer of the engine's own, a restart). Before one is reused
it is checked (`EngineConnection.usable`, as httpcore does): its transport not closing, and
its socket not readable, since an idle connection can only have an end or stray bytes to
read. And a request on a reused connection that fails before any byte of its answer
arrived is sent once more on a fresh connection, as not reached, never `Disconnected`
(which the proxy takes as "the engine had it": a death charged in the quarantine, a
failure seen at a healthy engine start). Why that is safe for a request that is not
idempotent (a completion): an HTTP/1.1 server (uvicorn, under vLLM) closes a keep-alive
connection only between requests, and bytes that meet a connection it is closing are
never read as a request (the kernel drops them and resets the connection); a server that
had read the request answers something, even dying (vLLM's API server answers 500 once
its core is gone), and any byte of an answer means the request was there: never sent
again from here. The one case left, a server process that died with the request read and
no byte sent, finds the fresh connection refused: that is reported as `Disconnected`, so
a request that kills its engine is charged for the death on a reused connection too.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Iterable
from types import TracebackType
from typing import Any
from urllib.parse import urlsplit

from supervisor.front.upstream_conn import (
    HIGH_WATER,
    Answer,
    BodyCut,
    ConnectFailed,
    Disconnected,
    EngineConnection,
    NotReached,
    UpstreamError,
)

__all__ = ["HIGH_WATER", "Answer", "BodyCut", "Call", "ConnectFailed", "Disconnected",
           "Upstream", "UpstreamError", "address"]

_NO_BODY = frozenset(("GET", "HEAD", "DELETE", "OPTIONS"))


@functools.lru_cache(maxsize=64)
def address(upstream: str) -> tuple[str, int, bytes]:
    """http://127.0.0.1:8100 -> (host, port, the Host header's value)."""
    parts = urlsplit(upstream)
    if parts.scheme != "http" or not parts.hostname:
        raise ValueError(f"not an http:// address: {upstream!r}")
    port = parts.port or 80
    host = parts.hostname
    shown = f"[{host}]" if ":" in host else host
    return host, port, f"{shown}:{port}".encode()


class Upstream:
    """Keep-alive connections to the engines, by address; one request per connection
    at a time."""

    def __init__(self, connect_timeout_s: float, read_timeout_s: float,
                 keepalive_s: float = 4.0) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self.keepalive_s = keepalive_s
        self._idle: dict[tuple[str, int], list[EngineConnection]] = {}
        self._closed = False
        # requests sent again on a fresh connection, their reused one gone unanswered
        self.resent_fresh = 0

    def request(self, method: str, upstream: str, target: str,
                headers: Iterable[tuple[str, str]] | bytes, body: bytes = b"") -> Call:
        """`async with upstream.request(...) as answer`: the request sent, its answer's
        head read. `target` is sent as it is (the proxy checked it raw)."""
        return Call(self, method, upstream, target, headers, body)

    async def get(self, upstream: str, target: str, timeout_s: float) -> tuple[int, bytes]:
        """A small GET (a health check, the model list): its status and body, within
        `timeout_s` in all."""
        async with asyncio.timeout(timeout_s), self.request("GET", upstream, target,
                                                            ()) as answer:
            return answer.status, await answer.read()

    async def close(self) -> None:
        self._closed = True
        for conns in self._idle.values():
            for c in conns:
                c.close()
        self._idle.clear()

    async def _connection(self, host: str, port: int, fresh: bool = False) -> EngineConnection:
        """A kept connection that is still usable, or a new one (`fresh`: always new)."""
        if self._closed:
            raise ConnectFailed("the proxy's upstream client is closed")
        idle = None if fresh else self._idle.get((host, port))
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            if now - conn.idle_since < self.keepalive_s and conn.usable():
                conn.reused = True
                return conn
            conn.close()
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, conn = await loop.create_connection(
                    lambda: EngineConnection(loop, self.read_timeout_s), host, port)
        except TimeoutError as exc:
            raise ConnectFailed(f"no connection to {host}:{port} within "
                                f"{self.connect_timeout_s:g} s") from exc
        except OSError as exc:
            raise ConnectFailed(f"cannot connect to {host}:{port}: {exc}") from exc
        return conn

    def _release(self, host: str, port: int, conn: EngineConnection) -> None:
        answer = conn.answer
        if (self._closed or conn.closed or conn.head_only or answer is None
                or not answer.complete or not answer.keep_alive or answer.failed):
            conn.close()
            return
        conn.idle_since = now = time.monotonic()
        idle = self._idle.setdefault((host, port), [])
        # the oldest first: those kept from a burst that traffic since never reached
        # (taken last in, first out) are let go once idle past `keepalive_s`, not kept as
        # objects to the next burst (their sockets the engine's to close meanwhile)
        while idle and (idle[0].closed or now - idle[0].idle_since >= self.keepalive_s):
            idle.pop(0).close()
        idle.append(conn)

    def kept(self) -> int:
        """The idle connections kept for the next requests, every address."""
        return sum(len(conns) for conns in self._idle.values())


class Call:
    """One request to an engine, as an async context manager: entered, the request is
    sent and its answer's head read; left, its connection kept for the next request
    (when the answer was read to its end) or dropped."""

    __slots__ = ("_answer", "_args", "_client", "_conn", "_host", "_port")

    def __init__(self, client: Upstream, method: str, upstream: str, target: str,
                 headers: Iterable[tuple[str, str]] | bytes, body: bytes) -> None:
        self._client = client
        self._args = (method, upstream, target, headers, body)
        self._conn: EngineConnection | None = None
        self._answer: Answer | None = None
        self._host = ""
        self._port = 0

    async def send(self) -> Answer:
        """Send the request and read its answer's head, as entering does: `async with`
        the call afterwards hands that answer (and keeps or drops its connection)."""
        self._answer = await self.__aenter__()
        return self._answer

    async def __aenter__(self) -> Answer:
        if self._answer is not None:  # (sent already, by `send`)
            return self._answer
        method, upstream, target, headers, body = self._args
        self._host, self._port, host_header = address(upstream)
        lines = [f"{method} {target} HTTP/1.1\r\nHost: ".encode(), host_header, b"\r\n"]
        if body or method not in _NO_BODY:  # (a GET says nothing of a body, as aiohttp)
            lines.append(b"Content-Length: %d\r\n" % len(body))
        if isinstance(headers, bytes):  # (header lines already: the client's, forwarded)
            lines.append(headers)
        else:
            for name, value in headers:
                lines.append(f"{name}: {value}\r\n".encode("utf-8", "surrogateescape"))
        lines.append(b"\r\n")
        request = b"".join(lines)
        client = self._client
        try:
            return await self._send(await client._connection(self._host, self._port),
                                    request, body, method == "HEAD")
        except NotReached as stale:
            # the engine had closed the kept connection: not reached (module docstring);
            # once more on a fresh one, whose refusal says the engine is gone
            client.resent_fresh += 1
            try:
                conn = await client._connection(self._host, self._port, fresh=True)
            except ConnectFailed as exc:
                raise Disconnected(f"{stale}; a fresh connection failed too: {exc}"
                                   ) from exc
            return await self._send(conn, request, body, method == "HEAD")

    def abort(self) -> None:
        """Close the request's connection now: an answer awaited fails (Disconnected),
        one under way is cut; the engine aborts the request. Nothing when not sent."""
        conn = self._conn
        if conn is not None:
            conn.reused = False  # (ours: never taken for a kept connection gone stale)
            conn.close()

    async def _send(self, conn: EngineConnection, request: bytes, body: bytes,
                    head_only: bool) -> Answer:
        """The request on `conn`, its answer's head awaited; the connection dropped if
        no head comes."""
        self._conn = conn
        head = conn.send(request, body, head_only)
        timer = conn.loop.call_later(conn.read_timeout_s, _expire_head, head,
                                     conn.read_timeout_s)
        try:
            return await head
        except BaseException:
            # no answer to hand over (a failure, a timeout, the caller cancelled because
            # its client went): `__aexit__` will not run, so the connection goes here
            conn.close()
            raise
        finally:
            timer.cancel()

    async def __aexit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        conn = self._conn
        if conn is None:
            return
        if kind is None:
            self._client._release(self._host, self._port, conn)
        else:
            conn.close()


def _expire_head(waiter: asyncio.Future[Any], after_s: float) -> None:
    """No answer's head within the read timeout (a timer's callback)."""
    _expire(waiter, f"no answer from the engine within {after_s:g} s")


def _expire(waiter: asyncio.Future[Any], why: str) -> None:
    """A wait for the engine ran past the read timeout (a timer's callback)."""
    if not waiter.done():
        waiter.set_exception(TimeoutError(why))
