"""The codec of the proxy workers' wire (`supervisor/plane/codec.py`, the kinds in
`supervisor/plane/messages.py`), without sockets: every kind each way reads back as it
was written; bytes that are not a message of the kind's types (garbage, a pickle, a cut
body, an unknown kind, a kind of the other way, a field of the wrong type, a count that
does not fit its histogram, a number that is not finite at the daemon) are refused with
a `WireError` that says why and names the kind and size, never the content."""

from __future__ import annotations

import collections.abc
import dataclasses
import json
import pickle
import struct
import types
import typing
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from supervisor.front.admission import GateLimits
from supervisor.front.deadlines import Deadline
from supervisor.front.exchange import ProxySettings
from supervisor.plane import codec, messages
from supervisor.plane.codec import WireError
from supervisor.plane.messages import (
    HELLO,
    TO_DAEMON,
    TO_WORKER,
    Acquire,
    Cancel,
    Counters,
    Done,
    EngineState,
    Hello,
    HistogramCounts,
    Init,
    Ready,
    State,
    Stats,
    added,
)

TO_WORKER_KINDS = typing.get_args(messages.ToWorker)
TO_DAEMON_KINDS = typing.get_args(messages.ToDaemon)


def strategy(tp: Any, finite: bool) -> st.SearchStrategy[Any]:
    """Values of type `tp` as the messages' fields declare them."""
    if tp is int:
        return st.integers(-(2**63), 2**63 - 1)  # (the packed kinds' range)
    if tp is float:
        return st.floats(allow_nan=False, allow_infinity=not finite)
    if tp is str:
        return st.text(max_size=20)
    if tp is bool:
        return st.booleans()
    if tp is HistogramCounts:  # (its counts fit its kind: its own check)
        return st.sampled_from(sorted(messages.BUCKETS)).flatmap(lambda k: st.builds(
            HistogramCounts, st.just(k), st.text(max_size=8),
            st.lists(st.integers(0, 2**40), min_size=messages.BUCKETS[k],
                     max_size=messages.BUCKETS[k]).map(tuple),
            strategy(float, finite), st.integers(0, 2**40)))
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return st.none() | strategy(next(a for a in args if a is not type(None)), finite)
    if origin is tuple and args[-1] is Ellipsis:
        return st.lists(strategy(args[0], finite), max_size=3).map(tuple)
    if origin is tuple:
        return st.tuples(*(strategy(a, finite) for a in args))
    if origin is not None and issubclass(origin, collections.abc.Mapping):
        return st.dictionaries(st.text(max_size=8), strategy(args[1], finite), max_size=3)
    assert dataclasses.is_dataclass(tp), tp
    hints = typing.get_type_hints(tp)
    return st.builds(tp, **{f.name: strategy(hints[f.name], finite)
                            for f in dataclasses.fields(tp)})


def kinds(classes: tuple[type, ...], finite: bool) -> st.SearchStrategy[Any]:
    return st.one_of(*(strategy(c, finite) for c in classes)).filter(
        lambda m: getattr(m, "problem", lambda: None)() is None)


@settings(max_examples=300, deadline=None)  # (a shared machine: no deadline)
@given(kinds(TO_WORKER_KINDS, finite=False))
def test_every_kind_to_a_worker_reads_back_as_written(m: Any) -> None:
    assert TO_WORKER.decode(codec.encode(m)) == m


@settings(max_examples=300, deadline=None)  # (a shared machine: no deadline)
@given(kinds(TO_DAEMON_KINDS, finite=True))
def test_every_kind_to_the_daemon_reads_back_as_written(m: Any) -> None:
    assert TO_DAEMON.decode(codec.encode(m)) == m


def test_each_way_reads_its_own_kinds_only() -> None:
    # (the seventeen of the pickled wire, its "ok" now two: granted and laned)
    assert len(TO_WORKER_KINDS) + len(TO_DAEMON_KINDS) == 18
    assert {c.KIND for c in TO_WORKER_KINDS}.isdisjoint(c.KIND for c in TO_DAEMON_KINDS)
    init = codec.encode(Init(ProxySettings("h", 1, "u"), ()))
    with pytest.raises(WireError, match="does not take") as e:
        TO_DAEMON.decode(init)  # (a worker telling the daemon what the daemon tells it)
    assert (e.value.kind, e.value.size) == ("init", len(init))
    with pytest.raises(WireError, match="does not take"):
        TO_WORKER.decode(codec.encode(Acquire(1, 10, False, -1, "e")))  # (packed: its tag)


