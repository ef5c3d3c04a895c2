"""One engine's control commands: a function per command, looked up in `COMMANDS`.

The host forwards to a unit the requests that act on one engine
(`supervisor/control/handlers.py`); each runs on the unit's task, with the unit and the
request, and either answers at once or leaves the answer to the step that ends it (a
stop, a KV reset). A refusal is a `CommandError`, whose message goes back to the client.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import structlog

from supervisor.engine import watching
from supervisor.engine.events import CommandError, ControlRequest
from supervisor.engine.states import State

if TYPE_CHECKING:
    from supervisor.engine.unit import EngineUnit

log = structlog.get_logger("supervisor")
Command = Callable[["EngineUnit", ControlRequest], None]


def status(unit: EngineUnit, ev: ControlRequest) -> None:
    ev.reply.set_result(unit.status())


def restart(unit: EngineUnit, ev: ControlRequest) -> None:
    reason = str(ev.args.get("reason") or "restart requested by operator")
    unit._audit("control", command="restart", reason=reason)
    unit._restart(reason)
    unit._count_restart("operator")
    ev.reply.set_result({"state": unit.state.value, "reason": reason})


def stop(unit: EngineUnit, ev: ControlRequest) -> None:
    unit._audit("control", command="stop")
    unit._stop_replies.append(ev.reply)
    unit._begin_stop("stop requested over the control socket")


def drain(unit: EngineUnit, ev: ControlRequest) -> None:
    unit.drained_by_operator = True
    unit.gate.hold("drain requested by operator")
    unit._audit("control", command="drain")
    log.info("drain: new requests are held", in_flight=unit.gate.in_flight)
    ev.reply.set_result({"held": True, "in_flight": unit.gate.in_flight,
                         "waiting": unit.gate.waiting})


def resume(unit: EngineUnit, ev: ControlRequest) -> None:
    unit.drained_by_operator = False
    waiting = unit.gate.waiting
    if unit.state is State.RUNNING and not unit._taking_down:
        unit.gate.release()
    unit._audit("control", command="resume", released=waiting)
    ev.reply.set_result({"held": unit.gate.held_reason is not None,
                         "released": waiting})


def throttle(unit: EngineUnit, ev: ControlRequest) -> None:
    level = 0 if ev.command == "unthrottle" else ev.args.get("level")
    top = len(unit.config.throttle.level_factors)
    if not isinstance(level, int) or isinstance(level, bool) or not 0 <= level <= top:
        raise CommandError(f"throttle: LEVEL must be an integer from 0 to {top}")
    unit._audit("control", command=ev.command, level=level)
    changed = level != unit.throttle_level
    unit.throttle_level = level
    if unit.proxy is not None:
        unit.gate.set_level(level)
    elif changed:  # no proxy: the throttle is a drained relaunch
        unit._restart(f"throttle level {level} requested by operator")
        unit._count_restart("operator")
    ev.reply.set_result({"throttle_level": level, "live": unit.proxy is not None,
                         "max_concurrency": unit.gate.concurrency_limit})


def policy_pause(unit: EngineUnit, ev: ControlRequest) -> None:
    paused = ev.command == "pause-policy"
    changed = paused != unit.policy_paused
    unit.policy_paused = paused
    unit._audit("control", command=ev.command, changed=changed)
    log.info("policy paused" if paused else "policy resumed", changed=changed)
    ev.reply.set_result({"policy_paused": paused, "changed": changed})


def kv_reset(unit: EngineUnit, ev: ControlRequest) -> None:
    why = watching.kv_reset_refusal(unit)
    if why is not None:
        raise CommandError(f"kv-reset refused: {why}")
    unit._audit("control", command="kv-reset")
    unit._remedy_replies.append(ev.reply)  # answered when it ends
    watching.begin_remedy(unit, "kv_reset", "requested by operator")


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
