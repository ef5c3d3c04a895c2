"""The front door's HTTP/1.1 server (`supervisor/front/server.py`) against mutated
requests, over real loopback sockets, with h11 as the reference reader (the servers,
readers and strategies: tests/http_fuzz.py): valid requests mutated (bytes flipped,
inserted, deleted; fields doubled; odd whitespace, bare LF, obs-fold, NUL; huge lengths
and chunk sizes; Content-Length with Transfer-Encoding): whatever ours writes reads (h11
as a client) as whole responses in order, never a status line inside another; a refusal
is a 4xx/5xx that closes; the loop never fails and a new connection is served after; and
no handler reads a body whose framing h11 refuses, nor sees a head whose framing is
ambiguous.
"""


from __future__ import annotations

import json
from collections.abc import Callable, Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.http_fuzz import (
    MUTATED_EXAMPLES,
    Answers,
    Front,
    Seen,
    Wire,
    connect,
    cut_points,
    h11_reads,
    pipelines,
    probe,
    read_answers,
    serving,
    write_in_pieces,
)


@pytest.fixture(scope="module")
def front() -> Iterator[Front]:
    yield from serving()


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
