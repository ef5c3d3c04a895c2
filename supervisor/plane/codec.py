"""The codec of the wire between the daemon and its proxy workers: typed messages as
compact JSON, the per-request ones packed, read back strictly; it cannot run code.

A message is a frozen dataclass with a `KIND` (`supervisor/plane/messages.py`). It is
written as one JSON array, its kind first and then its fields in their order
(`["cancel",12,true]`); a dataclass inside a message (the settings, an engine's state,
the counters) as a JSON object of its fields. A class with a `TAG` (the messages of
every request: `acquire`, `granted`, `done`) is packed instead (`_Packed`: a tag byte
under 0x20, where JSON's "[" is 0x5b, then its fields at fixed places), several times
cheaper each way. No field is bytes (were one added, it would go as base64 text).
Floats go as Python's JSON writes them (`Infinity` included: a config may say `inf`); a
reader may refuse the non-finite ones (the daemon does, from its workers: they have none
to send).

Reading is strict, as the sender's own types say (`typing.get_type_hints`, compiled once
per class): the kind must be one the reader accepts, the array as long as the message's
fields, every field of its declared type (an integer is not a boolean, a string not a
number, an object has exactly its fields), and a message's own `problem()`, where it has
one, must find nothing. Anything else raises `WireError`, which says why and what may be
logged of the frame: its kind and its size, never its content (a field's name and
place, never its value or an object's key).
"""

from __future__ import annotations

import collections.abc
import dataclasses
import hashlib
import json
import math
import operator
import struct
import types
import typing
from collections.abc import Callable, Iterable
from typing import Any, ClassVar, Protocol

Decode = Callable[[Any], Any]  # the JSON value -> the field's value (raises _Wrong)
Encode = Callable[[Any], Any]  # the field's value -> what JSON writes


class WireError(Exception):
    """A frame refused: why (never its content), its kind when it names one, its size."""

    def __init__(self, why: str, kind: str = "?", size: int = 0) -> None:
        super().__init__(why)
        self.why, self.kind, self.size = why, kind, size


class _Wrong(Exception):
    """A value not of its field's type; `path` is where, filled in on the way out (no
    path is built while a message reads well)."""

    def __init__(self, what: str) -> None:
        self.what, self.path = what, collections.deque[str]()

    def at(self, segment: str) -> _Wrong:
        self.path.appendleft(segment)
        return self

    def __str__(self) -> str:
        return "".join(self.path).lstrip(".") + ": " + self.what


class Message(Protocol):
    KIND: ClassVar[str]


def _json_type(v: object) -> str:
    names = {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
             list: "an array", dict: "an object", type(None): "null"}
    return names.get(type(v), type(v).__name__)


def _wrong(what: str, v: object) -> _Wrong:
    return _Wrong(f"expected {what}, got {_json_type(v)}")


def _int(v: Any) -> int:
    if type(v) is not int:
        raise _wrong("an integer", v)
    return v


def _float(v: Any) -> float:
    if type(v) is float:
        return v
    if type(v) is int:
        return float(v)
    raise _wrong("a number", v)


def _str(v: Any) -> str:
    if type(v) is not str:
        raise _wrong("a string", v)
    return v


def _bool(v: Any) -> bool:
    if type(v) is not bool:
        raise _wrong("a boolean", v)
    return v


def _none(v: Any) -> None:
    if v is not None:
        raise _wrong("null", v)


SCALARS: dict[Any, Decode] = {int: _int, float: _float, str: _str, bool: _bool,
                              type(None): _none}
# the JSON types each scalar takes, for an array or object of them checked at once
_ALL: dict[Any, set[type]] = {int: {int}, float: {float, int}, str: {str}, bool: {bool}}


