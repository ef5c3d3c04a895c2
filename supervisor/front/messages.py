"""The front door's requests and answers, as its server (`supervisor/front/server.py`)
hands them to the proxy's handler and writes them: a `Request` (its line and headers at
once, its body when read), and a `Response` (a whole answer: head and body in one write,
with its length) or a `StreamResponse` (written as it comes: HTTP/1.1 chunks, or for an
HTTP/1.0 client the bytes as they are and the connection closed at the end).

The shapes are aiohttp's where the proxy used those (`prepare`, `write`, `write_eof`,
`prepared`, `headers.add`), so that the proxy's code reads as it did.
"""

from __future__ import annotations

import asyncio
import contextlib
import email.utils
import json
import re
import time
from typing import Any, Protocol

import structlog

log = structlog.get_logger("supervisor")

# what may be written as one header field (RFC 9110 5.1, 5.5): a name of token characters,
# a value with no control character but a tab (a CR or LF would end the field, or the
# head, where the writer did not mean to: a response split)
_ONE = r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+: [^\x00-\x08\x0a-\x1f\x7f]*"
_FIELD = re.compile(_ONE + r"\Z")
# (every field at once, as they are joined: one match a head, with `_fields_ok`'s count
# of line ends, which tells a separator from a CR LF inside a value)
_FIELDS = re.compile(rf"{_ONE}(?:\r\n{_ONE})*\Z")
_REASON = re.compile(r"[^\x00-\x08\x0a-\x1f\x7f]*\Z")


class Connection(Protocol):
    """What a request and its answer use of their connection (`server.Connection`)."""

    loop: asyncio.AbstractEventLoop
    peer: str | None
    transport: asyncio.Transport | None
    closing: bool
    lost: bool

    def write(self, data: bytes) -> None: ...
    def write_interim(self, data: bytes) -> None: ...
    async def send(self, data: bytes) -> None: ...
    def send_nowait(self, data: bytes) -> bool: ...
    async def drain(self) -> None: ...

_NO_BODY_STATUS = frozenset((204, 304))
REASONS = {200: "OK", 400: "Bad Request", 403: "Forbidden", 404: "Not Found",
            408: "Request Timeout", 413: "Payload Too Large", 414: "URI Too Long",
            417: "Expectation Failed", 431: "Request Header Fields Too Large",
            499: "Client Closed Request", 500: "Internal Server Error",
            501: "Not Implemented", 502: "Bad Gateway", 503: "Service Unavailable",
            505: "HTTP Version Not Supported"}


class BodyTooLarge(Exception):
    pass


class Headers:
    """A request's header fields in their order, names as sent; `get` ignores case. Kept
    as the bytes that came (what the proxy sends on, `forward`), decoded only when read
    (as aiohttp decoded them: UTF-8, surrogates for the rest)."""

    __slots__ = ("_items", "raw")

    def __init__(self, raw: list[tuple[bytes, bytes]]) -> None:
        self.raw = raw
        self._items: list[tuple[str, str]] | None = None

    def get(self, name: str, default: str | None = None) -> str | None:
        low = name.lower()
        for k, v in self.items():
            if k.lower() == low:
                return v
        return default

    def items(self) -> list[tuple[str, str]]:
        if self._items is None:
            self._items = [(k.decode("utf-8", "surrogateescape"),
                            v.decode("utf-8", "surrogateescape")) for k, v in self.raw]
        return self._items

    def forward(self, hop_by_hop: frozenset[bytes], hop_lengths: frozenset[int]) -> bytes:
        """The fields but the hop-by-hop ones (lower-case names; `hop_lengths`: their
        lengths, so that most names are passed by their length alone), as header lines,
        byte for byte as they came."""
        return b"".join([k + b": " + v + b"\r\n" for k, v in self.raw
                         if len(k) not in hop_lengths or k.lower() not in hop_by_hop])


class ResponseHeaders:
    """An answer's header fields, in order: `add` one, or set one (replacing any of that
    name)."""

    __slots__ = ("items",)

    def __init__(self, items: dict[str, str] | None = None) -> None:
        self.items: list[tuple[str, str]] = list(items.items()) if items else []

    def add(self, name: str, value: str) -> None:
        self.items.append((name, value))

    def __setitem__(self, name: str, value: str) -> None:
        low = name.lower()
        self.items = [(k, v) for k, v in self.items if k.lower() != low]
        self.items.append((name, value))

    def get(self, name: str) -> str | None:
        low = name.lower()
        return next((v for k, v in self.items if k.lower() == low), None)


