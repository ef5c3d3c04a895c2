"""The front door's HTTP/1.1 server (`supervisor/front/server.py`) against generated
requests, over real loopback sockets, with h11 as the reference reader:

- differential: valid HTTP/1.1 requests (1-4 pipelined on one connection, written in
  random pieces) read by h11 as a server and by ours, whose handler echoes as JSON what it
  got: the two agree on every request (method, target, header fields in order, body), and
  ours answers each, in order;
- property: such requests mutated (bytes flipped, inserted, deleted; fields doubled; odd
  whitespace, bare LF, obs-fold, NUL; huge lengths and chunk sizes; Content-Length with
  Transfer-Encoding): whatever ours writes reads (h11 as a client) as whole responses in
  order, never a status line inside another; a refusal is a 4xx/5xx that closes; the
  loop never fails and a new connection is served after; and no handler reads a body
  whose framing h11 refuses, nor sees a head whose framing is ambiguous.

One module-scoped pair of servers on a thread and loop of their own; the examples talk to
them with blocking sockets under deadlines (no sleeps).
"""

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
import pytest
from hypothesis import HealthCheck, given, settings
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


@pytest.fixture(scope="module")
def front() -> Iterator[Front]:
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


# ---- the differential test --------------------------------------------------------------


@settings(max_examples=DIFFERENTIAL_EXAMPLES, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow])  # (generation is the cost)
@given(data=st.data())
def test_valid_pipelined_requests_read_as_h11_reads_them_and_are_answered_in_order(
        front: Front, data: st.DataObject) -> None:
    wires = data.draw(pipelines())
    raw = b"".join(w.render() for w in wires)
    cuts = data.draw(cut_points(len(raw)))
    verdict = h11_reads(raw)
    assert verdict.error is None and not verdict.unfinished, verdict  # (valid: h11 says)
    assert len(verdict.requests) == len(wires)
    with connect(front.patient_port) as sock:
        port = sock.getsockname()[1]
        front.forget(port)
        write_in_pieces(sock, raw, cuts)
        answers = Answers()
        read_answers(sock, answers,  # (to the close, where the last request asks for it)
                     lambda a: len(a.whole) >= len(wires) and not a.whole[-1].closes)
    assert [a.status for a in answers.whole] == [200] * len(wires), answers.raw
    assert all(a.from_handler for a in answers.whole)
    got = [json.loads(a.body) for a in answers.whole]
    for i, (ours, h11s) in enumerate(zip(got, verdict.requests, strict=True)):
        assert ours == as_echoed(h11s), f"request {i} of {raw!r}"
    assert set(answers.informational) <= {100}
    last_closes = "close" in {t.strip().lower() for k, v in verdict.requests[-1].headers
                              if k.lower() == "connection" for t in v.split(",")}
    assert [a.closes for a in answers.whole] == [False] * (len(wires) - 1) + [last_closes]
    assert answers.closed == last_closes
    front.forget(port)


# ---- what the generated requests found (each fixed since; kept as tests) ---------------

# A request refused (400) while one before it on the connection is still being answered
# (both in one read): the answer before it says `Connection: close` (the refusal set
# `closing`), and the refusal is written after it all the same, a response after the
# close that a client reads as garbage (h11: "Got data when expecting EOF").
KNOWN_BUG_REFUSAL_AFTER_CLOSE = b"GET /a HTTP/1.1\r\nHost: a\r\n\r\nX\r\n\r\n"


def test_a_request_refused_behind_an_answer_is_no_answer_after_a_close(front: Front) -> None:
    with connect(front.patient_port) as sock:
        sock.sendall(KNOWN_BUG_REFUSAL_AFTER_CLOSE)  # (one write: one read by the server)
        answers = Answers()
        read_answers(sock, answers, lambda a: False)
    assert answers.closed
    assert answers.whole[0].status == 200 and not answers.whole[0].closes
    assert [a.status for a in answers.whole[1:]] == [400] and not answers.after_close