def decoder(tp: Any) -> Decode:
    """How a value of type `tp` is read back from JSON, strictly."""
    if tp in SCALARS:
        return SCALARS[tp]
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        if len(rest) != 1 or len(args) != 2:
            raise TypeError(f"no wire form for {tp!r} (only `X | None`)")
        inner = decoder(rest[0])
        return lambda v: None if v is None else inner(v)
    if origin is tuple:
        return _array_decoder(tp, args)
    if origin in (dict, collections.abc.Mapping):
        if args[0] is not str:
            raise TypeError(f"no wire form for {tp!r} (an object's keys are strings)")
        value, same = decoder(args[1]), _ALL.get(args[1])

        def mapping(v: Any) -> dict[str, Any]:
            if type(v) is not dict:
                raise _wrong("an object", v)
            if same is not None and set(map(type, v.values())) <= same:
                return dict(v) if args[1] is not float else \
                    dict(zip(v, map(float, v.values()), strict=True))
            try:
                return {k: value(x) for k, x in v.items()}
            except _Wrong as exc:
                raise exc.at("[a value]") from None  # (a key is content: not said)
        return mapping
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        return _object_decoder(tp)
    raise TypeError(f"no wire form for {tp!r}")


def _array_decoder(tp: Any, args: tuple[Any, ...]) -> Decode:
    """tuple[X, ...] and tuple[X, Y] from a JSON array."""
    same = None
    if len(args) == 2 and args[1] is Ellipsis:
        item, items, same = decoder(args[0]), None, _ALL.get(args[0])
    else:
        items = [decoder(a) for a in args]

    def array(v: Any) -> tuple[Any, ...]:
        if type(v) is not list or (items is not None and len(v) != len(items)):
            raise _wrong("an array" if items is None else f"an array of {len(items)}", v)
        if same is not None and set(map(type, v)) <= same:  # (histograms' counts)
            return tuple(v) if args[0] is not float else tuple(map(float, v))
        try:
            if items is None:
                return tuple([item(x) for x in v])
            return tuple([d(x) for d, x in zip(items, v, strict=True)])
        except _Wrong as exc:
            at = next(i for i, x in enumerate(v) if _fails(item if items is None
                                                            else items[i], x))
            raise exc.at(f"[{at}]") from None
    return array


def _fails(d: Decode, v: Any) -> bool:
    try:
        d(v)
    except (_Wrong, ValueError):
        return True
    return False


def _fields(cls: Any) -> list[tuple[str, Any]]:
    hints = typing.get_type_hints(cls)
    return [(f.name, hints[f.name]) for f in dataclasses.fields(cls)]


def _object_decoder(cls: type) -> Decode:
    fields = [(name, decoder(tp)) for name, tp in _fields(cls)]
    names = {name for name, _ in fields}

    def obj(v: Any) -> Any:
        if type(v) is not dict:
            raise _wrong("an object", v)
        if v.keys() != names:
            missing, extra = sorted(names - v.keys()), len(v.keys() - names)
            raise _Wrong(f"fields missing {missing}, unknown {extra}")
        values = {}
        for name, d in fields:
            try:
                values[name] = d(v[name])
            except _Wrong as exc:
                raise exc.at(f".{name}") from None
        try:
            return cls(**values)
        except ValueError as exc:  # (its own check, in __post_init__)
            raise _Wrong(str(exc)) from None
    return obj


def encoder(tp: Any) -> Encode | None:
    """How a value of type `tp` is written as JSON; None: as it is (JSON writes a tuple
    as an array itself)."""
    if tp in SCALARS:
        return None
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        inner = encoder(next(a for a in args if a is not type(None)))
        return None if inner is None else (lambda v: None if v is None else inner(v))
    if origin is tuple:
        items = [encoder(a) for a in args if a is not Ellipsis]
        if all(e is None for e in items):
            return None
        if args[-1] is Ellipsis:
            e0 = items[0]
            assert e0 is not None
            return lambda v: [e0(x) for x in v]
        return lambda v: [x if e is None else e(x) for e, x in zip(items, v, strict=True)]
    if origin in (dict, collections.abc.Mapping):
        value = encoder(args[1])
        return dict if value is None else (lambda v: {k: value(x) for k, x in v.items()})
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        return _object_encoder(tp)
    raise TypeError(f"no wire form for {tp!r}")


def _object_encoder(cls: type) -> Encode:
    fields = [(name, encoder(t)) for name, t in _fields(cls)]
    plain = [name for name, e in fields if e is None]
    parts = [(name, e) for name, e in fields if e is not None]
    get = operator.attrgetter(*plain) if len(plain) > 1 else None

    def obj(v: Any) -> dict[str, Any]:
        out = dict(zip(plain, get(v), strict=True)) if get is not None \
            else {name: getattr(v, name) for name in plain}
        for name, e in parts:
            out[name] = e(getattr(v, name))
        return out
    return obj


