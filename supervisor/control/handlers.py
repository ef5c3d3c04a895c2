"""The control commands: one function per command, looked up in `HANDLERS`.

Each runs on the host's task with the host, seen through `HostControl` (what a command
may ask of it), and the request (`ControlRequest`: command, args, reply); it must not
block: it answers at once, forwards the request to an engine unit's queue
(which answers it), or starts a job that answers it later. `--engine NAME` arrives as
`args["engine"]`; with several engines, a command that acts on one engine requires it.
A refusal is a `CommandError`, whose message goes back to the client.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Mapping
from pathlib import Path
from typing import Any, Protocol

from supervisor.engine.events import CommandError, ControlRequest
from supervisor.engine.unit import EngineUnit
from supervisor.ops.audit import AuditTrail
from supervisor.settings.config import Config
from supervisor.watchdog import evidence


class HostControl(Protocol):
    """What the commands see of the host (`supervisor/host.py`)."""

    stopping: bool

    @property
    def config(self) -> Config: ...
    @property
    def audit(self) -> AuditTrail: ...
    @property
    def units(self) -> Mapping[str, EngineUnit]: ...

    def unit_for(self, command: str, args: dict[str, Any], *,
                 required: bool) -> EngineUnit | None: ...
    def live(self) -> list[str]: ...
    def launch(self, coro: Coroutine[Any, Any, Any], what: str) -> None: ...
    async def leave_fleet(self) -> None: ...
    async def let_go(self) -> None: ...
    def summary_line(self, name: str, st: dict[str, Any]) -> dict[str, Any]: ...
    def front_address(self, name: str) -> dict[str, Any]: ...
    def daemon_uptime_s(self) -> float: ...
    def loop_status(self) -> dict[str, Any]: ...
    def record(self, event: str, **fields: Any) -> None: ...
    def reload(self, reply: asyncio.Future[dict[str, Any]] | None) -> None: ...


Handler = Callable[[HostControl, ControlRequest], None]


def _forward(host: HostControl, req: ControlRequest) -> None:
    """A command that acts on one engine: its unit answers."""
    unit = host.unit_for(req.command, req.args, required=True)
    assert unit is not None
    args = {k: v for k, v in req.args.items() if k != "engine"}
    unit.post(ControlRequest(req.command, args, req.reply))


def status(host: HostControl, req: ControlRequest) -> None:
    unit = host.unit_for("status", req.args, required=False)
    names = [unit.name] if unit is not None and "engine" in req.args else host.live()
    host.launch(_status(host, names, req.reply), "status")


async def _status(host: HostControl, names: list[str],
                  reply: asyncio.Future[dict[str, Any]]) -> None:
    # (bounded: a unit that ends meanwhile answers no more)
    statuses = await asyncio.gather(
        *(asyncio.wait_for(host.units[n].submit("status", {}), 10.0) for n in names),
        return_exceptions=True)
    detail = {n: s for n, s in zip(names, statuses, strict=True) if isinstance(s, dict)}
    for n, s in detail.items():  # (the proxy is the host's: where it listens, sends)
        if s.get("admission") is not None:
            s["admission"] = {**host.front_address(n), **s["admission"]}
    lines = [host.summary_line(n, s) for n, s in detail.items()]
    if len(names) == 1 and names[0] in detail:  # one engine: its status, as it always was
        result = {**detail[names[0]], "engine_name": names[0], "engines": lines,
                  "loop": host.loop_status()}
    else:
        first = next(iter(detail.values()), {})
        result = {"engines": lines, "detail": detail,
                  "daemon_pid": first.get("daemon_pid"),
                  "daemon_uptime_s": round(host.daemon_uptime_s(), 3),
                  "config": host.config.source, "loop": host.loop_status()}
    if not reply.done():
        reply.set_result(result)


def stop(host: HostControl, req: ControlRequest) -> None:
    if "engine" in req.args:
        raise CommandError("stop: stops the daemon and every engine; to stop one engine, "
                           "remove its [engines.NAME] table and reload")
    host.stopping = True
    host.launch(_stop(host, req.reply), "stop")


async def _stop(host: HostControl, reply: asyncio.Future[dict[str, Any]]) -> None:
    """Out of the routers first (bounded), then every engine stops; the answer once the
    daemon has let go of everything but the control socket (its engines' folders, the
    front door's and the exporter's ports), so that a daemon started right after it finds
    them free."""
    await host.leave_fleet()
    loop = asyncio.get_running_loop()
    futures = []
    for name in host.live():
        fut: asyncio.Future[dict[str, Any]] = loop.create_future()
        host.units[name].post(ControlRequest("stop", {}, fut))
        futures.append(fut)
    results = await asyncio.gather(*futures, return_exceptions=True)
    codes = [r.get("exit_code", 0) if isinstance(r, dict) else 70 for r in results]
    await host.let_go()
    if not reply.done():
        reply.set_result({"state": "STOPPED", "exit_code": max(codes, default=0)})


def reload(host: HostControl, req: ControlRequest) -> None:
    host.record("control", command="reload")
    host.reload(req.reply)


def events(host: HostControl, req: ControlRequest) -> None:
    n = req.args.get("n", 20)
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= 10000:
        raise CommandError("events: n must be an integer from 1 to 10000")
    name = req.args.get("engine")
    if name is not None:
        host.unit_for("events", req.args, required=True)  # (a known name)
    host.launch(_events(host, n, name, req.reply), "events")


async def _events(host: HostControl, n: int, engine: str | None,
                  reply: asyncio.Future[dict[str, Any]]) -> None:
    def read() -> list[dict[str, Any]]:
        if engine is None:
            return host.audit.tail(n)
        # an engine's entries name it (with several engines); the host's name none
        return [r for r in host.audit.tail(max(n * 8, 200))
                if r.get("engine", engine) == engine][-n:]

    records = await asyncio.to_thread(read)
    if not reply.done():
        reply.set_result({"events": records})


def list_evidence(host: HostControl, req: ControlRequest) -> None:
    host.launch(_evidence(host.config.evidence.dir, req.reply), "evidence")


async def _evidence(where: str, reply: asyncio.Future[dict[str, Any]]) -> None:
    bundles = await asyncio.to_thread(evidence.list_bundles, Path(where))
    if not reply.done():
        reply.set_result({"dir": where, "bundles": bundles})


HANDLERS: dict[str, Handler] = {
    "status": status,
    "stop": stop,
    "reload": reload,
    "events": events,
    "evidence": list_evidence,
    # acting on one engine: forwarded to its unit
    **dict.fromkeys(("restart", "drain", "resume", "throttle", "unthrottle",
                     "pause-policy", "resume-policy", "kv-reset", "rearm"), _forward),
}
