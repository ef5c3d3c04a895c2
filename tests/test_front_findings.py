"""The front door's last findings of the hostile battery (issue 50, point 6), each tried
as it was found: the real proxy (`FrontProxy`) in this process, in front of the fake
engine (tests/fake_engine.py, a process of its own), over real sockets on loopback.

No test asserts a duration: every wait is a condition with a generous deadline, and what
is asserted is counts and state (the gate's slots, the server's connections, the answers
and where a connection ended).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from supervisor.front.admission import Gate, GateLimits, Ticket
from supervisor.front.dispatch import UNKNOWN_MODEL_LEN
from supervisor.front.exchange import ProxySettings
from supervisor.front.proxy import FrontProxy
from tests.harness import FAKE_ENGINE, free_port, until, wait_for
from tests.test_server_guards import status

WAIT_S = 20.0  # the bound on any one wait: generous, on a shared and busy machine


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """The fake engine (no max_model_len in its /v1/models, as an engine that does not
    say), and the file where it appends each request's method and target."""
    root = tmp_path_factory.mktemp("engine")
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, str(FAKE_ENGINE), "--host", "127.0.0.1", "--port", str(port),
         "--token-delay", "0.01"],
        env={**os.environ, "FAKE_ENGINE_PIDFILE": str(root / "pid")})
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: httpx.get(f"{base}/health", timeout=1).status_code == 200, 30,
                 "the fake engine's /health")
        yield base, root / "requests"
    finally:
        proc.kill()
        proc.wait(10)


@asynccontextmanager
async def front(upstream: str, **limits: Any) -> AsyncIterator[tuple[FrontProxy, Gate]]:
    gate = Gate(GateLimits(**{"concurrency": 100, "max_wait_s": 60, **limits}))
    gate.release()
    proxy = FrontProxy(ProxySettings("127.0.0.1", 0, upstream, header_timeout_s=60,
                                     body_timeout_s=60), gate, ready=lambda: True)
    await proxy.start()
    try:
        yield proxy, gate
    finally:
        await proxy.close()


def counting(gate: Gate) -> list[int]:
    """Every slot the gate grants from now on, by its estimate (the proxy asks through
    `acquire`)."""
    granted: list[int] = []
    acquire = gate.acquire

    async def counted(tokens: int, refusable: bool = False) -> Ticket:
        ticket = await acquire(tokens, refusable)
        granted.append(ticket.tokens)
        return ticket

    gate.acquire = counted  # type: ignore[method-assign]
    return granted


def completion(max_tokens: int = 3, stream: bool = False) -> bytes:
    return json.dumps({"model": "fake", "prompt": "hi", "max_tokens": max_tokens,
                       "stream": stream}).encode()


def post(body: bytes, close: bool = True) -> bytes:
    return (b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
            + (b"Connection: close\r\n" if close else b"")
            + b"Content-Length: %d\r\n\r\n" % len(body) + body)


