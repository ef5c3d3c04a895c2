"""What the front door's HTTP/1.1 fuzz tests share (tests/test_server_fuzz*.py): the pair
of servers on a thread and loop of their own (`front`, module-scoped: one pair per test
module), h11 as the reference reader of requests and the reader of answers, blocking
sockets under deadlines, and the strategies of valid requests (1-4 pipelined on one
connection, written in random pieces)."""


from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import socket
import string
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import h11
from hypothesis import strategies as st

from supervisor.front.messages import BodyTooLarge, Request, StreamResponse, json_response
from supervisor.front.server import Limits, Server

DEADLINE_S = 10.0  # for any one answer, or a start; only reached when something is wrong
QUICK_S = 0.25  # the quick server's head, body and idle deadlines: an unfinished
# (mutated) request is refused, a finished connection closed, this soon
DIFFERENTIAL_EXAMPLES = 100
MUTATED_EXAMPLES = 150

# ---- the servers --------------------------------------------------------------------


@dataclasses.dataclass
class Seen:
    """A request as a handler (ours) or h11 got it."""

    method: str
    target: str
    headers: list[tuple[str, str]]
    body: bytes | None = None  # None: never read whole


class Front:
    """Two servers on one loop, in a thread of their own: `patient` (nginx's deadlines) for
    the differential test, `quick` (deadlines of QUICK_S, small limits) for mutated
    requests, which may leave one unfinished. Their handler records what it got, by the
    client's port, and echoes it as JSON; the loop's exception handler records any error
    that escaped a protocol callback or a task."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seen: dict[int, list[Seen]] = {}
        self.loop_errors: list[str] = []
        self.patient_port = 0
        self.quick_port = 0
        self._started = threading.Event()
        self._failed: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, name="front", daemon=True)

    def start(self) -> None:
        self._thread.start()
        if not self._started.wait(DEADLINE_S):
            raise RuntimeError("the servers did not start")
        if self._failed is not None:
            raise self._failed

    def stop(self) -> None:
        loop, stop = self._loop, self._stop
        if loop is not None and stop is not None:
            loop.call_soon_threadsafe(stop.set)
        self._thread.join(DEADLINE_S)
        assert not self._thread.is_alive(), "the servers did not stop"
        if self._failed is not None:
            raise self._failed

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def seen(self, port: int) -> list[Seen]:
        with self._lock:
            return [dataclasses.replace(s) for s in self._seen.get(port, [])]

    def forget(self, port: int) -> None:
        with self._lock:
            self._seen.pop(port, None)

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as exc:
            self._failed = exc
            self._started.set()

    async def _main(self) -> None:
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(self._loop_error)
        self._loop, self._stop = loop, asyncio.Event()
        patient = Server(self._echo, Limits(max_line=8190, max_field=8190, max_body=1 << 20))
        quick = Server(self._echo, Limits(
            max_line=2048, max_field=2048, max_body=4096, header_timeout_s=QUICK_S,
            body_timeout_s=QUICK_S, idle_timeout_s=QUICK_S, send_timeout_s=DEADLINE_S))
        await patient.listen("127.0.0.1", 0)
        await quick.listen("127.0.0.1", 0)
        self.patient_port, self.quick_port = patient.port, quick.port
        self._started.set()
        try:
            await self._stop.wait()
        finally:
            await patient.close(shutdown_s=1.0)
            await quick.close(shutdown_s=1.0)

    def _loop_error(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        with self._lock:
            self.loop_errors.append(f"{context.get('message')}: {context.get('exception')!r}")

    async def _echo(self, request: Request) -> StreamResponse:
        assert request.transport is not None
        port = int(request.transport.get_extra_info("peername")[1])
        seen = Seen(request.method, request.raw_path, list(request.headers.items()))
        with self._lock:
            self._seen.setdefault(port, []).append(seen)
        try:
            body = await request.read()
        except BodyTooLarge:
            return json_response({"error": "too large"}, status=413, headers={"X-Echo": "1"})
        with self._lock:
            seen.body = body
        return json_response({"method": seen.method, "target": seen.target,
                              "headers": seen.headers, "body": body.hex()},
                             headers={"X-Echo": "1"})


def serving() -> Iterator[Front]:
    """The pair of servers for one test module (its `front` fixture): started, then
    stopped with no error left in their loop."""
    f = Front()
    f.start()
    yield f
    f.stop()
    assert f.loop_errors == []


# ---- h11: the reference reader of requests, and the reader of answers -----------------


@dataclasses.dataclass
class Verdict:
    """How h11, as a server, reads some bytes: its whole requests, in order (up to one
    that closes the connection), then the error it refused the next with, or whether a
    request was left unfinished."""

    requests: list[Seen]
    error: str | None
    unfinished: bool


def h11_reads(data: bytes) -> Verdict:
    conn = h11.Connection(h11.SERVER)
    conn.receive_data(data)
    whole: list[Seen] = []
    current: Seen | None = None
    while True:
        try:
            event = conn.next_event()
        except h11.RemoteProtocolError as exc:
            return Verdict(whole, str(exc), True)
        if event is h11.NEED_DATA or event is h11.PAUSED:
            return Verdict(whole, None, current is not None or bool(conn.trailing_data[0]))
        if isinstance(event, h11.Request):
            current = Seen(event.method.decode("latin-1"), event.target.decode("latin-1"),
                           [(k.decode("latin-1"), v.decode("latin-1"))
                            for k, v in event.headers.raw_items()], b"")
        elif isinstance(event, h11.Data):
            assert current is not None and current.body is not None
            current.body += bytes(event.data)
        elif isinstance(event, h11.EndOfMessage):
            assert current is not None
            whole.append(current)
            current = None
            conn.send(h11.Response(status_code=200, headers=[("Content-Length", "0")]))
            conn.send(h11.EndOfMessage())
            if conn.our_state is not h11.DONE or conn.their_state is not h11.DONE:
                return Verdict(whole, None, False)  # (what follows a close is not read)
            conn.start_next_cycle()


@dataclasses.dataclass
class Answer:
    status: int
    headers: list[tuple[bytes, bytes]]
    body: bytes = b""

    def header(self, name: bytes) -> bytes | None:
        return next((v for k, v in self.headers if k.lower() == name), None)

    @property
    def from_handler(self) -> bool:
        return self.header(b"x-echo") == b"1"

    @property
    def closes(self) -> bool:
        return (self.header(b"connection") or b"").lower() == b"close"


class Answers:
    """What the server wrote on one connection, read as it comes by h11 as a client: whole
    responses in order. A byte h11 cannot read as part of one (a status line inside a
    body, bytes after a `Connection: close` answer, a truncated answer) fails the test."""

    def __init__(self, tolerate_after_close: bool = False) -> None:
        self._conn = h11.Connection(h11.CLIENT)
        self.raw = b""
        self.whole: list[Answer] = []
        self.informational: list[int] = []
        self._partial: Answer | None = None
        self.closed = False  # the server closed the connection (FIN)
        self.reset = False  # ... or reset it (what it wrote last may be lost)
        # KNOWN_BUG_REFUSAL_AFTER_CLOSE: the bytes after a `Connection: close` answer read
        # as answers still (and the case noted), instead of failing the test
        self.tolerate_after_close = tolerate_after_close
        self.after_close: list[Answer] = []
        self._consumed = 0  # bytes of `raw` read into whole answers
        # KNOWN_BUG_CUT_AFTER_CONTINUE: a close after `100 Continue` and no final answer
        self.cut_after_continue = False
        self._interim = False  # the answer under way is a 100 so far

    def feed(self, data: bytes) -> None:
        self.raw += data
        self._conn.receive_data(data)
        while True:
            # (h11 reads an answer only to a request it sent: one is made up for each)
            if self._conn.our_state is h11.IDLE and self._conn.trailing_data[0]:
                self._conn.send(h11.Request(method="GET", target="/", headers=[("Host", "t")]))
                self._conn.send(h11.EndOfMessage())
            try:
                event = self._conn.next_event()
            except h11.ProtocolError as exc:
                if self.tolerate_after_close and self._conn.their_state is h11.ERROR \
                        and str(exc) == "Got data when expecting EOF":
                    self._conn = h11.Connection(h11.CLIENT)
                    self.after_close.append(self.whole[-1])
                    self._conn.receive_data(self.raw[self._consumed:])
                    continue
                if not data and self._interim and self._conn.their_state is h11.ERROR:
                    self.closed = self.cut_after_continue = True
                    return
                raise AssertionError(f"not whole HTTP/1.1 answers ({exc}): {self.raw!r}") \
                    from None
            if event is h11.NEED_DATA or event is h11.PAUSED:
                return
            if isinstance(event, h11.InformationalResponse):
                self.informational.append(event.status_code)
                self._interim = True
            elif isinstance(event, h11.Response):
                self._interim = False
                self._partial = Answer(event.status_code, list(event.headers.raw_items()))
            elif isinstance(event, h11.Data):
                assert self._partial is not None
                self._partial.body += bytes(event.data)
            elif isinstance(event, h11.EndOfMessage):
                assert self._partial is not None
                self.whole.append(self._partial)
                self._partial = None
                self._consumed = len(self.raw) - len(self._conn.trailing_data[0])
                if self._conn.our_state is h11.DONE and self._conn.their_state is h11.DONE:
                    self._conn.start_next_cycle()
            elif isinstance(event, h11.ConnectionClosed):
                self.closed = True
                return


def connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=DEADLINE_S)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def write_in_pieces(sock: socket.socket, data: bytes, cuts: list[int]) -> None:
    """`data` in one write per piece (cut at `cuts`); a server that closed first ends it."""
    edges = [0, *sorted(set(cuts)), len(data)]
    for a, b in itertools.pairwise(edges):
        try:
            sock.sendall(data[a:b])
        except (BrokenPipeError, ConnectionResetError):
            return


def read_answers(sock: socket.socket, answers: Answers,
                 enough: Callable[[Answers], bool]) -> None:
    """Reads until the server closes the connection, or `enough`; DEADLINE_S at most."""
    end = time.monotonic() + DEADLINE_S
    while not (answers.closed or answers.reset or enough(answers)):
        left = end - time.monotonic()
        if left <= 0:
            raise AssertionError(f"no end to the answers in {DEADLINE_S} s: {answers.raw!r}")
        sock.settimeout(left)
        try:
            data = sock.recv(65536)
        except TimeoutError:
            continue
        except ConnectionResetError:
            answers.reset = True
            return
        answers.feed(data)


def probe(front: Front, port: int) -> None:
    """A plain request on a new connection is served: nothing before broke the server.
    (A 408 is the quick server's deadline met on a loaded machine: asked again.)"""
    for _ in range(3):
        assert front.alive
        with connect(port) as sock:
            sock.sendall(b"GET /probe?x=1 HTTP/1.1\r\nHost: probe\r\nConnection: close\r\n\r\n")
            answers = Answers()
            read_answers(sock, answers, lambda a: False)
        assert answers.closed and len(answers.whole) == 1, answers.raw
        if answers.whole[0].status != 408:
            break
    assert answers.whole[0].status == 200, answers.raw
    assert json.loads(answers.whole[0].body)["target"] == "/probe?x=1"
    assert front.loop_errors == []


# ---- valid requests -------------------------------------------------------------------

METHODS = ("GET", "POST", "PUT", "DELETE")
TOKEN = string.ascii_letters + string.digits + "!#$%&'*+-.^_`|~"
VCHAR = "".join(map(chr, range(0x21, 0x7F)))
PCHAR = string.ascii_letters + string.digits + "-._~!$&'()*+,;=:@"
# fields the parsers or the server read themselves: drawn on purpose, never at random
SPECIAL = frozenset(("host", "content-length", "transfer-encoding", "connection",
                     "proxy-connection", "expect", "upgrade", "keep-alive"))
CONNECTION_OPTIONS = frozenset(("close", "keep-alive", "upgrade"))


def spellings(name: str) -> st.SearchStrategy[str]:
    return st.sampled_from((name, name.lower(), name.upper()))


escape = st.tuples(st.integers(0, 255), st.booleans()).map(
    lambda e: f"%{e[0]:02X}" if e[1] else f"%{e[0]:02x}")
segment = st.lists(st.sampled_from(PCHAR) | escape, max_size=8).map("".join)
query = st.lists(st.sampled_from(PCHAR + "/?") | escape, max_size=16).map("".join)
targets = st.tuples(st.lists(segment, min_size=1, max_size=4), st.none() | query).map(
    lambda pq: "/" + "/".join(pq[0]) + ("" if pq[1] is None else "?" + pq[1]))
hosts = st.sampled_from(("example.com", "127.0.0.1:8000", "[::1]:80", "a", "x.y-z.local"))
names = st.text(TOKEN, min_size=1, max_size=12).filter(lambda n: n.lower() not in SPECIAL)


@st.composite
def values(draw: st.DrawFn) -> str:
    """A field value: visible ASCII words, spaces and tabs between (none at its ends)."""
    words = draw(st.lists(st.text(VCHAR, min_size=1, max_size=8), max_size=3))
    return draw(st.sampled_from((" ", "\t", "  "))).join(words) if len(words) > 1 \
        else "".join(words)


@dataclasses.dataclass
class Wire:
    """One request as its bytes: the head's lines (each with its end of line, the blank
    line last) and its framed body; `data` is the body unframed, `chunked` its framing."""

    head: list[bytes]
    body: bytes
    data: bytes
    chunked: bool

    def render(self) -> bytes:
        return b"".join(self.head) + self.body

    def field_lines(self) -> range:
        return range(1, len(self.head) - 1)


@st.composite
def chunked_body(draw: st.DrawFn, data: bytes) -> bytes:
    cuts = sorted(set(draw(st.lists(st.integers(1, max(1, len(data) - 1)), max_size=5))))
    edges = [0, *(c for c in cuts if c < len(data)), len(data)]
    out = b""
    for a, b in itertools.pairwise(edges):
        if a == b:
            continue
        size = f"{b - a:x}"
        size = draw(st.sampled_from((size, size.upper(), "0" + size)))
        ext = draw(st.sampled_from(("", ";a=b", ";x", ';n="q v"')))
        out += f"{size}{ext}\r\n".encode() + data[a:b] + b"\r\n"
    out += b"0" + draw(st.sampled_from((b"", b";last"))) + b"\r\n"
    for name, value in draw(st.lists(st.tuples(names, values()), max_size=2)):
        out += f"{name}: {value}\r\n".encode()
    return out + b"\r\n"


@st.composite
def requests(draw: st.DrawFn, may_close: bool = False, fields_most: int = 8,
             body_most: int = 300) -> Wire:
    """A valid HTTP/1.1 request: a Host field, 0-8 others, a body framed by Content-Length
    or chunked (or none), perhaps `Expect: 100-continue`, perhaps a Connection field
    naming some of its fields (and `close`, where `may_close`)."""
    method = draw(st.sampled_from(METHODS))
    target = draw(targets)
    fields = [(name, draw(values())) for name in draw(st.lists(names, max_size=fields_most))]
    fields.append((draw(spellings("Host")), draw(hosts)))
    framing = draw(st.sampled_from(("none", "length", "chunked")))
    data = b"" if framing == "none" else draw(st.binary(max_size=body_most))
    if framing == "length":
        fields.append((draw(spellings("Content-Length")), str(len(data))))
    elif framing == "chunked":
        fields.append((draw(spellings("Transfer-Encoding")), "chunked"))
    if data and draw(st.booleans()):
        fields.append((draw(spellings("Expect")), "100-continue"))
    options = ["keep-alive", "x-absent", *(n for n, _ in fields[:-1])]
    named = draw(st.lists(st.sampled_from(options), max_size=3))
    if may_close and draw(st.booleans()):
        named.append("close")
    if named:
        fields.append((draw(spellings("Connection")), ", ".join(named)))
    fields = draw(st.permutations(fields))
    head = [f"{method} {target} HTTP/1.1\r\n".encode()]
    for name, value in fields:
        ows = draw(st.sampled_from(("", " ", " ", "\t", "  ")))
        head.append(f"{name}:{ows}{value}\r\n".encode())
    head.append(b"\r\n")
    if framing == "chunked":
        return Wire(head, draw(chunked_body(data)), data, True)
    return Wire(head, data, data, False)


@st.composite
def pipelines(draw: st.DrawFn, most: int = 4, fields_most: int = 8) -> list[Wire]:
    """1 to `most` requests for one connection; only the last may say `close`."""
    n = draw(st.integers(1, most))
    return [draw(requests(i == n - 1, fields_most, 300 if fields_most > 4 else 64))
            for i in range(n)]


def cut_points(size: int) -> st.SearchStrategy[list[int]]:
    return st.lists(st.integers(1, max(1, size - 1)), max_size=6)


def connection_named(headers: list[tuple[str, str]]) -> set[str]:
    return {n for k, v in headers if k.lower() == "connection"
            for t in v.split(",") if (n := t.strip().lower()) and n not in CONNECTION_OPTIONS}


def as_echoed(req: Seen) -> dict[str, Any]:
    """What the echo handler answers to `req` as h11 read it: the fields its Connection
    names dropped (RFC 9110 7.6.1); its trailers are apart in h11 and dropped in ours."""
    named = connection_named(req.headers)
    return {"method": req.method, "target": req.target,
            "headers": [[k, v] for k, v in req.headers if k.lower() not in named],
            "body": (req.body or b"").hex()}
