"""The proxy's client to its engines: HTTP/1.1 over keep-alive connections, one asyncio
protocol per connection with httptools' C response parser (as uvicorn parses requests).

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
it is checked (`_Connection.usable`, as httpcore does): its transport not closing, and
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
import contextlib
import functools
import select
import time
from collections.abc import Callable, Iterable
from types import TracebackType
from typing import Any, cast
from urllib.parse import urlsplit

import httptools

HIGH_WATER = 64 << 10  # body bytes buffered before the socket's reading pauses
_BIG_BODY = 64 << 10  # a request body above this goes in a write of its own
_NO_BODY = frozenset(("GET", "HEAD", "DELETE", "OPTIONS"))


class UpstreamError(Exception):
    pass


class ConnectFailed(UpstreamError):
    """No connection to the engine: the request never reached it."""


class Disconnected(UpstreamError):
    """The connection went before the answer's head: the engine had the request."""


class BodyCut(UpstreamError):
    """The connection went inside the answer's body."""


class _NotReached(UpstreamError):
    """A reused connection went before any byte of the answer: the engine had closed it
    while it was idle (sent again on a fresh one, never shown to a caller)."""


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


class Answer:
    """An engine's answer: its head at once, its body as it arrives (`read_some`) or
    whole (`read`). Owned by the one task that sent the request; `close` may come from
    any other (a stream paused for a drained restart)."""

    __slots__ = ("_body", "_buffered", "_conn", "_error", "_since", "_sink", "_sink_error",
                 "_timeout", "_timer", "_waiter", "chunked", "complete", "content_length",
                 "content_type", "headers", "keep_alive", "reason", "status")

    def __init__(self, conn: _Connection, status: int, reason: str,
                 headers: list[tuple[str, str]]) -> None:
        self._conn = conn
        self.status = status
        self.reason = reason
        self.headers = headers  # (name, value) as the engine sent them, in order
        self.content_type = ""
        self.content_length: int | None = None
        self.chunked = False
        for name, value in headers:
            low = name.lower()
            if low == "content-type":
                self.content_type = value.split(";", 1)[0].strip().lower()
            elif low == "content-length" and value.strip().isdigit():
                self.content_length = int(value)
            elif low == "transfer-encoding" and "chunked" in value.lower():
                self.chunked = True
        self._body: list[bytes] = []
        self._buffered = 0
        self._error: BaseException | None = None
        self._waiter: asyncio.Future[bool] | None = None  # True: `pump`'s sink stopped
        # the read timeout: one timer for the answer, not one per wait (a stream waits
        # once per event); it fires `read_timeout_s` after the later of the wait's start
        # and the last byte, and is moved on when bytes came meanwhile
        self._since = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self._timeout = conn.read_timeout_s  # (this answer's: `set_read_timeout`)
        # `pump`'s sink while it waits, and what the sink raised in the protocol's callback
        self._sink: Callable[[bytes], bool] | None = None
        self._sink_error: Exception | None = None
        self.complete = False
        self.keep_alive = False

    def set_read_timeout(self, seconds: float) -> None:
        """This answer's read timeout from now on (a stream's stall deadline), in place
        of its connection's."""
        self._timeout = seconds
        if self._timer is not None:  # (looked at again at its time: moved on from there)
            self._timer.cancel()
            self._timer = self._conn.loop.call_at(
                max(self._since, self._conn.last_byte_at) + seconds, self._expire)

    async def read_some(self) -> bytes:
        """What arrived of the body since the last call, waiting for some if none did;
        b"" at its end."""
        while not self._body:
            if self._error is not None:
                raise self._error
            if self.complete:
                return b""
            # (the wait inline, not a coroutine of its own: a stream waits once per event)
            conn = self._conn
            loop = conn.loop
            self._waiter = waiter = loop.create_future()
            self._since = loop.time()
            if self._timer is None:
                self._timer = loop.call_at(self._since + self._timeout, self._expire)
            try:
                await waiter
            finally:
                self._waiter = None
        data = self._body[0] if len(self._body) == 1 else b"".join(self._body)
        self._body.clear()
        self._buffered = 0
        self._conn.resume()
        return data

    async def pump(self, sink: Callable[[bytes], bool]) -> bool:
        """The body handed to `sink` read by read as it arrives, from the connection's
        own callback: no task wakes per read, as a stream of one event per engine step
        would cost with `read_some`. Returns True at the body's end; False as soon as
        `sink` returns False (what the caller waits for before it pumps on: the bytes that
        arrive meanwhile are kept, up to the high-water mark). Raises what `sink` raises,
        and the body's failures as `read_some` does, after the bytes read before them."""
        conn = self._conn
        loop = conn.loop
        while True:
            if self._body:  # bytes that came while no sink was set
                data = self._body[0] if len(self._body) == 1 else b"".join(self._body)
                self._body.clear()
                self._buffered = 0
                conn.resume()
                if not sink(data):
                    return False
                continue
            if self._error is not None:
                raise self._error
            if self.complete:
                return True
            self._waiter = waiter = loop.create_future()
            self._since = loop.time()
            if self._timer is None:
                self._timer = loop.call_at(self._since + self._timeout, self._expire)
            self._sink = sink
            try:
                await waiter
            finally:
                self._sink = None
                self._waiter = None
            if self._sink_error is not None:
                error, self._sink_error = self._sink_error, None
                raise error
            if waiter.result():  # the sink said stop
                return False

    def _stop_sink(self) -> None:
        """The sink said stop, or raised (`_Connection.data_received` called it): no more
        for it, and its task woken."""
        self._sink = None
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(True)

    async def read(self) -> bytes:
        """The whole body."""
        parts = []
        while chunk := await self.read_some():
            parts.append(chunk)
        return b"".join(parts)

    def close(self) -> None:
        """Drop the connection now (the engine sees its client go, and vLLM aborts the
        request); a reader waiting on it is told the body was cut."""
        self._conn.close()
        self._fail(BodyCut("closed by the proxy"))

    def _expire(self) -> None:
        """The read timer: a wait with no byte for `read_timeout_s` fails; one that had
        bytes since is looked at again when its own time is up."""
        self._timer = None
        waiter = self._waiter
        if waiter is None or waiter.done():
            return  # nobody waits: the next wait arms it again
        conn = self._conn
        due = max(self._since, conn.last_byte_at) + self._timeout
        if due > conn.loop.time():
            self._timer = conn.loop.call_at(due, self._expire)
            return
        waiter.set_exception(TimeoutError(f"no answer bytes for {self._timeout:g} s"))

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(False)
        if self.complete:
            self._stop_timer()

    def _fail(self, error: BaseException) -> None:
        if self._error is None and not self.complete:
            self._error = error
        self._stop_timer()
        self._wake()


