"""One keep-alive connection to an engine (`EngineConnection`: an asyncio protocol with
httptools' C response parser, as uvicorn parses requests) and the answer read on it
(`Answer`: its head at once, its body to a waiting task, `read_some`, or straight from
the protocol's callback to a sink, `pump`), with the failures a caller sees. The pool of
such connections and the request sent on one are supervisor/front/upstream.py's.
"""

from __future__ import annotations

import asyncio
import contextlib
import select
from collections.abc import Callable
from typing import cast

import httptools

HIGH_WATER = 64 << 10  # body bytes buffered before the socket's reading pauses
_BIG_BODY = 64 << 10  # a request body above this goes in a write of its own


class UpstreamError(Exception):
    pass


class ConnectFailed(UpstreamError):
    """No connection to the engine: the request never reached it."""


class Disconnected(UpstreamError):
    """The connection went before the answer's head: the engine had the request."""


class BodyCut(UpstreamError):
    """The connection went inside the answer's body."""


class NotReached(UpstreamError):
    """A reused connection went before any byte of the answer: the engine had closed it
    while it was idle (sent again on a fresh one, never shown to a caller)."""


class Answer:
    """An engine's answer: its head at once, its body as it arrives (`read_some`) or
    whole (`read`). Owned by the one task that sent the request; `close` may come from
    any other (a stream paused for a drained restart)."""

    __slots__ = ("_body", "_buffered", "_conn", "_error", "_since", "_sink", "_sink_error",
                 "_timeout", "_timer", "_waiter", "chunked", "complete", "content_length",
                 "content_type", "headers", "keep_alive", "reason", "status")

    def __init__(self, conn: EngineConnection, status: int, reason: str,
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

    @property
    def failed(self) -> bool:
        """The body failed (cut, closed, timed out): its connection is not kept."""
        return self._error is not None

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
        """The sink said stop, or raised (`EngineConnection.data_received` called it): no more
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


class EngineConnection(asyncio.Protocol):
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
                error = NotReached(f"the engine closed an idle connection{why}")
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