def test_the_per_request_kinds_are_packed_and_the_rest_compact_json() -> None:
    assert codec.encode(Done(7)) == b"\x03" + struct.pack("!q", 7)
    assert codec.encode(Acquire(7, 100, True, 40, "é")) == \
        b"\x01" + struct.pack("!qqBq", 7, 100, 1, 40) + "é".encode()
    assert codec.encode(Cancel(7, True)) == b'["cancel",7,true]'
    assert codec.encode(messages.HELLO_NOW) == \
        b'["hello",2,"' + messages.SCHEMA.encode() + b'"]'
    # (a packed kind written as JSON reads too: the form is the writer's choice)
    assert TO_DAEMON.decode(b'["done",7]') == Done(7)


ENGINE = EngineState("e0", "http://x", ("m",), False, True, None, 3, True, ((2, 1.5),), (),
                     GateLimits(), 0, "held", None, None, False, None, 1, 0)


def test_settings_with_deadlines_and_an_engines_state_read_back_typed() -> None:
    s = ProxySettings("127.0.0.1", 8000, "http://x", extra_routes=("/a",),
                      models=("m",), deadlines={"m": Deadline(request_timeout_s=5.0)},
                      idle_read_timeout_s=float("inf"))
    e = ENGINE
    back = TO_WORKER.decode(codec.encode(Init(s, (e,))))
    assert back == Init(s, (e,))
    assert isinstance(back.settings.deadlines["m"], Deadline)
    assert isinstance(back.engines[0].limits, GateLimits)


GARBAGE = {
    "not JSON": b"\xff\xfe{",
    "a pickle": pickle.dumps(("acquire", 1, "e", 1, False)),
    "JSON, not an array": b'{"kind":"done"}',
    "an empty array": b"[]",
    "no kind first": b"[1,2]",
    "too deep": b"[" * 100000,
    "an unknown kind": b'["exec","os.system"]',
    "an unknown packed tag": b"\x1f" + b"\0" * 8,
    "a field short": b'["cancel",1]',
    "a field more": b'["cancel",1,true,3]',
    "a string for an integer": b'["cancel","1",true]',
    "an integer for a boolean": b'["cancel",1,1]',
    "a boolean for an integer": b'["ready",true]',
    "a number for an integer": b'["ready",1.5]',
    "a number not finite": b'["failed","e",1,NaN]',
    "an infinity": b'["failed","e",1,Infinity]',
    "a packed boolean of 2": b"\x01" + struct.pack("!qqBq", 1, 1, 2, -1) + b"e",
    "a packed kind cut short": codec.encode(Done(1))[:-1],
    "a packed kind too long": codec.encode(Done(1)) + b"\0",
    "a packed string not UTF-8": b"\x01" + struct.pack("!qqBq", 1, 1, 0, -1) + b"\xff",
    "a negative token count": codec.encode(Acquire(1, -5, False, -1, "e")),
    "tokens to go below -1": codec.encode(Acquire(1, 5, False, -2, "e")),
    "a JSON body cut short": codec.encode(Stats(Counters(), 3))[:-2],
    "an object with a field missing": b'["stats",{"responses":{}},null]',
    "a histogram of the wrong size": codec.encode(Stats(Counters(), None)).replace(
        b'"latency":[]', b'"latency":[{"kind":"ttft","label":"m","counts":[1],'
                         b'"total":1.0,"n":1}]'),
    "a histogram of no kind": codec.encode(Stats(Counters(), None)).replace(
        b'"latency":[]', b'"latency":[{"kind":"x","label":"m","counts":[],'
                         b'"total":1.0,"n":1}]'),
    "a count that is a string": codec.encode(Stats(Counters(), None)).replace(
        b'"responses":{}', b'"responses":{"200":"many"}'),
}


@pytest.mark.parametrize("what", GARBAGE)
def test_what_is_not_a_message_of_its_types_is_refused_with_a_reason(what: str) -> None:
    data = GARBAGE[what]
    with pytest.raises(WireError) as e:
        TO_DAEMON.decode(data)
    assert e.value.why and e.value.size == len(data)
    # what may be logged of it says nothing of its content beyond a kind's name
    assert "os.system" not in str(e.value) and "many" not in str(e.value)
    assert e.value.kind in ("?", "exec", "cancel", "ready", "failed", "acquire", "done",
                            "stats"), e.value.kind


