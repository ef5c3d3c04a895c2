"""One client connection of the front door (`supervisor/front/server.py` says what the
server does as a whole): the bytes parsed as they come by httptools' C request parser,
each request handed in turn to the proxy's handler by the connection's one task, its
answer written back; the deadlines, the memory bounds and the refusals of one
connection. What it uses of its server is `Owner`.

Its state is explicit: where the parser is (`Phase`: between requests, in a head, in a
body), the one deadline its reading is under (`Wait`, kept by `waits.Deadline`), the
request being parsed, those waiting their turn, the one being answered.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import enum
from collections.abc import Awaitable, Callable
from typing import Protocol, cast

import httptools
import structlog

from supervisor.front import conformance
from supervisor.front.limits import Limits, refusal
from supervisor.front.messages import Request, StreamResponse, json_response
from supervisor.front.waits import Deadline, Wait

log = structlog.get_logger("supervisor.proxy")

LINGER_S = 2.0  # the rest of a refused body is read and dropped for at most this long
HIGH_WATER = 64 << 10  # bytes buffered for a client before `write` waits; and of a
# pipelined request's body read ahead of its turn before the socket's reading pauses
_PIPELINED = 16  # requests parsed ahead of their turn before the socket's reading pauses
Handler = Callable[[Request], Awaitable[StreamResponse]]
Refused = Callable[[int | None, str], None]  # (status sent or None, reason)


class Owner(Protocol):
    """What a connection uses of its server (`server.Server`)."""

    loop: asyncio.AbstractEventLoop
    limits: Limits
    handler: Handler
    refused: Refused
    connections: dict[Connection, None]
    buffered: int

    def admit(self, conn: Connection) -> bool: ...
    def release(self, held: int) -> None: ...


class Phase(enum.Enum):
    """Where the parser is in the connection's bytes."""

    IDLE = "idle"  # between requests
    HEAD = "head"  # a request's line and header fields
    BODY = "body"  # its body (with its chunk framing and trailers)


