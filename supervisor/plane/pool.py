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
  given back at once.

The daemon's own code sees one front door: the methods of `FrontProxy` that the host and
the units call (`supervisor/engine/effects.py`'s `Front`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

import structlog

from supervisor.front import readiness
from supervisor.front.admission import Rejected, Ticket
from supervisor.front.dispatch import Backend
from supervisor.front.exchange import ProxySettings, ProxyStats
from supervisor.front.latency import ClientLatency
from supervisor.front.proxy import ProxyError
from supervisor.plane.wire import Link, LinkClosed

log = structlog.get_logger("supervisor.plane")

START_TIMEOUT_S = 60.0  # a worker's import, its socket and its first word
STOP_GRACE_S = 12.0  # a worker's close: its busy connections get 10 s (server.close)
RESTART_DELAY_S = 0.5
RESTART_MAX_S = 30.0
REPORT_TIMEOUT_S = 1.0  # a scrape waits this long at most for the workers' counters
STATE_PERIOD_S = 0.02  # the engines' state, when it changed, at most this late
STATS_KEYS = ("responses", "rejections", "continuations", "refusals")


def workers_for(cpus: int | None) -> int:
    """`proxy.workers = 0`: one worker per four cores, at most 8; 1 on a small host."""
    return max(1, min(8, (cpus or 1) // 4))


def engine_state(b: Backend, cleared: dict[int, float]) -> dict[str, Any]:
    """What a worker is told of engine `b` (`mirror.apply` reads it)."""
    g = b.gate
    return {"name": b.name, "upstream": b.upstream, "models": b.models,
            "models_open": b.models_open, "fallback": b.fallback,
            "generation": b.generation(), "ready": b.ready(),
            "failure_seen": dict(b.failure_seen), "cleared": dict(cleared),
            "limits": g.limits, "level": g.level, "held_reason": g.held_reason,
            "closed_reason": g.closed_reason, "unhealthy": g.unhealthy,
            "breaker_open": g.breaker_open, "ready_at": g.ready_at,
            "in_flight": g.in_flight, "waiting": g.waiting}


def added(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Two workers' counters and histograms as one (`worker.stats_doc`'s shape)."""
    out: dict[str, Any] = {key: {k: a.get(key, {}).get(k, 0) + b.get(key, {}).get(k, 0)
                                 for k in {*a.get(key, {}), *b.get(key, {})}}
                           for key in STATS_KEYS}
    out["retried_connects"] = a.get("retried_connects", 0) + b.get("retried_connects", 0)
    hist: dict[Any, Any] = dict(a.get("latency", {}))
    for key, (counts, total, n) in b.get("latency", {}).items():
        if key in hist:
            c0, t0, n0 = hist[key]
            hist[key] = ([x + y for x, y in zip(c0, counts, strict=True)], t0 + total, n0 + n)
        else:
            hist[key] = (list(counts), total, n)
    out["latency"] = hist
    return out


def _changed(a: list[dict[str, Any]] | None, b: list[dict[str, Any]]) -> bool:
    """Whether the state changed in what a request's answer may depend on (the counts of
    requests in flight and waiting go with the periodic update)."""
    if a is None or len(a) != len(b):
        return True
    return any({k: v for k, v in x.items() if k not in ("in_flight", "waiting")}
               != {k: v for k, v in y.items() if k not in ("in_flight", "waiting")}
               for x, y in zip(a, b, strict=True))


@dataclasses.dataclass
class _Worker:
    index: int
    sock: socket.socket  # its listening socket (the daemon keeps it across its restarts)
    proc: asyncio.subprocess.Process | None = None
    link: Link | None = None
    ready: asyncio.Future[None] | None = None
    sent: list[dict[str, Any]] | None = None  # the state it was last told
    waits: dict[int, asyncio.Task[Any]] = dataclasses.field(default_factory=dict)
    slots: dict[int, tuple[Backend, Ticket, int]] = dataclasses.field(default_factory=dict)
    lanes: dict[int, asyncio.Lock] = dataclasses.field(default_factory=dict)
    stats: dict[str, Any] = dataclasses.field(default_factory=dict)
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
        self._retired: dict[str, Any] = {}  # the counters of workers that ended, added up
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
                      models_open: bool = False) -> None:
        self.backends[name].follow(upstream, models, models_open)
        self._push_all()

    def pause_streams(self, engine: str) -> int | None:
        """Every worker pauses its streams of `engine` (each logs how many): None, the
        count being theirs."""
        self._push_all()  # (the hold first: a stream that begins after it pauses too)
        for w in self._live():
            assert w.link is not None
            w.link.send(("pause", engine))
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
            w.link.send(("settings", self._share(self.s)))

    def ready(self) -> bool:
        return readiness.ready(self.backends)

    def unhealthy(self) -> list[str]:
        return readiness.unhealthy(self.backends)

    @property
    def port(self) -> int:
        assert self._port is not None
        return self._port

    def _totals(self) -> dict[str, Any]:
        """Every worker's counters and histograms added up (ended workers' included)."""
        return functools.reduce(added, (w.stats for w in self._workers), self._retired)

    @property
    def stats(self) -> ProxyStats:
        """Every worker's counters added up (those of workers that ended included)."""
        t = self._totals()
        return ProxyStats(**{key: t.get(key, {}) for key in STATS_KEYS},
                          retried_connects=t.get("retried_connects", 0))

    def cpu_s(self) -> dict[str, float]:
        """Each worker's CPU seconds as it last reported them, its ended processes'
        added (a counter that never goes back)."""
        return {str(w.index): self._retired_cpu.get(w.index, 0.0) + w.stats.get("cpu_s", 0.0)
                for w in self._workers}

    @property
    def latency(self) -> ClientLatency:
        """What clients felt, every worker's histograms added up."""
        out = ClientLatency(m for b in self.backends.values() for m in b.models)
        for (kind, label), (counts, total, n) in self._totals().get("latency", {}).items():
            h = out.histogram(kind, label)
            h.counts, h.total, h.n = list(counts), total, n
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
            w.link.send(("report", w.asked))
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
            w.link.send(("stop",))
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
        w.link = await Link.over(mine)
        w.sent = None
        w.link.send(("init", self._share(self.s), self._state()))
        w.sent = self._state()
        try:
            w.link.handle_with(lambda m: self._handle(w, m))
            raise LinkClosed(await w.link.wait_closed())
        finally:
            await w.link.close()
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
        if w.stats:
            self._retired = added(self._retired, w.stats)
            self._retired_cpu[w.index] = self._retired_cpu.get(w.index, 0.0) \
                + w.stats.get("cpu_s", 0.0)
            w.stats = {}

    # ---- a worker's messages ---------------------------------------------------------

    def _handle(self, w: _Worker, m: tuple[Any, ...]) -> None:
        kind = m[0]
        if kind == "acquire":
            self._acquire(w, m[1], m[2], m[3], m[4])
        elif kind == "done":
            self._give_back(w, m[1])
        elif kind == "cancel":
            t = w.waits.pop(m[1], None)
            if t is not None:
                t.cancel()  # (a gate or lane granted meanwhile is given back: _granted)
            self._give_back(w, m[1])
            if (lock := w.lanes.pop(m[1], None)) is not None:
                lock.release()
        elif kind == "lane":
            self._lane(w, m[1], m[2])
        elif kind == "unlane":
            if (lock := w.lanes.pop(m[1], None)) is not None:
                lock.release()
        elif kind == "failed":
            if (b := self.backends.get(m[1])) is not None:
                b.failed(m[2], m[3])
                self._push_all()
        elif kind == "served":
            if (b := self.backends.get(m[1])) is not None and m[2] in b.failure_seen:
                b.served(m[2], m[3])
                if m[2] not in b.failure_seen:
                    cleared = self._cleared.setdefault(m[1], {})
                    cleared[m[2]] = m[3]
                    if len(cleared) > 8:  # (only the last starts matter, as in Backend)
                        del cleared[min(cleared)]
                self._push_all()
        elif kind == "stats":
            w.stats = m[1]
            if len(m) > 2 and m[2] == w.asked:  # (the answer to the last ask, not a
                w.reported.set()                # report of its own sent before it)
        elif kind == "ready":
            if w.ready is not None and not w.ready.done():
                w.ready.set_result(None)
        else:
            log.warning("proxy worker sent an unknown message", worker=w.index,
                        message=str(kind)[:40])

    def _acquire(self, w: _Worker, i: int, engine: str, tokens: int,
                 refusable: bool) -> None:
        b = self.backends.get(engine)
        try:
            if b is None:
                raise Rejected("engine_down", f"engine {engine} is no longer served here")
            ticket = b.gate.admit_now(tokens, refusable)
        except Rejected as exc:
            self._reply(w, ("no", i, exc.reason, str(exc), exc.waited_s, exc.held))
            return
        if ticket is not None:
            self._granted(w, i, b, ticket)
            return
        t = asyncio.ensure_future(b.gate.acquire(tokens, refusable))
        w.waits[i] = t
        t.add_done_callback(lambda t: self._waited(w, i, b, t))

    def _waited(self, w: _Worker, i: int, b: Backend, t: asyncio.Future[Ticket]) -> None:
        w.waits.pop(i, None)
        if t.cancelled():
            return
        exc = t.exception()
        if isinstance(exc, Rejected):
            self._reply(w, ("no", i, exc.reason, str(exc), exc.waited_s, exc.held))
        elif exc is not None:
            self._reply(w, ("no", i, "proxy_error", repr(exc), 0.0, False))
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
        self._reply(w, ("ok", i, (ticket.tokens, ticket.waited_s, ticket.held, generation)))
        if w.sent is not None and any(e["name"] == b.name and (e["held_reason"] or
                                                               e["closed_reason"])
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
            self._reply(w, ("ok", i, None))

        t = asyncio.ensure_future(take())
        w.waits[i] = t
        t.add_done_callback(lambda _: w.waits.pop(i, None))

    def _reply(self, w: _Worker, message: tuple[Any, ...]) -> None:
        """An answer to worker `w`. (A grant never reaches a worker before the upstream
        it is for: `follow_engine` sends the state at once, and the grant names the
        engine start it was counted at.)"""
        assert w.link is not None
        w.link.send(message)

    # ---- the engines' state, to the workers ----------------------------------------

    def _state(self) -> list[dict[str, Any]]:
        return [engine_state(b, self._cleared.get(b.name, {})) for b in self.backends.values()]

    def _push_all(self, counts: bool = False) -> None:
        """The engines' state to every worker whose last differs (in the counts in
        flight and waiting too, with `counts`)."""
        state = self._state()
        for w in self._live():
            if _changed(w.sent, state) or (counts and state != w.sent):
                assert w.link is not None
                w.link.send(("state", state))
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

