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
  that they are reset without an answer, so that a flood cannot pile up tasks;
- the answer is written within `WRITE_TIMEOUT_S`, and the close waits at most `linger_s`
  for the client to finish sending (so that unread input does not reset the answer).

Metric names follow Prometheus conventions under the prefix `vllm_supervisor_`: base
units, `_total` counters, one series per engine state. An unknown value is omitted, never 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import re
import socket
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import structlog
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from supervisor.front.continuation import OUTCOMES, REFUSALS
from supervisor.front.latency import KINDS, HistogramView

log = structlog.get_logger("supervisor.exporter")

PREFIX = "vllm_supervisor_"
STATES = ("STARTING", "RUNNING", "DRAINING", "STOPPING", "BACKOFF", "FATAL", "STOPPED")
PATHS = ("/metrics", "/healthz", "/readyz")
MAX_HEAD = 8192  # bytes of request line and headers, the empty line included
WRITE_TIMEOUT_S = 5.0
MAX_LINGER_BYTES = 65536  # what the close reads and discards at most

_METRIC_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_TOKEN = r"[!#$%&'*+.^_`|~0-9A-Za-z-]+"  # RFC 9110 token
_REQUEST_LINE = re.compile(rf"({_TOKEN}) (\S+) HTTP/1\.[01]")
_HEADER = re.compile(rf"{_TOKEN}:[ \t]*[^\x00-\x08\x0a-\x1f\x7f]*")
_ABSOLUTE = re.compile(r"https?://[^/?#\s]*(.*)", re.IGNORECASE)
_LISTEN = re.compile(r"(?:\[(?P<v6>[^\[\]\s]+)\]|(?P<host>[A-Za-z0-9._-]+)):(?P<port>[0-9]+)")


@dataclass(frozen=True)
class ExporterView:
    """A frozen snapshot of what the exporter shows, made by the state-owning task."""

    state: str  # one of STATES
    ready: bool  # engine serving and not draining
    throttle_level: int
    restarts_by_reason: Mapping[str, int]
    trips_by_rule: Mapping[str, int]
    actions_by_kind: Mapping[str, int]
    last_decision_wall: float | None  # unix time of the last decision
    policy_paused: bool
    dry_run: bool
    engine_uptime_s: float | None
    gauges: Sequence[tuple[str, str, float | None]]  # (name, help, value); None: omitted
    proxy: ProxyView | None = None  # the front proxy's counters, when it runs
    engine_not_running_s: float = 0.0  # since the engine was last RUNNING; 0 while it is
    engine_startup_timeout_s: float | None = None  # its allowance to become healthy
    # several engines (or named ones): each one's view, shown with an `engine` label; the
    # fields above then summarise them (state, ready) and `proxy` holds the shared
    # counters, each engine's `proxy` its own gate's numbers
    engines: Sequence[tuple[str, ExporterView]] = ()


@dataclass(frozen=True)
class ProxyView:
    responses_by_code: Mapping[str, int]
    rejections_by_reason: Mapping[str, int]
    in_flight: int
    held: int  # waiting at the gate
    connect_retries: int
    held_limit: int = 0  # the hold queue's length limit (proxy.hold_queue_max)
    kv_breaker_open: bool = False
    latency: Sequence[HistogramView] = ()  # what clients felt, by kind and model
    continuations: Mapping[str, int] = field(default_factory=dict)  # by outcome
    continuation_refusals: Mapping[str, int] = field(default_factory=dict)


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


@dataclass
class _BadNames:
    """What was already logged as skipped, so that each is logged once."""

    seen: set[tuple[str, str]] = field(default_factory=set)

    def once(self, event: str, **kv: object) -> None:
        key = (event, repr(sorted(kv.items())))
        if key not in self.seen:
            self.seen.add(key)
            log.warning(event, **kv)


Labelled = list[tuple[str | None, "ExporterView"]]  # (engine name or None, its view)


def _labels(views: Labelled, labels: Sequence[str]) -> list[str]:
    """A family's labels: `engine` leads them when the engines are named."""
    return (["engine"] if views[0][0] is not None else []) + list(labels)


def _gauge(name: str, helptext: str, views: Labelled,
           labels: Sequence[str] = ()) -> GaugeMetricFamily:
    return GaugeMetricFamily(PREFIX + name, helptext, labels=_labels(views, labels))


def _counter(name: str, helptext: str, views: Labelled,
             labels: Sequence[str] = ()) -> CounterMetricFamily:
    return CounterMetricFamily(PREFIX + name, helptext, labels=_labels(views, labels))


