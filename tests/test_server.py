"""The front door's own HTTP/1.1 server (`supervisor/front/server.py`, its messages in
`supervisor/front/messages.py`), over real sockets on loopback: framing, keep-alive and
pipelining, the limits, a client that goes away, a handler that fails, a slow reader,
and closing."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import aiohttp

from supervisor.front.messages import (
    BodyTooLarge,
    Request,
    Response,
    StreamResponse,
    json_response,
)
from supervisor.front.server import Limits, Server

Handler = Callable[[Request], Awaitable[StreamResponse]]


@asynccontextmanager
async def serving(handler: Handler, refused: list[int] | None = None,
                  reasons: list[str] | None = None, **limits: Any) -> AsyncIterator[Server]:
    def count(status: int | None, reason: str) -> None:
        if refused is not None and status is not None:
            refused.append(status)
        if reasons is not None:
            reasons.append(reason)

    limits = {"max_line": 200, "max_field": 300, "max_body": 1000, **limits}
    server = Server(handler, Limits(**limits), refused=count)
    await server.listen("127.0.0.1", 0)
    try:
        yield server
    finally:
        await server.close(shutdown_s=1.0)


async def echo(request: Request) -> StreamResponse:
    body = await request.read()
    return Response(body=request.method.encode() + b" " + request.raw_path.encode()
                    + b" " + body, content_type="text/plain")


async def exchange(port: int, data: bytes, until_closed: bool = True) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    await writer.drain()
    try:
        if until_closed:
            return await asyncio.wait_for(reader.read(), 5)
        return await asyncio.wait_for(reader.read(65536), 5)
    finally:
        writer.close()


def test_keep_alive_and_pipelined_requests_are_answered_in_order() -> None:
    async def main() -> None:
        async with serving(echo) as server:
            async with aiohttp.ClientSession() as s:
                for i in range(3):  # one connection, kept
                    async with s.post(f"http://127.0.0.1:{server.port}/a?i={i}",
                                      data=b"x" * i) as r:
                        assert r.status == 200
                        assert await r.read() == f"POST /a?i={i} ".encode() + b"x" * i
                        assert r.headers["Date"] and r.headers["Content-Length"]
                assert len(server.connections) == 1
            # two requests in one write, the second closing: both answered, in order
            raw = await exchange(server.port, b"POST /1 HTTP/1.1\r\nHost: t\r\n"
                                 b"Content-Length: 2\r\n\r\nab"
                                 b"GET /2 HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
            first, second = raw.split(b"HTTP/1.1 200 OK")[1:]
            assert first.endswith(b"POST /1 ab") and second.endswith(b"GET /2 ")
            assert b"Connection: close" in second and b"Connection: close" not in first

    asyncio.run(main())


def test_http_1_0_closes_unless_asked_and_a_stream_to_it_is_not_chunked() -> None:
    async def stream(request: Request) -> StreamResponse:
        resp = StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(3):
            await resp.write(b"data: %d\n\n" % i)
        await resp.write_eof()
        return resp

    async def main() -> None:
        async with serving(echo) as server:
            raw = await exchange(server.port, b"GET /x HTTP/1.0\r\n\r\n")
            assert raw.startswith(b"HTTP/1.1 200") and b"Connection: close" in raw
            raw = await exchange(server.port, b"GET /x HTTP/1.0\r\nConnection: keep-alive"
                                 b"\r\n\r\n", until_closed=False)
            assert b"Connection: keep-alive" in raw and raw.endswith(b"GET /x ")
        async with serving(stream) as server:
            raw = await exchange(server.port, b"GET /s HTTP/1.1\r\nHost: t\r\n"
                                 b"Connection: close\r\n\r\n")
            assert b"Transfer-Encoding: chunked" in raw
            assert raw.endswith(b"\r\n9\r\ndata: 2\n\n\r\n0\r\n\r\n")
            raw = await exchange(server.port, b"GET /s HTTP/1.0\r\nConnection: keep-alive"
                                 b"\r\n\r\n")  # (closed at its end: nothing else frames it)
            assert b"chunked" not in raw and b"Connection: close" in raw
            assert raw.endswith(b"\r\n\r\ndata: 0\n\ndata: 1\n\ndata: 2\n\n")
            raw = await exchange(server.port, b"HEAD /s HTTP/1.1\r\nHost: t\r\nConnection: close"
                                 b"\r\n\r\n")
            assert raw.endswith(b"\r\n\r\n") and b"data:" not in raw

    asyncio.run(main())


def test_over_a_limit_or_malformed_is_refused_with_its_status_and_counted() -> None:
    refused: list[int] = []

    async def handler(request: Request) -> StreamResponse:
        try:
            await request.read()
        except BodyTooLarge:
            return json_response({"error": "too large"}, status=413)
        return Response(text="ok")

    async def main() -> None:
        async with serving(handler, refused) as server:
            raw = await exchange(server.port,
                                 b"GET /" + b"a" * 300 + b" HTTP/1.1\r\nHost: t\r\n\r\n")
            assert raw.startswith(b"HTTP/1.1 414 ") and b"request target too long" in raw
            raw = await exchange(server.port, b"GET / HTTP/1.1\r\nHost: t\r\nX-Big: " + b"b" * 400
                                 + b"\r\n\r\n")
            assert raw.startswith(b"HTTP/1.1 431 ")
            raw = await exchange(server.port, b"GET / HTTP/1.1\r\nHost: t\r\n" + b"X: y\r\n" * 500)
            assert raw.startswith(b"HTTP/1.1 431 ")  # (a head that never ends)
            raw = await exchange(server.port, b"NONSENSE\r\n\r\n")
            assert raw.startswith(b"HTTP/1.1 400 ") and b"malformed request" in raw
            assert refused == [414, 431, 431, 400]
            # a body over the limit, its length known or not: the client reads the 413
            # (the rest of the body read and dropped, not a reset)
            async with aiohttp.ClientSession() as s:
                async with s.post(f"http://127.0.0.1:{server.port}/", data=b"z" * 5000) as r:
                    assert r.status == 413 and r.headers["Connection"] == "close"

                async def chunks() -> AsyncIterator[bytes]:
                    for _ in range(20):
                        yield b"z" * 100

                async with s.post(f"http://127.0.0.1:{server.port}/", data=chunks()) as r:
                    assert r.status == 413
                async with s.post(f"http://127.0.0.1:{server.port}/", data=b"z" * 10) as r:
                    assert r.status == 200 and await r.text() == "ok"

    asyncio.run(main())


def test_a_client_that_goes_away_cancels_its_handler_and_a_failing_handler_is_a_500(
        ) -> None:
    async def main() -> None:
        gone, started = asyncio.Event(), asyncio.Event()

        async def slow(request: Request) -> StreamResponse:
            if request.raw_path == "/fail":
                raise ValueError("a bug")
            started.set()
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                gone.set()
                raise
            return Response(text="late")

        async with serving(slow) as server:
            raw = await exchange(server.port, b"GET /fail HTTP/1.1\r\nHost: t\r\n\r\n")
            assert raw.startswith(b"HTTP/1.1 500 ") and b"internal error" in raw
            _, writer = await asyncio.open_connection("127.0.0.1", server.port)
            writer.write(b"GET /slow HTTP/1.1\r\nHost: t\r\n\r\n")
            await asyncio.wait_for(started.wait(), 5)
            writer.close()
            await asyncio.wait_for(gone.wait(), 5)

    asyncio.run(main())


def test_a_slow_reader_holds_its_writer_with_a_bounded_buffer() -> None:
    async def main() -> None:
        progress: list[int] = []
        state: dict[str, StreamResponse] = {}

        async def big(request: Request) -> StreamResponse:
            resp = StreamResponse()
            state["resp"] = resp
            await resp.prepare(request)
            for i in range(2000):
                await resp.write(b"y" * 8192)
                progress.append(i)
            await resp.write_eof()
            return resp

        async with serving(big) as server:
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            writer.write(b"GET / HTTP/1.1\r\nHost: t\r\n\r\n")
            await asyncio.sleep(0.5)  # nothing read: the writer must be waiting
            (conn,) = server.connections
            assert conn.transport is not None
            assert conn.transport.get_write_buffer_size() <= 64 * 1024 + 8300
            assert 0 < len(progress) < 2000
            got = 0
            while chunk := await asyncio.wait_for(reader.read(1 << 20), 5):
                got += len(chunk)
                if chunk.endswith(b"0\r\n\r\n"):
                    break
            assert len(progress) == 2000 and got > 2000 * 8192
            writer.close()

    asyncio.run(main())


def test_idle_connections_close_and_close_gives_busy_handlers_their_time() -> None:
    async def main() -> None:
        finished: list[str] = []

        async def handler(request: Request) -> StreamResponse:
            if request.raw_path == "/slow":
                await asyncio.sleep(0.3)
                finished.append("slow")
            return Response(text="ok")

        server = Server(handler, Limits(200, 300, 1000, idle_timeout_s=0.2,
                                        header_timeout_s=0.2))
        await server.listen("127.0.0.1", 0)
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"GET / HTTP/1.1\r\nHost: t\r\n\r\n")
        assert (await reader.readuntil(b"ok")).startswith(b"HTTP/1.1 200")
        assert await asyncio.wait_for(reader.read(), 2) == b""  # idle: closed
        # a half-sent head: 408 at the head's deadline, and closed
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"GET / HTTP/1.1\r\nHost: t\r\nX-Y:")
        assert (await asyncio.wait_for(reader.read(), 2)).startswith(b"HTTP/1.1 408 ")
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"GET /slow HTTP/1.1\r\nHost: t\r\n\r\n")
        await asyncio.sleep(0.05)
        await server.close(shutdown_s=5.0)
        assert finished == ["slow"]
        assert (await asyncio.wait_for(reader.read(), 2)).startswith(b"HTTP/1.1 200")
        assert not server.connections

    asyncio.run(main())


class Wire:
    """A recording connection (what `messages.Connection` says an answer uses): each
    write, as one call."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.peer: str | None = "127.0.0.1"
        self.transport = None
        self.closing = False
        self.lost = False
        self.writes: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.writes.append(data)

    def write_interim(self, data: bytes) -> None:
        self.writes.append(data)

    async def send(self, data: bytes) -> None:
        self.writes.append(data)

    def send_nowait(self, data: bytes) -> bool:
        self.writes.append(data)
        return True

    async def drain(self) -> None:
        pass


