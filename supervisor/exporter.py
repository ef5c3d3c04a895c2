"""The daemon's own HTTP exporter: `/metrics` (Prometheus text), `/healthz`, `/readyz`.

A small asyncio server, bounded everywhere: one request per connection, an 8 KiB request
head read within `head_timeout_s`, at most `max_connections` at once (more get 503), and
a view callback answered within `view_timeout_s`. The view comes from the daemon's
state-owning task (through its queue), so `/healthz` answers 503 when that task is stuck.
It only reads the view: nothing here changes the daemon's state.

Names follow Prometheus conventions under the prefix `vllm_supervisor_`: base units,
`_total` counters, one series per engine state.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import structlog
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

log = structlog.get_logger("supervisor.exporter")

PREFIX = "vllm_supervisor_"
STATES = ("STARTING", "RUNNING", "DRAINING", "STOPPING", "BACKOFF", "FATAL", "STOPPED")
_NAME = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")
MAX_HEAD = 8192


@dataclass(frozen=True)
class ExporterView:
    state: str
    ready: bool  # engine serving and not draining
    throttle_level: int
    restarts_by_reason: Mapping[str, int]
    trips_by_rule: Mapping[str, int]
    actions_by_kind: Mapping[str, int]
    last_decision_wall: float | None
    policy_paused: bool
    dry_run: bool
    engine_uptime_s: float | None
    gauges: Sequence[tuple[str, str, float | None]]  # (name, help, value); None: omitted


class ExporterError(Exception):
    pass


def parse_listen(listen: str) -> tuple[str, int]:
    """"127.0.0.1:9402", "[::1]:9402", "localhost:0" -> (host, port)."""
    host, sep, port = listen.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"expected HOST:PORT (e.g. 127.0.0.1:9402 or [::1]:9402), "
                         f"got {listen!r}")
    return host, int(port)


class _ViewCollector(Collector):
    def __init__(self, view: ExporterView, bad_names: set[str]) -> None:
        self.view = view
        self.bad_names = bad_names

    def collect(self) -> Iterator[Metric]:
        v = self.view
        state = GaugeMetricFamily(PREFIX + "engine_state", "engine state (1 = current)",
                                  labels=["state"])
        for s in STATES:
            state.add_metric([s], 1.0 if s == v.state else 0.0)
        yield state
        yield GaugeMetricFamily(PREFIX + "engine_ready",
                                "1 while the engine serves and is not draining",
                                value=float(v.ready))
        if v.engine_uptime_s is not None:
            yield GaugeMetricFamily(PREFIX + "engine_uptime_seconds",
                                    "seconds since the engine became healthy",
                                    value=v.engine_uptime_s)
        for name, helptext, label, values in (
                ("engine_restarts", "engine restarts by reason", "reason",
                 v.restarts_by_reason),
                ("policy_trips", "policy decisions by rule (dry-run included)", "rule",
                 v.trips_by_rule),
                ("policy_actions", "policy actions carried out, by kind", "action",
                 v.actions_by_kind)):
            c = CounterMetricFamily(PREFIX + name, helptext, labels=[label])
            for key, n in sorted(values.items()):
                c.add_metric([key], float(n))
            yield c
        yield GaugeMetricFamily(PREFIX + "throttle_level", "throttle level in force",
                                value=float(v.throttle_level))
        yield GaugeMetricFamily(PREFIX + "policy_paused", "1 while the policy is paused",
                                value=float(v.policy_paused))
        yield GaugeMetricFamily(PREFIX + "policy_dry_run", "1 when the policy only reports",
                                value=float(v.dry_run))
        if v.last_decision_wall is not None:
            yield GaugeMetricFamily(PREFIX + "last_decision_timestamp_seconds",
                                    "unix time of the last decision",
                                    value=v.last_decision_wall)
        for name, helptext, value in v.gauges:
            if not _NAME.match(name):
                if name not in self.bad_names:
                    self.bad_names.add(name)
                    log.warning("exporter skips a gauge with a bad name", name=name)
                continue
            if value is not None:
                yield GaugeMetricFamily(PREFIX + name, helptext, value=value)


class Exporter:
    def __init__(self, listen: str, view: Callable[[], Awaitable[ExporterView]], *,
                 view_timeout_s: float = 2.0, head_timeout_s: float = 5.0,
                 max_connections: int = 64) -> None:
        self.listen = listen
        self._view = view
        self.view_timeout_s = view_timeout_s
        self.head_timeout_s = head_timeout_s
        self.max_connections = max_connections
        self._server: asyncio.Server | None = None
        self._open = 0
        self._bad_names: set[str] = set()

    @property
    def port(self) -> int:
        assert self._server is not None and self._server.sockets
        return int(self._server.sockets[0].getsockname()[1])

    async def start(self) -> None:
        try:
            host, port = parse_listen(self.listen)
            self._server = await asyncio.start_server(self._handle, host, port,
                                                      limit=MAX_HEAD * 2)
        except (OSError, ValueError) as exc:
            raise ExporterError(f"exporter cannot listen on {self.listen}: {exc}") from exc
        log.info("exporter listening", listen=self.listen, port=self.port)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2.0)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._open += 1
        try:
            if self._open > self.max_connections:
                await _respond(writer, 503, "too many connections\n")
                return
            try:
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"),
                                              self.head_timeout_s)
            except asyncio.LimitOverrunError:
                await _respond(writer, 431, "request head too large\n")
                return
            except (TimeoutError, asyncio.IncompleteReadError, ConnectionError):
                return  # silent or gone: just close
            if len(head) > MAX_HEAD:
                await _respond(writer, 431, "request head too large\n")
                return
            await self._answer(head, writer)
        except Exception:  # one bad connection must never reach the loop
            log.warning("exporter request failed", exc_info=True)
        finally:
            self._open -= 1
            writer.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(writer.wait_closed(), 1.0)

    async def _answer(self, head: bytes, writer: asyncio.StreamWriter) -> None:
        try:
            line = head.split(b"\r\n", 1)[0].decode("ascii")
            method, target, version = line.split(" ")
            if not version.startswith("HTTP/1."):
                raise ValueError(version)
        except (UnicodeDecodeError, ValueError):
            await _respond(writer, 400, "bad request\n")
            return
        path = target.split("?", 1)[0]
        if path not in ("/metrics", "/healthz", "/readyz"):
            await _respond(writer, 404, "not found: try /metrics, /healthz, /readyz\n",
                           head_only=method == "HEAD")
            return
        if method not in ("GET", "HEAD"):
            await _respond(writer, 405, "method not allowed\n",
                           extra={"Allow": "GET, HEAD"})
            return
        head_only = method == "HEAD"
        try:
            view = await asyncio.wait_for(self._view(), self.view_timeout_s)
        except Exception as exc:  # stuck or gone: the daemon's core is not answering
            code = 503 if path != "/metrics" else 500
            await _respond(writer, code, f"the daemon did not answer: {type(exc).__name__}\n",
                           head_only=head_only)
            return
        if path == "/healthz":
            await _respond(writer, 200, "ok\n", head_only=head_only)
        elif path == "/readyz":
            if view.ready:
                await _respond(writer, 200, "ready\n", head_only=head_only)
            else:
                await _respond(writer, 503, f"not ready: {view.state}\n", head_only=head_only)
        else:
            registry = CollectorRegistry(auto_describe=False)
            registry.register(_ViewCollector(view, self._bad_names))
            await _respond(writer, 200, generate_latest(registry),
                           content_type=CONTENT_TYPE_LATEST, head_only=head_only)


_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
            431: "Request Header Fields Too Large", 500: "Internal Server Error",
            503: "Service Unavailable"}


async def _respond(writer: asyncio.StreamWriter, code: int, body: str | bytes, *,
                   content_type: str = "text/plain; charset=utf-8", head_only: bool = False,
                   extra: Mapping[str, str] | None = None) -> None:
    data = body.encode() if isinstance(body, str) else body
    headers = {"Content-Type": content_type, "Content-Length": str(len(data)),
               "Connection": "close", **(extra or {})}
    head = f"HTTP/1.1 {code} {_REASONS.get(code, '')}\r\n" + "".join(
        f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n"
    writer.write(head.encode() + (b"" if head_only else data))
    with contextlib.suppress(ConnectionError, TimeoutError):
        await asyncio.wait_for(writer.drain(), 5.0)
