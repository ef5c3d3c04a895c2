"""The front door's guard rails (issue 33), over real sockets on loopback: each finding
of the hostile-client review, tried as it was found, against the server in this
process (`supervisor/front/server.py`). Sizes and deadlines are shrunk so that each
takes a fraction of a second; no test asserts a duration."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from supervisor.front.messages import BodyTooLarge, Request, Response, StreamResponse
from supervisor.front.server import Limits, Server, connection_cap
from tests.harness import until


class Seen:
    """What the server refused (status or None, reason), and what the handler saw."""

    def __init__(self) -> None:
        self.refused: list[tuple[int | None, str]] = []
        self.requests: list[tuple[str, list[tuple[str, str]], bytes]] = []

    def reasons(self) -> list[str]:
        return [r for _, r in self.refused]


@asynccontextmanager
async def serving(handler: Any = None, **limits: Any) -> AsyncIterator[tuple[Server, Seen]]:
    seen = Seen()

    async def echo(request: Request) -> StreamResponse:
        try:
            body = await request.read()
        except BodyTooLarge:
            return Response(status=413, text="too large")
        seen.requests.append((request.raw_path, list(request.headers.items()), body))
        return Response(body=json.dumps({"path": request.raw_path,
                                         "size": len(body)}).encode(),
                        content_type="application/json")

    bounds = {"max_line": 200, "max_field": 300, "max_body": 1 << 20, **limits}
    server = Server(handler or echo, Limits(**bounds),
                    refused=lambda status, reason: seen.refused.append((status, reason)))
    await server.listen("127.0.0.1", 0)
    try:
        yield server, seen
    finally:
        await server.close(shutdown_s=1.0)


async def talk(port: int, data: bytes, wait_s: float = 5.0) -> bytes:
    """Send, then read until the server closes."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        return await asyncio.wait_for(reader.read(), wait_s)
    finally:
        writer.close()


