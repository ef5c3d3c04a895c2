"""The watchdog's half of an engine's unit: the signals kept from the engine's metrics,
the GPU and the canary; the policy evaluated every tick and its decisions carried out;
the in-place remedies and the relaunches it chooses, each audited once when it ends.

Functions of the unit (`supervisor/engine/unit.py`), called on its task: they read and
change the unit's state like its own methods, never from elsewhere. The decisions they
carry out are pure (`supervisor/watchdog/policy.py`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import structlog

from supervisor.engine import process as eng
from supervisor.engine.events import (
    CanaryDone,
    DecisionRecord,
    GpuSampled,
    MetricsSampled,
    RemedyDone,
    SleepModeProbed,
)
from supervisor.engine.states import State
from supervisor.watchdog import relaunch, xid
from supervisor.watchdog.policy import EngineFacts, PolicyState, decide
from supervisor.watchdog.signals import Signals

if TYPE_CHECKING:
    from supervisor.engine.unit import EngineUnit

log = structlog.get_logger("supervisor")


@dataclass
class Relaunch:
    """A relaunch the policy chose (a restart rung, a reduced batch, a hang's restart,
    a failed in-place remedy's fallback): one `remedy` audit entry once the new engine
    serves again, or once it cannot. Marks are monotonic times."""

    rung: str
    reason: str
    started: float
    taken_down_at: float | None = None  # the take-down began (the drain ended)
    down_at: float | None = None  # the old tree was proven gone
    starts: int = 0  # engine starts it took (a failed boot backs off and tries again)

    def steps(self, now: float) -> dict[str, float]:
        marks = [("drain", self.taken_down_at), ("take_down", self.down_at), ("start", now)]
        out: dict[str, float] = {}
        last = self.started
        for name, at in marks:
            if at is None:
                break
            out[name] = round(at - last, 3)
            last = at
        return out


def on_metrics(unit: EngineUnit, ev: MetricsSampled) -> None:
    if unit.engine is None or unit.engine.generation != ev.generation:
        return
    if ev.snapshot is None:
        if unit.scrapes.failed():  # logged once per streak, counted always
            log.warning("metrics scrape failed", error=ev.error, pid=unit.engine.pid)
        return
    now = unit.clock.monotonic()
    ended = unit.scrapes.succeeded(ev.snapshot, now)
    # the requests the daemon knows are at the engine: a stopped core's own gauges
    # freeze at their last value, which may say idle
    at_engine = unit.gate.in_flight + unit._probes_in_flight
    unit.window.add_metrics(now, ev.snapshot, at_engine)
    unit.gate.set_kv_usage(ev.snapshot.kv_cache_usage)
    if ended:
        log.info("metrics scrape recovered", failed_scrapes=ended, pid=unit.engine.pid)


def signals(unit: EngineUnit, now: float) -> Signals:
    """The watchdog's signals now, under the names used in config, logs, status and
    the exporter. None means unknown."""
    at = unit.scrapes.last_at
    e = unit.engine
    up = now - e.healthy_at if e is not None and e.healthy_at is not None else None
    return unit.window.compute(
        now, metrics_age_s=round(now - at, 3) if at is not None else None,
        staleness_s=round(unit.scrapes.staleness_s(now), 3),
        scrape_failures_total=unit.scrapes.failures_total, engine_uptime_s=up)


def engine_view(unit: EngineUnit) -> EngineFacts:
    env = eng.build_spawn_spec(unit.config.engine, unit.environ).env
    return EngineFacts(
        state=unit.state.value, generation=unit.generation,
        throttle_level=unit.throttle_level,
        max_throttle_level=len(unit.config.throttle.level_factors),
        batch_reduced=unit.batch_reduced, spec_tokens=unit.spec_tokens,
        spec_tokens_max=(unit.config.policy.spec_tokens_max
                         or relaunch.spec_tokens(unit.config.engine.args) or 0),
        can_reset_prefix_cache=env.get("VLLM_SERVER_DEV_MODE") == "1",
        # sleep and wake behind a hold of new requests: the proxy must be there to hold
        can_kv_reset=unit.sleep_mode and unit.proxy is not None,
        # with the proxy, throttling is admission control; without it, a relaunch
        live_throttle=unit.proxy is not None)


def evaluate_policy(unit: EngineUnit, now: float) -> None:
    state = PolicyState(engine_view(unit), unit.policy_memory, unit.policy_paused)
    d = decide(signals(unit, now), state, unit.config.policy, now)
    unit.policy_memory = d.memory
    if d.held_back is not None:
        log.info("policy action held back", rule=d.rule, held_back=d.held_back,
                 reason=d.reason, evidence=dict(d.evidence))
        unit._audit("decision_held_back", rule=d.rule, held_back=d.held_back,
                    reason=d.reason, evidence=dict(d.evidence))
    if d.action == "none":
        return
    assert d.rule is not None
    # One canonical line and one audit entry per decision.
    fields: dict[str, Any] = {"rule": d.rule, "action": d.action, "reason": d.reason,
                              "evidence": dict(d.evidence), "dry_run": d.dry_run,
                              "throttle_level": d.throttle_level}
    log.warning("policy decision", **fields)
    unit._audit("decision", **fields)
    unit.trips_by_rule[d.rule] = unit.trips_by_rule.get(d.rule, 0) + 1
    unit.last_decision = unit.last_policy_decision = DecisionRecord(
        d.action, d.reason, unit.clock.wall(), d.rule, dict(d.evidence), d.dry_run)
    if d.dry_run:
        return
    unit.actions_by_kind[d.action] = unit.actions_by_kind.get(d.action, 0) + 1
    reason = f"policy {d.rule}: {d.action} ({d.reason})"
    if d.action == "alert":
        log.error("policy alert", rule=d.rule, reason=d.reason)
        _audit_remedy(unit, {"rung": "alert", "outcome": "alerted", "duration_s": 0.0,
                            "rule": d.rule})
    elif d.action == "hold_down":
        _want_evidence(unit, d.rule, reason)
        codes = [f"XID {c} ({xid.describe(c).name})" for c in unit.window.xids]
        why = f"{reason}: {', '.join(codes) or 'GPU error'}; the GPU needs a reset or a " \
              "reboot, so the engine stays down until `vllm-supervisorctl restart`"
        unit._give_up(why)
        if unit.engine is not None and not unit._taking_down:
            unit._take_down(graceful=True)
    elif d.action in ("reset_prefix_cache", "kv_reset"):
        if unit.engine is not None and unit.remedy_running is None:
            begin_remedy(unit, d.action, reason)
    else:
        # throttle and lift at the proxy, or a relaunch: restart, restart_now, and
        # every relaunch with new arguments
        unit.throttle_level = d.throttle_level
        unit.batch_reduced = d.batch_reduced
        unit.spec_tokens = d.spec_tokens
        unit.gate.set_level(unit.throttle_level if unit.proxy is not None else 0)
        if d.restarts_engine:
            unit._count_restart("policy")
            if d.action != "lift":  # (restoring settings is not a remedy)
                begin_relaunch(unit, d.action, reason)
                _want_evidence(unit, d.rule, reason)
            unit._restart(reason, graceful=d.action != "restart_now")
        elif d.action == "throttle":
            # live at the proxy: in force at once
            _audit_remedy(unit, {"rung": "throttle", "outcome": "ok", "duration_s": 0.0,
                                "rule": d.rule, "throttle_level": unit.throttle_level,
                                "max_concurrency": unit.gate.concurrency_limit})


def _want_evidence(unit: EngineUnit, rule: str, reason: str) -> None:
    """The engine's next take-down captures evidence first, if the rule is one of
    evidence.rules (a hang, no progress, an XID by default)."""
    if rule in unit.config.evidence.rules:
        unit._evidence_for = (rule, reason)


def on_sleep_mode_probed(unit: EngineUnit, ev: SleepModeProbed) -> None:
    if unit.engine is None or unit.engine.generation != ev.generation:
        return
    unit.sleep_mode, unit.sleep_mode_why = ev.available, ev.why
    if ev.available:
        log.info("the engine can drop its KV cache in place (sleep and wake)")
    else:
        log.info("no KV reset in place for this engine", reason=ev.why)


def kv_reset_refusal(unit: EngineUnit) -> str | None:
    if unit.state is not State.RUNNING or unit.engine is None or unit._taking_down:
        return f"the engine is not serving (state {unit.state.value})"
    if unit.remedy_running is not None:
        return f"a {unit.remedy_running[0]} is already in progress"
    if not unit.sleep_mode:
        return f"this engine cannot drop its KV cache in place: {unit.sleep_mode_why}"
    return None


def begin_remedy(unit: EngineUnit, rung: str, reason: str) -> None:
    engine = unit.engine
    assert engine is not None
    unit.remedy_running = (rung, unit.clock.monotonic())
    log.info("remedy started", rung=rung, reason=reason, in_flight=unit.gate.in_flight)
    if rung == "kv_reset":
        # new requests wait at the proxy; those at the engine finish first
        unit.gate.hold(f"KV reset in progress ({reason})")
    unit.act.remedy(engine, rung)


def _audit_remedy(unit: EngineUnit, fields: dict[str, Any]) -> None:
    """Every rung tried ends in one `remedy` audit entry and one log line: rung,
    outcome, duration."""
    unit._audit("remedy", **fields)
    (log.info if fields["outcome"] in ("ok", "alerted") else log.warning)(
        "remedy ended", **fields)


def begin_relaunch(unit: EngineUnit, rung: str, reason: str) -> None:
    # one entry per rung tried: a relaunch still waiting for its engine ends here
    finish_relaunch(unit, "superseded", f"superseded by {rung}: {reason}")
    unit._relaunch = Relaunch(rung, reason, unit.clock.monotonic())


def finish_relaunch(unit: EngineUnit, outcome: str, error: str | None) -> None:
    r = unit._relaunch
    if r is None:
        return
    unit._relaunch = None
    now = unit.clock.monotonic()
    _audit_remedy(unit, {
        "rung": r.rung, "outcome": outcome, "duration_s": round(now - r.started, 3),
        "steps_s": r.steps(now), "error": error, "starts": r.starts,
        "held": unit.gate.waiting if unit.proxy is not None else None,
        "reason": r.reason})


def on_remedy_done(unit: EngineUnit, ev: RemedyDone) -> None:
    unit.remedy_running = None
    unit._remedy_ended_at = unit.clock.monotonic()
    o = ev.outcome
    outcome = "ok" if o.ok else ("not attempted" if not o.attempted else "failed")
    fields: dict[str, Any] = {
        "rung": ev.rung, "outcome": outcome, "duration_s": round(ev.duration_s, 3),
        "steps_s": {k: round(v, 3) for k, v in o.steps.items()}, "error": o.error,
        "held": unit.gate.waiting if ev.rung == "kv_reset" else None}
    _audit_remedy(unit, fields)
    for reply in unit._remedy_replies:
        if not reply.done():
            reply.set_result(fields)
    unit._remedy_replies.clear()
    current = (unit.engine is not None and unit.engine.generation == ev.generation
               and unit.state is State.RUNNING and not unit._taking_down)
    if not current:
        return  # the engine went meanwhile: its restart holds and releases requests
    if o.ok or not o.attempted:
        if ev.rung == "kv_reset" and not unit.drained_by_operator:
            waiting = unit.gate.waiting
            unit.gate.release()
            if waiting:
                unit._audit("released", count=waiting)
        return
    # The engine refused or failed its remedy (it may even be asleep): a drained
    # restart instead; new requests stay held through it.
    unit._count_restart("policy")
    why = f"{ev.rung} failed ({o.error}): restarting instead"
    begin_relaunch(unit, "restart", why)
    unit._evidence_for = (f"{ev.rung}_failed", why)
    unit._restart(why)


def on_canary_done(unit: EngineUnit, ev: CanaryDone) -> None:
    if (unit.engine is None or unit.engine.generation != ev.generation
            or unit.state is not State.RUNNING or unit._taking_down):
        return  # a draining engine refuses work on purpose: not the canary's business
    if unit.remedy_running is not None or ev.started <= unit._remedy_ended_at:
        return  # an engine asleep for a KV reset does not answer: not a hang
    o = ev.outcome
    # A canary that timed out behind a queue while tokens kept flowing is slow, not
    # hung: only a failure with no progress counts towards the hang rule.
    counted = not o.ok and not unit.window.progressed_between(ev.started, ev.ended)
    before = unit.window.canary_failures
    unit.window.add_canary(o.ok, o.latency_s if o.ok else None, counted)
    if not o.ok:
        log.warning("canary failed", error=o.error, latency_s=round(o.latency_s, 3),
                    counted=counted, consecutive=unit.window.canary_failures,
                    pid=unit.engine.pid)
    elif before:
        log.info("canary passed again", latency_s=round(o.latency_s, 3),
                 failures_before=before)


def on_gpu_sampled(unit: EngineUnit, ev: GpuSampled) -> None:
    r = ev.reading
    if r.errors and not unit._gpu_errors_logged:
        log.warning("GPU readings incomplete; retrying each period", errors=list(r.errors))
    elif not r.errors and unit._gpu_errors_logged:
        log.info("GPU readings complete again")
    unit._gpu_errors_logged = bool(r.errors)
    pids = [p.pid for p in unit.engine.known] if unit.engine is not None else []
    remedies = {c: xid.describe(c).remedy for c in r.xids}
    for code in r.xids:
        x = xid.describe(code)
        log.error("GPU XID event", xid=code, name=x.name, remedy=x.remedy)
        unit._audit("xid", xid=code, name=x.name, remedy=x.remedy)
    unit.window.add_gpu(ev.at, r, pids, remedies)
