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
  forwarded to the engine.
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


def connection_named(values: list[str]) -> frozenset[str]:
    """The field names (lower case) that the request's Connection fields list."""
    return frozenset(n for v in values for c in v.split(",")
                     if (n := c.strip().lower()) and n not in _OPTIONS)


def without(fields: list[tuple[bytes, bytes]],
            names: frozenset[str]) -> list[tuple[bytes, bytes]]:
    """The fields but those named."""
    return [(k, v) for k, v in fields
            if k.decode("latin-1").lower() not in names]
