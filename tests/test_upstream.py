"""The proxy's upstream client (supervisor/front/upstream.py) against raw socket servers
that answer as scripted: what it sends, what it hands back, which failure it names,
and when it keeps a connection. Fast: no daemon, no engine."""

from __future__ import annotations

import asyncio
import contextlib
import select
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Literal

import pytest

from supervisor.front.upstream import (
    HIGH_WATER,
    BodyCut,
    ConnectFailed,
    Disconnected,
    Upstream,
    address,
)
from supervisor.loop import run

Script = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
OK = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"


class Engine:
    """A raw server; `connections` counts the connections it accepted, `writers` holds
    each one's writer."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.connections = 0
        self.writers: list[asyncio.StreamWriter] = []
        self.url = ""
        self.server: asyncio.Server | None = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.writers.append(writer)
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            await self.script(reader, writer)


@contextlib.asynccontextmanager
async def engine(script: Script) -> AsyncIterator[Engine]:
    e = Engine(script)
    server = e.server = await asyncio.start_server(e._serve, "127.0.0.1", 0)
    e.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    try:
        yield e
    finally:
        server.close()


async def read_request(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    return head, await reader.readexactly(length)


def test_a_request_is_one_write_and_its_connection_serves_the_next() -> None:
    seen: list[tuple[bytes, bytes]] = []

    async def answer_each(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            seen.append(await read_request(reader))
            writer.write(OK)

    async def main() -> None:
        async with engine(answer_each) as e:
            u = Upstream(1.0, 5.0)
            for _ in range(3):
                async with u.request("POST", e.url, "/v1/completions?x=%2F",
                                     [("Content-Type", "application/json"), ("X-A", "1"),
                                      ("X-A", "2")], b'{"a": 1}') as a:
                    assert (a.status, a.reason, a.content_type, a.content_length) == (
                        200, "OK", "application/json", 2)
                    assert await a.read() == b"{}"
            assert e.connections == 1
            status, body = await u.get(e.url, "/health", 2.0)
            assert (status, body) == (200, b"{}") and e.connections == 1
            await u.close()
        head, body = seen[0]
        port = e.url.rsplit(":", 1)[1]
        assert head.startswith(b"POST /v1/completions?x=%2F HTTP/1.1\r\nHost: 127.0.0.1:"
                               + port.encode() + b"\r\nContent-Length: 8\r\n")
        assert b"\r\nX-A: 1\r\nX-A: 2\r\n" in head and body == b'{"a": 1}'
        assert seen[3][0].startswith(b"GET /health HTTP/1.1\r\n")
        assert b"content-length" not in seen[3][0].lower()  # a GET says nothing of a body

    asyncio.run(main())


def test_a_chunked_answer_is_handed_over_a_read_at_a_time_not_a_chunk_at_a_time() -> None:
    go = asyncio.Event()

    async def stream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream; charset=utf-8\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n")
        writer.write(b"5\r\nhello\r\n1\r\n \r\n5\r\nworld\r\n")  # three chunks, one write
        await writer.drain()
        await go.wait()
        writer.write(b"1\r\n!\r\n0\r\n\r\n")
        await writer.drain()
        await read_request(reader)  # the connection is kept for the next request
        writer.write(OK)

    async def main() -> None:
        async with engine(stream) as e:
            u = Upstream(1.0, 5.0)
            async with u.request("POST", e.url, "/v1/completions", [], b"{}") as a:
                assert a.content_type == "text/event-stream" and a.content_length is None
                assert await a.read_some() == b"hello world"
                go.set()
                assert await a.read_some() == b"!"
                assert await a.read_some() == b""
            assert (await u.get(e.url, "/", 2.0)) == (200, b"{}")
            assert e.connections == 1
            await u.close()

    asyncio.run(main())


def test_each_failure_is_named_for_where_it_happened() -> None:
    async def close_at_once(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.close()

    async def cut_body(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n" + b"x" * 10)
        await writer.drain()
        writer.close()

    async def garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"SMTP ready\r\n\r\n")
        await writer.drain()

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        await asyncio.sleep(5)

    async def main() -> None:
        u = Upstream(1.0, 0.3)
        # nothing listens there: the request never reached an engine
        async with engine(silent) as e:
            gone = e.url
        with pytest.raises(ConnectFailed):
            async with u.request("POST", gone, "/", [], b"{}"):
                pass
        async with engine(close_at_once) as e:
            with pytest.raises(Disconnected):
                async with u.request("POST", e.url, "/", [], b"{}"):
                    pass
        async with engine(cut_body) as e, u.request("POST", e.url, "/", [], b"{}") as a:
            assert a.status == 200
            with pytest.raises(BodyCut):
                await a.read()
        async with engine(garbage) as e:
            with pytest.raises((BodyCut, Disconnected)):
                async with u.request("POST", e.url, "/", [], b"{}"):
                    pass
        async with engine(silent) as e:
            with pytest.raises(TimeoutError):
                async with u.request("POST", e.url, "/", [], b"{}"):
                    pass
            assert e.connections == 1
        await u.close()

    asyncio.run(main())


def test_a_reader_closed_from_elsewhere_is_told_its_body_was_cut() -> None:
    async def endless(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n")
        await writer.drain()
        await reader.read()  # until the proxy drops the connection

    async def main() -> None:
        async with engine(endless) as e:
            u = Upstream(1.0, 5.0)
            async with u.request("POST", e.url, "/", [], b"{}") as a:
                assert await a.read_some() == b"ok"
                asyncio.get_running_loop().call_later(0.05, a.close)
                with pytest.raises(BodyCut):
                    await a.read_some()
            await u.close()

    asyncio.run(main())


def test_idle_and_unfinished_connections_are_not_reused() -> None:
    async def answer_each(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            head, _ = await read_request(reader)
            if head.startswith(b"HEAD"):
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n")
            elif head.startswith(b"POST /open"):  # an answer that has not ended
                writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
                             b"2\r\nok\r\n")
            else:
                writer.write(OK)

    async def main() -> None:
        async with engine(answer_each) as e:
            u = Upstream(1.0, 5.0, keepalive_s=0.2)
            async with u.request("HEAD", e.url, "/", []) as a:  # no body follows its head
                assert a.status == 200 and a.content_length == 2
                assert await a.read() == b""
            async with u.request("POST", e.url, "/open", [], b"{}") as a:
                assert await a.read_some() == b"ok"  # left before its end: not reused
            assert (await u.get(e.url, "/", 2.0)) == (200, b"{}")
            assert e.connections == 3
            await asyncio.sleep(0.3)  # idle past keepalive_s: dropped, not reused
            assert (await u.get(e.url, "/", 2.0)) == (200, b"{}")
            assert e.connections == 4
            await u.close()

    asyncio.run(main())


def test_connections_kept_from_a_burst_are_let_go_once_idle_while_traffic_goes_on() -> None:
    """Issue 50's RSS finding: after a burst, traffic that needs one connection at a time
    takes the newest kept one again and again (last in, first out); the burst's others
    used to stay in the pool as objects until the next burst. Now they go once idle past
    `keepalive_s`, when another connection is put back after them."""
    started = asyncio.Event()
    answering = 0

    async def answer_each(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal answering
        while True:
            head, _ = await read_request(reader)
            if head.startswith(b"POST /burst"):  # answered once all 16 are in
                answering += 1
                if answering == 16:
                    started.set()
                await started.wait()
            writer.write(OK)

    async def main() -> None:
        async with engine(answer_each) as e:
            u = Upstream(1.0, 5.0, keepalive_s=0.2)

            async def one(target: str) -> None:
                async with u.request("POST", e.url, target, [], b"{}") as a:
                    assert await a.read() == b"{}"

            await asyncio.gather(*(one("/burst") for _ in range(16)))
            assert u.kept() == 16 and e.connections == 16
            loop = asyncio.get_running_loop()
            until = loop.time() + 0.5  # one at a time, past the burst's keepalive_s
            while loop.time() < until:
                await one("/one")
                await asyncio.sleep(0.02)
            assert e.connections == 16  # each on the newest kept one, none new
            assert u.kept() == 1
            await u.close()
            assert u.kept() == 0

    asyncio.run(main())


def test_a_request_given_up_before_its_answer_closes_its_connection() -> None:
    """Its caller cancelled (the proxy's client went away) while the engine has not
    answered: the engine sees the connection close, as vLLM must to abort the request."""
    arrived, closed = asyncio.Event(), asyncio.Event()

    async def slow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        arrived.set()
        await reader.read()  # b"" once the proxy closes
        closed.set()

    async def main() -> None:
        async with engine(slow) as e:
            u = Upstream(1.0, 5.0)

            async def ask() -> None:
                async with u.request("POST", e.url, "/", [], b"{}"):
                    pass

            task = asyncio.create_task(ask())
            await asyncio.wait_for(arrived.wait(), 2)  # at the engine, not answered
            task.cancel()
            await asyncio.wait_for(closed.wait(), 2)
            await u.close()

    asyncio.run(main())


def test_a_slow_reader_pauses_the_socket_and_still_gets_every_byte() -> None:
    size = 16 * HIGH_WATER

    async def flood(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % size)
        for i in range(16):
            writer.write(bytes([65 + i]) * HIGH_WATER)
            await writer.drain()

    async def main() -> None:
        async with engine(flood) as e:
            u = Upstream(1.0, 5.0)
            async with u.request("POST", e.url, "/", [], b"{}") as a:
                await asyncio.sleep(0.3)  # not reading: the client must stop reading too
                held = a._buffered
                assert HIGH_WATER <= held < 4 * HIGH_WATER, held
                body = await a.read()
            assert len(body) == size and body[-1:] == b"P"
            await u.close()

    asyncio.run(main())


def test_an_address_is_read_once_and_a_bad_one_refused() -> None:
    assert address("http://127.0.0.1:8100") == ("127.0.0.1", 8100, b"127.0.0.1:8100")
    assert address("http://[::1]:8100") == ("::1", 8100, b"[::1]:8100")
    with pytest.raises(ValueError, match="not an http"):
        address("https://127.0.0.1:8100")


# ---- kept connections the engine closed ------------------------------------------------


async def answer_each(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while True:
        await read_request(reader)
        writer.write(OK)


def _readable(fd: int, deadline_s: float) -> bool:
    """Whether `fd` has something to read (here: the peer's end) within `deadline_s`,
    waited for without running the event loop."""
    return bool(select.select([fd], [], [], deadline_s)[0])


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_a_kept_connection_the_engine_closed_while_idle_is_not_reused(
        loop: Literal["asyncio", "uvloop"]) -> None:
    """The engine closes a kept connection and the loop has not run since, so the
    connection does not know it yet: it is checked before reuse, dropped, and the
    request goes on a new one, never sent into the closed one."""

    async def main() -> None:
        async with engine(answer_each) as e:
            u = Upstream(1.0, 5.0)
            assert (await u.get(e.url, "/", 2.0)) == (200, b"{}")
            (kept,) = u._idle[("127.0.0.1", int(e.url.rsplit(":", 1)[1]))]
            assert kept.transport is not None
            mine = kept.transport.get_extra_info("socket").fileno()
            # the engine's end goes now (its FIN sent at once), without the loop running
            theirs = e.writers[0].get_extra_info("socket")
            with socket.fromfd(theirs.fileno(), socket.AF_INET, socket.SOCK_STREAM) as dup:
                dup.shutdown(socket.SHUT_RDWR)
            e.writers[0].transport.abort()
            assert _readable(mine, 5.0), "the engine's close never arrived"
            assert not kept.closed  # (the loop has not seen it)
            assert (await u.get(e.url, "/", 2.0)) == (200, b"{}")
            assert e.connections == 2 and u.resent_fresh == 0
            await u.close()

    run(main(), loop)


def test_a_reused_connection_gone_before_any_answer_byte_is_sent_again_on_a_fresh_one(
        ) -> None:
    """The engine reads the next request on a kept connection and closes it without a
    byte, as uvicorn's keep-alive timer does when it fires as a request arrives: the
    request was not reached, so it goes once more on a new connection, and the caller
    sees its answer, never `Disconnected`."""

    async def close_the_kept_one(reader: asyncio.StreamReader,
                                 writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(OK)
        if e.connections == 1:
            await read_request(reader)
            writer.transport.abort()
            return
        await answer_each(reader, writer)

    async def main() -> None:
        nonlocal e
        async with engine(close_the_kept_one) as e:
            u = Upstream(1.0, 5.0)
            for _ in range(2):
                async with u.request("POST", e.url, "/v1/completions", [], b"{}") as a:
                    assert a.status == 200 and await a.read() == b"{}"
            assert e.connections == 2 and u.resent_fresh == 1
            await u.close()

    e: Any = None
    asyncio.run(main())


def test_a_reused_connection_gone_after_answer_bytes_or_with_no_engine_left_is_disconnected(
        ) -> None:
    """Not sent again: a kept connection the engine closed inside its answer's head (it
    had the request), or one closed without a byte when no new connection can be made
    (the engine is gone: it may have died of this request, which must be counted)."""

    async def cut_the_head(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(OK)
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-")
        await writer.drain()
        writer.transport.abort()

    async def die(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(OK)
        await read_request(reader)
        assert e.server is not None
        e.server.close()  # nothing listens any more
        writer.transport.abort()

    async def main() -> None:
        nonlocal e
        for script, why in ((cut_the_head, "before answering"), (die, "fresh connection")):
            async with engine(script) as e:
                u = Upstream(1.0, 5.0)
                assert (await u.get(e.url, "/", 2.0)) == (200, b"{}")
                with pytest.raises(Disconnected, match=why):
                    async with u.request("POST", e.url, "/", [], b"{}"):
                        pass
                assert e.connections == 1
                await u.close()

    e: Any = None
    asyncio.run(main())


def _chunked(*parts: bytes) -> bytes:
    return b"".join(b"%x\r\n%b\r\n" % (len(p), p) for p in parts)


SSE_HEAD = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n")


def test_a_pumped_body_goes_to_its_sink_read_by_read_and_stops_when_it_says_so() -> None:
    go = asyncio.Event()

    async def paced(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(SSE_HEAD)
        for part in (b"one", b"two", b"three"):
            writer.write(_chunked(part))
            await writer.drain()
            await asyncio.sleep(0.02)  # (a read each, as an engine's steps)
        await go.wait()
        writer.write(_chunked(b"four") + b"0\r\n\r\n")
        await writer.drain()
        await read_request(reader)  # the connection is kept for the next request
        writer.write(OK)

    async def main() -> None:
        async with engine(paced) as e:
            u = Upstream(1.0, 5.0)
            got: list[bytes] = []

            def sink(data: bytes) -> bool:
                got.append(data)
                return data != b"two"

            async with u.request("POST", e.url, "/", [], b"{}") as a:
                assert await a.pump(sink) is False  # stopped after "two"
                assert b"".join(got) == b"onetwo"
                go.set()
                assert await a.pump(sink) is True  # the rest, then the end
                assert b"".join(got) == b"onetwothreefour"
            assert (await u.get(e.url, "/", 2.0)) == (200, b"{}")
            assert e.connections == 1
            await u.close()

    run(main())


def test_what_a_sink_raises_reaches_the_pumping_task_not_the_loop() -> None:
    async def stream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(SSE_HEAD + _chunked(b"bad"))
        await writer.drain()
        await reader.read()

    async def main() -> None:
        async with engine(stream) as e:
            u = Upstream(1.0, 5.0)

            def sink(data: bytes) -> bool:
                raise ValueError(data.decode())

            with pytest.raises(ValueError, match="bad"):
                async with u.request("POST", e.url, "/", [], b"{}") as a:
                    await a.pump(sink)
            assert not u._idle.get(address(e.url)[:2])  # not kept
            await u.close()

    run(main())


def test_a_pumped_body_cut_or_gone_silent_fails_after_every_byte_it_had() -> None:
    async def cut(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(SSE_HEAD + _chunked(b"last words"))
        await writer.drain()
        writer.close()

    async def slow_then_silent(reader: asyncio.StreamReader,
                               writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(SSE_HEAD)
        for i in range(6):  # a byte every 0.1 s: well inside the 0.5 s read timeout
            writer.write(_chunked(b"%d" % i))
            await writer.drain()
            await asyncio.sleep(0.1)
        await reader.read()

    async def main() -> None:
        u = Upstream(1.0, 0.5)
        got: list[bytes] = []

        def sink(data: bytes) -> bool:
            got.append(data)
            return True

        async with engine(cut) as e, u.request("POST", e.url, "/", [], b"{}") as a:
            with pytest.raises(BodyCut):
                await a.pump(sink)
        assert b"".join(got) == b"last words"
        got.clear()
        async with engine(slow_then_silent) as e, u.request("POST", e.url, "/", [],
                                                            b"{}") as a:
            with pytest.raises(TimeoutError):
                await a.pump(sink)
        assert b"".join(got) == b"012345"  # the timer moved on with each byte
        await u.close()

    run(main())
