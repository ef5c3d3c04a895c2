"""The reading side of one client connection (`supervisor/front/connection.py`): the
bytes parsed as they come by httptools' C request parser, whose callbacks these are;
where the parser is (`Phase`), the request being parsed (its target, its header fields,
the few the server reads itself, its body), and the bounds of what it may send: its
line, its fields, its head and trailers, its body's framing, the bodies held by every
connection together.

It hands each request to its connection (`Receiver`) as its head is in, and its body as
it comes; it never answers, never times anything and never decides what is served: a
request that breaks a rule is refused by the connection (`Receiver.refuse`).
"""

from __future__ import annotations

from typing import Protocol

import httptools

from supervisor.front import conformance
from supervisor.front.connection_states import Phase
from supervisor.front.limits import Limits
from supervisor.front.messages import Connection as Answering
from supervisor.front.messages import Request


class Budget(Protocol):
    """The request bodies held by every connection of a server together (`Server`)."""

    buffered: int


class Receiver(Protocol):
    """What a reader hands its requests to (`connection.Connection`)."""

    stopped: bool

    @property
    def sender(self) -> Answering: ...  # (what its requests are answered through)

    def begun(self) -> None: ...
    def head_in(self, req: Request, body: bool) -> None: ...
    def body_came(self, req: Request) -> None: ...
    def parsed(self, req: Request | None) -> None: ...
    def refuse(self, status: int, message: str, reason: str = "bad_http") -> None: ...
    def stop_reading(self) -> None: ...