class _Connection(asyncio.Protocol):
    """One keep-alive connection to an engine, one request at a time."""

    def __init__(self, loop: asyncio.AbstractEventLoop, read_timeout_s: float) -> None:
        self.loop = loop
        self.read_timeout_s = read_timeout_s
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.idle_since = 0.0
        self.last_byte_at = 0.0  # (the loop's clock) the latest read of the answer
        self.reused = False  # the request now on it is not the connection's first
        self.answered = False  # a byte arrived for the request now on it
        self.head_only = False  # a HEAD request's answer: no body follows its head
        self._reason = ""
        self._headers: list[tuple[str, str]] = []
        self._head: asyncio.Future[Answer] | None = None
        self.answer: Answer | None = None
        self._paused = False
        self._poll: select.poll | None = None  # its socket, for `usable`

    # ---- the request --------------------------------------------------------------

    def send(self, head: bytes, body: bytes, head_only: bool) -> asyncio.Future[Answer]:
        """Write the request; the answer's head arrives on the future returned."""
        assert self.transport is not None
        self.parser = httptools.HttpResponseParser(self)
        self._headers = []
        self.answer = None
        self.answered = False
        self.head_only = head_only
        self._head = self.loop.create_future()
        if len(body) > _BIG_BODY:
            self.transport.write(head)
            self.transport.write(body)
        else:
            self.transport.write(head + body)
        return self._head

    def usable(self) -> bool:
        """An idle connection that can take a request: open, and nothing to read on it
        (an idle connection has only the engine's close, or stray bytes, to read)."""
        if self.closed or self.transport is None or self.transport.is_closing():
            return False
        if self._poll is None:
            return True
        try:
            return not self._poll.poll(0)
        except (OSError, ValueError):
            return False

    def resume(self) -> None:
        if self._paused and self.transport is not None and not self.closed:
            self._paused = False
            self.transport.resume_reading()

    def close(self) -> None:
        if self.answer is not None:
            self.answer._stop_timer()
        if not self.closed:
            self.closed = True
            if self.transport is not None:
                self.transport.abort()

    # ---- asyncio.Protocol -----------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # (uvloop's is not a subclass)
        sock = transport.get_extra_info("socket")
        if sock is not None:  # (`usable` asks it, once per request: set up once)
            with contextlib.suppress(OSError, ValueError):
                poll = select.poll()
                poll.register(sock.fileno(), select.POLLIN)
                self._poll = poll

    def data_received(self, data: bytes) -> None:
        if self.answer is not None and self.answer.complete and self._head is not None:
            self.close()  # bytes after an answer's end, asked for by no request: unusable
            return
        self.answered = True
        self.last_byte_at = self.loop.time()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._lost(BodyCut(f"unreadable answer from the engine: {exc}"))
            self.close()
            return
        answer = self.answer
        if answer is not None and answer._body:
            sink = answer._sink
            if sink is not None:  # `pump` waits: the bytes to its sink now (`_to_sink`)
                body = answer._body
                data = body[0] if len(body) == 1 else b"".join(body)
                body.clear()
                answer._buffered = 0
                try:
                    if sink(data):
                        return
                except Exception as exc:  # (never into the loop: to the pumping task)
                    answer._sink_error = exc
                answer._stop_sink()
                return
            if answer._buffered > HIGH_WATER and not self._paused and not answer.complete:
                self._paused = True
                assert self.transport is not None
                self.transport.pause_reading()
            answer._wake()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        answer = self.answer
        if (exc is None and answer is not None and not answer.complete
                and answer.content_length is None and not answer.chunked):
            answer.complete = True  # a body that ends with its connection: whole
            answer._wake()
            return
        why = f": {exc!r}" if exc is not None else ""
        self._lost(None, why)

    def _lost(self, error: UpstreamError | None, why: str = "") -> None:
        if self._head is not None and not self._head.done():
            if error is None and self.reused and not self.answered:
                error = _NotReached(f"the engine closed an idle connection{why}")
            self._head.set_exception(error or Disconnected(
                f"the engine closed the connection before answering{why}"))
        elif self.answer is not None:
            self.answer._fail(error or BodyCut(
                f"the engine closed the connection inside its answer{why}"))

    # ---- httptools' callbacks ----------------------------------------------------------

    def on_status(self, status: bytes) -> None:
        self._reason = status.decode("latin-1")

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name.decode("utf-8", "surrogateescape"),
                              value.decode("utf-8", "surrogateescape")))  # (as aiohttp)

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if status < 200:  # an interim answer (100 Continue): the real one follows
            self._headers = []
            return
        self.answer = answer = Answer(self, status, self._reason, self._headers)
        if self.head_only or status in (204, 304):
            answer.complete = True  # nothing follows; not reused (the parser expects a body)
        if self._head is not None and not self._head.done():
            self._head.set_result(answer)

    def on_body(self, body: bytes) -> None:
        answer = self.answer
        if answer is not None and not answer.complete:
            answer._body.append(body)
            answer._buffered += len(body)

    def on_message_complete(self) -> None:
        answer = self.answer
        if answer is not None and not answer.complete:
            answer.complete = True
            answer.keep_alive = self.parser.should_keep_alive()
            answer._wake()


class Upstream:
    """Keep-alive connections to the engines, by address; one request per connection
    at a time."""

    def __init__(self, connect_timeout_s: float, read_timeout_s: float,
                 keepalive_s: float = 4.0) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self.keepalive_s = keepalive_s
        self._idle: dict[tuple[str, int], list[_Connection]] = {}
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

    async def _connection(self, host: str, port: int, fresh: bool = False) -> _Connection:
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
                    lambda: _Connection(loop, self.read_timeout_s), host, port)
        except TimeoutError as exc:
            raise ConnectFailed(f"no connection to {host}:{port} within "
                                f"{self.connect_timeout_s:g} s") from exc
        except OSError as exc:
            raise ConnectFailed(f"cannot connect to {host}:{port}: {exc}") from exc
        return conn

    def _release(self, host: str, port: int, conn: _Connection) -> None:
        answer = conn.answer
        if (self._closed or conn.closed or conn.head_only or answer is None
                or not answer.complete or not answer.keep_alive or answer._error is not None):
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
        self._conn: _Connection | None = None
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
        except _NotReached as stale:
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

    async def _send(self, conn: _Connection, request: bytes, body: bytes,
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
