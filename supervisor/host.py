"""The host: one daemon process around one or more engine units.

The host owns what the engines share: the signals, the control socket, the front proxy,
the exporter, sd_notify and the config as a whole. Each engine is a unit
(`supervisor.engine.unit.EngineUnit`): one task that owns that engine's lifecycle and watchdog
state, with its own queue, gate, restart budget and backoff. The host never touches a
unit's state: it puts events on the unit's queue (a signal, a control request, a reloaded
config, a view request) and reads the answers.

The host's own state (its units, the config, whether it is stopping) is changed only by
its task, from events on its queue: a signal, a control request, a reloaded config, a
unit that ended. Control commands are looked up in `supervisor/control/handlers.py`.

Invariants:
- one engine's FATAL, budget or backoff never touches another's: each lives in its unit;
- `READY=1` goes to systemd once every engine serves or has given up;
- a unit removed by reload drains and stops its engine before its routes go away;
- the daemon exits once every unit has stopped, with the worst unit's exit status.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

import structlog

from supervisor.control import handlers
from supervisor.control.server import ControlServer
from supervisor.engine.events import (
    CommandError,
    ControlRequest,
    Reloaded,
    SignalReceived,
    iso_time,
)
from supervisor.engine.unit import EngineUnit
from supervisor.fleet.registrar import Registrar
from supervisor.front.continuation import schedules_by_priority
from supervisor.front.dispatch import Backend
from supervisor.front.exchange import ProxySettings
from supervisor.front.proxy import FrontProxy, ProxyError
from supervisor.loop import Clock, Jobs
from supervisor.ops.audit import AuditTrail
from supervisor.ops.exporter import Exporter, parse_listen
from supervisor.ops.exposition import ExporterView, ProxyView
from supervisor.ops.looplag import LoopLag
from supervisor.ops.sdnotify import Notifier
from supervisor.plane.pool import WorkerPool, cpus, workers_for
from supervisor.settings.config import Config, ConfigError, load_config
from supervisor.settings.sections import EngineConfig
from supervisor.watchdog.gpu import GpuProcessLister, GpuSampler

log = structlog.get_logger("supervisor")

# what lists the processes on an engine's GPUs, and what samples them (None: no GPU)
GpuFor = Callable[[EngineConfig], tuple[GpuProcessLister, GpuSampler | None]]


@dataclass(frozen=True)
class UnitDone:
    """A unit's task ended: stopped, or failed with `error`."""

    engine: str
    exit_code: int
    error: BaseException | None = None
    name: str = "unit_done"


@dataclass(frozen=True)
class HostReloaded:
    config: Config | None
    error: str | None
    reply: asyncio.Future[dict[str, Any]] | None
    name: str = "reloaded"


class UnitNotifier(Notifier):
    """sd_notify for one unit of several: its readiness and status go to the host, which
    tells systemd once for all of them."""

    def __init__(self, host: Host, engine: str) -> None:
        super().__init__({})
        self.host, self.engine = host, engine
        self.watchdog_interval_s = host.notifier.watchdog_interval_s

    def ready(self, status: str) -> bool:
        self.host.unit_settled(self.engine, status)
        return True

    def status(self, status: str) -> bool:
        return self.host.unit_status(self.engine, status)

    def watchdog(self) -> bool:
        return self.host.notifier.watchdog()

    def extend_timeout(self, seconds: float) -> bool:
        return self.host.notifier.extend_timeout(seconds)

    def stopping(self, status: str) -> bool:
        # one engine removed by reload is not the daemon stopping
        return self.host.notifier.stopping(status) if self.host.stopping else False