# A request refused (400 for its chunks, 408 for its body's deadline) after the server
# answered its `Expect: 100-continue` with `100 Continue`: the connection is closed with no
# final answer (`_refuse` counts the interim answer as an answer begun, and cuts), where
# RFC 9110 15.2.1 wants one (nothing stops a final answer following an interim one).
KNOWN_BUG_CUT_AFTER_CONTINUE = (b"POST / HTTP/1.1\r\nHost: a\r\nExpect: 100-continue\r\n"
                                b"Transfer-Encoding: chunked\r\n\r\n", b"zz\r\n\r\n")


def test_a_body_refused_after_100_continue_is_answered_400(front: Front) -> None:
    head, body = KNOWN_BUG_CUT_AFTER_CONTINUE
    with connect(front.patient_port) as sock:
        sock.sendall(head)
        answers = Answers()
        read_answers(sock, answers, lambda a: a.informational == [100])
        sock.sendall(body)  # (after the 100: the handler waits for it)
        read_answers(sock, answers, lambda a: False)
    assert not answers.cut_after_continue
    assert [a.status for a in answers.whole] == [400] and answers.closed


# A field value with whitespace at its end: the handler gets the whitespace as part of the
# value (llhttp hands it over; the server keeps it, and the proxy sends it on), where RFC
# 9112 5 excludes it ("OWS ... is excluded by parsers when extracting the field line
# value"); h11 strips it. (Leading whitespace is stripped by both.)
KNOWN_BUG_TRAILING_WHITESPACE = (b"GET / HTTP/1.1\r\nHost: a\r\nX-Pad: v \t\r\n"
                                 b"Connection: close\r\n\r\n")


def test_a_field_value_is_read_without_its_trailing_whitespace(front: Front) -> None:
    (h11s,) = h11_reads(KNOWN_BUG_TRAILING_WHITESPACE).requests
    with connect(front.patient_port) as sock:
        sock.sendall(KNOWN_BUG_TRAILING_WHITESPACE)
        answers = Answers()
        read_answers(sock, answers, lambda a: False)
    assert [a.status for a in answers.whole] == [200], answers.raw
    assert json.loads(answers.whole[0].body) == as_echoed(h11s)


# ---- mutated requests -------------------------------------------------------------------

Mutation = Callable[[st.DataObject, Wire], None]


def _field(data: st.DataObject, w: Wire) -> int | None:
    lines = w.field_lines()
    return data.draw(st.sampled_from(lines)) if lines else None


def dup_field(data: st.DataObject, w: Wire) -> None:
    if (j := _field(data, w)) is not None:
        w.head.insert(j, w.head[j])


def odd_whitespace(data: st.DataObject, w: Wire) -> None:
    if (j := _field(data, w)) is None:
        return
    name, _, rest = w.head[j].partition(b":")
    w.head[j] = data.draw(st.sampled_from((
        name + b" :" + rest, name + b"\t:" + rest, b" " + w.head[j], b"\t" + w.head[j],
        name[:1] + b" " + name[1:] + b":" + rest, name + b":\x0b" + rest,
        name + b":" + rest[:-2] + b" \r\n", name + b":" + rest[:-2] + b"\t\t\r\n",
        name + b":" + rest[:-2] + b"\x0c\r\n")))


def line_ends(data: st.DataObject, w: Wire) -> None:
    j = data.draw(st.integers(0, len(w.head) - 1))
    if w.head[j].endswith(b"\r\n"):
        end = data.draw(st.sampled_from((b"\n", b"\r", b"\r\r\n", b"\n\r", b"")))
        w.head[j] = w.head[j][:-2] + end


def obs_fold(data: st.DataObject, w: Wire) -> None:
    if (j := _field(data, w)) is not None:
        w.head.insert(j + 1, data.draw(st.sampled_from((b" folded\r\n", b"\tx y\r\n",
                                                        b" \r\n", b" Host: evil\r\n"))))


