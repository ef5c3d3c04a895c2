"""The wire between the daemon and a proxy worker: one Unix socket pair, frames of a
4-byte length and a typed message, compact JSON or packed (`supervisor/plane/codec.py`, the
kinds in `supervisor/plane/messages.py`); nothing read from it can run code.

Each end's first frame is its `Hello`, and nothing from the other end is taken before
its own hello says the same protocol and the same digest of the messages' types. A
frame longer than `MAX_FRAME`, or one that does not read as a message this end takes,
refuses the link: it is logged once (its kind and its size, never its content), the
link closes, and `fault` says why (the daemon then ends that worker and starts it
again: `supervisor/plane/pool.py`).

Sends are queued and written once per turn of the event loop, in order, so that a state
update sent before a reply is read before it (`Link.send`); nothing waits for the peer
to read. What arrives is handed to the end's handler as it is read, every whole message
of a read in turn, in the loop's own callback (no task wakes per message: under load a
read brings dozens); before a handler is set, `recv` takes them one by one.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import socket
import struct
import typing
from collections.abc import Callable, Iterable
from typing import Any, Generic, TypeVar

import structlog

from supervisor.plane import codec
from supervisor.plane.codec import Decoder, WireError
from supervisor.plane.messages import HELLO, HELLO_NOW, Hello

log = structlog.get_logger("supervisor.plane")

HEADER = struct.Struct("!I")
MAX_FRAME = 16 << 20  # the largest is a stats snapshot or the engines' state: kilobytes

In = TypeVar("In")
Out = TypeVar("Out", bound=codec.Message)


def send_all(links: Iterable[Link[Any, Out]], message: Out) -> None:
    """`message` to each of `links`, encoded once (the engines' state, to every worker)."""
    data: bytes | None = None
    for link in links:
        if not link.closed:
            data = data if data is not None else codec.encode(message)
            link._queue(data)


class LinkClosed(Exception):
    """The other end went away (its process ended, or it closed the link)."""


class _Protocol(asyncio.Protocol):
    def __init__(self, link: Link[Any, Any]) -> None:
        self.link = link

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # (a stream socket's: uvloop's is one without deriving from asyncio.Transport)
        self.link._transport = typing.cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.link._received(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self.link._lost(repr(exc) if exc else "end of the link")


class Link(Generic[In, Out]):
    """One end of the wire: it reads the kinds of `decoder`, and sends `Out`s."""

    def __init__(self, decoder: Decoder, **fields: Any) -> None:
        self._decoder = decoder
        self._fields = fields  # on its log lines (the daemon's: which worker)
        self._transport: asyncio.Transport | None = None
        self._out: list[bytes] = []
        self._flushing = False
        self._buf = bytearray()  # what arrived and is not a whole frame yet
        self._greeted = False  # the other end's hello was read, and says our protocol
        self._inbox: collections.deque[In] = collections.deque()  # (before a handler)
        self._handler: Callable[[In], None] | None = None
        self._arrived = asyncio.Event()
        self._closed: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self.fault: WireError | None = None  # what the other end sent that was refused

    @classmethod
    async def over(cls, sock: socket.socket, decoder: Decoder, **fields: Any) -> Link[In, Out]:
        """The link over `sock`, its hello sent; `fields` go on its log lines."""
        link: Link[In, Out] = cls(decoder, **fields)
        await asyncio.get_running_loop().create_unix_connection(lambda: _Protocol(link),
                                                                sock=sock)
        link._queue(codec.encode(HELLO_NOW))
        return link

    @property
    def closed(self) -> bool:
        return self._closed.done()

    def send(self, message: Out) -> None:
        """Queue `message`; written with the others of this turn of the loop."""
        if self._closed.done():
            return  # (the peer is gone: its end cleans up after it)
        self._queue(codec.encode(message))

    def _queue(self, data: bytes) -> None:
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

    def handle_with(self, handler: Callable[[In], None]) -> None:
        """Every message from now on (and those `recv` has not taken) to `handler`, as it
        arrives. A handler's exception is logged; the link goes on."""
        self._handler = handler
        while self._inbox:
            self._dispatch(self._inbox.popleft())

    async def recv(self) -> In:
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
        if self._closed.done():
            return  # (refused: nothing more is read)
        buf = self._buf
        buf += data
        at = 0
        try:
            while len(buf) - at >= HEADER.size:
                (n,) = HEADER.unpack_from(buf, at)
                if n > MAX_FRAME:
                    raise WireError(f"a frame of {n} bytes, more than {MAX_FRAME}", size=n)
                if len(buf) - at - HEADER.size < n:
                    break
                frame = buf[at + HEADER.size:at + HEADER.size + n]  # (a copy)
                at += HEADER.size + n
                if not self._greeted:
                    self._greet(frame)
                    continue
                message = self._decoder.decode(frame)
                if self._handler is not None:
                    self._dispatch(message)
                else:
                    self._inbox.append(message)
                    self._arrived.set()
        except WireError as exc:
            self._refuse(exc)
            return
        del buf[:at]

    def _greet(self, frame: bytearray) -> None:
        try:
            hello: Hello = HELLO.decode(frame)
        except WireError as exc:
            raise WireError(f"no hello first ({exc.why})", exc.kind, exc.size) from None
        if hello != HELLO_NOW:
            log.error("the proxy workers' link refused: the other end speaks another "
                      "protocol (the daemon and its worker run different code: upgraded "
                      "in place?)", protocol=HELLO_NOW.protocol, other=hello.protocol,
                      schema=HELLO_NOW.schema, other_schema=hello.schema, **self._fields)
            raise WireError(f"protocol {hello.protocol} ({hello.schema}), not "
                            f"{HELLO_NOW.protocol} ({HELLO_NOW.schema})", "hello", len(frame))
        self._greeted = True

    def _dispatch(self, message: In) -> None:
        assert self._handler is not None
        try:
            self._handler(message)
        except Exception:
            log.exception("a message on the proxy workers' link failed",
                          message=type(message).__name__, **self._fields)

    def _refuse(self, exc: WireError) -> None:
        """A frame that does not read: the link closes (what follows it is not read)."""
        log.error("the proxy workers' link refused a message, and closed", why=exc.why,
                  kind=exc.kind, size=exc.size, **self._fields)
        self.fault = exc
        self._buf.clear()
        if self._transport is not None:
            self._transport.close()
        self._lost(f"a message refused: {exc.why}")

    def _lost(self, why: str) -> None:
        if not self._closed.done():
            self._closed.set_result(why)
        self._arrived.set()
