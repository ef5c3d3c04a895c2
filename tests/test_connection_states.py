"""A client connection's writing side as a state (`supervisor/front/connection_states.py`,
`Sender` in `supervisor/front/sending.py`), without a socket: its table, and the
connection (`supervisor/front/connection.py`) over a recording transport taken through
an answer kept alive, a refusal in an answer's place, an answer cut by a refusal, a
client whose buffer stays full, and a client gone."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from supervisor.front.connection import Connection
from supervisor.front.connection_states import SEND, Send, TransitionError, check
from supervisor.front.limits import Limits
from supervisor.front.messages import Request, Response, StreamResponse
from supervisor.front.sending import Sender
from tests.test_server_guards import until


class Transport:
    """What a connection uses of its transport, recorded."""

    def __init__(self) -> None:
        self.written: list[bytes] = []
        self.closed = self.eof = self.aborted = self.paused = False

    def write(self, data: bytes) -> None:
        self.written.append(data)

    def is_closing(self) -> bool:
        return self.closed or self.aborted

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.aborted = True

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        self.eof = True

    def pause_reading(self) -> None:
        self.paused = True

    def resume_reading(self) -> None:
        self.paused = False

    def set_write_buffer_limits(self, high: int) -> None:
        pass

    def get_extra_info(self, name: str) -> Any:
        return ("127.0.0.1", 5000) if name == "peername" else None


class Owner:
    """What a connection uses of its server."""

    def __init__(self, handler: Callable[[Request], Awaitable[StreamResponse]],
                 **limits: Any) -> None:
        self.loop = asyncio.get_running_loop()
        self.limits = Limits(**{"max_line": 200, "max_field": 300, "max_body": 1000,
                                **limits})
        self.handler = handler
        self.reasons: list[str] = []
        self.connections: dict[Connection, None] = {}
        self.buffered = 0

    def refused(self, status: int | None, reason: str) -> None:
        self.reasons.append(reason)

    def admit(self, conn: Connection) -> bool:
        self.connections[conn] = None
        return True

    def release(self, held: int) -> None:
        self.buffered -= held


def state(conn: Connection) -> Send:
    return conn.sender.state


def test_the_send_table_reaches_every_state_and_closed_is_the_end() -> None:
    seen, todo = {Send.IDLE}, [Send.IDLE]
    while todo:
        for nxt in SEND[todo.pop()] - seen:
            seen.add(nxt)
            todo.append(nxt)
    assert seen == set(Send)
    assert SEND[Send.CLOSED] == frozenset()
    assert all(Send.CLOSED in SEND[s] for s in Send if s is not Send.CLOSED)
    with pytest.raises(TransitionError):
        check(Send.CLOSING, Send.ANSWERING)  # (no answer after the last)
    with pytest.raises(TransitionError):
        check(Send.IDLE, Send.WRITING)  # (bytes of an answer that never began)


def test_idle_to_answering_to_writing_to_idle_on_a_kept_alive_answer() -> None:
    async def main() -> None:
        seen: list[Send] = []
        go = asyncio.Event()

        async def handler(req: Request) -> StreamResponse:
            seen.append(conn.sender.state)
            await go.wait()
            return Response(text="ok")

        owner = Owner(handler)
        conn = Connection(owner)  # type: ignore[arg-type]
        transport = Transport()
        conn.connection_made(transport)  # type: ignore[arg-type]
        assert state(conn) is Send.IDLE and conn.idle()
        conn.data_received(b"GET / HTTP/1.1\r\nHost: t\r\n\r\n")
        await until(lambda: bool(seen))
        assert seen == [Send.ANSWERING] and not conn.idle()
        go.set()
        await until(lambda: bool(transport.written))
        assert transport.written[0].startswith(b"HTTP/1.1 200 OK\r\n")
        await until(lambda: state(conn) is Send.IDLE)
        assert not conn.closing and not transport.closed and conn.idle()
        conn.connection_lost(None)
        assert state(conn) is Send.CLOSED and conn.lost

    asyncio.run(main())


def test_answering_to_closing_with_a_refusal_in_place_of_the_answer() -> None:
    """A body that breaks its framing before its handler wrote a byte: the refusal is
    the answer, our side ends, the rest lingers."""
    async def main() -> None:
        async def handler(req: Request) -> StreamResponse:
            await req.read()
            return Response(text="never")

        owner = Owner(handler)
        conn = Connection(owner)  # type: ignore[arg-type]
        transport = Transport()
        conn.connection_made(transport)  # type: ignore[arg-type]
        conn.data_received(b"POST / HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n")
        assert state(conn) is Send.ANSWERING  # (its handler waits for the body)
        conn.data_received(b"zz\r\n")
        assert state(conn) is Send.CLOSING and conn.closing
        assert transport.written[0].startswith(b"HTTP/1.1 400 ")
        assert transport.eof and not transport.closed  # (lingering: LINGER_S at most)
        conn.connection_lost(None)
        assert state(conn) is Send.CLOSED

    asyncio.run(main())


def test_writing_to_closing_when_a_begun_answer_is_refused_cuts_it() -> None:
    """An answer begun (its head out) when its own body breaks a rule: cut, never a
    status line inside it."""
    async def main() -> None:
        async def handler(req: Request) -> StreamResponse:
            resp = StreamResponse()
            await resp.prepare(req)
            await req.read()
            return resp

        owner = Owner(handler)
        conn = Connection(owner)  # type: ignore[arg-type]
        transport = Transport()
        conn.connection_made(transport)  # type: ignore[arg-type]
        conn.data_received(b"POST / HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n")
        await until(lambda: state(conn) is Send.WRITING)
        conn.data_received(b"zz\r\n")
        assert state(conn) is Send.CLOSING and transport.closed
        assert not any(w.startswith(b"HTTP/1.1 400") for w in transport.written)
        assert owner.reasons == ["bad_http"]

    asyncio.run(main())


def test_a_stalled_client_is_waited_on_then_cut_at_its_send_deadline() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        limits = Limits(max_line=200, max_field=300, max_body=1000, send_timeout_s=0.05)
        reasons: list[str] = []
        cut = asyncio.Event()
        sender = Sender(loop, limits, lambda status, reason: reasons.append(reason), cut.set)
        transport = Transport()
        sender.made(transport, None)  # type: ignore[arg-type]
        sender.answering()
        assert sender.send_nowait(b"head")
        assert sender.state is Send.WRITING
        sender.pause_writing()
        assert not sender.send_nowait(b"more")  # (the writer must drain first)
        draining = asyncio.ensure_future(sender.drain())
        await asyncio.sleep(0)
        assert not draining.done()
        sender.resume_writing()
        await asyncio.wait_for(draining, 1.0)
        assert sender.send_nowait(b"again")
        sender.pause_writing()  # (and nothing taken again: cut)
        await asyncio.wait_for(cut.wait(), 2.0)
        assert reasons == ["send_timeout"]
        sender.gone()
        assert sender.lost and sender.state.value == "closed"
        with pytest.raises(ConnectionResetError):
            sender.write(b"late")
        with pytest.raises(TransitionError):
            sender.answered()

    asyncio.run(main())