class Connection(asyncio.Protocol):
    """One client connection: requests parsed as they come, handled one at a time in
    their order by the connection's one task (cancelled if the client goes)."""

    def __init__(self, server: Owner) -> None:
        self.server = server
        self.limits = server.limits
        self.loop = server.loop
        self.transport: asyncio.Transport | None = None
        self.peer: str | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.lost = False
        self.closing = False
        self._paused = False  # writing: the client's buffer is full
        self._drain: asyncio.Future[None] | None = None
        self._send_timer: asyncio.TimerHandle | None = None
        self._reading_paused = False
        self._stopped = False  # reading for good: what comes next is not served
        # the request being parsed: its target and headers so far, and its bytes
        self._phase = Phase.IDLE
        self._messages = 0  # requests begun on this connection
        self._url = b""
        self._fields: list[tuple[bytes, bytes]] = []
        self._expect: str | None = None  # its Expect field's value
        self._length = 0  # its Content-Length
        self._hosts = 0
        self._codings: list[str] = []  # its Transfer-Encoding values
        self._named: list[str] = []  # its Connection values
        self._upgrade = False  # it had an Upgrade field
        self._trailers_next = False  # a chunk's size line came, none of its data since
        self._trailer_bytes = 0  # read since, with no data: the last chunk's trailers
        self._head_bytes = 0  # of its head and trailers, as parsed
        self._raw_bytes = 0  # of its head, or of its body's framing, as read
        self._body_in = 0  # body bytes parsed on this connection
        self._body_from = 0  # where the body being parsed began in that count
        self._parsing: Request | None = None
        self._queue: collections.deque[Request] = collections.deque()
        self._current: Request | None = None
        self._answered = False  # a byte of the current request's answer was written
        self._refusal: tuple[int, str] | None = None  # sent once the current answer ends
        self._task: asyncio.Task[None] | None = None  # serves the requests in turn
        self._wakeup: asyncio.Future[None] | None = None  # its wait for the next
        self._deadline = Deadline(self.loop, self._timed_out)
        self._last_read = 0.0
        self._linger: asyncio.TimerHandle | None = None

    # ---- the socket ---------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport = cast(asyncio.Transport, transport)  # (uvloop's is not a subclass)
        self.transport = transport
        transport.set_write_buffer_limits(high=HIGH_WATER)
        peer = transport.get_extra_info("peername")
        self.peer = peer[0] if isinstance(peer, tuple) else None
        if not self.server.admit(self):
            return
        self._arm(Wait.HEADER, self.limits.header_timeout_s)  # (nginx: from the accept)

    def connection_lost(self, exc: BaseException | None) -> None:
        self.lost = True
        self.server.connections.pop(self, None)
        self._deadline.cancel()
        for handle in (self._linger, self._send_timer):
            if handle is not None:
                handle.cancel()
        if self._drain is not None and not self._drain.done():
            self._drain.set_exception(ConnectionResetError("the client went away"))
        if self._task is not None and not self._task.done():
            self._task.cancel()  # the handler stops; its upstream request with it
        # the bodies it held go now, not when a collection finds the cancelled task
        for req in (self._current, self._parsing, *self._queue):
            if req is not None:
                self.server.release(req._drop_body())
        self._queue.clear()

    def pause_writing(self) -> None:
        self._paused = True
        if self._send_timer is None:
            self._send_timer = self.loop.call_later(self.limits.send_timeout_s,
                                                    self._send_timed_out)

    def resume_writing(self) -> None:
        self._paused = False
        if self._send_timer is not None:
            self._send_timer.cancel()
            self._send_timer = None
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)

    def data_received(self, data: bytes) -> None:
        if self._stopped:
            return  # (after a refusal, or after a request that closes the connection)
        phase, messages, body_in = self._phase, self._messages, self._body_in
        in_trailers = self._trailers_next
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            # (answered as a plain request that closes the connection: what follows its
            # head is not read; `conformance.upgrade_problem`)
            self._stop_reading()
            return
        except httptools.HttpParserError as exc:
            # (an exception in a callback comes out as the parser's, the cause inside)
            if isinstance(why := exc.__context__, _Refused):
                self._refuse(why.status, why.message, why.reason)
            elif self._stopped:
                pass  # bytes after `Connection: close`: ignored (RFC 9112 9.6)
            else:
                self._refuse(400, f"malformed request: {exc}")
            return
        # A read wholly inside one request's head, or one body's framing and trailers,
        # counts whole (what the parser holds but has not handed over yet: a field
        # still coming); one across a boundary is counted by the parser's callbacks.
        if self._phase is phase and self._messages == messages:
            if in_trailers and self._trailers_next and self._body_in == body_in:
                # a read past the last chunk's size line: trailers, bounded as a head
                # whatever the body's size (the read that held that line not counted)
                self._trailer_bytes += len(data)
                if self._trailer_bytes > self.limits.max_head:
                    self._refuse(431, "request trailer section too large")
                    return
            if phase is Phase.HEAD:
                self._raw_bytes += len(data)
                if self._raw_bytes > self.limits.max_head:
                    self._refuse(431, "request header section too large")
            elif phase is Phase.BODY:
                self._last_read = self.loop.time()
                self._raw_bytes += len(data) - (self._body_in - body_in)
                # (chunk sizes and their line ends: a quarter of the body is ample)
                allowed = self.limits.max_head + ((self._body_in - self._body_from) >> 2)
                if self._raw_bytes > allowed:
                    self._refuse(400, "chunk framing or trailers too large")
        elif self._phase is Phase.BODY:
            self._last_read = self.loop.time()

    # ---- the parser's callbacks ---------------------------------------------------

    def on_message_begin(self) -> None:
        self._phase = Phase.HEAD
        self._messages += 1
        self._url = b""
        self._fields = []
        self._expect = None
        self._length = 0
        self._hosts = 0
        self._codings = []
        self._named = []
        self._upgrade = self._trailers_next = False
        self._head_bytes = 0
        self._raw_bytes = 0
        if self._deadline.wait is Wait.IDLE:  # (a kept-alive connection: its next head is timed)
            self._arm(Wait.HEADER, self.limits.header_timeout_s)

    def on_url(self, url: bytes) -> None:
        self._url += url
        self._head_bytes += len(url)
        if len(self._url) > self.limits.max_line:
            raise _Refused(414, "request target too long")

    def on_header(self, name: bytes, value: bytes) -> None:
        if len(name) + len(value) > self.limits.max_field:
            raise _Refused(431, "request header field too large")
        self._head_bytes += len(name) + len(value) + 4
        if self._head_bytes > self.limits.max_head:
            raise _Refused(431, "request header section too large")
        if self._phase is not Phase.HEAD:
            return  # a trailer field: counted, and dropped (RFC 9110 6.5.1)
        # (as aiohttp decoded them, and as the upstream client encodes them: the bytes
        # sent on are the bytes that came, less the whitespace around the value that
        # llhttp leaves at its end: RFC 9112 5)
        if value[-1:] in b" \t":
            value = value.rstrip(b" \t")
        self._fields.append((name, value))  # (decoded if read: `Headers`)
        if len(name) in _READ_HERE:  # (the few the server reads itself, found cheaply)
            low = name.lower()
            if low == b"expect":
                if self._expect is None:  # (the first, as `Headers.get` finds it)
                    self._expect = value.decode("utf-8", "surrogateescape")
            elif low == b"content-length" and value.strip().isdigit():
                self._length = int(value)
            elif low == b"host":
                self._hosts += 1
            elif low == b"transfer-encoding":
                self._codings.append(value.decode("latin-1"))
            elif low == b"connection":
                self._named.append(value.decode("latin-1"))
            elif low == b"upgrade":
                self._upgrade = True

    def on_headers_complete(self) -> None:
        p = self.parser
        v = p.get_http_version()
        if (problem := conformance.head_problem(v, self._hosts, self._codings)) is not None:
            raise _Refused(*problem)
        self._phase = Phase.BODY
        self._raw_bytes = 0
        self._body_from = self._body_in
        fields = self._fields
        if self._named and (named := conformance.connection_named(self._named)):
            fields = conformance.without(fields, named)
        version = (1, 1) if v == "1.1" else (1, 0)
        method = p.get_method().decode("latin-1")
        keep_alive = p.should_keep_alive()
        if self._upgrade or p.should_upgrade():  # (CONNECT, or a switch asked for)
            if p.should_upgrade() and (problem := conformance.upgrade_problem(
                    method, bool(self._length or self._codings))) is not None:
                raise _Refused(*problem)
            keep_alive = False  # answered as a plain request, then closed
        req = Request(self, method, self._url.decode("utf-8", "surrogateescape"), version,
                      fields, keep_alive, self._expect)
        req._expect_continue = version == (1, 1) and self._expect is not None \
            and self._expect.strip().lower() == "100-continue"
        if self._length > self.limits.max_body:
            req.too_large = True  # (known now: the handler need not wait for it)
        elif self._length and self.server.buffered + self._length > self.limits.max_buffered:
            raise _Refused(503, _OVER_BUDGET, "body_budget")
        self._parsing = req
        if self._deadline.wait is Wait.HEADER:
            self._disarm()
        if self.closing:
            return  # (a request after one that closes the connection: not served)
        if self._length or self._codings:  # (a body to come: its reads are timed)
            self._last_read = self.loop.time()
            self._arm(Wait.BODY, self.limits.body_timeout_s)
        if self._current is None:
            self._start(req)
        else:
            self._queue.append(req)
            if len(self._queue) >= _PIPELINED:
                self._update_reading()

    def on_chunk_header(self) -> None:
        self._trailers_next, self._trailer_bytes = True, 0

    def on_body(self, body: bytes) -> None:
        self._body_in += len(body)
        self._trailers_next = False
        req = self._parsing
        if req is None:
            return
        server = self.server
        server.buffered += req._add_body(body, self.limits.max_body)
        if server.buffered > self.limits.max_buffered:
            raise _Refused(503, _OVER_BUDGET, "body_budget")
        if req is not self._current:
            self._update_reading()

    def on_message_complete(self) -> None:
        self._phase = Phase.IDLE
        self._trailers_next = False
        if self._deadline.wait is Wait.BODY:
            self._disarm()
        req, self._parsing = self._parsing, None
        if req is None:
            return
        req._complete()
        if req is not self._current and req not in self._queue:  # (answered already)
            self.server.release(req._drop_body())
        if not req.keep_alive:
            self._stop_reading()  # what follows is not served (RFC 9112 9.6)
        if self._current is None and self.closing and self.transport is not None:
            self.transport.close()  # (a refused body, read to its end)

    # ---- requests -----------------------------------------------------------------

    def _start(self, req: Request) -> None:
        if self._deadline.wait is Wait.IDLE:
            self._disarm()
        self._current = req
        self._answered = False
        if self._task is None or self._task.done():
            self._task = self.loop.create_task(self._serve_all())
        elif self._wakeup is not None and not self._wakeup.done():
            self._wakeup.set_result(None)

    async def _serve_all(self) -> None:
        """The connection's one task: its requests, one after the other (a task each
        would cost more than the request's own parsing)."""
        while not self.lost:
            req = self._current
            if req is None:
                if self.closing:
                    return
                self._wakeup = self.loop.create_future()
                try:
                    await self._wakeup
                finally:
                    self._wakeup = None
                continue
            await self._serve(req)

    async def _serve(self, req: Request) -> None:
        resp: StreamResponse | None = None
        try:
            resp = await self.server.handler(req)
            if not resp._ended:
                await resp.prepare(req)
                await resp.write_eof()
        except asyncio.CancelledError:
            if self.lost:
                return  # the client went away
            raise
        except ConnectionError:
            self._close()
        except Exception:
            log.exception("proxy handler failed", method=req.method,
                          path=req.raw_path[:512])
            if resp is None or not resp.prepared:
                with contextlib.suppress(ConnectionError):
                    req.keep_alive = False
                    failed = json_response({"error": {
                        "message": "internal error in the proxy", "type": "proxy_error",
                        "code": 500}}, status=500)
                    await failed.prepare(req)
                    await failed.write_eof()
            else:
                self._close()
        finally:
            if self._current is req:
                self._finished(req)

    def _finished(self, req: Request) -> None:
        self._current = None
        if req is not self._parsing:  # (else its body is still coming, and counted)
            self.server.release(req._drop_body())
        if self.lost:
            return
        if self._refusal is not None:  # a request behind this one was refused
            self.closing = True
            if req.keep_alive:
                self._send_refusal(*self._refusal)
            else:
                self._close()  # (its answer said close: nothing may follow it)
            return
        if not req.keep_alive or self.closing:
            self.closing = True
            self._disarm()  # (its answer said close: nothing more is said on it)
            if req._done or self.transport is None:
                self._close()
            else:
                self._linger_then_close()
            return
        if self._queue:
            self._start(self._queue.popleft())
            self._update_reading()
        elif self._phase is Phase.IDLE:
            self._arm(Wait.IDLE, self.limits.idle_timeout_s)
        elif self._phase is Phase.HEAD:
            self._arm(Wait.HEADER, self.limits.header_timeout_s)

    def _linger_then_close(self) -> None:
        """The answer is out but the client may still be sending the body it was refused:
        read it and drop it (at most LINGER_S), then close."""
        if self._linger is None and not self.lost:
            self._linger = self.loop.call_later(LINGER_S, self._close)

    def _refuse(self, status: int, message: str, reason: str = "bad_http") -> None:
        """A request that cannot be parsed, breaks a rule or a limit: answered here (after
        the answer being written, if it is another request's), and the connection
        closed."""
        log.warning("request refused", reason=reason, status=status, peer=self.peer,
                    why=message[:300])
        self.server.refused(status, reason)
        self._stop_reading()
        for req in self._queue:
            self.server.release(req._drop_body())
        self._queue.clear()
        current = self._current
        if current is not None and current is not self._parsing:
            # sent when the current answer ends (which does not say close: the refusal
            # after it does)
            self._refusal = (status, message)
            return
        self.closing = True
        if current is not None and self._task is not None:
            self._task.cancel()  # (its answer could not be told from the refusal's)
            self._current = None
            self.server.release(current._drop_body())
            if self._answered:
                self._close()  # (an answer begun: cut, never a status line inside it)
                return
        self._send_refusal(status, message)

    def _send_refusal(self, status: int, message: str) -> None:
        retry = self.limits.retry_after_s if status == 503 else None
        with contextlib.suppress(ConnectionError):
            self.write(refusal(status, message, retry_after_s=retry))
        # The client may still be sending what was refused: our side ends here, what it
        # sends is read and dropped (at most LINGER_S), so that it reads the answer
        # instead of a reset.
        transport = self.transport
        if transport is not None and not transport.is_closing() and transport.can_write_eof():
            transport.write_eof()
            self._linger_then_close()
        else:
            self._close()

    # ---- reading and its deadlines ------------------------------------------------

    def _update_reading(self) -> None:
        """Reading pauses while requests wait for their turn (too many, or their bodies
        past HIGH_WATER), and for good once stopped. (Only this connection's own turn
        resumes it: no wait on another client.)"""
        pause = self._stopped or len(self._queue) >= _PIPELINED \
            or sum(r._held for r in self._queue) > HIGH_WATER
        if self.transport is None or pause is self._reading_paused or self.lost:
            return
        self._reading_paused = pause
        if pause:
            self.transport.pause_reading()
        else:
            self._last_read = self.loop.time()  # (the body's clock starts again)
            self.transport.resume_reading()

    def _stop_reading(self) -> None:
        self._stopped = True
        if self._deadline.wait is not Wait.IDLE:
            self._disarm()
        self._update_reading()

    def _arm(self, wait: Wait, after_s: float) -> None:
        if not self.lost:
            self._deadline.arm(wait, after_s)  # (lazily: `supervisor/front/waits.py`)

    def _disarm(self) -> None:
        self._deadline.disarm()

    def _timed_out(self, wait: Wait) -> None:
        if self.lost:
            return
        if wait is Wait.IDLE:
            self._close()
        elif wait is Wait.HEADER:
            if self._phase is Phase.HEAD:
                self._refuse(408, f"request head not received within "
                             f"{self.limits.header_timeout_s:g} s", "header_timeout")
            else:  # (a connection opened that never sent a byte)
                self.server.refused(None, "header_timeout")
                self._close()
        elif wait is Wait.BODY:
            left = self._last_read + self.limits.body_timeout_s - self.loop.time()
            if self._reading_paused or left > 0:  # (read since, or paused by us)
                self._arm(Wait.BODY, max(left, 0.05) if not self._reading_paused
                          else self.limits.body_timeout_s)
            else:
                self._refuse(408, f"nothing of the request body for "
                             f"{self.limits.body_timeout_s:g} s", "body_timeout")

    # ---- writing ------------------------------------------------------------------

    def write(self, data: bytes) -> None:
        if self.lost or self.transport is None or self.transport.is_closing():
            raise ConnectionResetError("the client went away")
        self._answered = True
        self.transport.write(data)

    def write_interim(self, data: bytes) -> None:
        """A 1xx answer (`100 Continue`): the final one is still to come."""
        if self.lost or self.transport is None or self.transport.is_closing():
            raise ConnectionResetError("the client went away")
        self.transport.write(data)

    async def send(self, data: bytes) -> None:
        """Bytes to the client, waiting while too many are buffered for it."""
        if not self.send_nowait(data):
            await self.drain()

    def send_nowait(self, data: bytes) -> bool:
        """Bytes to the client now; False when too many are buffered for it, and the
        sender must `drain()` before it sends more (`send` without its coroutine, for a
        stream's events; `write` inline)."""
        transport = self.transport
        if self.lost or transport is None or transport.is_closing():
            raise ConnectionResetError("the client went away")
        self._answered = True
        transport.write(data)
        return not self._paused

    async def drain(self) -> None:
        """Until the client's buffer has room again (at once if it has); the client cut
        if it takes nothing for `send_timeout_s` (`pause_writing`)."""
        if self._paused:
            if self._drain is None or self._drain.done():
                self._drain = self.loop.create_future()
            await self._drain

    def _send_timed_out(self) -> None:
        """The client took nothing of its answer for `send_timeout_s`: cut, so that its
        handler ends (its upstream request, its admission slot with it)."""
        self._send_timer = None
        if self.lost or not self._paused:
            return
        log.warning("client cut", reason="send_timeout", peer=self.peer,
                    why=f"it read nothing for {self.limits.send_timeout_s:g} s")
        self.server.refused(None, "send_timeout")
        self.abort()

    def _close(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()

    def idle(self) -> bool:
        """No request under way, none begun: it may be closed without cutting anyone."""
        return self._current is None and self._phase is Phase.IDLE and not self._queue \
            and not self.closing

    def close_if_idle(self) -> bool:
        if self._current is None:
            self._close()
            return True
        self.closing = True  # (closed once its answer is out)
        return False

    def turn_away(self, answer: bytes) -> None:
        """Not served (its server is at its cap): the answer, then closed."""
        self._stopped = self.closing = True
        if self.transport is not None:
            self.transport.write(answer)
            self.transport.close()

    def abort(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()
        if self.transport is not None:
            self.transport.abort()


# the lengths of the header names the server reads itself (Host, Expect, Upgrade,
# Connection, Content-Length, Transfer-Encoding)
_READ_HERE = frozenset((4, 6, 7, 10, 14, 17))


_OVER_BUDGET = "request bodies held here are over proxy.max_buffered_bytes; try again"


class _Refused(Exception):
    def __init__(self, status: int, message: str, reason: str = "bad_http") -> None:
        super().__init__(message)
        self.status, self.message, self.reason = status, message, reason