class Request:
    """One request: its line and headers at once, its body when the handler reads it."""

    __slots__ = ("_body", "_conn", "_done", "_expect_continue", "_held", "_size", "_waiter",
                 "expect", "headers", "keep_alive", "method", "raw_path", "too_large",
                 "version")

    def __init__(self, conn: Connection, method: str, raw_path: str,
                 version: tuple[int, int], headers: list[tuple[bytes, bytes]],
                 keep_alive: bool, expect: str | None = None) -> None:
        self._conn = conn
        self.method = method
        self.raw_path = raw_path  # the target exactly as sent
        self.version = version
        self.headers = Headers(headers)
        self.expect = expect  # its Expect field's value, if it had one
        self.keep_alive = keep_alive
        self._body: list[bytes] = []
        self._size = 0  # body bytes that came
        self._held = 0  # of those, kept in memory (the server's budget counts them)
        self._done = False
        self._waiter: asyncio.Future[None] | None = None
        self.too_large = False
        self._expect_continue = False

    @property
    def remote(self) -> str | None:
        return self._conn.peer

    @property
    def transport(self) -> asyncio.Transport | None:
        return self._conn.transport

    async def read(self) -> bytes:
        """The whole body; `BodyTooLarge` past the server's limit."""
        if self._expect_continue and not self._done and not self.too_large:
            self._expect_continue = False
            self._conn.write_interim(b"HTTP/1.1 100 Continue\r\n\r\n")
        while not self._done and not self.too_large:
            self._waiter = self._conn.loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        if self.too_large:
            raise BodyTooLarge()
        if len(self._body) != 1:
            self._body = [b"".join(self._body)]
        return self._body[0]

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _add_body(self, data: bytes, limit: int) -> int:
        """Body bytes as they come; how many more are held in memory (fewer, once the
        body is over `limit`: what it had is dropped)."""
        self._size += len(data)
        if self.too_large:
            return 0
        if self._size > limit:
            self.too_large = True
            self._body.clear()
            dropped, self._held = self._held, 0
            self._wake()
            return -dropped
        self._body.append(data)
        self._held += len(data)
        return len(data)

    def _drop_body(self) -> int:
        """The request is over (or its client gone): its body leaves the server's count
        (and memory, if nobody else holds it). How many bytes it held."""
        self._body = []
        held, self._held = self._held, 0
        return held

    def _complete(self) -> None:
        self._done = True
        self._wake()


