"""The control protocol, version 1.

Transport: a unix stream socket (mode 0660; peers checked with SO_PEERCRED).
Framing: newline-delimited JSON, one request and one reply per line, UTF-8, at most
MAX_MESSAGE_BYTES per line including the newline. A connection may carry several
requests in turn; the server closes it after IDLE_TIMEOUT_S without a request.

Request:  {"v": 1, "cmd": "status", "args": {}}
          cmd is one of COMMANDS; args is an object (optional), e.g.
          {"v": 1, "cmd": "restart", "args": {"reason": "new weights"}}
          {"v": 1, "cmd": "events", "args": {"n": 50}}
          {"v": 1, "cmd": "pause-policy"}   (maintenance: the watchdog decides nothing)
          {"v": 1, "cmd": "throttle", "args": {"level": 2}}
          {"v": 1, "cmd": "kv-reset"}   (answered when the sleep, wake and canary are done)
          {"v": 1, "cmd": "evidence"}   (the evidence bundles kept, oldest first)
          {"v": 1, "cmd": "restart", "args": {"engine": "small"}}   (several engines:
          a command acting on one engine names it; status and events show all by default)
Reply:    {"v": 1, "ok": true, "result": {...}}
          {"v": 1, "ok": false, "error": "one line saying what was refused and why"}

A malformed, oversized, unknown or unauthorised request gets an error reply (an
oversized one, or one from an unauthorised peer, also ends the connection); the daemon
carries on. Malformed means anything `decode_request` cannot take, JSON nested past the
parser's recursion limit included. An error message quotes at most `QUOTE_CHARS`
characters of what the client sent (it is logged). This module is pure: bytes in, values
out.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

VERSION = 1
MAX_MESSAGE_BYTES = 64 * 1024
IDLE_TIMEOUT_S = 30.0
QUOTE_CHARS = 40  # of a client's value, at most, in an error message
COMMANDS = ("status", "restart", "stop", "reload", "events", "pause-policy", "resume-policy",
            "drain", "resume", "throttle", "unthrottle", "kv-reset", "evidence", "rearm")
# the commands that only read: logged at debug level (a monitor that polls `status` twice
# a second filled the log with them, issue 52); every other one at info, with its peer
READS = frozenset({"status", "events"})


class ProtocolError(ValueError):
    """A request that does not follow the protocol; the message is sent back."""


@dataclass(frozen=True)
class Request:
    cmd: str
    args: dict[str, Any] = field(default_factory=dict)


def encode_request(cmd: str, args: dict[str, Any] | None = None) -> bytes:
    return _encode({"v": VERSION, "cmd": cmd, "args": args or {}})


def encode_ok(result: dict[str, Any]) -> bytes:
    return _encode({"v": VERSION, "ok": True, "result": result})


def encode_error(message: str) -> bytes:
    return _encode({"v": VERSION, "ok": False, "error": message})


def _encode(doc: dict[str, Any]) -> bytes:
    data = json.dumps(doc, separators=(",", ":"), default=str).encode() + b"\n"
    if len(data) > MAX_MESSAGE_BYTES:
        return json.dumps({"v": VERSION, "ok": False,
                           "error": "reply too large for the protocol"}).encode() + b"\n"
    return data


def quote(value: Any) -> str:
    """`repr(value)`, cut to QUOTE_CHARS characters: what an error may say of a client's
    value (a value's repr is computed only as far as needed for a long str)."""
    if isinstance(value, str) and len(value) > QUOTE_CHARS:
        value = value[:QUOTE_CHARS]
    try:
        text = repr(value)
    except RecursionError:
        text = f"<a deeply nested {type(value).__name__}>"
    return text if len(text) <= QUOTE_CHARS else text[:QUOTE_CHARS - 3] + "..."


def decode_request(line: bytes) -> Request:
    """The request on one line; ProtocolError for anything else, never another error."""
    try:
        doc = json.loads(line)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ProtocolError(f"malformed request: not JSON ({exc})") from None
    except RecursionError:
        raise ProtocolError("malformed request: JSON nested too deeply") from None
    if not isinstance(doc, dict):
        raise ProtocolError("malformed request: expected a JSON object")
    v = doc.get("v")
    if v != VERSION:
        raise ProtocolError(f"unsupported protocol version {quote(v)}; "
                            f"this daemon speaks {VERSION}")
    cmd = doc.get("cmd")
    if not isinstance(cmd, str):
        raise ProtocolError("malformed request: 'cmd' must be a string")
    if cmd not in COMMANDS:
        raise ProtocolError(f"unknown command {quote(cmd)} (known: {', '.join(COMMANDS)})")
    args = doc.get("args", {})
    if not isinstance(args, dict):
        raise ProtocolError("malformed request: 'args' must be an object")
    unknown = set(doc) - {"v", "cmd", "args"}
    if unknown:
        raise ProtocolError(f"malformed request: unknown field {quote(sorted(unknown)[0])}")
    return Request(cmd, args)


def decode_reply(line: bytes) -> dict[str, Any]:
    """The reply's result; raises ProtocolError with the daemon's error message."""
    try:
        doc = json.loads(line)
    except ValueError as exc:
        raise ProtocolError(f"malformed reply from the daemon: {exc}") from None
    if not isinstance(doc, dict) or "ok" not in doc:
        raise ProtocolError("malformed reply from the daemon")
    if not doc["ok"]:
        raise ProtocolError(str(doc.get("error", "unknown error")))
    result = doc.get("result", {})
    if not isinstance(result, dict):
        raise ProtocolError("malformed reply from the daemon")
    return result
