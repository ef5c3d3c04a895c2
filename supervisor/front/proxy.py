"""The front door: a reverse proxy on the public port, in front of the engine.

Owns the public listening socket and the requests on it; never the engine's lifecycle.
Every request passes the admission gate (`admission.Gate`): held during a drain or a
restart, limited by the throttle level, stopped by the KV breaker; then it is forwarded
to the engine's internal port and its answer streamed back chunk by chunk (SSE included),
status and headers kept. A client that goes away cancels its upstream request (the
server cancels its handler, which closes the upstream connection, and vLLM aborts the
request). The HTTP on both sides is the proxy's own, on httptools' parsers: the server
(`supervisor/front/server.py`) and the upstream client (`supervisor/front/upstream.py`).

Only the serving API is forwarded, and only by route (`supervisor/front/routes.py`): the
request target is read once, anything ambiguous refused with 400, the allow-list checked
on that one canonical path, and the upstream request line built from the same path,
sent as already encoded, so nothing normalises it again on the way (the upstream client,
`supervisor/front/upstream.py`, writes the target it is given). The engine's
administrative routes (`/sleep`, `/wake_up`, `/reset_*`, `/pause`, `/collective_rpc`,
`/server_info`...) are refused with 403: vLLM leaves them unauthenticated and only the
daemon calls them, on the internal port. Every refused path is logged with its peer and
counted by reason.

A connection refused by the engine means the request never reached it, so it goes back
to the gate (which holds it while the daemon restarts the engine) and is sent again. A
stream the engine fails mid-answer is continued token-exact on the engine that comes
back (`supervisor/front/continuation.py`, driven by `supervisor/front/streams.py`), with
blank keep-alive lines keeping the client's connection alive while it waits; one that
cannot be continued ends with an explicit error event and no `[DONE]`, never as a clean
but short answer. Any other answer the engine had started fails fast with 502, since it
cannot be saved. A request an engine that still serves drops unanswered (its connection
closed, its /health 200) is no death of the engine's: it is sent again at most twice,
then answered 502 (`streams.RESENDS_AFTER_DROP`). A request past its total deadline is
ended by `supervisor/front/request_timeout.py`. The proxy's own `/healthz` and `/readyz`
answer load balancers (`supervisor/front/readiness.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import math
import re
import socket
import time
from collections.abc import Callable

import structlog

from supervisor.front import (
    continuable,
    deadlines,
    dispatch,
    quarantine,
    readiness,
    request_timeout,
    routing,
)
from supervisor.front.admission import Gate, Rejected
from supervisor.front.continuation import Transcript
from supervisor.front.dispatch import Backend, Choice, RequestFacts, read_request
from supervisor.front.exchange import Exchange, ProxySettings, ProxyStats
from supervisor.front.latency import ClientLatency
from supervisor.front.messages import (
    BodyTooLarge,
    Request,
    Response,
    StreamResponse,
    json_response,
)
from supervisor.front.routes import LOCAL, PathRefused, Routes, Target, read_target
from supervisor.front.server import Limits, Server, connection_cap
from supervisor.front.streams import (
    HOP_BY_HOP,
    RESENDS_AFTER_DROP,
    TAIL_BYTES,
    Broken,
    NotDelivered,
    StreamRelay,
    UpstreamFailed,
    dropped_message,
    upstream_headers,
)
from supervisor.front.upstream import (
    BodyCut,
    ConnectFailed,
    Disconnected,
    Upstream,
    UpstreamError,
)
from supervisor.ops import descriptors
from supervisor.ops.logs import RequestLog

log = structlog.get_logger("supervisor.proxy")
access = RequestLog("supervisor.proxy")  # the access line: once per request

ENGINE_HEADER = "X-Supervisor-Engine"  # names the engine that answered
_ENGINE_LOW = ENGINE_HEADER.lower()
# A stream's head is held for its first event, to go in one write with it, at most this
# long: the client can do nothing with the head alone, and under a burst of new streams
# each write saved is a system call in the path of every first event.
HEAD_HOLD_S = 0.1
USAGE_TOKENS = re.compile(rb'"completion_tokens"\s*:\s*(\d+)')
# A non-streamed answer of at most this many bytes (its Content-Length) is read whole and
# sent in one write; a larger one, or one of unknown length, is relayed as it arrives.
WHOLE_MAX = 1 << 20


class FrontProxy:
    """The front door for one or more engines (`Backend`s, routed by model name). Built
    with a gate, it has one engine named `name` at `settings.upstream` at once."""

    def __init__(self, settings: ProxySettings, gate: Gate | None = None,
                 ready: Callable[[], bool] | None = None, name: str = "default",
                 lanes: quarantine.Lanes | None = None) -> None:
        self.s = settings
        self.stats = ProxyStats()
        self.latency = ClientLatency(settings.models)
        self.routes = Routes.serving(settings.extra_routes)
        self.backends: dict[str, Backend] = {}  # config order
        if gate is not None:
            self.add_engine(Backend(name, gate, ready or (lambda: True), settings.upstream,
                                    settings.models,
                                    settings.models_open or not settings.models))
        self._server: Server | None = None
        self._upstream: Upstream | None = None
        # the streams it can continue: relayed, paused, continued
        # requests that kill their engine (a worker's: the daemon's lanes)
        self.lanes: quarantine.Lanes = lanes if lanes is not None else quarantine.Quarantine()
        self.streams = StreamRelay(settings, self.stats, self.latency, self.lanes)
        self.worker: int | None = None  # its index, as one of several processes

    def add_engine(self, backend: Backend) -> None:
        """An engine to route to, after those there are (a reload adds one)."""
        self.backends[backend.name] = backend
        self._names_changed()

    def remove_engine(self, name: str) -> None:
        """An engine removed by reload: its models are no longer routed here."""
        self.backends.pop(name, None)
        self._names_changed()

    def set_fallback(self, name: str, fallback: str | None) -> None:
        if name in self.backends:
            self.backends[name].fallback = fallback or None

    def _names_changed(self) -> None:
        self.latency.models = frozenset(m for b in self.backends.values() for m in b.models)

    def ready(self) -> bool:
        """Every engine's models can be answered now: by the engine, or its fallback."""
        return readiness.ready(self.backends)

    async def start(self, sock: socket.socket | None = None) -> None:
        """Listen (on `sock`, a worker's, when given); raises ProxyError naming the
        address when it cannot."""
        # every request to the one handler, which reads the target itself
        s = self.s
        limits = Limits(max_line=s.max_header_bytes, max_field=s.max_header_bytes,
                        max_body=s.max_body_bytes, header_timeout_s=s.header_timeout_s,
                        body_timeout_s=s.body_timeout_s, send_timeout_s=s.send_timeout_s,
                        idle_timeout_s=s.idle_timeout_s,
                        max_connections=connection_cap(s.max_connections),
                        max_buffered=s.max_buffered_bytes, retry_after_s=s.retry_after_s)
        if limits.max_connections < s.max_connections:
            log.warning("proxy connections capped under the descriptor limit",
                        max_connections=s.max_connections, cap=limits.max_connections,
                        descriptors=descriptors.soft_limit())
        server = Server(self._handle, limits, refused=self._refused)
        try:
            await server.listen(self.s.listen_host, self.s.listen_port, sock)
        except OSError as exc:
            raise ProxyError(f"proxy cannot listen on {self.s.listen_host}:"
                             f"{self.s.listen_port}: {exc}") from exc
        self._server = server
        self._upstream = Upstream(self.s.connect_timeout_s, self.s.idle_read_timeout_s)
        self.streams.upstream = self._upstream
        log.info("proxy listening", host=self.s.listen_host, port=self.port,
                 upstream=self.s.upstream)

    def reconfigure(self, settings: ProxySettings) -> None:
        """Settings from a reloaded config, in force for the next request. What the
        listening socket and its HTTP parser were built with (the address, the body and
        header limits) stays until the daemon restarts (supervisor/settings/reload.py)."""
        self.s = dataclasses.replace(
            settings, listen_host=self.s.listen_host, listen_port=self.s.listen_port,
            max_body_bytes=self.s.max_body_bytes, max_header_bytes=self.s.max_header_bytes,
            upstream=self.s.upstream, models=self.s.models, models_open=self.s.models_open)
        self.routes = Routes.serving(settings.extra_routes)
        self.streams.s = self.s

    def pause_streams(self, engine: str) -> int:
        """Every stream of `engine` that can be continued leaves it now, to go on on its
        new engine (`StreamRelay.pause`). How many."""
        return self.streams.pause(engine)

    def in_flight_at(self, name: str, generation: int) -> int:
        """Requests sent to start `generation` of engine `name` and not yet over there."""
        b = self.backends.get(name)
        return b.at.get(generation, 0) if b is not None else 0

    def follow_engine(self, name: str, upstream: str, models: tuple[str, ...],
                      models_open: bool = False, priority_scheduling: bool = False) -> None:
        """Engine `name`, being started, listens here and serves these names: its requests
        from now on go there (a reloaded `engine.port` takes effect with the engine)."""
        self.backends[name].follow(upstream, models, models_open, priority_scheduling)
        self._names_changed()

    @property
    def port(self) -> int:
        assert self._server is not None
        return self._server.port

    async def close(self) -> None:
        if self._server is not None:
            await self._server.close()
        if self._upstream is not None:
            await self._upstream.close()

    # ---- requests -------------------------------------------------------------------

    def _refused(self, status: int | None, reason: str) -> None:
        """The server refused what it could not parse, what broke a limit or a deadline,
        or a connection above its cap."""
        if status is not None:
            self.stats.count(status)
        self.stats.reject(reason)

    def _error(self, status: int, message: str, reason: str | None = None,
               choices: list[Choice] | None = None) -> Response:
        headers = {"Retry-After": str(self._retry_after(choices))} if status == 503 else {}
        if reason is not None:
            self.stats.reject(reason)
        self.stats.count(status)
        body = {"error": {"message": message, "type": reason or "proxy_error", "code": status}}
        return json_response(body, status=status, headers=headers)

    def _retry_after(self, choices: list[Choice] | None) -> int:
        """A refusal's Retry-After: when the soonest of these engines is expected to serve
        (learned from its past starts), else `proxy.retry_after_s`."""
        now = time.monotonic()
        soon = [c.backend.gate.ready_at - now for c in choices or ()
                if c.backend.gate.ready_at is not None]
        if not soon:
            return self.s.retry_after_s
        return max(1, min(3600, math.ceil(min(soon))))

    def _cut(self, target: Target, request: Request, resp: StreamResponse,
             exc: BaseException, ex: Exchange) -> StreamResponse:
        """The answer had started: nothing to do but cut it, so the client sees an
        incomplete stream rather than a truncated success."""
        ex.outcome = "cut"
        self.stats.count(502)
        log.warning("engine answer cut", path=target.path, error=repr(exc))
        with contextlib.suppress(Exception):
            if request.transport is not None:
                request.transport.close()
        return resp

    async def _handle(self, request: Request) -> StreamResponse:
        ex = Exchange(arrived=time.monotonic())
        try:
            target = read_target(request.raw_path)
            if target.path in LOCAL:
                return readiness.answer(target.path, self.backends)
            self.routes.check(target.path)
        except PathRefused as exc:
            log.warning("request path refused", reason=exc.reason, status=exc.status,
                        method=request.method, path=request.raw_path[:512],
                        peer=request.remote, why=exc.message)
            return self._error(exc.status, exc.message, exc.reason)
        if (expect := request.expect) is not None \
                and request.version == (1, 1) and expect.lower() != "100-continue":
            return self._error(417, f"unknown Expect: {expect[:100]}", "bad_expect")
        try:
            # the whole body before a slot is asked for (as nginx buffers a request): a
            # slow body holds its connection, never a slot (tests/test_front_findings.py)
            body = await request.read()  # (a 100-continue answered first)
        except BodyTooLarge:
            return self._error(413, f"request body over {self.s.max_body_bytes} bytes",
                               "body_too_large")
        if target.path == "/v1/models" and request.method == "GET" and len(self.backends) > 1:
            return await self._list_models()
        try:
            facts = read_request(body)
        except RecursionError:  # (json's parser, on arrays nested thousands deep)
            return self._error(400, "request body nested too deeply", "bad_json")
        ex.model, ex.tokens = facts.model, facts.tokens
        try:
            choices = dispatch.choices(self.backends, facts, body)
        except routing.UnknownModel as exc:
            # a name no engine serves: 404 at once, never held through a restart
            ex.status, ex.outcome = 404, "unknown_model"
            self._finish(request, target, ex)
            return self._error(404, str(exc), "unknown_model")
        ex.request_timeout_s, ex.stall_timeout_s = deadlines.for_request(
            self.s.deadlines, facts.model, choices[0].backend.name if choices else None,
            self.s.request_timeout_s, self.s.stall_timeout_s)
        try:
            if ex.request_timeout_s > 0:
                return await request_timeout.within(
                    request, target.path, ex, self.stats, self._error,
                    lambda: self._admit_and_forward(request, target, facts, body, choices,
                                                    ex))
            return await self._admit_and_forward(request, target, facts, body, choices, ex)
        finally:
            self._finish(request, target, ex)

    async def _list_models(self) -> Response:
        """GET /v1/models with several engines: every model served here, each once, as
        the engines that serve now describe it (a down engine's by name alone)."""
        assert self._upstream is not None
        data: dict[str, dict[str, object]] = {}
        for b in self.backends.values():
            entries: list[dict[str, object]] = []
            if b.serving():
                with contextlib.suppress(TimeoutError, UpstreamError, ValueError,
                                         AttributeError):
                    status, text = await self._upstream.get(b.upstream, "/v1/models", 2.0)
                    if status == 200:
                        doc = json.loads(text)
                        entries = [e for e in doc.get("data", []) if isinstance(e, dict)]
            for m in b.models:
                if not any(e.get("id") == m for e in entries):
                    entries.append({"id": m, "object": "model", "owned_by": "vllm"})
            for e in entries:
                data.setdefault(str(e.get("id")), e)
        self.stats.count(200)
        return json_response({"object": "list", "data": list(data.values())})

    async def _admit_and_forward(self, request: Request, target: Target,
                                 facts: RequestFacts, body: bytes, choices: list[Choice],
                                 ex: Exchange) -> StreamResponse:
        broken: Broken | None = None
        give_up = time.monotonic() + choices[0].backend.gate.limits.max_wait_s
        drops = 0  # sends an engine that still serves closed unanswered
        while True:
            # (only a request no engine has died with: one that has must stay here, where
            # its deaths are counted, or a killer would travel the fleet unrefused)
            if self.s.refuse_when_unhealthy and ex.deaths == 0 \
                    and (why := readiness.all_unhealthy(choices)):
                ex.status, ex.outcome = 503, "engine_unavailable"
                return self._error(503, f"not served on this host now ({why}): try another",
                                   "engine_unavailable", choices)
            for c in choices:
                await self._learn_max_model_len(c.backend)
            try:
                choice, ticket = await dispatch.acquire_any(
                    choices, ex.tokens,
                    refusable=self.s.refuse_when_unhealthy and ex.deaths == 0)
            except Rejected as exc:
                ex.status, ex.outcome = 503, exc.reason
                if exc.held:
                    ex.held_s += exc.waited_s
                else:
                    ex.queued_s += exc.waited_s
                return self._error(503, str(exc), exc.reason, choices)
            if ticket.held:
                ex.held_s += ticket.waited_s
            else:
                ex.queued_s += ticket.waited_s
            ex.backend = choice.backend
            plan = continuable.plan(target.path, choice.body, choice.doc) \
                if self.s.continuation else None
            try:
                async with self.lanes.lane(choice.backend.name, ex.deaths):
                    ex.sent(choice.backend)
                    return await self._forward(request, target, choice.body, ex, plan)
            except Broken as exc:
                broken = exc  # continued below, once its ticket is given back
                break
            except NotDelivered as exc:
                # the engine refused the connection or is dying: the client has seen
                # nothing, and the request is routed again: to an engine that serves now,
                # or held while the daemon brings its own back (bounded by the hold timeout)
                if exc.reached:
                    ex.engine_failed()
                if ex.deaths >= quarantine.REFUSE_AT:
                    return self._refuse_killer(body, ex, exc)
                if exc.dropped and (drops := drops + 1) > RESENDS_AFTER_DROP:
                    ex.status, ex.outcome = 502, "engine_dropped"
                    return self._error(502, dropped_message(drops), "engine_dropped")
                self.stats.retried_connects += 1
                if time.monotonic() >= give_up:
                    ex.status, ex.outcome = 503, "hold_timeout"
                    return self._error(503, f"the engine did not come back: {exc}",
                                       "hold_timeout")
            finally:
                ex.left()
                choice.backend.gate.done(ticket)
            # (its slot given back first: a drain, a KV reset's, waits for no request that
            # is only waiting to go again)
            await asyncio.sleep(0.2)
            with contextlib.suppress(routing.UnknownModel):  # (removed by a reload)
                choices = dispatch.choices(self.backends, facts, body)
        return await self.streams.continue_stream(request, broken, ex)

    async def _learn_max_model_len(self, backend: Backend) -> None:
        """Where a token budget is set: the engine's max_model_len, asked of its
        /v1/models once per engine start while it serves, bounds each request's estimate
        (`Backend.budget`)."""
        start = backend.generation()
        if not backend.gate.limits.tokens or backend.max_model_len_asked == start \
                or not backend.serving():
            return
        assert self._upstream is not None
        backend.max_model_len_asked = start
        try:
            status, text = await self._upstream.get(backend.upstream, "/v1/models", 2.0)
        except (TimeoutError, UpstreamError):
            backend.max_model_len_asked = None  # asked again by the next request
            return
        with contextlib.suppress(ValueError):  # (not JSON: not vLLM's answer)
            if status == 200 and (n := dispatch.model_len_of(json.loads(text))) is not None:
                backend.max_model_len = n

    def _refuse_killer(self, body: bytes, ex: Exchange, exc: BaseException) -> Response:
        """A request the engine died of, each time it was sent: not sent again."""
        ex.status, ex.outcome = 502, quarantine.REASON
        log.warning("request refused", reason=quarantine.REASON, deaths=ex.deaths,
                    body=quarantine.digest(body), last_error=str(exc)[:300])
        return self._error(502, quarantine.refusal(ex.deaths), quarantine.REASON)

    def _finish(self, request: Request, target: Target, ex: Exchange) -> None:
        """The request is over: its latencies into the histograms, its one access line."""
        now = time.monotonic()
        label = self.latency.label(ex.model)
        observe = self.latency.observe
        observe("hold_wait", label, ex.held_s)
        observe("admission_wait", label, ex.queued_s)
        observe("duration", label, now - ex.arrived)
        if ex.stream and ex.first_chunk_at is not None:
            observe("ttft", label, ex.first_chunk_at - ex.arrived)
        if not access.enabled():
            return  # (no access line is written: its fields are not built)
        fields: dict[str, object] = {
            "method": request.method, "path": target.path, "status": ex.status,
            "duration_s": round(now - ex.arrived, 4), "peer": request.remote}
        if isinstance(ex.model, str):
            fields["model"] = ex.model[:128]
        if ex.backend is not None and len(self.backends) > 1:
            fields["engine"] = ex.backend.name
        if ex.outcome != "ok":
            fields["outcome"] = ex.outcome
        if ex.stream and ex.first_chunk_at is not None:
            fields["ttft_s"] = round(ex.first_chunk_at - ex.arrived, 4)
        if ex.transcript is not None and ex.transcript.plan.refused is None:
            fields["tokens"] = len(ex.transcript.delivered)
            if ex.transcript.attempt:
                fields["continuations"] = ex.transcript.attempt
                # (the longest from a continuation's answer beginning to its first token)
                fields["resumed_s"] = round(ex.resumed_s, 4)
        elif (m := USAGE_TOKENS.search(ex.tail)) is not None:
            fields["tokens"] = int(m[1])
        elif ex.stream:
            fields["stream_events"] = max(0, ex.events - 1)  # less the closing [DONE]
        if ex.held_s > 0:
            fields["held_s"] = round(ex.held_s, 3)
        if ex.queued_s > 0:
            fields["queued_s"] = round(ex.queued_s, 3)
        if self.worker is not None:
            fields["worker"] = self.worker
        access.info("request", **fields)

    def unhealthy(self) -> list[str]:
        """Why a router should not send requests here now, one line per engine whose
        models nothing else here answers; [] when every model is served now or within a
        short wait (docs/fleet.md)."""
        return readiness.unhealthy(self.backends)

    async def _forward(self, request: Request, target: Target, body: bytes,
                       ex: Exchange, plan: continuable.Plan | None) -> StreamResponse:
        assert self._upstream is not None and ex.backend is not None
        if plan is not None:
            body = plan.body
        resp: StreamResponse | None = None
        try:
            # the target as it came: the path checked is the path sent, not normalised
            call = self._upstream.request(request.method, ex.backend.upstream,
                                          target.upstream_path_qs, upstream_headers(request),
                                          body)
            # (a pause of its engine cuts it until it is answered; during one, it waits)
            if plan is not None and not self.streams.unanswered(ex, call, ex.backend.name):
                raise NotDelivered("paused before it was sent")
            try:
                await call.send()
            finally:
                self.streams.answered(ex)
            ex.cut_by_pause = False  # (answered as it was cut: its relay breaks instead)
            async with call as up:
                if up.status >= 500 and not await self.streams.still_serving(ex):
                    # nothing has reached the client, and the engine is dying (vLLM answers
                    # 500 to new requests between its core's death and its own exit) or
                    # was replaced meanwhile: the answer goes to the engine that serves
                    raise NotDelivered(f"HTTP {up.status} from a dying engine",
                                       reached=True)
                ex.stream = up.content_type == "text/event-stream"
                whole = (not ex.stream and up.content_length is not None
                         and up.content_length <= WHOLE_MAX and request.method != "HEAD"
                         and up.status not in (204, 304))
                if whole:
                    # a sized answer, read before the client is answered, then sent as
                    # one write, headers and body, with its length; an engine that fails
                    # inside it is as one that failed before answering: the client has
                    # seen nothing, and the request goes again
                    try:
                        data = await up.read()
                    except BodyCut as exc:
                        if await self.streams.still_serving(ex):
                            # (a healthy engine that cut its answer: asked again, it may
                            # cut it again; the client has seen nothing: an explicit 502)
                            raise UpstreamFailed(
                                f"the engine cut its answer: {exc!r}") from exc
                        raise NotDelivered(f"the engine's answer was cut: {exc!r}",
                                           reached=True) from exc
                    resp = Response(status=up.status, reason=up.reason, body=data)
                    ex.tail = data[-TAIL_BYTES:]
                else:
                    resp = StreamResponse(status=up.status, reason=up.reason)
                # the engine's end-to-end fields, and which engine answered (in place of
                # any field of that name it sent)
                resp.headers.items = [(k, v) for k, v in up.headers
                                      if (low := k.lower()) not in HOP_BY_HOP
                                      and low != _ENGINE_LOW]
                resp.headers.items.append((ENGINE_HEADER, ex.backend.name))
                ex.status = up.status
                try:
                    # (a stream's head goes with its first event: `HEAD_HOLD_S`)
                    await resp.prepare(request, HEAD_HOLD_S if ex.stream else 0.0)
                    ex.resp = resp
                    if plan is not None and ex.stream:
                        ex.transcript = Transcript(plan)
                        await self.streams.relay_events(up, resp, ex, ex.transcript)
                    elif not whole:
                        await self.streams.relay(up, resp, ex)
                    await resp.write_eof()  # (a whole answer: its one write)
                except ConnectionError:
                    # the client went away: leaving this block closes the upstream
                    # connection, and vLLM aborts the request
                    ex.status, ex.outcome = 499, "client_gone"
                    self.stats.count(499)
                    self.stats.reject("client_gone")
                    return resp
                self.stats.count(up.status)
                if up.status == 200 and target.path in continuable.CONTINUABLE \
                        and ex.sent_to is not None:
                    backend, start, sent_at = ex.sent_to
                    backend.served(start, sent_at)  # a generation, whole: it serves
                return resp
        except ConnectFailed as exc:
            # refused: the request never reached the engine, and can go again
            raise NotDelivered(repr(exc)) from exc
        except Disconnected as exc:
            # the engine went while it had the request, or dropped it while it serves:
            # no answer has begun, so the client has seen nothing
            raise await self.streams.not_delivered(ex, exc) from exc
        except (TimeoutError, UpstreamError, UpstreamFailed) as exc:
            if resp is not None and resp.prepared:
                return self._cut(target, request, resp, exc, ex)
            ex.status, ex.outcome = 502, "engine_failed"
            return self._error(502, f"the engine failed during the request: "
                                    f"{type(exc).__name__}: {exc}", "engine_failed")

class ProxyError(Exception):
    pass