def test_a_held_head_goes_with_the_first_bytes_or_alone_at_its_hold() -> None:
    """`prepare(request, hold_s)`: a chunked answer's head is written with its first
    event (one write), with its end if that comes first, or alone once `hold_s` passed;
    without a hold, at once."""
    async def main() -> None:
        wire = Wire(asyncio.get_running_loop())

        def answer() -> tuple[StreamResponse, Request]:
            return StreamResponse(headers={"Content-Type": "text/event-stream"}), \
                Request(wire, "POST", "/v1/completions", (1, 1), [], True)  # type: ignore[arg-type]

        resp, req = answer()
        await resp.prepare(req, 5.0)
        assert wire.writes == []
        assert resp.write_nowait(b"data: 1\n\n")
        assert resp.end_nowait(b"data: [DONE]\n\n")
        first, last = wire.writes
        assert first.startswith(b"HTTP/1.1 200 OK\r\n") and b"chunked" in first
        assert first.endswith(b"\r\n\r\n9\r\ndata: 1\n\n\r\n")
        assert last == b"e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n"
        wire.writes.clear()
        resp, req = answer()  # no body within the hold: the head alone, then the rest
        await resp.prepare(req, 0.05)
        await asyncio.sleep(0.2)
        assert len(wire.writes) == 1 and wire.writes[0].endswith(b"\r\n\r\n")
        await resp.write_eof()
        assert wire.writes[1:] == [b"0\r\n\r\n"]
        wire.writes.clear()
        resp, req = answer()  # ended before any body: head and end in one write
        await resp.prepare(req, 5.0)
        await resp.write_eof()
        assert len(wire.writes) == 1 and wire.writes[0].endswith(b"\r\n\r\n0\r\n\r\n")
        await asyncio.sleep(0)
        wire.writes.clear()
        resp, req = answer()  # no hold: at once
        await resp.prepare(req)
        assert len(wire.writes) == 1 and wire.writes[0].startswith(b"HTTP/1.1 200")

    asyncio.run(main())


