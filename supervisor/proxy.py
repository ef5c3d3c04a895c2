"""The front door: a reverse proxy on the public port, in front of the engine.

Owns the public listening socket and the requests on it; never the engine's lifecycle.
Every request passes the admission gate (`admission.Gate`): held during a drain or a
restart, limited by the throttle level, stopped by the KV breaker; then it is forwarded
to the engine's internal port and its answer streamed back chunk by chunk (SSE included),
status and headers kept. A client that goes away cancels its upstream request (aiohttp's
handler cancellation closes the upstream connection, and vLLM aborts the request).

Only the serving API is forwarded, and only by route (`supervisor/routes.py`): the
request target is read once, anything ambiguous refused with 400, the allow-list checked
on that one canonical path, and the upstream request line built from the same path,
sent as already encoded, so no URL library normalises it again on the way. The engine's
administrative routes (`/sleep`, `/wake_up`, `/reset_*`, `/pause`, `/collective_rpc`,
`/server_info`...) are refused with 403: vLLM leaves them unauthenticated and only the
daemon calls them, on the internal port. Every refused path is logged with its peer and
counted by reason.

A connection refused by the engine means the request never reached it, so it goes back
to the gate (which holds it while the daemon restarts the engine) and is sent again; a
request the engine had started fails fast with 502 and a clear error, since it cannot be
saved. The proxy's own `/healthz` and `/readyz` answer load balancers.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import aiohttp
import structlog
from aiohttp import web
from yarl import URL

from supervisor.admission import Gate, Rejected
from supervisor.routes import LOCAL, PathRefused, Routes, Target, read_target

log = structlog.get_logger("supervisor.proxy")

HOP_BY_HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te",
              "trailer", "transfer-encoding", "upgrade", "host", "content-length"}
HOLD_BUCKETS = (0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


@dataclass
class ProxyStats:
    """Counters for the exporter; the proxy's handlers update them on the loop's thread."""

    responses: dict[str, int] = field(default_factory=dict)  # status code -> count
    rejections: dict[str, int] = field(default_factory=dict)  # reason -> count
    hold_wait_buckets: list[int] = field(default_factory=lambda: [0] * len(HOLD_BUCKETS))
    hold_wait_count: int = 0
    hold_wait_sum: float = 0.0
    retried_connects: int = 0

    def count(self, status: int) -> None:
        self.responses[str(status)] = self.responses.get(str(status), 0) + 1

    def reject(self, reason: str) -> None:
        self.rejections[reason] = self.rejections.get(reason, 0) + 1

    def waited(self, seconds: float) -> None:
        self.hold_wait_count += 1
        self.hold_wait_sum += seconds
        for i, le in enumerate(HOLD_BUCKETS):
            if seconds <= le:
                self.hold_wait_buckets[i] += 1


@dataclass
class ProxySettings:
    listen_host: str
    listen_port: int
    upstream: str  # http://127.0.0.1:8100
    max_body_bytes: int = 16 << 20
    max_header_bytes: int = 16 << 10
    retry_after_s: int = 5
    extra_routes: tuple[str, ...] = ()
    connect_timeout_s: float = 5.0
    idle_read_timeout_s: float = 600.0  # between two chunks of an answer


def estimate_tokens(body: bytes) -> int:
    """Prompt tokens (about 4 characters each) plus max_tokens: a cheap, safe over-estimate
    for the token budget. Unparseable bodies count as their length / 4."""
    try:
        doc = json.loads(body) if body else {}
    except ValueError:
        return len(body) // 4
    if not isinstance(doc, dict):
        return len(body) // 4
    prompt = doc.get("prompt", doc.get("messages", doc.get("input", "")))
    text = prompt if isinstance(prompt, str) else json.dumps(prompt)
    out = doc.get("max_tokens", doc.get("max_completion_tokens", 16))
    out = out if isinstance(out, int) and not isinstance(out, bool) and out > 0 else 16
    return len(text) // 4 + out


class FrontProxy:
    def __init__(self, settings: ProxySettings, gate: Gate,
                 ready: Callable[[], bool]) -> None:
        self.s = settings
        self.gate = gate
        self.ready = ready  # the daemon's view: engine serving and the gate open
        self.stats = ProxyStats()
        self.routes = Routes.serving(settings.extra_routes)
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        """Listen; raises ProxyError naming the address when it cannot."""
        app = web.Application(client_max_size=self.s.max_body_bytes)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(
            app, handle_signals=False, access_log=None, handler_cancellation=True,
            max_line_size=self.s.max_header_bytes, max_field_size=self.s.max_header_bytes)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.s.listen_host, self.s.listen_port,
                           reuse_address=True)
        try:
            await site.start()
        except OSError as exc:
            await self._runner.cleanup()
            raise ProxyError(f"proxy cannot listen on {self.s.listen_host}:"
                             f"{self.s.listen_port}: {exc}") from exc
        self._session = aiohttp.ClientSession(
            # idle upstream connections are dropped before uvicorn's own 5 s keep-alive
            # timeout closes them under us
            connector=aiohttp.TCPConnector(limit=0, force_close=False, keepalive_timeout=4.0),
            auto_decompress=False, timeout=aiohttp.ClientTimeout(
                total=None, connect=self.s.connect_timeout_s,
                sock_read=self.s.idle_read_timeout_s))
        log.info("proxy listening", host=self.s.listen_host, port=self.port,
                 upstream=self.s.upstream)

    @property
    def port(self) -> int:
        assert self._runner is not None
        for site in self._runner.sites:
            server = getattr(site, "_server", None)
            if server is not None and server.sockets:
                return int(server.sockets[0].getsockname()[1])
        return self.s.listen_port

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()

    # ---- requests -------------------------------------------------------------------

    def _error(self, status: int, message: str, reason: str | None = None) -> web.Response:
        headers = {"Retry-After": str(self.s.retry_after_s)} if status == 503 else {}
        if reason is not None:
            self.stats.reject(reason)
        self.stats.count(status)
        body = {"error": {"message": message, "type": reason or "proxy_error", "code": status}}
        return web.json_response(body, status=status, headers=headers)

    def _cut(self, target: Target, request: web.Request, resp: web.StreamResponse,
             exc: BaseException) -> web.StreamResponse:
        """The answer had started: nothing to do but cut it, so the client sees an
        incomplete stream rather than a truncated success."""
        self.stats.count(502)
        log.warning("engine answer cut", path=target.path, error=repr(exc))
        with contextlib.suppress(Exception):
            if request.transport is not None:
                request.transport.close()
        return resp

    async def _engine_healthy(self) -> bool:
        assert self._session is not None
        try:
            async with self._session.get(self.s.upstream + "/health",
                                         timeout=aiohttp.ClientTimeout(total=2.0)) as r:
                return r.status == 200
        except (TimeoutError, aiohttp.ClientError):
            return False

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        try:
            target = read_target(request.raw_path)
            if target.path in LOCAL:
                return self._answer_locally(target.path)
            self.routes.check(target.path)
        except PathRefused as exc:
            log.warning("request path refused", reason=exc.reason, status=exc.status,
                        method=request.method, path=request.raw_path[:512],
                        peer=request.remote, why=exc.message)
            return self._error(exc.status, exc.message, exc.reason)
        try:
            body = await request.read()
        except web.HTTPRequestEntityTooLarge:
            return self._error(413, f"request body over {self.s.max_body_bytes} bytes",
                               "body_too_large")
        tokens = estimate_tokens(body)
        give_up = time.monotonic() + self.gate.limits.max_wait_s
        while True:
            try:
                ticket = await self.gate.acquire(tokens)
            except Rejected as exc:
                return self._error(503, str(exc), exc.reason)
            if ticket.waited_s > 0:
                self.stats.waited(ticket.waited_s)
            try:
                return await self._forward(request, target, body)
            except _NotDelivered as exc:
                # the engine refused the connection or is dying: the client has seen
                # nothing, and the gate holds the request while the daemon brings the
                # engine back (bounded by the hold timeout)
                self.stats.retried_connects += 1
                if time.monotonic() >= give_up:
                    return self._error(503, f"the engine did not come back: {exc}",
                                       "hold_timeout")
                await asyncio.sleep(0.2)
            finally:
                self.gate.done(ticket)

    def _answer_locally(self, path: str) -> web.Response:
        """/healthz: the daemon runs. /readyz, and vLLM's /health and /ping for clients
        that probe those: the engine serves and the gate is open (the daemon's view, which
        sees a frozen engine whose own /health still says 200)."""
        if path == "/healthz" or self.ready():
            return web.Response(text="ok\n" if path == "/healthz" else "ready\n")
        return web.Response(status=503, text="not ready\n")

    async def _forward(self, request: web.Request, target: Target,
                       body: bytes) -> web.StreamResponse:
        assert self._session is not None
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}
        # as already encoded: the path checked is the path sent, not normalised again
        url = URL(self.s.upstream + target.upstream_path_qs, encoded=True)
        resp: web.StreamResponse | None = None
        try:
            async with self._session.request(request.method, url, headers=headers, data=body,
                                             allow_redirects=False) as up:
                if up.status >= 500 and not await self._engine_healthy():
                    # nothing has reached the client, and the engine is dying (vLLM answers
                    # 500 to new requests between its core's death and its own exit): the
                    # answer goes to the engine that replaces it instead
                    raise _NotDelivered(f"HTTP {up.status} from a dying engine")
                resp = web.StreamResponse(status=up.status, reason=up.reason)
                for k, v in up.headers.items():
                    if k.lower() not in HOP_BY_HOP:
                        resp.headers.add(k, v)
                try:
                    await resp.prepare(request)
                    async for chunk in _chunks(up):
                        await resp.write(chunk)
                    await resp.write_eof()
                except (ConnectionError, aiohttp.ClientConnectionResetError):
                    # the client went away: leaving this block closes the upstream
                    # connection, and vLLM aborts the request
                    self.stats.count(499)
                    self.stats.reject("client_gone")
                    return resp
                self.stats.count(up.status)
                return resp
        except (aiohttp.ClientConnectorError, aiohttp.ServerDisconnectedError,
                aiohttp.ClientOSError) as exc:
            if resp is None or not resp.prepared:
                # refused, or a kept-alive connection the engine had closed: no answer has
                # begun, so the client has seen nothing and the request can go again
                raise _NotDelivered(repr(exc)) from exc
            if isinstance(exc, aiohttp.ClientConnectorError):
                raise
            return self._cut(target, request, resp, exc)
        except (TimeoutError, aiohttp.ClientError, _UpstreamFailed) as exc:
            if resp is not None and resp.prepared:
                return self._cut(target, request, resp, exc)
            return self._error(502, f"the engine failed during the request: "
                                    f"{type(exc).__name__}: {exc}", "engine_failed")


async def _chunks(up: aiohttp.ClientResponse) -> AsyncIterator[bytes]:
    """The upstream body as it arrives; an upstream failure is raised as _UpstreamFailed,
    so that it is never mistaken for the client going away."""
    try:
        async for chunk in up.content.iter_any():
            yield chunk
    except (TimeoutError, aiohttp.ClientError) as exc:
        raise _UpstreamFailed(exc) from exc


class _UpstreamFailed(Exception):
    pass


class ProxyError(Exception):
    pass


class _NotDelivered(Exception):
    """The engine refused the connection: the request never reached it."""