@dataclass
class Host:
    config: Config
    notifier: Notifier
    gpu_for: GpuFor
    clock: Clock = field(default_factory=Clock)
    environ: dict[str, str] = field(default_factory=lambda: dict(os.environ))

    def __post_init__(self) -> None:
        self.queue: asyncio.Queue[Any] = asyncio.Queue()
        self.units: dict[str, EngineUnit] = {}  # config order
        self.tasks: dict[str, asyncio.Task[int]] = {}
        self.removing: set[str] = set()  # units stopping because a reload removed them
        self.stopping = False
        self.exit_code = 0
        self.started_at = self.clock.monotonic()
        self.proxy: FrontProxy | WorkerPool | None = None
        self.registrar: Registrar | None = None  # [fleet] routers, once the sockets listen
        self._settled: dict[str, str] = {}  # engine -> why it counts as settled
        self._statuses: dict[str, str] = {}
        self._ready_sent = False
        self._jobs = Jobs()
        self.loop_lag = LoopLag(clock=self.clock.monotonic)  # how late this loop runs
        self._control: ControlServer | None = None
        self._exporter: Exporter | None = None
        self._let_go = asyncio.Event()  # (set once only the control socket is left)
        self.audit = AuditTrail(self.config.audit.path, self.config.audit.max_bytes,
                                self.config.audit.backups)

    # ---- running ----------------------------------------------------------------------

    async def run(self) -> int:
        """Run every engine until the daemon is stopped. Returns the exit status."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            # Handlers only enqueue: no logging, no state, nothing that can block.
            loop.add_signal_handler(sig, self.queue.put_nowait, SignalReceived(sig))
        if self.config.proxy.enabled:  # (built before the units: they reach it; listens below)
            self.proxy = self._front_door()
        for name in self.config.engines:
            self._make_unit(name, self.config)
        try:
            await self._open_sockets()
            log.info("daemon started", pid=os.getpid(), config=self.config.source,
                     socket=self.config.control.socket, engines=list(self.units))
            self.launch(self.loop_lag.run(), "event loop watch")
            for name in self.units:
                self._start_unit(name)
            self._join_fleet()
            while self.tasks:
                event = await self.queue.get()
                getattr(self, f"handle_{event.name}")(event)
        finally:
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                loop.remove_signal_handler(sig)
            for task in self.tasks.values():  # (only when the host itself failed)
                task.cancel()
            await asyncio.gather(*self.tasks.values(), return_exceptions=True)
            if self.registrar is not None:
                await self.registrar.close(self.config.fleet.leave_timeout_s)
            await self._close_sockets()
            await self._jobs.cancel_all()
        return self.exit_code

    async def _open_sockets(self) -> None:
        """The control socket, the proxy and the exporter; a failure raises, and `run`'s
        cleanup closes what was opened (no engine has started yet)."""
        self._control = ControlServer(self.config.control, self.submit)
        await self._control.start()
        if self.proxy is not None:
            try:
                await self.proxy.start()
            except ProxyError:
                self.proxy = None  # (its start cleaned up after itself)
                raise
        if self.config.exporter.enabled:
            exporter = Exporter(self.config.exporter.listen, self.view)
            await exporter.start()  # (a failure leaves nothing open)
            self._exporter = exporter

    async def _close_sockets(self) -> None:
        """The exporter and the front door, then the control socket last: a `stop`
        waiting in `let_go` answers in between (its reply is in flight when the control
        socket closes, which lets it reach its client)."""
        if self._exporter is not None:
            await self._exporter.close()
        if self.proxy is not None:
            await self.proxy.close()
        self._let_go.set()
        await asyncio.sleep(0)  # (the waiting `stop` replies)
        if self._control is not None:
            await self._control.close()

    async def let_go(self) -> None:
        """Until the daemon has closed everything but its control socket."""
        await self._let_go.wait()

    def launch(self, coro: Coroutine[Any, Any, Any], what: str) -> None:
        self._jobs.launch(coro, what)

    # ---- units ------------------------------------------------------------------------

    def _front_door(self) -> FrontProxy | WorkerPool:
        """The proxy in this process, or over `proxy.workers` processes (docs/proxy.md)."""
        workers = self.config.proxy.workers or workers_for(cpus())
        if workers == 1:
            return FrontProxy(self.proxy_settings())
        return WorkerPool(self.proxy_settings(), workers, self.config.log.level,
                          self.config.log.format)

    def _make_unit(self, name: str, cfg: Config) -> EngineUnit:
        lister, sampler = self.gpu_for(cfg.engines[name])
        unit = EngineUnit(
            config=cfg.for_engine(name),
            notifier=UnitNotifier(self, name) if cfg.several else self.notifier,
            gpu=lister, sampler=sampler, clock=self.clock, environ=self.environ, name=name,
            siblings=lambda: self._pids_but(name), front=self.proxy)
        self.units[name] = unit
        if self.proxy is not None:
            self._route_to(name)
        return unit

    def _start_unit(self, name: str) -> None:
        task = asyncio.ensure_future(self.units[name].run())
        self.tasks[name] = task

        def done(t: asyncio.Task[int]) -> None:
            error = None if t.cancelled() else t.exception()
            code = 70 if error is not None or t.cancelled() else t.result()
            self.queue.put_nowait(UnitDone(name, code, error))

        task.add_done_callback(done)

    def _route_to(self, name: str) -> None:
        """The proxy routes this unit's models to its gate."""
        assert self.proxy is not None
        unit = self.units[name]
        e = unit.config.engine
        models = e.served_models()
        self.proxy.add_engine(Backend(name, unit.gate, unit.serving, e.base_url, models,
                                      e.models_open or not models, e.fallback or None,
                                      priority_scheduling=schedules_by_priority(e.args),
                                      generation=lambda: unit.generation))

    def _pids_but(self, name: str) -> set[int]:
        """The processes of every other engine (a shared GPU's expected memory)."""
        pids: set[int] = set()
        for other, unit in self.units.items():
            if other != name:
                pids |= unit.pids()
        return pids

    def handle_unit_done(self, ev: UnitDone) -> None:
        self.tasks.pop(ev.engine, None)
        self.units.pop(ev.engine, None)
        self._settled.pop(ev.engine, None)
        self._statuses.pop(ev.engine, None)
        if self.proxy is not None:
            self.proxy.remove_engine(ev.engine)
        if ev.engine in self.removing:
            self.removing.discard(ev.engine)
            log.info("engine removed", engine=ev.engine)
            self.record("engine_removed", engine=ev.engine)
            return
        self.exit_code = max(self.exit_code, ev.exit_code)
        if ev.error is not None:
            log.critical("an engine unit failed; stopping the daemon", engine=ev.engine,
                         exc_info=ev.error)
            self.exit_code = 70  # EX_SOFTWARE
        if not self.stopping:
            self.begin_stop(f"engine {ev.engine} stopped")

    def begin_stop(self, reason: str, signum: int = signal.SIGTERM) -> None:
        """Every unit stops (drains, takes its engine down); the loop ends with the last.
        With routers, the daemon leaves them first (bounded), so that none sends it a
        request it would refuse; a second stop does not wait for that."""
        first = not self.stopping
        self.stopping = True
        log.info("daemon stopping", reason=reason, engines=list(self.units))
        if first and self.registrar is not None:
            self.launch(self._leave_fleet_then_stop(signum), "leave the routers")
            return
        self._stop_units(signum)

    def _stop_units(self, signum: int) -> None:
        for unit in self.units.values():
            unit.post(SignalReceived(signum))

    # ---- the fleet (supervisor/fleet/registrar.py) ------------------------------------

    def _join_fleet(self) -> None:
        f = self.config.fleet
        if not f.routers or self.proxy is None:
            return
        self.registrar = Registrar(f, f.advertised(self.config.proxy.listen),
                                   self._why_not_in_fleet)
        self.registrar.start()
        log.info("fleet: routers to register with", routers=f.routers,
                 advertise=self.registrar.advertise)

    def _why_not_in_fleet(self) -> str | None:
        """Why routers should not send requests here now (None: they should): what the
        proxy's /health says (docs/fleet.md)."""
        if self.stopping:
            return "the daemon is stopping"
        problems = self.proxy.unhealthy() if self.proxy is not None else ["no proxy"]
        return "; ".join(problems) or None

    async def leave_fleet(self) -> None:
        """Out of every router, within fleet.leave_timeout_s (nothing without routers)."""
        if self.registrar is not None:
            await self.registrar.leave(self.config.fleet.leave_timeout_s)

    async def _leave_fleet_then_stop(self, signum: int) -> None:
        try:
            await self.leave_fleet()
        finally:
            self._stop_units(signum)

    def handle_signal_received(self, ev: SignalReceived) -> None:
        if ev.signum == signal.SIGHUP:
            log.info("reload requested", signal="SIGHUP")
            self.launch(self._job_reload(None), "reload")
        else:
            self.begin_stop(f"{signal.Signals(ev.signum).name} received", ev.signum)

    # ---- sd_notify across units -------------------------------------------------------

    def unit_settled(self, engine: str, status: str) -> None:
        """A unit serves or has given up (its first READY): READY=1 once all have."""
        self._settled[engine] = status
        if not self._ready_sent and set(self._settled) >= set(self.units):
            self._ready_sent = True
            self.notifier.ready(self._summary())

    def unit_status(self, engine: str, status: str) -> bool:
        self._statuses[engine] = status
        return self.notifier.status(self._summary())

    def _summary(self) -> str:
        return "; ".join(f"{n}: {self._statuses.get(n, 'starting')}"
                         for n in self.units)[:400]

    # ---- views ------------------------------------------------------------------------

    def proxy_settings(self) -> ProxySettings:
        """The proxy's shared settings from the current config; each engine's address and
        model names are its backend's, and follow it at each start."""
        p = self.config.proxy
        host, port = parse_listen(p.listen)
        first = next(iter(self.config.engines.values()))
        return ProxySettings(listen_host=host, listen_port=port, upstream=first.base_url,
                             max_body_bytes=p.max_body_bytes,
                             max_header_bytes=p.max_header_bytes,
                             max_connections=p.max_connections,
                             header_timeout_s=p.header_timeout_s,
                             body_timeout_s=p.body_timeout_s,
                             send_timeout_s=p.send_timeout_s,
                             idle_timeout_s=p.idle_timeout_s,
                             max_buffered_bytes=p.max_buffered_bytes,
                             retry_after_s=p.retry_after_s,
                             extra_routes=tuple(p.extra_routes),
                             models=tuple(m for e in self.config.engines.values()
                                          for m in e.served_models()),
                             continuation=p.continue_streams,
                             continue_timeout_s=p.continue_timeout_s,
                             max_continuations=p.max_continuations,
                             stall_timeout_s=p.stall_timeout_s,
                             request_timeout_s=p.request_timeout_s,
                             deadlines=p.deadlines,
                             keepalive_s=p.keepalive_s,
                             refuse_when_unhealthy=bool(self.config.fleet.routers))

    def live(self) -> list[str]:
        """The units whose task still runs (one that ended reads its queue no more)."""
        return [n for n in self.units if n in self.tasks and not self.tasks[n].done()]

    async def view(self) -> ExporterView:
        """For the exporter: each unit answers from its own task (so /healthz fails when
        one is stuck); the proxy's shared counters are added here."""
        names = self.live() or list(self.units)[:1]
        views = await asyncio.gather(*(self.units[n].view() for n in names))
        if isinstance(self.proxy, WorkerPool):
            await self.proxy.refresh()  # (the workers' counters, as of this scrape)
        shared = self._proxy_counters(views)
        fleet = self.registrar.registered() if self.registrar is not None else None
        if not self.config.several:
            return ExporterView(**{**views[0].__dict__, "proxy": shared, "fleet": fleet,
                                   "loop_lag_s": self.loop_lag.max_s(),
                                   "loop_stalls": self.loop_lag.stalls})
        ready = self.proxy.ready() if self.proxy is not None else all(v.ready for v in views)
        worst = next((v.state for v in views if v.state != "RUNNING"), "RUNNING")
        first = views[0]
        return ExporterView(
            state=worst, ready=ready, throttle_level=first.throttle_level,
            restarts_by_reason={}, trips_by_rule={}, actions_by_kind={},
            last_decision_wall=None, policy_paused=False, dry_run=first.dry_run,
            engine_uptime_s=None, gauges=[], proxy=shared, fleet=fleet,
            engines=list(zip(names, views, strict=True)),
            loop_lag_s=self.loop_lag.max_s(), loop_stalls=self.loop_lag.stalls)

    def _proxy_counters(self, views: list[ExporterView]) -> ProxyView | None:
        if self.proxy is None:
            return None
        st, gates = self.proxy.stats, [v.proxy for v in views if v.proxy is not None]
        pool = self.proxy if isinstance(self.proxy, WorkerPool) else None
        return ProxyView(
            responses_by_code=dict(st.responses), rejections_by_reason=dict(st.rejections),
            in_flight=sum(g.in_flight for g in gates), held=sum(g.held for g in gates),
            held_limit=sum(g.held_limit for g in gates),
            kv_breaker_open=any(g.kv_breaker_open for g in gates),
            connect_retries=st.retried_connects, latency=self.proxy.latency.views(),
            continuations=dict(st.continuations), continuation_refusals=dict(st.refusals),
            worker_cpu_s=pool.cpu_s() if pool else {},
            worker_restarts=pool.restarts if pool else None)

    def front_address(self, name: str) -> dict[str, Any]:
        """Where the proxy listens (not a reloaded address it takes at the next daemon
        start) and where it sends engine `name`'s requests now."""
        if self.proxy is None:
            return {}
        b = self.proxy.backends.get(name)
        workers = {"workers": self.proxy.n, "worker_restarts": self.proxy.restarts} \
            if isinstance(self.proxy, WorkerPool) else {}
        return {"listen": f"{self.proxy.s.listen_host}:{self.proxy.port}",
                "upstream": b.upstream if b is not None else None, **workers}

    def daemon_uptime_s(self) -> float:
        return self.clock.monotonic() - self.started_at

    def loop_status(self) -> dict[str, Any]:
        return self.loop_lag.status()

    def summary_line(self, name: str, st: dict[str, Any]) -> dict[str, Any]:
        """One engine in a line of `status`."""
        e = self.config.engines.get(name) or self.units[name].config.engine
        return {"name": name, "state": st["state"], "reason": st["reason"],
                "pid": st["pid"], "restarts": st["restarts"], "uptime_s": st["uptime_s"],
                "port": st["engine"]["port"], "models": list(e.served_models()),
                "fallback": e.fallback or None,
                "serving": self.units[name].serving() if name in self.units else False}

    # ---- control ----------------------------------------------------------------------

    async def submit(self, command: str, args: dict[str, Any]) -> dict[str, Any]:
        """Called by the control server: enqueue the request and wait for its answer."""
        reply: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self.queue.put_nowait(ControlRequest(command, args, reply))
        return await reply

    def handle_control_request(self, ev: ControlRequest) -> None:
        if ev.reply.done():  # the client gave up waiting
            return
        handler = handlers.HANDLERS.get(ev.command)
        try:
            if handler is None:
                raise CommandError(f"unknown command {ev.command!r}")
            handler(self, ev)
        except CommandError as exc:
            ev.reply.set_exception(exc)

    def unit_for(self, command: str, args: dict[str, Any], *,
                 required: bool) -> EngineUnit | None:
        """The unit `--engine` names; with several engines, a command that acts on one
        must name it. None: no name given, and the command means them all."""
        name = args.get("engine")
        if name is None:
            if len(self.units) == 1:
                return next(iter(self.units.values()))
            if required:
                raise CommandError(f"{command}: there are {len(self.units)} engines "
                                   f"({', '.join(self.units)}); name one with --engine")
            return None
        if not isinstance(name, str) or name not in self.units:
            raise CommandError(f"{command}: no engine named {name!r} (engines: "
                               f"{', '.join(self.units)})")
        if name not in self.live():
            raise CommandError(f"{command}: engine {name} has stopped")
        return self.units[name]

    def record(self, event: str, **fields: Any) -> None:
        """One entry of the host's own in the audit trail."""
        err = self.audit.append({"time": iso_time(self.clock.wall()), "event": event, **fields})
        if err is not None:
            log.warning("audit write failed", error=err)

    # ---- reload -----------------------------------------------------------------------

    async def _job_reload(self, reply: asyncio.Future[dict[str, Any]] | None) -> None:
        try:
            new = await asyncio.to_thread(load_config, self.config.source)
        except ConfigError as exc:
            self.queue.put_nowait(HostReloaded(None, str(exc), reply))
            return
        self.queue.put_nowait(HostReloaded(new, None, reply))

    def reload(self, reply: asyncio.Future[dict[str, Any]] | None) -> None:
        self.launch(self._job_reload(reply), "reload")

    def handle_reloaded(self, ev: HostReloaded) -> None:
        if ev.config is None:
            log.warning("reload refused; the running config stays in force", error=ev.error)
            self.record("reload_refused", error=ev.error)
            if ev.reply is not None and not ev.reply.done():
                ev.reply.set_exception(CommandError(f"reload refused: {ev.error}"))
            return
        new, old = ev.config, self.config
        self.config = new
        self.audit = AuditTrail(new.audit.path, new.audit.max_bytes, new.audit.backups)
        replies: dict[str, asyncio.Future[dict[str, Any]]] = {}
        loop = asyncio.get_running_loop()
        for name, unit in self.units.items():
            if name in new.engines and name not in self.removing:
                replies[name] = loop.create_future()
                unit.post(Reloaded(new.for_engine(name), None, replies[name]))
        added = [n for n in new.engines if n not in self.units]
        removed = [n for n in self.units if n not in new.engines and n not in self.removing]
        if self.proxy is not None:
            self.proxy.reconfigure(self.proxy_settings())
            for name, e in new.engines.items():
                self.proxy.set_fallback(name, e.fallback)
        for name in removed:
            log.info("engine removed from the config: draining and stopping it", engine=name)
            self.removing.add(name)
            self.units[name].post(SignalReceived(signal.SIGTERM))
        for name in added:
            log.info("engine added by reload: starting it", engine=name)
            self._make_unit(name, new)
            self._start_unit(name)
            self.record("engine_added", engine=name)
        self.launch(self._job_merge_plans(replies, added, removed, old.several or new.several,
                                          ev.reply), "reload reply")

    async def _job_merge_plans(self, replies: dict[str, asyncio.Future[dict[str, Any]]],
                               added: list[str], removed: list[str], named: bool,
                               reply: asyncio.Future[dict[str, Any]] | None) -> None:
        """The reply to a reload: every unit's plan in one, engine keys named by engine."""
        merged: dict[str, list[str]] = {"changed": [], "applied_now": [],
                                        "next_engine_start": [], "next_daemon_start": []}
        for name, fut in replies.items():
            try:
                plan = await asyncio.wait_for(fut, 10.0)
            except (TimeoutError, CommandError) as exc:
                log.warning("an engine did not take the reload", engine=name, error=str(exc))
                continue
            for when, keys in plan.items():
                for key in keys:
                    if named and key.startswith("engine."):
                        key = f"engines.{name}.{key.removeprefix('engine.')}"
                    if key not in merged[when]:
                        merged[when].append(key)
        for name in [*added, *removed]:
            merged["changed"].append(f"engines.{name}")
            merged["applied_now"].append(f"engines.{name}")
        if reply is not None and not reply.done():
            reply.set_result(merged)
