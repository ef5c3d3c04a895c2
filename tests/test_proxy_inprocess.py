"""The front proxy in this process, in front of a scripted upstream (an aiohttp app, or a
raw socket server that misbehaves on purpose): how answers are framed to the client,
and what it does when an engine fails inside an answer. Fast: no daemon, no engine.
Streams: tests/test_proxy_inprocess_streams.py."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from structlog.testing import capture_logs
from yarl import URL

from supervisor.front.admission import Gate, GateLimits
from supervisor.front.exchange import ProxySettings
from supervisor.front.proxy import ENGINE_HEADER, FrontProxy
from tests.inprocess_proxy import (
    COMPLETION,
    answer_health_or_read_body,
    behind_raw_engine,
    completion_through,
    post_body,
    proxy_to,
    read_body,
    replaced_after_its_first_answer,
    scripted_upstream,
)


def test_a_sized_answer_goes_to_the_client_whole_with_its_length_and_headers() -> None:
    seen: list[bytes] = []

    async def handler(request: web.Request) -> web.StreamResponse:
        seen.append(await request.read())
        if request.path == "/v1/embeddings":  # an answer of unknown length: relayed
            resp = web.StreamResponse(headers={"Content-Type": "application/json"})
            resp.enable_chunked_encoding()
            await resp.prepare(request)
            await resp.write(COMPLETION[:20])
            await resp.write(COMPLETION[20:])
            await resp.write_eof()
            return resp
        return web.Response(body=COMPLETION, content_type="application/json",
                            headers={"X-Engine-Own": "1"}, status=201)

    async def main() -> None:
        runner, up = await scripted_upstream(handler)
        proxy = await proxy_to(up)
        try:
            async with aiohttp.ClientSession() as s:
                with capture_logs() as logs:
                    async with s.post(f"http://127.0.0.1:{proxy.port}/v1/completions",
                                      data=post_body({"model": "m", "prompt": "x"})) as r:
                        body = await r.read()
                        assert r.status == 201 and body == COMPLETION
                        assert r.headers["Content-Length"] == str(len(COMPLETION))
                        assert "Transfer-Encoding" not in r.headers
                        assert r.headers["X-Engine-Own"] == "1"
                        assert r.headers["Content-Type"] == "application/json"
                        assert r.headers[ENGINE_HEADER] == "default"
                    async with s.post(f"http://127.0.0.1:{proxy.port}/v1/embeddings",
                                      data=post_body({"model": "m", "input": "x"})) as r:
                        assert await r.read() == COMPLETION
                        assert r.headers["Transfer-Encoding"] == "chunked"
            access = [e for e in logs if e["event"] == "request"]
            assert [(e["path"], e["status"], e["tokens"]) for e in access] == [
                ("/v1/completions", 201, 7), ("/v1/embeddings", 200, 7)]
            assert proxy.stats.responses == {"201": 1, "200": 1}
            assert len(seen) == 2
        finally:
            await proxy.close()
            await runner.cleanup()

    asyncio.run(main())


def test_a_sized_answer_cut_by_a_dying_engine_is_sent_again_never_half_delivered() -> None:
    """The engine sends its headers and part of a sized body, then its connection
    drops: the client has seen nothing, so the request goes through the gate again and
    the next answer reaches it whole."""
    attempts: list[int] = []

    async def engine(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_body(reader, await reader.readuntil(b"\r\n\r\n"))
        attempts.append(1)
        status = (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n" % len(COMPLETION))
        if len(attempts) == 1:
            writer.write(status + COMPLETION[:10])  # ... and dies
        else:
            writer.write(status + COMPLETION)
        await writer.drain()
        writer.close()

    async def main() -> None:
        async with behind_raw_engine(engine) as proxy:
            async with aiohttp.ClientSession() as s, s.post(
                    f"http://127.0.0.1:{proxy.port}/v1/completions",
                    data=post_body({"model": "m", "prompt": "x"})) as r:
                assert r.status == 200 and await r.read() == COMPLETION
            assert len(attempts) == 2
            assert proxy.stats.retried_connects == 1

    asyncio.run(main())


def test_the_raw_target_is_checked_and_the_body_bounded_before_the_engine_sees_them() -> None:
    """aiohttp's low-level server hands every request to the proxy's one handler: the
    allow-list on the raw target, the body limit, the local health routes."""
    seen: list[str] = []

    async def handler(request: web.Request) -> web.StreamResponse:
        seen.append(request.raw_path)
        return web.Response(body=COMPLETION, content_type="application/json")

    async def main() -> None:
        runner, up = await scripted_upstream(handler)
        proxy = await proxy_to(up, max_body_bytes=100)
        base = f"http://127.0.0.1:{proxy.port}"
        try:
            async with aiohttp.ClientSession() as s:
                for path, status in [("/v1/completions/../../sleep", 400), ("/sleep", 403),
                                     ("/v1/nothing", 404), ("/metrics", 404)]:
                    async with s.post(URL(base + path, encoded=True), data=b"{}") as r:
                        assert r.status == status, path
                async with s.post(base + "/v1/completions", data=b"x" * 101) as r:
                    assert r.status == 413
                async with s.get(base + "/healthz") as r:
                    assert r.status == 200
                async with s.post(URL(base + "/v1/completions?a=%2F", encoded=True),
                                  data=post_body({"model": "m"})) as r:
                    assert r.status == 200 and await r.read() == COMPLETION
            assert seen == ["/v1/completions?a=%2F"]
        finally:
            await proxy.close()
            await runner.cleanup()

    asyncio.run(main())


def test_a_sized_answer_cut_by_a_healthy_engine_is_a_502_not_sent_again() -> None:
    """The engine cuts a sized answer but its /health says it serves: asked again, it
    could cut it again (and run the completion again each time), so the client, who has
    seen nothing, gets an explicit 502 at once."""
    attempts: list[int] = []

    async def engine(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        if head.startswith(b"GET /health"):
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
        else:
            await read_body(reader, head)
            attempts.append(1)
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n" % len(COMPLETION) + COMPLETION[:10])
        await writer.drain()
        writer.close()

    async def main() -> None:
        async with behind_raw_engine(engine) as proxy:
            async with aiohttp.ClientSession() as s, s.post(
                    f"http://127.0.0.1:{proxy.port}/v1/completions",
                    data=post_body({"model": "m", "prompt": "x"})) as r:
                assert r.status == 502
                assert (await r.json())["error"]["type"] == "engine_failed"
            assert len(attempts) == 1 and proxy.stats.retried_connects == 0

    asyncio.run(main())


def test_expect_100_continue_is_answered_before_the_body_and_an_unknown_expect_refused(
        ) -> None:
    async def handler(request: web.Request) -> web.StreamResponse:
        await request.read()
        return web.Response(body=COMPLETION, content_type="application/json")

    async def ask(expect: str, body: bytes) -> tuple[bytes, bytes]:
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Type: application/json\r\nExpect: " + expect.encode()
                     + b"\r\nContent-Length: %d\r\n\r\n" % len(body))
        await writer.drain()
        interim = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        rest = b""
        if interim.startswith(b"HTTP/1.1 100"):
            writer.write(body)
            await writer.drain()
            rest = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        writer.close()
        return interim, rest

    async def main() -> None:
        nonlocal proxy
        runner, upstream = await scripted_upstream(handler)
        proxy = await proxy_to(upstream)
        try:
            interim, final = await ask("100-continue", post_body({"model": "m", "prompt": "x"}))
            assert interim.startswith(b"HTTP/1.1 100 Continue") and final.startswith(
                b"HTTP/1.1 200")
            refused, _ = await ask("something-else", b"{}")
            assert refused.startswith(b"HTTP/1.1 417")
        finally:
            await proxy.close()
            await runner.cleanup()

    proxy: Any = None
    asyncio.run(main())


def test_a_kept_connection_the_engine_closed_is_not_a_death_nor_a_resend() -> None:
    """An engine that closes its kept connections: the first after reading the next
    request on it without a byte back (its keep-alive timer firing as that request
    arrived), the others right after answering. Every client gets its answer; nothing is
    charged as the engine's failure (no death in the quarantine, no failure seen at a
    healthy engine start), nothing goes back through the gate: the upstream client sent
    the one request again on a fresh connection, itself."""
    seen: list[int] = []  # the connection each request arrived on

    async def engine(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        me = len(connections) + 1
        connections.append(me)
        await read_body(reader, await reader.readuntil(b"\r\n\r\n"))
        seen.append(me)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(COMPLETION) + COMPLETION)
        await writer.drain()
        if me == 1:  # kept: the next request on it is read, then the connection closed
            await read_body(reader, await reader.readuntil(b"\r\n\r\n"))
            seen.append(me)
        writer.transport.abort()

    connections: list[int] = []

    async def main() -> None:
        async with behind_raw_engine(engine) as proxy, aiohttp.ClientSession() as s:
            for _ in range(4):
                async with s.post(f"http://127.0.0.1:{proxy.port}/v1/completions",
                                  data=post_body({"model": "m", "prompt": "x"})) as r:
                    assert r.status == 200 and await r.read() == COMPLETION
            backend = proxy.backends["default"]
            assert backend.failure_seen == {} and proxy.stats.retried_connects == 0
            assert proxy.stats.responses == {"200": 4}
            assert proxy._upstream is not None and proxy._upstream.resent_fresh == 1
            assert seen[:3] == [1, 1, 2]  # the second request again, on a new connection

    asyncio.run(main())




@pytest.mark.parametrize("stream", [False, True], ids=["request", "stream"])
def test_a_request_a_healthy_engine_drops_unanswered_is_sent_again_twice_then_fails(
        stream: bool) -> None:
    """An engine that closes the connection of every completion without a byte, its
    /health saying 200 all the while: no death, and the request is sent again twice,
    not every 0.2 s until the hold timeout; then a 502 naming why. A stream whose head
    the engine sent before it cut it (nothing the client can read yet) goes the same
    way, and ends with an error event."""
    posts: list[int] = []

    async def engine(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # (no connection kept: one the engine closes unanswered once kept is sent again
        # by the upstream client itself, as not reached)
        if await answer_health_or_read_body(reader, writer) is None:
            return
        posts.append(1)
        if stream and len(posts) == 1:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                         b"Transfer-Encoding: chunked\r\n\r\n")
            await writer.drain()
        writer.transport.abort()

    async def main() -> None:
        async with behind_raw_engine(engine, continue_timeout_s=5.0) as proxy, \
                aiohttp.ClientSession() as s, s.post(
                    f"http://127.0.0.1:{proxy.port}/v1/completions",
                    data=post_body({"model": "m", "prompt": "x", "stream": stream})) as r:
            body = await r.read()
            if stream:
                assert r.status == 200 and b"[DONE]" not in body, body
                (event,) = [line for line in body.split(b"\n") if line.startswith(b"data:")]
                message = json.loads(event[5:])["error"]["message"]
                assert proxy.stats.continuations == {"failed": 1}
            else:
                assert r.status == 502, body
                error = json.loads(body)["error"]
                assert error["type"] == "engine_dropped"
                message = error["message"]
                assert proxy.stats.rejections == {"engine_dropped": 1}
            assert "without answering, 3 times, while it served" in message, message
            assert len(posts) == (1 + 3 if stream else 3), posts
            if not stream:  # no death: a drop is no failure of that engine start
                assert proxy.backends["default"].failure_seen == {}

    asyncio.run(main())


def test_a_request_asking_more_tokens_than_the_engine_takes_does_not_hold_the_others(
        ) -> None:
    """With a token budget (`max_tokens_in_flight`), a request whose max_tokens is 10**12
    counts as the engine's max_model_len (its /v1/models says 512), not as 10**12: it
    goes beside a request already at the engine, and one that arrives after it goes too,
    instead of all waiting for a full drain behind it."""
    running: set[str] = set()
    arrived = asyncio.Condition()

    async def handler(request: web.Request) -> web.StreamResponse:
        if request.path == "/v1/models":
            return web.json_response({"object": "list", "data": [
                {"id": "m", "object": "model", "max_model_len": 512}]})
        doc = await request.json()
        async with arrived:
            running.add(doc["prompt"])
            arrived.notify_all()
            # each answered once all three are at the engine together
            await arrived.wait_for(lambda: len(running) == 3)
        return web.Response(body=COMPLETION, content_type="application/json")

    async def at_engine(*prompts: str) -> None:
        async with arrived:
            await arrived.wait_for(lambda: running >= set(prompts))

    async def main() -> None:
        runner, upstream = await scripted_upstream(handler)
        gate = Gate(GateLimits(concurrency=100, tokens=1000, max_wait_s=30))
        gate.release()
        proxy = FrontProxy(ProxySettings("127.0.0.1", 0, upstream), gate, ready=lambda: True)
        await proxy.start()
        url = f"http://127.0.0.1:{proxy.port}/v1/completions"
        try:
            async with aiohttp.ClientSession() as s:

                async def post(prompt: str, max_tokens: int) -> int:
                    async with s.post(url, data=post_body({"model": "m", "prompt": prompt,
                                                       "max_tokens": max_tokens})) as r:
                        await r.read()
                        return r.status

                first = asyncio.create_task(post("first", 100))
                await asyncio.wait_for(at_engine("first"), 10)
                huge = asyncio.create_task(post("huge", 10**12))
                await asyncio.wait_for(at_engine("huge"), 10)
                behind = asyncio.create_task(post("behind", 50))
                await asyncio.wait_for(at_engine("first", "huge", "behind"), 10)
                assert await asyncio.gather(first, huge, behind) == [200, 200, 200]
            assert proxy.backends["default"].max_model_len == 512
            assert gate.tokens_in_flight == 0
        finally:
            await proxy.close()
            await runner.cleanup()

    asyncio.run(main())


def test_a_drop_whose_health_check_a_new_engine_start_answers_is_a_death() -> None:
    """The engine start that had the request went (its connection closed unanswered);
    the /health asked then is answered by the start that replaced it: that says nothing
    of the one that had the request, which is counted as a death it was at, not as a
    drop by an engine that still serves."""
    engine, start = replaced_after_its_first_answer(lambda w: w.transport.abort())

    async def main() -> None:
        async with behind_raw_engine(engine) as proxy:
            backend = await completion_through(proxy, start)
            assert set(backend.failure_seen) == {1} and proxy.stats.retried_connects == 1

    asyncio.run(main())


def test_a_500_whose_health_check_the_engine_that_took_over_answers_goes_there() -> None:
    """vLLM answers 500 to a new request once its core is dead; a failover to the
    standby between that request and the proxy's /health question makes the standby
    answer it (200): the 500 is still the dying start's, and the request goes to the
    start that serves now, not to the client (a CI run saw it reach the client)."""
    dead = b'{"error": {"message": "EngineCore encountered an issue"}}'
    engine, start = replaced_after_its_first_answer(lambda w: w.write(
        b"HTTP/1.1 500 Internal Server Error\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % len(dead) + dead))

    async def main() -> None:
        async with behind_raw_engine(engine) as proxy:
            backend = await completion_through(proxy, start)
            assert set(backend.failure_seen) == {1}
            assert proxy.stats.responses == {"200": 1}

    asyncio.run(main())
