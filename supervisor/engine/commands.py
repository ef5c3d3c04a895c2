"""One engine's control commands: a function per command, looked up in `COMMANDS`, and
the reload of its config.

The host forwards to a unit the requests that act on one engine
(`supervisor/control/handlers.py`), and each reloaded config (`reloaded`); each runs on
the unit's task with the unit, seen through `Commandable` (what a command may ask of
it), and the request. A command acts through the unit's public steps (a restart, a stop,
a remedy, the gate following the state) and the settings it names (the operator's hold,
the throttle level), and either answers at once or leaves the answer to the step that
ends it (a stop, a KV reset). A refusal is a `CommandError`, whose message goes back to
the client. A command never changes the unit's own state but through those steps.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, Protocol

import structlog

from supervisor.engine.events import CommandError, ControlRequest, Reloaded
from supervisor.engine.gatekeeper import GateKeeper
from supervisor.engine.steps import Step, Upgrade
from supervisor.engine.watch import EngineWatch, UnitFacts
from supervisor.front.admission import Gate
from supervisor.settings import reload
from supervisor.settings.config import Config, diff_keys

log = structlog.get_logger("supervisor")


class Commandable(Protocol):
    """What the commands see of an engine's unit (`supervisor/engine/unit.py`)."""

    @property
    def config(self) -> Config: ...
    @property
    def gate(self) -> Gate: ...
    @property
    def keeper(self) -> GateKeeper: ...
    @property
    def fronted(self) -> bool: ...
    @property
    def watch(self) -> EngineWatch: ...
    @property
    def state_value(self) -> str: ...

    def status(self) -> dict[str, Any]: ...
    def facts(self) -> UnitFacts: ...
    def audit(self, event: str, **fields: Any) -> None: ...
    def restart_engine(self, reason: str, graceful: bool = True) -> None: ...
    def count_restart(self, reason: str) -> None: ...
    def begin_stop(self, reason: str,
                   reply: asyncio.Future[dict[str, Any]] | None = None) -> None: ...
    def sync_gate(self) -> None: ...
    def reconfigure(self, new: Config) -> None: ...
    def run_steps(self, steps: list[Step]) -> None: ...
    def rearm(self, reason: str) -> str: ...
    def begin_remedy(self, rung: str, reason: str,
                     reply: asyncio.Future[dict[str, Any]] | None = None) -> None: ...


Command = Callable[[Commandable, ControlRequest], None]


def run(unit: Commandable, ev: ControlRequest) -> None:
    """One request, by its command; a refusal is its answer."""
    if ev.reply.done():  # the client gave up waiting
        return
    command = COMMANDS.get(ev.command)
    try:
        if command is None:
            raise CommandError(f"unknown command {ev.command!r}")
        command(unit, ev)
    except CommandError as exc:
        ev.reply.set_exception(exc)


def status(unit: Commandable, ev: ControlRequest) -> None:
    ev.reply.set_result(unit.status())


def operator_restart(unit: Commandable, reason: str) -> None:
    """An operator's restart (a throttle without a proxy is one too)."""
    unit.restart_engine(reason)
    unit.count_restart("operator")


def restart(unit: Commandable, ev: ControlRequest) -> None:
    reason = str(ev.args.get("reason") or "restart requested by operator")
    unit.audit("control", command="restart", reason=reason)
    operator_restart(unit, reason)
    ev.reply.set_result({"state": unit.state_value, "reason": reason})


def stop(unit: Commandable, ev: ControlRequest) -> None:
    unit.audit("control", command="stop")
    unit.begin_stop("stop requested over the control socket", ev.reply)  # answered stopped


def hold(unit: Commandable, held: bool) -> int:
    """The operator holds (or lets go) new requests; how many wait now."""
    unit.keeper.drained_by_operator = held
    waiting = unit.gate.waiting
    unit.sync_gate()
    return waiting


def drain(unit: Commandable, ev: ControlRequest) -> None:
    hold(unit, True)
    unit.audit("control", command="drain")
    log.info("drain: new requests are held", in_flight=unit.gate.in_flight)
    ev.reply.set_result({"held": True, "in_flight": unit.gate.in_flight,
                         "waiting": unit.gate.waiting})