def test_a_refusal_names_the_field_and_the_types() -> None:
    with pytest.raises(WireError, match=r"granted: expected a boolean, got an integer"):
        TO_DAEMON.decode(b'["cancel",1,1]')
    with pytest.raises(WireError, match=r"counters.responses\[a value\]: expected an integer"):
        TO_DAEMON.decode(GARBAGE["a count that is a string"])
    with pytest.raises(WireError, match=r"3 fields, cancel has 2"):
        TO_DAEMON.decode(GARBAGE["a field more"])
    with pytest.raises(WireError, match=r"counters.latency\[0\]: a ttft histogram of 1 "):
        TO_DAEMON.decode(GARBAGE["a histogram of the wrong size"])
    with pytest.raises(WireError, match=r"engines\[1\].failure_seen\[0\]\[1\]: expected a "
                                        r"number, got a string"):
        e = json.loads(codec.encode(State((ENGINE, ENGINE))))
        e[1][1]["failure_seen"] = [[2, "soon"]]
        TO_WORKER.decode(json.dumps(e).encode())


@settings(deadline=None)
@given(st.binary(max_size=64))
def test_any_bytes_read_as_a_message_or_are_refused_never_otherwise(data: bytes) -> None:
    try:
        m = TO_DAEMON.decode(data)
    except WireError:
        return
    assert isinstance(m, TO_DAEMON_KINDS)


@settings(deadline=None)
@given(kinds(TO_DAEMON_KINDS, finite=True), st.data())
def test_a_json_body_cut_anywhere_is_refused(m: Any, data: st.DataObject) -> None:
    body = codec.encode(m)
    if body[0] < 0x20:
        # (packed: its length is the frame's; cut in its fixed part, refused; its string
        # runs to the frame's end, which only the frame's length says: wire.py)
        n = data.draw(st.integers(0, codec._Packed(type(m), type(m).TAG).size - 1))
    else:
        n = data.draw(st.integers(0, len(body) - 1))
    with pytest.raises(WireError):
        TO_DAEMON.decode(body[:n])


def test_the_hello_says_the_version_and_anything_else_first_is_no_hello() -> None:
    assert HELLO.decode(codec.encode(Hello(7, "x"))) == Hello(7, "x")
    for first in (codec.encode(Ready(1)), b'["hello","1","x"]', b'["hello",1]',
                  b'["hello",1,"x",2]', b"\x80"):
        with pytest.raises(WireError):
            HELLO.decode(first)


def test_the_schema_digest_changes_with_any_field_of_any_part() -> None:
    @dataclasses.dataclass(frozen=True)
    class Limits:
        concurrency: int

    @dataclasses.dataclass(frozen=True)
    class Wider:
        concurrency: int
        tokens: int

    def kind(part: type) -> type:
        return dataclasses.make_dataclass("K", [("limits", part)], frozen=True,
                                          namespace={"KIND": "k"})

    assert codec.schema([kind(Limits)]) == codec.schema([kind(Limits)])
    assert codec.schema([kind(Limits)]) != codec.schema([kind(Wider)])
    assert len(messages.SCHEMA) == 16


def test_the_counters_of_ended_workers_add_up_into_one() -> None:
    def h(kind: str, label: str, counts: list[int], total: float, n: int) -> HistogramCounts:
        return HistogramCounts(kind, label, tuple(counts + [0] * (messages.BUCKETS[kind]
                                                                  - len(counts))), total, n)

    a = Counters(responses={"200": 3}, continuations={"continued": 1}, retried_connects=2,
                 cpu_s=1.5, latency=(h("ttft", "m", [1, 2], 0.5, 3),))
    b = Counters(responses={"200": 1, "503": 4}, rejections={"queue_full": 4}, cpu_s=0.5,
                 latency=(h("ttft", "m", [0, 1, 1], 2.0, 2), h("duration", "m", [1], 0.1, 1)))
    out = added(added(Counters(), a), b)
    assert out.responses == {"200": 4, "503": 4} and out.rejections == {"queue_full": 4}
    assert out.continuations == {"continued": 1} and out.retried_connects == 2
    assert out.cpu_s == 2.0
    assert set(out.latency) == {h("ttft", "m", [1, 3, 1], 2.5, 5),
                                h("duration", "m", [1], 0.1, 1)}


def test_a_message_is_written_as_strictly_as_it_is_read() -> None:
    """What the writer's types do not allow does not leave it (JSON cannot carry it)."""
    with pytest.raises(TypeError):
        codec.encode(Cancel(1, object()))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="buckets"):
        HistogramCounts("ttft", "m", (1,), 1.0, 1)
    json.loads(codec.encode(Stats(Counters(), None)))  # (plain JSON: any reader reads it)