async def trickle(port: int, head: bytes, piece: bytes, pieces: int) -> bytes:
    """`head`, then `piece` after `piece` as a slow client sends them, until the server
    answers (or `pieces` went); what it answered."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(head)
    for _ in range(pieces):
        if reader.at_eof() or writer.is_closing():
            break
        writer.write(piece)
        await asyncio.sleep(0.005)
    try:
        return await asyncio.wait_for(reader.read(), 5)
    finally:
        writer.close()


def status(raw: bytes) -> int:
    return int(raw.split(b" ", 2)[1])


CHUNKED_HEAD = b"POST /c HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n"
CHUNKED = CHUNKED_HEAD + b"3\r\nabc\r\n0\r\n"  # (its trailers, and their end, to come)


# ---- H1: connections ------------------------------------------------------------------

def test_at_the_connection_cap_an_idle_one_makes_room_and_else_503_and_close() -> None:
    async def main() -> None:
        gate = asyncio.Event()

        async def handler(request: Request) -> StreamResponse:
            await gate.wait()
            return Response(text="ok")

        async with serving(handler, max_connections=3, retry_after_s=7) as (server, seen):
            # a flood of idle connections: each new one takes the oldest idle one's place
            idle = [await asyncio.open_connection("127.0.0.1", server.port)
                    for _ in range(5)]
            await until(lambda: seen.reasons().count("connections_evicted") == 2)
            assert await asyncio.wait_for(idle[0][0].read(), 5) == b""  # (the oldest)
            busy = [asyncio.create_task(talk(server.port, b"GET /%d HTTP/1.1\r\nHost: t\r\n"
                                              b"Connection: close\r\n\r\n" % i))
                    for i in range(3)]  # a client gets in past the flood...
            await until(lambda: sum(not c.idle() for c in server.connections) == 3)
            # ... and with every connection busy, a new one is refused
            raw = await talk(server.port, b"GET / HTTP/1.1\r\nHost: t\r\n\r\n")
            assert status(raw) == 503 and b"Retry-After: 7" in raw
            assert b"Connection: close" in raw and seen.reasons()[-1] == "connections"
            gate.set()
            assert [status(await b) for b in busy] == [200, 200, 200]
            for _, w in idle:
                w.close()

    asyncio.run(main())


def test_the_connection_cap_stays_under_the_descriptor_limit() -> None:
    assert connection_cap(4096, soft_limit=65536) == 4096
    assert connection_cap(4096, soft_limit=1024) == 384  # (1024 - 256) / 2: two each
    assert connection_cap(4096, soft_limit=256) == 96  # a quarter kept in reserve
    assert connection_cap(10, soft_limit=1024) == 10


def test_a_connection_that_never_sends_a_head_is_closed_at_the_head_deadline() -> None:
    async def main() -> None:
        async with serving(header_timeout_s=0.2) as (server, seen):
            assert await talk(server.port, b"") == b""  # closed, nothing said
            raw = await talk(server.port, b"GET / HTTP/1.1\r\nHost: t\r\nX-Slow: a")
            assert status(raw) == 408
            assert seen.refused == [(None, "header_timeout"), (408, "header_timeout")]
            await until(lambda: not server.connections)

    asyncio.run(main())


def test_a_kept_connections_deadline_moves_with_it_past_its_first_timer() -> None:
    """Its deadlines are moved without a timer each (`Connection._arm`): the first timer,
    set for the first head's deadline, fires while the connection is kept idle, and
    finds the idle deadline (later) instead; a head begun after that is timed again."""
    async def main() -> None:
        async with serving(header_timeout_s=0.3, idle_timeout_s=5.0) as (server, seen):
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            writer.write(b"GET /a HTTP/1.1\r\nHost: t\r\n\r\n")
            assert (await reader.readuntil(b"}")).startswith(b"HTTP/1.1 200")
            await asyncio.sleep(0.6)  # past the first head's deadline: kept, idle
            writer.write(b"GET /b HTTP/1.1\r\nHost: t\r\n\r\n")
            assert (await reader.readuntil(b"}")).startswith(b"HTTP/1.1 200")
            writer.write(b"GET /c HTTP/1.1\r\nHost: t\r\nX-Slow: a")  # never ends
            assert status(await asyncio.wait_for(reader.read(), 5)) == 408
            assert [r[0] for r in seen.requests] == ["/a", "/b"]
            assert seen.refused == [(408, "header_timeout")]
            writer.close()

    asyncio.run(main())


# ---- H2, M3: trailers -----------------------------------------------------------------

def test_trailers_count_against_the_head_bound_and_never_reach_the_handler() -> None:
    async def main() -> None:
        async with serving() as (server, seen):
            raw = await talk(server.port, CHUNKED + b"Authorization: secret\r\nX-T: 1\r\n\r\n"
                             + b"GET /next HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
            assert raw.count(b"HTTP/1.1 200") == 2
            (_, fields, body), (path, _, _) = seen.requests
            assert body == b"abc" and path == "/next"
            assert [k for k, _ in fields] == ["Host", "Transfer-Encoding"]  # (not merged)
            # many small trailer fields: refused at the head's bound (8 x 300 bytes),
            # long before the 2 MiB that follow
            many = CHUNKED + b"X-T: 1\r\n" * (2 << 17)
            raw = await talk(server.port, many)
            assert status(raw) == 431 and b"header section too large" in raw
            # one trailer value that never ends: refused as it grows
            raw = await trickle(server.port, CHUNKED + b"X-T: ", b"v" * 1000, 40)
            assert status(raw) == 431 and b"trailer section too large" in raw
            assert server.buffered == 0

    asyncio.run(main())


def test_a_trailer_after_a_large_body_is_bounded_as_a_head_not_by_the_body() -> None:
    """Issue 50, point 6: the framing's allowance grows with the body (a quarter of it),
    and a trailer value behind a 12.8 MiB body was read to 3.2 MiB. The trailers are
    bounded as a head is, whatever came before them: refused with 431 and closed long
    before a megabyte of it."""
    async def main() -> None:
        async with serving(max_body=1 << 20) as (server, seen):
            body = b"%x\r\n%b\r\n" % (800_000, b"b" * 800_000)  # (a 200 KB allowance)
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            writer.write(CHUNKED_HEAD + body + b"0\r\nX-T: ")
            answer = asyncio.ensure_future(reader.read())  # (until the server closes)
            sent = 0
            while sent < 1 << 20 and not answer.done():
                writer.write(b"v" * 4096)
                sent += 4096
                await asyncio.sleep(0.005)
            try:
                raw = await asyncio.wait_for(answer, 5)
            finally:
                writer.close()
            assert status(raw) == 431 and b"trailer section too large" in raw
            assert sent < 1 << 20  # refused as it grew, before a megabyte
            assert seen.reasons() == ["bad_http"] and not seen.requests
            assert server.buffered == 0

    asyncio.run(main())


def test_blank_lines_after_a_chunked_request_are_no_trailers() -> None:
    """The trailers' count ends with their request: line ends a client sends between
    requests (RFC 9112 2.2 lets a server skip them) after a chunked one, past the head's
    bound in all, are not refused as trailers, and its next request is served."""
    async def main() -> None:
        async with serving() as (server, seen):
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            writer.write(CHUNKED + b"\r\n")
            await until(lambda: len(seen.requests) == 1)
            for _ in range(20):  # (8,000 bytes, in reads of their own)
                writer.write(b"\r\n" * 200)
                await asyncio.sleep(0.01)
            writer.write(b"GET /after HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
            raw = await asyncio.wait_for(reader.read(), 5)
            writer.close()
            assert raw.count(b"HTTP/1.1 200") == 2 and seen.reasons() == []
            assert [path for path, _, _ in seen.requests] == ["/c", "/after"]

    asyncio.run(main())


def test_chunk_extensions_are_bounded() -> None:
    async def main() -> None:
        async with serving() as (server, seen):
            # a megabyte of extensions, as it comes: refused as it grows (one read's
            # worth, as the parser skips them, is not counted)
            raw = await trickle(server.port, CHUNKED_HEAD + b"3;", b"e" * 4096, 256)
            assert status(raw) == 400 and b"chunk framing" in raw
            assert not seen.requests
            # a body sent in small chunks with short extensions is served
            body = b"".join(b"2;e=1\r\nab\r\n" for _ in range(500)) + b"0\r\n\r\n"
            raw = await talk(server.port, CHUNKED_HEAD + body +
                             b"GET /x HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
            assert raw.count(b"HTTP/1.1 200") == 2 and b'"size": 1000' in raw

    asyncio.run(main())


# ---- M2: the head, counted as it arrives ----------------------------------------------

def test_a_head_over_the_bound_in_one_read_never_reaches_the_handler() -> None:
    async def main() -> None:
        async with serving() as (server, seen):
            head = b"GET / HTTP/1.1\r\nHost: t\r\n" + b"".join(
                b"X-%d: %s\r\n" % (i, b"v" * 250) for i in range(40)) + b"\r\n"
            assert len(head) > 8 * 300
            raw = await talk(server.port, head)
            assert status(raw) == 431 and not seen.requests

    asyncio.run(main())


# ---- H3, M1: deadlines ----------------------------------------------------------------

def test_a_client_that_stops_reading_is_cut_and_its_handler_ends() -> None:
    async def main() -> None:
        ended = asyncio.Event()

        async def endless(request: Request) -> StreamResponse:
            resp = StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            try:
                while True:
                    await resp.write(b"data: " + b"x" * 4000 + b"\n\n")
            finally:
                ended.set()

        async with serving(endless, send_timeout_s=0.3) as (server, seen):
            _, writer = await asyncio.open_connection("127.0.0.1", server.port)
            writer.transport.set_write_buffer_limits(0)
            sock = writer.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            writer.write(b"GET /s HTTP/1.1\r\nHost: t\r\n\r\n")
            await asyncio.wait_for(ended.wait(), 10)  # nothing read: cut
            assert seen.reasons() == ["send_timeout"]
            await until(lambda: not server.connections)
            writer.close()

    asyncio.run(main())


def test_a_body_that_stalls_is_refused_with_408_and_one_that_trickles_is_served() -> None:
    async def main() -> None:
        async with serving(body_timeout_s=0.3) as (server, seen):
            raw = await talk(server.port, b"POST / HTTP/1.1\r\nHost: t\r\n"
                             b"Content-Length: 100\r\n\r\n0123456789")
            assert status(raw) == 408 and seen.reasons() == ["body_timeout"]
            assert not seen.requests and server.buffered == 0
            # a byte every 0.1 s, for longer than the deadline in all: each read resets it
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            writer.write(b"POST / HTTP/1.1\r\nHost: t\r\nContent-Length: 8\r\n"
                         b"Connection: close\r\n\r\n")
            for b in b"abcdefgh":
                await asyncio.sleep(0.1)
                writer.write(bytes([b]))
            raw = await asyncio.wait_for(reader.read(), 5)
            writer.close()
            assert status(raw) == 200 and b'"size": 8' in raw

    asyncio.run(main())


# ---- M4: memory ----------------------------------------------------------------------

def test_pipelined_bodies_are_not_read_ahead_of_their_turn() -> None:
    async def main() -> None:
        gate = asyncio.Event()
        peak = [0]

        async def handler(request: Request) -> StreamResponse:
            body = await request.read()
            if request.raw_path == "/first":
                await gate.wait()
            return Response(text=str(len(body)))

        async with serving(handler) as (server, _):
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            writer.write(b"GET /first HTTP/1.1\r\nHost: t\r\n\r\n")
            body = b"b" * 200_000
            sent = b"".join(b"POST /%d HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n\r\n%s"
                            % (i, len(body), body) for i in range(15))
            writer.write(sent)  # 3 MB behind a request that waits
            for _ in range(30):
                await asyncio.sleep(0.02)
                peak[0] = max(peak[0], server.buffered)
            assert peak[0] <= 64 * 1024 + 256 * 1024  # (the mark, and one read past it)
            gate.set()
            got = b""
            while got.count(b"200000") < 15:
                got += await asyncio.wait_for(reader.read(1 << 20), 5)
            writer.close()
            await until(lambda: server.buffered == 0)

    asyncio.run(main())


def test_a_gone_clients_partial_body_is_dropped_at_once() -> None:
    async def main() -> None:
        async with serving() as (server, _):
            _, writer = await asyncio.open_connection("127.0.0.1", server.port)
            writer.write(b"POST / HTTP/1.1\r\nHost: t\r\nContent-Length: 900000\r\n\r\n"
                         + b"p" * 500_000)
            await until(lambda: server.buffered >= 400_000)
            writer.close()
            await until(lambda: not server.connections)
            assert server.buffered == 0  # (no collection needed to give it back)

    asyncio.run(main())


def test_a_body_past_the_total_budget_is_refused_503_and_the_others_served() -> None:
    async def main() -> None:
        gate = asyncio.Event()

        async def handler(request: Request) -> StreamResponse:
            body = await request.read()
            if request.raw_path == "/a":
                await gate.wait()
            return Response(text=str(len(body)))

        async with serving(handler, max_buffered=1 << 20) as (server, seen):
            head = b"POST /%s HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n" \
                   b"Connection: close\r\n\r\n"
            a = asyncio.create_task(talk(server.port, head % (b"a", 900_000) + b"q" * 900_000))
            await until(lambda: server.buffered == 900_000)
            # its length known: refused at its head; unknown: once it passes the budget
            raw = await talk(server.port, head % (b"b", 900_000) + b"q" * 900_000)
            assert status(raw) == 503 and b"Retry-After: 5" in raw
            raw = await talk(server.port, CHUNKED_HEAD + b"".join(
                b"10000\r\n" + b"c" * 0x10000 + b"\r\n" for _ in range(8)) + b"0\r\n\r\n")
            assert status(raw) == 503 and b"max_buffered_bytes" in raw
            assert seen.reasons() == ["body_budget", "body_budget"]
            assert server.buffered == 900_000  # (what was refused is not held)
            raw = await talk(server.port, head % (b"c", 10) + b"q" * 10)  # fits: served
            assert raw.endswith(b"10")
            gate.set()
            assert status(await a) == 200
            assert server.buffered == 0

    asyncio.run(main())


# ---- the Low list: conformance --------------------------------------------------------

def test_heads_the_parser_lets_through_are_refused_by_the_rules() -> None:
    cases = [
        (b"GET / HTTP/1.1\r\n\r\n", 400, b"without a Host"),
        (b"GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n", 400, b"more than one Host"),
        (b"GET / HTTP/2.0\r\nHost: a\r\n\r\n", 505, b"HTTP/2.0"),
        (b"GET /\r\n\r\n", 400, b"without an HTTP version"),
        (b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: gzip, chunked\r\n\r\n"
         b"3\r\nabc\r\n0\r\n\r\n", 501, b"gzip"),
        (b"POST / HTTP/1.0\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n",
         400, b"HTTP/1.0"),
    ]

    async def main() -> None:
        async with serving() as (server, seen):
            for data, code, why in cases:
                raw = await talk(server.port, data)
                assert status(raw) == code and why in raw, (data, raw)
                assert b"Connection: close" in raw
            assert not seen.requests
            raw = await talk(server.port, b"GET /old HTTP/1.0\r\n\r\n")  # (1.0: no Host)
            assert status(raw) == 200

    asyncio.run(main())


def test_fields_named_by_connection_are_dropped_and_bytes_after_close_ignored() -> None:
    async def main() -> None:
        async with serving() as (server, seen):
            raw = await talk(server.port, b"GET /a HTTP/1.1\r\nHost: t\r\nX-Secret: s\r\n"
                             b"Connection: close, X-Secret\r\n\r\nGARBAGE\r\n\r\n")
            assert status(raw) == 200 and raw.count(b"HTTP/1.1") == 1
            ((_, fields, _),) = seen.requests
            assert "X-Secret" not in [k for k, _ in fields]
            assert seen.refused == []

    asyncio.run(main())


def test_a_bad_request_behind_a_streamed_answer_is_refused_after_its_end() -> None:
    async def main() -> None:
        async def stream(request: Request) -> StreamResponse:
            resp = StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for i in range(5):
                await resp.write(b"data: %d\n\n" % i)
                await asyncio.sleep(0.02)
            await resp.write_eof()
            return resp

        async with serving(stream) as (server, seen):
            raw = await talk(server.port, b"GET /s HTTP/1.1\r\nHost: t\r\n\r\nNONSENSE\r\n\r\n")
            first, second = raw.split(b"0\r\n\r\n", 1)
            assert first.count(b"HTTP/1.1 ") == 1 and b"data: 4" in first  # whole
            assert second.startswith(b"HTTP/1.1 400 ")
            assert seen.reasons() == ["bad_http"]

    asyncio.run(main())
