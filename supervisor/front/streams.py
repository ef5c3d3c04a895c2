"""The front door's continuable streams: relayed event by event, paused for a drained
restart, continued when their engine fails them (`supervisor/front/continuation.py` is the pure
half: the plan, the refusal rules, the transcript and its reframing).

`StreamRelay` owns those streams for the proxy (`supervisor/front/proxy.py`), which
gives it its settings, counters, histograms and upstream client, and nothing else.
A broken stream keeps its client's connection: it gives back its slot at the gate
(a drain does not wait for it), waits at most `proxy.continue_timeout_s` for the gate
to admit it again with blank keep-alive lines meanwhile, and goes on from the engine
that answers; or ends with an explicit error event, never a clean but short answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import structlog

from supervisor.front import continuation, quarantine, sse
from supervisor.front.admission import Rejected, Ticket
from supervisor.front.continuation import StreamBroken, Transcript
from supervisor.front.dispatch import UNKNOWN_MODEL_LEN, Backend
from supervisor.front.exchange import Exchange, ProxySettings, ProxyStats
from supervisor.front.latency import ClientLatency
from supervisor.front.messages import Request, StreamResponse
from supervisor.front.upstream import (
    Answer,
    Call,
    ConnectFailed,
    Disconnected,
    Upstream,
    UpstreamError,
)

log = structlog.get_logger("supervisor.proxy")

# What a waiting stream gets every `keepalive_s`: two blank lines, an empty event block
# that every SSE parser skips. Not an SSE comment (`: keep-alive`): vLLM's own benchmark
# client strips each read and glues it to its buffer, so a comment arriving alone heads
# the buffer and every event after it is dropped with it (issue 20: 115 of 128 resent
# streams seen as failed on an H100, continued ones short); a naive client that splits on
# blank lines and reads `data:` lines drops a comment too, and one blank line alone would
# shift its next event by a newline.
KEEPALIVE = b"\n\n"
TAIL_BYTES = 1024  # of an answer, kept to read its usage from
# A request a healthy engine dropped (its connection closed before any answer, the engine
# still serving) is no death of the engine's, and asked again it may be dropped again:
# sent again at most this many times, then failed with 502 (an error event in a stream).
RESENDS_AFTER_DROP = 2
# (and `expect`: the proxy answered a client's 100-continue itself, and has the body)
HOP_BY_HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te",
              "trailer", "transfer-encoding", "upgrade", "host", "content-length", "expect"}
_HOP_BY_HOP = frozenset(n.encode() for n in HOP_BY_HOP)
_HOP_LENGTHS = frozenset(len(n) for n in HOP_BY_HOP)


class StreamRelay:
    """The front door's continuable streams: relayed through their transcripts, paused
    for a drained restart, continued when their engine fails them. `s` follows the
    proxy's reloaded settings; `upstream` is the proxy's upstream client once it listens."""

    def __init__(self, settings: ProxySettings, stats: ProxyStats, latency: ClientLatency,
                 lanes: quarantine.Lanes) -> None:
        self.s = settings
        self.stats = stats
        self.latency = latency
        self.lanes = lanes
        self.upstream: Upstream | None = None
        # continuable streams being relayed: id(transcript) -> (it, its engine answer,
        # the engine's name)
        self._relays: dict[int, tuple[Transcript, Answer, str]] = {}
        # engines whose streams were paused while their gate holds new requests: a stream
        # admitted before the hold whose answer begins only now is paused too
        self._pausing: set[str] = set()
        # continuable requests sent and not yet answered: id(exchange) -> (it, its call,
        # the engine's name); a pause cuts them, to go again (nothing reached the client)
        self._unanswered: dict[int, tuple[Exchange, Call, str]] = {}

    async def engine_healthy(self, backend: Backend) -> bool:
        assert self.upstream is not None
        try:
            status, _ = await self.upstream.get(backend.upstream, "/health", 2.0)
        except (TimeoutError, UpstreamError):
            return False
        return status == 200

    async def still_serving(self, ex: Exchange) -> bool:
        """The engine start the request was sent to still serves: its /health says 200
        and no other start has taken its place. A /health answered by the start that
        replaced it (a failover between the request and the question) says nothing of
        the one that had the request."""
        assert ex.sent_to is not None
        backend, start, _ = ex.sent_to
        return (backend.generation() == start and await self.engine_healthy(backend)
                and backend.generation() == start)

    def unanswered(self, ex: Exchange, call: Call, engine: str) -> bool:
        """A continuable request about to be sent to `engine`, its answer not begun
        (until `answered`); False: not to be sent, its engine pausing now (admitted just
        before the pause's hold, after the pause cut the others: it would wait for a
        place in the batch the pause is emptying)."""
        assert ex.backend is not None
        if engine in self._pausing and ex.backend.gate.held_reason is not None:
            return False
        self._unanswered[id(ex)] = (ex, call, engine)
        return True

    def answered(self, ex: Exchange) -> None:
        self._unanswered.pop(id(ex), None)

    async def not_delivered(self, ex: Exchange, exc: Disconnected) -> NotDelivered:
        """The engine closed the connection before answering: a death the request was
        at when the engine is going, a drop when it still serves (`dropped`: no death,
        never a failure seen at that engine start, and re-sent a bounded number of
        times: RESENDS_AFTER_DROP). Still serving means the same engine start: a /health
        answered by the start that replaced it says nothing of the one that had it.
        Cut by a pause (`pause`): neither, it goes again once the engine serves."""
        if ex.cut_by_pause:
            ex.cut_by_pause = False
            return NotDelivered(f"paused before its answer began ({exc!r})")
        if await self.still_serving(ex):
            return NotDelivered(f"{exc!r}, the engine still serving", dropped=True)
        return NotDelivered(repr(exc), reached=True)

    async def _write(self, resp: StreamResponse, ex: Exchange, data: bytes) -> None:
        """Bytes of a continuable stream to its client, timed as `relay` times them."""
        await resp.write(data)
        self._timed(ex, data, time.monotonic())

    def _timed(self, ex: Exchange, data: bytes, now: float) -> None:
        """`data` reached the client's socket at `now`: the stream's times, its events."""
        label = self.latency.label(ex.model)
        if ex.first_chunk_at is None:
            ex.first_chunk_at = now
        elif ex.gap_from is not None:  # the first answer bytes after a fault
            self.latency.observe("continuation_gap", label, now - ex.gap_from)
            ex.gap_from = None
            ex.resumed(now)
        else:
            self.latency.observe("stream_gap", label, now - ex.last_data_at)
        ex.last_write_at = ex.last_data_at = now
        ex.events += data.count(b"data:")

    async def relay_events(self, up: Answer, resp: StreamResponse,
                            ex: Exchange, t: Transcript) -> None:
        """A continuable stream, event by event through its transcript (token ids recorded
        and removed, a continuation reframed); returns at its [DONE], raises Broken when
        the engine fails it."""
        t.new_reader()
        t.paused = False
        assert ex.backend is not None
        self._relays[id(t)] = (t, up, ex.backend.name)
        if ex.backend.name in self._pausing:
            if ex.backend.gate.held_reason is None:
                self._pausing.discard(ex.backend.name)  # (the hold is over)
            elif t.refusal() is None:
                # sent before the hold, its answer only beginning now (vLLM under load
                # answers late): it leaves the engine too, rather than run to its end
                # while everything else waits (18 of 256 did on the H100)
                t.paused = True
                up.close()
        # (the path of every event of every stream: each engine read taken in the
        # upstream connection's own callback (`Answer.pump`), no task woken per event;
        # the write without a coroutine; the histogram found once)
        transcribe, write, end, clock = t.read, resp.write_nowait, resp.end_nowait, \
            time.monotonic
        if (stall := ex.stall_timeout_s) > 0:  # (no token that long: the engine's fault)
            up.set_read_timeout(min(stall, self.s.idle_read_timeout_s))
        gaps = self.latency.histogram("stream_gap", self.latency.label(ex.model))
        behind: list[bytes] = []  # written past the client's full buffer: timed once drained

        def sink(chunk: bytes) -> bool:
            out = transcribe(chunk)  # one write per read: the socket coalesced them
            if out:
                # (the [DONE] event and the body's end: one write)
                if not (end(out) if t.done else write(out)):
                    behind.append(out)
                    return False
                now = clock()
                if ex.first_chunk_at is None or ex.gap_from is not None:
                    self._timed(ex, out, now)
                else:  # (`_timed`'s common case, inline)
                    gaps.observe(now - ex.last_data_at)
                    ex.last_write_at = ex.last_data_at = now
                    ex.events += out.count(b"data:")
            return not t.done

        try:
            while True:
                try:
                    ended = await up.pump(sink)
                except TimeoutError as exc:
                    if stall > 0:
                        up.close()  # (so vLLM aborts it: it goes on elsewhere)
                        raise Stalled(stall, t.events) from exc
                    raise UpstreamFailed(exc) from exc
                except UpstreamError as exc:
                    raise UpstreamFailed(exc) from exc
                except StreamBroken as exc:
                    # what was recorded as delivered is delivered, even on a break
                    if exc.partial:
                        await self._write(resp, ex, exc.partial)
                    raise
                if behind:
                    await resp.drain()
                    self._timed(ex, behind.pop(), clock())
                if t.done:
                    return
                if ended:
                    break
        except (UpstreamFailed, StreamBroken) as exc:
            raise Broken(resp, t, Paused() if t.paused else exc) from exc
        finally:
            self._relays.pop(id(t), None)
        raise Broken(resp, t, Paused() if t.paused else StreamBroken(
            "the engine's stream ended before the answer's end"))

    async def relay(self, up: Answer, resp: StreamResponse, ex: Exchange) -> None:
        """An answer that is not continued (a sized one's body, or a stream the proxy
        cannot continue), chunk by chunk as it arrives (each engine read handed on from the
        upstream connection's callback, `Answer.pump`); the stream's gaps as the client
        gets them, and the answer's tail (where its usage is) for the access line."""
        gaps = self.latency.histogram("stream_gap", self.latency.label(ex.model))
        write, end, clock = resp.write_nowait, resp.end_nowait, time.monotonic
        last = 0.0
        behind: list[bytes] = []  # written past the client's full buffer: timed once drained

        def timed(chunk: bytes) -> None:
            nonlocal last
            now = clock()
            if ex.first_chunk_at is None:
                ex.first_chunk_at = now
            elif ex.stream:
                gaps.observe(now - last)
            last = now
            if ex.stream:
                ex.events += chunk.count(b"data:")
            ex.tail = (chunk[-TAIL_BYTES:] if len(chunk) >= TAIL_BYTES
                       else (ex.tail + chunk)[-TAIL_BYTES:])

        def sink(chunk: bytes) -> bool:
            # (the answer's last bytes and its end: one write)
            if not (end(chunk) if up.complete else write(chunk)):
                behind.append(chunk)
                return False
            timed(chunk)
            return True

        while True:
            try:
                ended = await up.pump(sink)
            except (TimeoutError, UpstreamError) as exc:
                raise UpstreamFailed(exc) from exc
            if behind:
                await resp.drain()
                timed(behind.pop())
            if ended:
                return

    def pause(self, engine: str) -> int:
        """A drained restart or a KV reset with `engine.drain = "continue"`: every stream
        that can be continued leaves that engine now (its upstream connection closed, so
        vLLM aborts it) and goes on once it serves again; the others finish as usual. So
        does each one whose answer begins while the engine's gate still holds. How many
        now."""
        self._pausing.add(engine)
        paused = 0
        for t, up, name in list(self._relays.values()):
            if name == engine and t.refusal() is None and not t.done:
                t.paused = True
                up.close()
                paused += 1
        # those whose answer has not begun (vLLM under load answers some late: waiting
        # for them held a KV reset 2.3 s on the H100): cut, and sent again after it
        for ex, call, name in list(self._unanswered.values()):
            if name == engine:
                del self._unanswered[id(ex)]
                ex.cut_by_pause = True
                call.abort()
                paused += 1
        return paused

    # ---- a stream the engine failed ---------------------------------------------------

    async def continue_stream(self, request: Request, broken: Broken | None,
                        ex: Exchange) -> StreamResponse:
        """A stream the engine failed mid-answer: continued on the engine that comes back,
        up to `max_continuations` times and `continue_timeout_s` each; or ended with an
        error event when it cannot be. The client's connection stays open meanwhile."""
        assert broken is not None
        resp, t, cause = broken.resp, broken.transcript, broken.cause
        ka = asyncio.create_task(self._keepalive(resp, ex))
        faults = 0 if isinstance(cause, Paused) else 1
        self._fault(ex, t, cause)
        try:
            while True:
                if t.finish_reason is not None and t.plan.refused is None:
                    await self._write(resp, ex, t.close())  # only its end was lost
                    await resp.write_eof()
                    return self._continued(resp, ex, "closed")
                why = None if t.events == 0 else t.refusal()
                if why is None and ex.deaths >= quarantine.REFUSE_AT:
                    self.stats.continued("refused", quarantine.REASON)
                    return await self._end_with_error(
                        resp, ex, f"{cause}; {quarantine.refusal(ex.deaths)}",
                        killer=quarantine.digest(t.plan.body))
                if why is None and faults > self.s.max_continuations:
                    why = "too_many_faults"
                if why is not None:
                    self.stats.continued("refused", why)
                    return await self._end_with_error(
                        resp, ex, f"{cause}; the answer cannot be continued ({why})")
                try:
                    await self._attempt(request, resp, ex, t, cause)
                except Broken as again:
                    cause = again.cause
                    ex.resumed(time.monotonic())  # (broken again before its first token)
                    if not isinstance(cause, Paused):
                        faults += 1
                        self._fault(ex, t, cause)
                    continue
                except EngineDied as died:
                    cause = died
                    await asyncio.sleep(0.2)  # (the engine is going: not at once again)
                    continue
                except GaveUp as exc:
                    self.stats.continued("failed")
                    return await self._end_with_error(resp, ex, f"{cause}; {exc}")
                await resp.write_eof()
                return self._continued(resp, ex, "continued" if t.attempt else "resent")
        except ConnectionError:
            ex.status, ex.outcome = 499, "client_gone"
            self.stats.continued("client_gone")
            return resp
        finally:
            ka.cancel()

    def _fault(self, ex: Exchange, t: Transcript, cause: BaseException) -> None:
        """What broke a stream, counted: an engine's death it was at (the quarantine's),
        or a stall, which is no death (the engine lives: it is the request's fault there
        only, bounded by `max_continuations`)."""
        if isinstance(cause, Stalled):
            self.stats.reject("stalled")
            log.warning("stream stalled: continued elsewhere", id=t.id, after_s=cause.after_s,
                        events=cause.events)
        elif not isinstance(cause, Paused):
            ex.engine_failed()

    def _continued(self, resp: StreamResponse, ex: Exchange,
                   outcome: str) -> StreamResponse:
        ex.outcome = "ok"
        self.stats.continued(outcome)
        self.stats.count(200)
        return resp

    async def _attempt(self, request: Request, resp: StreamResponse, ex: Exchange,
                       t: Transcript, cause: BaseException) -> None:
        """One continuation (or, when the client has seen nothing, the request again):
        wait for an engine, send it, relay it. Returns at its [DONE]; raises Broken when
        it fails mid-answer too, GaveUp when no engine took it in time."""
        assert self.upstream is not None and ex.backend is not None
        backend = ex.backend  # the same engine: a fallback would not give the same tokens
        broke_at = ex.last_data_at or time.monotonic()
        deadline = time.monotonic() + self.s.continue_timeout_s
        errors = 0  # 5xx from an engine whose /health says it serves
        drops = 0  # connections it closed unanswered, serving all the while
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise GaveUp(f"no engine took the continuation within "
                              f"{self.s.continue_timeout_s:g} s")
            ticket = await self._admit_within(ex, t, left)
            try:
                if t.events == 0:  # nothing reached the client: the request again
                    path, body = t.plan.path, t.plan.body
                else:
                    path = continuation.CONTINUATION_PATH
                    body = t.continuation(first=backend.priority_scheduling)
                try:
                    async with self.lanes.lane(backend.name, ex.deaths, left):
                        ex.sent(backend)
                        async with self.upstream.request(
                                "POST", backend.upstream, path, upstream_headers(request),
                                body) as up:
                            if up.status >= 500:
                                if not await self.still_serving(ex):
                                    # a dying engine: the continuation waits for the next
                                    # one, and the request was there as it died
                                    raise NotDelivered(
                                        f"HTTP {up.status} from a dying engine", reached=True)
                                if (errors := errors + 1) < 3:
                                    # its /health may say 200 for a moment after its core
                                    # died: asked again here, a few times
                                    raise NotDelivered(f"HTTP {up.status}")
                            if up.status != 200:
                                text = (await up.read())[:500].decode(errors="replace")
                                raise GaveUp(f"the engine refused the continuation: HTTP "
                                              f"{up.status}: {text}")
                            if t.events:
                                t.begin_attempt()
                                ex.gap_from, ex.continued_at = broke_at, time.monotonic()
                                log.info("stream continued", id=t.id, attempt=t.attempt,
                                         tokens_before=t.base, cause=str(cause)[:300],
                                         waited_s=round(time.monotonic() - broke_at, 3))
                            await self.relay_events(up, resp, ex, t)
                            assert ex.sent_to is not None
                            backend.served(ex.sent_to[1], ex.sent_to[2])
                            return
                except (ConnectFailed, Disconnected, NotDelivered) as exc:
                    failed = await self.not_delivered(ex, exc) \
                        if isinstance(exc, Disconnected) else exc
                    if isinstance(failed, NotDelivered) and failed.dropped \
                            and (drops := drops + 1) > RESENDS_AFTER_DROP:
                        raise GaveUp(dropped_message(drops)) from exc
                    reached = isinstance(failed, NotDelivered) and failed.reached
                    # it was at the engine when the engine went: a new fault; one that
                    # met an engine already seen dying waits on for the next, as if
                    # refused
                    if reached and ex.engine_failed():
                        raise EngineDied(f"the engine failed the request again: {exc!r}"
                                         ) from exc
                except (TimeoutError, UpstreamError):
                    pass  # refused, or its lane or the engine busy: not back yet
            finally:
                ex.left()
                backend.gate.done(ticket)
            await asyncio.sleep(0.2)

    async def _admit_within(self, ex: Exchange, t: Transcript, left_s: float) -> Ticket:
        """A slot for the continuation, ahead of new requests (`admission.Gate`): the
        stream with the fewest tokens still to come first."""
        assert ex.backend is not None
        remaining = t.remaining
        to_go = UNKNOWN_MODEL_LEN if remaining is None else max(0, remaining)
        try:
            ticket = await asyncio.wait_for(ex.backend.gate.acquire(
                ex.backend.budget(ex.tokens), to_go=to_go), left_s)
        except TimeoutError:
            raise GaveUp(f"no engine came back within {self.s.continue_timeout_s:g} s"
                          ) from None
        except Rejected as exc:
            raise GaveUp(f"no engine to continue on: {exc}") from None
        ex.held_s += ticket.waited_s if ticket.held else 0.0
        return ticket

    async def _keepalive(self, resp: StreamResponse, ex: Exchange) -> None:
        """Keep-alive bytes while a broken stream waits, so that idle timeouts on the
        client's side do not fire: `KEEPALIVE`, two blank lines."""
        # RuntimeError: the stream was finished (write_eof) while this one was writing
        with contextlib.suppress(ConnectionError, RuntimeError):
            while True:
                idle = time.monotonic() - ex.last_write_at
                if idle >= self.s.keepalive_s:
                    await resp.write(KEEPALIVE)
                    ex.last_write_at = time.monotonic()
                    idle = 0.0
                await asyncio.sleep(self.s.keepalive_s - idle)

    async def _end_with_error(self, resp: StreamResponse, ex: Exchange, message: str,
                              killer: str | None = None) -> StreamResponse:
        """The explicit end of a stream that cannot be finished: an error event and the
        end of the body, no [DONE]; never a stream that ends cleanly but short. `killer`:
        the digest of a request refused for killing its engine."""
        ex.outcome = quarantine.REASON if killer else "failed"
        self.stats.count(502)
        log.warning("stream failed", id=ex.transcript.id if ex.transcript else None,
                    why=message[:500], deaths=ex.deaths, **({"body": killer} if killer else {}))
        await resp.write(sse.error_event(message))
        await resp.write_eof()
        return resp


def upstream_headers(request: Request) -> bytes:
    """The client's end-to-end header fields, as lines for the engine's request."""
    return request.headers.forward(_HOP_BY_HOP, _HOP_LENGTHS)


class UpstreamFailed(Exception):
    pass


class Broken(Exception):
    """A continuable stream the engine failed after its answer had begun."""

    def __init__(self, resp: StreamResponse, transcript: Transcript,
                 cause: BaseException) -> None:
        super().__init__(str(cause))
        self.resp, self.transcript, self.cause = resp, transcript, cause


class Stalled(UpstreamFailed):
    """A continuable stream with no token for its `stall_timeout_s` from a live engine."""

    def __init__(self, after_s: float, events: int) -> None:
        super().__init__(f"no token for {after_s:g} s (its stall_timeout_s)")
        self.after_s, self.events = after_s, events


class Paused(Exception):
    def __init__(self) -> None:
        super().__init__("paused by the daemon for its engine's restart or KV reset")


class GaveUp(Exception):
    """No engine took a continuation in time, or one refused it."""


class NotDelivered(Exception):
    """No answer began: the engine refused the connection (the request never reached
    it), or it was reached and the engine went (`reached`: a death it was at), or an
    engine that still serves closed the connection without answering (`dropped`)."""

    def __init__(self, message: str, reached: bool = False, dropped: bool = False) -> None:
        super().__init__(message)
        self.reached = reached
        self.dropped = dropped


def dropped_message(times: int) -> str:
    return (f"the engine closed the connection without answering, {times} times, while it "
            f"served: not sent again")


class EngineDied(Exception):
    """A continuation reached its engine, and the engine went before answering."""