def resume(unit: Commandable, ev: ControlRequest) -> None:
    waiting = hold(unit, False)
    unit.audit("control", command="resume", released=waiting)
    ev.reply.set_result({"held": unit.gate.held_reason is not None, "released": waiting})


def throttle(unit: Commandable, ev: ControlRequest) -> None:
    """The operator's throttle level: live at the proxy, else a drained relaunch."""
    level = 0 if ev.command == "unthrottle" else ev.args.get("level")
    top = len(unit.config.throttle.level_factors)
    if not isinstance(level, int) or isinstance(level, bool) or not 0 <= level <= top:
        raise CommandError(f"throttle: LEVEL must be an integer from 0 to {top}")
    unit.audit("control", command=ev.command, level=level)
    if unit.watch.set_throttle(level) and not unit.fronted:
        operator_restart(unit, f"throttle level {level} requested by operator")
    unit.sync_gate()
    ev.reply.set_result({"throttle_level": level, "live": unit.fronted,
                         "max_concurrency": unit.gate.concurrency_limit})


def policy_pause(unit: Commandable, ev: ControlRequest) -> None:
    paused = ev.command == "pause-policy"
    changed = unit.watch.pause(paused)
    unit.audit("control", command=ev.command, changed=changed)
    log.info("policy paused" if paused else "policy resumed", changed=changed)
    ev.reply.set_result({"policy_paused": paused, "changed": changed})


def kv_reset(unit: Commandable, ev: ControlRequest) -> None:
    why = unit.watch.kv_reset_refusal(unit.facts())
    if why is not None:
        raise CommandError(f"kv-reset refused: {why}")
    unit.audit("control", command="kv-reset")
    unit.begin_remedy("kv_reset", "requested by operator", ev.reply)  # answered at its end


def rearm(unit: Commandable, ev: ControlRequest) -> None:
    try:
        what = unit.rearm("requested by operator")
    except ValueError as exc:
        raise CommandError(f"rearm refused: {exc}") from exc
    unit.audit("control", command="rearm")
    ev.reply.set_result({"rearm": what, "state": unit.state_value})


COMMANDS: dict[str, Command] = {
    "status": status,
    "restart": restart,
    "stop": stop,
    "drain": drain,
    "resume": resume,
    "throttle": throttle,
    "unthrottle": throttle,
    "pause-policy": policy_pause,
    "resume-policy": policy_pause,
    "kv-reset": kv_reset,
    "rearm": rearm,
}


def reloaded(unit: Commandable, ev: Reloaded) -> None:
    """A reloaded config (the host's), as this engine takes it: what applies now is put in
    force by the unit (`reconfigure`), an engine setting at the next start (through a
    standby now, when there is one), the rest when the daemon restarts
    (`supervisor/settings/reload.py` says which key applies when)."""
    if ev.config is None:
        log.warning("reload refused; the running config stays in force", error=ev.error)
        unit.audit("reload_refused", error=ev.error)
        if ev.reply is not None and not ev.reply.done():
            ev.reply.set_exception(CommandError(f"reload refused: {ev.error}"))
        return
    plan = reload.plan(diff_keys(unit.config, ev.config))
    unit.reconfigure(ev.config)
    log.info("config reloaded", **plan.as_dict())
    if plan.next_engine_start:
        log.info("engine settings take effect at the next start",
                 keys=list(plan.next_engine_start))
        # (through a standby with the new arguments when one can begin, else nothing
        # more: they apply at the next start)
        unit.run_steps([Upgrade(f"reloaded {', '.join(plan.next_engine_start)}",
                                "upgrade", ())])
    if plan.next_daemon_start:
        log.warning("these settings take effect only when the daemon restarts",
                    keys=list(plan.next_daemon_start))
    unit.audit("reload", **plan.as_dict())
    if ev.reply is not None and not ev.reply.done():
        ev.reply.set_result(plan.as_dict())