def _refuse_constant(name: str) -> float:
    raise ValueError(f"{name} is not a number this end takes")


_write = json.JSONEncoder(separators=(",", ":")).encode
_read = json.JSONDecoder().decode
_read_finite = json.JSONDecoder(parse_constant=_refuse_constant).decode


def _json_encoder(cls: type[Message]) -> Callable[[Any], bytes]:
    kind = cls.KIND
    fields = [(name, encoder(tp)) for name, tp in _fields(cls)]
    return lambda m: _write([kind, *(getattr(m, name) if e is None else e(getattr(m, name))
                                     for name, e in fields)]).encode()


class _Packed:
    """A per-request message's packed form (a class with a `TAG`): the tag's byte, its
    integers (`q`), numbers (`d`) and booleans (a byte, 0 or 1) in their order, then its
    string, if it has one (its last field), as UTF-8 to the frame's end (which the
    frame's length says). Read as strictly as JSON: its exact size, booleans 0 or 1,
    UTF-8, the class's `problem()`."""

    CODES: ClassVar[dict[Any, str]] = {int: "q", float: "d", bool: "?"}

    def __init__(self, cls: type[Message], tag: int) -> None:
        fields = _fields(cls)
        fixed = [(name, tp) for name, tp in fields if tp is not str]
        text = [name for name, tp in fields if tp is str]
        if any(tp not in self.CODES for _, tp in fixed) or tag >= 0x20 \
                or text not in ([], [fields[-1][0]]):
            raise TypeError(f"{cls.__name__}: no packed form (integers, numbers, "
                            "booleans and one string, last; a tag under 0x20)")
        self.make: Callable[..., Any] = cls
        self.kind, self.tag = cls.KIND, tag
        codes = "".join(self.CODES[tp] for _, tp in fixed)
        self.pack = struct.Struct("!B" + codes).pack
        fields_at = struct.Struct("!" + codes)
        self.unpack, self.size = fields_at.unpack_from, 1 + fields_at.size
        self.names = [name for name, _ in fixed]
        self.text = text[0] if text else None
        # where each boolean's byte is (read strictly: 0 or 1, where "?" takes any byte)
        self.bools = [(1 + struct.calcsize("!" + codes[:i]), name)
                      for i, (name, tp) in enumerate(fixed) if tp is bool]
        self.floats = [i for i, (_, tp) in enumerate(fixed) if tp is float]
        get = operator.attrgetter(*self.names, *text)
        self.values: Callable[[Any], tuple[Any, ...]] = \
            get if len(fields) > 1 else (lambda m: (get(m),))
        self.problem: Callable[[Any], str | None] | None = getattr(cls, "problem", None)

    def encode(self, m: Any) -> bytes:
        values = self.values(m)
        if self.text is None:
            return self.pack(self.tag, *values)
        text: str = values[-1]
        return self.pack(self.tag, *values[:-1]) + text.encode()

    def decode(self, data: bytes | bytearray, finite: bool) -> Any:
        size = len(data)
        if size != self.size and (self.text is None or size < self.size):
            raise WireError(f"{size} bytes, not a {self.kind}'s", self.kind, size)
        for at, name in self.bools:
            if data[at] > 1:
                raise WireError(f"{name}: expected a boolean", self.kind, size)
        values = self.unpack(data, 1)
        if finite and self.floats and not all(math.isfinite(values[i]) for i in self.floats):
            raise WireError("a number that is not finite", self.kind, size)
        if self.text is None:
            message = self.make(*values)
        else:
            try:
                message = self.make(*values, str(data[self.size:], "utf-8"))
            except UnicodeDecodeError:
                raise WireError(f"{self.text}: not UTF-8", self.kind, size) from None
        if self.problem is not None and (problem := self.problem(message)) is not None:
            raise WireError(problem, self.kind, size)
        return message


_encoders: dict[type, Callable[[Any], bytes]] = {}