def _set_field(w: Wire, name: bytes, value: bytes, replace: bool) -> None:
    line = name + b": " + value + b"\r\n"
    for j in w.field_lines():
        if replace and w.head[j].lower().startswith(name.lower() + b":"):
            w.head[j] = line
            return
    w.head.insert(len(w.head) - 1, line)


def content_length(data: st.DataObject, w: Wire) -> None:
    n = len(w.data)
    value = data.draw(st.sampled_from((
        b"99999999999999999999999", b"18446744073709551616", b"18446744073709551615",
        b"-1", b"+%d" % n, b"0x%x" % n, b"%d %d" % (n, n), b"%d, %d" % (n, n),
        b"%d,%d" % (n, n + 1), b" %d" % n, b"", b"1e3", b"%d" % (n + 1), b"%d" % max(0, n - 1),
        b"0" * 16 + b"%d" % n, b"%d\x00" % n)))
    _set_field(w, b"Content-Length", value, replace=data.draw(st.booleans()))


def transfer_encoding(data: st.DataObject, w: Wire) -> None:
    value = data.draw(st.sampled_from((
        b"chunked", b"gzip, chunked", b"chunked, gzip", b"Chunked", b"chunked, chunked",
        b"identity", b"xchunked", b"chunked\x00", b"chunked;q=1", b",chunked", b"chunk")))
    _set_field(w, b"Transfer-Encoding", value, replace=data.draw(st.booleans()))


def chunk_framing(data: st.DataObject, w: Wire) -> None:
    """The body as broken chunks (and the head saying chunked, if it did not)."""
    d = w.data or b"x"
    n = len(d)
    w.body = data.draw(st.sampled_from((
        b"FFFFFFFFFFFFFFFFFFFFFFFF\r\n" + d + b"\r\n0\r\n\r\n",
        b"10000000000000000\r\n" + d + b"\r\n0\r\n\r\n",
        b"-1\r\n" + d + b"\r\n0\r\n\r\n",
        b"0x%x\r\n" % n + d + b"\r\n0\r\n\r\n",
        b"%x %x\r\n" % (n, n) + d + b"\r\n0\r\n\r\n",
        b" %x\r\n" % n + d + b"\r\n0\r\n\r\n",
        b"%x \r\n" % n + d + b"\r\n0\r\n\r\n",
        b"%x\n" % n + d + b"\n0\n\n",
        b"%x\r\n" % (n + 1) + d + b"\r\n0\r\n\r\n",
        b"%x\r\n" % max(1, n - 1) + d + b"\r\n0\r\n\r\n",
        b"%x\r\n" % n + d + b"0\r\n\r\n",
        b"%x\r\n" % n + d + b"XX0\r\n\r\n",
        b"%x;" % n + b"e" * 20000 + b"\r\n" + d + b"\r\n0\r\n\r\n",
        b"0" * 16 + b"%x\r\n" % n + d + b"\r\n0\r\n\r\n",
        b"%x\r\n" % n + d + b"\r\n0\r\n",
        b"%x\r\n" % n + d + b"\r\n0\r\nContent-Length: 5\r\n\r\n",
        b"%x\r\n" % n + d + b"\r\n0\r\nX: y\r\n folded\r\n\r\n",
        b"%x\r\n" % n + d + b"\r\n0\r\nX y\r\n\r\n",
        b"%x\r\n" % n + d + b"\r\n0\r\n\x00: y\r\n\r\n",
        b"%x\r\n" % n + d + b"\r\n0\r\nGET /smuggled HTTP/1.1\r\nHost: t\r\n\r\n",
    )))
    if not w.chunked:
        _set_field(w, b"Transfer-Encoding", b"chunked", replace=False)
        w.chunked = True


def nul_byte(data: st.DataObject, w: Wire) -> None:
    j = data.draw(st.integers(0, len(w.head) - 2))
    at = data.draw(st.integers(0, max(0, len(w.head[j]) - 2)))
    w.head[j] = w.head[j][:at] + b"\x00" + w.head[j][at:]


