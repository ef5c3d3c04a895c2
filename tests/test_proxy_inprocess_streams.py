"""The front proxy in this process, in front of a raw socket engine, with streams: a
continuable stream to a client that reads late or not at all, a stream cut when its
engine pauses and sent again, a stream admitted as its engine pauses, and a request that
would wait past the hold timeout. Fast: no daemon, no engine."""

from __future__ import annotations

import asyncio
import re
import socket

import aiohttp
import pytest
from aiohttp import web

from supervisor.front.admission import Gate, GateLimits
from supervisor.front.exchange import Exchange, ProxySettings
from supervisor.front.proxy import FrontProxy
from tests.inprocess_proxy import (
    COMPLETION,
    SSE_HEAD,
    answer_health_or_read_body,
    behind_raw_engine,
    post_body,
    read_body,
    read_to_the_last_chunk,
    scripted_upstream,
    stream_request,
    token_event,
)


def test_a_continuable_stream_to_a_client_that_reads_late_gets_every_token_in_order() -> None:
    """The engine writes far faster than the client reads: the client's buffer fills,
    the relay waits for it to drain and goes on, every token once and in order."""
    n = 30000

    async def fast(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        assert b"return_token_ids" in await read_body(reader, head)
        writer.write(SSE_HEAD)
        for i in range(n):
            writer.write(token_event(i, first=i == 0, last=i == n - 1))
            if i % 50 == 0:
                await writer.drain()
        writer.write(b"%x\r\ndata: [DONE]\n\n\r\n0\r\n\r\n" % len(b"data: [DONE]\n\n"))
        await writer.drain()
        await reader.read()

    async def main() -> None:
        async with behind_raw_engine(fast) as proxy:
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # (fills soon)
            sock.connect(("127.0.0.1", proxy.port))
            reader, writer = await asyncio.open_connection(sock=sock, limit=1 << 20)
            writer.write(stream_request(n))
            await writer.drain()
            await asyncio.sleep(0.5)  # not reading: the proxy's writes back up
            got = await read_to_the_last_chunk(reader)
            writer.close()
            texts = [int(t) for t in re.findall(rb'"text":" t(\d+)"', got)]
            assert texts == list(range(n))
            assert b"token_ids" not in got and got.count(b"data: [DONE]") == 1

    asyncio.run(main())


def test_a_continuable_stream_to_a_client_that_reads_nothing_is_cut_and_its_engine_freed(
        ) -> None:
    """`send_timeout_s` holds on the relay's path too: the client cut, the engine's
    connection closed (vLLM aborts the request), the cut counted."""
    freed = asyncio.Event()

    async def endless(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        await read_body(reader, head)
        writer.write(SSE_HEAD)
        try:
            for i in range(10**6):
                writer.write(token_event(i, first=i == 0))
                await writer.drain()
        except ConnectionError:
            pass
        freed.set()

    async def main() -> None:
        async with behind_raw_engine(endless, send_timeout_s=0.3) as proxy:
            _reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
            writer.write(stream_request(10**6))
            await writer.drain()
            await asyncio.wait_for(freed.wait(), 30)
            assert proxy.stats.rejections.get("send_timeout") == 1
            writer.close()

    asyncio.run(main())


def test_a_stream_unanswered_when_its_engine_pauses_is_cut_and_sent_again_never_dropped(
        ) -> None:
    """A pause of the engine's streams (a KV reset, a drained restart with continue)
    cuts the continuable requests it has not begun to answer too, rather than wait for
    their answers (vLLM under load answers some seconds late): each goes again, as often
    as it is cut: no death of the engine start, no drop counted (a drop is sent again
    twice at most), and the client gets the whole stream once."""
    posts: list[int] = []
    waiting = asyncio.Event()
    n = 5

    async def engine(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if await answer_health_or_read_body(reader, writer) is None:
            return
        posts.append(1)
        if len(posts) <= 3:  # unanswered until the proxy closes the connection
            waiting.set()
            await reader.read()
            writer.close()
            return
        writer.write(SSE_HEAD)
        for i in range(n):
            writer.write(token_event(i, first=i == 0, last=i == n - 1))
        writer.write(b"%x\r\ndata: [DONE]\n\n\r\n0\r\n\r\n" % len(b"data: [DONE]\n\n"))
        await writer.drain()
        await reader.read()

    async def main() -> None:
        async with behind_raw_engine(engine) as proxy:
            reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
            writer.write(stream_request(n))
            await writer.drain()
            cut = []
            for _ in range(3):
                await asyncio.wait_for(waiting.wait(), 10)
                waiting.clear()
                cut.append(proxy.pause_streams("default"))
            got = await read_to_the_last_chunk(reader)
            writer.close()
            assert [int(t) for t in re.findall(rb'"text":" t(\d+)"', got)] == list(range(n))
            assert got.count(b"data: [DONE]") == 1
            assert cut == [1, 1, 1] and len(posts) == 4
            assert proxy.backends["default"].failure_seen == {}  # no death
            assert proxy.stats.rejections == {}  # never engine_dropped

    asyncio.run(main())


def test_a_stream_admitted_as_its_engine_pauses_is_not_sent_until_it_serves() -> None:
    """Admitted just before a pause's hold, sent after the pause cut the others: it
    would wait at the engine for a place in the batch the pause is emptying (a KV
    reset's drain held 1.1-1.4 s on the H100 with nothing else left), so it is not sent
    while the hold lasts (it goes back to the held gate); once the hold is over it is."""

    async def engine(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()

    async def main() -> None:
        async with behind_raw_engine(engine) as proxy:
            backend = proxy.backends["default"]
            ex = Exchange(arrived=0.0, backend=backend)
            call = proxy._upstream.request("POST", backend.upstream, "/v1/completions",  # type: ignore[union-attr]
                                           [], b"{}")
            backend.gate.hold("a KV reset")
            proxy.pause_streams("default")
            assert not proxy.streams.unanswered(ex, call, "default")
            backend.gate.release()  # (the reset is over: the pause with it)
            assert proxy.streams.unanswered(ex, call, "default")
            proxy.streams.answered(ex)

    asyncio.run(main())


def test_a_request_that_would_wait_past_the_hold_timeout_gets_503_over_capacity_at_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 51 over real HTTP: an engine of one slot that serves ~20 requests a second,
    160 requests queued behind it; once the gate has measured that pace (its window made
    short here), a newcomer would wait ~8 s, past the 3 s hold timeout: 503 at once, its
    reason `over_capacity` in the body and on the exporter's count, with Retry-After."""
    from supervisor.front import admission

    monkeypatch.setattr(admission, "RATE_WINDOW_S", 0.5)
    monkeypatch.setattr(admission, "RATE_MIN_DONE", 3)

    async def handler(request: web.Request) -> web.StreamResponse:
        await request.read()
        await asyncio.sleep(0.05)
        return web.Response(body=COMPLETION, content_type="application/json")

    async def main() -> None:
        runner, up = await scripted_upstream(handler)
        gate = Gate(GateLimits(concurrency=1, max_wait_s=3.0))
        gate.release()
        proxy = FrontProxy(ProxySettings("127.0.0.1", 0, up), gate, ready=lambda: True)
        await proxy.start()
        url = f"http://127.0.0.1:{proxy.port}/v1/completions"
        body = post_body({"model": "m", "prompt": "x", "max_tokens": 8})
        try:
            async with aiohttp.ClientSession(
                    connector=aiohttp.TCPConnector(limit=0)) as s:
                async def one() -> int:
                    async with s.post(url, data=body) as r:
                        await r.read()
                        return r.status

                load = [asyncio.create_task(one()) for _ in range(160)]
                for _ in range(500):  # (bounded: 10 s) until the pace is known
                    if gate.predicted_wait(1) is not None:
                        break
                    await asyncio.sleep(0.02)
                guess = gate.predicted_wait(1)
                assert guess is not None and guess[0] > 3.0, guess
                waiting = gate.waiting
                async with s.post(url, data=body) as r:
                    doc = await r.json()
                    assert r.status == 503, doc
                    assert doc["error"]["type"] == "over_capacity", doc
                    assert "past the hold timeout" in doc["error"]["message"]
                    assert int(r.headers["Retry-After"]) > 0
                assert gate.waiting <= waiting  # (it took no place in the queue)
                codes = await asyncio.gather(*load)
            assert proxy.stats.rejections.get("over_capacity") == 1, proxy.stats.rejections
            # the ones already queued were served or timed out as before, none refused so
            assert set(codes) <= {200, 503} and codes.count(200) >= 1
        finally:
            await proxy.close()
            await runner.cleanup()

    asyncio.run(main())
