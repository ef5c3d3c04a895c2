"""The front proxy in this process for the in-process tests (tests/test_proxy_inprocess*.py,
tests/test_proxy_guards.py): a scripted upstream (an aiohttp app) or a raw socket engine
that misbehaves on purpose, a proxy in front of it, and the answers and chunks those
engines write."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
from aiohttp import web

from supervisor.front.admission import Gate, GateLimits
from supervisor.front.exchange import ProxySettings
from supervisor.front.proxy import FrontProxy

COMPLETION = json.dumps({
    "id": "cmpl-1", "object": "text_completion", "created": 0, "model": "m",
    "choices": [{"index": 0, "text": " hi", "logprobs": None, "finish_reason": "length"}],
    "usage": {"prompt_tokens": 1, "completion_tokens": 7, "total_tokens": 8}}).encode()


async def scripted_upstream(handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                    ) -> tuple[web.AppRunner, str]:
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handler)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    return runner, f"http://127.0.0.1:{port}"


async def proxy_to(upstream: str, **settings: Any) -> FrontProxy:
    gate = Gate(GateLimits(concurrency=100, max_wait_s=5))
    gate.release()
    proxy = FrontProxy(ProxySettings("127.0.0.1", 0, upstream, **settings), gate,
                       ready=lambda: True)
    await proxy.start()
    return proxy


RawEngine = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@contextlib.asynccontextmanager
async def behind_raw_engine(engine: RawEngine, **settings: Any) -> AsyncIterator[FrontProxy]:
    """The proxy in front of a raw socket server (an engine that misbehaves on purpose)."""
    server = await asyncio.start_server(engine, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    proxy = await proxy_to(f"http://127.0.0.1:{port}", **settings)
    try:
        yield proxy
    finally:
        await proxy.close()
        server.close()
        await server.wait_closed()


async def read_body(reader: asyncio.StreamReader, head: bytes) -> bytes:
    """The body of a request whose head was read, by its Content-Length."""
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length")))
    return await reader.readexactly(length)


HEALTHY = b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"


async def answer_health_or_read_body(reader: asyncio.StreamReader,
                                     writer: asyncio.StreamWriter) -> bytes | None:
    """A raw engine's next request: a /health check answered 200 and closed (None), or
    the body of any other request."""
    head = await reader.readuntil(b"\r\n\r\n")
    if head.startswith(b"GET /health"):
        writer.write(HEALTHY)
        await writer.drain()
        writer.close()
        return None
    return await read_body(reader, head)


def post_body(body: dict[str, Any]) -> bytes:
    return json.dumps(body).encode()



def replaced_after_its_first_answer(first: Callable[[asyncio.StreamWriter], None]
                                     ) -> tuple[RawEngine, list[int]]:
    """An engine whose first completion is answered by `first` (a drop, a 500) as its
    start is replaced (the start number, by the time /health is asked, is the next
    one's, and the next start answers /health 200); every later completion whole."""
    start = [1]

    async def engine(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        if head.startswith(b"GET /health"):
            writer.write(HEALTHY)
        else:
            await read_body(reader, head)
            if start[0] == 1:
                start[0] = 2
                first(writer)
                if writer.transport.is_closing():
                    return
            else:
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                             b"Content-Length: %d\r\n\r\n" % len(COMPLETION) + COMPLETION)
        await writer.drain()
        writer.close()

    return engine, start


async def completion_through(proxy: FrontProxy, start: list[int]) -> Any:
    """One completion through the proxy, the backend's start number read from `start`;
    the backend."""
    backend = proxy.backends["default"]
    backend.generation = lambda: start[0]
    async with aiohttp.ClientSession() as s, s.post(
            f"http://127.0.0.1:{proxy.port}/v1/completions",
            data=post_body({"model": "m", "prompt": "x"})) as r:
        assert r.status == 200 and await r.read() == COMPLETION
    return backend



def token_event(i: int, first: bool = False, last: bool = False) -> bytes:
    """A completions chunk as vLLM writes it with `return_token_ids`."""
    choice = {"index": 0, "text": f" t{i}", "logprobs": None,
              "finish_reason": "length" if last else None, "stop_reason": None,
              "prompt_token_ids": [1, 2] if first else None, "token_ids": [100 + i]}
    doc = {"id": "cmpl-1", "object": "text_completion", "created": 0, "model": "m",
           "choices": [choice]}
    data = b"data: " + json.dumps(doc, separators=(",", ":")).encode() + b"\n\n"
    return b"%x\r\n%b\r\n" % (len(data), data)


SSE_HEAD = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n")


def stream_request(tokens: int) -> bytes:
    body = post_body({"model": "m", "prompt": "hi", "max_tokens": tokens, "stream": True})
    return (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%b" % (len(body), body))


async def read_to_the_last_chunk(reader: asyncio.StreamReader) -> bytes:
    """A chunked answer as the client reads it, to its last (empty) chunk; 10 s a read."""
    got = bytearray()
    while not got.endswith(b"0\r\n\r\n"):
        part = await asyncio.wait_for(reader.read(1 << 16), 10)
        assert part, bytes(got[-300:])
        got += part
    return bytes(got)