class StreamResponse:
    """An answer written as it comes: its head at `prepare`, then `write`s (HTTP/1.1
    chunks; for an HTTP/1.0 client the bytes as they are, the connection closed at the
    end), ended by `write_eof`."""

    def __init__(self, status: int = 200, reason: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        self.status = status
        self.reason = reason or REASONS.get(status, "")
        self.headers = ResponseHeaders(headers)
        self.prepared = False
        self._conn: Connection | None = None
        self._request: Request | None = None
        self._chunked = False
        self._bodyless = False
        self._ended = False
        self._held_head: bytes | None = None  # the head, held for the first bytes
        self._head_timer: asyncio.TimerHandle | None = None

    def _head(self, request: Request, framing: str | None) -> bytes:
        conn = self._conn
        assert conn is not None
        keep = request.keep_alive and not conn.closing and not request.too_large \
            and not (framing is None and not self._bodyless)
        request.keep_alive = keep
        reason = self.reason if _REASON.match(self.reason) else REASONS.get(self.status, "")
        lines = [f"HTTP/1.1 {self.status} {reason}"]
        fields = [f"{k}: {v}" for k, v in self.headers.items]
        if not _fields_ok(fields):
            fields = _writable(fields)
        lines += fields
        if framing is not None:
            lines.append(framing)
        if self.headers.get("date") is None:
            lines.append(date_header())
        if not keep:
            lines.append("Connection: close")
        elif request.version == (1, 0):
            lines.append("Connection: keep-alive")
        lines.append("\r\n")
        return "\r\n".join(lines).encode("utf-8", "surrogateescape")

    async def prepare(self, request: Request, hold_s: float = 0.0) -> None:
        """The head, written; or (`hold_s`, a chunked answer) held to go with the body's
        first bytes in one write, for at most `hold_s` (a stream's head and its first
        event: one system call a request fewer, and the head no later than that)."""
        if self.prepared:
            return
        self.prepared = True
        conn = self._conn = request._conn
        self._request = request
        self._bodyless = request.method == "HEAD" or self.status in _NO_BODY_STATUS \
            or self.status < 200
        self._chunked = not self._bodyless and request.version >= (1, 1)
        head = self._head(request, "Transfer-Encoding: chunked" if self._chunked else None)
        if hold_s > 0 and self._chunked:
            if conn.lost:
                raise ConnectionResetError("the client went away")
            self._held_head = head
            self._head_timer = conn.loop.call_later(hold_s, self._send_head)
            return
        await conn.send(head)

    def _send_head(self) -> None:
        """The held head, alone: no body came within its hold (or the answer ends)."""
        self._head_timer = None
        head, self._held_head = self._held_head, None
        if head is not None and self._conn is not None and not self._conn.lost:
            with contextlib.suppress(ConnectionError):
                self._conn.send_nowait(head)

    def _with_head(self, data: bytes) -> bytes:
        head, self._held_head = self._held_head, None
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        return head + data if head is not None else data

    async def write(self, data: bytes) -> None:
        if not self.write_nowait(data):
            await self.drain()

    def write_nowait(self, data: bytes) -> bool:
        """`write` without waiting (a stream's events, one per engine step): the bytes
        buffered for the client now; False when its buffer is full, and the writer must
        `await drain()` before the next."""
        conn = self._conn
        assert conn is not None, "write before prepare"
        if self._ended:
            raise RuntimeError("a write after the answer's end")
        if self._bodyless or not data:
            if conn.lost:
                raise ConnectionResetError("the client went away")
            return True
        if self._chunked:
            data = b"%x\r\n%b\r\n" % (len(data), data)
            if self._held_head is not None:
                data = self._with_head(data)
        return conn.send_nowait(data)

    def end_nowait(self, data: bytes) -> bool:
        """The answer's last bytes and its end, in one write (a stream's [DONE] event and
        the chunked body's terminator: one system call a request fewer); as
        `write_nowait`, then `write_eof` has nothing left to do."""
        conn = self._conn
        assert conn is not None, "write before prepare"
        if self._ended:
            raise RuntimeError("a write after the answer's end")
        if self._bodyless or not self._chunked:
            ok = self.write_nowait(data)
            self._ended = True  # (an HTTP/1.0 client's end is the connection's)
            return ok
        self._ended = True
        return conn.send_nowait(self._with_head(
            b"%x\r\n%b\r\n0\r\n\r\n" % (len(data), data) if data else b"0\r\n\r\n"))

    async def drain(self) -> None:
        assert self._conn is not None, "drain before prepare"
        await self._conn.drain()

    async def write_eof(self) -> None:
        if self._ended:
            return
        self._ended = True
        conn = self._conn
        assert conn is not None and self._request is not None
        if self._chunked:
            await conn.send(self._with_head(b"0\r\n\r\n"))


class Response(StreamResponse):
    """A whole answer: head and body in one write, with its length."""

    def __init__(self, status: int = 200, reason: str | None = None, body: bytes = b"",
                 text: str | None = None, content_type: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(status, reason, headers)
        if text is not None:
            body = text.encode()
            content_type = content_type or "text/plain; charset=utf-8"
        if content_type is not None:
            self.headers["Content-Type"] = content_type
        self.body = body

    async def prepare(self, request: Request, hold_s: float = 0.0) -> None:
        self.prepared = True  # (its head goes with its body, at write_eof)
        self._conn, self._request = request._conn, request

    async def write(self, data: bytes) -> None:
        raise RuntimeError("a whole answer is written by write_eof")

    async def write_eof(self) -> None:
        if self._ended:
            return
        self._ended = True
        request, conn = self._request, self._conn
        assert request is not None and conn is not None
        bodyless = self.status in _NO_BODY_STATUS or self.status < 200
        head = self._head(request, None if bodyless else f"Content-Length: {len(self.body)}")
        send = head if bodyless or request.method == "HEAD" else head + self.body
        await conn.send(send)


def _fields_ok(fields: list[str]) -> bool:
    """Whether each field can be written as it is (`_FIELD`), in one pass over them."""
    if not fields:
        return True
    block = "\r\n".join(fields)
    return block.count("\n") == len(fields) - 1 and _FIELDS.match(block) is not None


def _writable(fields: list[str]) -> list[str]:
    """The header fields that can be written as they are; each other one left out, and
    said (its name, never its value: it may be anything an engine sent)."""
    kept = []
    for f in fields:
        if _FIELD.match(f):
            kept.append(f)
        else:
            log.warning("an answer's header field was not written: a name that is not a "
                        "token, or a control character in its value",
                        field=repr(f.partition(":")[0][:100]))
    return kept


def json_response(doc: Any, status: int = 200,
                  headers: dict[str, str] | None = None) -> Response:
    return Response(status, body=json.dumps(doc).encode(), content_type="application/json",
                    headers=headers)


_date_cache: tuple[int, str] = (0, "")


def date_header() -> str:
    global _date_cache
    now = int(time.time())
    if _date_cache[0] != now:
        _date_cache = (now, "Date: " + email.utils.formatdate(now, usegmt=True))
    return _date_cache[1]