def request_line(data: st.DataObject, w: Wire) -> None:
    method, _, rest = w.head[0].rstrip(b"\r\n").partition(b" ")
    target, _, _version = rest.partition(b" ")
    what = data.draw(st.sampled_from(("version", "method", "target")))
    if what == "version":
        version = data.draw(st.sampled_from((
            b"HTTP/1.0", b"HTTP/2.0", b"HTTP/1.2", b"HTTP/11", b"", b"http/1.1", b"HTTP/1.1 ",
            b"HTTP/1.1\t", b"HTTP/0.9", b"HTTP/9.9", b"HTTP/1")))
        w.head[0] = method + b" " + target + (b" " + version if version else b"") + b"\r\n"
    elif what == "method":
        method = data.draw(st.sampled_from((b"get", b"G ET", b"GE\x00T", b"", b"GET\t",
                                             b"P(S)T", b"POST  ")))
        w.head[0] = method + b" " + target + b" HTTP/1.1\r\n"
    else:
        at = data.draw(st.integers(0, len(target)))
        bad = data.draw(st.sampled_from((b" ", b"\x7f", b"#", b"\xff", b"\t", b"%", b"\x00",
                                         b" HTTP/1.1\r\n")))
        w.head[0] = method + b" " + target[:at] + bad + target[at:] + b" HTTP/1.1\r\n"


def host_fields(data: st.DataObject, w: Wire) -> None:
    hosts = [j for j in w.field_lines() if w.head[j].lower().startswith(b"host:")]
    if data.draw(st.booleans()):
        for j in reversed(hosts):
            del w.head[j]
    else:
        _set_field(w, b"Host", data.draw(st.sampled_from((b"other", b"", b"a b"))), False)


def close_early(data: st.DataObject, w: Wire) -> None:
    _set_field(w, b"Connection", b"close", replace=False)


MUTATIONS: tuple[Mutation, ...] = (
    dup_field, odd_whitespace, line_ends, obs_fold, content_length, transfer_encoding,
    chunk_framing, nul_byte, request_line, host_fields, close_early)
INSERTS = (b"\r", b"\n", b"\r\n", b"\x00", b" ", b"\t", b":", b",", b";", b"0", b"9", b"f",
           b"\x7f", b"\x80", b"\xff", b"HTTP/1.1 200 OK\r\n", b"\r\n\r\n")


def mutate_bytes(data: st.DataObject, raw: bytes) -> bytes:
    at = data.draw(st.integers(0, len(raw) - 1))
    how = data.draw(st.sampled_from(("flip", "insert", "delete", "truncate")))
    if how == "flip":
        return raw[:at] + bytes([raw[at] ^ data.draw(st.integers(1, 255))]) + raw[at + 1:]
    if how == "insert":
        return raw[:at] + data.draw(st.sampled_from(INSERTS)) + raw[at:]
    if how == "delete":
        return raw[:at] + raw[at + data.draw(st.integers(1, 8)):]
    return raw[:at]


# h11's refusals of a request's framing: in its head (what Content-Length and
# Transfer-Encoding say), and in its body (the chunks)
HEAD_FRAMING = ("conflicting Content-Length", "bad Content-Length",
                "multiple Transfer-Encoding", "Only Transfer-Encoding: chunked")
BODY_FRAMING = ("illegal chunk header", "malformed chunk footer")


def framing_is_plain(req: Seen) -> bool:
    """One Content-Length of digits, or Transfer-Encoding `chunked` alone (its empty list
    elements ignored, RFC 9110 5.6.1: h11 is stricter there); never both."""
    lengths = [v.strip() for k, v in req.headers if k.lower() == "content-length"]
    codings = [c.strip().lower() for k, v in req.headers if k.lower() == "transfer-encoding"
               for c in v.split(",") if c.strip()]
    if lengths and codings:
        return False
    if lengths:
        return len(lengths) == 1 and lengths[0].isdigit()
    return codings in ([], ["chunked"])


