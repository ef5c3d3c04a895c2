"""The front door as several processes: the daemon's side (`proxy.workers` > 1).

The daemon binds the public address once per worker (`SO_REUSEPORT`: the kernel spreads
new connections over the workers; a connection, its requests and its streams stay in the
worker that accepted it), starts each worker (`supervisor/plane/worker.py`, a
`FrontProxy` over `supervisor/plane/mirror.py`), and keeps every decision that must hold
across them, so that nothing a client is promised depends on the worker it reached:

- admission: each request's slot is asked of the engine's one `Gate` (its limits, the
  hold, the throttle level, the KV breaker, the hold queue's bound and order, the fleet's
  early refusal); a slot granted is counted at the engine start it was granted for, so a
  swap waits for it (`in_flight_at`) from the moment it is granted;
- the suspect lanes (one suspect at a time per engine) and the failures seen at each
  engine start, told to every worker;
- the engines' state (where each listens, whether it serves, its gate) sent to each
  worker when it changes, before any answer that depends on it;
- what clients felt and the counters, each worker's added up (`stats`, `latency`);
- the workers themselves: a worker that dies is started again on its socket (the
  connections it held are lost, as the one process's would be), its slots and lanes
  given back at once; a worker whose message does not read (`supervisor/plane/wire.py`)
  is ended at once and started again: what it sends is never trusted.

The daemon's own code sees one front door: the methods of `FrontProxy` that the host and
the units call (`supervisor/engine/effects/protocol.py`'s `Front`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import operator
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any, assert_never

import structlog

from supervisor.front import readiness
from supervisor.front.admission import Gate, Rejected, Ticket
from supervisor.front.dispatch import Backend
from supervisor.front.exchange import ProxySettings, ProxyStats
from supervisor.front.latency import ClientLatency
from supervisor.front.proxy import ProxyError
from supervisor.plane.messages import (
    TO_DAEMON,
    Acquire,
    Cancel,
    Counters,
    Done,
    EngineState,
    Failed,
    Granted,
    Init,
    Lane,
    Laned,
    Pause,
    Ready,
    Refused,
    Report,
    Served,
    Settings,
    State,
    Stats,
    Stop,
    ToDaemon,
    ToWorker,
    Unlane,
    added,
)
from supervisor.plane.wire import Link, LinkClosed, send_all

log = structlog.get_logger("supervisor.plane")

START_TIMEOUT_S = 60.0  # a worker's import, its socket and its first word
STOP_GRACE_S = 12.0  # a worker's close: its busy connections get 10 s (server.close)
RESTART_DELAY_S = 0.5
RESTART_MAX_S = 30.0
REPORT_TIMEOUT_S = 1.0  # a scrape waits this long at most for the workers' counters
STATE_PERIOD_S = 0.02  # the engines' state, when it changed, at most this late


def workers_for(cpus: int | None) -> int:
    """`proxy.workers = 0`: one worker per four cores, at most 8; 1 on a small host."""
    return max(1, min(8, (cpus or 1) // 4))


def gate_of(b: Backend) -> Gate:
    """The daemon's gate of engine `b` (the host's engines have the daemon's gates; the
    proxy reads them as `dispatch.EngineGate`)."""
    assert isinstance(b.gate, Gate), f"engine {b.name}: not the daemon's gate"
    return b.gate


def engine_state(b: Backend, cleared: dict[int, float]) -> EngineState:
    """What a worker is told of engine `b` (`mirror.WorkerBackend.told` reads it)."""
    g = gate_of(b)
    return EngineState(
        b.name, b.upstream, b.models, b.models_open, b.priority_scheduling, b.fallback,
        b.generation(), b.ready(),
        tuple(b.failure_seen.items()), tuple(cleared.items()), g.limits, g.level,
        g.held_reason, g.closed_reason, g.unhealthy, g.breaker_open, g.ready_at,
        g.in_flight, g.waiting)


def _changed(a: tuple[EngineState, ...] | None, b: tuple[EngineState, ...]) -> bool:
    """Whether the state changed in what a request's answer may depend on (the counts of
    requests in flight and waiting go with the periodic update)."""
    if a is None or len(a) != len(b):
        return True
    return any(_decisive(x) != _decisive(y) for x, y in zip(a, b, strict=True))


# (every 20 ms, per worker and engine: a tuple of the fields, not a copy of the state)
_decisive = operator.attrgetter(*(f.name for f in dataclasses.fields(EngineState)
                                  if f.name not in ("in_flight", "waiting")))


@dataclasses.dataclass
class _Worker:
    index: int
    sock: socket.socket  # its listening socket (the daemon keeps it across its restarts)
    proc: asyncio.subprocess.Process | None = None
    link: Link[ToDaemon, ToWorker] | None = None
    ready: asyncio.Future[None] | None = None
    sent: tuple[EngineState, ...] | None = None  # the state it was last told
    waits: dict[int, asyncio.Task[Any]] = dataclasses.field(default_factory=dict)
    slots: dict[int, tuple[Backend, Ticket, int]] = dataclasses.field(default_factory=dict)
    lanes: dict[int, asyncio.Lock] = dataclasses.field(default_factory=dict)
    stats: Counters | None = None  # its last report
    reported: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    asked: int = 0  # the last report asked of it (its answer names it)
    task: asyncio.Task[None] | None = None


class WorkerPool:
    """The front door over `workers` processes; the same methods as `FrontProxy` for the
    daemon's side."""

    def __init__(self, settings: ProxySettings, workers: int, log_level: str = "info",
                 log_format: str = "json") -> None:
        assert workers >= 2
        self.s = settings
        self.n = workers
        self.log_level, self.log_format = log_level, log_format
        self.backends: dict[str, Backend] = {}  # config order
        self._workers: list[_Worker] = []
        self._at: dict[tuple[str, int], int] = {}  # slots per (engine, start)
        self._cleared: dict[str, dict[int, float]] = {}  # failures forgotten: when sent
        self._lanes: dict[str, asyncio.Lock] = {}
        self._retired = Counters()  # the counters of workers that ended, added up
        self._port: int | None = None
        self._closing = False
        self._ticker: asyncio.Task[None] | None = None
        self.restarts = 0  # workers started again after they ended (status shows it)
        self._retired_cpu: dict[int, float] = {}  # CPU s of each worker's ended processes

    # ---- the engines (the host's and the units' side) --------------------------------

    def add_engine(self, backend: Backend) -> None:
        self.backends[backend.name] = backend
        self._push_all()

    def remove_engine(self, name: str) -> None:
        self.backends.pop(name, None)
        self._push_all()

    def set_fallback(self, name: str, fallback: str | None) -> None:
        if name in self.backends:
            self.backends[name].fallback = fallback or None
            self._push_all()

    def follow_engine(self, name: str, upstream: str, models: tuple[str, ...],
                      models_open: bool = False, priority_scheduling: bool = False) -> None:
        self.backends[name].follow(upstream, models, models_open, priority_scheduling)
        self._push_all()

    def pause_streams(self, engine: str) -> int | None:
        """Every worker pauses its streams of `engine` (each logs how many): None, the
        count being theirs."""
        self._push_all()  # (the hold first: a stream that begins after it pauses too)
        for w in self._live():
            assert w.link is not None
            w.link.send(Pause(engine))
        return None

    def in_flight_at(self, name: str, generation: int) -> int:
        """Slots granted for start `generation` of engine `name` and not yet given back."""
        return self._at.get((name, generation), 0)

    def reconfigure(self, settings: ProxySettings) -> None:
        self.s = dataclasses.replace(
            settings, listen_host=self.s.listen_host, listen_port=self.s.listen_port,
            max_body_bytes=self.s.max_body_bytes, max_header_bytes=self.s.max_header_bytes,
            upstream=self.s.upstream, models=self.s.models, models_open=self.s.models_open,
            max_connections=self.s.max_connections,
            max_buffered_bytes=self.s.max_buffered_bytes)
        for w in self._live():
            assert w.link is not None
            w.link.send(Settings(self._share(self.s)))

    def ready(self) -> bool:
        return readiness.ready(self.backends)

    def unhealthy(self) -> list[str]:
        return readiness.unhealthy(self.backends)

    @property
    def port(self) -> int:
        assert self._port is not None
        return self._port

    def _totals(self) -> Counters:
        """Every worker's counters and histograms added up (ended workers' included)."""
        return functools.reduce(added, (w.stats for w in self._workers if w.stats),
                                self._retired)

    @property
    def stats(self) -> ProxyStats:
        """Every worker's counters added up (those of workers that ended included)."""
        t = self._totals()
        return ProxyStats(responses=t.responses, rejections=t.rejections,
                          retried_connects=t.retried_connects,
                          continuations=t.continuations, refusals=t.refusals)

    def cpu_s(self) -> dict[str, float]:
        """Each worker's CPU seconds as it last reported them, its ended processes'
        added (a counter that never goes back)."""
        return {str(w.index): self._retired_cpu.get(w.index, 0.0)
                + (w.stats.cpu_s if w.stats else 0.0) for w in self._workers}

    @property
    def latency(self) -> ClientLatency:
        """What clients felt, every worker's histograms added up."""
        out = ClientLatency(m for b in self.backends.values() for m in b.models)
        for t in self._totals().latency:
            h = out.histogram(t.kind, t.label)
            h.counts, h.total, h.n = list(t.counts), t.total, t.n
        return out

    async def refresh(self, timeout_s: float = REPORT_TIMEOUT_S) -> None:
        """Every worker's counters as of now (a scrape's): each is asked, and answers
        after what it had to do before; a worker that does not answer in time keeps its
        last report (sent twice a second by itself)."""
        live = self._live()
        for w in live:
            assert w.link is not None
            w.asked += 1
            w.reported.clear()
            w.link.send(Report(w.asked))
        if live:
            await asyncio.wait([asyncio.ensure_future(w.reported.wait()) for w in live],
                               timeout=timeout_s)

    # ---- running ----------------------------------------------------------------------

    async def start(self) -> None:
        """Bind the address for each worker and start them; raises ProxyError naming the
        address, or the worker that did not start."""
        try:
            for i in range(self.n):
                self._workers.append(_Worker(i, self._bind()))
        except OSError as exc:
            self._close_socks()
            raise ProxyError(f"proxy cannot listen on {self.s.listen_host}:"
                             f"{self.s.listen_port}: {exc}") from exc
        for w in self._workers:
            w.ready = asyncio.get_running_loop().create_future()
            w.task = asyncio.create_task(self._run(w), name=f"proxy-worker-{w.index}")
        try:
            await asyncio.wait_for(asyncio.gather(*(self._started(w) for w in self._workers)),
                                   START_TIMEOUT_S)
        except (TimeoutError, ProxyError) as exc:
            await self.close()
            raise ProxyError(f"proxy workers did not start: {exc or 'no word in time'}"
                             ) from None
        self._ticker = asyncio.create_task(self._tick())
        log.info("proxy listening", host=self.s.listen_host, port=self.port,
                 workers=self.n, pids=[w.proc.pid for w in self._workers if w.proc])

    def _bind(self) -> socket.socket:
        host = self.s.listen_host or "0.0.0.0"
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            sock.bind((host, self._port if self._port is not None else self.s.listen_port))
            sock.listen(1024)
        except OSError:
            sock.close()
            raise
        self._port = int(sock.getsockname()[1])
        sock.set_inheritable(True)
        return sock

    async def _started(self, w: _Worker) -> None:
        assert w.ready is not None
        await w.ready

    async def close(self) -> None:
        """Every worker closes (its busy connections get their grace), then the sockets."""
        self._closing = True
        if self._ticker is not None:
            self._ticker.cancel()
        for w in self._live():
            assert w.link is not None
            w.link.send(Stop())
        tasks = [w.task for w in self._workers if w.task is not None]
        _, pending = await asyncio.wait(tasks, timeout=STOP_GRACE_S) if tasks \
            else (set(), set())
        for w in self._workers:
            if w.proc is not None and w.proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    w.proc.kill()
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        self._close_socks()

    def _close_socks(self) -> None:
        for w in self._workers:
            w.sock.close()

    def _live(self) -> list[_Worker]:
        return [w for w in self._workers if w.link is not None and not w.link.closed]

    async def _run(self, w: _Worker) -> None:
        """Worker `w`, started and started again, until the pool closes. A first start
        that fails fails the pool's start; a later one is tried again, each wait twice
        the last (from RESTART_DELAY_S, at most RESTART_MAX_S) while it does not serve."""
        first, delay = True, RESTART_DELAY_S
        while not self._closing:
            if w.ready is None or w.ready.done():
                w.ready = asyncio.get_running_loop().create_future()
            try:
                await self._serve(w)
            except Exception as exc:  # (its process or its link failed: started again)
                if first and not w.ready.done():
                    w.ready.set_exception(ProxyError(f"worker {w.index}: {exc}"))
                    return
                if not isinstance(exc, LinkClosed):
                    log.error("proxy worker link failed", worker=w.index, error=repr(exc))
            finally:
                self._forget(w)
            served, first = w.ready.done(), False
            delay = RESTART_DELAY_S if served else min(RESTART_MAX_S, delay * 2)
            if not self._closing:
                log.error("proxy worker ended; starting it again", worker=w.index,
                          code=w.proc.returncode if w.proc else None,
                          after_s=delay, **({} if served else {"served": False}))
                self.restarts += 1
                await asyncio.sleep(delay)

    async def _serve(self, w: _Worker) -> None:
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            w.proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "supervisor.plane.worker", "--index", str(w.index),
                "--link-fd", str(theirs.fileno()), "--listen-fd", str(w.sock.fileno()),
                "--log-level", self.log_level, "--log-format", self.log_format,
                pass_fds=(theirs.fileno(), w.sock.fileno()), env=worker_env())
        except BaseException:
            mine.close()
            raise
        finally:
            theirs.close()
        link: Link[ToDaemon, ToWorker] = await Link.over(mine, TO_DAEMON, worker=w.index)
        w.link = link
        w.sent = self._state()
        link.send(Init(self._share(self.s), w.sent))
        try:
            link.handle_with(lambda m: self._handle(w, m))
            why = await link.wait_closed()
            if link.fault is not None:  # (what it sent is not trusted: ended at once)
                with contextlib.suppress(ProcessLookupError):
                    w.proc.kill()
            raise LinkClosed(why)
        finally:
            await link.close()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(w.proc.wait(), STOP_GRACE_S)
            if w.proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    w.proc.kill()
                await w.proc.wait()

    def _share(self, s: ProxySettings) -> ProxySettings:
        """A worker's settings: the guard rails that bound the host (connections, bodies
        held) split between the workers, so that together they hold."""
        return dataclasses.replace(s, max_connections=max(1, s.max_connections // self.n),
                                   max_buffered_bytes=max(1 << 20,
                                                          s.max_buffered_bytes // self.n))

    def _forget(self, w: _Worker) -> None:
        """Worker `w` is gone: what it waited for is cancelled, what it held given back."""
        for t in w.waits.values():
            t.cancel()
        w.waits.clear()
        for i in list(w.slots):
            self._give_back(w, i)
        for lock in w.lanes.values():
            lock.release()
        w.lanes.clear()
        if w.stats is not None:
            self._retired = added(self._retired, w.stats)
            self._retired_cpu[w.index] = self._retired_cpu.get(w.index, 0.0) + w.stats.cpu_s
            w.stats = None

    # ---- a worker's messages ---------------------------------------------------------

    def _handle(self, w: _Worker, m: ToDaemon) -> None:
        match m:
            case Acquire(i, tokens, refusable, to_go, engine):
                self._acquire(w, i, engine, tokens, refusable, None if to_go < 0 else to_go)
            case Done(i):
                self._give_back(w, i)
            case Cancel(i):
                if (t := w.waits.pop(i, None)) is not None:
                    t.cancel()  # (a gate or lane granted meanwhile is given back: _granted)
                self._give_back(w, i)
                if (lock := w.lanes.pop(i, None)) is not None:
                    lock.release()
            case Lane(i, engine):
                self._lane(w, i, engine)
            case Unlane(i):
                if (lock := w.lanes.pop(i, None)) is not None:
                    lock.release()
            case Failed(engine, generation, now):
                if (b := self.backends.get(engine)) is not None:
                    b.failed(generation, now)
                    self._push_all()
            case Served(engine, generation, sent_at):
                if (b := self.backends.get(engine)) is not None \
                        and generation in b.failure_seen:
                    b.served(generation, sent_at)
                    if generation not in b.failure_seen:
                        cleared = self._cleared.setdefault(engine, {})
                        cleared[generation] = sent_at
                        if len(cleared) > 8:  # (only the last starts matter, as in Backend)
                            del cleared[min(cleared)]
                    self._push_all()
            case Stats(counters, asked):
                w.stats = counters
                if asked is not None and asked == w.asked:  # (the answer to the last ask,
                    w.reported.set()                        # not a report of its own)
            case Ready():
                if w.ready is not None and not w.ready.done():
                    w.ready.set_result(None)
            case _:
                assert_never(m)

    def _acquire(self, w: _Worker, i: int, engine: str, tokens: int,
                 refusable: bool, to_go: int | None) -> None:
        b = self.backends.get(engine)
        try:
            if b is None:
                raise Rejected("engine_down", f"engine {engine} is no longer served here")
            ticket = gate_of(b).admit_now(tokens, refusable, to_go)
        except Rejected as exc:
            self._reply(w, Refused(i, exc.reason, str(exc), exc.waited_s, exc.held))
            return
        if ticket is not None:
            self._granted(w, i, b, ticket)
            return
        t = asyncio.ensure_future(b.gate.acquire(tokens, refusable, to_go))
        w.waits[i] = t
        t.add_done_callback(lambda t: self._waited(w, i, b, t))

    def _waited(self, w: _Worker, i: int, b: Backend, t: asyncio.Future[Ticket]) -> None:
        w.waits.pop(i, None)
        if t.cancelled():
            return
        exc = t.exception()
        if isinstance(exc, Rejected):
            self._reply(w, Refused(i, exc.reason, str(exc), exc.waited_s, exc.held))
        elif exc is not None:
            self._reply(w, Refused(i, "proxy_error", repr(exc), 0.0, False))
        else:
            self._granted(w, i, b, t.result())

    def _granted(self, w: _Worker, i: int, b: Backend, ticket: Ticket) -> None:
        if w.link is None or w.link.closed:
            b.gate.done(ticket)  # (the worker is gone)
            return
        generation = b.generation()
        key = (b.name, generation)
        self._at[key] = self._at.get(key, 0) + 1
        w.slots[i] = (b, ticket, generation)
        self._reply(w, Granted(i, ticket.tokens, ticket.waited_s, ticket.held, generation))
        if w.sent is not None and any(e.name == b.name and (e.held_reason or e.closed_reason)
                                      for e in w.sent):
            w.sent = None  # (the worker reads the grant as the gate open: told anew)

    def _give_back(self, w: _Worker, i: int) -> None:
        slot = w.slots.pop(i, None)
        if slot is None:
            return
        b, ticket, generation = slot
        key = (b.name, generation)
        if (n := self._at.get(key, 0) - 1) > 0:
            self._at[key] = n
        else:
            self._at.pop(key, None)
        b.gate.done(ticket)

    def _lane(self, w: _Worker, i: int, engine: str) -> None:
        lock = self._lanes.setdefault(engine, asyncio.Lock())

        async def take() -> None:
            await lock.acquire()
            if w.link is None or w.link.closed:
                lock.release()
                return
            w.lanes[i] = lock
            self._reply(w, Laned(i))

        t = asyncio.ensure_future(take())
        w.waits[i] = t
        t.add_done_callback(lambda _: w.waits.pop(i, None))

    def _reply(self, w: _Worker, message: ToWorker) -> None:
        """An answer to worker `w`. (A grant never reaches a worker before the upstream
        it is for: `follow_engine` sends the state at once, and the grant names the
        engine start it was counted at.)"""
        assert w.link is not None
        w.link.send(message)

    # ---- the engines' state, to the workers ----------------------------------------

    def _state(self) -> tuple[EngineState, ...]:
        return tuple(engine_state(b, self._cleared.get(b.name, {}))
                     for b in self.backends.values())

    def _push_all(self, counts: bool = False) -> None:
        """The engines' state to every worker whose last differs (in the counts in
        flight and waiting too, with `counts`)."""
        state = self._state()
        told = [w for w in self._live() if _changed(w.sent, state)
                or (counts and state != w.sent)]
        send_all([w.link for w in told if w.link is not None], State(state))  # (encoded once)
        for w in told:
            w.sent = state

    async def _tick(self) -> None:
        """Changes made by the units (a hold, a level, the breaker, a start) reach the
        workers within STATE_PERIOD_S; the counts in flight every 0.1 s."""
        last_counts = 0.0
        while True:
            await asyncio.sleep(STATE_PERIOD_S)
            counts = time.monotonic() - last_counts >= 0.1
            if counts:
                last_counts = time.monotonic()
            try:
                self._push_all(counts)
            except Exception:  # (a unit's state that would not read: told next time)
                log.exception("the engines' state could not be sent to the proxy workers")


def worker_env() -> dict[str, str]:
    """The daemon's environment, with the folder its own `supervisor` package came from
    first on the path: a worker runs the daemon's code, however the daemon found it."""
    here = str(Path(__file__).resolve().parent.parent.parent)
    path = os.environ.get("PYTHONPATH", "")
    return {**os.environ, "PYTHONPATH": here + (os.pathsep + path if path else "")}


def cpus() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1