def encode(message: Message) -> bytes:
    """`message` as the bytes of one frame's body: packed where its class has a `TAG`,
    else JSON."""
    enc = _encoders.get(type(message))
    if enc is None:
        cls = type(message)
        tag = getattr(cls, "TAG", None)
        enc = _encoders[cls] = _Packed(cls, tag).encode if tag is not None \
            else _json_encoder(cls)
    return enc(message)


@dataclasses.dataclass(frozen=True)
class _Kind:
    cls: type[Message]
    decoders: list[Decode]
    names: list[str]
    problem: Callable[[Any], str | None] | None  # the class's own check, where it has one


class Decoder:
    """Reads the message kinds one end accepts, strictly (the module says how); with
    `finite`, a number that is not finite is refused."""

    def __init__(self, kinds: Iterable[type[Message]], finite: bool = False) -> None:
        self._kinds: dict[str, _Kind] = {}
        self._packed: dict[int, _Packed] = {}
        for cls in kinds:
            fields = _fields(cls)
            self._kinds[cls.KIND] = _Kind(cls, [decoder(tp) for _, tp in fields],
                                          [name for name, _ in fields],
                                          getattr(cls, "problem", None))
            if (tag := getattr(cls, "TAG", None)) is not None:
                self._packed[tag] = _Packed(cls, tag)
        self._finite = finite
        self._read = _read_finite if finite else _read

    def decode(self, data: bytes | bytearray) -> Any:
        if data and data[0] < 0x20:  # (a JSON message begins with "[")
            if (packed := self._packed.get(data[0])) is not None:
                return packed.decode(data, self._finite)
            raise WireError(f"a packed kind this end does not take ({data[0]})",
                            size=len(data))
        return self._decode_json(data)

    def _decode_json(self, data: bytes | bytearray) -> Any:
        size = len(data)
        try:
            doc = self._read(str(data, "utf-8"))
        except (ValueError, RecursionError) as exc:  # (UnicodeDecodeError is a ValueError)
            raise WireError(f"not JSON: {_position(exc)}", size=size) from None
        if type(doc) is not list or not doc or type(doc[0]) is not str:
            raise WireError(f"not a message: {_json_type(doc)}", size=size)
        kind = doc[0]
        spec = self._kinds.get(kind)
        if spec is None:
            raise WireError("a kind this end does not take", kind=kind[:40], size=size)
        if len(doc) != len(spec.decoders) + 1:
            raise WireError(f"{len(doc) - 1} fields, {kind} has {len(spec.decoders)}",
                            kind=kind, size=size)
        values: list[Any] = []
        try:
            for d, v in zip(spec.decoders, doc[1:], strict=True):
                values.append(d(v))
        except _Wrong as exc:  # (the field it was at: the next one)
            raise WireError(str(exc.at(spec.names[len(values)])), kind=kind,
                            size=size) from None
        message = spec.cls(*values)
        problem = None if spec.problem is None else spec.problem(message)
        if problem is not None:
            raise WireError(problem, kind=kind, size=size)
        return message


def schema(kinds: Iterable[type[Message]]) -> str:
    """A digest of the kinds' names, tags, fields and types, the dataclasses in them
    included (the settings and the gate's limits live in `front/`, edited for the
    proxy's sake): two ends whose digests differ would misread each other."""
    def describe(tp: Any) -> str:
        if dataclasses.is_dataclass(tp) and isinstance(tp, type):
            return tp.__name__ + "{" + ",".join(f"{name}:{describe(t)}"
                                                for name, t in _fields(tp)) + "}"
        if typing.get_origin(tp) is not None:
            return (repr(typing.get_origin(tp)) + "["
                    + ",".join(describe(a) for a in typing.get_args(tp)) + "]")
        return getattr(tp, "__name__", repr(tp))

    text = ";".join(f"{c.KIND}/{getattr(c, 'TAG', '')}={describe(c)}" for c in kinds)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _position(exc: BaseException) -> str:
    """Where a frame stopped reading as JSON, without its content."""
    if isinstance(exc, json.JSONDecodeError):
        return f"{exc.msg} at byte {exc.pos}"
    if isinstance(exc, UnicodeDecodeError):
        return f"{exc.reason} at byte {exc.start}"
    return "nesting too deep" if isinstance(exc, RecursionError) else str(exc)[:80]