async def until_closed(port: int, data: bytes) -> bytes:
    """Send, then read until the server closes: a connection left open fails the test
    at WAIT_S (a TimeoutError)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        return await asyncio.wait_for(reader.read(), WAIT_S)
    finally:
        writer.close()


def engine_saw(requests: Path) -> list[str]:
    return requests.read_text().splitlines() if requests.exists() else []


# ---- a slot once the body is in ---------------------------------------------------------

def test_slow_bodies_and_heads_hold_connections_never_slots_and_others_are_served(
        engine: tuple[str, Path]) -> None:
    """Slow attacks beside ordinary requests: four clients each with half a body sent
    and the rest held back (as one sending a byte every few seconds), two with half a
    head. With two slots at the gate, the nine ordinary requests are all served while
    they hold their connections: a request takes a slot only once its body is in (as
    nginx buffers a request before it goes upstream); the slow ones, once whole, are
    served too."""
    async def main() -> None:
        async with front(engine[0], concurrency=2) as (proxy, gate):
            granted = counting(gate)
            port = proxy.port
            body = completion()
            half = len(body) // 2
            slow = []
            for _ in range(4):
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(post(body)[:-(len(body) - half)])
                slow.append((reader, writer))
            heads = []
            for _ in range(2):
                _, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nX-A: ")
                heads.append(writer)
            server = proxy._server
            assert server is not None
            await until(lambda: server.buffered == 4 * half
                        and len(server.connections) == 6, WAIT_S)
            assert (gate.in_flight, gate.waiting, granted) == (0, 0, [])

            answers = await asyncio.gather(*[until_closed(port, post(completion()))
                                             for _ in range(9)])
            assert [status(a) for a in answers] == [200] * 9
            assert len(granted) == 9 and gate.in_flight == 0 and gate.waiting == 0
            assert server.buffered == 4 * half and len(server.connections) == 6

            for _, writer in slow:  # the rest of each body: now each is admitted
                writer.write(body[half:])
            answers = [await asyncio.wait_for(r.read(), WAIT_S) for r, _ in slow]
            assert [status(a) for a in answers] == [200] * 4
            assert len(granted) == 13 and gate.in_flight == 0
            for _, writer in slow:
                writer.close()
            for writer in heads:
                writer.close()

    asyncio.run(main())


# ---- the token estimate without max_model_len -------------------------------------------

def test_a_huge_max_tokens_at_an_engine_without_max_model_len_does_not_hold_others(
        engine: tuple[str, Path]) -> None:
    """A stream asking 10**12 tokens of an engine whose /v1/models says no max_model_len
    (the fake engine streams until its client goes): counted as UNKNOWN_MODEL_LEN, not
    as the whole budget, so an ordinary request goes beside it instead of waiting for
    its end."""
    async def main() -> None:
        async with front(engine[0], tokens=UNKNOWN_MODEL_LEN + 1000) as (proxy, gate):
            reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
            writer.write(post(completion(10**12, stream=True)))
            first = await asyncio.wait_for(reader.readuntil(b"data: "), WAIT_S)
            assert status(first) == 200
            assert proxy.backends["default"].max_model_len is None  # (it was asked)
            assert (gate.in_flight, gate.tokens_in_flight) == (1, UNKNOWN_MODEL_LEN)

            answer = await until_closed(proxy.port, post(completion(5)))
            assert status(answer) == 200 and gate.waiting == 0
            assert not reader.at_eof()  # (the huge one still streams)
            writer.close()
            await until(lambda: gate.in_flight == 0 and gate.tokens_in_flight == 0, WAIT_S)

    asyncio.run(main())


# ---- no switch of protocols, and the connection closed ----------------------------------

H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
WS_FRAME = b"\x81\x85\x37\xfa\x21\x3d\x7f\x9f\x4d\x51\x58"  # a masked "Hello"


def test_connect_is_refused_and_the_connection_closed(engine: tuple[str, Path]) -> None:
    """CONNECT (a tunnel the front door never opens): one 400 that says close, then
    the socket closed; nothing reaches the engine, and what followed is not read."""
    async def main() -> None:
        async with front(engine[0]) as (proxy, gate):
            before = engine_saw(engine[1])
            raw = await until_closed(
                proxy.port, b"CONNECT example.com:443 HTTP/1.1\r\nHost: example.com:443"
                b"\r\n\r\n" + b"GET /v1/models HTTP/1.1\r\nHost: t\r\n\r\n")
            assert status(raw) == 400 and raw.count(b"HTTP/1.1 ") == 1
            assert b"Connection: close" in raw and b"CONNECT" in raw
            assert engine_saw(engine[1]) == before and gate.in_flight == 0

    asyncio.run(main())


@pytest.mark.parametrize("head, after", [
    (b"GET /v1/models HTTP/1.1\r\nHost: t\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
     b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n",
     WS_FRAME),
    (b"GET /v1/models HTTP/1.1\r\nHost: t\r\nUpgrade: h2c\r\n"
     b"Connection: Upgrade, HTTP2-Settings\r\nHTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA\r\n"
     b"\r\n", H2_PREFACE),
    # (without the Connection option: llhttp reads it as a plain request; closed too)
    (b"GET /v1/models HTTP/1.1\r\nHost: t\r\nUpgrade: websocket\r\n\r\n",
     b"GET /v1/models HTTP/1.1\r\nHost: t\r\n\r\n"),
], ids=["websocket", "h2c", "upgrade-alone"])
def test_an_upgrade_is_answered_as_plain_http_and_the_connection_closed(
        engine: tuple[str, Path], head: bytes, after: bytes) -> None:
    """A request that asks to switch to websocket or h2c: answered in HTTP/1.1 (never
    101), its Upgrade not sent to the engine, the answer saying close and the socket
    closed after it; the other protocol's bytes that follow its head are never read as
    a request."""
    async def main() -> None:
        async with front(engine[0]) as (proxy, _):
            before = len(engine_saw(engine[1]))
            raw = await until_closed(proxy.port, head + after)
            assert status(raw) == 200 and raw.count(b"HTTP/1.1 ") == 1
            answer_head = raw.split(b"\r\n\r\n", 1)[0]
            assert b"Connection: close" in answer_head
            assert b"Upgrade" not in answer_head
            assert engine_saw(engine[1])[before:] == ["GET /v1/models"]

    asyncio.run(main())


def test_an_upgrade_with_a_body_is_refused_and_the_connection_closed(
        engine: tuple[str, Path]) -> None:
    """h2c asked for by a POST with a body: the parser stops at the upgrade's head, so
    the body cannot be framed: 400, closed, nothing sent to the engine (before, it got
    the request with an empty body, and the client a second answer)."""
    async def main() -> None:
        async with front(engine[0]) as (proxy, gate):
            before = engine_saw(engine[1])
            body = completion()
            raw = await until_closed(
                proxy.port, b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nUpgrade: h2c\r\n"
                b"Connection: Upgrade, HTTP2-Settings\r\nHTTP2-Settings: AAMAAABkAARAAAAA"
                b"AAIAAAAA\r\nContent-Length: %d\r\n\r\n%b" % (len(body), body))
            assert status(raw) == 400 and raw.count(b"HTTP/1.1 ") == 1
            assert b"Connection: close" in raw
            assert engine_saw(engine[1]) == before and gate.in_flight == 0

    asyncio.run(main())
