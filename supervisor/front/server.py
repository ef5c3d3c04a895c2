"""The front door's HTTP/1.1 server: the public socket's connections, one asyncio protocol
each with httptools' C request parser (as uvicorn parses), every request handed to the
proxy's one handler as a `Request`, its answer written as a `Response` (sized, one write)
or a `StreamResponse` (chunked, written as it comes); those in `supervisor/front/messages.py`.

Why not aiohttp's server: it cost some 60-95 µs of the proxy's CPU a request on 2 cores
(its protocol, its request and response objects, its payload writer: docs/proxy.md,
"Cost per request and per chunk"), the largest share left once the upstream client was
our own. Here a request is one parse, one wake-up of its connection's task and one write.

What it does, as an operator would expect of a front door:
- keep-alive (HTTP/1.1 by default, HTTP/1.0 when asked for), pipelined requests answered
  in order, an idle connection closed after `keepalive_s`;
- `Expect: 100-continue` answered when the handler reads the body (`Request.read`), so
  a body is never asked for before the request was checked;
- limits: a request line over `max_line` bytes is refused with 414, a header field over
  `max_field` or a header section over 8 times that with 431, a body over `max_body`
  raises `BodyTooLarge` in `read` (the proxy answers 413); the rest of a refused body is
  read and dropped (at most `LINGER_S`) before the connection closes, so that the client
  reads the answer instead of a reset;
- a malformed request: 400 and the connection closed;
- a client that goes away: its handler's task is cancelled (the proxy's upstream request
  with it, and vLLM aborts it), and a write to it raises `ConnectionResetError`;
- a handler that fails: 500 if nothing was sent yet, else the connection cut;
- a writer faster than its client waits in `write` (64 KiB buffered at most);
- `close`: the socket stops listening, idle connections close, and handlers still
  running get `shutdown_s` before they are cancelled.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import time
from collections.abc import Awaitable, Callable
from typing import cast

import httptools
import structlog

from supervisor.front.messages import (
    REASONS,
    Request,
    StreamResponse,
    date_header,
    json_response,
)

log = structlog.get_logger("supervisor.proxy")

KEEPALIVE_S = 75.0  # an idle client connection is closed after this (aiohttp's default)
LINGER_S = 2.0  # the rest of a refused body is read and dropped for at most this long
HIGH_WATER = 64 << 10  # bytes buffered for a client before `write` waits
_PIPELINED = 16  # requests parsed ahead of their turn before the socket's reading pauses
Handler = Callable[[Request], Awaitable[StreamResponse]]


class Limits:
    __slots__ = ("max_body", "max_field", "max_line")

    def __init__(self, max_line: int, max_field: int, max_body: int) -> None:
        self.max_line, self.max_field, self.max_body = max_line, max_field, max_body


class Connection(asyncio.Protocol):
    """One client connection: requests parsed as they come, handled one at a time in
    their order by the connection's one task (cancelled if the client goes)."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self.loop = server.loop
        self.transport: asyncio.Transport | None = None
        self.peer: str | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.lost = False
        self.closing = False
        self._paused = False  # writing: the client's buffer is full
        self._drain: asyncio.Future[None] | None = None
        self._reading_paused = False
        # the request being parsed: its target and headers so far
        self._url = b""
        self._fields: list[tuple[str, str]] = []
        self._expect = False  # an `Expect: 100-continue`
        self._length = 0  # its Content-Length
        self._head_bytes = 0
        self._in_head = False
        self._parsing: Request | None = None
        self._queue: collections.deque[Request] = collections.deque()
        self._current: Request | None = None
        self._task: asyncio.Task[None] | None = None  # serves the requests in turn
        self._wakeup: asyncio.Future[None] | None = None  # its wait for the next
        self._idle: asyncio.TimerHandle | None = None
        self._linger: asyncio.TimerHandle | None = None

    # ---- the socket ---------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport = cast(asyncio.Transport, transport)  # (uvloop's is not a subclass)
        self.transport = transport
        transport.set_write_buffer_limits(high=HIGH_WATER)
        peer = transport.get_extra_info("peername")
        self.peer = peer[0] if isinstance(peer, tuple) else None
        self.server.connections.add(self)
        self._arm_idle()

    def connection_lost(self, exc: BaseException | None) -> None:
        self.lost = True
        self.server.connections.discard(self)
        for handle in (self._idle, self._linger):
            if handle is not None:
                handle.cancel()
        if self._drain is not None and not self._drain.done():
            self._drain.set_exception(ConnectionResetError("the client went away"))
        if self._task is not None and not self._task.done():
            self._task.cancel()  # the handler stops; its upstream request with it
        self._queue.clear()

    def pause_writing(self) -> None:
        self._paused = True

    def resume_writing(self) -> None:
        self._paused = False
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._refuse(400, "protocol upgrades are not served here")
        except httptools.HttpParserError as exc:
            # (an exception in a callback comes out as the parser's, the cause inside)
            if isinstance(why := exc.__context__, _Refused):
                self._refuse(why.status, why.message)
            else:
                self._refuse(400, f"malformed request: {exc}")
        else:
            if self._in_head:  # (a head not yet whole: what it has taken so far)
                self._head_bytes += len(data)
                if self._head_bytes > 8 * self.server.limits.max_field:
                    self._refuse(431, "request header section too large")

    # ---- the parser's callbacks ---------------------------------------------------

    def on_message_begin(self) -> None:
        self._url = b""
        self._fields = []
        self._expect = False
        self._length = 0
        self._in_head = True
        self._head_bytes = 0

    def on_url(self, url: bytes) -> None:
        self._url += url
        if len(self._url) > self.server.limits.max_line:
            raise _Refused(414, "request target too long")

    def on_header(self, name: bytes, value: bytes) -> None:
        if len(name) + len(value) > self.server.limits.max_field:
            raise _Refused(431, "request header field too large")
        # (as aiohttp decoded them, and as the upstream client encodes them: the bytes
        # sent on are the bytes that came)
        self._fields.append((name.decode("utf-8", "surrogateescape"),
                             value.decode("utf-8", "surrogateescape")))
        if len(name) in (6, 14):  # (the two the server reads itself, found cheaply)
            low = name.lower()
            if low == b"expect":
                self._expect = value.strip().lower() == b"100-continue"
            elif low == b"content-length" and value.strip().isdigit():
                self._length = int(value)

    def on_headers_complete(self) -> None:
        self._in_head = False
        p = self.parser
        version = (1, 1) if p.get_http_version() == "1.1" else (1, 0)
        req = Request(self, p.get_method().decode("latin-1"),
                      self._url.decode("utf-8", "surrogateescape"), version, self._fields,
                      p.should_keep_alive())
        req._expect_continue = self._expect and version == (1, 1)
        if self._length > self.server.limits.max_body:
            req.too_large = True  # (known now: the handler need not wait for it)
        self._parsing = req
        if self.closing:
            return  # (a request after one that closes the connection: not served)
        if self._current is None:
            self._start(req)
        else:
            self._queue.append(req)
            if len(self._queue) >= _PIPELINED and self.transport is not None:
                self.transport.pause_reading()
                self._reading_paused = True

    def on_body(self, body: bytes) -> None:
        if self._parsing is not None:
            self._parsing._add_body(body, self.server.limits.max_body)

    def on_message_complete(self) -> None:
        req, self._parsing = self._parsing, None
        if req is not None:
            req._complete()
            if self._current is None and self.closing and self.transport is not None:
                self.transport.close()  # (a refused body, read to its end)

    # ---- requests -----------------------------------------------------------------

    def _start(self, req: Request) -> None:
        if self._idle is not None:  # (armed while the connection waits for a request,
            self._idle.cancel()     # its head included: a stalled head is closed too)
            self._idle = None
        self._current = req
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
        if self.lost:
            return
        if not req.keep_alive or self.closing:
            self.closing = True
            if req._done or self.transport is None:
                self._close()
            else:
                self._linger_then_close()
            return
        if self._queue:
            if self._reading_paused and self.transport is not None:
                self._reading_paused = False
                self.transport.resume_reading()
            self._start(self._queue.popleft())
        else:
            self._arm_idle()

    def _linger_then_close(self) -> None:
        """The answer is out but the client may still be sending the body it was refused:
        read it and drop it (at most LINGER_S), then close."""
        if self._linger is None and not self.lost:
            self._linger = self.loop.call_later(LINGER_S, self._close)

    def _arm_idle(self) -> None:
        if self._idle is None and not self.lost:
            self._idle = self.loop.call_later(self.server.keepalive_s, self._close)

    def _refuse(self, status: int, message: str) -> None:
        """A request that cannot be parsed or is over a limit: answered here, and the
        connection closed."""
        log.warning("request refused", reason="bad_http", status=status, peer=self.peer,
                    why=message[:300])
        self.server.refused(status)
        if self._current is not None and self._task is not None:
            self._task.cancel()  # (its answer could not be told from the refusal's)
        self._current = None
        self._queue.clear()
        self.closing = True
        body = json.dumps({"error": {"message": message, "type": "bad_http",
                                     "code": status}}).encode()
        head = (f"HTTP/1.1 {status} {REASONS.get(status, '')}\r\nContent-Type: "
                f"application/json\r\nContent-Length: {len(body)}\r\n{date_header()}\r\n"
                "Connection: close\r\n\r\n").encode("latin-1")
        self.write(head + body)
        self._close()

    # ---- writing ------------------------------------------------------------------

    def write(self, data: bytes) -> None:
        if self.lost or self.transport is None or self.transport.is_closing():
            raise ConnectionResetError("the client went away")
        self.transport.write(data)

    async def send(self, data: bytes) -> None:
        """Bytes to the client, waiting while too many are buffered for it."""
        self.write(data)
        if self._paused:
            if self._drain is None or self._drain.done():
                self._drain = self.loop.create_future()
            await self._drain

    def _close(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()

    def close_if_idle(self) -> bool:
        if self._current is None:
            self._close()
            return True
        self.closing = True  # (closed once its answer is out)
        return False

    def abort(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()
        if self.transport is not None:
            self.transport.abort()


class _Refused(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


class Server:
    """The listening socket and its connections."""

    def __init__(self, handler: Handler, limits: Limits,
                 refused: Callable[[int], None] = lambda status: None,
                 keepalive_s: float = KEEPALIVE_S) -> None:
        self.handler = handler
        self.limits = limits
        self.refused = refused
        self.keepalive_s = keepalive_s
        self.loop = asyncio.get_running_loop()
        self.connections: set[Connection] = set()
        self._server: asyncio.Server | None = None
        self._port: int | None = None

    async def listen(self, host: str, port: int) -> None:
        """Raises OSError when it cannot."""
        self._server = await self.loop.create_server(
            lambda: Connection(self), host or None, port, reuse_address=True, backlog=1024)
        self._port = int(self._server.sockets[0].getsockname()[1])

    @property
    def port(self) -> int:
        """The port it listens on (the one the system chose for port 0), or did."""
        assert self._port is not None, "never listened"
        return self._port

    async def close(self, shutdown_s: float = 10.0) -> None:
        """Stop listening; close idle connections; give the busy ones `shutdown_s`."""
        if self._server is not None:
            self._server.close()
        busy = [c for c in list(self.connections) if not c.close_if_idle()]
        deadline = time.monotonic() + shutdown_s
        while busy and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
            busy = [c for c in busy if not c.lost and c._current is not None]
        for c in busy:
            c.abort()
        for c in list(self.connections):
            c.abort()
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 1.0)
            self._server = None
