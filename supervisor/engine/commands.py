"""One engine's control commands: a function per command, looked up in `COMMANDS`.

The host forwards to a unit the requests that act on one engine
(`supervisor/control/handlers.py`); each runs on the unit's task with the unit, seen
through `Commandable` (what a command may ask of it), and the request; it either
answers at once or leaves the answer to the step that ends it (a stop, a KV reset). A
refusal is a `CommandError`, whose message goes back to the client.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, Protocol

import structlog

from supervisor.config import Config
from supervisor.engine.events import CommandError, ControlRequest
from supervisor.front.admission import Gate

log = structlog.get_logger("supervisor")


class Watch(Protocol):
    @property
    def paused(self) -> bool: ...

    def pause(self, paused: bool) -> bool: ...


class Commandable(Protocol):
    """What the commands see of an engine's unit (`supervisor/engine/unit.py`)."""

    @property
    def config(self) -> Config: ...

    @property
    def gate(self) -> Gate: ...

    @property
    def fronted(self) -> bool: ...

    @property
    def watch(self) -> Watch: ...

    def status(self) -> dict[str, Any]: ...

    def audit(self, event: str, **fields: Any) -> None: ...

    def restart(self, reason: str) -> None: ...

    def stop(self, reply: asyncio.Future[dict[str, Any]]) -> None: ...

    def drain(self, held: bool) -> int: ...

    def set_throttle(self, level: int) -> bool: ...

    def kv_reset(self, reply: asyncio.Future[dict[str, Any]], reason: str) -> None: ...

    @property
    def state_value(self) -> str: ...


Command = Callable[[Commandable, ControlRequest], None]


def status(unit: Commandable, ev: ControlRequest) -> None:
    ev.reply.set_result(unit.status())


def restart(unit: Commandable, ev: ControlRequest) -> None:
    reason = str(ev.args.get("reason") or "restart requested by operator")
    unit.audit("control", command="restart", reason=reason)
    unit.restart(reason)
    ev.reply.set_result({"state": unit.state_value, "reason": reason})


def stop(unit: Commandable, ev: ControlRequest) -> None:
    unit.audit("control", command="stop")
    unit.stop(ev.reply)


def drain(unit: Commandable, ev: ControlRequest) -> None:
    unit.drain(True)
    unit.audit("control", command="drain")
    log.info("drain: new requests are held", in_flight=unit.gate.in_flight)
    ev.reply.set_result({"held": True, "in_flight": unit.gate.in_flight,
                         "waiting": unit.gate.waiting})


def resume(unit: Commandable, ev: ControlRequest) -> None:
    waiting = unit.drain(False)
    unit.audit("control", command="resume", released=waiting)
    ev.reply.set_result({"held": unit.gate.held_reason is not None, "released": waiting})


def throttle(unit: Commandable, ev: ControlRequest) -> None:
    level = 0 if ev.command == "unthrottle" else ev.args.get("level")
    top = len(unit.config.throttle.level_factors)
    if not isinstance(level, int) or isinstance(level, bool) or not 0 <= level <= top:
        raise CommandError(f"throttle: LEVEL must be an integer from 0 to {top}")
    unit.audit("control", command=ev.command, level=level)
    unit.set_throttle(level)
    ev.reply.set_result({"throttle_level": level, "live": unit.fronted,
                         "max_concurrency": unit.gate.concurrency_limit})


def policy_pause(unit: Commandable, ev: ControlRequest) -> None:
    paused = ev.command == "pause-policy"
    changed = unit.watch.pause(paused)
    unit.audit("control", command=ev.command, changed=changed)
    log.info("policy paused" if paused else "policy resumed", changed=changed)
    ev.reply.set_result({"policy_paused": paused, "changed": changed})


def kv_reset(unit: Commandable, ev: ControlRequest) -> None:
    unit.kv_reset(ev.reply, "requested by operator")  # answered when it ends


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
}