class _ViewCollector(Collector):
    def __init__(self, view: ExporterView, bad: _BadNames) -> None:
        self.view = view
        self.bad = bad

    def collect(self) -> Iterator[Metric]:
        v = self.view
        views: Labelled = [(n, e) for n, e in v.engines] or [(None, v)]

        def lv(name: str | None, *rest: str) -> list[str]:
            return ([name] if name is not None else []) + list(rest)

        state = _gauge("engine_state",
                        "engine state: 1 for the current state, 0 for the others", views,
                        ["state"])
        for name, e in views:
            if e.state not in STATES:
                self.bad.once("exporter got an unknown engine state", state=e.state)
            for s in STATES:
                state.add_metric(lv(name, s), 1.0 if s == e.state else 0.0)
        yield state
        simple: list[tuple[str, str, Callable[[ExporterView], float | None]]] = [
            ("engine_ready", "1 while the engine serves and is not draining",
             lambda e: float(e.ready)),
            ("engine_uptime_seconds", "seconds since the engine became healthy",
             lambda e: e.engine_uptime_s),
            ("engine_not_running_seconds",
             "seconds since the engine was last RUNNING (0 while it is)",
             lambda e: e.engine_not_running_s),
            ("engine_startup_timeout_seconds",
             "the engine's allowance to become healthy (engine.startup_timeout_s)",
             lambda e: e.engine_startup_timeout_s)]
        for fname, helptext, get in simple:
            values = [(name, get(e)) for name, e in views]
            if all(x is None for _, x in values):
                continue
            fam = _gauge(fname, helptext, views)
            for name, x in values:
                if x is not None:
                    fam.add_metric(lv(name), float(x))
            yield fam
        counts: list[tuple[str, str, str, Callable[[ExporterView], Mapping[str, int]]]] = [
                ("engine_restarts", "engine restarts, by reason", "reason",
                 lambda e: e.restarts_by_reason),
                ("policy_trips", "policy rule trips, by rule (dry-run included)", "rule",
                 lambda e: e.trips_by_rule),
                ("policy_actions", "policy actions carried out, by action", "action",
                 lambda e: e.actions_by_kind)]
        for fname, helptext, label, get_counts in counts:
            counter = _counter(fname, helptext, views, [label])
            for name, e in views:
                for key, n in sorted(get_counts(e).items()):
                    counter.add_metric(lv(name, key), float(n))
            yield counter
        more: list[tuple[str, str, Callable[[ExporterView], float | None]]] = [
                ("throttle_level", "throttle level in force (0: none)",
                 lambda e: float(e.throttle_level)),
                ("policy_paused", "1 while the policy is paused",
                 lambda e: float(e.policy_paused)),
                ("policy_dry_run", "1 when the policy only reports what it would do",
                 lambda e: float(e.dry_run)),
                ("last_decision_timestamp_seconds", "unix time of the last policy decision",
                 lambda e: e.last_decision_wall)]
        for fname, helptext, get in more:
            values = [(name, get(e)) for name, e in views]
            if all(x is None for _, x in values):
                continue
            fam = _gauge(fname, helptext, views)
            for name, x in values:
                if x is not None:
                    fam.add_metric(lv(name), float(x))
            yield fam
        if v.proxy is not None:
            gates: Labelled = ([(n, e) for n, e in v.engines if e.proxy is not None]
                               or [(None, v)])
            yield from _proxy_metrics(v.proxy, gates)
        yield from self._gauges(views)

    def _gauges(self, views: Labelled) -> Iterator[Metric]:
        # The fixed families above, and the sample names they make: a gauge must not
        # repeat one (a repeated family makes the whole exposition invalid).
        taken = {PREFIX + n for n in (
            "engine_state", "engine_ready", "engine_uptime_seconds", "throttle_level",
            "policy_paused", "policy_dry_run", "last_decision_timestamp_seconds",
            "proxy_in_flight", "proxy_held", "proxy_held_limit", "proxy_kv_breaker_open",
            "engine_not_running_seconds", "engine_startup_timeout_seconds")}
        for n in ("proxy_responses", "proxy_rejections", "proxy_connect_retries",
                  *(k.metric for k in KINDS)):
            taken |= {PREFIX + n, PREFIX + n + "_total", PREFIX + n + "_created",
                      PREFIX + n + "_bucket", PREFIX + n + "_count", PREFIX + n + "_sum"}
        for n in ("engine_restarts", "policy_trips", "policy_actions"):
            taken |= {PREFIX + n, PREFIX + n + "_total", PREFIX + n + "_created"}
        families: dict[str, GaugeMetricFamily] = {}
        for engine, view in views:
            seen: set[str] = set()
            for name, helptext, value in view.gauges:
                if not isinstance(name, str) or _METRIC_NAME.fullmatch(name) is None:
                    self.bad.once("exporter skips a gauge with a bad name", name=name)
                    continue
                if PREFIX + name in taken or name in seen:
                    self.bad.once("exporter skips a gauge whose name is taken", name=name)
                    continue
                seen.add(name)
                if value is None:
                    continue  # unknown: omitted, never 0
                try:
                    number = float(value)
                except (TypeError, ValueError):
                    self.bad.once("exporter skips a gauge whose value is not a number",
                                  name=name, value=repr(value))
                    continue
                fam = families.get(name)
                if fam is None:
                    fam = families[name] = _gauge(name, str(helptext),
                                                   views)
                fam.add_metric([engine] if engine is not None else [], number)
        yield from families.values()


