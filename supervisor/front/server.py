"""The front door's HTTP/1.1 server: the public socket and its connections, one asyncio
protocol each with httptools' C request parser (as uvicorn parses), every request handed
to the proxy's one handler as a `Request`, its answer written as a `Response` (sized, one
write) or a `StreamResponse` (chunked, written as it comes); those in
`supervisor/front/messages.py`. This module owns the listening socket, the connections
open and the bodies they hold (`Server`); one connection is
`supervisor/front/connection.py`'s, the bounds and the refusal's bytes
`supervisor/front/limits.py`'s, the head's rules `supervisor/front/conformance.py`'s.

Why not aiohttp's server: it cost some 60-95 µs of the proxy's CPU a request on 2 cores
(its protocol, its request and response objects, its payload writer: docs/proxy.md,
"Cost per request and per chunk"), the largest share left once the upstream client was
our own. Here a request is one parse, one wake-up of its connection's task and one write.

What it does, as an operator would expect of a front door:
- keep-alive (HTTP/1.1 by default, HTTP/1.0 when asked for), pipelined requests answered
  in order; a request that says `Connection: close` is answered and what follows it
  ignored (RFC 9112 9.6);
- `Expect: 100-continue` answered when the handler reads the body (`Request.read`), so
  a body is never asked for before the request was checked;
- limits: a request line over `max_line` bytes is refused with 414, a header field over
  `max_field` with 431, a head over 8 times that with 431 (counted as it arrives, the
  read that completes it included), its chunk framing past that bound with 400, its
  trailers past it with 431 whatever the body's size (trailers are read and dropped:
  never merged into the header section, RFC 9110 6.5.1), a body over `max_body`
  raises `BodyTooLarge` in `read` (the proxy answers 413); the rest of a refused body
  is read and dropped (at most `LINGER_S`) before the connection closes, so that the
  client reads the answer instead of a reset;
- the head's rules its parser does not check (`supervisor/front/conformance.py`: the
  version, Host, Transfer-Encoding codings; fields named by Connection dropped; no
  switch of protocols: CONNECT 400, an Upgrade answered as a plain request and the
  connection closed after it);
- a malformed request: 400 and the connection closed; one that comes pipelined behind a
  request being answered waits for that answer's end (never a status line inside
  another answer);
- deadlines, nginx's: a request's head within `header_timeout_s` of its first byte (of
  the connection's opening, for its first request), 408; a body read within
  `body_timeout_s` of the last, 408; a client that takes nothing of its answer for
  `send_timeout_s` is cut (its handler cancelled, so its upstream request, so its
  admission slot); a kept-alive connection idle for `idle_timeout_s` closed;
- memory: reading pauses while a pipelined request's body waits for its turn beyond
  `HIGH_WATER`; a body that would take the bodies held by every connection together
  past `max_buffered` is refused, 503 with `Retry-After` (never a wait on other
  clients, which could all be waiting on each other); a gone client's bodies are
  dropped at once;
- connections: at `max_connections` open ones a new connection takes the place of the
  oldest idle one (never sent a byte, or kept alive between requests), which is closed;
  when none is idle it is answered 503 with `Retry-After` and closed (the proxy keeps the
  cap under the descriptor limit);
- a client that goes away: its handler's task is cancelled (the proxy's upstream request
  with it, and vLLM aborts it), and a write to it raises `ConnectionResetError`;
- a handler that fails: 500 if nothing was sent yet, else the connection cut;
- a writer faster than its client waits in `write` (64 KiB buffered at most);
- `close`: the socket stops listening, idle connections close, and handlers still
  running get `shutdown_s` before they are cancelled.

Every refusal is logged (with its peer, never a byte of a body) and counted by the
`refused(status, reason)` callback: `bad_http`, `header_timeout`, `body_timeout`,
`send_timeout`, `connections`, `connections_evicted` (an idle one closed at the cap),
`body_budget`.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time

import structlog

from supervisor.front.connection import Connection, Handler, Refused
from supervisor.front.limits import Limits, connection_cap, refusal

__all__ = ["Connection", "Handler", "Limits", "Refused", "Server", "connection_cap"]

log = structlog.get_logger("supervisor.proxy")

_LOG_EVERY_S = 10.0  # connections refused above the cap: one line per this long at most


class Server:
    """The listening socket and its connections."""

    def __init__(self, handler: Handler, limits: Limits,
                 refused: Refused = lambda status, reason: None) -> None:
        self.handler = handler
        self.limits = limits
        self.refused = refused
        self.loop = asyncio.get_running_loop()
        # (in the order they came: the oldest idle one is the first to go at the cap)
        self.connections: dict[Connection, None] = {}
        self.buffered = 0  # request body bytes held, all connections together
        self._over_cap = 0  # connections refused above the cap, not yet logged
        self._over_cap_logged = -_LOG_EVERY_S
        self._server: asyncio.Server | None = None
        self._port: int | None = None

    def admit(self, conn: Connection) -> bool:
        """A new connection is served; at the cap, in place of the oldest idle one (no
        request under way: a connection that never sent a byte, or a kept-alive one
        between requests), which is closed; when every one is busy, the new one is
        answered 503 and closed. So a flood of idle connections does not keep clients
        out until the head deadline clears them."""
        if len(self.connections) >= self.limits.max_connections:
            idle = next((c for c in self.connections if c.idle()), None)
            if idle is not None:
                self.refused(None, "connections_evicted")
                idle.abort()
                self.connections.pop(idle, None)
        if len(self.connections) < self.limits.max_connections:
            self.connections[conn] = None
            return True
        self.refused(503, "connections")
        self._over_cap += 1
        now = self.loop.time()
        if now - self._over_cap_logged >= _LOG_EVERY_S:
            log.warning("connections refused", reason="connections",
                        refused=self._over_cap, open=len(self.connections),
                        max_connections=self.limits.max_connections)
            self._over_cap, self._over_cap_logged = 0, now
        conn.turn_away(refusal(503, "too many connections", "connections",
                               self.limits.retry_after_s))
        return False

    def release(self, held: int) -> None:
        """Body bytes no longer held."""
        self.buffered -= held

    async def listen(self, host: str, port: int, sock: socket.socket | None = None) -> None:
        """Raises OSError when it cannot. With `sock`: on that socket, already listening
        (a proxy worker's, bound by the daemon)."""
        if sock is not None:
            self._server = await self.loop.create_server(lambda: Connection(self), sock=sock,
                                                         backlog=1024)
        else:
            self._server = await self.loop.create_server(
                lambda: Connection(self), host or None, port, reuse_address=True,
                backlog=1024)
        self._port = int(self._server.sockets[0].getsockname()[1])

    @property
    def port(self) -> int:
        """The port it listens on (the one the system chose for port 0), or did."""
        assert self._port is not None, "never listened"
        return self._port

    async def close(self, shutdown_s: float = 10.0) -> None:
        """Stop listening; close idle connections; give the busy ones `shutdown_s`."""
        if self._server is not None:
            self._server.close()
        busy = [c for c in list(self.connections) if not c.close_if_idle()]
        deadline = time.monotonic() + shutdown_s
        while busy and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
            busy = [c for c in busy if not c.lost and c._current is not None]
        for c in busy:
            c.abort()
        for c in list(self.connections):
            c.abort()
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 1.0)
            self._server = None
