"""What the front door refuses in a request's head that its parser (httptools, llhttp)
lets through, and which header fields it drops before the proxy sees them. Pure: the
server gathers the few fields these rules read while it parses, and asks here once the
head is whole.

The rules and where they come from:
- the version: HTTP/1.0 and HTTP/1.1 are served; a request line without one (HTTP/0.9's
  shape) is a 400, another version (llhttp parses `HTTP/2.0`) a 505;
- `Host` (RFC 9112 3.2): an HTTP/1.1 request without one, or any request with two, is a
  400;
- `Transfer-Encoding` (RFC 9112 6.1): only `chunked`, alone, is served; another coding
  before it is a 501 (a coding we would ignore is a body we would misread); on an
  HTTP/1.0 request it is faulty framing: a 400, and the connection closed;
- `Connection` (RFC 9110 7.6.1): the fields it names are hop-by-hop: dropped, never
  forwarded to the engine;
- a switch of protocols is never made (`upgrade_problem`): `CONNECT` (a tunnel) is a
  400; a request that asks to switch (`Upgrade`: websocket, h2c) is answered as a plain
  HTTP/1.1 request, as RFC 9110 7.8 lets a server that keeps its protocol, and its
  connection closed after the answer; one that also carries a body is a 400 (llhttp stops
  reading at an upgrade's head, so its body could not be framed). Either way nothing
  after that head is read on the connection.
"""

from __future__ import annotations

# the Connection options that name no field of the request
_OPTIONS = frozenset(("close", "keep-alive", "upgrade"))


def head_problem(version: str, hosts: int, codings: list[str]) -> tuple[int, str] | None:
    """(status, why) for a head the server must refuse, or None. `hosts`: how many Host
    fields it had; `codings`: its Transfer-Encoding values, in order."""
    if version not in ("1.1", "1.0"):
        if version == "0.9":
            return 400, "a request line without an HTTP version"
        return 505, f"HTTP/{version} is not served here (HTTP/1.1 and 1.0 are)"
    if hosts > 1:
        return 400, "more than one Host header"
    if hosts == 0 and version == "1.1":
        return 400, "an HTTP/1.1 request without a Host header"
    if codings:
        if version == "1.0":
            return 400, "Transfer-Encoding in an HTTP/1.0 request"
        listed = [c.strip().lower() for v in codings for c in v.split(",") if c.strip()]
        if listed != ["chunked"]:
            return 501, f"Transfer-Encoding {', '.join(listed)[:100]!r} is not served " \
                        "(chunked alone is)"
    return None


def upgrade_problem(method: str, has_body: bool) -> tuple[int, str] | None:
    """(status, why) for a request that asks for another protocol and is refused, or
    None: it is answered as a plain request (the `Upgrade` field is hop-by-hop: never
    forwarded), then its connection closed. Why close: the client may already be
    sending the new protocol's bytes after its head (h2c's preface, a websocket's
    frames), which are no HTTP/1.1 request, and the parser stops at an upgrade's head,
    so nothing after it can be framed; nginx and Go's server likewise answer such a
    request in HTTP/1.1 rather than switch. `CONNECT` asks for a tunnel the front door
    never opens; a body behind an upgrade's head is one the parser did not read."""
    if method == "CONNECT":
        return 400, "CONNECT is not served here (no tunnels)"
    if has_body:
        return 400, "a request that asks to switch protocols with a body is not served " \
                    "(its body cannot be framed)"
    return None


def connection_named(values: list[str]) -> frozenset[str]:
    """The field names (lower case) that the request's Connection fields list."""
    return frozenset(n for v in values for c in v.split(",")
                     if (n := c.strip().lower()) and n not in _OPTIONS)


def without(fields: list[tuple[bytes, bytes]],
            names: frozenset[str]) -> list[tuple[bytes, bytes]]:
    """The fields but those named."""
    return [(k, v) for k, v in fields
            if k.decode("latin-1").lower() not in names]
