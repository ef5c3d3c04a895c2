"""The daemon's own HTTP exporter: `/metrics` (Prometheus text), `/healthz`, `/readyz`.

What it owns: a listening socket and the connections on it, nothing else. It only reads a
view of the daemon, asked for through `view()`, which the daemon answers from its
state-owning task (through its queue); nothing here changes the daemon's state, and
`/healthz` answers 503 when that task does not answer within `view_timeout_s`.

What it must never do: block the event loop, hold a connection without a deadline, or let
one connection's error escape into the loop. Bounds (docs/exporter.md):

- one request per connection, `Connection: close` on every answer;
- the request head (request line and headers) is at most `MAX_HEAD` bytes (else 431) and
  must arrive within `head_timeout_s` (else the connection is closed without an answer);
- at most `max_connections` are served at once; more are answered 503, and beyond twice
  that they are reset without an answer, so that a flood cannot pile up tasks (a run of
  refusals is logged once at its start, with why, and once at its end, with counts);
- the answer is written within `WRITE_TIMEOUT_S`, and the close waits at most `linger_s`
  for the client to finish sending (so that unread input does not reset the answer).

What it serves is rendered by `supervisor/ops/exposition.py` from the daemon's view.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import math
import re
import socket
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import structlog
from prometheus_client import (
    CONTENT_TYPE_LATEST,
)

from supervisor.ops.exposition import BadNames, ExporterView, render_metrics

log = structlog.get_logger("supervisor.exporter")

PATHS = ("/metrics", "/healthz", "/readyz")
MAX_HEAD = 8192  # bytes of request line and headers, the empty line included
WRITE_TIMEOUT_S = 5.0
MAX_LINGER_BYTES = 65536  # what the close reads and discards at most

_TOKEN = r"[!#$%&'*+.^_`|~0-9A-Za-z-]+"  # RFC 9110 token
_REQUEST_LINE = re.compile(rf"({_TOKEN}) (\S+) HTTP/1\.[01]")
_HEADER = re.compile(rf"{_TOKEN}:[ \t]*[^\x00-\x08\x0a-\x1f\x7f]*")
_ABSOLUTE = re.compile(r"https?://[^/?#\s]*(.*)", re.IGNORECASE)
_LISTEN = re.compile(r"(?:\[(?P<v6>[^\[\]\s]+)\]|(?P<host>[A-Za-z0-9._-]+)):(?P<port>[0-9]+)")


class ExporterError(Exception):
    """The exporter cannot serve (bad address, cannot bind); the message names the address."""


def parse_listen(listen: str) -> tuple[str, int]:
    """ "127.0.0.1:9402", "[::1]:9402", "localhost:0" -> (host, port); ValueError otherwise."""
    expected = f"expected HOST:PORT (e.g. 127.0.0.1:9402 or [::1]:9402), got {listen!r}"
    m = _LISTEN.fullmatch(listen)
    if m is None:
        if listen.count(":") > 1 and "[" not in listen:
            raise ValueError(f"{expected}: an IPv6 address needs brackets")
        raise ValueError(expected)
    port = int(m["port"])
    if port > 65535:
        raise ValueError(f"{expected}: port {port} is out of range 0-65535")
    if m["v6"] is None:
        return m["host"], port
    try:
        ipaddress.IPv6Address(m["v6"])
    except ValueError:
        raise ValueError(f"{expected}: {m['v6']!r} in brackets is not an IPv6 address") from None
    return m["v6"], port


def parse_request_head(lines: Sequence[bytes]) -> tuple[str, str]:
    """The request line and header lines (line ends stripped) -> (method, path).

    Pure; ValueError with a short reason for anything malformed. Header values are not
    kept: nothing this server answers depends on them.
    """
    if not lines:
        raise ValueError("no request line")
    text = [line.decode("latin-1") for line in lines]
    m = _REQUEST_LINE.fullmatch(text[0])
    if m is None:
        raise ValueError("malformed request line")
    method, target = m[1], m[2]
    if (absolute := _ABSOLUTE.fullmatch(target)) is not None:
        target = absolute[1] or "/"
    if not target.startswith("/"):
        raise ValueError("request target is not a path")
    for header in text[1:]:
        # Obsolete line folding (a line starting with white space) is rejected too.
        if _HEADER.fullmatch(header) is None:
            raise ValueError("malformed header line")
    return method, target.split("?", 1)[0].split("#", 1)[0]


@dataclass(frozen=True)
class _Answer:
    status: int
    body: bytes
    content_type: str = "text/plain; charset=utf-8"
    head_only: bool = False
    allow: bool = False  # send `Allow: GET, HEAD`
    retry_after: int | None = None  # send `Retry-After` (seconds)

    def encode(self) -> bytes:
        headers = [f"HTTP/1.1 {self.status} {_REASONS[self.status]}",
                   f"Content-Type: {self.content_type}",
                   f"Content-Length: {len(self.body)}",
                   "Connection: close"]
        if self.allow:
            headers.append("Allow: GET, HEAD")
        if self.retry_after is not None:
            headers.append(f"Retry-After: {self.retry_after}")
        head = ("\r\n".join(headers) + "\r\n\r\n").encode("ascii")
        return head if self.head_only else head + self.body


def _text(status: int, body: str, *, head_only: bool = False, allow: bool = False) -> _Answer:
    return _Answer(status, body.encode("utf-8", "replace"), head_only=head_only, allow=allow)


_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
            431: "Request Header Fields Too Large", 500: "Internal Server Error",
            503: "Service Unavailable"}


class _HeadTooLarge(Exception):
    pass


class Exporter:
    """Serves /metrics, /healthz and /readyz on `listen` from `view()`.

    `start()` binds (ExporterError naming the address on failure); `close()` stops
    listening and ends the connections in flight.
    """

    def __init__(self, listen: str, view: Callable[[], Awaitable[ExporterView]], *,
                 view_timeout_s: float = 2.0, head_timeout_s: float = 5.0,
                 max_connections: int = 64, linger_s: float = 1.0) -> None:
        self.listen = listen
        self._view = view
        self.view_timeout_s = view_timeout_s
        self.head_timeout_s = head_timeout_s
        self.max_connections = max_connections
        self.linger_s = linger_s
        self._server: asyncio.Server | None = None
        self._served = 0  # connections admitted and not yet closed
        self._open = 0  # all connections not yet closed, the rejected included
        self._tasks: set[asyncio.Task[None]] = set()
        self._bad = BadNames()
        self._view_failing = False
        self._closing = False
        self._refused = 0  # connections answered 503 in the run of refusals under way
        self._reset = 0  # connections reset without an answer in that run

    @property
    def port(self) -> int:
        """The bound port (`listen` may say port 0)."""
        if self._server is None or not self._server.sockets:
            raise RuntimeError("the exporter is not started")
        return int(self._server.sockets[0].getsockname()[1])

    async def start(self) -> None:
        try:
            host, port = parse_listen(self.listen)
        except ValueError as exc:
            raise ExporterError(f"exporter cannot listen on {self.listen}: {exc}") from None
        try:
            if port == 0:
                # A name such as localhost resolves to several addresses, and each would
                # get its own ephemeral port: bind the first one only, so `port` is the port.
                infos = await asyncio.get_running_loop().getaddrinfo(
                    host, 0, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
                host = str(infos[0][4][0])
            self._server = await asyncio.start_server(self._handle, host, port,
                                                      limit=MAX_HEAD)
        except OSError as exc:
            raise ExporterError(f"exporter cannot listen on {self.listen}: {exc}") from exc
        log.info("exporter listening", listen=self.listen, port=self.port)

    async def close(self) -> None:
        if self._server is None:
            return
        self._closing = True
        self._server.close()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._server.wait_closed(), 2.0)

    # ---- one connection --------------------------------------------------------------

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None  # start_server runs each connection in a task
        self._tasks.add(task)
        self._open += 1
        admitted = self._served < self.max_connections
        self._served += admitted
        try:
            if not self._closing:
                self._note_admission(admitted, self._open > 2 * self.max_connections)
            if self._closing or (not admitted and self._open > 2 * self.max_connections):
                writer.transport.abort()  # closing, or a flood: no answer, no task left
                return
            answer = (await self._serve(reader) if admitted
                      else _text(503, "too many connections\n"))
            if answer is not None and await self._send(writer, answer):
                await self._linger(reader, writer)
        except Exception:  # one bad connection must never reach the loop
            log.warning("exporter connection failed", exc_info=True)
        except asyncio.CancelledError:
            # close() cancels the connections in flight and awaits them. The task must end
            # normally: Python 3.11's start_server calls task.exception() on a cancelled
            # task and logs an error from it.
            if not self._closing:
                raise
        finally:
            self._open -= 1
            self._served -= admitted
            self._tasks.discard(task)
            await _close(writer)

    def _note_admission(self, admitted: bool, reset: bool) -> None:
        """A run of refused connections: logged at its start with why, at its end with
        how many were answered 503 and how many reset."""
        if not admitted:
            if not self._refused and not self._reset:
                log.warning("exporter refusing connections: too many at once",
                            open=self._open, max_connections=self.max_connections,
                            answer=f"503 up to {2 * self.max_connections} open, then reset "
                                   "without an answer")
            self._reset += reset
            self._refused += not reset
        elif self._refused or self._reset:
            log.info("exporter serving connections again", answered_503=self._refused,
                     reset=self._reset, open=self._open)
            self._refused = self._reset = 0

    async def _serve(self, reader: asyncio.StreamReader) -> _Answer | None:
        """Read one request and answer it; None: close without an answer."""
        try:
            lines = await asyncio.wait_for(_read_head(reader), self.head_timeout_s)
        except _HeadTooLarge:
            return _text(431, f"request head over {MAX_HEAD} bytes\n")
        except (TimeoutError, ConnectionError):
            return None  # silent, slow or gone: close
        if lines is None:
            return None  # the client closed before the end of its head
        try:
            method, path = parse_request_head(lines)
        except ValueError as exc:
            return _text(400, f"bad request: {exc}\n")
        head_only = method == "HEAD"
        if path not in PATHS:
            return _text(404, f"not found: try {', '.join(PATHS)}\n", head_only=head_only)
        if method not in ("GET", "HEAD"):
            return _text(405, "method not allowed\n", allow=True)
        view = await self._fetch_view()
        if isinstance(view, str):
            # /metrics: the scrape failed (500); probes: the daemon's core is not answering.
            status = 500 if path == "/metrics" else 503
            return _text(status, f"the daemon did not answer: {view}\n", head_only=head_only)
        if path == "/healthz":
            return _text(200, "ok\n", head_only=head_only)
        if path == "/readyz":
            if view.ready:
                return _text(200, "ready\n", head_only=head_only)
            if view.eta_s is None:
                return _text(503, f"not ready: {view.state}\n", head_only=head_only)
            # (a starting engine: when its past starts say it will serve)
            eta = max(1, math.ceil(view.eta_s))
            return _Answer(503, f"not ready: {view.state}, ready in about {eta} s\n".encode(),
                           head_only=head_only, retry_after=eta)
        try:
            body = render_metrics(view, self._bad)
        except Exception as exc:
            log.error("exporter cannot render its metrics", exc_info=True)
            return _text(500, f"cannot render metrics: {type(exc).__name__}\n",
                         head_only=head_only)
        return _Answer(200, body, content_type=CONTENT_TYPE_LATEST, head_only=head_only)

    async def _fetch_view(self) -> ExporterView | str:
        """The view, or why there is none; a failing streak is logged at its start and end."""
        reason: str | None = None
        try:
            view = await asyncio.wait_for(self._view(), self.view_timeout_s)
        except TimeoutError:
            reason = f"no view within {self.view_timeout_s:g} s"
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # this connection is being cancelled (close)
            reason = "the view was cancelled"  # the owner went away with our request
        except Exception as exc:
            reason = f"the view failed: {type(exc).__name__}: {exc}"
        if reason is not None:
            if not self._view_failing:
                self._view_failing = True
                log.warning("exporter gets no view from the daemon", reason=reason)
            return reason
        if self._view_failing:
            self._view_failing = False
            log.info("exporter gets views from the daemon again")
        return view

    async def _send(self, writer: asyncio.StreamWriter, answer: _Answer) -> bool:
        writer.write(answer.encode())
        try:
            await asyncio.wait_for(writer.drain(), WRITE_TIMEOUT_S)
        except (TimeoutError, ConnectionError):
            writer.transport.abort()
            return False
        return True

    async def _linger(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Half-close, then read what the client still sends, for at most `linger_s`.

        Closing a socket with unread input makes the kernel send a reset, which can
        discard the answer before the client reads it (a 503 or 431 sent before reading
        the whole request, a body nobody reads).
        """
        with contextlib.suppress(OSError, RuntimeError):
            if writer.can_write_eof():
                writer.write_eof()
        discarded = 0
        with contextlib.suppress(TimeoutError, ConnectionError):
            async with asyncio.timeout(self.linger_s):
                while discarded < MAX_LINGER_BYTES:
                    chunk = await reader.read(4096)
                    if not chunk:
                        break
                    discarded += len(chunk)


async def _read_head(reader: asyncio.StreamReader) -> list[bytes] | None:
    """The request line and headers, line ends stripped; None if the client closed first.

    Accepts CRLF or bare LF line ends; empty lines before the request line are skipped
    (RFC 9112 section 2.2). Raises _HeadTooLarge past MAX_HEAD bytes.
    """
    lines: list[bytes] = []
    size = 0
    while True:
        try:
            line = await reader.readline()
        except ValueError:  # one line over the reader's limit (MAX_HEAD)
            raise _HeadTooLarge from None
        size += len(line)
        if size > MAX_HEAD:
            raise _HeadTooLarge
        if not line.endswith(b"\n"):
            return None
        line = line[:-2] if line.endswith(b"\r\n") else line[:-1]
        if line:
            lines.append(line)
        elif lines:
            return lines


async def _close(writer: asyncio.StreamWriter) -> None:
    """Close within a bound: a client that reads nothing must not keep the socket."""
    writer.close()
    try:
        await asyncio.wait_for(writer.wait_closed(), WRITE_TIMEOUT_S)
    except (TimeoutError, OSError):
        writer.transport.abort()
    except asyncio.CancelledError:
        writer.transport.abort()
        raise
