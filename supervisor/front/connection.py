"""One client connection of the front door (`supervisor/front/server.py` says what the
server does as a whole): its requests, parsed as they come (`reading.Reader`), handed in
turn to the proxy's handler by the connection's one task, their answers written back
(`sending.Sender`); the deadlines of its reading and the refusals of one connection.
What it uses of its server is `Owner`.

Its state is explicit, one per side (`connection_states`): where the parser is
(`Phase`: between requests, in a head, in a body) and where the writing is (`Send`:
between answers, an answer under way with nothing of it written, or bytes of it
written, closing, closed); the one deadline its reading is under (`Wait`, kept by
`waits.Deadline`); the request being parsed, those waiting their turn, the one being
answered, a refusal waiting for that answer's end.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import Awaitable, Callable
from typing import Protocol, cast

import structlog

from supervisor.front.connection_states import Phase, Send
from supervisor.front.limits import Limits, refusal
from supervisor.front.messages import Request, StreamResponse, json_response
from supervisor.front.reading import Reader
from supervisor.front.sending import HIGH_WATER, LINGER_S, Sender
from supervisor.front.waits import Deadline, Wait

__all__ = ["HIGH_WATER", "LINGER_S", "Connection", "Handler", "Owner", "Phase",
           "Refused", "Send"]

log = structlog.get_logger("supervisor.proxy")

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


class Connection(asyncio.Protocol):
    """One client connection: requests parsed as they come, handled one at a time in
    their order by the connection's one task (cancelled if the client goes)."""

    def __init__(self, server: Owner) -> None:
        self.server = server
        self.limits = server.limits
        self.loop = server.loop
        self.sender = Sender(self.loop, self.limits, server.refused, self.abort)
        self.reader = Reader(self, server, self.limits)
        self._reading_paused = False
        self.stopped = False  # reading for good: what comes next is not served
        self._queue: collections.deque[Request] = collections.deque()
        self._current: Request | None = None  # (Send ANSWERING or WRITING) its request
        self._refusal: tuple[int, str] | None = None  # sent once the current answer ends
        self._task: asyncio.Task[None] | None = None  # serves the requests in turn
        self._wakeup: asyncio.Future[None] | None = None  # its wait for the next
        self._deadline = Deadline(self.loop, self._timed_out)
        self._last_read = 0.0

    @property
    def transport(self) -> asyncio.Transport | None:
        return self.sender.transport

    @property
    def peer(self) -> str | None:
        return self.sender.peer

    @property
    def lost(self) -> bool:
        return self.sender.lost  # (its state CLOSED)

    @property
    def closing(self) -> bool:
        return self.sender.closing

    # ---- the socket ---------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport = cast(asyncio.Transport, transport)  # (uvloop's is not a subclass)
        peer = transport.get_extra_info("peername")
        self.sender.made(transport, peer[0] if isinstance(peer, tuple) else None)
        if not self.server.admit(self):
            return
        self._arm(Wait.HEADER, self.limits.header_timeout_s)  # (nginx: from the accept)

    def connection_lost(self, exc: BaseException | None) -> None:
        self.sender.gone()
        self.server.connections.pop(self, None)
        self._deadline.cancel()
        if self._task is not None and not self._task.done():
            self._task.cancel()  # the handler stops; its upstream request with it
        # the bodies it held go now, not when a collection finds the cancelled task
        for req in (self._current, self.reader.parsing, *self._queue):
            if req is not None:
                self.server.release(req._drop_body())
        self._queue.clear()

    def pause_writing(self) -> None:
        self.sender.pause_writing()

    def resume_writing(self) -> None:
        self.sender.resume_writing()

    def data_received(self, data: bytes) -> None:
        if self.stopped:
            return  # (after a refusal, or after a request that closes the connection)
        if self.reader.feed(data):
            self._last_read = self.loop.time()  # (a body under way: its clock)

    # ---- what its reader hands it (`reading.Receiver`) ----------------------------

    def begun(self) -> None:
        """A request's head begins."""
        if self._deadline.wait is Wait.IDLE:  # (a kept-alive connection: its next head is timed)
            self._arm(Wait.HEADER, self.limits.header_timeout_s)

    def head_in(self, req: Request, body: bool) -> None:
        """A request's head is in (`body`: a body is to come): served now, or queued."""
        if self._deadline.wait is Wait.HEADER:
            self._disarm()
        if self.sender.closing:
            return  # (a request after one that closes the connection: not served)
        if body:  # (its reads are timed)
            self._last_read = self.loop.time()
            self._arm(Wait.BODY, self.limits.body_timeout_s)
        if self._current is None:
            self._start(req)
        else:
            self._queue.append(req)
            if len(self._queue) >= _PIPELINED:
                self._update_reading()

    def body_came(self, req: Request) -> None:
        """Some of its body came (held, and counted in the server's budget)."""
        if req is not self._current:
            self._update_reading()

    def parsed(self, req: Request | None) -> None:
        """A request is read to its end (None: one that was not served)."""
        if self._deadline.wait is Wait.BODY:
            self._disarm()
        if req is None:
            return
        req._complete()
        if req is not self._current and req not in self._queue:  # (answered already)
            self.server.release(req._drop_body())
        if not req.keep_alive:
            self.stop_reading()  # what follows is not served (RFC 9112 9.6)
        if self.sender.state is Send.CLOSING:
            self.sender.close()  # (a refused body, read to its end)

    # ---- requests -----------------------------------------------------------------

    def _start(self, req: Request) -> None:
        if self._deadline.wait is Wait.IDLE:
            self._disarm()
        self._current = req
        self.sender.answering()
        if self._task is None or self._task.done():
            self._task = self.loop.create_task(self._serve_all())
        elif self._wakeup is not None and not self._wakeup.done():
            self._wakeup.set_result(None)

    async def _serve_all(self) -> None:
        """The connection's one task: its requests, one after the other (a task each
        would cost more than the request's own parsing)."""
        while not self.sender.lost:
            req = self._current
            if req is None:
                if self.sender.state is Send.CLOSING:
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
            if self.sender.lost:
                return  # the client went away
            raise
        except ConnectionError:
            self.sender.close()
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
                self.sender.close()
        finally:
            if self._current is req:
                self._finished(req)

    def _finished(self, req: Request) -> None:
        self._current = None
        if req is not self.reader.parsing:  # (else its body is still coming, and counted)
            self.server.release(req._drop_body())
        if self.sender.lost:
            return
        sender = self.sender
        if self._refusal is not None:  # a request behind this one was refused
            sender.end()
            if req.keep_alive:
                self._send_refusal(*self._refusal)
            else:
                sender.close()  # (its answer said close: nothing may follow it)
            return
        if not req.keep_alive or sender.closing:
            sender.end()
            self._disarm()  # (its answer said close: nothing more is said on it)
            if req._done or sender.transport is None:
                sender.close()
            else:
                sender.linger_then_close()
            return
        sender.answered()
        if self._queue:
            self._start(self._queue.popleft())
            self._update_reading()
        elif self.reader.phase is Phase.IDLE:
            self._arm(Wait.IDLE, self.limits.idle_timeout_s)
        elif self.reader.phase is Phase.HEAD:
            self._arm(Wait.HEADER, self.limits.header_timeout_s)

    def refuse(self, status: int, message: str, reason: str = "bad_http") -> None:
        """A request that cannot be parsed, breaks a rule or a limit: answered here (after
        the answer being written, if it is another request's), and the connection
        closed."""
        log.warning("request refused", reason=reason, status=status, peer=self.peer,
                    why=message[:300])
        self.server.refused(status, reason)
        self.stop_reading()
        for req in self._queue:
            self.server.release(req._drop_body())
        self._queue.clear()
        current = self._current
        if current is not None and current is not self.reader.parsing:
            # sent when the current answer ends (which does not say close: the refusal
            # after it does)
            self._refusal = (status, message)
            return
        sender = self.sender
        answered = sender.state is Send.WRITING
        sender.end()
        if current is not None and self._task is not None:
            self._task.cancel()  # (its answer could not be told from the refusal's)
            self._current = None
            self.server.release(current._drop_body())
            if answered:
                sender.close()  # (an answer begun: cut, never a status line inside it)
                return
        self._send_refusal(status, message)

    def _send_refusal(self, status: int, message: str) -> None:
        retry = self.limits.retry_after_s if status == 503 else None
        self.sender.end_with(refusal(status, message, retry_after_s=retry))

    # ---- reading and its deadlines ------------------------------------------------

    def _update_reading(self) -> None:
        """Reading pauses while requests wait for their turn (too many, or their bodies
        past HIGH_WATER), and for good once stopped. (Only this connection's own turn
        resumes it: no wait on another client.)"""
        pause = self.stopped or len(self._queue) >= _PIPELINED \
            or sum(r._held for r in self._queue) > HIGH_WATER
        transport = self.transport
        if transport is None or pause is self._reading_paused or self.sender.lost:
            return
        self._reading_paused = pause
        if pause:
            transport.pause_reading()
        else:
            self._last_read = self.loop.time()  # (the body's clock starts again)
            transport.resume_reading()

    def stop_reading(self) -> None:
        self.stopped = True
        if self._deadline.wait is not Wait.IDLE:
            self._disarm()
        self._update_reading()

    def _arm(self, wait: Wait, after_s: float) -> None:
        if not self.sender.lost:
            self._deadline.arm(wait, after_s)  # (lazily: `supervisor/front/waits.py`)

    def _disarm(self) -> None:
        self._deadline.disarm()

    def _timed_out(self, wait: Wait) -> None:
        if self.sender.lost:
            return
        if wait is Wait.IDLE:
            self.sender.close()
        elif wait is Wait.HEADER:
            if self.reader.phase is Phase.HEAD:
                self.refuse(408, f"request head not received within "
                            f"{self.limits.header_timeout_s:g} s", "header_timeout")
            else:  # (a connection opened that never sent a byte)
                self.server.refused(None, "header_timeout")
                self.sender.close()
        elif wait is Wait.BODY:
            left = self._last_read + self.limits.body_timeout_s - self.loop.time()
            if self._reading_paused or left > 0:  # (read since, or paused by us)
                self._arm(Wait.BODY, max(left, 0.05) if not self._reading_paused
                          else self.limits.body_timeout_s)
            else:
                self.refuse(408, f"nothing of the request body for "
                            f"{self.limits.body_timeout_s:g} s", "body_timeout")

    # ---- its server's calls -------------------------------------------------------

    def idle(self) -> bool:
        """No request under way, none begun: it may be closed without cutting anyone."""
        return self.sender.state is Send.IDLE and self.reader.phase is Phase.IDLE \
            and not self._queue

    def close_if_idle(self) -> bool:
        if self._current is None:
            self.sender.close()
            return True
        self.sender.closing = True  # (closed once its answer is out)
        return False

    def turn_away(self, answer: bytes) -> None:
        """Not served (its server is at its cap): the answer, then closed."""
        self.stopped = True
        self.sender.turn_away(answer)

    def abort(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()
        if self.transport is not None:
            self.transport.abort()