@settings(max_examples=MUTATED_EXAMPLES, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow])  # (generation is the cost)
@given(data=st.data())
def test_mutated_requests_get_whole_answers_in_order_or_a_refusal_that_closes(
        front: Front, data: st.DataObject) -> None:
    wires = data.draw(pipelines(most=3, fields_most=3))  # (fewer draws: the mutations
    # are what this test is about)
    for _ in range(data.draw(st.integers(1, 3))):
        w = data.draw(st.sampled_from(wires))
        data.draw(st.sampled_from(MUTATIONS))(data, w)
    raw = b"".join(w.render() for w in wires)
    for _ in range(data.draw(st.integers(0, 2))):
        raw = mutate_bytes(data, raw) or raw
    cuts = data.draw(cut_points(len(raw)))
    verdict = h11_reads(raw)

    with connect(front.quick_port) as sock:
        port = sock.getsockname()[1]
        front.forget(port)
        write_in_pieces(sock, raw, cuts)
        answers = Answers(tolerate_after_close=True)  # (to name the case if it comes back)

        def settled(a: Answers) -> bool:
            """All that h11 read whole is answered, and nothing else is under way: the
            server would only wait (QUICK_S) for more; other cases read to the close."""
            n = len(verdict.requests)
            if a.whole and a.whole[-1].closes:  # (read to the close, which comes at once,
                # but after a 413: the rest of a refused body is read for LINGER_S first)
                return a.whole[-1].from_handler and a.whole[-1].status == 413
            return verdict.error is None and not verdict.unfinished \
                and len(a.whole) == n and all(x.from_handler for x in a.whole) \
                and len(front.seen(port)) == n

        read_answers(sock, answers, settled)
    seen = front.seen(port)
    front.forget(port)

    # what came back: the handler's answers, in the order of its requests, then at most
    # one refusal, a 4xx/5xx that closes the connection
    assert set(answers.informational) <= {100}, answers.raw
    handled = [a for a in answers.whole if a.from_handler]
    assert answers.whole[:len(handled)] == handled, answers.raw
    assert len(handled) <= len(seen)
    for a, s in zip(handled, seen, strict=False):
        if a.status == 413:
            assert s.body is None
            continue
        assert a.status == 200, answers.raw
        echo = json.loads(a.body)
        assert (echo["method"], echo["target"]) == (s.method, s.target), answers.raw
        assert bytes.fromhex(echo["body"]) == s.body
    refusals = answers.whole[len(handled):]
    assert len(refusals) <= 1, answers.raw
    for a in refusals:
        assert 400 <= a.status <= 599 and a.closes, answers.raw
        assert json.loads(a.body)["error"]["code"] == a.status
        assert answers.closed or answers.reset, answers.raw
    assert not answers.cut_after_continue, answers.raw  # (KNOWN_BUG_CUT_AFTER_CONTINUE)
    assert not answers.after_close, answers.raw  # (KNOWN_BUG_REFUSAL_AFTER_CLOSE)
    if any(a.closes for a in answers.whole) and not any(
            a.status == 413 for a in handled):  # (a refused body lingers: LINGER_S)
        assert answers.closed or answers.reset, answers.raw

    # what reached the handler: never an ambiguous framing, never a body h11 refuses
    assert all(framing_is_plain(s) for s in seen), seen
    if verdict.error is not None:
        ok = len(verdict.requests)
        if verdict.error.startswith(HEAD_FRAMING):  # (what h11 reads as ambiguous: only
            # where RFC 9112 reads it one way, h11 stricter, as the plain check above says)
            assert len(seen) <= ok or all(framing_is_plain(s) for s in seen[ok:]), (
                verdict, seen, raw)
        if verdict.error.startswith(BODY_FRAMING):
            assert sum(s.body is not None for s in seen) <= ok, (verdict, seen, raw)

    probe(front, front.quick_port)