def test_a_header_field_that_would_split_the_answer_is_never_written() -> None:
    """Outgoing fields are checked before they are written (issue 50, point 7): a value
    with a CR or LF (or another control character), or a name that is not a token, is
    left out, and a reason phrase with one is replaced by the status's own; the answer's
    other fields, its body and the connection's next answer are as they would be."""
    async def handler(request: Request) -> StreamResponse:
        resp = Response(status=200, reason="OK\r\nX-Injected: reason", text="body")
        resp.headers.add("X-Good", "kept\tvalue é")
        resp.headers.add("X-Split", "a\r\nSet-Cookie: stolen=1")
        resp.headers.add("X-Nul", "a\x00b")
        resp.headers.add("Bad Name", "v")
        resp.headers.add("X-Also-Good", "yes")
        return resp

    async def main() -> None:
        async with serving(handler) as server:
            two = b"GET / HTTP/1.1\r\nHost: t\r\n\r\n" + \
                b"GET / HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n"
            raw = await exchange(server.port, two)
        answers = raw.split(b"HTTP/1.1 ")[1:]
        assert len(answers) == 2, raw
        for answer in answers:
            head, _, body = answer.partition(b"\r\n\r\n")
            lines = head.split(b"\r\n")
            assert lines[0] == b"200 OK", lines
            names = [x.split(b":")[0] for x in lines[1:]]
            assert b"X-Good" in names and b"X-Also-Good" in names
            assert not {b"X-Split", b"X-Nul", b"Bad Name", b"Set-Cookie",
                        b"X-Injected"} & set(names), lines
            assert "X-Good: kept\tvalue é".encode() in lines
            assert body == b"body"

    asyncio.run(main())
