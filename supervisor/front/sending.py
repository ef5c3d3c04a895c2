"""The writing side of one client connection (`supervisor/front/connection.py`): its
answers' bytes to the transport, where its writing is (`Send`, changed only by `_to`,
which checks `connection_states.SEND`), the client's buffer while it is full (`_Stall`:
the future its writers wait on, and the send deadline that cuts a client that takes
nothing), and its end: the last bytes, our side ended, what the client still sends read
and dropped for at most LINGER_S, then closed.

A `Sender` is what a request and its answer use of their connection
(`messages.Connection`). It never reads and never decides whether a request is served:
its connection does, and moves it between answers (`answering`, `answered`, `end`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

import structlog

from supervisor.front.connection_states import SEND, Send, check
from supervisor.front.limits import Limits

log = structlog.get_logger("supervisor.proxy")

LINGER_S = 2.0  # the rest of a refused body is read and dropped for at most this long
HIGH_WATER = 64 << 10  # bytes buffered for a client before `send` waits (and of a
# pipelined request's body read ahead of its turn before the socket's reading pauses)


class _Stall:
    """The client's buffer over HIGH_WATER, from `pause_writing` to `resume_writing`."""

    __slots__ = ("drained", "timer")

    def __init__(self, timer: asyncio.TimerHandle) -> None:
        self.drained: asyncio.Future[None] | None = None  # what `drain` waits on
        self.timer: asyncio.TimerHandle | None = timer  # the send deadline


class Sender:
    """One connection's writing: its transport's bytes out, its `Send` state, its
    client's stalls and its end."""

    def __init__(self, loop: asyncio.AbstractEventLoop, limits: Limits,
                 refused: Callable[[int | None, str], None],
                 cut: Callable[[], None]) -> None:
        self.loop = loop
        self.limits = limits
        self._refused = refused  # (the server's count of refusals)
        self._cut = cut  # aborts the connection (its task cancelled, its transport gone)
        self.transport: asyncio.Transport | None = None
        self.peer: str | None = None
        self.state = Send.IDLE
        # no request after the one being answered is served, and its head says close
        # (set with no answer under way, it comes with CLOSING)
        self.closing = False
        self._stall: _Stall | None = None  # while the client's buffer is full
        self._linger: asyncio.TimerHandle | None = None  # (CLOSING) closes the transport
        # `state is Send.CLOSED`, for what an answer reads of its connection
        # (`messages.Connection`, whose `lost` is a plain attribute); set by `gone` only
        self.lost = False

    def _to(self, new: Send) -> None:
        """The one place the writing state changes, checked against `SEND` (as `check`
        does, inline: a request goes through three of them)."""
        if new not in SEND[self.state]:
            check(self.state, new)  # (raises)
        self.state = new

    # ---- between answers (its connection's calls) ---------------------------------

    def made(self, transport: asyncio.Transport, peer: str | None) -> None:
        self.transport = transport
        self.peer = peer
        transport.set_write_buffer_limits(high=HIGH_WATER)

    def answering(self) -> None:
        """A request's answer begins (IDLE -> ANSWERING)."""
        self._to(Send.ANSWERING)

    def answered(self) -> None:
        """Its answer ended, the connection kept (-> IDLE)."""
        self._to(Send.IDLE)

    def end(self) -> None:
        """No answer more on this connection (-> CLOSING)."""
        self.closing = True
        if self.state is not Send.CLOSING:
            self._to(Send.CLOSING)

    def gone(self) -> None:
        """The client went away (`connection_lost`): its writers told, its timers off."""
        self._to(Send.CLOSED)
        self.lost = True
        if self._linger is not None:
            self._linger.cancel()
        stall = self._stall
        if stall is not None:
            if stall.timer is not None:
                stall.timer.cancel()
            if stall.drained is not None and not stall.drained.done():
                stall.drained.set_exception(ConnectionResetError("the client went away"))

    # ---- bytes out -----------------------------------------------------------------

    def write(self, data: bytes) -> None:
        """Bytes to the client now, however many are buffered for it (an answer's head
        and a body written inline)."""
        self.send_nowait(data)

    def write_interim(self, data: bytes) -> None:
        """A 1xx answer (`100 Continue`): the final one is still to come."""
        transport = self.transport
        if self.state is Send.CLOSED or transport is None or transport.is_closing():
            raise ConnectionResetError("the client went away")
        transport.write(data)

    async def send(self, data: bytes) -> None:
        """Bytes to the client, waiting while too many are buffered for it."""
        if not self.send_nowait(data):
            await self.drain()

    def send_nowait(self, data: bytes) -> bool:
        """Bytes to the client now; False when too many are buffered for it, and the
        sender must `drain()` before it sends more (`send` without its coroutine, for a
        stream's events; `write` inline)."""
        transport = self.transport
        if self.state is Send.CLOSED or transport is None or transport.is_closing():
            raise ConnectionResetError("the client went away")
        if self.state is Send.ANSWERING:
            self._to(Send.WRITING)
        transport.write(data)
        return self._stall is None

    async def drain(self) -> None:
        """Until the client's buffer has room again (at once if it has); the client cut
        if it takes nothing for `send_timeout_s` (`pause_writing`)."""
        stall = self._stall
        if stall is not None:
            if stall.drained is None or stall.drained.done():
                stall.drained = self.loop.create_future()
            await stall.drained

    # ---- the client's buffer (the transport's calls, through its connection) -------

    def pause_writing(self) -> None:
        if self._stall is None:
            self._stall = _Stall(self.loop.call_later(self.limits.send_timeout_s,
                                                      self._send_timed_out))

    def resume_writing(self) -> None:
        stall, self._stall = self._stall, None
        if stall is None:
            return
        if stall.timer is not None:
            stall.timer.cancel()
        if stall.drained is not None and not stall.drained.done():
            stall.drained.set_result(None)

    def _send_timed_out(self) -> None:
        """The client took nothing of its answer for `send_timeout_s`: cut, so that its
        handler ends (its upstream request, its admission slot with it)."""
        stall = self._stall
        if self.state is Send.CLOSED or stall is None:
            return
        stall.timer = None
        log.warning("client cut", reason="send_timeout", peer=self.peer,
                    why=f"it read nothing for {self.limits.send_timeout_s:g} s")
        self._refused(None, "send_timeout")
        self._cut()

    # ---- the end -------------------------------------------------------------------

    def end_with(self, data: bytes) -> None:
        """The connection's last bytes (a refusal), then our side ended. The client may
        still be sending what was refused: what it sends is read and dropped (at most
        LINGER_S), so that it reads the answer instead of a reset."""
        with contextlib.suppress(ConnectionError):
            self.write(data)
        transport = self.transport
        if transport is not None and not transport.is_closing() and transport.can_write_eof():
            transport.write_eof()
            self.linger_then_close()
        else:
            self.close()

    def linger_then_close(self) -> None:
        """The answer is out but the client may still be sending the body it was refused:
        read it and drop it (at most LINGER_S), then close."""
        if self._linger is None and self.state is not Send.CLOSED:
            self._linger = self.loop.call_later(LINGER_S, self.close)

    def close(self) -> None:
        """The transport closed (what is buffered still goes out); with no answer under
        way, no answer more."""
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()
        if self.state is Send.IDLE:
            self.end()

    def turn_away(self, answer: bytes) -> None:
        """Not served (its server is at its cap): the answer, then closed."""
        self.end()
        if self.transport is not None:
            self.transport.write(answer)
            self.transport.close()
