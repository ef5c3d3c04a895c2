"""The wire between the daemon and a proxy worker: one Unix socket pair, messages of a
4-byte length and a pickle (both ends are this program, started by the daemon).

A message is a tuple whose first item names it. Sends are queued and written once per
turn of the event loop, in order, so that a state update sent before a reply is read
before it (`Link.send`); nothing waits for the peer to read. What arrives is handed to
the end's handler as it is read, every whole message of a read in turn, in the loop's
own callback (no task wakes per message: under load a read brings dozens); before a
handler is set, `recv` takes them one by one.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import pickle
import struct
from collections.abc import Callable
from typing import Any

import structlog

log = structlog.get_logger("supervisor.plane")

HEADER = struct.Struct("!I")
MAX_MESSAGE = 64 << 20  # a stats snapshot is the largest: kilobytes

Message = tuple[Any, ...]


class LinkClosed(Exception):
    """The other end went away (its process ended, or it closed the link)."""


class _Protocol(asyncio.Protocol):
    def __init__(self, link: Link) -> None:
        self.link = link

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.link._transport = transport  # type: ignore[assignment]  # (uvloop's own)

    def data_received(self, data: bytes) -> None:
        self.link._received(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self.link._lost(repr(exc) if exc else "end of the link")


class Link:
    """One end of the wire."""

    def __init__(self) -> None:
        self._transport: asyncio.Transport | None = None
        self._out: list[bytes] = []
        self._flushing = False
        self._buf = bytearray()  # what arrived and is not a whole message yet
        self._inbox: collections.deque[Message] = collections.deque()  # (before a handler)
        self._handler: Callable[[Message], None] | None = None
        self._arrived = asyncio.Event()
        self._closed: asyncio.Future[str] = asyncio.get_running_loop().create_future()

    @classmethod
    async def over(cls, sock: Any) -> Link:
        link = cls()
        await asyncio.get_running_loop().create_unix_connection(lambda: _Protocol(link),
                                                                sock=sock)
        return link

    @property
    def closed(self) -> bool:
        return self._closed.done()

    def send(self, message: Message) -> None:
        """Queue `message`; written with the others of this turn of the loop."""
        if self._closed.done():
            return  # (the peer is gone: its end cleans up after it)
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        self._out.append(HEADER.pack(len(data)))
        self._out.append(data)
        if not self._flushing:
            self._flushing = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flushing = False
        if self._out and self._transport is not None and not self._closed.done():
            self._transport.write(b"".join(self._out))
        self._out.clear()

    def handle_with(self, handler: Callable[[Message], None]) -> None:
        """Every message from now on (and those `recv` has not taken) to `handler`, as it
        arrives. A handler's exception is logged; the link goes on."""
        self._handler = handler
        while self._inbox:
            self._dispatch(self._inbox.popleft())

    async def recv(self) -> Message:
        """The next message (before a handler is set); raises LinkClosed at the end."""
        while not self._inbox:
            if self._closed.done():
                raise LinkClosed(self._closed.result())
            self._arrived.clear()
            await self._arrived.wait()  # (set by a message and by the end)
        return self._inbox.popleft()

    async def wait_closed(self) -> str:
        """Until the other end goes away: why."""
        return await asyncio.shield(self._closed)

    async def close(self) -> None:
        self._flush()
        if self._transport is not None:
            self._transport.close()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(self._closed), 1.0)

    def _received(self, data: bytes) -> None:
        buf = self._buf
        buf += data
        at = 0
        while len(buf) - at >= HEADER.size:
            (n,) = HEADER.unpack_from(buf, at)
            if n > MAX_MESSAGE or len(buf) - at - HEADER.size < n:
                break
            try:
                message = pickle.loads(memoryview(buf)[at + HEADER.size:at + HEADER.size + n])
            except Exception as exc:  # (not this program's: the link is closed)
                self._bad(f"a message that does not read: {exc!r}")
                return
            at += HEADER.size + n
            if not isinstance(message, tuple) or not message:
                self._bad(f"not a message: {type(message).__name__}")
                return
            if self._handler is not None:
                self._dispatch(message)
            else:
                self._inbox.append(message)
                self._arrived.set()
        del buf[:at]
        if len(buf) >= HEADER.size and HEADER.unpack_from(buf, 0)[0] > MAX_MESSAGE:
            self._bad(f"a message of {HEADER.unpack_from(buf, 0)[0]} bytes")

    def _dispatch(self, message: Message) -> None:
        assert self._handler is not None
        try:
            self._handler(message)
        except Exception:
            log.exception("a message on the proxy workers' link failed",
                          message=str(message[0])[:40])

    def _bad(self, why: str) -> None:
        log.error("the proxy workers' link closed", why=why)
        if self._transport is not None:
            self._transport.close()
        self._lost(why)

    def _lost(self, why: str) -> None:
        if not self._closed.done():
            self._closed.set_result(why)
        self._arrived.set()
