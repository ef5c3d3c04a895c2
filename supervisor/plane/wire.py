"""The wire between the daemon and a proxy worker: one Unix socket pair, messages of a
4-byte length and a pickle (both ends are this program, started by the daemon).

A message is a tuple whose first item names it. Sends are queued and written once per
turn of the event loop, in order, so that a state update sent before a reply is read
before it (`Link.send`); nothing waits for the peer to read.
"""

from __future__ import annotations

import asyncio
import contextlib
import pickle
import struct
from typing import Any

HEADER = struct.Struct("!I")
MAX_MESSAGE = 64 << 20  # a stats snapshot is the largest: kilobytes
READ_SIZE = 1 << 18


class LinkClosed(Exception):
    """The other end went away (its process ended, or it closed the link)."""


class Link:
    """One end of the wire."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._r, self._w = reader, writer
        self._out: list[bytes] = []
        self._flushing = False
        self._buf = bytearray()  # what arrived and is not a whole message yet
        self._inbox: list[tuple[Any, ...]] = []  # (recv's: whole messages not yet taken)

    @classmethod
    async def over(cls, sock: Any) -> Link:
        reader, writer = await asyncio.open_unix_connection(sock=sock)
        return cls(reader, writer)

    @property
    def closed(self) -> bool:
        return self._w.is_closing()

    def send(self, message: tuple[Any, ...]) -> None:
        """Queue `message`; written with the others of this turn of the loop."""
        if self._w.is_closing():
            return  # (the peer is gone: its end cleans up after it)
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        self._out.append(HEADER.pack(len(data)))
        self._out.append(data)
        if not self._flushing:
            self._flushing = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flushing = False
        if self._out and not self._w.is_closing():
            self._w.write(b"".join(self._out))
        self._out.clear()

    async def recv(self) -> tuple[Any, ...]:
        """The next message; raises LinkClosed at the end."""
        while not self._inbox:
            self._inbox.extend(await self.recv_all())
        return self._inbox.pop(0)

    async def recv_all(self) -> list[tuple[Any, ...]]:
        """Every whole message that has arrived (at least one: waits for it); raises
        LinkClosed at the end. One read for many messages: under load a turn of the loop
        brings dozens."""
        buf = self._buf
        while True:
            out: list[tuple[Any, ...]] = []
            at = 0
            while len(buf) - at >= HEADER.size:
                (n,) = HEADER.unpack_from(buf, at)
                if n > MAX_MESSAGE:
                    raise LinkClosed(f"a message of {n} bytes: not this program's")
                if len(buf) - at - HEADER.size < n:
                    break
                message = pickle.loads(memoryview(buf)[at + HEADER.size:at + HEADER.size + n])
                if not isinstance(message, tuple) or not message:
                    raise LinkClosed(f"not a message: {type(message).__name__}")
                out.append(message)
                at += HEADER.size + n
            del buf[:at]
            if out:
                return out
            try:
                data = await self._r.read(READ_SIZE)
            except ConnectionError as exc:
                raise LinkClosed(str(exc) or type(exc).__name__) from None
            if not data:
                raise LinkClosed("end of the link")
            buf += data

    async def close(self) -> None:
        self._flush()
        self._w.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._w.wait_closed(), 1.0)