class Reader:
    """One connection's bytes, parsed: the parser's callbacks and their bounds."""

    def __init__(self, receiver: Receiver, budget: Budget, limits: Limits) -> None:
        self._receiver = receiver
        self._budget = budget
        self.limits = limits
        self.parser = httptools.HttpRequestParser(self)
        self.phase = Phase.IDLE
        # the request being parsed: its target and headers so far, and its bytes
        self._messages = 0  # requests begun on this connection
        self._url = b""
        self._fields: list[tuple[bytes, bytes]] = []
        self._expect: str | None = None  # its Expect field's value
        self._length = 0  # its Content-Length
        self._hosts = 0
        self._codings: list[str] = []  # its Transfer-Encoding values
        self._named: list[str] = []  # its Connection values
        self._upgrade = False  # it had an Upgrade field
        self._trailers_next = False  # a chunk's size line came, none of its data since
        self._trailer_bytes = 0  # read since, with no data: the last chunk's trailers
        self._head_bytes = 0  # of its head and trailers, as parsed
        self._raw_bytes = 0  # of its head, or of its body's framing, as read
        self._body_in = 0  # body bytes parsed on this connection
        self._body_from = 0  # where the body being parsed began in that count
        self.parsing: Request | None = None

    def feed(self, data: bytes) -> bool:
        """Bytes read, parsed; whether the read ended in a body (its clock starts
        again)."""
        receiver = self._receiver
        phase, messages, body_in = self.phase, self._messages, self._body_in
        in_trailers = self._trailers_next
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            # (answered as a plain request that closes the connection: what follows its
            # head is not read; `conformance.upgrade_problem`)
            receiver.stop_reading()
            return False
        except httptools.HttpParserError as exc:
            # (an exception in a callback comes out as the parser's, the cause inside)
            if isinstance(why := exc.__context__, _Refused):
                receiver.refuse(why.status, why.message, why.reason)
            elif receiver.stopped:
                pass  # bytes after `Connection: close`: ignored (RFC 9112 9.6)
            else:
                receiver.refuse(400, f"malformed request: {exc}")
            return False
        # A read wholly inside one request's head, or one body's framing and trailers,
        # counts whole (what the parser holds but has not handed over yet: a field
        # still coming); one across a boundary is counted by the parser's callbacks.
        if self.phase is phase and self._messages == messages:
            if in_trailers and self._trailers_next and self._body_in == body_in:
                # a read past the last chunk's size line: trailers, bounded as a head
                # whatever the body's size (the read that held that line not counted)
                self._trailer_bytes += len(data)
                if self._trailer_bytes > self.limits.max_head:
                    receiver.refuse(431, "request trailer section too large")
                    return False
            if phase is Phase.HEAD:
                self._raw_bytes += len(data)
                if self._raw_bytes > self.limits.max_head:
                    receiver.refuse(431, "request header section too large")
            elif phase is Phase.BODY:
                self._raw_bytes += len(data) - (self._body_in - body_in)
                # (chunk sizes and their line ends: a quarter of the body is ample)
                allowed = self.limits.max_head + ((self._body_in - self._body_from) >> 2)
                if self._raw_bytes > allowed:
                    receiver.refuse(400, "chunk framing or trailers too large")
        return self.phase is Phase.BODY

    # ---- the parser's callbacks ---------------------------------------------------

    def on_message_begin(self) -> None:
        self.phase = Phase.HEAD
        self._messages += 1
        self._url = b""
        self._fields = []
        self._expect = None
        self._length = 0
        self._hosts = 0
        self._codings = []
        self._named = []
        self._upgrade = self._trailers_next = False
        self._head_bytes = 0
        self._raw_bytes = 0
        self._receiver.begun()

    def on_url(self, url: bytes) -> None:
        self._url += url
        self._head_bytes += len(url)
        if len(self._url) > self.limits.max_line:
            raise _Refused(414, "request target too long")

    def on_header(self, name: bytes, value: bytes) -> None:
        if len(name) + len(value) > self.limits.max_field:
            raise _Refused(431, "request header field too large")
        self._head_bytes += len(name) + len(value) + 4
        if self._head_bytes > self.limits.max_head:
            raise _Refused(431, "request header section too large")
        if self.phase is not Phase.HEAD:
            return  # a trailer field: counted, and dropped (RFC 9110 6.5.1)
        # (as aiohttp decoded them, and as the upstream client encodes them: the bytes
        # sent on are the bytes that came, less the whitespace around the value that
        # llhttp leaves at its end: RFC 9112 5)
        if value[-1:] in b" \t":
            value = value.rstrip(b" \t")
        self._fields.append((name, value))  # (decoded if read: `Headers`)
        if len(name) in _READ_HERE:  # (the few the server reads itself, found cheaply)
            low = name.lower()
            if low == b"expect":
                if self._expect is None:  # (the first, as `Headers.get` finds it)
                    self._expect = value.decode("utf-8", "surrogateescape")
            elif low == b"content-length" and value.strip().isdigit():
                self._length = int(value)
            elif low == b"host":
                self._hosts += 1
            elif low == b"transfer-encoding":
                self._codings.append(value.decode("latin-1"))
            elif low == b"connection":
                self._named.append(value.decode("latin-1"))
            elif low == b"upgrade":
                self._upgrade = True

    def on_headers_complete(self) -> None:
        p = self.parser
        v = p.get_http_version()
        if (problem := conformance.head_problem(v, self._hosts, self._codings)) is not None:
            raise _Refused(*problem)
        self.phase = Phase.BODY
        self._raw_bytes = 0
        self._body_from = self._body_in
        fields = self._fields
        if self._named and (named := conformance.connection_named(self._named)):
            fields = conformance.without(fields, named)
        version = (1, 1) if v == "1.1" else (1, 0)
        method = p.get_method().decode("latin-1")
        keep_alive = p.should_keep_alive()
        if self._upgrade or p.should_upgrade():  # (CONNECT, or a switch asked for)
            if p.should_upgrade() and (problem := conformance.upgrade_problem(
                    method, bool(self._length or self._codings))) is not None:
                raise _Refused(*problem)
            keep_alive = False  # answered as a plain request, then closed
        req = Request(self._receiver.sender, method,
                      self._url.decode("utf-8", "surrogateescape"), version, fields,
                      keep_alive, self._expect)
        req._expect_continue = version == (1, 1) and self._expect is not None \
            and self._expect.strip().lower() == "100-continue"
        if self._length > self.limits.max_body:
            req.too_large = True  # (known now: the handler need not wait for it)
        elif self._length and self._budget.buffered + self._length > self.limits.max_buffered:
            raise _Refused(503, _OVER_BUDGET, "body_budget")
        self.parsing = req
        self._receiver.head_in(req, bool(self._length or self._codings))

    def on_chunk_header(self) -> None:
        self._trailers_next, self._trailer_bytes = True, 0

    def on_body(self, body: bytes) -> None:
        self._body_in += len(body)
        self._trailers_next = False
        req = self.parsing
        if req is None:
            return
        budget = self._budget
        budget.buffered += req._add_body(body, self.limits.max_body)
        if budget.buffered > self.limits.max_buffered:
            raise _Refused(503, _OVER_BUDGET, "body_budget")
        self._receiver.body_came(req)

    def on_message_complete(self) -> None:
        self.phase = Phase.IDLE
        self._trailers_next = False
        req, self.parsing = self.parsing, None
        self._receiver.parsed(req)


# the lengths of the header names the server reads itself (Host, Expect, Upgrade,
# Connection, Content-Length, Transfer-Encoding)
_READ_HERE = frozenset((4, 6, 7, 10, 14, 17))


_OVER_BUDGET = "request bodies held here are over proxy.max_buffered_bytes; try again"


class _Refused(Exception):
    """Raised in a parser's callback: the request is refused with this status."""

    def __init__(self, status: int, message: str, reason: str = "bad_http") -> None:
        super().__init__(message)
        self.status, self.message, self.reason = status, message, reason