def _proxy_metrics(p: ProxyView, gates: Labelled) -> Iterator[Metric]:
    codes = CounterMetricFamily(PREFIX + "proxy_responses", "proxy answers, by status code",
                                labels=["code"])
    for code, n in sorted(p.responses_by_code.items()):
        codes.add_metric([code], float(n))
    yield codes
    rejected = CounterMetricFamily(PREFIX + "proxy_rejections",
                                   "requests the proxy refused, by reason", labels=["reason"])
    for reason, n in sorted(p.rejections_by_reason.items()):
        rejected.add_metric([reason], float(n))
    yield rejected
    # the admission gate's numbers: one gate per engine
    gauges: list[tuple[str, str, Callable[[ProxyView], float]]] = [
            ("proxy_in_flight", "requests at the engine", lambda g: float(g.in_flight)),
            ("proxy_held", "requests waiting at the gate", lambda g: float(g.held)),
            ("proxy_held_limit", "the most requests that may wait at the gate "
             "(hold_queue_max)", lambda g: float(g.held_limit)),
            ("proxy_kv_breaker_open", "1 while the KV breaker stops admission",
             lambda g: float(g.kv_breaker_open))]
    for fname, helptext, get in gauges:
        fam = _gauge(fname, helptext, gates)
        for name, e in gates:
            gate = e.proxy if name is not None else p
            assert gate is not None
            fam.add_metric([name] if name is not None else [], get(gate))
        yield fam
    yield CounterMetricFamily(PREFIX + "proxy_connect_retries",
                              "requests sent again after the engine refused the connection",
                              value=float(p.connect_retries))
    outcomes = CounterMetricFamily(
        PREFIX + "proxy_continuations", "streams the engine failed mid-answer, by how they "
        "ended (continued, resent, closed, refused, failed, client_gone)", labels=["outcome"])
    for outcome in OUTCOMES:
        outcomes.add_metric([outcome], float(p.continuations.get(outcome, 0)))
    yield outcomes
    refusals = CounterMetricFamily(
        PREFIX + "proxy_continuation_refusals", "broken streams not continued, by why "
        "(continuation would not be exact)", labels=["reason"])
    for reason in REFUSALS:
        refusals.add_metric([reason], float(p.continuation_refusals.get(reason, 0)))
    yield refusals
    for kind in KINDS:
        family = HistogramMetricFamily(PREFIX + kind.metric, kind.help, labels=["model"])
        for h in p.latency:
            if h.kind != kind.name:
                continue
            buckets = [(("+Inf" if le == float("inf") else f"{le:g}"), float(n))
                       for le, n in h.buckets]
            family.add_metric([v for _, v in h.labels], buckets, sum_value=h.sum)
        yield family


def render_metrics(view: ExporterView, bad: _BadNames | None = None) -> bytes:
    """The Prometheus text exposition of a view. Raises on a view it cannot render."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_ViewCollector(view, bad if bad is not None else _BadNames()))
    # the daemon's own health: process_resident_memory_bytes, process_cpu_seconds_total,
    # open fds (a few reads of /proc/self, in memory)
    ProcessCollector(registry=registry)
    return generate_latest(registry)


@dataclass(frozen=True)
class _Answer:
    status: int
    body: bytes
    content_type: str = "text/plain; charset=utf-8"
    head_only: bool = False
    allow: bool = False  # send `Allow: GET, HEAD`

    def encode(self) -> bytes:
        headers = [f"HTTP/1.1 {self.status} {_REASONS[self.status]}",
                   f"Content-Type: {self.content_type}",
                   f"Content-Length: {len(self.body)}",
                   "Connection: close"]
        if self.allow:
            headers.append("Allow: GET, HEAD")
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
        self._bad = _BadNames()
        self._view_failing = False
        self._closing = False

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
            return _text(503, f"not ready: {view.state}\n", head_only=head_only)
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
